//! Validation reports every problem at once, each with its field path and value.

use kmm_api::ModuleSpec;
use kmm_resolver::{ModuleIdentity, validate};

fn errors(yaml: &str, name: &str, namespace: &str) -> Vec<String> {
    let spec: ModuleSpec = serde_yaml_ng::from_str(yaml).expect("test spec parses");
    let identity = ModuleIdentity {
        name,
        namespace,
        spec_path: "spec.moduleSpec",
    };
    match validate(&spec, identity) {
        Ok(()) => Vec::new(),
        Err(e) => e.0.iter().map(ToString::to_string).collect(),
    }
}

const C: &str = "spec.moduleSpec.moduleLoader.container";

/// A module with only a device plugin (upstream's in-tree driver case).
const PLUGIN_ONLY: &str = "selector: {}\ndevicePlugin:\n  container: {image: r.example/plugin:1}\n";

#[test]
fn a_good_spec_has_no_errors() {
    let spec = r#"
selector: {}
tolerations: [{key: gpu, operator: Exists, effect: NoSchedule}]
moduleLoader:
  container:
    version: "1.0"
    containerImage: 'r.example/m:${KERNEL_FULL_VERSION}'
    modprobe: {moduleName: m, modulesLoadingOrder: [m, dep]}
    kernelMappings: [{regexp: '^6\.1\.'}, {literal: 5.14.0, containerImage: 'r.example/m@sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef'}]
"#;
    assert_eq!(errors(spec, "m", "ns"), Vec::<String>::new());
}

#[test]
fn every_error_is_reported_with_its_path() {
    let spec = r#"
selector: {}
tolerations: [{operator: Equal, value: x}, {key: k, operator: Sometimes}, {key: k, tolerationSeconds: 5}]
moduleLoader:
  container:
    version: "not a label value!"
    imagePullPolicy: Sometimes
    inTreeModuleToRemove: a
    inTreeModulesToRemove: [b]
    modprobe:
      moduleName: m
      rawArgs: {load: [x]}
      modulesLoadingOrder: [other, m, other]
    sign:
      keySecret: {name: k}
      certSecret: {name: c}
      filesToSign: [/etc/evil.ko, '/opt/../etc/evil.ko', '/opt/lib/[.ko', '/opt/lib/*/*.ko']
    kernelMappings:
      - {literal: 6.1.0, regexp: '6', containerImage: r.example/a:v1}
      - {containerImage: r.example/a:v1}
      - {regexp: '(', containerImage: r.example/a:v1}
      - {regexp: '.', containerImage: r.example/no-tag}
      - {regexp: '.', containerImage: 'r.example/a:${NOT_A_VARIABLE}'}
      - {regexp: '.', containerImage: 'r.example/a:${KERNEL_X'}
      - {regexp: '.', containerImage: 'r.example/UPPER:v1'}
      - {regexp: '.'}
"#;
    let got = errors(
        spec,
        "a-module-name-that-is-quite-long",
        "and-a-namespace-too",
    );
    let expect_prefixes = [
        "metadata.name: \"a-module-name-that-is-quite-long\": name and namespace",
        "spec.moduleSpec.tolerations[0].operator: \"Equal\": must be Exists when key is empty",
        "spec.moduleSpec.tolerations[1].operator: \"Sometimes\": must be Equal or Exists",
        "spec.moduleSpec.tolerations[2].tolerationSeconds: requires effect NoExecute",
        &format!("{C}.imagePullPolicy: \"Sometimes\""),
        &format!("{C}.version: \"not a label value!\""),
        &format!("{C}.inTreeModuleToRemove: \"a\": only one of"),
        &format!("{C}.kernelMappings[0]: literal and regexp are mutually exclusive"),
        &format!("{C}.kernelMappings[1]: set exactly one of literal or regexp"),
        &format!("{C}.kernelMappings[2].regexp: \"(\": does not compile: unclosed group"),
        &format!(
            "{C}.kernelMappings[3].containerImage: \"r.example/no-tag\": has neither a tag nor a digest"
        ),
        &format!(
            "{C}.kernelMappings[4].containerImage: \"r.example/a:${{NOT_A_VARIABLE}}\": unknown variable NOT_A_VARIABLE"
        ),
        &format!("{C}.kernelMappings[5].containerImage: \"r.example/a:${{KERNEL_X\": unterminated"),
        &format!(
            "{C}.kernelMappings[6].containerImage: \"r.example/UPPER:v1\": is not a valid image reference"
        ),
        &format!("{C}.kernelMappings[7].containerImage: no image"),
        &format!("{C}.modprobe.rawArgs: must not be set together with moduleName"),
        &format!("{C}.modprobe.modulesLoadingOrder[0]: \"other\": must be moduleName \"m\""),
        &format!("{C}.modprobe.modulesLoadingOrder[2]: \"other\": appears more than once"),
        &format!(
            "{C}.sign.filesToSign[0]: \"/etc/evil.ko\": must be a path under modprobe.dirName \"/opt\""
        ),
        &format!("{C}.sign.filesToSign[1]: \"/opt/../etc/evil.ko\": must be a path under"),
        &format!("{C}.sign.filesToSign[2]: \"/opt/lib/[.ko\": is not a valid glob"),
    ];
    for prefix in &expect_prefixes {
        assert!(
            got.iter().any(|e| e.starts_with(prefix)),
            "missing error starting with {prefix:?}; got:\n{}",
            got.join("\n")
        );
    }
    assert_eq!(
        got.len(),
        expect_prefixes.len(),
        "unexpected extra errors:\n{}",
        got.join("\n")
    );
}

