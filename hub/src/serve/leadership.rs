//! Leader election between hub replicas: a coordination.k8s.io Lease decides which one
//! reconciles, writes status and serves proxies. The others stand by (ready, serving the
//! admission webhook) and take over when the Lease is released or expires.
//!
//! The leader also labels its own Pod `hub.kmm.sigs.x-k8s.io/role=leader`: the proxies'
//! Service selects on it, so spoke proxies only ever reach the replica that serves them.

use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use kube::api::{Patch, PatchParams};
use kube::{Api, Client};
use kube_lease_manager::{LeaseManagerBuilder, LeaseManagerError};
use serde_json::json;
use thiserror::Error;
use tokio::sync::watch;

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
            .with_field_manager("kmm-hub")
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
        })
    }

    /// Waits until this replica leads; labels its Pod leader.
    pub async fn won(&mut self) -> Result<(), LeadershipError> {
        // A closed channel means the manager ended; `lost` reports why.
        let _ = self.is_leader.wait_for(|leads| *leads).await;
        if let Some(pod) = &self.pod {
            pod.set("leader").await?;
        }
        Ok(())
    }

    /// Resolves when this replica no longer leads.
    pub fn lost(&self) -> impl std::future::Future<Output = ()> + Send + 'static {
        let mut is_leader = self.is_leader.clone();
        async move {
            let _ = is_leader.wait_for(|leads| !*leads).await;
        }
    }

    /// Leaves the election, releasing the Lease so a standby takes over at once, and
    /// labels the Pod standby again (best effort: the Pod may be going away).
    pub async fn resign(self) {
        let Self {
            is_leader,
            task,
            pod,
        } = self;
        drop(is_leader);
        match tokio::time::timeout(Duration::from_secs(5), task).await {
            Ok(Ok(Ok(_))) => tracing::info!("released the leader Lease"),
            Ok(Ok(Err(error))) => tracing::warn!(%error, "cannot release the leader Lease"),
            Ok(Err(error)) => tracing::warn!(%error, "the leader election task failed"),
            Err(_) => tracing::warn!("releasing the leader Lease timed out"),
        }
        if let Some(pod) = pod
            && let Err(error) = pod.set("standby").await
        {
            tracing::debug!(%error, "cannot label the Pod standby");
        }
    }
}

#[derive(Debug)]
struct PodRole {
    api: Api<Pod>,
    name: String,
}

impl PodRole {
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
