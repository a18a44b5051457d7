//! What one managed cluster must run: every selected module resolved for every kernel the
//! cluster reported, each image pinned to the digest the hub found for it, as the
//! IntentSnapshot streamed to its spoke proxy. Pure.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use kmm_api::{ManagedClusterModule, MaxUnavailable};
use kmm_proto::v1::{
    DevicePlugin, ImageResolution, KernelTarget, Modprobe, ModprobeArgs, ModuleIntent, ModuleKey,
    ModuleLoad, PullCredential, RegistryTls, Toleration, Unresolved, kernel_target::Target,
    module_intent,
};
use kmm_resolver::Resolution;
use kube::ResourceExt;

use super::built_intents::{BuiltFrom, BuiltIntents};
use super::mirrors::{ImageMirror, mirrored};
use super::shared_snapshot::SharedSnapshot;
use crate::images::need::pin_generation;
use crate::images::spoke_pins::cluster_verdict;
use crate::images::{ClusterVerdict, ImageKey, ImageRecord, SpokePins, Verdict};
use crate::resolutions::{ModuleResolutions, Resolutions};

/// A module as the hub sees it for one cluster.
#[derive(Clone, Copy, Debug)]
pub struct ModuleInput<'a> {
    pub module: &'a Arc<ManagedClusterModule>,
    /// Unload everywhere in the cluster: the module is being deleted, or the cluster is no
    /// longer selected. Unloading is always explicit, never inferred from absence.
    pub unload: bool,
}

/// Whether `selector` (matchLabels semantics; empty selects every cluster, as upstream)
/// selects a cluster with `labels`.
pub fn selects(selector: &BTreeMap<String, String>, labels: &BTreeMap<String, String>) -> bool {
    selector
        .iter()
        .all(|(key, value)| labels.get(key) == Some(value))
}

/// A cluster's snapshot, and whether an image it loads has not been checked yet.
#[derive(Clone, Debug, PartialEq)]
pub struct ClusterIntents {
    pub snapshot: SharedSnapshot,
    /// The images to load that have no record yet: sending their modules now would tell
    /// nodes "not checked" where they may be running them fine (after a failover, say).
    /// See [`while_unchecked`].
    pub unchecked: BTreeSet<ImageKey>,
}

/// The snapshot to send while some modules' images are not checked yet, so that they hold
/// up nothing else (other modules' changes, unloads): each such module keeps the intent
/// it was last sent (`previous`), and one never sent is left out until its check, unless
/// it `runs` on the cluster (a failover: nothing to keep it at, and leaving it out would
/// stop its device plugin). `None`: hold the whole snapshot until the checks.
pub fn while_unchecked(
    mut snapshot: SharedSnapshot,
    unchecked: &BTreeSet<ImageKey>,
    previous: Option<&SharedSnapshot>,
    runs: impl Fn(&ModuleKey) -> bool,
) -> Option<SharedSnapshot> {
    let before = |key: &ModuleKey| {
        previous?
            .modules
            .iter()
            .find(|m| m.key.as_ref() == Some(key))
            .cloned()
    };
    let mut kept = Vec::with_capacity(snapshot.modules.len());
    for intent in std::mem::take(&mut snapshot.modules) {
        let key = intent.key.clone().unwrap_or_default();
        if !unchecked.iter().any(|image| image.module == key.name) {
            kept.push(intent);
            continue;
        }
        match before(&key) {
            Some(earlier) => {
                let credential = earlier
                    .kernels
                    .iter()
                    .filter_map(|k| match &k.target {
                        Some(Target::Load(load)) => Some(load.pull_credential_id.as_str()),
                        _ => None,
                    })
                    .find(|id| !id.is_empty())
                    .map(str::to_owned);
                if let Some(id) = credential
                    && !snapshot.credentials.iter().any(|c| c.id == id)
                    && let Some(found) = previous
                        .into_iter()
                        .flat_map(|p| &p.credentials)
                        .find(|c| c.id == id)
                {
                    snapshot.credentials.push(found.clone());
                }
                kept.push(earlier);
            }
            None if runs(&key) => return None,
            None => {}
        }
    }
    snapshot.modules = kept;
    Some(snapshot)
}

/// Where the images stand for one cluster: the hub's records, and the digests clusters
/// resolved for the images the hub cannot check.
#[derive(Clone, Copy, Debug)]
pub struct ClusterImages<'a> {
    pub records: &'a BTreeMap<ImageKey, ImageRecord>,
    pub spoke_pins: &'a BTreeMap<ImageKey, SpokePins>,
    /// The cluster the snapshot is for: its own pins apply.
    pub cluster: &'a str,
    /// Per module, a count that moves whenever one of its records changes: an intent
    /// built from the records at one count holds until it moves (see `built_intents`).
    pub versions: &'a BTreeMap<String, u64>,
    /// The cluster's image mirrors (its AddOnDeploymentConfig's `registries`): its loads
    /// and device plugins pull through them, a load still by its pinned digest.
    pub mirrors: &'a [ImageMirror],
}

