//! Open Cluster Management's API as kmm-fleet speaks it: the groups, versions, kinds and
//! plurals of the OCM resources the hub and the local fleet read and write, and the labels
//! OCM puts on them. OCM's types are not compiled in (they are read as dynamic objects), so
//! these names are their only definition: one place, so that every user asks for the same
//! version and following OCM to a new one is one edit.

use kube::core::{ApiResource, GroupVersionKind};

/// API group of ManagedClusters, their sets, and Placements.
pub const CLUSTER_GROUP: &str = "cluster.open-cluster-management.io";
/// API group of add-ons and their configs.
pub const ADDON_GROUP: &str = "addon.open-cluster-management.io";
/// API group of ManifestWorks.
pub const WORK_GROUP: &str = "work.open-cluster-management.io";

/// On a ManagedCluster: the ManagedClusterSet it belongs to.
pub const CLUSTER_SET_LABEL: &str = "cluster.open-cluster-management.io/clusterset";
/// On every PlacementDecision: the Placement that made it.
pub const PLACEMENT_LABEL: &str = "cluster.open-cluster-management.io/placement";
/// On every PlacementDecision: the index of its decision group.
pub const DECISION_GROUP_INDEX_LABEL: &str =
    "cluster.open-cluster-management.io/decision-group-index";
/// On a PlacementDecision of a named decision group: the group's name.
pub const DECISION_GROUP_NAME_LABEL: &str =
    "cluster.open-cluster-management.io/decision-group-name";

/// A ManagedCluster taint set by OCM's registration when the cluster's agent lease lapsed
/// (its `ManagedClusterConditionAvailable` is `Unknown`).
pub const UNREACHABLE_TAINT: &str = "cluster.open-cluster-management.io/unreachable";
/// A ManagedCluster taint set by OCM's registration when the cluster reports itself
/// unavailable (`ManagedClusterConditionAvailable` is `False`).
pub const UNAVAILABLE_TAINT: &str = "cluster.open-cluster-management.io/unavailable";

/// An OCM kind in the version kmm-fleet uses. Static rather than an [`ApiResource`] (which
/// owns its strings) so that it can be a constant and its parts compared against.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Resource {
    pub group: &'static str,
    pub version: &'static str,
    pub kind: &'static str,
    /// The name in URLs, RBAC rules and add-on config references.
    pub plural: &'static str,
}

impl Resource {
    /// For `Api::<DynamicObject>::*_with` and reflectors. The plural is given, not guessed
    /// from the kind as `ApiResource::from_gvk` would.
    pub fn api_resource(&self) -> ApiResource {
        let gvk = GroupVersionKind::gvk(self.group, self.version, self.kind);
        ApiResource::from_gvk_with_plural(&gvk, self.plural)
    }

    /// `group/version`, as in an object's `apiVersion`.
    pub fn api_version(&self) -> String {
        format!("{}/{}", self.group, self.version)
    }
}

/// Cluster-scoped; its name is the cluster's, and its namespace on the hub.
pub const MANAGED_CLUSTER: Resource = Resource {
    group: CLUSTER_GROUP,
    version: "v1",
    kind: "ManagedCluster",
    plural: "managedclusters",
};

/// Namespaced: lets a namespace's Placements choose from a ManagedClusterSet.
pub const MANAGED_CLUSTER_SET_BINDING: Resource = Resource {
    group: CLUSTER_GROUP,
    version: "v1beta2",
    kind: "ManagedClusterSetBinding",
    plural: "managedclustersetbindings",
};

/// Namespaced; named by a module's `spec.placementRefs`.
pub const PLACEMENT: Resource = Resource {
    group: CLUSTER_GROUP,
    version: "v1beta1",
    kind: "Placement",
    plural: "placements",
};

/// Namespaced, next to its Placement, which [`PLACEMENT_LABEL`] names.
pub const PLACEMENT_DECISION: Resource = Resource {
    group: CLUSTER_GROUP,
    version: "v1beta1",
    kind: "PlacementDecision",
    plural: "placementdecisions",
};

/// Cluster-scoped: the add-on itself.
pub const CLUSTER_MANAGEMENT_ADD_ON: Resource = Resource {
    group: ADDON_GROUP,
    version: "v1alpha1",
    kind: "ClusterManagementAddOn",
    plural: "clustermanagementaddons",
};

/// In each cluster's namespace: the add-on on that cluster.
pub const MANAGED_CLUSTER_ADD_ON: Resource = Resource {
    group: ADDON_GROUP,
    version: "v1alpha1",
    kind: "ManagedClusterAddOn",
    plural: "managedclusteraddons",
};

/// Namespaced: the variables an add-on's template renders with.
pub const ADD_ON_DEPLOYMENT_CONFIG: Resource = Resource {
    group: ADDON_GROUP,
    version: "v1alpha1",
    kind: "AddOnDeploymentConfig",
    plural: "addondeploymentconfigs",
};

/// Cluster-scoped: what an add-on deploys on each cluster.
pub const ADD_ON_TEMPLATE: Resource = Resource {
    group: ADDON_GROUP,
    version: "v1alpha1",
    kind: "AddOnTemplate",
    plural: "addontemplates",
};

/// In a cluster's namespace: objects OCM applies on that cluster.
pub const MANIFEST_WORK: Resource = Resource {
    group: WORK_GROUP,
    version: "v1",
    kind: "ManifestWork",
    plural: "manifestworks",
};

#[cfg(test)]
mod tests {
    use super::*;

    /// Spelled out as OCM's CRDs (open-cluster-management.io/api) serve them, not
    /// derived from the constants: a typo there fails here.
    #[test]
    fn each_resource_is_what_ocm_serves() {
        let served = [
            (
                MANAGED_CLUSTER,
                "cluster.open-cluster-management.io/v1",
                "ManagedCluster",
                "managedclusters",
            ),
            (
                MANAGED_CLUSTER_SET_BINDING,
                "cluster.open-cluster-management.io/v1beta2",
                "ManagedClusterSetBinding",
                "managedclustersetbindings",
            ),
            (
                PLACEMENT,
                "cluster.open-cluster-management.io/v1beta1",
                "Placement",
                "placements",
            ),
            (
                PLACEMENT_DECISION,
                "cluster.open-cluster-management.io/v1beta1",
                "PlacementDecision",
                "placementdecisions",
            ),
            (
                CLUSTER_MANAGEMENT_ADD_ON,
                "addon.open-cluster-management.io/v1alpha1",
                "ClusterManagementAddOn",
                "clustermanagementaddons",
            ),
            (
                MANAGED_CLUSTER_ADD_ON,
                "addon.open-cluster-management.io/v1alpha1",
                "ManagedClusterAddOn",
                "managedclusteraddons",
            ),
            (
                ADD_ON_DEPLOYMENT_CONFIG,
                "addon.open-cluster-management.io/v1alpha1",
                "AddOnDeploymentConfig",
                "addondeploymentconfigs",
            ),
            (
                ADD_ON_TEMPLATE,
                "addon.open-cluster-management.io/v1alpha1",
                "AddOnTemplate",
                "addontemplates",
            ),
            (
                MANIFEST_WORK,
                "work.open-cluster-management.io/v1",
                "ManifestWork",
                "manifestworks",
            ),
        ];
        for (resource, api_version, kind, plural) in served {
            let api = resource.api_resource();
            assert_eq!(api.api_version, api_version, "{kind}");
            assert_eq!(resource.api_version(), api_version, "{kind}");
            assert_eq!(api.kind, kind);
            assert_eq!(api.plural, plural, "{kind}");
        }
    }
}
