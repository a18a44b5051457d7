//! What the control plane asks this node to run: plain types, independent of the
//! Kubernetes API, shaped like upstream KMM's module loader settings.

use serde::{Deserialize, Serialize};

/// `/opt`: upstream's default `dirName`.
pub const DEFAULT_DIR_NAME: &str = "/opt";

/// What the control plane asks of this node at one revision. Unloading is always
/// explicit: a module recorded as loaded but named neither in `modules` nor in
/// `unload` is left as it is, so a gap in the control plane's knowledge never unloads
/// anything.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct DesiredSnapshot {
    /// Reported back with every event acting on this snapshot.
    #[serde(default)]
    pub revision: u64,
    /// Modules to have loaded.
    #[serde(default)]
    pub modules: Vec<DesiredModule>,
    /// Keys of modules to unload, with the settings recorded when they were loaded.
    /// A key listed here is not loaded even if `modules` also names it.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub unload: Vec<String>,
}

/// Why a `--desired-file` content is refused.
#[derive(Debug, thiserror::Error)]
pub enum SnapshotFileError {
    #[error(
        "expected a JSON object {{\"revision\", \"modules\", \"unload\"}}, found a list: \
         modules are no longer unloaded by leaving them out, list their keys under \"unload\""
    )]
    BareList,
    #[error("invalid desired modules: {0}")]
    Invalid(#[from] serde_json::Error),
}

impl DesiredSnapshot {
    /// Parses the `--desired-file` format.
    pub fn from_json(bytes: &[u8]) -> Result<Self, SnapshotFileError> {
        // serde accepts a sequence for a struct; the former bare-list format must not
        // silently become an empty snapshot.
        if bytes.trim_ascii_start().starts_with(b"[") {
            return Err(SnapshotFileError::BareList);
        }
        Ok(serde_json::from_slice(bytes)?)
    }
}

/// One module the node must run.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DesiredModule {
    /// Identity of the module on this node: `<namespace>/<name>` of the Module.
    pub key: String,
    /// Upstream's `version`; a change unloads the old version and loads the new.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub version: Option<String>,
    /// The kmod image as resolved for this node's kernel (tag or digest reference).
    pub image: String,
    /// The image digest when the control plane already resolved it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub digest: Option<String>,
    /// How to load the module.
    pub modprobe: Modprobe,
    /// In-tree modules removed before loading.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub in_tree_modules_to_remove: Vec<String>,
    /// How to reach the registry.
    #[serde(default)]
    pub registry_tls: RegistryTls,
    /// Pull credentials, in memory only: never serialised, never logged.
    #[serde(default, skip_serializing)]
    pub pull_secret: Option<PullSecret>,
}

impl DesiredModule {
    /// The modules loaded for this entry, in load order (dependencies first).
    pub fn load_order(&self) -> Vec<String> {
        self.modprobe.load_order()
    }
}

/// Upstream's `modprobe` settings.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Modprobe {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub module_name: Option<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub parameters: Vec<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dir_name: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub args: Option<ModprobeArgs>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub raw_args: Option<ModprobeArgs>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub firmware_path: Option<String>,
    /// `moduleName` first, then the module it depends on, and so on.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub modules_loading_order: Vec<String>,
}

impl Modprobe {
    pub fn dir_name(&self) -> &str {
        match self.dir_name.as_deref() {
            Some(dir) if !dir.is_empty() => dir,
            _ => DEFAULT_DIR_NAME,
        }
    }

    /// Modules in the order they are loaded: the reverse of `modulesLoadingOrder`
    /// (whose first entry is `moduleName`), or just `moduleName`.
    pub fn load_order(&self) -> Vec<String> {
        if !self.modules_loading_order.is_empty() {
            return self.modules_loading_order.iter().rev().cloned().collect();
        }
        self.module_name.iter().cloned().collect()
    }
}

/// modprobe arguments for loading and unloading.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModprobeArgs {
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub load: Vec<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub unload: Vec<String>,
}

pub use kmm_registry::{PullSecret, RegistryTls};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn load_order_reverses_modules_loading_order() {
        let m = Modprobe {
            module_name: Some("a".into()),
            modules_loading_order: vec!["a".into(), "b".into(), "c".into()],
            ..Default::default()
        };
        assert_eq!(m.load_order(), ["c", "b", "a"]);
        let m = Modprobe {
            module_name: Some("a".into()),
            ..Default::default()
        };
        assert_eq!(m.load_order(), ["a"]);
        assert!(Modprobe::default().load_order().is_empty());
        assert_eq!(Modprobe::default().dir_name(), "/opt");
    }

    #[test]
    fn secrets_are_neither_shown_nor_serialised() {
        let module: DesiredModule = serde_json::from_value(serde_json::json!({
            "key": "ns/m",
            "image": "r/i:t",
            "modprobe": { "moduleName": "m" },
            "registryTls": { "insecureSkipTLSVerify": true },
            "pullSecret": { "dockerConfigJson": "{\"auths\":{\"r\":{\"auth\":\"c2VjcmV0\"}}}" }
        }))
        .unwrap();
        assert!(module.registry_tls.insecure_skip_tls_verify);
        assert!(module.pull_secret.is_some());
        let shown = format!("{module:?}");
        assert!(!shown.contains("c2VjcmV0"), "{shown}");
        let written = serde_json::to_string(&module).unwrap();
        assert!(
            !written.contains("c2VjcmV0") && !written.contains("pullSecret"),
            "{written}"
        );
    }

    #[test]
    fn snapshot_format() {
        let snapshot: DesiredSnapshot = serde_json::from_value(serde_json::json!({
            "revision": 7,
            "modules": [{ "key": "ns/a", "image": "r/a:1", "modprobe": { "moduleName": "a" } }],
            "unload": ["ns/b"]
        }))
        .unwrap();
        assert_eq!(snapshot.revision, 7);
        assert_eq!(snapshot.modules[0].key, "ns/a");
        assert_eq!(snapshot.unload, ["ns/b"]);
        let empty = DesiredSnapshot::from_json(b" {}").unwrap();
        assert_eq!(empty, DesiredSnapshot::default());
        // The former bare list (whose absences meant "unload") is refused, not reinterpreted.
        for list in [&b"[]"[..], b" \n[{\"key\": \"ns/a\"}]"] {
            let error = DesiredSnapshot::from_json(list).unwrap_err();
            assert!(matches!(error, SnapshotFileError::BareList), "{error}");
            assert!(error.to_string().contains("\"unload\""), "{error}");
        }
        let error = DesiredSnapshot::from_json(br#"{"unloads": []}"#).unwrap_err();
        assert!(
            error.to_string().contains("unknown field `unloads`"),
            "{error}"
        );
    }
}
