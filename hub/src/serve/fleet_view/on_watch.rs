//! Watched objects as they reach the fleet view: each change recomputes the snapshots it
//! can change and touches the modules whose status it can change.

use std::sync::Arc;
use std::time::Instant;

use k8s_openapi::api::apps::v1::ControllerRevision;
use kmm_api::ManagedClusterModule;
use kube::ResourceExt;

use crate::fleet::revisions::MODULE_LABEL;

use super::index::{ModuleChange, ViewChange};
use super::sessions::ClusterSession;
use super::{FleetView, gauge, lock};

impl FleetView {
    /// A ManagedClusterModule was created or changed (its watch): recompute the clusters it
    /// concerns when what snapshots depend on (generation, deletion, rollout assignment)
    /// changed since last time.
    pub fn note_module(&self, module: &ManagedClusterModule) {
        match self.index.note(module) {
            ModuleChange::None => return,
            ModuleChange::Assignment => {}
            // The moment the work on a module's change begins; its status writes, which
            // the watch delivers too, are not changes of the module.
            ModuleChange::Spec => self.metrics.module_change_received.set_now(),
        }
        self.mark_module_stale(module);
        self.signals.bump_needs();
        self.signals.preflight_changed.notify_one();
    }

    /// The hub released the module's finalizer: drop it from every snapshot now.
    pub fn forget_module(&self, module: &ManagedClusterModule) {
        self.index.forget(module);
        self.caches.forget(&module.name_any());
        self.mark_module_stale(module);
        self.signals.bump_needs();
    }

    /// A ManagedCluster was created, changed or deleted. Only a change of its labels or
    /// of its acceptance matters: a cluster no longer accepted (`hubAcceptsClient` false,
    /// or deleted) loses its stream at once, before any other snapshot could reach it;
    /// new labels recompute its snapshot and touch the modules whose selection changed.
    pub fn cluster_changed(&self, cluster: &str) {
        if !self.is_synced() {
            return;
        }
        let Some(ViewChange { before, now }) = self.index.remember_view(cluster) else {
            return;
        };
        let mut selection_changed = self.index.selection_changed(before.as_ref(), now.as_ref());
        if let Some(session) = self.sessions.get(cluster) {
            let mut session = lock(&session);
            if now.as_ref().is_none_or(|v| !v.accepted) {
                self.deny(cluster, &session);
            } else {
                self.recompute(cluster, &mut session);
            }
            if now.is_none() {
                // The cluster is gone from the fleet: nothing it last reported can be
                // confirmed any more, so it holds no deletion.
                selection_changed.extend(session.carried().map(str::to_owned));
                if session.stream.take().is_some() {
                    // Its stream, ended above, finds no session to close.
                    self.sessions.closed(cluster);
                    self.metrics
                        .connected_clusters
                        .set(gauge(self.sessions.open_count()));
                }
                drop(session);
                self.sessions.remove(cluster);
            }
        }
        if !selection_changed.is_empty() {
            self.signals.bump_needs();
            self.signals.touched.add(selection_changed);
        }
    }

    /// A PlacementDecision was created, changed or deleted: the clusters whose Placements
    /// changed are looked at again, as if their labels had changed.
    pub fn decisions_changed(&self) {
        if !self.is_synced() {
            return;
        }
        for cluster in self.index.index_placements() {
            self.cluster_changed(&cluster);
        }
    }

    /// Clusters that left a Placement's decisions long enough ago (see
    /// `placements::DECISIONS_SETTLE`) are looked at again: their departure is meant now.
    pub fn settle_departures(&self, now: Instant) {
        if !self.is_synced() {
            return;
        }
        for cluster in self.index.expire_departures(now) {
            self.cluster_changed(&cluster);
        }
    }

    /// A pull Secret changed: recompute the clusters of the modules referencing it.
    pub fn secret_changed(&self, secret: &str) {
        for module in self.index.modules_pulling_with(secret) {
            self.mark_module_stale(&module);
        }
    }

    /// A kept revision appeared, changed or went: the module's clusters that run it are
    /// recomputed (after a restart, a cluster on an earlier revision waits for it).
    pub fn revision_changed(&self, revision: &ControllerRevision) {
        let Some(name) = revision.labels().get(MODULE_LABEL) else {
            return;
        };
        if let Some(module) = self.index.module(name) {
            self.mark_module_stale(&module);
            self.signals.bump_needs();
        }
    }

    /// A PreflightValidation changed or went: its image needs follow.
    pub fn preflight_changed(&self) {
        self.signals.bump_needs();
        self.signals.preflight_changed.notify_one();
    }

    /// Recomputes every connected cluster and touches every module: after the watches
    /// listed (again), when any change may have been missed.
    pub fn recompute_all(&self) {
        self.index.index_placements();
        self.index.remember_all_views();
        let synced = self.is_synced();
        for (cluster, session) in self.sessions.all() {
            let mut session = lock(&session);
            let accepted = self
                .index
                .cluster_view(&cluster)
                .is_some_and(|v| v.accepted);
            if synced && !accepted {
                self.deny(&cluster, &session);
            } else if session.stream.is_some() {
                self.recompute(&cluster, &mut session);
            }
        }
        self.signals.bump_needs();
        self.signals.touched.add(self.index.module_names());
    }

    /// The module's current revision (computed once per generation).
    pub fn current_revision(&self, module: &ManagedClusterModule) -> String {
        self.caches.revisions().current(module)
    }

    /// The module's kept revisions.
    pub fn kept_revisions(&self, module: &str) -> Vec<Arc<ControllerRevision>> {
        self.index.kept_revisions(module)
    }

    /// Ends the stream of a cluster the hub no longer accepts.
    pub(super) fn deny(&self, cluster: &str, session: &ClusterSession) {
        if let Some((_, stream)) = &session.stream {
            tracing::warn!(
                cluster,
                "the cluster is no longer accepted; ending its stream"
            );
            self.metrics.streams_refused.inc();
            stream.end(
                tonic::Code::PermissionDenied,
                format!("cluster {cluster} is no longer a ManagedCluster this hub accepts"),
            );
        }
    }
}