/// Builds the cluster's snapshot (revision left at 0 for the caller to stamp).
/// `credentials` maps pull Secret names in the hub's namespace to their content; only the
/// credentials an image of this snapshot needs are included. `images` is where each
/// image stands: only an image with a digest is loaded, by that digest (the hub's, or the
/// one this cluster resolved); one the cluster is to resolve is sent as a resolution.
/// An intent built for another cluster from the same inputs is taken from `built`.
pub fn cluster_intents(
    modules: &[ModuleInput<'_>],
    kernels: &BTreeSet<String>,
    credentials: &BTreeMap<String, PullCredential>,
    images: ClusterImages<'_>,
    resolutions: &mut Resolutions,
    built: &mut BuiltIntents,
) -> ClusterIntents {
    let mut needed = BTreeSet::new();
    let mut unchecked = BTreeSet::new();
    let mut intents = Vec::with_capacity(modules.len());
    for input in modules {
        let module = input.module;
        let name = module.metadata.name.as_deref().unwrap_or_default();
        let from = BuiltFrom {
            kernels,
            mirrors: images.mirrors,
            secret_found: image_repo_secret(module).is_none_or(|s| credentials.contains_key(s)),
            images_version: images.versions.get(name).copied().unwrap_or_default(),
        };
        if let Some(found) = built.get(module, input.unload, &from) {
            needed.extend(found.needed.iter().cloned());
            unchecked.extend(found.unchecked.iter().cloned());
            intents.push(found.intent.clone());
            continue;
        }
        let mut module_needed = BTreeSet::new();
        let mut module_unchecked = BTreeSet::new();
        let mut cluster_specific = false;
        let mut intent = if module.spec.module_spec.module_loader.is_none() {
            let valid = resolutions.invalid(module).is_none();
            device_plugin_only_intent(input, valid)
        } else {
            module_intent(
                input,
                kernels,
                credentials,
                images,
                resolutions.resolve(module, kernels),
                Found {
                    needed: &mut module_needed,
                    unchecked: &mut module_unchecked,
                    cluster_specific: &mut cluster_specific,
                },
            )
        };
        through_mirrors(&mut intent, images.mirrors);
        needed.extend(module_needed.iter().cloned());
        unchecked.extend(module_unchecked.iter().cloned());
        intents.push(if cluster_specific {
            built.share(intent)
        } else {
            let secret = module_needed.into_iter().next();
            built.keep(
                module,
                input.unload,
                &from,
                intent,
                module_unchecked,
                secret,
            )
        });
    }
    built.sweep();
    ClusterIntents {
        snapshot: SharedSnapshot {
            revision: 0,
            modules: intents,
            credentials: needed
                .into_iter()
                .filter_map(|id| credentials.get(&id).cloned())
                .collect(),
        },
        unchecked,
    }
}

/// What building one module's intent found besides the intent.
struct Found<'a> {
    /// The pull credential its loads name.
    needed: &'a mut BTreeSet<String>,
    /// Its images without a record yet.
    unchecked: &'a mut BTreeSet<ImageKey>,
    /// Whether it holds what the cluster resolved (its own pins), so that another
    /// cluster's intent differs.
    cluster_specific: &'a mut bool,
}

/// The name of the module's `imageRepoSecret`, when it names one.
fn image_repo_secret(mcm: &ManagedClusterModule) -> Option<&str> {
    mcm.spec
        .module_spec
        .image_repo_secret
        .as_ref()
        .map(|s| s.name.as_str())
        .filter(|n| !n.is_empty())
}

fn module_intent(
    input: &ModuleInput<'_>,
    kernels: &BTreeSet<String>,
    credentials: &BTreeMap<String, PullCredential>,
    images: ClusterImages<'_>,
    resolutions: &ModuleResolutions,
    found: Found<'_>,
) -> ModuleIntent {
    let Found {
        needed,
        unchecked,
        cluster_specific,
    } = found;
    let mcm = input.module;
    let name = mcm.name_any();
    let spec = &mcm.spec.module_spec;
    let secret = image_repo_secret(mcm).map(str::to_owned);
    let generation = spec.image_rebuild_trigger_generation.unwrap_or_default();
    // The revision served loads the digests pinned by its pin generation.
    let pinned_at = pin_generation(mcm);
    let targets = kernels
        .iter()
        .map(|kernel| {
            let resolved = match (resolutions.invalid(), resolutions.kernel(kernel)) {
                (Some(errors), _) => Err(unresolved("InvalidSpec", errors.to_owned())),
                (None, Some(Ok(resolution))) => Ok(resolution),
                (None, Some(Err(e))) => Err(unresolved(e.kind.reason(), e.to_string())),
                (None, None) => unreachable!("resolve() resolved every kernel asked"),
            };
            let target = match resolved {
                Err(target) => target,
                Ok(resolution) => match &secret {
                        Some(secret) if !credentials.contains_key(secret) => unresolved(
                            "PullSecretNotFound",
                            format!("spec.moduleSpec.imageRepoSecret: Secret {secret:?} not found in the hub's namespace"),
                        ),
                        _ => {
                            let key = ImageKey {
                                module: name.clone(),
                                image: resolution.container_image.clone(),
                            };
                            let verdict = images.records.get(&key).map(|r| r.verdict_at(pinned_at));
                            // What this cluster resolved is its own.
                            *cluster_specific |= matches!(verdict, Some(Verdict::ResolveOnSpoke));
                            match verdict {
                                Some(Verdict::Load { digest }) => {
                                    needed.extend(secret.clone());
                                    Target::Load(module_load(resolution, secret.as_deref(), digest))
                                }
                                // The hub cannot check it: this cluster's pin, or a request to
                                // make one (with the credentials the load names, or the
                                // cluster's own).
                                Some(Verdict::ResolveOnSpoke) => match cluster_verdict(
                                    images.spoke_pins.get(&key),
                                    generation,
                                    images.cluster,
                                ) {
                                    ClusterVerdict::Load { digest } => {
                                        needed.extend(secret.clone());
                                        Target::Load(module_load(resolution, secret.as_deref(), digest))
                                    }
                                    // A failed answer is shown on the nodes while the
                                    // cluster goes on resolving: the request stays.
                                    verdict @ (ClusterVerdict::Resolve | ClusterVerdict::Wait { .. }) => {
                                        needed.extend(secret.clone());
                                        let failed = match verdict {
                                            ClusterVerdict::Wait { reason, message } => Some(Unresolved {
                                                reason: reason.to_owned(),
                                                message: format!("kernel {kernel}: {message}"),
                                            }),
                                            _ => None,
                                        };
                                        Target::Resolve(ImageResolution {
                                            load: Some(module_load(resolution, secret.as_deref(), "")),
                                            image_generation: generation,
                                            failed,
                                        })
                                    }
                                },
                                Some(Verdict::Wait { reason, message }) => unresolved(
                                    reason,
                                    format!("kernel {kernel}: image {}: {message}", key.image),
                                ),
                                None => {
                                    // An unloading module's targets are never acted on.
                                    if !input.unload {
                                        unchecked.insert(key.clone());
                                    }
                                    unresolved(
                                        "ImageNotChecked",
                                        format!("kernel {kernel}: image {}: not checked yet", key.image),
                                    )
                                }
                            }
                        }
                    },
            };
            KernelTarget { kernel: kernel.clone(), target: Some(target) }
        })
        .collect();
    ModuleIntent {
        kernels: targets,
        ..placed_intent(input)
    }
}

