//! Shared by the end-to-end tests and the convergence benchmark: sample modules, node and
//! cluster labels, and waiting for the ready labels the spoke proxies set.

// Each user (a test binary, the benchmark) uses a different part.
#![allow(dead_code)]

pub mod addon_config;

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use anyhow::{Context, Result, bail, ensure};
use k8s_openapi::ByteString;
use k8s_openapi::api::apps::v1::{DaemonSet, Deployment};
use k8s_openapi::api::core::v1::{ConfigMap, Node, Secret};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kmm_api::ManagedClusterModule;
use kmm_api::labels::{ready_label, version_ready_label};
use kmm_e2e::fixture::{Fleet, wait_until};
use kmm_e2e::fleet::kmm::{self as fleet_kmm, Agent, Kmm, SPOKE_NAMESPACE};
use kmm_e2e::fleet::nodes::RealNode;
use kmm_e2e::fleet::{Settings, managed_clusters};
use kmm_e2e::guest::firmware_image::{FIRMWARE_FILE, FIRMWARE_PATH};
use kmm_e2e::guest::module_signing::TestKey;
use kmm_e2e::kmod_builder;
use kmm_registry_fixture::RegistryServer;
use kube::api::{DeleteParams, Patch, PatchParams, PostParams};
use kube::{Api, Client, ResourceExt};
use oci_client::client::{ClientConfig, ClientProtocol};
use oci_client::secrets::RegistryAuth;
use serde_json::{Value, json};

pub const WAIT: Duration = Duration::from_secs(120);
pub const VERSION: &str = "1.0";
/// The spokeNamespace of the tests' modules.
pub const NAMESPACE: &str = "kmm-e2e";

pub fn unique(prefix: &str) -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or_default();
    format!("{prefix}-{nanos:x}")
}

pub fn kmm(fleet: &Fleet) -> Result<&Kmm> {
    fleet.state.kmm.as_ref().context(
        "the running fleet was started with --no-kmm; restart it with `cargo xtask env up`",
    )
}

/// The nodes of `cluster` (KWOK and real) with a sample image for their kernel.
/// The first real node (containerd, kubelet) of `spoke`.
pub fn real_node(fleet: &Fleet, spoke: &str) -> Result<RealNode> {
    fleet
        .state
        .cluster(spoke)?
        .real_nodes
        .first()
        .cloned()
        .context("the spoke has no real node")
}

pub fn nodes_with_images(fleet: &Fleet, cluster: &str) -> Result<Vec<(String, String)>> {
    let images: BTreeSet<&str> = fleet
        .state
        .images
        .iter()
        .map(|i| i.kernel.as_str())
        .collect();
    let cluster = fleet.state.cluster(cluster)?;
    let kwok = cluster.nodes.iter().map(|n| (&n.name, &n.kernel));
    let real = cluster.real_nodes.iter().map(|n| (&n.name, &n.kernel));
    Ok(kwok
        .chain(real)
        .filter(|(_, kernel)| images.contains(kernel.as_str()))
        .map(|(name, kernel)| (name.clone(), kernel.clone()))
        .collect())
}

/// An MCM loading the sample module from the fleet's registry, selecting clusters and
/// nodes carrying label `selector_key=yes`, with `mappings` as kernelMappings.
pub fn module(name: &str, selector_key: &str, mappings: Value) -> Result<ManagedClusterModule> {
    Ok(serde_json::from_value(json!({
        "apiVersion": "hub.kmm.sigs.x-k8s.io/v1beta1",
        "kind": "ManagedClusterModule",
        "metadata": { "name": name },
        "spec": {
            "spokeNamespace": NAMESPACE,
            "selector": { selector_key: "yes" },
            "moduleSpec": {
                "selector": { selector_key: "yes" },
                "moduleLoader": { "container": {
                    "version": VERSION,
                    "modprobe": {
                        "moduleName": "kmm_hello_dep",
                        "modulesLoadingOrder": ["kmm_hello_dep", "kmm_hello"],
                        "parameters": ["who=e2e"],
                    },
                    "registryTLS": { "insecure": true },
                    "kernelMappings": mappings,
                }},
            },
        },
    }))?)
}

