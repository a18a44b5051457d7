//! An MCM written for upstream Kernel Module Management deserializes here and serializes
//! back unchanged: no field is renamed, dropped or added.

use kmm_api::ManagedClusterModule;
use proptest::prelude::*;
use serde_json::Value;

const EVERY_FIELD: &str = include_str!("fixtures/upstream-every-field.yaml");

fn every_field() -> Value {
    serde_yaml_ng::from_str(EVERY_FIELD).expect("fixture parses")
}

fn round_trip(value: &Value) -> Result<Value, serde_json::Error> {
    let mcm: ManagedClusterModule = serde_json::from_value(value.clone())?;
    Ok(serde_json::to_value(&mcm).expect("serializes"))
}

#[test]
fn every_upstream_field_round_trips_unchanged() {
    let original = every_field();
    let back = round_trip(&original).expect("deserializes");
    assert_eq!(back, original, "round trip changed the document");
}

#[test]
fn minimal_upstream_mcm_round_trips_unchanged() {
    let original: Value = serde_yaml_ng::from_str(
        r#"
apiVersion: hub.kmm.sigs.x-k8s.io/v1beta1
kind: ManagedClusterModule
metadata: {name: minimal}
spec:
  spokeNamespace: default
  selector: {}
  moduleSpec:
    selector: {}
    moduleLoader:
      container:
        modprobe: {moduleName: m}
        kernelMappings:
          - {regexp: '.*', containerImage: 'r.example/m:v1'}
"#,
    )
    .unwrap();
    assert_eq!(round_trip(&original).unwrap(), original);
}

/// Every JSON path of an object key in `value`, depth first.
fn key_paths(value: &Value, prefix: &mut Vec<String>, out: &mut Vec<Vec<String>>) {
    match value {
        Value::Object(map) => {
            for (key, child) in map {
                prefix.push(key.clone());
                out.push(prefix.clone());
                key_paths(child, prefix, out);
                prefix.pop();
            }
        }
        Value::Array(items) => {
            for (i, child) in items.iter().enumerate() {
                prefix.push(i.to_string());
                key_paths(child, prefix, out);
                prefix.pop();
            }
        }
        _ => {}
    }
}

fn remove(value: &mut Value, path: &[String]) {
    let (last, parents) = path.split_last().expect("non-empty path");
    let mut node = value;
    for step in parents {
        node = match node {
            Value::Object(map) => match map.get_mut(step) {
                Some(child) => child,
                None => return,
            },
            Value::Array(items) => {
                match step.parse::<usize>().ok().and_then(|i| items.get_mut(i)) {
                    Some(child) => child,
                    None => return,
                }
            }
            _ => return,
        };
    }
    if let Value::Object(map) = node {
        map.remove(last);
    }
}

proptest! {
    /// Removing any set of fields either still round-trips exactly, or fails to
    /// deserialize with an error naming a field upstream also requires.
    #[test]
    fn any_subset_of_fields_round_trips_or_names_a_required_field(
        picks in proptest::collection::vec(any::<prop::sample::Index>(), 0..12)
    ) {
        let original = every_field();
        let mut paths = Vec::new();
        key_paths(&original, &mut Vec::new(), &mut paths);
        // Inside Kubernetes' own types, k8s-openapi fills a removed required field with its
        // default; those fields are not this API's to keep.
        let core_types = [
            "volumeMounts", "volumes", "env", "imageRepoSecret", "dockerfileConfigMap", "secrets", "keySecret",
            "certSecret",
        ];
        // apiVersion and kind are type metadata that kube fills in on its own.
        paths.retain(|path| path != &["apiVersion"] && path != &["kind"]);
        paths.retain(|path| {
            let (_, ancestors) = path.split_last().expect("non-empty");
            !ancestors.iter().any(|step| core_types.contains(&step.as_str()))
        });
        let mut doc = original;
        let removed: Vec<String> = picks.iter().map(|pick| paths[pick.index(paths.len())].join(".")).collect();
        for pick in picks {
            remove(&mut doc, &paths[pick.index(paths.len())]);
        }
        match round_trip(&doc) {
            Ok(back) => prop_assert!(back == doc, "round trip changed the document after removing {:?}", removed),
            Err(e) => {
                let message = e.to_string();
                let required = [
                    "apiVersion", "kind", "spec", "moduleSpec", "spokeNamespace", "selector", "container",
                    "kernelMappings", "modprobe", "image", "dockerfileConfigMap", "keySecret", "certSecret",
                    "name", "value", "metadata",
                ];
                prop_assert!(
                    required.iter().any(|field| message.contains(&format!("`{field}`"))),
                    "unexpected error: {}", message
                );
            }
        }
    }
}