/// The intent's images as the cluster pulls them through its `mirrors`: each load's (by
/// the same digest) and the device plugin's containers'. A request to resolve keeps the
/// image as the hub names it: the cluster's answer is about that name.
fn through_mirrors(intent: &mut ModuleIntent, mirrors: &[ImageMirror]) {
    if mirrors.is_empty() {
        return;
    }
    for target in &mut intent.kernels {
        if let Some(Target::Load(load)) = &mut target.target {
            load.image = mirrored(mirrors, &load.image);
        }
    }
    if let Some(plugin) = &mut intent.device_plugin
        && let Ok(mut spec) = serde_json::from_str::<serde_json::Value>(&plugin.spec_json)
    {
        for container in ["container", "initContainer"] {
            if let Some(image) = spec[container]["image"].as_str() {
                spec[container]["image"] = mirrored(mirrors, image).into();
            }
        }
        plugin.spec_json = spec.to_string();
    }
}

/// What every intent of the module carries: where it goes, whether it leaves, its
/// device plugin; no kernel.
fn placed_intent(input: &ModuleInput<'_>) -> ModuleIntent {
    let mcm = input.module;
    let spec = &mcm.spec.module_spec;
    ModuleIntent {
        key: Some(ModuleKey {
            namespace: mcm.spec.spoke_namespace.clone(),
            name: mcm.name_any(),
        }),
        generation: mcm.metadata.generation.unwrap_or_default(),
        pin_generation: pin_generation(mcm),
        node_selector: spec.selector.clone().into_iter().collect(),
        tolerations: spec.tolerations.iter().flatten().map(toleration).collect(),
        kernels: Vec::new(),
        unload: input.unload,
        max_unavailable: max_unavailable(mcm),
        device_plugin: device_plugin(mcm),
        device_plugin_only: false,
    }
}

/// A module without `moduleLoader` (upstream's in-tree driver with its device plugin):
/// nothing to resolve per kernel, nothing for the agents; the proxy runs its plugin on
/// every node it selects. An invalid spec runs nothing, as a loader module's loads
/// nothing: its plugin stays on the hub, and its status says why.
fn device_plugin_only_intent(input: &ModuleInput<'_>, valid: bool) -> ModuleIntent {
    let mut intent = placed_intent(input);
    intent.device_plugin_only = true;
    if !valid {
        intent.device_plugin = None;
    }
    intent
}

/// The module's device plugin, also on an unload: the proxy stops the plugin on a node
/// before it unloads the module there.
fn device_plugin(mcm: &ManagedClusterModule) -> Option<DevicePlugin> {
    let spec = mcm.spec.module_spec.device_plugin.as_ref()?;
    // Serializing a typed value cannot fail: no map with non-string keys, no float NaN.
    serde_json::to_string(spec)
        .ok()
        .map(|spec_json| DevicePlugin {
            spec_json,
            // The plugin's Pods name it, as upstream's do, never the Secret's content.
            image_repo_secret: image_repo_secret(mcm).unwrap_or_default().to_owned(),
        })
}

/// `nodeUpgrade.maxUnavailable` for the proxy; a value admission would refuse (stored
/// before the rule existed) limits nothing rather than stopping the module.
fn max_unavailable(mcm: &ManagedClusterModule) -> Option<module_intent::MaxUnavailable> {
    let value = mcm.spec.node_upgrade.as_ref()?.max_unavailable.as_ref()?;
    match MaxUnavailable::parse(value).ok()? {
        MaxUnavailable::Nodes(n) => Some(module_intent::MaxUnavailable::MaxUnavailableNodes(n)),
        MaxUnavailable::Percent(p) => Some(module_intent::MaxUnavailable::MaxUnavailablePercent(p)),
    }
}

fn unresolved(reason: &str, message: String) -> Target {
    Target::Unresolved(Unresolved {
        reason: reason.to_owned(),
        message,
    })
}

fn module_load(r: &Resolution, credential: Option<&str>, digest: &str) -> ModuleLoad {
    let m = &r.modprobe;
    let args = |a: &Option<kmm_api::ModprobeArgs>| {
        a.as_ref().map(|a| ModprobeArgs {
            load: a.load.clone().unwrap_or_default(),
            unload: a.unload.clone().unwrap_or_default(),
        })
    };
    ModuleLoad {
        image: r.container_image.clone(),
        registry_tls: r.registry_tls.as_ref().map(|tls| RegistryTls {
            insecure: tls.insecure.unwrap_or_default(),
            insecure_skip_tls_verify: tls.insecure_skip_tls_verify.unwrap_or_default(),
        }),
        modprobe: Some(Modprobe {
            module_name: m.module_name.clone().unwrap_or_default(),
            parameters: m.parameters.clone().unwrap_or_default(),
            dir_name: m.dir_name_or_default().to_owned(),
            args: args(&m.args),
            raw_args: args(&m.raw_args),
            firmware_path: m.firmware_path.clone().unwrap_or_default(),
            modules_loading_order: m.modules_loading_order.clone().unwrap_or_default(),
        }),
        in_tree_modules_to_remove: r.in_tree_modules_to_remove.clone(),
        version: r.version.clone().unwrap_or_default(),
        pull_credential_id: credential.unwrap_or_default().to_owned(),
        digest: digest.to_owned(),
    }
}

