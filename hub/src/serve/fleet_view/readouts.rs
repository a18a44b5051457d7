//! What the fleet UI reads of the view: the modules, the clusters, and each cluster's
//! session as a [`ClusterReadout`]. A readout lends the session's reports and the
//! resolutions it was sent, never the snapshot itself: the pull credentials a snapshot
//! carries cannot be reached through it.

use std::collections::BTreeSet;
use std::sync::Arc;

use kmm_api::ManagedClusterModule;
use kmm_proto::v1::KernelTarget;
use kube::ResourceExt;

use crate::fleet::cluster_states::{StateCounts, state_counts};
use crate::fleet::node_statuses::NodeStatuses;

use super::sessions::ClusterSession;
use super::{FleetView, lock};

/// One cluster's session as a reader sees it, its lock held for as long as it is lent.
#[derive(Clone, Copy, Debug)]
pub struct ClusterReadout<'a> {
    session: &'a ClusterSession,
}

impl<'a> ClusterReadout<'a> {
    /// Whether the cluster's proxy is connected now.
    pub fn connected(&self) -> bool {
        self.session.stream.is_some()
    }

    /// The kernels of its latest inventory; `None` until one arrived.
    pub fn kernels(&self) -> Option<&'a BTreeSet<String>> {
        self.session.kernels.as_ref()
    }

    /// Every node status the cluster reported.
    pub fn statuses(&self) -> &'a NodeStatuses {
        &self.session.statuses
    }

    /// The module's per-kernel resolution in the cluster's last snapshot.
    pub fn resolutions(&self, namespace: &str, name: &str) -> &'a [KernelTarget] {
        self.session
            .carried_intent(namespace, name)
            .map_or(&[], |intent| intent.kernels.as_slice())
    }
}

impl FleetView {
    /// Every ManagedClusterModule the hub manages.
    pub fn known_modules(&self) -> Vec<Arc<ManagedClusterModule>> {
        self.index.modules()
    }

    pub fn known_module(&self, name: &str) -> Option<Arc<ManagedClusterModule>> {
        self.index.module(name)
    }

    /// The module's selected clusters by state, as its view was last counted (counted now
    /// if it never was).
    pub fn state_counts(&self, module: &ManagedClusterModule) -> StateCounts {
        match self.caches.state_counts(&module.name_any()) {
            Some(counts) => counts,
            None => {
                let view = self.module_view(module);
                state_counts(&view)
            }
        }
    }

    /// Every ManagedCluster, by name.
    pub fn cluster_names(&self) -> Vec<String> {
        self.index.cluster_names()
    }

    /// The clusters whose proxy is connected now.
    pub fn connected_clusters(&self) -> BTreeSet<String> {
        self.sessions.connections().borrow().open.clone()
    }

    /// Visits every cluster's session, one lock at a time.
    pub fn each_cluster(&self, mut visit: impl FnMut(&str, ClusterReadout<'_>)) {
        for (cluster, session) in self.sessions.all() {
            let session = lock(&session);
            visit(&cluster, ClusterReadout { session: &session });
        }
    }

    /// Reads one cluster's session, its lock held while `read` runs; `None` when the
    /// cluster's proxy never connected to this hub.
    pub fn read_cluster<R>(
        &self,
        cluster: &str,
        read: impl FnOnce(ClusterReadout<'_>) -> R,
    ) -> Option<R> {
        let session = self.sessions.get(cluster)?;
        let session = lock(&session);
        Some(read(ClusterReadout { session: &session }))
    }
}
