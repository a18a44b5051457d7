//! The kmm-fleet hub API (`hub.kmm.sigs.x-k8s.io/v1beta1`): `ManagedClusterModule`, and
//! `PreflightValidation`; and, in [`ocm`], the Open Cluster Management kinds and labels
//! kmm-fleet works with.
//!
//! Wire-compatible with upstream Kernel Module Management: `spec.moduleSpec` is upstream's
//! `Module` spec, field for field; kmm-fleet only adds fields, never renames them.

mod crd;
pub mod labels;
mod managed_cluster_module;
mod module_spec;
mod node_upgrade;
pub mod ocm;
mod percent;
mod placement_ref;
mod preflight_validation;
mod rollout;
mod schema;
mod status;
#[cfg(any(test, feature = "testing"))]
pub mod testing;

pub use crd::{
    CRD_PATH, PREFLIGHT_CRD_PATH, managed_cluster_module_crd_yaml, preflight_validation_crd_yaml,
};
pub use managed_cluster_module::{ManagedClusterModule, ManagedClusterModuleSpec};
pub use module_spec::{
    Build, BuildArg, DEFAULT_DIR_NAME, DevicePluginContainerSpec, DevicePluginSpec, KanikoParams,
    KernelMapping, ModprobeArgs, ModprobeSpec, ModuleLoaderContainerSpec, ModuleLoaderSpec,
    ModuleSpec, Sign, TlsOptions,
};
pub use node_upgrade::{MaxUnavailable, NodeUpgrade};
pub use placement_ref::PlacementRef;
pub use preflight_validation::{
    PreflightModuleStatus, PreflightValidation, PreflightValidationSpec, PreflightValidationStatus,
};
pub use rollout::{
    GroupRef, MandatoryDecisionGroup, Pace, Rollout, RolloutCluster, RolloutConfig, RolloutCounts,
    RolloutGroup, RolloutProblem, RolloutProgressive, RolloutProgressivePerGroup, RolloutStatus,
    RolloutStrategy, RolloutType, Share, parse_duration,
};
pub use status::{
    ClusterCounts, ClusterDevicePlugins, DevicePluginCounts, FailureSample, HeldCluster,
    ImageClusterStatus, ImagePin, ImageStatus, KernelCounts, MAX_EARLIER_PINS, MAX_FAILURE_SAMPLES,
    MAX_IMAGE_CLUSTER_MESSAGE, MAX_IMAGE_CLUSTERS, MAX_IMAGE_KERNELS, MAX_IMAGE_STATUSES,
    MAX_MODULE_IMAGE_CLUSTERS, MAX_SHARED_KERNEL_MODULES, ManagedClusterModuleStatus, NodeCounts,
    SharedKernelModule,
};