fn toleration(t: &k8s_openapi::api::core::v1::Toleration) -> Toleration {
    Toleration {
        key: t.key.clone().unwrap_or_default(),
        operator: t.operator.clone().unwrap_or_default(),
        value: t.value.clone().unwrap_or_default(),
        effect: t.effect.clone().unwrap_or_default(),
    }
}

#[cfg(test)]
mod tests {
    use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
    use kmm_proto::v1::IntentSnapshot;
    use kmm_proto::v1::pull_credential::Content;

    use kmm_api::testing::ModuleBuilder;

    use super::*;
    use crate::images::SpokePin;

    fn mcm(name: &str, yaml_module_spec: &str) -> ManagedClusterModule {
        ModuleBuilder::new(name)
            .generation(4)
            .selector(&[("fleet", "a")])
            .module_spec_yaml(yaml_module_spec)
            .build()
    }

    const HELLO: &str = r#"    selector: {role: worker}
    imageRepoSecret: {name: pull}
    tolerations: [{key: gpu, operator: Exists, effect: NoSchedule}]
    moduleLoader:
      container:
        version: "1"
        modprobe: {moduleName: hello, parameters: [a=1]}
        kernelMappings:
          - {regexp: 'amd64$', containerImage: 'r.example/hello:${KERNEL_FULL_VERSION}'}
"#;

    const PINNED: &str = "sha256:0123";

    static NO_SPOKE_PINS: BTreeMap<ImageKey, SpokePins> = BTreeMap::new();
    static NO_VERSIONS: BTreeMap<String, u64> = BTreeMap::new();

