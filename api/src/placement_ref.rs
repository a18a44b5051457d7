//! `spec.placementRefs`: Open Cluster Management Placements that choose a module's
//! clusters, and whose decision groups are its rollout's waves.

use kube::KubeSchema;
use serde::{Deserialize, Serialize};

/// A Placement (`cluster.open-cluster-management.io/v1beta1`), by namespace and name.
/// The ManagedClusterModule is cluster-scoped, so the namespace is spelled out.
#[derive(
    Clone, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize, KubeSchema,
)]
pub struct PlacementRef {
    #[schemars(
        length(min = 1, max = 63),
        regex(pattern = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
    )]
    pub namespace: String,
    #[schemars(
        length(min = 1, max = 253),
        regex(pattern = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
    )]
    pub name: String,
}

impl std::fmt::Display for PlacementRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}