/// Every kernel maps to the sample image built for it.
pub fn sample_mapping(fleet: &Fleet) -> Value {
    json!([{
        "regexp": "^.+$",
        "containerImage": format!("{}/samples/kmm-hello:${{KERNEL_FULL_VERSION}}", fleet.state.node_registry),
    }])
}

pub async fn label_cluster(hub: &Client, cluster: &str, key: &str, on: bool) -> Result<()> {
    label_cluster_with(hub, cluster, key, on.then_some("yes")).await
}

/// Sets the ManagedCluster label `key` to `value`, or removes it (`None`).
pub async fn label_cluster_with(
    hub: &Client,
    cluster: &str,
    key: &str,
    value: Option<&str>,
) -> Result<()> {
    let value = value.map_or(Value::Null, |v| json!(v));
    managed_clusters(hub)
        .patch(
            cluster,
            &PatchParams::default(),
            &Patch::Merge(json!({ "metadata": { "labels": { key: value } } })),
        )
        .await
        .with_context(|| format!("labelling ManagedCluster {cluster}"))?;
    Ok(())
}

pub async fn label_node(spoke: &Client, node: &str, key: &str, on: bool) -> Result<()> {
    let value = if on { json!("yes") } else { Value::Null };
    Api::<Node>::all(spoke.clone())
        .patch(
            node,
            &PatchParams::default(),
            &Patch::Merge(json!({ "metadata": { "labels": { key: value } } })),
        )
        .await
        .with_context(|| format!("labelling Node {node}"))?;
    Ok(())
}

/// `(cluster, node)` of every simulated node carrying the module's ready label, with
/// the value of its version label.
pub async fn labelled(
    fleet: &Fleet,
    name: &str,
) -> Result<BTreeMap<(String, String), Option<String>>> {
    labelled_in(fleet, NAMESPACE, name).await
}

/// [`labelled`] for a module of another spokeNamespace.
pub async fn labelled_in(
    fleet: &Fleet,
    namespace: &str,
    name: &str,
) -> Result<BTreeMap<(String, String), Option<String>>> {
    let (ready, version) = (
        ready_label(namespace, name),
        version_ready_label(namespace, name),
    );
    let mut found = BTreeMap::new();
    for cluster in fleet.spoke_names() {
        for node in Api::<Node>::all(fleet.spoke(&cluster)?.clone())
            .list(&Default::default())
            .await?
        {
            let labels = node.labels();
            if labels.contains_key(&ready) {
                found.insert(
                    (cluster.clone(), node.name_any()),
                    labels.get(&version).cloned(),
                );
            } else {
                ensure!(
                    !labels.contains_key(&version),
                    "{cluster}/{} has {version} without {ready}",
                    node.name_any()
                );
            }
        }
    }
    Ok(found)
}

/// Waits until exactly `expected` nodes carry the module's labels (with the version).
pub async fn wait_labelled(fleet: &Fleet, name: &str, expected: &[(String, String)]) -> Result<()> {
    wait_labelled_in(fleet, NAMESPACE, name, expected).await
}

/// [`wait_labelled`] for a module of another spokeNamespace.
pub async fn wait_labelled_in(
    fleet: &Fleet,
    namespace: &str,
    name: &str,
    expected: &[(String, String)],
) -> Result<()> {
    wait_labelled_at(fleet, namespace, name, expected, VERSION).await
}

/// Waits until exactly `expected` nodes carry the module's labels, with `version`.
pub async fn wait_labelled_at(
    fleet: &Fleet,
    namespace: &str,
    name: &str,
    expected: &[(String, String)],
    version: &str,
) -> Result<()> {
    let expected: BTreeMap<(String, String), Option<String>> = expected
        .iter()
        .map(|key| (key.clone(), Some(version.to_owned())))
        .collect();
    wait_until(
        &format!("exactly {expected:?} labelled for {name}"),
        WAIT,
        || async {
            match labelled_in(fleet, namespace, name).await {
                Ok(now) if now == expected => Ok(()),
                Ok(now) => Err(format!("labelled: {now:?}")),
                Err(e) => Err(e.to_string()),
            }
        },
    )
    .await?;
    Ok(())
}

