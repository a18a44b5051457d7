//! The add-on's packaging (`addon-manifests/addon`) agrees with kmm-hub: every variable
//! the AddOnTemplate uses is OCM's, set by the default AddOnDeploymentConfig, one of the
//! variables kmm-hub requires (and reports missing) or checks when set, or the CA bundle
//! kmm-hub publishes.
//! OCM renders an unknown variable as an empty string, silently; this is where a typo in
//! the template is caught. The hub's own manifests (`addon-manifests/hub`) give its
//! builds the namespace and permissions `kmm_hub::build` relies on.

use std::collections::BTreeSet;

use kmm_hub::fleet::addon_config::{
    CA_BUNDLE_PARTS, CA_BUNDLE_PREFIX, CLUSTER_PULL_SECRET, OPTIONAL_VARIABLES,
    REGISTRY_CA_BUNDLE_PARTS, REGISTRY_CA_BUNDLE_PREFIX, REQUIRED_VARIABLES,
};
use regex::Regex;
use serde_json::Value;

/// The variables OCM's addon-manager defines for every template add-on.
const OCM_BUILT_IN: [&str; 3] = ["CLUSTER_NAME", "INSTALL_NAMESPACE", "HUB_KUBECONFIG"];

fn read(file: &str) -> String {
    read_in("addon", file)
}

fn read_in(dir: &str, file: &str) -> String {
    let path = format!(
        "{}/../addon-manifests/{dir}/{file}",
        env!("CARGO_MANIFEST_DIR")
    );
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"))
}

/// The documents of a multi-document YAML file of `addon-manifests/hub`.
fn hub_documents(file: &str) -> Vec<Value> {
    serde_yaml_ng::Deserializer::from_str(&read_in("hub", file))
        .map(|d| serde::Deserialize::deserialize(d).unwrap())
        .collect()
}

fn find<'a>(documents: &'a [Value], kind: &str) -> &'a Value {
    documents
        .iter()
        .find(|d| d["kind"] == kind)
        .unwrap_or_else(|| panic!("no {kind}"))
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
    let registry_bundle: BTreeSet<String> = (1..=REGISTRY_CA_BUNDLE_PARTS)
        .map(|i| format!("{REGISTRY_CA_BUNDLE_PREFIX}{i}"))
        .collect();
    for variable in &used {
        assert!(
            OCM_BUILT_IN.contains(&variable.as_str())
                || defaults.contains(variable)
                || REQUIRED_VARIABLES.contains(&variable.as_str())
                || OPTIONAL_VARIABLES.contains(&variable.as_str())
                || bundle.contains(variable)
                || registry_bundle.contains(variable),
            "the template uses {{{{{variable}}}}}, which nobody defines"
        );
    }
    for required in REQUIRED_VARIABLES.into_iter().chain(OPTIONAL_VARIABLES) {
        assert!(used.contains(required), "kmm-hub checks {required}, unused");
    }
    assert!(
        bundle.is_subset(&used),
        "the template must join every CA bundle part: {bundle:?}"
    );
}

#[test]
fn the_hub_ca_and_the_registries_cas_are_joined_from_every_part_in_order() {
    let template: Value = serde_yaml_ng::from_str(&read("addon-template.yaml")).unwrap();
    let manifests = template["spec"]["agentSpec"]["workload"]["manifests"]
        .as_array()
        .unwrap();
    for (config_map, prefix, parts) in [
        ("kmm-hub-ca", CA_BUNDLE_PREFIX, CA_BUNDLE_PARTS),
        (
            "kmm-registry-ca",
            REGISTRY_CA_BUNDLE_PREFIX,
            REGISTRY_CA_BUNDLE_PARTS,
        ),
    ] {
        let ca = manifests
            .iter()
            .find(|m| m["kind"] == "ConfigMap" && m["metadata"]["name"] == config_map)
            .unwrap_or_else(|| panic!("the ConfigMap {config_map}"));
        let joined: String = (1..=parts)
            .map(|i| format!("{{{{{prefix}{i}}}}}"))
            .collect();
        assert_eq!(ca["binaryData"]["ca.crt"], joined.as_str(), "{config_map}");
    }
    // The agents trust that ConfigMap's bundle, and so does the proxy, which resolves
    // the images the hub cannot check.
    for kind in ["DaemonSet", "Deployment"] {
        let workload = manifests
            .iter()
            .find(|m| m["kind"] == kind)
            .unwrap_or_else(|| panic!("the add-on's {kind}"));
        let pod = &workload["spec"]["template"]["spec"];
        assert!(
            pod["volumes"]
                .as_array()
                .unwrap()
                .iter()
                .any(|v| v["configMap"]["name"] == "kmm-registry-ca"),
            "{kind}"
        );
        assert!(
            pod["containers"][0]["args"]
                .as_array()
                .unwrap()
                .contains(&Value::from(
                    "--registry-ca-file=/etc/kmm/registry-ca/ca.crt"
                )),
            "{kind}"
        );
    }
}

/// Every rule of the proxy's Roles and ClusterRoles that names Secrets: (kind, resource
/// names, verbs).
fn secret_rules(template: &Value) -> Vec<(String, Vec<String>, Vec<String>)> {
    let strings = |v: &Value| -> Vec<String> {
        v.as_array()
            .into_iter()
            .flatten()
            .filter_map(|s| s.as_str().map(str::to_owned))
            .collect()
    };
    template["spec"]["agentSpec"]["workload"]["manifests"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|m| m["kind"] == "Role" || m["kind"] == "ClusterRole")
        .flat_map(|role| {
            let kind = role["kind"].as_str().unwrap().to_owned();
            role["rules"]
                .as_array()
                .unwrap()
                .iter()
                .filter(|rule| strings(&rule["resources"]).contains(&"secrets".to_owned()))
                .map(move |rule| {
                    (
                        kind.clone(),
                        strings(&rule["resourceNames"]),
                        strings(&rule["verbs"]),
                    )
                })
                .collect::<Vec<_>>()
        })
        .collect()
}

