//! The observed state of a ManagedClusterModule: concrete counts, bounded in size.
//!
//! Counts say where the fleet is without reading a condition's prose (seed 000, "Conditions
//! vs concrete data"); failure samples say why, and there are never more than
//! [`MAX_FAILURE_SAMPLES`] of them whatever the fleet size.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::KubeSchema;
use serde::{Deserialize, Serialize};
use serde_with::skip_serializing_none;

/// Most failure samples kept in status; the counts still cover every failure.
pub const MAX_FAILURE_SAMPLES: usize = 10;
/// Most nodes listed in `sharedKernelModules`.
pub const MAX_SHARED_KERNEL_MODULES: usize = 10;

/// Observed state of a ManagedClusterModule.
#[skip_serializing_none]
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct ManagedClusterModuleStatus {
    /// The `metadata.generation` these counts were computed for.
    pub observed_generation: Option<i64>,

    /// Managed clusters, by state.
    #[serde(default)]
    pub clusters: ClusterCounts,

    /// Nodes of the selected clusters, by state.
    #[serde(default)]
    pub nodes: NodeCounts,

    /// Distinct kernel releases seen on matching nodes, by resolution outcome.
    #[serde(default)]
    pub kernels: KernelCounts,

    /// Clusters kept running the module although no Placement of it decides them any
    /// more, for a reason that is not a request (see `clusters.held`); at most 10, by
    /// cluster name.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 10))]
    pub held: Vec<HeldCluster>,

    /// A bounded sample of failures, newest first.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 10))]
    pub failures: Vec<FailureSample>,

    /// Nodes where the module shares a kernel module with another module: an unload of
    /// one left it loaded for the other, which needs it. Not a failure; at most 10, by
    /// cluster and node.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 10))]
    pub shared_kernel_modules: Vec<SharedKernelModule>,

    /// The kmod images the fleet needs, sorted by image; at most 100.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 100))]
    pub images: Vec<ImageStatus>,

    /// Where the rollout of the latest `spec.moduleSpec` across the clusters stands.
    pub rollout: Option<crate::RolloutStatus>,

    /// How many times the hub followed a moved tag of the module's images
    /// (`imagePullPolicy: Always`): part of what a revision is, so that the new digest
    /// reaches clusters through `rolloutStrategy` like a spec change. Absent: never.
    pub pin_generation: Option<i64>,

    /// The device plugin's Pods (`spec.moduleSpec.devicePlugin`) on the selected clusters.
    pub device_plugins: Option<DevicePluginCounts>,

    /// Upstream KMM-Hub's counter, kept for tools written against it: the selected
    /// clusters (upstream counts the ManifestWorks it wants, one per cluster).
    #[serde(default)]
    pub number_desired: i32,

    /// Upstream's counter: the selected clusters on which every matching node runs the
    /// module (upstream counts applied ManifestWorks, which says less).
    #[serde(default)]
    pub number_applied: i32,

    /// Upstream's counter: the selected clusters with at least one failed node.
    #[serde(default)]
    pub number_degraded: i32,

    /// Standard conditions summarising the counts (`Ready`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
}

/// Device plugin Pods: one should run on every node that runs the module (for a module
/// with only a device plugin, on every node it selects).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct DevicePluginCounts {
    /// Nodes where a plugin Pod should run.
    pub desired: i32,
    /// Of those, nodes where it is available.
    pub available: i32,
    /// The clusters where fewer are available than desired, by name; at most 10.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 10))]
    pub short: Vec<ClusterDevicePlugins>,
}

/// One cluster's device plugin Pods.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct ClusterDevicePlugins {
    pub cluster: String,
    pub desired: i32,
    pub available: i32,
}

/// Managed clusters by state.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct ClusterCounts {
    /// Clusters whose labels match `spec.selector`.
    pub selected: i32,
    /// Selected clusters whose spoke proxy is connected to the hub.
    pub connected: i32,
    /// Selected clusters on which every matching node runs the desired module version.
    pub converged: i32,
    /// Clusters that still run the module although its Placements no longer decide them,
    /// because OCM lost sight of them rather than because anyone asked (`held` says why).
    /// They are counted in `selected` too.
    #[serde(default)]
    pub held: i32,
}

/// A cluster kept running a module that its Placements no longer decide.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct HeldCluster {
    /// Managed cluster name.
    pub cluster: String,
    /// The Placement (`namespace/name`) that no longer decides it.
    pub placement: String,
    /// `ClusterUnreachable`, `PlacementWithoutDecisions` or `DecisionsChanging`.
    pub reason: String,
    /// What happened and what would unload it.
    pub message: String,
}

/// Nodes by state.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct NodeCounts {
    /// Nodes matching the module's node selector and tolerations.
    pub matching: i32,
    /// Matching nodes on which the module is loaded at the desired version.
    pub loaded: i32,
    /// Matching nodes where loading failed or no image resolves for their kernel.
    pub failed: i32,
    /// Nodes the module does not apply to: no kernel mapping matches their kernel (as
    /// upstream, they are skipped; not counted in `matching`, never waited for).
    #[serde(default)]
    pub skipped: i32,
}