    /// The hub's records, no cluster's pins, for spoke1, without mirrors.
    fn hub_only(records: &BTreeMap<ImageKey, ImageRecord>) -> ClusterImages<'_> {
        ClusterImages {
            records,
            spoke_pins: &NO_SPOKE_PINS,
            cluster: "spoke1",
            mirrors: &[],
            versions: &NO_VERSIONS,
        }
    }

    /// Every image of HELLO found, pinned to [`PINNED`].
    fn pinned() -> BTreeMap<ImageKey, ImageRecord> {
        let need = crate::images::ImageNeed {
            module_uid: String::new(),
            ..crate::images::ImageNeed::for_kernels([])
        };
        let now = k8s_openapi::jiff::Timestamp::UNIX_EPOCH;
        BTreeMap::from([(
            ImageKey {
                module: "hello".into(),
                image: "r.example/hello:6.1.0-13-amd64".into(),
            },
            ImageRecord::seeded(&need, PINNED.into(), now),
        )])
    }

    fn kernels(list: &[&str]) -> BTreeSet<String> {
        list.iter().map(|k| k.to_string()).collect()
    }

    fn creds(names: &[&str]) -> BTreeMap<String, PullCredential> {
        names
            .iter()
            .map(|n| {
                let content = Some(Content::DockerConfigJson(
                    format!("{{\"auths\":{{\"{n}\":{{}}}}}}").into_bytes(),
                ));
                (
                    n.to_string(),
                    PullCredential {
                        id: n.to_string(),
                        content,
                    },
                )
            })
            .collect()
    }

    /// A module's intent with no kernels, credentials or resolutions around it.
    fn bare_intent(module: &ManagedClusterModule, unload: bool) -> ModuleIntent {
        module_intent(
            &ModuleInput {
                module: &Arc::new(module.clone()),
                unload,
            },
            &kernels(&[]),
            &creds(&[]),
            hub_only(&pinned()),
            &ModuleResolutions::default(),
            Found {
                needed: &mut BTreeSet::new(),
                unchecked: &mut BTreeSet::new(),
                cluster_specific: &mut false,
            },
        )
    }

    #[test]
    fn each_revision_loads_the_digest_its_pin_generation_pinned() {
        let mut images = pinned();
        for record in images.values_mut() {
            record.earlier = vec![kmm_api::ImagePin {
                pin_generation: 0,
                digest: "sha256:before".into(),
            }];
            record.pinned_at = 1;
        }
        let digest_of = |module: &ManagedClusterModule| {
            let snapshot = cluster_intents(
                &[ModuleInput {
                    module: &Arc::new(module.clone()),
                    unload: false,
                }],
                &kernels(&["6.1.0-13-amd64"]),
                &creds(&["pull"]),
                hub_only(&images),
                &mut Resolutions::default(),
                &mut BuiltIntents::default(),
            )
            .snapshot;
            match &snapshot.modules[0].kernels[0].target {
                Some(Target::Load(load)) => load.digest.clone(),
                other => panic!("not loaded: {other:?}"),
            }
        };
        let before = mcm("hello", HELLO);
        assert_eq!(digest_of(&before), "sha256:before");
        let mut moved = before.clone();
        moved.status = Some(kmm_api::ManagedClusterModuleStatus {
            pin_generation: Some(1),
            ..Default::default()
        });
        assert_eq!(digest_of(&moved), PINNED);
    }

    #[test]
    fn selection_is_match_labels_and_empty_selects_all() {
        let labels = BTreeMap::from([
            ("fleet".to_string(), "a".to_string()),
            ("zone".to_string(), "x".to_string()),
        ]);
        assert!(selects(&BTreeMap::new(), &labels));
        assert!(selects(
            &BTreeMap::from([("fleet".into(), "a".into())]),
            &labels
        ));
        assert!(!selects(
            &BTreeMap::from([("fleet".into(), "b".into())]),
            &labels
        ));
        assert!(!selects(
            &BTreeMap::from([("other".into(), "a".into())]),
            &labels
        ));
    }

    #[test]
    fn a_clusters_mirrors_rewrite_its_loads_by_the_same_digest_and_its_plugin() {
        let mut module = mcm("hello", HELLO);
        module.spec.module_spec.device_plugin = Some(
            serde_json::from_value(serde_json::json!({
                "container": {"image": "r.example/plugin:1"},
                "initContainer": {"image": "other.example/init:1"},
            }))
            .unwrap(),
        );
        let records = pinned();
        let mirrors = [crate::fleet::mirrors::ImageMirror {
            source: "r.example".into(),
            mirror: "mirror.internal:5000".into(),
        }];
        let snapshot = cluster_intents(
            &[ModuleInput {
                module: &Arc::new(module.clone()),
                unload: false,
            }],
            &kernels(&["6.1.0-13-amd64"]),
            &creds(&["pull"]),
            ClusterImages {
                mirrors: &mirrors,
                ..hub_only(&records)
            },
            &mut Resolutions::default(),
            &mut BuiltIntents::default(),
        )
        .snapshot;
        let intent = &snapshot.modules[0];
        let Some(Target::Load(load)) = &intent.kernels[0].target else {
            panic!("a load")
        };
        assert_eq!(load.image, "mirror.internal:5000/hello:6.1.0-13-amd64");
        assert_eq!(load.digest, PINNED, "the hub's bytes, from the mirror");
        let plugin: serde_json::Value =
            serde_json::from_str(&intent.device_plugin.as_ref().unwrap().spec_json).unwrap();
        assert_eq!(
            plugin["container"]["image"],
            "mirror.internal:5000/plugin:1"
        );
        assert_eq!(
            plugin["initContainer"]["image"], "other.example/init:1",
            "no mirror for its registry"
        );
    }

    #[test]
    fn every_kernel_is_resolved_or_explained() {
        let module = mcm("hello", HELLO);
        let snapshot = cluster_intents(
            &[ModuleInput {
                module: &Arc::new(module.clone()),
                unload: false,
            }],
            &kernels(&["6.1.0-13-amd64", "5.14.0-427.el9.x86_64"]),
            &creds(&["pull", "unrelated"]),
            hub_only(&pinned()),
            &mut Resolutions::default(),
            &mut BuiltIntents::default(),
        )
        .snapshot;
        let intent = &snapshot.modules[0];
        assert_eq!(
            intent.key,
            Some(ModuleKey {
                namespace: "drivers".into(),
                name: "hello".into()
            })
        );
        assert_eq!(intent.generation, 4);
        assert_eq!(
            intent.node_selector.get("role").map(String::as_str),
            Some("worker")
        );
        assert_eq!(intent.tolerations[0].key, "gpu");
        let by_kernel: BTreeMap<_, _> = intent
            .kernels
            .iter()
            .map(|k| (k.kernel.as_str(), k.target.clone().unwrap()))
            .collect();
        let Target::Load(load) = &by_kernel["6.1.0-13-amd64"] else {
            panic!("amd64 resolves")
        };
        assert_eq!(load.image, "r.example/hello:6.1.0-13-amd64");
        assert_eq!(load.digest, PINNED, "nodes load the bytes the hub pinned");
        assert_eq!(load.modprobe.as_ref().unwrap().dir_name, "/opt");
        assert_eq!(load.pull_credential_id, "pull");
        let Target::Unresolved(why) = &by_kernel["5.14.0-427.el9.x86_64"] else {
            panic!("el9 has no mapping")
        };
        assert_eq!(why.reason, "NoKernelMapping");
        assert!(
            why.message.contains("5.14.0-427.el9.x86_64"),
            "{}",
            why.message
        );
        // Only the credential an image needs travels to the cluster.
        assert_eq!(
            snapshot
                .credentials
                .iter()
                .map(|c| c.id.as_str())
                .collect::<Vec<_>>(),
            ["pull"]
        );
    }

    #[test]
    fn max_unavailable_reaches_the_intent_as_nodes_or_percent() {
        let intent = |node_upgrade: Option<IntOrString>| {
            let mut module = mcm("hello", HELLO);
            module.spec.node_upgrade = node_upgrade.map(|m| kmm_api::NodeUpgrade {
                max_unavailable: Some(m),
            });
            bare_intent(&module, false).max_unavailable
        };
        use module_intent::MaxUnavailable::{MaxUnavailableNodes, MaxUnavailablePercent};
        assert_eq!(intent(None), None);
        assert_eq!(
            intent(Some(IntOrString::Int(2))),
            Some(MaxUnavailableNodes(2))
        );
        assert_eq!(
            intent(Some(IntOrString::String("30%".into()))),
            Some(MaxUnavailablePercent(30))
        );
        assert_eq!(intent(Some(IntOrString::Int(0))), None);
    }

    #[test]
    fn the_device_plugin_travels_with_loads_and_unloads() {
        let mut module = mcm("hello", HELLO);
        let spec: kmm_api::DevicePluginSpec =
            serde_json::from_value(serde_json::json!({"container": {"image": "r/plugin:1"}}))
                .unwrap();
        module.spec.module_spec.device_plugin = Some(spec.clone());
        for unload in [false, true] {
            let intent = bare_intent(&module, unload);
            let plugin = intent.device_plugin.unwrap();
            let sent: kmm_api::DevicePluginSpec = serde_json::from_str(&plugin.spec_json).unwrap();
            assert_eq!(sent, spec, "unload: {unload}");
            assert_eq!(plugin.image_repo_secret, "pull", "its name only");
        }
        module.spec.module_spec.image_repo_secret = None;
        let intent = bare_intent(&module, false);
        assert_eq!(intent.device_plugin.unwrap().image_repo_secret, "");
    }

    #[test]
    fn an_image_the_hub_cannot_check_is_resolved_then_loaded_by_each_clusters_pin() {
        let module = mcm(
            "hello",
            &HELLO.replace("    imageRepoSecret: {name: pull}\n", ""),
        );
        let mut records = pinned();
        let (key, record) = records.iter_mut().next().unwrap();
        let key = key.clone();
        record.digest = None;
        record.state = crate::images::ImageState::SpokeResolved;
        let record = record.clone();
        let mut pins = BTreeMap::from([(key.clone(), SpokePins::default())]);
        // One module object and one cache for every cluster, as the hub has them: what a
        // cluster resolved is its own, whatever another cluster was sent.
        let module = Arc::new(module);
        let mut built = BuiltIntents::default();
        let mut target = |pins: &BTreeMap<ImageKey, SpokePins>, cluster: &str| {
            let intents = cluster_intents(
                &[ModuleInput {
                    module: &module,
                    unload: false,
                }],
                &kernels(&["6.1.0-13-amd64"]),
                &creds(&["pull"]),
                ClusterImages {
                    records: &records,
                    spoke_pins: pins,
                    cluster,
                    mirrors: &[],
                    versions: &NO_VERSIONS,
                },
                &mut Resolutions::default(),
                &mut built,
            );
            assert!(intents.unchecked.is_empty(), "the hub looked");
            assert!(intents.snapshot.credentials.is_empty());
            intents.snapshot.modules[0].kernels[0]
                .target
                .clone()
                .unwrap()
        };
        let Target::Resolve(request) = target(&pins, "spoke1") else {
            panic!("a request to resolve")
        };
        let load = request.load.unwrap();
        assert_eq!(load.image, "r.example/hello:6.1.0-13-amd64");
        assert_eq!(load.digest, "", "nothing pinned yet");
        assert_eq!(load.pull_credential_id, "", "the cluster's credentials");

        let pins_of = pins.get_mut(&key).unwrap();
        pins_of.answer(&record, "spoke1", 0, SpokePin::Digest("sha256:s1".into()));
        pins_of.answer(
            &record,
            "spoke2",
            0,
            SpokePin::Failed {
                reason: "ImageNotFound".into(),
                message: "spoke2 resolved r.example/hello:6.1.0-13-amd64: manifest unknown".into(),
            },
        );
        let Target::Load(load) = target(&pins, "spoke1") else {
            panic!("spoke1's pin loads")
        };
        assert_eq!(load.digest, "sha256:s1");
        // A failure is shown, and the request stays: without it the proxy would forget the
        // image and never answer again, whatever changes on the cluster.
        let Target::Resolve(ImageResolution {
            failed: Some(why),
            load: Some(load),
            ..
        }) = target(&pins, "spoke2")
        else {
            panic!("spoke2 goes on resolving, with its failure")
        };
        assert_eq!(load.image, "r.example/hello:6.1.0-13-amd64");
        assert_eq!(why.reason, "ImageNotFound");
        assert!(
            why.message
                .starts_with("kernel 6.1.0-13-amd64: spoke2 resolved")
        );
        assert!(matches!(
            target(&pins, "spoke3"),
            Target::Resolve(ImageResolution { failed: None, .. })
        ));
    }

    #[test]
    fn an_intent_built_for_an_earlier_cluster_is_what_building_it_again_gives() {
        let hello = Arc::new(mcm("hello", HELLO));
        let mut edited = mcm(
            "hello",
            &HELLO.replace("parameters: [a=1]", "parameters: [a=2]"),
        );
        edited.metadata.generation = Some(5);
        let edited = Arc::new(edited);
        let kernel_sets = [
            kernels(&["6.1.0-13-amd64"]),
            kernels(&["6.1.0-13-amd64", "6.2.0-1-amd64", "5.14.0-427.el9.x86_64"]),
            kernels(&[]),
        ];
        let mirrors = [crate::fleet::mirrors::ImageMirror {
            source: "r.example".into(),
            mirror: "mirror.internal".into(),
        }];
        // The records as the image worker moves them: none, one pinned, then both pinned
        // to other digests; each move moves the module's version.
        let none = BTreeMap::new();
        let one = pinned();
        let mut both = pinned();
        for record in both.values_mut() {
            record.digest = Some("sha256:4567".into());
        }
        let need = crate::images::ImageNeed::for_kernels([]);
        both.insert(
            ImageKey {
                module: "hello".into(),
                image: "r.example/hello:6.2.0-1-amd64".into(),
            },
            ImageRecord::seeded(
                &need,
                "sha256:89ab".into(),
                k8s_openapi::jiff::Timestamp::UNIX_EPOCH,
            ),
        );
        let mut built = BuiltIntents::default();
        let mut resolutions = Resolutions::default();
        // Every combination of module object, kernels, unload, credential and mirrors,
        // twice, in a scrambled order, so that most find one built for an earlier cluster.
        let mut combinations: Vec<usize> = (0..2 * 48).map(|i| i % 48).collect();
        let mut seed = 7_u64;
        for i in (1..combinations.len()).rev() {
            seed = seed.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
            combinations.swap(i, (seed >> 33) as usize % (i + 1));
        }
        let mut compared = 0;
        for (version, records) in [(0, &none), (1, &one), (2, &both)] {
            let versions = BTreeMap::from([("hello".to_owned(), version)]);
            for &c in &combinations {
                let module = [&hello, &edited][c % 2];
                let kernels = &kernel_sets[c / 2 % 3];
                let unload = c / 6 % 2 == 1;
                let credentials = creds(if c / 12 % 2 == 1 { &["pull"] } else { &[] });
                let images = ClusterImages {
                    mirrors: if c / 24 == 1 { &mirrors } else { &[] },
                    versions: &versions,
                    ..hub_only(records)
                };
                let input = [ModuleInput { module, unload }];
                let taken = cluster_intents(
                    &input,
                    kernels,
                    &credentials,
                    images,
                    &mut resolutions,
                    &mut built,
                );
                let fresh = cluster_intents(
                    &input,
                    kernels,
                    &credentials,
                    images,
                    &mut Resolutions::default(),
                    &mut BuiltIntents::default(),
                );
                assert_eq!(
                    taken.snapshot.to_wire(),
                    fresh.snapshot.to_wire(),
                    "combination {c}"
                );
                assert_eq!(taken.unchecked, fresh.unchecked, "combination {c}");
                compared += 1;
            }
        }
        assert_eq!(compared, 3 * 96);
        assert!(built.modules_kept() <= 2, "one entry per module object");
    }

    #[test]
    fn clusters_alike_share_one_intent() {
        let hello = Arc::new(mcm("hello", HELLO));
        let mut built = BuiltIntents::default();
        let mut snapshot = |kernels: &BTreeSet<String>| {
            cluster_intents(
                &[ModuleInput {
                    module: &hello,
                    unload: false,
                }],
                kernels,
                &creds(&["pull"]),
                hub_only(&pinned()),
                &mut Resolutions::default(),
                &mut built,
            )
            .snapshot
        };
        let first = snapshot(&kernels(&["6.1.0-13-amd64"]));
        let second = snapshot(&kernels(&["6.1.0-13-amd64"]));
        let other = snapshot(&kernels(&["6.2.0-1-amd64"]));
        assert!(Arc::ptr_eq(&first.modules[0], &second.modules[0]));
        assert_ne!(first.modules[0], other.modules[0]);
        assert_eq!(second.credentials.len(), 1, "the credential, as when built");
    }

    const PLUGIN_ONLY: &str = r#"    selector: {role: gpu}
    tolerations: [{key: gpu, operator: Exists, effect: NoSchedule}]
    devicePlugin:
      container: {image: r.example/plugin:1}