pub async fn create(hub: &Client, module: &ManagedClusterModule) -> Result<()> {
    Api::<ManagedClusterModule>::all(hub.clone())
        .create(&PostParams::default(), module)
        .await
        .with_context(|| format!("creating ManagedClusterModule {}", module.name_any()))?;
    Ok(())
}

/// Deletes the module and waits until the hub let it go (its finalizer completes once
/// the nodes confirmed the unload).
pub async fn delete(hub: &Client, name: &str) -> Result<()> {
    let api = Api::<ManagedClusterModule>::all(hub.clone());
    api.delete(name, &DeleteParams::default()).await?;
    wait_until(
        &format!("ManagedClusterModule {name} to be gone"),
        WAIT,
        || async {
            match api.get_opt(name).await {
                Ok(None) => Ok(()),
                Ok(Some(m)) => Err(format!("still there, finalizers {:?}", m.finalizers())),
                Err(e) => Err(e.to_string()),
            }
        },
    )
    .await?;
    Ok(())
}

pub async fn status(hub: &Client, name: &str) -> Result<Value> {
    let module = Api::<ManagedClusterModule>::all(hub.clone())
        .get(name)
        .await?;
    Ok(serde_json::to_value(module.status.unwrap_or_default())?)
}

/// The sum of the unload attempts of every agent but the one of `except_node`.
pub async fn unloads_except(fleet: &Fleet, kmm: &Kmm, except_node: &str) -> Result<u64> {
    let mut total = 0;
    for agent in kmm.agents.iter().filter(|a| a.node != except_node) {
        total += agent_attempts(fleet, agent, "unloads").await?;
    }
    Ok(total)
}

/// The sum of every agent's unload attempts.
pub async fn unloads(fleet: &Fleet, kmm: &Kmm) -> Result<u64> {
    unloads_except(fleet, kmm, "").await
}

/// Load or unload attempts (`what`: `loads`, `unloads`) of one agent since it started,
/// whatever their outcome, from its `/metrics`.
pub async fn agent_attempts(fleet: &Fleet, agent: &Agent, what: &str) -> Result<u64> {
    let text = fleet_kmm::agent_metrics(fleet.spoke(&agent.cluster)?, &agent.node)
        .await
        .with_context(|| format!("/metrics of the agent of {}", agent.node))?;
    let prefix = format!("kmm_agent_{what}_total{{");
    Ok(text
        .lines()
        .filter(|l| l.starts_with(&prefix))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
        .sum())
}

