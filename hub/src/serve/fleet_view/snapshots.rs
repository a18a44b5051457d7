//! Recomputing clusters' snapshots and sending those that changed.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kmm_api::ManagedClusterModule;
use kmm_proto::v1::ModuleKey;
use kube::ResourceExt;

use crate::fleet::assignment::{ClusterFacts, cluster_modules, is_selected};
use crate::fleet::cluster_view::ClusterView;
use crate::fleet::forgetting::only_forgets;
use crate::fleet::intents::{ClusterImages, cluster_intents, while_unchecked};
use crate::fleet::served_revisions::{MissingRevision, at_revisions};
use crate::images::ImageKey;
use crate::images::awaited_checks::{AWAIT_BOUND, AfterRecord};

use super::sessions::ClusterSession;
use super::signals::CheckUnderWay;
use super::{FleetView, lock};

/// Longest the recompute task waits for registry checks under way.
const STALE_HOLD: Duration = Duration::from_millis(100);

/// Now, on the clock the recompute task's timers run on (a paused one in tests).
fn now() -> Instant {
    tokio::time::Instant::now().into_std()
}

impl FleetView {
    /// Marks the connected clusters the module is selected by or sent to as stale, for
    /// the recompute task.
    pub(super) fn mark_module_stale(&self, module: &ManagedClusterModule) {
        self.mark_stale_where(module, |_| true);
    }

    /// The record of the module's image `key` changed: marks the module's clusters as
    /// [`FleetView::mark_module_stale`] does, but for those still waiting for other
    /// checks (see `images::awaited_checks`): the last of those marks them.
    pub(super) fn mark_image_stale(&self, module: &ManagedClusterModule, key: &ImageKey) {
        let now = now();
        self.mark_stale_where(module, |session| {
            session.awaited.recorded(key, now) == AfterRecord::Recompute
        });
    }

    /// Marks as stale the connected clusters that waited their bound for image checks
    /// or, given what is `needed` now, wait for one that will never be recorded, and
    /// those whose snapshot that only forgets (`fleet::forgetting`) waited its bound.
    /// Returns when a cluster still waiting is due next.
    pub(super) fn release_waits(&self, needed: Option<&BTreeSet<u64>>) -> Option<Instant> {
        let now = now();
        let mut stale = Vec::new();
        let mut next: Option<Instant> = None;
        for (cluster, session) in self.sessions.all() {
            let session = lock(&session);
            let due = [session.awaited.due(), session.forgetting.due()]
                .into_iter()
                .flatten()
                .min();
            let Some(due) = due.filter(|_| session.stream.is_some()) else {
                continue;
            };
            let released = due <= now || needed.is_some_and(|n| session.awaited.abandoned(n));
            // A released cluster is recomputed, and is due again then if it still waits.
            let due = if released { now + AWAIT_BOUND } else { due };
            next = Some(next.map_or(due, |next| next.min(due)));
            if released {
                stale.push(cluster);
            }
        }
        self.signals.stale.add(stale);
        next
    }

    /// Marks the connected clusters for which `also` holds (asked of each first) and
    /// that the module selects, was sent to or may still run on.
    fn mark_stale_where(
        &self,
        module: &ManagedClusterModule,
        mut also: impl FnMut(&mut ClusterSession) -> bool,
    ) {
        let name = module.name_any();
        let namespace = module.spec.spoke_namespace.as_str();
        let stale: Vec<String> = self
            .sessions
            .all()
            .into_iter()
            .filter_map(|(cluster, session)| {
                let mut session = lock(&session);
                // The cluster's view is built last: a kernel upgrade's records leave most
                // clusters waiting (`also`), each record asking every cluster.
                (session.stream.is_some()
                    && also(&mut session)
                    && (session.carries(namespace, &name)
                        || session.statuses.lingers(namespace, &name)
                        || is_selected(
                            module,
                            self.index
                                .cluster_view(&cluster)
                                .as_ref()
                                .map(ClusterView::facts),
                        )))
                .then_some(cluster)
            })
            .collect();
        self.signals.stale.add(stale);
    }

    /// Recomputes the clusters marked stale until none is.
    pub fn recompute_stale(&self) {
        loop {
            let stale = self.signals.stale.take();
            if stale.is_empty() {
                return;
            }
            for cluster in stale {
                if let Some(session) = self.sessions.get(&cluster) {
                    self.recompute(&cluster, &mut lock(&session));
                }
            }
        }
    }

