//! Reading a module from a YAML or JSON document: a ManagedClusterModule, or an upstream
//! Kernel Module Management `Module`.

use kmm_api::{ManagedClusterModule, ModuleSpec};
use kmm_resolver::ModuleIdentity;
use serde::Deserialize;

const MCM_API_VERSION: &str = "hub.kmm.sigs.x-k8s.io/v1beta1";
const MODULE_API_VERSION: &str = "kmm.sigs.x-k8s.io/v1beta1";

/// A module spec with the identity it is resolved under.
#[derive(Debug)]
pub struct ModuleDocument {
    pub kind: &'static str,
    pub name: String,
    pub namespace: String,
    pub spec_path: &'static str,
    pub spec: ModuleSpec,
}

impl ModuleDocument {
    pub fn identity(&self) -> ModuleIdentity<'_> {
        ModuleIdentity {
            name: &self.name,
            namespace: &self.namespace,
            spec_path: self.spec_path,
        }
    }
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct TypeMeta {
    api_version: Option<String>,
    kind: Option<String>,
}

/// The upstream namespaced `Module`, as far as resolution needs it.
#[derive(Deserialize)]
struct UpstreamModule {
    metadata: UpstreamMetadata,
    spec: ModuleSpec,
}

#[derive(Deserialize)]
struct UpstreamMetadata {
    name: String,
    namespace: Option<String>,
}

/// Parses one document; errors name the field that could not be read.
pub fn parse(text: &str) -> Result<ModuleDocument, String> {
    let value: serde_json::Value =
        serde_yaml_ng::from_str(text).map_err(|e| format!("not a YAML or JSON document: {e}"))?;
    let meta: TypeMeta =
        serde_json::from_value(value.clone()).map_err(|e| format!("apiVersion/kind: {e}"))?;
    match (meta.api_version.as_deref(), meta.kind.as_deref()) {
        (Some(MCM_API_VERSION), Some("ManagedClusterModule")) => {
            let mcm: ManagedClusterModule = from_value(value)?;
            Ok(ModuleDocument {
                kind: "ManagedClusterModule",
                name: kube_name(mcm.metadata.name)?,
                namespace: mcm.spec.spoke_namespace,
                spec_path: "spec.moduleSpec",
                spec: mcm.spec.module_spec,
            })
        }
        (Some(MODULE_API_VERSION), Some("Module")) => {
            let module: UpstreamModule = from_value(value)?;
            Ok(ModuleDocument {
                kind: "Module",
                name: module.metadata.name,
                // What `kubectl apply` would use for a manifest without a namespace.
                namespace: module
                    .metadata
                    .namespace
                    .unwrap_or_else(|| "default".to_owned()),
                spec_path: "spec",
                spec: module.spec,
            })
        }
        (api_version, kind) => Err(format!(
            "apiVersion {:?}, kind {:?}: expected {MCM_API_VERSION} ManagedClusterModule or \
             {MODULE_API_VERSION} Module",
            api_version.unwrap_or_default(),
            kind.unwrap_or_default()
        )),
    }
}

fn kube_name(name: Option<String>) -> Result<String, String> {
    name.filter(|n| !n.is_empty())
        .ok_or_else(|| "metadata.name: required".to_owned())
}

/// Deserializes strictly, as `kubectl apply` does by default: a field the API does not
/// have is an error naming it, rather than a setting silently dropped.
fn from_value<T: serde::de::DeserializeOwned>(value: serde_json::Value) -> Result<T, String> {
    let mut unknown = Vec::new();
    let mut track = serde_path_to_error::Track::new();
    let tracked = serde_path_to_error::Deserializer::new(value, &mut track);
    let parsed = serde_ignored::deserialize(tracked, |path| {
        // serde_ignored marks each `Option` it passes through with a `?` segment.
        let path = path.to_string().replace(".?", "");
        // Type metadata was checked before deserializing; the derived types skip it.
        if path != "apiVersion" && path != "kind" {
            unknown.push(path);
        }
    });
    let parsed = parsed.map_err(|e| format!("{}: {e}", track.path()))?;
    unknown.sort();
    match unknown.as_slice() {
        [] => Ok(parsed),
        fields => Err(format!(
            "unknown field{} {}",
            if fields.len() == 1 { "" } else { "s" },
            fields.join(", ")
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn type_errors_name_the_field() {
        let doc = r#"
apiVersion: hub.kmm.sigs.x-k8s.io/v1beta1
kind: ManagedClusterModule
metadata: {name: m}
spec:
  spokeNamespace: ns
  selector: {}
  moduleSpec:
    selector: {}
    moduleLoader:
      container:
        modprobe: {moduleName: m}
        kernelMappings:
          - literal: 6.1.0
            containerImage: [not, a, string]
"#;
        let err = parse(doc).unwrap_err();
        assert!(
            err.starts_with(
                "spec.moduleSpec.moduleLoader.container.kernelMappings[0].containerImage:"
            ),
            "{err}"
        );
    }

    #[test]
    fn unknown_fields_are_refused_by_path() {
        let doc = r#"
apiVersion: hub.kmm.sigs.x-k8s.io/v1beta1
kind: ManagedClusterModule
metadata: {name: m}
spec:
  spokeNamespace: ns
  selector: {}
  moduleSpec:
    selector: {}
    moduleLoader:
      container:
        modprobe: {moduleName: m, dirname: /srv}
        kernelMapping: []
        kernelMappings: [{literal: 6.1.0, containerImage: r/x:v1}]
"#;
        assert_eq!(
            parse(doc).unwrap_err(),
            "unknown fields spec.moduleSpec.moduleLoader.container.kernelMapping, \
             spec.moduleSpec.moduleLoader.container.modprobe.dirname"
        );
    }

    #[test]
    fn unknown_kinds_are_refused() {
        let err = parse("apiVersion: v1\nkind: ConfigMap\n").unwrap_err();
        assert!(err.contains("\"ConfigMap\""), "{err}");
    }

    #[test]
    fn upstream_module_defaults_to_the_default_namespace() {
        let doc = "apiVersion: kmm.sigs.x-k8s.io/v1beta1\nkind: Module\nmetadata: {name: m}\nspec: {selector: {}}\n";
        let module = parse(doc).unwrap();
        assert_eq!(
            (module.kind, module.namespace.as_str()),
            ("Module", "default")
        );
    }
}
