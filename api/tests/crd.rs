//! The committed CRD matches the Rust types, and its CEL rules say what they mean.

use std::path::Path;

use kmm_api::{
    CRD_PATH, MAX_FAILURE_SAMPLES, ManagedClusterModule, PREFLIGHT_CRD_PATH,
    managed_cluster_module_crd_yaml, preflight_validation_crd_yaml,
};
use kube::core::cel::validate_cel;
use serde_json::{Value, json};

#[test]
fn committed_crds_match_the_types() {
    for (path, generated) in [
        (CRD_PATH, managed_cluster_module_crd_yaml()),
        (PREFLIGHT_CRD_PATH, preflight_validation_crd_yaml()),
    ] {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join(path);
        let committed = std::fs::read_to_string(&path).expect("the CRD is committed");
        assert!(
            committed == generated,
            "{} drifted from api/; run `cargo xtask crdgen` and commit the result",
            path.display()
        );
    }
}

fn schema() -> Value {
    let crd: Value = serde_yaml_ng::from_str(&managed_cluster_module_crd_yaml()).unwrap();
    crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"].clone()
}

#[test]
fn status_failure_samples_are_bounded() {
    let failures = &schema()["properties"]["status"]["properties"]["failures"];
    assert_eq!(failures["maxItems"], json!(MAX_FAILURE_SAMPLES));
}

#[test]
fn a_preflight_kernel_version_must_read_as_uname_r_prints_it() {
    let crd: Value = serde_yaml_ng::from_str(&preflight_validation_crd_yaml()).unwrap();
    let field = &crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
        ["kernelVersion"];
    let pattern = regex::Regex::new(field["pattern"].as_str().unwrap()).unwrap();
    let (min, max) = (
        field["minLength"].as_u64().unwrap(),
        field["maxLength"].as_u64().unwrap(),
    );
    let admitted = |v: &str| pattern.is_match(v) && (min..=max).contains(&(v.len() as u64));
    for good in [
        "6.1.0-13-amd64",
        "5.14.0-427.el9.x86_64",
        "4.18.0-513.5.1.el8_9.x86_64",
        "6.8.0-1010-azure",
        "6.6.30+rpt-rpi-v8",
    ] {
        assert!(admitted(good), "{good}");
    }
    for bad in [
        "",
        "latest",
        "6",
        "6.1.0 amd64",
        "../6.1",
        "6.1.0-13-amd64\n",
        &"6.1".repeat(30),
    ] {
        assert!(!admitted(bad), "{bad:?}");
    }
}

#[test]
fn crd_is_cluster_scoped_with_short_name() {
    let crd: Value = serde_yaml_ng::from_str(&managed_cluster_module_crd_yaml()).unwrap();
    assert_eq!(crd["spec"]["scope"], "Cluster");
    assert_eq!(crd["spec"]["names"]["shortNames"], json!(["mcm"]));
    assert_eq!(
        crd["spec"]["versions"][0]["subresources"]["status"],
        json!({})
    );
}

fn mcm(mapping: Value, modprobe: Value, container_extra: Value) -> ManagedClusterModule {
    let mut container = json!({"kernelMappings": [mapping], "modprobe": modprobe});
    for (k, v) in container_extra.as_object().unwrap() {
        container[k] = v.clone();
    }
    serde_json::from_value(json!({
        "apiVersion": "hub.kmm.sigs.x-k8s.io/v1beta1",
        "kind": "ManagedClusterModule",
        "metadata": {"name": "m"},
        "spec": {
            "spokeNamespace": "ns",
            "selector": {},
            "moduleSpec": {"selector": {}, "moduleLoader": {"container": container}}
        }
    }))
    .unwrap()
}

fn cel_errors(mcm: &ManagedClusterModule) -> String {
    match validate_cel(mcm) {
        Ok(()) => String::new(),
        Err(errors) => format!("{errors:?}"),
    }
}

#[test]
fn cel_requires_exactly_one_of_literal_or_regexp() {
    let modprobe = json!({"moduleName": "m"});
    let ok = mcm(
        json!({"literal": "6.1.0", "containerImage": "r/x:v1"}),
        modprobe.clone(),
        json!({}),
    );
    assert_eq!(cel_errors(&ok), "");
    // Go clients serialize unset strings as "": that still counts as unset.
    let go_style = mcm(
        json!({"literal": "", "regexp": "el9"}),
        modprobe.clone(),
        json!({}),
    );
    assert_eq!(cel_errors(&go_style), "");
    let both = mcm(
        json!({"literal": "6.1.0", "regexp": "el9"}),
        modprobe.clone(),
        json!({}),
    );
    assert!(cel_errors(&both).contains("exactly one of literal or regexp"));
    let neither = mcm(json!({"containerImage": "r/x:v1"}), modprobe, json!({}));
    assert!(cel_errors(&neither).contains("exactly one of literal or regexp"));
}

#[test]
fn cel_enforces_modprobe_name_or_raw_args() {
    let mapping = json!({"regexp": "."});
    let raw_only = mcm(
        mapping.clone(),
        json!({"rawArgs": {"load": ["a"], "unload": ["b"]}}),
        json!({}),
    );
    assert_eq!(cel_errors(&raw_only), "");
    let both = mcm(
        mapping.clone(),
        json!({"moduleName": "m", "rawArgs": {"load": ["a"]}}),
        json!({}),
    );
    assert!(cel_errors(&both).contains("set either moduleName"));
    let half_raw = mcm(
        mapping.clone(),
        json!({"rawArgs": {"load": ["a"]}}),
        json!({}),
    );
    assert!(cel_errors(&half_raw).contains("set either moduleName"));
    let bad_order = mcm(
        mapping,
        json!({"moduleName": "m", "modulesLoadingOrder": ["x", "m"]}),
        json!({}),
    );
    assert!(cel_errors(&bad_order).contains("must start with moduleName"));
}

#[test]
fn cel_refuses_both_in_tree_fields() {
    let both = mcm(
        json!({"regexp": "."}),
        json!({"moduleName": "m"}),
        json!({"inTreeModuleToRemove": "a", "inTreeModulesToRemove": ["b"]}),
    );
    assert!(cel_errors(&both).contains("only one of inTreeModuleToRemove"));
}