/// What `kubectl describe node` prints for `node` of `cluster`, as a person reads it.
pub fn describe_node(fleet: &Fleet, cluster: &str, node: &str) -> Result<String> {
    let toolchain = kmm_e2e::toolchain::Toolchain::locate(
        &kmm_e2e::versions::Versions::pinned(),
        settings()?.bin_dir.as_deref(),
    )?;
    let output = std::process::Command::new(toolchain.bin("kubectl"))
        .arg("--kubeconfig")
        .arg(&fleet.state.cluster(cluster)?.kubeconfig)
        .args(["describe", "node", node])
        .output()?;
    anyhow::ensure!(
        output.status.success(),
        "kubectl describe node {node}: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    Ok(String::from_utf8_lossy(&output.stdout).into_owned())
}

pub fn settings() -> Result<Settings> {
    Ok(Settings::from_env()?)
}

/// A spoke with a node (KWOK or real) on `kernel`.
pub fn spoke_with_kernel(fleet: &Fleet, kernel: &str) -> Result<String> {
    fleet
        .spoke_names()
        .into_iter()
        .find(|s| {
            fleet
                .state
                .cluster(s)
                .is_ok_and(|c| c.nodes.iter().any(|n| n.kernel == kernel))
        })
        .with_context(|| format!("a spoke with a node on {kernel}"))
}

/// The installed hub's namespace: build ConfigMaps and signing key Secrets go there.
pub const HUB_NAMESPACE: &str = "kmm-hub";

/// A ManagedClusterModule that has the installed kmm-hub build the sample modules for
/// one kernel (a Job from the builder base with the kernel's headers,
/// `kmm_e2e::kmod_builder`) and sign them with a test key, on a spoke with a
/// node on that kernel; with its ConfigMap and key Secrets. The image is named after the
/// module, itself named after the key: a run never finds an earlier run's image.
pub struct HubBuildSign {
    pub module: String,
    pub cluster: String,
    pub kernel: String,
    /// The signed image as nodes pull it, its variable resolved.
    pub image: String,
}

impl HubBuildSign {
    /// Creates everything; the hub starts at once.
    pub async fn create(fleet: &Fleet, kernel: &str, key: &TestKey) -> Result<Self> {
        let (registry, node_registry) = (&fleet.state.registry, &fleet.state.node_registry);
        let (owned_kernel, pushed) = (kernel.to_owned(), registry.clone());
        tokio::task::spawn_blocking(move || kmod_builder::ensure(&owned_kernel, Some(&pushed)))
            .await?
            .with_context(|| format!("the builder base for {kernel}"))?;
        let cluster = spoke_with_kernel(fleet, kernel)?;
        let module = format!("built-{}", &key.key_id[..12]);
        let image = format!("{node_registry}/kmm-e2e/{module}:${{KERNEL_FULL_VERSION}}");
        let hub = &fleet.hub;
        let secrets: Api<Secret> = Api::namespaced(hub.clone(), HUB_NAMESPACE);
        for (name, field, path) in [
            (format!("{module}-key"), "key", &key.key),
            (format!("{module}-cert"), "cert", &key.cert),
        ] {
            let secret = Secret {
                metadata: ObjectMeta {
                    name: Some(name),
                    ..ObjectMeta::default()
                },
                data: Some([(field.to_owned(), ByteString(std::fs::read(path)?))].into()),
                ..Secret::default()
            };
            secrets.create(&PostParams::default(), &secret).await?;
        }
        let base = format!("{node_registry}/{}", kmod_builder::repository(kernel));
        let config_map = ConfigMap {
            metadata: ObjectMeta {
                name: Some(format!("{module}-build")),
                ..ObjectMeta::default()
            },
            data: Some([("dockerfile".to_owned(), sample_dockerfile(&base))].into()),
            ..ConfigMap::default()
        };
        Api::<ConfigMap>::namespaced(hub.clone(), HUB_NAMESPACE)
            .create(&PostParams::default(), &config_map)
            .await?;
        let extra = "/opt/lib/modules/${KERNEL_FULL_VERSION}/extra";
        let mapping = json!([{
            "literal": kernel,
            "containerImage": image,
            "build": {
                "dockerfileConfigMap": {"name": format!("{module}-build")},
                "baseImageRegistryTLS": {"insecure": true},
            },
            "sign": {
                "keySecret": {"name": format!("{module}-key")},
                "certSecret": {"name": format!("{module}-cert")},
                "unsignedImageRegistryTLS": {"insecure": true},
                "filesToSign": [
                    format!("{extra}/kmm_hello_dep.ko"),
                    format!("{extra}/kmm_hello.ko"),
                ],
            },
        }]);
        let mut spec = self::module(&module, &module, mapping)?;
        spec.spec.module_spec.selector =
            [("kubernetes.io/os".to_owned(), "linux".to_owned())].into();
        create(hub, &spec).await?;
        label_cluster(hub, &cluster, &module, true).await?;
        Ok(Self {
            image: image.replace("${KERNEL_FULL_VERSION}", kernel),
            module,
            cluster,
            kernel: kernel.to_owned(),
        })
    }

    /// The image's state in status and its digest, once status lists it.
    pub async fn state(&self, fleet: &Fleet) -> Result<Option<(String, Option<String>)>> {
        let status = status(&fleet.hub, &self.module).await?;
        let entry = status["images"].as_array().and_then(|i| {
            i.iter()
                .find(|i| i["image"] == self.image.as_str())
                .cloned()
        });
        Ok(entry.map(|e| {
            let text = |field: &str| e[field].as_str().map(str::to_owned);
            (text("state").unwrap_or_default(), text("digest"))
        }))
    }

    /// Waits until the hub pinned the signed image; its digest. Fails at once when the
    /// hub gives up.
    pub async fn pinned(&self, fleet: &Fleet, timeout: Duration) -> Result<String> {
        Ok(wait_until(
            "the hub's built and signed image pinned",
            timeout,
            || async {
                match self.state(fleet).await.map_err(|e| e.to_string())? {
                    Some((state, Some(digest))) if state == "Exists" => Ok(digest),
                    Some((state, _)) if state == "Failed" || state == "NotFound" => Err(format!(
                        "the hub gave up: {}",
                        status(&fleet.hub, &self.module)
                            .await
                            .map_err(|e| e.to_string())?
                    )),
                    other => Err(format!("{other:?}")),
                }
            },
        )
        .await?)
    }

    /// Removes the module (once the hub let it go), its Secrets and its ConfigMap.
    pub async fn clean_up(self, fleet: &Fleet) -> Result<()> {
        let hub = &fleet.hub;
        label_cluster(hub, &self.cluster, &self.module, false).await?;
        delete(hub, &self.module).await?;
        let secrets: Api<Secret> = Api::namespaced(hub.clone(), HUB_NAMESPACE);
        for name in [
            format!("{}-key", self.module),
            format!("{}-cert", self.module),
        ] {
            secrets.delete(&name, &DeleteParams::default()).await?;
        }
        Api::<ConfigMap>::namespaced(hub.clone(), HUB_NAMESPACE)
            .delete(&format!("{}-build", self.module), &DeleteParams::default())
            .await?;
        Ok(())
    }
}

/// A Dockerfile for the sample modules compiled against the kernel's headers in the
/// builder base `base`, laid out as the sample image with firmware
/// (`kmm_e2e::guest::firmware_image`): the modules under `/opt/lib/modules/<kernel>`
/// with their `modules.dep`, the firmware file under `/firmware`.
fn sample_dockerfile(base: &str) -> String {
    let sources = kmod_builder::SAMPLE_SOURCES;
    let modules = "/image/opt/lib/modules/${KERNEL_FULL_VERSION}";
    let firmware = format!("/image{FIRMWARE_PATH}/{FIRMWARE_FILE}");
    format!(
        "FROM {base} AS build\n\
         ARG KERNEL_FULL_VERSION\n\
         RUN make -C /usr/src/linux-headers-${{KERNEL_FULL_VERSION}} M={sources} modules\n\
         RUN mkdir -p {modules}/extra \"$(dirname {firmware})\" \\\n  \
             && cp {sources}/kmm_hello_dep.ko {sources}/kmm_hello.ko {modules}/extra/ \\\n  \
             && depmod -b /image/opt ${{KERNEL_FULL_VERSION}} \\\n  \
             && printf 'kmm_hello firmware for %s\\n' ${{KERNEL_FULL_VERSION}} > {firmware}\n\
         FROM scratch\n\
         COPY --from=build /image /\n"
    )
}

/// A node's kernel log from byte `from` on: (nanoseconds, node, inserted?, kmod).
pub fn kernel_events(agent: &Agent, from: usize) -> Result<Vec<(u128, String, bool, String)>> {
    let path = agent.kernel_log();
    let log = std::fs::read_to_string(&path).with_context(|| format!("{}", path.display()))?;
    log.get(from..)
        .unwrap_or_default()
        .lines()
        .map(|line| {
            let mut words = line.split(' ');
            match (words.next(), words.next(), words.next()) {
                (Some(at), Some(event @ ("insert" | "remove")), Some(kmod)) => Ok((
                    at.parse()?,
                    agent.node.clone(),
                    event == "insert",
                    kmod.to_owned(),
                )),
                _ => bail!("{}: unexpected line {line:?}", path.display()),
            }
        })
        .collect()
}

pub fn log_len(agent: &Agent) -> usize {
    std::fs::metadata(agent.kernel_log()).map_or(0, |m| m.len() as usize)
}

/// When `agent`'s kernel first removed (`inserted` false) or inserted a kmod after byte
/// `from` of its log.
pub fn first_event(agent: &Agent, from: usize, inserted: bool) -> Result<Option<u128>> {
    Ok(kernel_events(agent, from)?
        .into_iter()
        .find(|(_, _, i, _)| *i == inserted)
        .map(|(at, ..)| at))
}

/// Waits until the proxy Deployment and the agents' DaemonSet on `spoke` run `tag`
/// everywhere, rolled out, and the proxy and every agent are ready.
pub async fn wait_addon_on(spoke: &Client, tag: &str, within: Duration) -> Result<()> {
    let suffix = format!(":{tag}");
    wait_until(&format!("the add-on on {tag}"), within, || async {
        let deployment = Api::<Deployment>::namespaced(spoke.clone(), SPOKE_NAMESPACE)
            .get("kmm-spoke-proxy")
            .await
            .map_err(|e| e.to_string())?;
        let daemonset = Api::<DaemonSet>::namespaced(spoke.clone(), SPOKE_NAMESPACE)
            .get("kmm-node-agent")
            .await
            .map_err(|e| e.to_string())?;
        let proxy_image = deployment
            .spec
            .as_ref()
            .and_then(|s| s.template.spec.as_ref())
            .and_then(|s| s.containers.first())
            .and_then(|c| c.image.clone());
        let agent_image = daemonset
            .spec
            .as_ref()
            .and_then(|s| s.template.spec.as_ref())
            .and_then(|s| s.containers.first())
            .and_then(|c| c.image.clone());
        let status = deployment.status.clone().unwrap_or_default();
        let ds = daemonset.status.clone().unwrap_or_default();
        // Counts of an older generation say nothing about the change just made.
        let done = status.observed_generation == deployment.metadata.generation
            && ds.observed_generation == daemonset.metadata.generation
            && proxy_image.as_ref().is_some_and(|i| i.ends_with(&suffix))
            && agent_image.as_ref().is_some_and(|i| i.ends_with(&suffix))
            && status.updated_replicas == Some(1)
            && status.ready_replicas == Some(1)
            && status.replicas == Some(1)
            && ds.updated_number_scheduled == Some(ds.desired_number_scheduled)
            && ds.number_ready == ds.desired_number_scheduled;
        if done {
            Ok(())
        } else {
            Err(format!(
                "proxy {proxy_image:?} {status:?}; agents {agent_image:?} {} of {} updated, {} ready",
                ds.updated_number_scheduled.unwrap_or_default(),
                ds.desired_number_scheduled,
                ds.number_ready
            ))
        }
    })
    .await?;
    fleet_kmm::wait_proxy_ready(spoke, WAIT).await?;
    fleet_kmm::wait_agents_ready(spoke, WAIT).await?;
    Ok(())
}

/// A simulated node whose kernel has no sample image in the fleet's registry, and its
/// cluster: where a module fails for want of an image.
pub fn node_without_image(fleet: &Fleet) -> Result<(String, kmm_e2e::fleet::SimulatedNode)> {
    let images: Vec<&str> = fleet
        .state
        .images
        .iter()
        .map(|i| i.kernel.as_str())
        .collect();
    fleet
        .spoke_names()
        .into_iter()
        .find_map(|spoke| {
            let cluster = fleet.state.cluster(&spoke).ok()?;
            let node = cluster
                .nodes
                .iter()
                .find(|n| !images.contains(&n.kernel.as_str()))?
                .clone();
            Some((spoke, node))
        })
        .context("the fleet has a node whose kernel has no sample image")
}

/// The README's example on the local fleet.
pub struct ReadmeExample {
    /// `docs/examples/local-fleet.yaml`, its registry the fleet's.
    pub module: ManagedClusterModule,
    /// The spoke the README labels (the first).
    pub spoke: String,
    /// Every node of that spoke as (cluster, node): each, KWOK and real, has a sample
    /// image.
    pub nodes: Vec<(String, String)>,
}

pub fn readme_example(fleet: &Fleet) -> Result<ReadmeExample> {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../docs/examples/local-fleet.yaml"
    );
    let text =
        std::fs::read_to_string(path)?.replace("registry.example.com", &fleet.state.node_registry);
    let module: ManagedClusterModule = serde_yaml_ng::from_str(&text)?;
    let spoke = fleet.spoke_names()[0].clone();
    let expected: Vec<(String, String)> = nodes_with_images(fleet, &spoke)?
        .into_iter()
        .map(|(node, _)| (spoke.clone(), node))
        .collect();
    let cluster = fleet.state.cluster(&spoke)?;
    ensure!(
        expected.len() == cluster.nodes.len() + cluster.real_nodes.len(),
        "the example expects images for every node of {spoke}"
    );
    Ok(ReadmeExample {
        module,
        spoke,
        nodes: expected,
    })
}

