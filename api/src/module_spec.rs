//! The upstream Kernel Module Management `Module` spec (`kmm.sigs.x-k8s.io/v1beta1`).
//!
//! Field names, nesting and optionality follow upstream exactly so that a spec written for
//! upstream deserializes here and serializes back unchanged. Every optional field is an
//! `Option` skipped when absent (`skip_serializing_none`): a round trip never adds `""`,
//! `false` or `[]` that the author did not write.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{
    EnvVar, LocalObjectReference, ResourceRequirements, Toleration, Volume, VolumeMount,
};
use kube::KubeSchema;
use serde::{Deserialize, Serialize};
use serde_with::skip_serializing_none;

/// Default root directory for modules inside a kmod image (`modprobe -d`).
pub const DEFAULT_DIR_NAME: &str = "/opt";

/// How the KMM add-on should deploy one out-of-tree kernel module on the nodes that need it.
#[skip_serializing_none]
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct ModuleSpec {
    /// Overrides for the container that deploys the device plugin on the node.
    pub device_plugin: Option<DevicePluginSpec>,

    /// Dynamic Resource Allocation driver settings (upstream `spec.dra`). Kept verbatim so
    /// that upstream specs round-trip; kmm-fleet does not deploy DRA drivers.
    // `default` tells schemars the field is optional, which `schema_with` hides from it.
    #[serde(default)]
    #[schemars(schema_with = "crate::schema::preserve_unknown_object")]
    pub dra: Option<serde_json::Value>,

    /// How the module is loaded on the node.
    pub module_loader: Option<ModuleLoaderSpec>,

    /// Secret (in the hub's namespace) used to pull the kmod images and to push built ones.
    pub image_repo_secret: Option<LocalObjectReference>,

    /// Node labels that select the nodes on which the module is loaded.
    pub selector: BTreeMap<String, String>,

    /// Node taints the module tolerates; nodes with other NoSchedule/NoExecute taints are skipped.
    pub tolerations: Option<Vec<Toleration>>,

    /// Counter that triggers a rebuild of the module images when incremented.
    pub image_rebuild_trigger_generation: Option<i64>,
}

/// The module loader: which images hold the module and how modprobe loads it.
#[skip_serializing_none]
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct ModuleLoaderSpec {
    /// The kmod image and modprobe settings.
    pub container: ModuleLoaderContainerSpec,

    /// Accepted for upstream compatibility; the node agent never runs user pods.
    pub service_account_name: Option<String>,
}

/// Image, build, sign and modprobe settings shared by all kernel mappings.
#[skip_serializing_none]
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = kube::core::Rule::new(
    "!(has(self.inTreeModuleToRemove) && size(self.inTreeModuleToRemove) > 0 && has(self.inTreeModulesToRemove))"
).message("only one of inTreeModuleToRemove or inTreeModulesToRemove may be set"))]
pub struct ModuleLoaderContainerSpec {
    /// Default build settings, merged with each mapping's.
    pub build: Option<Build>,

    /// Default signing settings, merged with each mapping's.
    pub sign: Option<Sign>,

    /// Version of the module; changing it unloads the old module and loads the new one.
    pub version: Option<String>,

    /// Default kmod image, used by mappings that do not set their own. May use kernel variables.
    pub container_image: Option<String>,

    /// One of Always, Never, IfNotPresent. Nodes load the digest the hub pinned whatever
    /// the policy. With Always the hub resolves the tag again periodically and moves nodes
    /// to a new digest through `rolloutStrategy`; otherwise the pin holds until
    /// `imageRebuildTriggerGeneration` changes.
    pub image_pull_policy: Option<String>,

    /// Kernel mappings, tried in order: the first that matches a node's kernel wins.
    // The bound (absent upstream) keeps the per-mapping CEL rule within the apiserver's
    // estimated cost budget, which an unbounded list exceeds; no real spec comes close.
    #[schemars(length(min = 1, max = 1024))]
    pub kernel_mappings: Vec<KernelMapping>,

