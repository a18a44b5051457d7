//! `PreflightValidation`: "what happens if nodes move to kernel K", answered for the whole
//! fleet on the hub, in upstream Kernel Module Management's shape (`kernelVersion`,
//! `pushBuiltImage`; per module `verificationStatus`, `statusReason`,
//! `verificationStage`). No cluster receives anything from a preflight.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::{CustomResource, KubeSchema};
use serde::{Deserialize, Serialize};

/// The kernel to validate every ManagedClusterModule against.
// Each printcolumn(...) repeats the same keys, which clippy mistakes for duplicates.
#[allow(clippy::duplicated_attributes)]
#[derive(CustomResource, Clone, Debug, PartialEq, Serialize, Deserialize, KubeSchema)]
#[kube(
    group = "hub.kmm.sigs.x-k8s.io",
    version = "v1beta1",
    kind = "PreflightValidation",
    plural = "preflightvalidations",
    singular = "preflightvalidation",
    category = "kmm",
    status = "PreflightValidationStatus",
    derive = "PartialEq",
    doc = "Whether every ManagedClusterModule would load on nodes running a given kernel.",
    printcolumn(name = "Kernel", type_ = "string", json_path = ".spec.kernelVersion"),
    printcolumn(
        name = "Push",
        type_ = "boolean",
        description = "Whether missing images are built and signed ahead",
        json_path = ".spec.pushBuiltImage"
    ),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[serde(rename_all = "camelCase")]
pub struct PreflightValidationSpec {
    /// The kernel release nodes would run, as `uname -r` prints it (`6.1.0-13-amd64`,
    /// `5.14.0-427.el9.x86_64`): digits, a dot, digits, then letters, digits and `._+~-`.
    #[schemars(
        length(min = 3, max = 64),
        regex(pattern = r"^[0-9]+\.[0-9]+[0-9A-Za-z._+~-]*$")
    )]
    pub kernel_version: String,

    /// Build and sign the images that kernel needs and push them now, so that they exist
    /// before any node runs it. Otherwise only check what exists.
    #[serde(default)]
    pub push_built_image: bool,
}

/// Every ManagedClusterModule's verdict.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct PreflightValidationStatus {
    /// One entry per ManagedClusterModule, sorted by name.
    #[serde(default)]
    pub modules: Vec<PreflightModuleStatus>,
}

/// One module's verdict.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct PreflightModuleStatus {
    /// The ManagedClusterModule.
    pub name: String,
    /// Its `spokeNamespace`.
    pub namespace: String,
    /// `True` when nodes on the kernel would load the module, `False` otherwise.
    pub verification_status: String,
    /// Why, e.g. `image exists`, or the resolver's or registry's answer.
    pub status_reason: String,
    /// `Image` (checking), `Build`, `Sign`, `Requeued` (waiting to check again) or `Done`.
    pub verification_stage: String,
    /// When the verdict last changed.
    pub last_transition_time: Time,
}
