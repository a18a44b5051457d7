//! Leader election between hub replicas: a coordination.k8s.io Lease decides which one
//! reconciles, writes status and serves proxies. The others stand by (ready, serving the
//! admission webhook) and take over when the Lease is released or expires.
//!
//! The leader also labels its own Pod `hub.kmm.sigs.x-k8s.io/role=leader`: the proxies'
//! Service selects on it, so spoke proxies only ever reach the replica that serves them.
//!
//! The lease library keeps retrying a renewal that fails and never reports a loss, so a
//! leader cut from its apiserver would keep leading after a standby took over. The
//! leader therefore watches its own renewals: when none is seen by the renew deadline
//! (two thirds of the lease duration after the last one, which is before any standby may
//! take the expired Lease), it counts as lost and the hub stops serving, writing and
//! building.

use std::collections::BTreeMap;
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{ListParams, Patch, PatchParams};
use kube::runtime::watcher;
use kube::{Api, Client};
use kube_lease_manager::{LeaseManagerBuilder, LeaseManagerError};
use serde_json::json;
use thiserror::Error;
use tokio::sync::watch;
use tokio::time::Instant;

/// Label on hub Pods naming their current role.
pub const ROLE_LABEL: &str = "hub.kmm.sigs.x-k8s.io/role";

/// How replicas elect their leader.
#[derive(Clone, Debug)]
pub struct LeaderElection {
    /// Name of the Lease in the hub's namespace.
    pub lease: String,
    /// This replica's identity in the Lease (its Pod name).
    pub identity: String,
    /// How long a Lease holds without renewal; a standby takes over after it.
    pub duration: Duration,
    /// How long before expiry the leader renews.
    pub renew_before: Duration,
    /// This replica's Pod, labelled with its role (`None` outside a Pod).
    pub pod: Option<String>,
}

#[derive(Debug, Error)]
pub enum LeadershipError {
    #[error("leader election on Lease {lease}: {source}")]
    Lease {
        lease: String,
        source: LeaseManagerError,
    },
    #[error("labelling Pod {pod} as {role}: {source}")]
    Label {
        pod: String,
        role: &'static str,
        source: kube::Error,
    },
}

/// A running election: `is_leader` follows this replica's hold on the Lease.
#[derive(Debug)]
pub struct Election {
    is_leader: watch::Receiver<bool>,
    task: tokio::task::JoinHandle<Result<kube_lease_manager::LeaseManager, LeaseManagerError>>,
    pod: Option<PodRole>,
    /// When this replica's last renewal was seen, once it leads.
    renewals: Option<RenewalWatch>,
    lease: Api<Lease>,
    settings: LeaderElection,
}