    /// Which module modprobe loads and how.
    pub modprobe: ModprobeSpec,

    /// TLS settings for the kmod image registry.
    #[serde(rename = "registryTLS")]
    pub registry_tls: Option<TlsOptions>,

    /// Deprecated upstream in favour of `inTreeModulesToRemove`.
    pub in_tree_module_to_remove: Option<String>,

    /// In-tree modules removed (if present) before the module is loaded.
    pub in_tree_modules_to_remove: Option<Vec<String>>,
}

/// Pairs kernel releases, matched literally or by regular expression, with a kmod image.
#[skip_serializing_none]
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = kube::core::Rule::new(
    "(has(self.literal) && size(self.literal) > 0) != (has(self.regexp) && size(self.regexp) > 0)"
).message("exactly one of literal or regexp must be set"))]
pub struct KernelMapping {
    /// Build settings for this mapping, merged over the container's.
    pub build: Option<Build>,

    /// Signing settings for this mapping, merged over the container's.
    pub sign: Option<Sign>,

    /// kmod image for kernels matching this mapping. May use kernel variables.
    pub container_image: Option<String>,

    /// Kernel release matched exactly.
    pub literal: Option<String>,

    /// TLS settings for this mapping's registry; replaces the container's.
    #[serde(rename = "registryTLS")]
    pub registry_tls: Option<TlsOptions>,

    /// Regular expression (RE2 syntax, unanchored) matched against the kernel release.
    pub regexp: Option<String>,

    /// Deprecated upstream in favour of `inTreeModulesToRemove`.
    pub in_tree_module_to_remove: Option<String>,

    /// In-tree modules removed before loading; replaces the container's list when set.
    pub in_tree_modules_to_remove: Option<Vec<String>>,
}

/// Settings that customise modprobe.
#[skip_serializing_none]
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = kube::core::Rule::new(
    "(has(self.moduleName) && size(self.moduleName) > 0) ? !(has(self.rawArgs) && (has(self.rawArgs.load) || has(self.rawArgs.unload))) : (has(self.rawArgs) && has(self.rawArgs.load) && has(self.rawArgs.unload))"
).message("set either moduleName, or rawArgs with both load and unload"))]
#[x_kube(validation = kube::core::Rule::new(
    "!has(self.modulesLoadingOrder) || (has(self.moduleName) && self.modulesLoadingOrder[0] == self.moduleName)"
).message("modulesLoadingOrder must start with moduleName"))]
pub struct ModprobeSpec {
    /// Name of the module to load. May be empty only when `rawArgs` is set.
    #[schemars(length(max = 64))]
    pub module_name: Option<String>,

    /// Module parameters (`key=value`) appended to the load command.
    pub parameters: Option<Vec<String>>,

    /// Root directory of the modules in the image (`modprobe -d`); `/opt` when unset.
    pub dir_name: Option<String>,

    /// Extra modprobe arguments placed before the module name.
    pub args: Option<ModprobeArgs>,

    /// Complete modprobe arguments; all other settings here are then ignored.
    pub raw_args: Option<ModprobeArgs>,

    /// Directory in the image whose files are copied to the host's firmware directory.
    pub firmware_path: Option<String>,

    /// Load order for modules without depmod dependencies: `moduleName` first, then the
    /// module it depends on, and so on.
    #[schemars(length(min = 2), inner(length(max = 64)), extend("x-kubernetes-list-type" = "set"))]
    pub modules_loading_order: Option<Vec<String>>,
}

impl ModprobeSpec {
    /// The module root inside the image, with upstream's default applied.
    pub fn dir_name_or_default(&self) -> &str {
        match self.dir_name.as_deref() {
            Some(dir) if !dir.is_empty() => dir,
            _ => DEFAULT_DIR_NAME,
        }
    }
}

