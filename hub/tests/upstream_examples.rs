//! Upstream Kernel Module Management's documented examples (`api/tests/fixtures/
//! upstream-docs/`, written anew in upstream's shapes), applied: each passes the hub's
//! admission, renders as `kmm-hub render` renders it, and is sent to a cluster's proxy
//! as upstream documents the feature to behave.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::jiff::Timestamp;
use kmm_api::ManagedClusterModule;
use kmm_api::labels::version_module_label;
use kmm_hub::admission::review;
use kmm_hub::build::request::BuildRequest;
use kmm_hub::fleet::built_intents::BuiltIntents;
use kmm_hub::fleet::intents::{ClusterImages, ModuleInput, cluster_intents, selects};
use kmm_hub::images::{ImageKey, ImageNeed, ImageRecord, module_needs};
use kmm_hub::resolutions::Resolutions;
use kmm_proto::v1::kernel_target::Target;
use kmm_proto::v1::pull_credential::Content;
use kmm_proto::v1::{IntentSnapshot, ModuleLoad, PullCredential};
use kmm_resolver::{MatchedBy, ModuleIdentity, Resolution, ResolveError, Resolver};
use kube::core::DynamicObject;
use kube::core::admission::{AdmissionRequest, AdmissionReview};
use serde_json::json;

macro_rules! example {
    ($name:literal) => {
        include_str!(concat!(
            "../../api/tests/fixtures/upstream-docs/",
            $name,
            ".yaml"
        ))
    };
}

fn mcm(text: &str) -> ManagedClusterModule {
    let mut module: ManagedClusterModule =
        serde_yaml_ng::from_str(text).expect("the example reads");
    module.metadata.uid = Some("uid-1".into());
    module.metadata.generation = Some(1);
    module
}

/// The hub's admission of a create of `module`: allowed, with these warnings.
fn admitted(module: &ManagedClusterModule) -> Vec<String> {
    let review_json = json!({
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": "5f0c6d2e-8a47-4f0b-9d55-1b2c3d4e5f60",
            "kind": {"group": "hub.kmm.sigs.x-k8s.io", "version": "v1beta1", "kind": "ManagedClusterModule"},
            "resource": {"group": "hub.kmm.sigs.x-k8s.io", "version": "v1beta1", "resource": "managedclustermodules"},
            "name": module.metadata.name,
            "operation": "CREATE",
            "userInfo": {"username": "platform-team"},
            "object": module,
        },
    });
    let review_object: AdmissionReview<DynamicObject> =
        serde_json::from_value(review_json).expect("a well-formed review");
    let request: AdmissionRequest<DynamicObject> =
        review_object.try_into().expect("the review has a request");
    let response = review(&request, &BTreeMap::new());
    assert!(
        response.allowed,
        "{:?} refused: {}",
        module.metadata.name, response.result.message
    );
    response.warnings.unwrap_or_default()
}

/// What `kmm-hub render` resolves for `kernel`.
fn render(module: &ManagedClusterModule, kernel: &str) -> Result<Resolution, ResolveError> {
    let name = module.metadata.name.clone().unwrap_or_default();
    let identity = ModuleIdentity {
        name: &name,
        namespace: &module.spec.spoke_namespace,
        spec_path: "spec.moduleSpec",
    };
    Resolver::new(&module.spec.module_spec, identity)
        .expect("the example validates")
        .resolve(kernel)
}

/// The module's images as the hub needs them on `kernels`.
fn needs(module: &ManagedClusterModule, kernels: &[&str]) -> BTreeMap<ImageKey, ImageNeed> {
    let kernels: BTreeSet<String> = kernels.iter().map(|k| (*k).to_owned()).collect();
    let mut resolutions = Resolutions::default();
    module_needs(
        module,
        resolutions.resolve(module, &kernels),
        &kernels,
        Some(Duration::from_secs(300)),
    )
}

