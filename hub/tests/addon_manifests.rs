//! The add-on's packaging (`addon-manifests/addon`) agrees with kmm-hub: every variable
//! the AddOnTemplate uses is OCM's, set by the default AddOnDeploymentConfig, one of the
//! variables kmm-hub requires (and reports missing), or the CA bundle kmm-hub publishes.
//! OCM renders an unknown variable as an empty string, silently; this is where a typo in
//! the template is caught.

use std::collections::BTreeSet;

use kmm_hub::fleet::addon_config::{CA_BUNDLE_PARTS, CA_BUNDLE_PREFIX, REQUIRED_VARIABLES};
use regex::Regex;
use serde_json::Value;

/// The variables OCM's addon-manager defines for every template add-on.
const OCM_BUILT_IN: [&str; 3] = ["CLUSTER_NAME", "INSTALL_NAMESPACE", "HUB_KUBECONFIG"];

fn read(file: &str) -> String {
    let path = format!(
        "{}/../addon-manifests/addon/{file}",
        env!("CARGO_MANIFEST_DIR")
    );
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"))
}

fn template_variables(text: &str) -> BTreeSet<String> {
    Regex::new(r"\{\{([A-Za-z0-9_]+)\}\}")
        .unwrap()
        .captures_iter(text)
        .map(|c| c[1].to_owned())
        .collect()
}

#[test]
fn every_template_variable_is_defined_by_ocm_the_default_config_or_kmm_hub() {
    let used = template_variables(&read("addon-template.yaml"));
    let config: Value = serde_yaml_ng::from_str(&read("addon-deployment-config.yaml")).unwrap();
    let defaults: BTreeSet<String> = config["spec"]["customizedVariables"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v["name"].as_str().unwrap().to_owned())
        .collect();
    let bundle: BTreeSet<String> = (1..=CA_BUNDLE_PARTS)
        .map(|i| format!("{CA_BUNDLE_PREFIX}{i}"))
        .collect();
    for variable in &used {
        assert!(
            OCM_BUILT_IN.contains(&variable.as_str())
                || defaults.contains(variable)
                || REQUIRED_VARIABLES.contains(&variable.as_str())
                || bundle.contains(variable),
            "the template uses {{{{{variable}}}}}, which nobody defines"
        );
    }
    for required in REQUIRED_VARIABLES {
        assert!(
            used.contains(required),
            "kmm-hub requires {required}, unused"
        );
    }
    assert!(
        bundle.is_subset(&used),
        "the template must join every CA bundle part: {bundle:?}"
    );
}

#[test]
fn the_hub_ca_is_joined_from_every_part_in_order() {
    let template: Value = serde_yaml_ng::from_str(&read("addon-template.yaml")).unwrap();
    let manifests = template["spec"]["agentSpec"]["workload"]["manifests"]
        .as_array()
        .unwrap();
    let ca = manifests
        .iter()
        .find(|m| m["kind"] == "ConfigMap" && m["metadata"]["name"] == "kmm-hub-ca")
        .expect("the ConfigMap kmm-hub-ca");
    let joined: String = (1..=CA_BUNDLE_PARTS)
        .map(|i| format!("{{{{{CA_BUNDLE_PREFIX}{i}}}}}"))
        .collect();
    assert_eq!(ca["binaryData"]["ca.crt"], joined.as_str());
}

#[test]
fn the_signer_names_the_ca_secret_kmm_hub_creates() {
    let template: Value = serde_yaml_ng::from_str(&read("addon-template.yaml")).unwrap();
    let signer = &template["spec"]["registration"][0]["customSigner"];
    assert_eq!(signer["signerName"], "kmm.sigs.x-k8s.io/hub-client");
    assert_eq!(signer["signingCA"]["name"], kmm_hub::serve::ca::CA_SECRET);
    assert_eq!(signer["signingCA"]["namespace"], "kmm-hub");
}
