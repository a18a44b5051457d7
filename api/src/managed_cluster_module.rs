//! `ManagedClusterModule`: one module, loaded on the selected nodes of the selected clusters.

use std::collections::BTreeMap;

use kube::{CustomResource, KubeSchema};
use serde::{Deserialize, Serialize};

use crate::{ManagedClusterModuleStatus, ModuleSpec, NodeUpgrade, PlacementRef, RolloutStrategy};

/// The desired state of a ManagedClusterModule.
// Each printcolumn(...) repeats the same keys, which clippy mistakes for duplicates.
#[allow(clippy::duplicated_attributes)]
#[derive(CustomResource, Clone, Debug, PartialEq, Serialize, Deserialize, KubeSchema)]
#[kube(
    group = "hub.kmm.sigs.x-k8s.io",
    version = "v1beta1",
    kind = "ManagedClusterModule",
    plural = "managedclustermodules",
    singular = "managedclustermodule",
    shortname = "mcm",
    category = "kmm",
    status = "ManagedClusterModuleStatus",
    derive = "PartialEq",
    doc = "A kernel module to load on the selected nodes of the selected managed clusters.",
    printcolumn(
        name = "Namespace",
        type_ = "string",
        description = "Namespace of the module on the managed clusters",
        json_path = ".spec.spokeNamespace"
    ),
    printcolumn(
        name = "Clusters",
        type_ = "integer",
        description = "Managed clusters selected",
        json_path = ".status.clusters.selected"
    ),
    printcolumn(
        name = "Converged",
        type_ = "integer",
        description = "Selected clusters on which every matching node runs the module",
        json_path = ".status.clusters.converged"
    ),
    printcolumn(
        name = "Nodes",
        type_ = "integer",
        description = "Nodes matching the module's node selector",
        json_path = ".status.nodes.matching"
    ),
    printcolumn(
        name = "Loaded",
        type_ = "integer",
        description = "Nodes on which the module is loaded",
        json_path = ".status.nodes.loaded"
    ),
    printcolumn(
        name = "Failed",
        type_ = "integer",
        description = "Nodes on which loading failed or no image resolves",
        json_path = ".status.nodes.failed"
    ),
    printcolumn(
        name = "Skipped",
        type_ = "integer",
        description = "Nodes no kernel mapping applies to",
        json_path = ".status.nodes.skipped",
        priority = 1
    ),
    printcolumn(
        name = "Rollout",
        type_ = "string",
        description = "Where the rollout of the latest spec stands",
        json_path = ".status.rollout.summary"
    ),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[serde(rename_all = "camelCase")]
pub struct ManagedClusterModuleSpec {
    /// The module, exactly as upstream Kernel Module Management's `Module` spec.
    pub module_spec: ModuleSpec,

    /// Namespace the module belongs to on the managed clusters; part of the node labels.
    #[schemars(
        length(min = 1, max = 63),
        regex(pattern = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
    )]
    pub spoke_namespace: String,

    /// Labels of the ManagedClusters the module is deployed to.
    pub selector: BTreeMap<String, String>,

    /// Open Cluster Management Placements that choose the clusters too (an addition to
    /// upstream): a cluster is selected when its labels match `selector` and a Placement
    /// here decided it. Their decision groups are the rollout's waves, in the order of
    /// this list, then of each Placement's group index. Absent: `selector` alone.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1))]
    pub placement_refs: Option<Vec<PlacementRef>>,

    /// How a change of the module's version moves through each cluster's nodes (an
    /// addition to upstream). Absent: every node at once.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_upgrade: Option<NodeUpgrade>,

    /// How a change of `moduleSpec` moves across the selected clusters (an addition to
    /// upstream, in Open Cluster Management's RolloutStrategy shape). Absent: `All`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rollout_strategy: Option<RolloutStrategy>,
}