/// The cluster pull Secret's name comes from a variable, which renders empty when unset;
/// an empty resource name grants a list of every Secret of the namespace. So it is only
/// ever read by name, and no rule grants more than `create` on Secrets without names.
#[test]
fn the_proxy_reads_the_cluster_pull_secret_by_name_only_and_no_secret_unnamed() {
    let template: Value = serde_yaml_ng::from_str(&read("addon-template.yaml")).unwrap();
    let rules = secret_rules(&template);
    let by_variable: Vec<_> = rules
        .iter()
        .filter(|(_, names, _)| names.contains(&format!("{{{{{CLUSTER_PULL_SECRET}}}}}")))
        .collect();
    assert_eq!(by_variable.len(), 1, "{rules:?}");
    let (kind, names, verbs) = by_variable[0];
    assert_eq!(kind, "Role", "in the add-on's namespace only");
    assert_eq!(names.len(), 1, "{names:?}");
    assert_eq!(verbs, &["get"], "never list or watch");
    for (kind, names, verbs) in &rules {
        if names.is_empty() {
            assert_eq!(verbs, &["create"], "{kind}: Secrets of any name");
        }
        assert!(
            !verbs.iter().any(|v| v == "list" || v == "watch")
                || !names.iter().any(|n| n.contains("{{")),
            "{kind}: list or watch of a name a variable renders: {names:?} {verbs:?}"
        );
    }
    // The proxy's run arguments name the same variable.
    assert!(read("addon-template.yaml").contains("--cluster-pull-secret={{CLUSTER_PULL_SECRET}}"));
}

#[test]
fn the_signer_names_the_ca_secret_kmm_hub_creates() {
    let template: Value = serde_yaml_ng::from_str(&read("addon-template.yaml")).unwrap();
    let signer = &template["spec"]["registration"][0]["customSigner"];
    assert_eq!(signer["signerName"], "kmm.sigs.x-k8s.io/hub-client");
    assert_eq!(signer["signingCA"]["name"], kmm_hub::serve::ca::CA_SECRET);
    assert_eq!(signer["signingCA"]["namespace"], "kmm-hub");
}

#[test]
fn builds_run_in_their_own_namespace_whose_pod_security_admits_buildah() {
    let hub = hub_documents("namespace.yaml");
    let hub_namespace = find(&hub, "Namespace");
    assert_eq!(
        hub_namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"], "restricted",
        "the hub's own namespace stays restricted"
    );
    let builds = hub_documents("builds.yaml");
    let namespace = find(&builds, "Namespace");
    let name =
        kmm_hub::build::builds_namespace(hub_namespace["metadata"]["name"].as_str().unwrap());
    assert_eq!(namespace["metadata"]["name"], name.as_str());
    // CAP_SYS_ADMIN, which buildah needs, is beyond `baseline`.
    assert_eq!(
        namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"],
        "privileged"
    );
    let kustomization: Value =
        serde_yaml_ng::from_str(&read_in("hub", "kustomization.yaml")).unwrap();
    assert!(
        kustomization["resources"]
            .as_array()
            .unwrap()
            .iter()
            .any(|r| r == "builds.yaml"),
        "the kustomization installs builds.yaml"
    );
}

#[test]
fn the_hub_may_do_in_the_builds_namespace_exactly_what_its_builds_need() {
    let builds = hub_documents("builds.yaml");
    let role = find(&builds, "Role");
    let binding = find(&builds, "RoleBinding");
    let namespace = find(&builds, "Namespace")["metadata"]["name"].clone();
    assert_eq!(role["metadata"]["namespace"], namespace);
    assert_eq!(binding["metadata"]["namespace"], namespace);
    assert_eq!(binding["roleRef"]["name"], role["metadata"]["name"]);
    let subject = &binding["subjects"][0];
    assert_eq!(
        (&subject["kind"], &subject["name"], &subject["namespace"]),
        (
            &Value::from("ServiceAccount"),
            &Value::from("kmm-hub"),
            &Value::from("kmm-hub")
        )
    );
    let mut granted = BTreeSet::new();
    for rule in role["rules"].as_array().unwrap() {
        for group in rule["apiGroups"].as_array().unwrap() {
            for resource in rule["resources"].as_array().unwrap() {
                for verb in rule["verbs"].as_array().unwrap() {
                    granted.insert(format!(
                        "{}/{}:{}",
                        group.as_str().unwrap(),
                        resource.as_str().unwrap(),
                        verb.as_str().unwrap()
                    ));
                }
            }
        }
    }
    // What `BuildJobs` calls (reading, creating, resuming and deleting Jobs; listing their
    // Pods and reading a log; creating the copies), and watching Jobs and Pods, which the
    // pipeline's informers need. Nothing else: no reading back a copied Secret.
    let needed: BTreeSet<String> = [
        "batch/jobs:get",
        "batch/jobs:list",
        "batch/jobs:watch",
        "batch/jobs:create",
        "batch/jobs:patch",
        "batch/jobs:delete",
        "/pods:get",
        "/pods:list",
        "/pods:watch",
        "/pods/log:get",
        "/configmaps:create",
        "/secrets:create",
    ]
    .iter()
    .map(|s| (*s).to_owned())
    .collect();
    assert_eq!(granted, needed);
}