/// modprobe arguments for loading and unloading.
#[skip_serializing_none]
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct ModprobeArgs {
    /// Arguments used when loading.
    #[schemars(length(min = 1))]
    pub load: Option<Vec<String>>,

    /// Arguments used when unloading.
    #[schemars(length(min = 1))]
    pub unload: Option<Vec<String>>,
}

/// How to reach a registry.
#[skip_serializing_none]
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct TlsOptions {
    /// Plain HTTP.
    pub insecure: Option<bool>,

    /// HTTPS without verifying the registry's certificate.
    #[serde(rename = "insecureSkipTLSVerify")]
    pub insecure_skip_tls_verify: Option<bool>,
}

/// A build argument given to the image build.
#[skip_serializing_none]
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, KubeSchema)]
pub struct BuildArg {
    /// Argument name.
    pub name: String,
    /// Argument value.
    pub value: String,
}

/// Kaniko settings.
#[skip_serializing_none]
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, KubeSchema)]
pub struct KanikoParams {
    /// Kaniko image tag.
    pub tag: Option<String>,
}

/// How to build a kmod image when it does not exist.
#[skip_serializing_none]
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct Build {
    /// Build arguments; a mapping's argument replaces the container's of the same name.
    pub build_args: Option<Vec<BuildArg>>,

    /// ConfigMap holding the Dockerfile.
    pub dockerfile_config_map: LocalObjectReference,

    /// TLS settings for the registries of the Dockerfile's base images.
    #[serde(rename = "baseImageRegistryTLS")]
    pub base_image_registry_tls: Option<TlsOptions>,

    /// Secrets made available to the build; a mapping's are appended to the container's.
    pub secrets: Option<Vec<LocalObjectReference>>,

    /// Kaniko settings.
    pub kaniko_params: Option<KanikoParams>,

    /// Labels of the nodes the build may run on.
    pub selector: Option<BTreeMap<String, String>>,
}

/// How to sign the modules of a kmod image for Secure Boot.
#[skip_serializing_none]
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct Sign {
    /// Image to sign; ignored when a build is configured. May use kernel variables.
    pub unsigned_image: Option<String>,

    /// TLS settings for the unsigned image's registry.
    #[serde(rename = "unsignedImageRegistryTLS")]
    pub unsigned_image_registry_tls: Option<TlsOptions>,

    /// Secret holding the private signing key.
    pub key_secret: LocalObjectReference,

    /// Secret holding the public certificate.
    pub cert_secret: LocalObjectReference,

    /// Absolute paths, inside the image, of the module files to sign. May use kernel variables.
    pub files_to_sign: Option<Vec<String>>,
}

/// The device plugin deployed next to the module.
#[skip_serializing_none]
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct DevicePluginSpec {
    /// The device plugin container.
    pub container: DevicePluginContainerSpec,

    /// An init container run before the device plugin.
    pub init_container: Option<DevicePluginContainerSpec>,

    /// ServiceAccount of the device plugin pod.
    pub service_account_name: Option<String>,

    /// Extra volumes of the device plugin pod.
    pub volumes: Option<Vec<Volume>>,

    /// Whether the pod mounts its ServiceAccount token.
    pub automount_service_account_token: Option<bool>,
}

/// A device plugin container.
#[skip_serializing_none]
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct DevicePluginContainerSpec {
    /// Entrypoint array.
    pub command: Option<Vec<String>>,

    /// Arguments to the entrypoint.
    pub args: Option<Vec<String>>,

    /// Environment variables.
    pub env: Option<Vec<EnvVar>>,

    /// Image of the device plugin.
    pub image: String,

    /// One of Always, Never, IfNotPresent.
    pub image_pull_policy: Option<String>,

    /// Compute resources.
    pub resources: Option<ResourceRequirements>,

    /// Volume mounts appended to the default ones.
    pub volume_mounts: Option<Vec<VolumeMount>>,
}