    /// The recompute task: runs until dropped. Registry checks under way would mark the
    /// same clusters stale again within moments (a kernel upgrade checks each module's
    /// image for every new kernel: one recompute per check made a dozen snapshots per
    /// cluster), so the task waits for them to be recorded, up to [`STALE_HOLD`]: a
    /// slow registry holds nothing up for longer. A cluster waiting for image checks is
    /// recomputed when it is due at the latest, whether or not anything else marks a
    /// cluster stale meanwhile: the task keeps the earliest time one may be due (a
    /// recompute only moves a cluster's later) and looks at every cluster only then.
    pub async fn follow_stale(self: std::sync::Arc<Self>) {
        let mut checks = self.signals.checks.subscribe();
        let mut waits = self.signals.waits.subscribe();
        let mut due = self.release_waits(None);
        loop {
            let at_due = async {
                match due {
                    Some(due) => tokio::time::sleep_until(due.into()).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                () = self.signals.stale.added() => {}
                changed = waits.changed() => {
                    if changed.is_err() {
                        return;
                    }
                    let new = now() + AWAIT_BOUND;
                    due = Some(due.map_or(new, |due| due.min(new)));
                    continue;
                }
                () = at_due => due = self.release_waits(None),
            }
            let _ = tokio::time::timeout(STALE_HOLD, checks.wait_for(|n| *n == 0)).await;
            self.recompute_stale();
        }
    }

    /// A registry check is under way until the guard drops.
    pub fn checking(&self) -> CheckUnderWay<'_> {
        CheckUnderWay::start(&self.signals.checks)
    }

    /// The modules as `cluster` is to run them (see `fleet::served_revisions`).
    pub(super) fn served_modules(
        &self,
        modules: &[Arc<ManagedClusterModule>],
        cluster: &str,
        facts: Option<ClusterFacts<'_>>,
    ) -> Vec<Arc<ManagedClusterModule>> {
        let mut missing = Vec::new();
        let served = at_revisions(
            modules,
            cluster,
            facts,
            &mut self.caches.revisions(),
            |object| self.index.stored_revision(object),
            &mut missing,
        );
        for MissingRevision { module, revision } in missing {
            tracing::warn!(
                module,
                cluster,
                revision,
                "the revision the cluster runs is not kept (or unreadable); the snapshots \
                 of the clusters on it leave the module out until the rollout moves them"
            );
        }
        served
    }

    /// Recomputes one cluster's snapshot (its lock held) and sends it when it changed.
    pub(super) fn recompute(&self, cluster: &str, session: &mut ClusterSession) {
        if !self.is_synced() || session.stream.is_none() {
            return;
        }
        let Some(kernels) = &session.kernels else {
            return;
        };
        let view = self.index.cluster_view(cluster);
        let facts = view.as_ref().map(ClusterView::facts);
        let modules = self.served_modules(&self.index.modules(), cluster, facts);
        let unconfirmed = |namespace: &str, name: &str| {
            session
                .outbox
                .unload_unconfirmed(namespace, name, session.acked_revision)
        };
        let inputs = cluster_modules(&modules, facts, &session.statuses, &unconfirmed);
        let credentials = self
            .index
            .credentials(inputs.iter().map(|i| i.module.as_ref()));
        let images = self.images.read();
        let mirrors = self.mirrors_of(cluster);
        let intents = cluster_intents(
            &inputs,
            kernels,
            &credentials,
            ClusterImages {
                records: &images.records,
                spoke_pins: &images.spoke_pins,
                cluster,
                mirrors: &mirrors,
                versions: &images.versions,
            },
            &mut self.caches.resolutions(),
            &mut self.caches.intents(),
        );
        drop(images);
        let was_waiting = session.awaited.due().is_some();
        session.awaited.set(&intents.unchecked, now());
        if !was_waiting && session.awaited.due().is_some() {
            self.signals.bump_waits();
        }
        let mut snapshot = intents.snapshot;
        if !intents.unchecked.is_empty() {
            // The image worker checks them within moments and recomputes.
            self.signals
                .unchecked_images
                .report(intents.unchecked.iter().cloned());
            // A proxy that named what it holds keeps running it: rather than a snapshot
            // leaving out what is unchecked (which it would forget until the check), it
            // gets the whole one after the checks, or nothing if that is what it holds.
            if session.outbox.resuming() {
                return;
            }
            let runs = |key: &ModuleKey| session.statuses.lingers(&key.namespace, &key.name);
            match while_unchecked(snapshot, &intents.unchecked, session.outbox.last(), runs) {
                Some(partial) => snapshot = partial,
                None => return,
            }
        }
        let shared = match session.outbox.resume(snapshot) {
            Ok(held) => {
                tracing::info!(
                    cluster,
                    revision = held.revision,
                    "the proxy holds the intents already"
                );
                self.metrics.snapshots_resumed.inc();
                if let Some((_, stream)) = &session.stream {
                    stream.held(held);
                }
                self.signals.bump_sent();
                return;
            }
            Err(shared) => shared,
        };
        if only_forgets(&session.outbox, &shared) {
            let was_holding = session.forgetting.due().is_some();
            if session.forgetting.hold(now()) {
                if !was_holding {
                    self.signals.bump_waits();
                }
                return;
            }
        }
        session.forgetting.release();
        let Some(snapshot) = session.outbox.offer(shared) else {
            return;
        };
        if let Some((_, stream)) = &session.stream {
            tracing::info!(
                cluster,
                revision = snapshot.revision,
                modules = snapshot.modules.len(),
                unloads = snapshot.modules.iter().filter(|m| m.unload).count(),
                credentials = snapshot.credentials.len(),
                "sending intents"
            );
            self.metrics.snapshots_sent.inc();
            stream.snapshot(snapshot);
        }
        self.signals.bump_sent();
    }
}