"#;

    #[test]
    fn a_module_without_a_loader_sends_its_plugin_and_nothing_to_load() {
        let module = mcm("plugin", PLUGIN_ONLY);
        for unload in [false, true] {
            let intents = cluster_intents(
                &[ModuleInput {
                    module: &Arc::new(module.clone()),
                    unload,
                }],
                &kernels(&["6.1.0-13-amd64", "5.14.0-427.el9.x86_64"]),
                &creds(&["pull"]),
                hub_only(&BTreeMap::new()),
                &mut Resolutions::default(),
                &mut BuiltIntents::default(),
            );
            assert!(intents.unchecked.is_empty(), "no image to check");
            let snapshot = intents.snapshot;
            assert!(snapshot.credentials.is_empty(), "nothing to pull");
            let intent = &snapshot.modules[0];
            assert!(intent.device_plugin_only);
            assert!(intent.kernels.is_empty(), "{:?}", intent.kernels);
            assert_eq!(intent.unload, unload);
            assert_eq!(intent.tolerations[0].key, "gpu");
            assert_eq!(
                intent.node_selector.get("role").map(String::as_str),
                Some("gpu")
            );
            let plugin: kmm_api::DevicePluginSpec =
                serde_json::from_str(&intent.device_plugin.as_ref().unwrap().spec_json).unwrap();
            assert_eq!(plugin.container.image, "r.example/plugin:1");
        }
        let loader = cluster_intents(
            &[ModuleInput {
                module: &Arc::new(mcm("hello", HELLO)),
                unload: false,
            }],
            &kernels(&[]),
            &creds(&[]),
            hub_only(&pinned()),
            &mut Resolutions::default(),
            &mut BuiltIntents::default(),
        );
        assert!(!loader.snapshot.modules[0].device_plugin_only);
    }

    #[test]
    fn an_invalid_module_without_a_loader_runs_no_plugin() {
        let mut module = mcm("plugin", PLUGIN_ONLY);
        module.spec.spoke_namespace = "Not A Namespace".into();
        let snapshot = cluster_intents(
            &[ModuleInput {
                module: &Arc::new(module.clone()),
                unload: false,
            }],
            &kernels(&["6.1.0-13-amd64"]),
            &creds(&[]),
            hub_only(&BTreeMap::new()),
            &mut Resolutions::default(),
            &mut BuiltIntents::default(),
        )
        .snapshot;
        let intent = &snapshot.modules[0];
        assert!(intent.device_plugin_only);
        assert_eq!(intent.device_plugin, None);
    }

    #[test]
    fn missing_pull_secret_is_a_reason_not_silence() {
        let module = mcm("hello", HELLO);
        let snapshot = cluster_intents(
            &[ModuleInput {
                module: &Arc::new(module.clone()),
                unload: false,
            }],
            &kernels(&["6.1.0-13-amd64"]),
            &BTreeMap::new(),
            hub_only(&pinned()),
            &mut Resolutions::default(),
            &mut BuiltIntents::default(),
        )
        .snapshot;
        let Some(Target::Unresolved(why)) = &snapshot.modules[0].kernels[0].target else {
            panic!("no secret, no load")
        };
        assert_eq!(why.reason, "PullSecretNotFound");
        assert!(snapshot.credentials.is_empty());
    }

    #[test]
    fn no_credentials_travel_when_no_kernel_resolves() {
        let module = mcm("hello", HELLO);
        let snapshot = cluster_intents(
            &[ModuleInput {
                module: &Arc::new(module.clone()),
                unload: false,
            }],
            &kernels(&["5.14.0-427.el9.x86_64"]),
            &creds(&["pull"]),
            hub_only(&pinned()),
            &mut Resolutions::default(),
            &mut BuiltIntents::default(),
        )
        .snapshot;
        assert!(snapshot.credentials.is_empty());
    }

    #[test]
    fn invalid_specs_are_reported_per_kernel_and_unload_is_explicit() {
        let broken = mcm(
            "broken",
            "    selector: {}\n    moduleLoader:\n      container:\n        modprobe: {}\n        kernelMappings: [{regexp: '('}]\n",
        );
        let snapshot = cluster_intents(
            &[ModuleInput {
                module: &Arc::new(broken.clone()),
                unload: true,
            }],
            &kernels(&["6.1.0"]),
            &BTreeMap::new(),
            hub_only(&pinned()),
            &mut Resolutions::default(),
            &mut BuiltIntents::default(),
        )
        .snapshot;
        let intent = &snapshot.modules[0];
        assert!(intent.unload);
        let Some(Target::Unresolved(why)) = &intent.kernels[0].target else {
            panic!("invalid spec")
        };
        assert_eq!(why.reason, "InvalidSpec");
        assert!(
            why.message.contains("kernelMappings[0].regexp"),
            "{}",
            why.message
        );
    }

    #[test]
    fn an_image_the_hub_has_not_found_is_a_reason_and_unchecked_ones_hold_the_snapshot() {
        let module = mcm("hello", HELLO);
        let input = [ModuleInput {
            module: &Arc::new(module.clone()),
            unload: false,
        }];
        let kernels = kernels(&["6.1.0-13-amd64"]);
        let mut images = pinned();
        let record = images.values_mut().next().unwrap();
        record.digest = None;
        record.reason = "ImageNotFound".into();
        record.message = "manifest unknown".into();
        let intents = cluster_intents(
            &input,
            &kernels,
            &creds(&["pull"]),
            hub_only(&images),
            &mut Resolutions::default(),
            &mut BuiltIntents::default(),
        );
        assert!(intents.unchecked.is_empty());
        let Some(Target::Unresolved(why)) = &intents.snapshot.modules[0].kernels[0].target else {
            panic!("no image, no load")
        };
        assert_eq!(why.reason, "ImageNotFound");
        assert_eq!(
            why.message,
            "kernel 6.1.0-13-amd64: image r.example/hello:6.1.0-13-amd64: manifest unknown"
        );
        assert!(intents.snapshot.credentials.is_empty());

        let held = cluster_intents(
            &input,
            &kernels,
            &creds(&["pull"]),
            hub_only(&BTreeMap::new()),
            &mut Resolutions::default(),
            &mut BuiltIntents::default(),
        );
        assert_eq!(
            held.unchecked,
            BTreeSet::from([ImageKey {
                module: "hello".into(),
                image: "r.example/hello:6.1.0-13-amd64".into(),
            }])
        );
        let unloading = [ModuleInput {
            module: &Arc::new(module.clone()),
            unload: true,
        }];
        assert!(
            cluster_intents(
                &unloading,
                &kernels,
                &creds(&["pull"]),
                hub_only(&BTreeMap::new()),
                &mut Resolutions::default(),
                &mut BuiltIntents::default(),
            )
            .unchecked
            .is_empty(),
            "an unload does not wait for image checks"
        );
    }

    fn intent(name: &str, image: &str, credential: &str) -> ModuleIntent {
        ModuleIntent {
            key: Some(ModuleKey {
                namespace: "drivers".into(),
                name: name.into(),
            }),
            kernels: vec![KernelTarget {
                kernel: "6.1".into(),
                target: Some(Target::Load(ModuleLoad {
                    image: image.into(),
                    pull_credential_id: credential.into(),
                    ..ModuleLoad::default()
                })),
            }],
            ..ModuleIntent::default()
        }
    }

    fn names(snapshot: &SharedSnapshot) -> Vec<(String, String, bool)> {
        snapshot
            .modules
            .iter()
            .map(|m| {
                let image = match &m.kernels.first().and_then(|k| k.target.clone()) {
                    Some(Target::Load(load)) => load.image.clone(),
                    _ => String::new(),
                };
                (m.key.clone().unwrap().name, image, m.unload)
            })
            .collect()
    }

    #[test]
    fn an_unchecked_image_holds_up_only_its_own_module() {
        let previous = SharedSnapshot::from(IntentSnapshot {
            revision: 3,
            modules: vec![intent("a", "r/a:v1", "pull"), intent("b", "r/b:v1", "")],
            credentials: creds(&["pull"]).into_values().collect(),
            ..IntentSnapshot::default()
        });
        let mut unload_b = intent("b", "r/b:v1", "");
        unload_b.unload = true;
        let now = SharedSnapshot::from(IntentSnapshot {
            modules: vec![
                intent("a", "r/a:v2", ""),
                unload_b,
                intent("c", "r/c:v1", ""),
            ],
            ..IntentSnapshot::default()
        });
        let unchecked = BTreeSet::from([
            ImageKey {
                module: "a".into(),
                image: "r/a:v2".into(),
            },
            ImageKey {
                module: "c".into(),
                image: "r/c:v1".into(),
            },
        ]);
        let sent = while_unchecked(now.clone(), &unchecked, Some(&previous), |_| false)
            .expect("sent, not held");
        assert_eq!(
            names(&sent),
            [
                ("a".to_owned(), "r/a:v1".to_owned(), false),
                ("b".to_owned(), "r/b:v1".to_owned(), true),
            ],
            "a keeps what it was sent, b's unload goes, c waits for its check"
        );
        assert_eq!(sent.credentials.len(), 1, "a's credential still travels");

        // After a failover nothing was sent yet: a module that runs there holds all.
        assert_eq!(
            while_unchecked(now.clone(), &unchecked, None, |key| key.name == "a"),
            None
        );
        let fresh = while_unchecked(now, &unchecked, None, |_| false).unwrap();
        assert_eq!(names(&fresh).len(), 1);
    }
}
