//! One builder for every test that needs a ManagedClusterModule (the `testing` feature).
//!
//! It starts from a small module the API admits and changes it where a test says, by the
//! same JSON an apiserver would hold, so a test reads as the object it builds and the
//! object is always one serde accepts.

use serde_json::{Value, json};

use crate::ManagedClusterModule;

/// A ManagedClusterModule under construction.
#[derive(Clone, Debug)]
pub struct ModuleBuilder {
    doc: Value,
}

impl ModuleBuilder {
    /// `name`, generation 1, for spoke namespace `drivers`, selecting every cluster and
    /// node, loading kernel module `name` from `r.example/<name>:1` on kernel `6.1`.
    pub fn new(name: &str) -> Self {
        Self {
            doc: json!({
                "apiVersion": "hub.kmm.sigs.x-k8s.io/v1beta1",
                "kind": "ManagedClusterModule",
                "metadata": {"name": name, "generation": 1},
                "spec": {
                    "spokeNamespace": "drivers",
                    "selector": {},
                    "moduleSpec": {
                        "selector": {},
                        "moduleLoader": {"container": {
                            "modprobe": {"moduleName": name},
                            "kernelMappings": [
                                {"literal": "6.1", "containerImage": format!("r.example/{name}:1")},
                            ],
                        }},
                    },
                },
            }),
        }
    }

    /// Sets the value at a JSON pointer (`/spec/rolloutStrategy`), creating the objects
    /// on the way.
    pub fn with(mut self, pointer: &str, value: impl Into<Value>) -> Self {
        let mut at = &mut self.doc;
        for token in pointer.split('/').skip(1) {
            let token = token.replace("~1", "/").replace("~0", "~");
            if !at.is_object() {
                *at = json!({});
            }
            at = at
                .as_object_mut()
                .expect("just made an object")
                .entry(token)
                .or_insert(Value::Null);
        }
        *at = value.into();
        self
    }

    /// Removes the value at a JSON pointer, if any.
    pub fn without(mut self, pointer: &str) -> Self {
        let (parent, key) = pointer.rsplit_once('/').expect("a JSON pointer");
        if let Some(Value::Object(parent)) = self.doc.pointer_mut(parent) {
            parent.remove(key);
        }
        self
    }

    pub fn generation(self, generation: i64) -> Self {
        self.with("/metadata/generation", generation)
    }

    pub fn uid(self, uid: &str) -> Self {
        self.with("/metadata/uid", uid)
    }

    pub fn resource_version(self, version: &str) -> Self {
        self.with("/metadata/resourceVersion", version)
    }

    pub fn labels(self, labels: &[(&str, &str)]) -> Self {
        self.with("/metadata/labels", pairs(labels))
    }

    pub fn finalizers(self, finalizers: &[&str]) -> Self {
        self.with("/metadata/finalizers", json!(finalizers))
    }

    /// Marked for deletion (at the Unix epoch).
    pub fn deleting(self) -> Self {
        self.with("/metadata/deletionTimestamp", "1970-01-01T00:00:00Z")
    }

    /// `spec.selector`: the ManagedClusters' labels.
    pub fn selector(self, labels: &[(&str, &str)]) -> Self {
        self.with("/spec/selector", pairs(labels))
    }

    pub fn spoke_namespace(self, namespace: &str) -> Self {
        self.with("/spec/spokeNamespace", namespace)
    }

    /// `spec.moduleSpec`, whole.
    pub fn module_spec(self, spec: Value) -> Self {
        self.with("/spec/moduleSpec", spec)
    }

    /// `spec.moduleSpec`, whole, from YAML (indented as a test embeds it, or not).
    pub fn module_spec_yaml(self, yaml: &str) -> Self {
        let spec: Value = serde_yaml_ng::from_str(yaml).expect("the test's moduleSpec is YAML");
        self.module_spec(spec)
    }

    /// The module's kernel mappings.
    pub fn kernel_mappings(self, mappings: Value) -> Self {
        self.with(
            "/spec/moduleSpec/moduleLoader/container/kernelMappings",
            mappings,
        )
    }

    /// The object as an apiserver would hold it.
    pub fn json(&self) -> Value {
        self.doc.clone()
    }

    pub fn build(self) -> ManagedClusterModule {
        serde_json::from_value(self.doc).expect("the test's ManagedClusterModule parses")
    }
}

fn pairs(labels: &[(&str, &str)]) -> Value {
    Value::Object(
        labels
            .iter()
            .map(|(k, v)| ((*k).to_owned(), Value::from(*v)))
            .collect(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_module_parses_and_each_setter_lands_where_it_names() {
        let module = ModuleBuilder::new("hello")
            .generation(3)
            .uid("u1")
            .resource_version("7")
            .labels(&[("team", "a")])
            .finalizers(&["f"])
            .deleting()
            .selector(&[("env", "prod")])
            .spoke_namespace("kmm")
            .with("/spec/rolloutStrategy/type", "Progressive")
            .build();
        assert_eq!(module.metadata.name.as_deref(), Some("hello"));
        assert_eq!(module.metadata.generation, Some(3));
        assert_eq!(module.metadata.uid.as_deref(), Some("u1"));
        assert_eq!(module.metadata.resource_version.as_deref(), Some("7"));
        assert_eq!(module.metadata.finalizers, Some(vec!["f".to_owned()]));
        assert!(module.metadata.deletion_timestamp.is_some());
        assert_eq!(
            module.spec.selector.get("env").map(String::as_str),
            Some("prod")
        );
        assert_eq!(module.spec.spoke_namespace, "kmm");
        assert!(module.spec.rollout_strategy.is_some());
        let loader = module.spec.module_spec.module_loader.unwrap();
        assert_eq!(
            loader.container.kernel_mappings[0]
                .container_image
                .as_deref(),
            Some("r.example/hello:1")
        );
    }

    #[test]
    fn an_indented_yaml_module_spec_and_a_removal_are_taken() {
        let yaml = "    selector: {role: worker}\n    moduleLoader:\n      container:\n        modprobe: {moduleName: x}\n        kernelMappings: [{regexp: '.*', containerImage: 'r/x:1'}]\n";
        let built = ModuleBuilder::new("x").module_spec_yaml(yaml);
        assert_eq!(
            built.json()["spec"]["moduleSpec"]["selector"]["role"],
            "worker"
        );
        let gone = built.without("/spec/moduleSpec/moduleLoader").json();
        assert!(gone["spec"]["moduleSpec"].get("moduleLoader").is_none());
    }
}