/// Kernel releases by resolution outcome.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct KernelCounts {
    /// Kernel releases for which an image was resolved.
    pub resolved: i32,
    /// Kernel releases no mapping matches, or whose image could not be resolved.
    pub unresolved: i32,
}

/// One failure, precise enough to act on.
#[skip_serializing_none]
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct FailureSample {
    /// Managed cluster name.
    pub cluster: String,
    /// Node name, when the failure is a node's.
    pub node: Option<String>,
    /// Kernel release involved.
    pub kernel: String,
    /// Machine-readable reason, e.g. `NoKernelMapping`, `ImageNotFound`, `LoadFailed`.
    pub reason: String,
    /// Human-readable detail, e.g. the node agent's full error text.
    pub message: String,
}

/// A node where the module shares a kernel module with another module.
#[derive(
    Clone, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize, KubeSchema,
)]
#[serde(rename_all = "camelCase")]
pub struct SharedKernelModule {
    /// Managed cluster name.
    pub cluster: String,
    /// Node name.
    pub node: String,
    /// The kernel modules and the other module (`namespace/name`), e.g. "kernel module
    /// kmm_hello stays loaded: kmm-ops/kmm-hello needs it".
    pub message: String,
}

/// Most images listed in status; beyond them only the per-kernel counts and node statuses
/// tell.
pub const MAX_IMAGE_STATUSES: usize = 100;
/// Most kernels named per image in status.
pub const MAX_IMAGE_KERNELS: usize = 10;
/// Most clusters listed per spoke-resolved image in status (by name); the hub keeps the
/// pins of the others in memory, and their proxies keep answering with the digest they
/// resolved.
pub const MAX_IMAGE_CLUSTERS: usize = 50;
/// Most cluster entries over all the images of one module's status, and the longest
/// message one keeps: status stays far below what the API server stores.
pub const MAX_MODULE_IMAGE_CLUSTERS: usize = 200;
pub const MAX_IMAGE_CLUSTER_MESSAGE: usize = 256;

/// Most earlier pins an image keeps (see [`ImageStatus::earlier_pins`]).
pub const MAX_EARLIER_PINS: usize = 4;

/// A digest an image was pinned to at a pin generation.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct ImagePin {
    /// The module's `pinGeneration` when the digest was pinned.
    pub pin_generation: i64,
    pub digest: String,
}

/// One kmod image the fleet needs, as the hub found, built or signed it.
#[skip_serializing_none]
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct ImageStatus {
    /// The image reference nodes load, variables substituted.
    pub image: String,
    /// Kernel releases whose nodes load this image (at most 10 named).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 10))]
    pub kernels: Vec<String>,
    /// Exists, NeedsBuild, NeedsSign, Building, Signing, Failed, NotFound, or
    /// SpokeResolved (the hub cannot check the image: each cluster resolves the tag with
    /// its own pull Secret and CAs and loads the digest it found, listed in `clusters`).
    pub state: String,
    /// The manifest digest nodes on the module's latest revision load: the tag resolved
    /// once (with `imagePullPolicy: Always`, again whenever the tag moved), or the signed
    /// image. Unset for a SpokeResolved image, whose digests are per cluster.
    pub digest: Option<String>,
    /// The module's `pinGeneration` when `digest` was pinned. Absent: 0.
    pub pin_generation: Option<i64>,
    /// The module's `imageRebuildTriggerGeneration` the digests here were resolved,
    /// built or signed for: a new leader that finds another one in the spec resolves
    /// (builds, signs) the image anew. Absent: the spec's.
    pub rebuild_generation: Option<i64>,
    /// Digests pinned before `digest` for clusters still on an earlier revision, oldest
    /// first; at most 4.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 4))]
    pub earlier_pins: Vec<ImagePin>,
    /// Machine-readable reason, e.g. `ImageNotFound`, `BuildFailed`, `SignFailed`.
    pub reason: String,
    /// Detail: the registry's answer, the end of a failed build's log, the signing error.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub message: String,
    /// When `state` last changed.
    pub last_transition_time: Option<k8s_openapi::apimachinery::pkg::apis::meta::v1::Time>,
    /// For a SpokeResolved image, each cluster's answer, by cluster name (at most 50
    /// listed): the digest its nodes load, or why it could not resolve the tag.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 50))]
    pub clusters: Vec<ImageClusterStatus>,
}

/// One cluster's resolution of a SpokeResolved image.
#[skip_serializing_none]
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct ImageClusterStatus {
    /// The ManagedCluster.
    pub cluster: String,
    /// The manifest digest the cluster resolved the tag to, which its nodes load; kept
    /// until the image is resolved anew (`imageRebuildTriggerGeneration`).
    pub digest: Option<String>,
    /// Why the cluster could not resolve the tag (e.g. `ImageNotFound`,
    /// `RegistryUnauthorized`); unset once it did.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub reason: String,
    /// The registry's answer to the cluster.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub message: String,
}