/// The snapshot a cluster running `kernels` gets, every image found; `secrets` are the
/// pull Secrets the hub's namespace holds.
fn sent(module: &ManagedClusterModule, kernels: &[&str], secrets: &[&str]) -> IntentSnapshot {
    let images: BTreeMap<ImageKey, ImageRecord> = needs(module, kernels)
        .into_iter()
        .map(|(key, need)| {
            let record = ImageRecord::seeded(&need, "sha256:feed".into(), Timestamp::UNIX_EPOCH);
            (key, record)
        })
        .collect();
    let credentials = secrets
        .iter()
        .map(|name| {
            let content = Content::DockerConfigJson(br#"{"auths":{}}"#.to_vec());
            let credential = PullCredential {
                id: (*name).to_owned(),
                content: Some(content),
            };
            ((*name).to_owned(), credential)
        })
        .collect();
    let kernels: BTreeSet<String> = kernels.iter().map(|k| (*k).to_owned()).collect();
    cluster_intents(
        &[ModuleInput {
            module: &Arc::new(module.clone()),
            unload: false,
        }],
        &kernels,
        &credentials,
        ClusterImages {
            records: &images,
            spoke_pins: &BTreeMap::new(),
            cluster: "spoke1",
            mirrors: &[],
            versions: &BTreeMap::new(),
        },
        &mut Resolutions::default(),
        &mut BuiltIntents::default(),
    )
    .snapshot
    .to_wire()
}

/// The load `kernel`'s nodes are sent.
fn load_on(snapshot: &IntentSnapshot, kernel: &str) -> ModuleLoad {
    let target = snapshot.modules[0]
        .kernels
        .iter()
        .find(|t| t.kernel == kernel)
        .and_then(|t| t.target.clone());
    match target {
        Some(Target::Load(load)) => load,
        other => panic!("kernel {kernel} loads nothing: {other:?}"),
    }
}

#[test]
fn kernel_mappings_match_literal_first_then_each_regexp_in_order() {
    let module = mcm(example!("kernel-mappings"));
    assert!(admitted(&module).is_empty());
    let literal = render(&module, "6.8.9-300.fc40.x86_64").unwrap();
    assert_eq!(
        literal.container_image,
        "registry.example.com/acme/nic:pinned-6.8.9"
    );
    assert_eq!(
        literal.matched_by,
        MatchedBy::Literal("6.8.9-300.fc40.x86_64".into())
    );
    let fedora = render(&module, "6.9.1-200.fc40.x86_64").unwrap();
    assert_eq!(
        fedora.container_image,
        "registry.example.com/acme/nic-fedora:6.9.1-200.fc40.x86_64"
    );
    assert_eq!(fedora.mapping_index, 1);
    let other = render(&module, "6.1.0-13-amd64").unwrap();
    assert_eq!(
        other.container_image,
        "registry.example.com/acme/nic:6.1.0-13-amd64"
    );
    assert_eq!(other.mapping_index, 2);
    // Selected clusters, as the ManagedClusterModule's own selector says.
    let labels = |value: &str| BTreeMap::from([("fleet.example.com/nic".into(), value.into())]);
    assert!(selects(&module.spec.selector, &labels("acme")));
    assert!(!selects(&module.spec.selector, &labels("other")));
}

#[test]
fn a_build_gets_the_dockerfile_config_map_its_arguments_and_secrets() {
    let module = mcm(example!("build"));
    assert!(admitted(&module).is_empty());
    let kernel = "6.1.0-13-amd64";
    let resolution = render(&module, kernel).unwrap();
    let build = resolution.build.clone().expect("a build");
    assert_eq!(build.dockerfile_config_map.name, "acme-nic-dockerfile");
    let needed = needs(&module, &[kernel]);
    let need = needed.values().next().expect("one image");
    assert_eq!(
        need.pull_secret.as_deref(),
        Some("acme-push"),
        "pushes with it"
    );
    let request = BuildRequest {
        module: "acme-build".into(),
        module_uid: "uid-1".into(),
        spoke_namespace: module.spec.spoke_namespace.clone(),
        kernel: kernel.into(),
        image: resolution.container_image.clone(),
        build,
        registry_tls: None,
        push_secret: need.pull_secret.clone(),
        dockerfile: "FROM scratch\n".into(),
        rebuild_generation: 0,
    };
    let args = request.build_args();
    assert_eq!(args["DRIVER_RELEASE"], "2.4.1");
    assert_eq!(args["KERNEL_FULL_VERSION"], kernel, "as upstream passes it");
    assert_eq!(
        request.secret_names(),
        BTreeSet::from(["acme-source-token".to_owned()])
    );
}

#[test]
fn a_prebuilt_image_is_signed_file_by_file_and_glob_by_glob() {
    let module = mcm(example!("sign-prebuilt"));
    assert!(admitted(&module).is_empty());
    let kernel = "5.14.0-427.13.1.el9_4.x86_64";
    let sign = render(&module, kernel).unwrap().sign.expect("signed");
    assert_eq!(
        sign.files_to_sign.as_deref().unwrap_or_default(),
        [
            format!("/opt/lib/modules/{kernel}/acme_nic.ko"),
            format!("/opt/lib/modules/{kernel}/acme_*.ko"),
            format!("/opt/lib/modules/{kernel}/acme-[ab].ko"),
        ]
    );
    let needed = needs(&module, &[kernel]);
    let (key, need) = needed.iter().next().expect("one image");
    assert_eq!(
        key.image,
        format!("registry.example.com/acme/nic:{kernel}-signed")
    );
    let plan = need.sign.as_ref().expect("a signing plan");
    assert_eq!(
        plan.unsigned_image,
        format!("registry.example.com/vendor/nic:{kernel}")
    );
    assert_eq!(
        (plan.key_secret.as_str(), plan.cert_secret.as_str()),
        ("acme-signing-key", "acme-signing-cert")
    );
    assert!(need.build.is_none(), "nothing is built");
    // A kernel the mapping does not match gets nothing (upstream skips its nodes).
    assert!(render(&module, "6.1.0-13-arm64").is_err());
}

#[test]
fn a_build_then_signing_goes_through_upstreams_unsigned_image() {
    let module = mcm(example!("build-and-sign"));
    assert!(admitted(&module).is_empty());
    let needed = needs(&module, &["5.14.0-427.13.1.el9_4.x86_64"]);
    let (key, need) = needed.iter().next().expect("one image");
    let plan = need.sign.as_ref().expect("a signing plan");
    assert_eq!(
        plan.unsigned_image,
        "registry.example.com/acme/nic:release-acme-drivers_acme-built-signed_kmm_unsigned"
    );
    assert_eq!(need.build_target(&key.image), plan.unsigned_image);
    assert_eq!(
        plan.files,
        ["/opt/lib/modules/5.14.0-427.13.1.el9_4.x86_64/*.ko"]
    );
}

#[test]
fn in_tree_modules_are_removed_first_and_a_mappings_list_wins() {
    let module = mcm(example!("in-tree-removal"));
    assert!(admitted(&module).is_empty());
    let snapshot = sent(&module, &["6.1.0-13-amd64", "6.1.0-20-amd64"], &[]);
    assert_eq!(
        load_on(&snapshot, "6.1.0-13-amd64").in_tree_modules_to_remove,
        ["acme_legacy"]
    );
    assert_eq!(
        load_on(&snapshot, "6.1.0-20-amd64").in_tree_modules_to_remove,
        ["acme_nic", "acme_nic_core"]
    );
}

#[test]
fn modprobe_gets_the_parameters_arguments_directory_and_loading_order() {
    let module = mcm(example!("modprobe"));
    assert!(admitted(&module).is_empty());
    let load = load_on(&sent(&module, &["6.1.0-13-amd64"], &[]), "6.1.0-13-amd64");
    let modprobe = load.modprobe.expect("modprobe settings");
    assert_eq!(modprobe.module_name, "acme_nic");
    assert_eq!(modprobe.dir_name, "/opt");
    assert_eq!(modprobe.parameters, ["queues=8", "debug=0"]);
    let args = modprobe.args.expect("arguments");
    assert_eq!(
        (args.load, args.unload),
        (vec!["--verbose".to_owned()], vec!["--verbose".to_owned()])
    );
    assert_eq!(
        modprobe.modules_loading_order,
        ["acme_nic", "acme_nic_core"]
    );
    assert!(modprobe.raw_args.is_none());
}

#[test]
fn raw_args_replace_modprobes_arguments_entirely() {
    let module = mcm(example!("modprobe-raw-args"));
    assert!(admitted(&module).is_empty());
    let load = load_on(&sent(&module, &["6.1.0-13-amd64"], &[]), "6.1.0-13-amd64");
    let modprobe = load.modprobe.expect("modprobe settings");
    let raw = modprobe.raw_args.expect("raw arguments");
    assert_eq!(raw.load, ["-d", "/opt", "acme_nic", "queues=4"]);
    assert_eq!(raw.unload, ["-r", "-d", "/opt", "acme_nic"]);
    assert!(modprobe.module_name.is_empty());
}

#[test]
fn firmware_is_copied_from_the_images_firmware_path() {
    let module = mcm(example!("firmware"));
    assert!(admitted(&module).is_empty());
    let load = load_on(&sent(&module, &["6.1.0-13-amd64"], &[]), "6.1.0-13-amd64");
    assert_eq!(load.modprobe.expect("modprobe").firmware_path, "/firmware");
}

#[test]
fn a_device_plugin_alone_runs_on_the_selected_nodes_whatever_their_kernel() {
    let module = mcm(example!("device-plugin-only"));
    assert!(admitted(&module).is_empty());
    let snapshot = sent(
        &module,
        &["6.1.0-13-amd64", "5.14.0-427.13.1.el9_4.x86_64"],
        &[],
    );
    let intent = &snapshot.modules[0];
    assert!(intent.device_plugin_only);
    assert!(intent.kernels.is_empty(), "nothing to load on any kernel");
    let plugin: serde_json::Value =
        serde_json::from_str(&intent.device_plugin.as_ref().expect("the plugin").spec_json)
            .unwrap();
    assert_eq!(
        plugin["container"]["image"],
        "registry.example.com/acme/device-plugin:v3"
    );
    assert_eq!(
        plugin["initContainer"]["image"],
        "registry.example.com/acme/wait-for-device:v3"
    );
    assert_eq!(
        intent
            .node_selector
            .get("node-role.kubernetes.io/worker")
            .map(String::as_str),
        Some("")
    );
}

#[test]
fn the_image_repo_secret_pulls_the_kmod_and_names_the_plugins_pull_secret() {
    let module = mcm(example!("image-repo-secret"));
    assert!(admitted(&module).is_empty());
    let snapshot = sent(&module, &["6.1.0-13-amd64"], &["acme-private-pull"]);
    let load = load_on(&snapshot, "6.1.0-13-amd64");
    assert_eq!(load.pull_credential_id, "acme-private-pull");
    assert_eq!(
        snapshot.credentials.len(),
        1,
        "the Secret's content travels with it"
    );
    let plugin = snapshot.modules[0]
        .device_plugin
        .as_ref()
        .expect("the plugin");
    assert_eq!(
        plugin.image_repo_secret, "acme-private-pull",
        "named, never copied"
    );
    // Without the Secret on the hub, nodes are told why, naming it.
    let without = sent(&module, &["6.1.0-13-amd64"], &[]);
    match &without.modules[0].kernels[0].target {
        Some(Target::Unresolved(why)) => {
            assert_eq!(why.reason, "PullSecretNotFound");
            assert!(why.message.contains("acme-private-pull"), "{}", why.message);
        }
        other => panic!("loaded without its Secret: {other:?}"),
    }
}

#[test]
fn a_version_moves_nodes_as_their_version_label_says() {
    let module = mcm(example!("ordered-upgrade"));
    assert!(admitted(&module).is_empty());
    let load = load_on(&sent(&module, &["6.1.0-13-amd64"], &[]), "6.1.0-13-amd64");
    assert_eq!(load.version, "2.4.1");
    assert_eq!(
        version_module_label("acme-drivers", "acme-ordered"),
        "kmm.node.kubernetes.io/version-module.acme-drivers.acme-ordered"
    );
}

#[test]
fn tolerations_and_the_node_selector_travel_to_the_proxy() {
    let module = mcm(example!("tolerations-and-selector"));
    assert!(admitted(&module).is_empty());
    let snapshot = sent(&module, &["6.1.0-13-amd64"], &[]);
    let intent = &snapshot.modules[0];
    let tolerations: Vec<(&str, &str, &str, &str)> = intent
        .tolerations
        .iter()
        .map(|t| {
            (
                t.key.as_str(),
                t.operator.as_str(),
                t.value.as_str(),
                t.effect.as_str(),
            )
        })
        .collect();
    assert_eq!(
        tolerations,
        [
            (
                "acme.example.com/nic-maintenance",
                "Exists",
                "",
                "NoSchedule"
            ),
            ("dedicated", "Equal", "network", "NoExecute"),
        ]
    );
    assert_eq!(intent.node_selector.len(), 2);
    assert_eq!(
        intent
            .node_selector
            .get("feature.node.kubernetes.io/pci-1d0f.present")
            .map(String::as_str),
        Some("true")
    );
}

#[test]
fn always_follows_the_tag_and_the_plugins_policy_goes_to_its_pods() {
    let module = mcm(example!("image-pull-policy"));
    assert!(admitted(&module).is_empty());
    let needed = needs(&module, &["6.1.0-13-amd64"]);
    assert_eq!(
        needed.values().next().expect("one image").follow_interval,
        Some(Duration::from_secs(300)),
        "the hub resolves the tag again"
    );
    let snapshot = sent(&module, &["6.1.0-13-amd64"], &[]);
    let load = load_on(&snapshot, "6.1.0-13-amd64");
    assert_eq!(
        load.digest, "sha256:feed",
        "nodes load the digest the hub pinned"
    );
    let plugin: serde_json::Value = serde_json::from_str(
        &snapshot.modules[0]
            .device_plugin
            .as_ref()
            .expect("the plugin")
            .spec_json,
    )
    .unwrap();
    assert_eq!(plugin["container"]["imagePullPolicy"], "IfNotPresent");
}