/// This replica's renewals of the Lease as a watch sees them.
#[derive(Debug)]
struct RenewalWatch {
    seen: watch::Receiver<Instant>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for RenewalWatch {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// How long a leader may go without a renewal seen before it stops: two thirds of the
/// lease duration. Renewals come every third of it, so two may fail in a row; a standby
/// takes the Lease only a full duration after the last renewal.
pub fn renew_deadline(duration: Duration) -> Duration {
    duration * 2 / 3
}

/// The field manager a replica claims the Lease as. Server-side apply refuses a claim
/// only when another manager owns the holder: with one name for all replicas, two that
/// found the Lease free at once would both win it.
fn field_manager(identity: &str) -> String {
    format!("kmm-hub/{identity}")
}

/// Resolves once no renewal was seen for `deadline`: each renewal moves the deadline on.
pub async fn renewals_stop(mut seen: watch::Receiver<Instant>, deadline: Duration) {
    loop {
        let last = *seen.borrow_and_update();
        tokio::select! {
            () = tokio::time::sleep_until(last + deadline) => return,
            changed = seen.changed() => {
                if changed.is_err() {
                    // No watch any more: nothing will move the deadline on.
                    tokio::time::sleep_until(last + deadline).await;
                    return;
                }
            }
        }
    }
}

impl Election {
    /// Joins the election, as standby until the Lease is won.
    pub async fn join(
        client: &Client,
        namespace: &str,
        settings: &LeaderElection,
    ) -> Result<Self, LeadershipError> {
        let pod = settings.pod.as_ref().map(|name| PodRole {
            api: Api::namespaced(client.clone(), namespace),
            name: name.clone(),
        });
        if let Some(pod) = &pod {
            // A restarted container's Pod may still say leader.
            pod.set("standby").await?;
        }
        let manager = LeaseManagerBuilder::new(client.clone(), &settings.lease)
            .with_namespace(namespace)
            .with_identity(&settings.identity)
            .with_duration(settings.duration.as_secs().max(1))
            .with_grace(settings.renew_before.as_secs().max(1))
            .with_field_manager(field_manager(&settings.identity))
            .build()
            .await
            .map_err(|source| LeadershipError::Lease {
                lease: settings.lease.clone(),
                source,
            })?;
        let (is_leader, task) = manager.watch().await;
        Ok(Self {
            is_leader,
            task,
            pod,
            renewals: None,
            lease: Api::namespaced(client.clone(), namespace),
            settings: settings.clone(),
        })
    }

    /// Waits until this replica leads; labels its Pod leader and starts watching its
    /// renewals.
    pub async fn won(&mut self) -> Result<(), LeadershipError> {
        // A closed channel means the manager ended; `lost` reports why.
        let _ = self.is_leader.wait_for(|leads| *leads).await;
        self.renewals = Some(watch_renewals(
            self.lease.clone(),
            &self.settings.lease,
            &self.settings.identity,
        ));
        if let Some(pod) = &self.pod {
            pod.set("leader").await?;
            pod.demote_others().await;
        }
        Ok(())
    }

    /// Resolves when this replica no longer leads: another holds the Lease, or no
    /// renewal of its own was seen by the renew deadline.
    pub fn lost(&self) -> impl std::future::Future<Output = ()> + Send + 'static {
        let mut is_leader = self.is_leader.clone();
        let seen = self.renewals.as_ref().map(|r| r.seen.clone());
        let deadline = renew_deadline(self.settings.duration);
        async move {
            let stopped = async {
                match seen {
                    Some(seen) => renewals_stop(seen, deadline).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                _ = is_leader.wait_for(|leads| !*leads) => {}
                () = stopped => tracing::error!(
                    deadline = ?deadline,
                    "no renewal of the leader Lease seen by the renew deadline (apiserver \
                     unreachable?); stepping down before a standby may take over"
                ),
            }
        }
    }

    /// Leaves the election, releasing the Lease so a standby takes over at once, and
    /// labels the Pod standby again (best effort: the Pod may be going away).
    pub async fn resign(mut self) {
        // The lease library's own release is unconditional: sent late (after a cut
        // healed) it would clear a new leader's hold. Stop the library first, then
        // release only if this replica still holds the Lease.
        self.task.abort();
        let _ = (&mut self.task).await;
        self.renewals = None;
        match tokio::time::timeout(
            Duration::from_secs(5),
            release(&self.lease, &self.settings.lease, &self.settings.identity),
        )
        .await
        {
            Ok(Ok(Released::Yes)) => tracing::info!("released the leader Lease"),
            Ok(Ok(Released::HeldByOther)) => {}
            Ok(Err(error)) => tracing::warn!(%error, "cannot release the leader Lease"),
            Err(_) => tracing::warn!("releasing the leader Lease timed out"),
        }
        if let Some(pod) = &self.pod
            && let Err(error) = pod.set("standby").await
        {
            tracing::debug!(%error, "cannot label the Pod standby");
        }
    }
}

impl Drop for Election {
    /// An election dropped without `resign` (the Lease was lost) releases nothing: the
    /// lease library would otherwise release unconditionally on its way out.
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Whether [`release`] cleared the Lease.
#[derive(Debug, PartialEq, Eq)]
pub enum Released {
    Yes,
    /// Another replica holds it (or nobody does): nothing was changed.
    HeldByOther,
}

/// Clears the Lease's holder if, and only if, it is still `identity`: a JSON patch's
/// `test` makes the check and the write one step on the apiserver.
pub async fn release(
    leases: &Api<Lease>,
    lease: &str,
    identity: &str,
) -> Result<Released, kube::Error> {
    let patch: json_patch::Patch = serde_json::from_value(json!([
        {"op": "test", "path": "/spec/holderIdentity", "value": identity},
        {"op": "add", "path": "/spec/holderIdentity", "value": null},
        {"op": "add", "path": "/spec/acquireTime", "value": null},
        {"op": "add", "path": "/spec/renewTime", "value": null},
        {"op": "add", "path": "/spec/leaseDurationSeconds", "value": null},
    ]))
    .expect("a well-formed JSON patch");
    match leases
        .patch(lease, &PatchParams::default(), &Patch::<()>::Json(patch))
        .await
    {
        Ok(_) => Ok(Released::Yes),
        // The test failed (422), or the Lease or its spec is gone.
        Err(kube::Error::Api(status)) if status.code == 422 || status.code == 404 => {
            Ok(Released::HeldByOther)
        }
        Err(error) => Err(error),
    }
}

/// Watches the Lease and notes each renewal by `identity` (a new `renewTime` while it
/// holds it) at the time it was made, starting from now: winning is a renewal.
fn watch_renewals(leases: Api<Lease>, lease: &str, identity: &str) -> RenewalWatch {
    let (noted, seen) = watch::channel(Instant::now());
    let config = watcher::Config::default().fields(&format!("metadata.name={lease}"));
    let identity = identity.to_owned();
    let task = tokio::spawn(async move {
        let mut last = None;
        let mut events = std::pin::pin!(watcher(leases, config));
        while let Some(event) = events.next().await {
            let lease = match event {
                Ok(watcher::Event::Apply(lease) | watcher::Event::InitApply(lease)) => lease,
                Ok(_) => continue,
                Err(error) => {
                    tracing::debug!(%error, "watching the leader Lease");
                    continue;
                }
            };
            let Some(spec) = lease.spec else { continue };
            let Some(renewed) = spec.renew_time.clone() else {
                continue;
            };
            if spec.holder_identity.as_deref() == Some(identity.as_str())
                && Some(&renewed) != last.as_ref()
            {
                noted.send_replace(instant_of(renewed.0));
                last = Some(renewed);
            }
        }
    });
    RenewalWatch { seen, task }
}

/// The monotonic instant of a `renewTime` this replica wrote with its own clock. An
/// event seen late (a watch cut and resumed) then moves the deadline no further than the
/// renewal itself did: the standby counts from `renewTime` too.
fn instant_of(renewed: k8s_openapi::jiff::Timestamp) -> Instant {
    let age = k8s_openapi::jiff::Timestamp::now().duration_since(renewed);
    let age = Duration::try_from(age).unwrap_or_default();
    Instant::now().checked_sub(age).unwrap_or_else(Instant::now)
}

#[derive(Debug)]
struct PodRole {
    api: Api<Pod>,
    name: String,
}

impl PodRole {
    /// Labels standby every other Pod still labelled leader: a former leader cut from its
    /// apiserver could not take its label off, and the proxies' Service would keep
    /// sending them to it. Best effort: a Pod gone meanwhile needs nothing.
    async fn demote_others(&self) {
        let selector = format!("{ROLE_LABEL}=leader");
        let leaders = match self
            .api
            .list(&ListParams::default().labels(&selector))
            .await
        {
            Ok(list) => list.items,
            Err(error) => {
                tracing::warn!(%error, "cannot list the Pods labelled leader");
                return;
            }
        };
        for former in leaders {
            let Some(name) = former.metadata.name.filter(|n| *n != self.name) else {
                continue;
            };
            let other = PodRole {
                api: self.api.clone(),
                name,
            };
            match other.set("standby").await {
                Ok(()) => tracing::info!(pod = other.name, "labelled a former leader standby"),
                Err(error) => tracing::warn!(%error, "cannot label a former leader standby"),
            }
        }
    }

    async fn set(&self, role: &'static str) -> Result<(), LeadershipError> {
        let patch = json!({"metadata": {"labels": BTreeMap::from([(ROLE_LABEL, role)])}});
        self.api
            .patch(&self.name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
            .map(drop)
            .map_err(|source| LeadershipError::Label {
                pod: self.name.clone(),
                role,
                source,
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_replica_claims_the_lease_as_its_own_field_manager() {
        assert_ne!(field_manager("kmm-hub-0"), field_manager("kmm-hub-1"));
    }

    #[tokio::test(start_paused = true)]
    async fn a_leader_whose_renewals_stop_steps_down_by_the_renew_deadline() {
        let duration = Duration::from_secs(15);
        let deadline = renew_deadline(duration);
        let (renewed, seen) = watch::channel(Instant::now());
        let start = Instant::now();
        let stops = tokio::spawn(renewals_stop(seen, deadline));
        // Renewals every third of the duration keep it leading well past the deadline.
        for _ in 0..6 {
            tokio::time::sleep(duration / 3).await;
            assert!(!stops.is_finished());
            renewed.send_replace(Instant::now());
        }
        let last = Instant::now();
        stops.await.unwrap();
        let stepped_down = Instant::now();
        assert_eq!(stepped_down - last, deadline);
        assert!(
            stepped_down - last < duration,
            "before a standby may take over"
        );
        assert!(stepped_down - start > duration * 2);
    }

    #[test]
    fn a_renewal_counts_from_when_it_was_made_not_when_it_was_seen() {
        let made =
            k8s_openapi::jiff::Timestamp::now() - k8s_openapi::jiff::SignedDuration::from_secs(8);
        let at = instant_of(made);
        let age = Instant::now() - at;
        assert!(
            age >= Duration::from_secs(8) && age < Duration::from_secs(9),
            "{age:?}"
        );
        let future =
            k8s_openapi::jiff::Timestamp::now() + k8s_openapi::jiff::SignedDuration::from_secs(5);
        assert!(instant_of(future) <= Instant::now());
    }

    #[tokio::test(start_paused = true)]
    async fn a_renewal_watch_that_ends_still_steps_down_by_the_deadline() {
        let deadline = renew_deadline(Duration::from_secs(9));
        let (renewed, seen) = watch::channel(Instant::now());
        let start = Instant::now();
        drop(renewed);
        renewals_stop(seen, deadline).await;
        assert_eq!(Instant::now() - start, deadline);
    }
}