/// Waits until the module's status samples a failure of `node` with `reason`, and
/// returns its message.
pub async fn wait_failure(hub: &Client, name: &str, node: &str, reason: &str) -> Result<String> {
    Ok(wait_until(
        &format!("{name} failing on {node} with {reason}"),
        WAIT,
        || async {
            let status = status(hub, name).await.map_err(|e| e.to_string())?;
            status["failures"]
                .as_array()
                .into_iter()
                .flatten()
                .find(|f| f["node"] == node && f["reason"] == reason)
                .and_then(|f| f["message"].as_str().map(str::to_owned))
                .ok_or_else(|| format!("failures: {}", status["failures"]))
        },
    )
    .await?)
}

/// The digest the agent recorded loading module `key` (`namespace/name`) from, once it
/// has.
pub async fn loaded_digest(agent: &Agent, key: &str) -> Result<String> {
    Ok(wait_until(
        &format!("{} to record loading {key}", agent.node),
        WAIT,
        || async {
            let state: Value = std::fs::read(agent.state_file())
                .ok()
                .and_then(|b| serde_json::from_slice(&b).ok())
                .ok_or("no state yet")?;
            state["modules"][key]["digest"]
                .as_str()
                .map(str::to_owned)
                .ok_or_else(|| state.to_string())
        },
    )
    .await?)
}