#[test]
fn pull_policies_are_upstreams_three_on_every_container() {
    let spec = |policy: &str| {
        format!(
            r#"
selector: {{}}
moduleLoader:
  container:
    imagePullPolicy: {policy}
    modprobe: {{moduleName: m}}
    kernelMappings: [{{regexp: '.', containerImage: r.example/a:v1}}]
devicePlugin:
  container: {{image: r.example/plugin:v1, imagePullPolicy: {policy}}}
  initContainer: {{image: r.example/init:v1, imagePullPolicy: {policy}}}
"#
        )
    };
    for policy in ["Always", "IfNotPresent", "Never"] {
        assert_eq!(
            errors(&spec(policy), "m", "ns"),
            Vec::<String>::new(),
            "{policy}"
        );
    }
    let got = errors(&spec("always"), "m", "ns");
    let must = "\"always\": must be one of Always, Never, IfNotPresent";
    assert_eq!(
        got,
        [
            format!("spec.moduleSpec.devicePlugin.container.imagePullPolicy: {must}"),
            format!("spec.moduleSpec.devicePlugin.initContainer.imagePullPolicy: {must}"),
            format!("{C}.imagePullPolicy: {must}"),
        ]
    );
}

#[test]
fn raw_args_need_load_and_unload_without_module_name() {
    let spec = r#"
selector: {}
moduleLoader:
  container:
    modprobe: {rawArgs: {load: [-d, /opt, m]}}
    kernelMappings: [{regexp: '.', containerImage: r.example/a:v1}]
"#;
    assert_eq!(
        errors(spec, "m", "ns"),
        [format!(
            "{C}.modprobe.moduleName: required unless rawArgs sets both load and unload"
        )]
    );
}

#[test]
fn loading_order_needs_two_entries_and_a_module_name() {
    let spec = r#"
selector: {}
moduleLoader:
  container:
    modprobe: {rawArgs: {load: [a], unload: [b]}, modulesLoadingOrder: [m]}
    kernelMappings: [{regexp: '.', containerImage: r.example/a:v1}]
"#;
    let got = errors(spec, "m", "ns");
    assert_eq!(got.len(), 2, "{got:?}");
    assert!(got[0].ends_with("when set, must list at least two modules"));
    assert!(got[1].ends_with("requires moduleName to be set"));
}

#[test]
fn spoke_namespace_must_be_a_dns_label() {
    let spec = PLUGIN_ONLY;
    assert_eq!(
        errors(spec, "m", "Bad_NS"),
        [
            "spec.spokeNamespace: \"Bad_NS\": must be a valid namespace name: lowercase letters, digits and '-', at most 63 characters"
        ]
    );
    assert!(
        errors(spec, "m", "")
            .iter()
            .any(|e| e.starts_with("spec.spokeNamespace"))
    );
}

#[test]
fn name_and_namespace_fit_the_node_label_bound() {
    let spec = PLUGIN_ONLY;
    assert!(errors(spec, &"n".repeat(21), &"s".repeat(20)).is_empty());
    assert_eq!(errors(spec, &"n".repeat(22), &"s".repeat(20)).len(), 1);
}

#[test]
fn a_module_needs_a_loader_or_a_device_plugin() {
    assert_eq!(errors(PLUGIN_ONLY, "m", "ns"), Vec::<String>::new());
    assert_eq!(
        errors("selector: {}\n", "m", "ns"),
        [
            "spec.moduleSpec.moduleLoader: must be set when devicePlugin is not: the module \
             would load nothing and run nothing"
        ]
    );
}