/// Copies `image` of the fleet's registry (plain HTTP, open) into `to` as `name`.
pub async fn copy_image(image: &str, to: &RegistryServer, name: &str) -> Result<()> {
    copy_image_to(image, &to.client(), &to.auth(), &to.image(name)).await
}

/// Copies `image` of the fleet's registry (plain HTTP, open) to `target`, pushed with
/// `client` and `auth`.
pub async fn copy_image_to(
    image: &str,
    client: &oci_client::Client,
    auth: &RegistryAuth,
    target: &str,
) -> Result<()> {
    let source = plain_client();
    let pulled = source
        .pull(
            &image.parse()?,
            &RegistryAuth::Anonymous,
            vec![
                oci_client::manifest::IMAGE_LAYER_GZIP_MEDIA_TYPE,
                oci_client::manifest::IMAGE_LAYER_MEDIA_TYPE,
                oci_client::manifest::IMAGE_DOCKER_LAYER_GZIP_MEDIA_TYPE,
            ],
        )
        .await
        .with_context(|| format!("pulling {image}"))?;
    client
        .push(
            &target.parse()?,
            &pulled.layers,
            pulled.config,
            auth,
            pulled.manifest,
        )
        .await
        .with_context(|| format!("pushing {target}"))?;
    Ok(())
}

/// A client of plain HTTP registries, as the fleet's.
pub fn plain_client() -> oci_client::Client {
    oci_client::Client::new(ClientConfig {
        protocol: ClientProtocol::Http,
        ..ClientConfig::default()
    })
}
