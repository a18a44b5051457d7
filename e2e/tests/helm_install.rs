//! `charts/kmm-fleet` installed with the real `helm` (the toolchain's, pinned in
//! e2e/versions.toml) on the local fleet's hub, then upgraded to a new image tag:
//!
//! * Before touching anything, the chart under the fleet's values must render what the
//!   fleet's kustomize overlay installed (else the test stops there).
//! * `helm install` takes over the fleet's own install in place: the objects get Helm's
//!   ownership label and annotations (what Helm requires to adopt an object), and the
//!   install changes nothing else (the hub Deployment's and the AddOnTemplate's
//!   generations stay); the hub leads.
//! * A module is applied and loaded on every spoke's nodes with a sample image.
//! * The four images are retagged in the fleet's registry (same manifests) and
//!   `helm upgrade` moves the release to the new tag: kmm-hub rolls, OCM rolls the proxy
//!   and the agents on every spoke, and, watched continuously from before the upgrade to
//!   after the roll, no node loses the module's ready label, no simulated kernel removes
//!   or inserts a kmod, and the new agents neither loaded nor unloaded anything.
//!
//! Why in place rather than beside the fleet's install: kmm's namespaces, its
//! cluster-scoped objects (CRDs, webhook, ClusterManagementAddOn `kmm`) and the add-on's
//! namespace on the spokes are fixed, so a second install would fight the first one
//! over the same nodes. Why not `helm uninstall` at the end: it deletes what the
//! release owns, the hub's namespace (and with it the CA every proxy's certificate
//! chains to) and the add-on (its agents). Instead the test always hands the objects back:
//! it deletes the release's records, strips Helm's ownership metadata and re-applies the
//! fleet's overlay server-side, forcing the fields Helm changed back, then waits until the
//! hub and the add-on run the original tag again.
//!
//! Needs the fleet (`cargo xtask env up`); fails, never skips, without it.

mod support;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Context, Result, ensure};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::Node;
use kmm_api::labels::ready_label;
use kmm_api::ocm::ADD_ON_TEMPLATE;
use kmm_e2e::fixture::{Fleet, wait_until};
use kmm_e2e::fleet::hub_install::{self, DEPLOYMENT, Overlay};
use kmm_e2e::fleet::kmm::{Agent, HUB_NAMESPACE};
use kmm_e2e::helm::{Objects, compare, render_chart, render_kustomize};
use kmm_e2e::toolchain::Toolchain;
use kmm_e2e::versions::Versions;
use kube::api::DynamicObject;
use kube::runtime::WatchStreamExt;
use kube::runtime::watcher;
use kube::{Api, Client, ResourceExt};
use serde_json::Value;
use support::*;
use tokio::task::JoinHandle;

const RELEASE: &str = "kmm-fleet-e2e";
/// The release's records live outside kmm-hub: the chart creates that namespace itself.
const RELEASE_NAMESPACE: &str = "default";
/// The images the chart sets, in the fleet's registry.
const IMAGES: [&str; 4] = [
    "kmm-fleet/kmm-hub",
    "kmm-fleet/kmm-spoke-proxy",
    "kmm-fleet/kmm-node-agent",
    "kmm-fleet/kmm-builder",
];
/// Helm adopts an existing object only when it carries these, naming the release.
const MANAGED_BY: &str = "app.kubernetes.io/managed-by";
const RELEASE_NAME: &str = "meta.helm.sh/release-name";
const RELEASE_NAMESPACE_ANNOTATION: &str = "meta.helm.sh/release-namespace";
/// A roll of the hub (two replicas, one surge) or of the add-on on a spoke.
const ROLL: Duration = Duration::from_secs(240);

/// The toolchain's programs, pointed at the hub, with Helm's own state in `dir`.
struct Tools {
    helm: PathBuf,
    kubectl: PathBuf,
    kubeconfig: PathBuf,
    dir: PathBuf,
}

impl Tools {
    fn run(&self, program: &Path, args: &[&str]) -> Result<String> {
        let out = Command::new(program)
            .arg("--kubeconfig")
            .arg(&self.kubeconfig)
            .args(args)
            // Repositories, cache and plugins of the test's own: nothing of the user's.
            .env("HELM_CACHE_HOME", self.dir.join("helm/cache"))
            .env("HELM_CONFIG_HOME", self.dir.join("helm/config"))
            .env("HELM_DATA_HOME", self.dir.join("helm/data"))
            .output()
            .with_context(|| format!("running {}", program.display()))?;
        ensure!(
            out.status.success(),
            "{} {} failed ({}): {}",
            program.display(),
            args.join(" "),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    fn helm(&self, args: &[&str]) -> Result<String> {
        self.run(&self.helm, args)
    }

    fn kubectl(&self, args: &[&str]) -> Result<String> {
        self.run(&self.kubectl, args)
    }

    /// `helm install|upgrade` of the chart with `values`.
    fn helm_release(&self, verb: &str, values: &Value) -> Result<()> {
        let file = self.dir.join(format!("values-{verb}.json"));
        std::fs::write(&file, values.to_string())?;
        let chart = kmm_e2e::helm::chart_dir();
        self.helm(&[
            verb,
            RELEASE,
            &chart.to_string_lossy(),
            "--namespace",
            RELEASE_NAMESPACE,
            "--values",
            &file.to_string_lossy(),
        ])?;
        Ok(())
    }

    /// Deletes the release's records (Helm keeps them as Secrets), if any.
    fn forget_release(&self) -> Result<()> {
        self.kubectl(&[
            "delete",
            "secret",
            "--namespace",
            RELEASE_NAMESPACE,
            "--selector",
            &format!("owner=helm,name={RELEASE}"),
            "--ignore-not-found",
        ])?;
        Ok(())
    }
}

/// The objects the release owns (the chart's templates; Helm keeps `crds/` out of a
/// release), as a file kubectl can label and annotate.
fn release_objects(objects: &Objects, dir: &Path) -> Result<PathBuf> {
    let mut stream = String::new();
    for (key, object) in objects {
        if key.kind != "CustomResourceDefinition" {
            stream.push_str("---\n");
            stream.push_str(&serde_yaml_ng::to_string(object)?);
        }
    }
    let file = dir.join("release-objects.yaml");
    std::fs::write(&file, stream)?;
    Ok(file)
}

fn container_image(deployment: &Deployment) -> Option<String> {
    deployment
        .spec
        .as_ref()?
        .template
        .spec
        .as_ref()?
        .containers
        .first()?
        .image
        .clone()
}

async fn generations(hub: &Client, template: &str) -> Result<(Option<i64>, Option<i64>)> {
    let deployment = Api::<Deployment>::namespaced(hub.clone(), HUB_NAMESPACE)
        .get(DEPLOYMENT)
        .await?;
    let template = Api::<DynamicObject>::all_with(hub.clone(), &ADD_ON_TEMPLATE.api_resource())
        .get(template)
        .await?;
    Ok((deployment.metadata.generation, template.metadata.generation))
}

/// Waits until the hub runs `tag` on every replica and one leads.
async fn wait_hub_on(hub: &Client, tag: &str) -> Result<()> {
    let deployments = Api::<Deployment>::namespaced(hub.clone(), HUB_NAMESPACE);
    wait_until(&format!("the hub Deployment on {tag}"), ROLL, || async {
        let deployment = deployments
            .get(DEPLOYMENT)
            .await
            .map_err(|e| e.to_string())?;
        match container_image(&deployment) {
            Some(image) if image.ends_with(&format!(":{tag}")) => Ok(()),
            other => Err(format!("image {other:?}")),
        }
    })
    .await?;
    hub_install::wait_installed(hub).await?;
    Ok(())
}

/// Every target node's ready label, watched on every spoke from [`NoLoss::watch`] until
/// [`NoLoss::stop`]: each watch event of a target node without the label is recorded.
struct NoLoss {
    tasks: Vec<JoinHandle<()>>,
    losses: Arc<Mutex<Vec<String>>>,
}

impl NoLoss {
    async fn watch(fleet: &Fleet, label: &str, targets: &[(String, String)]) -> Result<Self> {
        let losses = Arc::new(Mutex::new(vec![]));
        let mut tasks = vec![];
        let mut by_cluster: BTreeMap<&str, Vec<String>> = BTreeMap::new();
        for (cluster, node) in targets {
            by_cluster.entry(cluster).or_default().push(node.clone());
        }
        let mut listings = vec![];
        for (cluster, nodes) in by_cluster {
            let api: Api<Node> = Api::all(fleet.spoke(cluster)?.clone());
            let (cluster, label, losses) = (cluster.to_owned(), label.to_owned(), losses.clone());
            let (listed_tx, listed) = tokio::sync::oneshot::channel();
            listings.push(listed);
            let mut listed = Some(listed_tx);
            tasks.push(tokio::spawn(async move {
                let mut events = std::pin::pin!(
                    watcher::watcher(api, watcher::Config::default()).default_backoff()
                );
                while let Some(event) = tokio_stream::StreamExt::next(&mut events).await {
                    // A failed watch is retried with backoff; a relist replays every node.
                    let Ok(event) = event else { continue };
                    let node = match event {
                        watcher::Event::Apply(n) | watcher::Event::InitApply(n) => n,
                        watcher::Event::InitDone => {
                            // The first listing's end; a relist after a failed watch
                            // replays every node above and needs no signal.
                            if let Some(listed) = listed.take() {
                                listed.send(()).ok();
                            }
                            continue;
                        }
                        watcher::Event::Init | watcher::Event::Delete(_) => continue,
                    };
                    let name = node.name_any();
                    if nodes.contains(&name) && !node.labels().contains_key(&label) {
                        losses.lock().expect("not poisoned").push(format!(
                            "{cluster}/{name} without {label} at resourceVersion {:?}",
                            node.resource_version()
                        ));
                    }
                }
            }));
        }
        let watching = Self { tasks, losses };
        // Every spoke's first listing is in before anything changes.
        for listed in listings {
            tokio::time::timeout(WAIT, listed)
                .await
                .context("the Node watches' first listing")?
                .context("a Node watch ended before its first listing")?;
        }
        Ok(watching)
    }

    fn stop(self) -> Vec<String> {
        for task in &self.tasks {
            task.abort();
        }
        self.losses.lock().expect("not poisoned").clone()
    }
}

#[tokio::test]
async fn helm_takes_over_the_hub_in_place_and_upgrades_its_images_without_unloading() -> Result<()>
{
    let fleet = Fleet::get().await?;
    kmm(&fleet)?;
    let versions = Versions::pinned();
    let toolchain = Toolchain::ensure_helm(&versions, settings()?.bin_dir.as_deref())?;
    let work = tempfile::tempdir()?;
    let hub = fleet.state.cluster("hub")?;
    let tools = Tools {
        helm: toolchain.bin("helm").to_path_buf(),
        kubectl: toolchain.bin("kubectl").to_path_buf(),
        kubeconfig: hub.kubeconfig.clone(),
        dir: work.path().to_path_buf(),
    };
    let node_ip = hub
        .real_nodes
        .first()
        .context("the hub's real node")?
        .ip
        .to_string();
    // What the fleet installed (`kmm_images::Options::new`'s tag), not what runs now: a
    // run that died mid-upgrade left the new tag behind, and this one hands back to this.
    let tag = kmm_images::VERSION.to_owned();
    let overlay = Overlay {
        registry: &fleet.state.node_registry,
        tag: &tag,
        node_ip: &node_ip,
    };
    let overlay_dir = work.path().join("overlay");
    hub_install::write(&overlay_dir, &overlay)?;

    // The chart must render what is installed, or taking it over would change the fleet.
    let values = overlay.helm_values();
    let chart = render_chart(&tools.helm, RELEASE, &values)?;
    let installed = render_kustomize(&tools.kubectl, &[&overlay_dir])?;
    let differences = compare(&installed, &chart);
    ensure!(
        differences.is_empty(),
        "the chart does not render the fleet's install; not touching it:\n{}",
        differences
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join("\n")
    );
    let objects = release_objects(&chart, work.path())?;
    let template = chart
        .keys()
        .find(|k| k.kind == ADD_ON_TEMPLATE.kind)
        .map(|k| k.name.clone())
        .context("an AddOnTemplate in the chart's render")?;

    let outcome = take_over_and_upgrade(&fleet, &tools, &objects, &values, &tag, &template).await;
    let restored = hand_back(&fleet, &tools, &objects, &overlay_dir, &tag).await;
    match (outcome, restored) {
        (Ok(()), restored) => restored.context("restoring the fleet's kustomize install"),
        (Err(e), Ok(())) => Err(e),
        (Err(e), Err(restore)) => Err(e.context(format!(
            "and restoring the fleet's kustomize install failed too: {restore:#}"
        ))),
    }
}

async fn take_over_and_upgrade(
    fleet: &Fleet,
    tools: &Tools,
    objects: &Path,
    values: &Value,
    tag: &str,
    template: &str,
) -> Result<()> {
    // A run that died before handing back may have left its records.
    tools.forget_release()?;
    let file = objects.to_string_lossy();
    tools.kubectl(&[
        "label",
        "--overwrite",
        "-f",
        &file,
        &format!("{MANAGED_BY}=Helm"),
    ])?;
    tools.kubectl(&[
        "annotate",
        "--overwrite",
        "-f",
        &file,
        &format!("{RELEASE_NAME}={RELEASE}"),
        &format!("{RELEASE_NAMESPACE_ANNOTATION}={RELEASE_NAMESPACE}"),
    ])?;
    // After the annotations: a Deployment's generation counts annotation changes too (they
    // are copied to its ReplicaSets), though its Pods stay.
    let before = generations(&fleet.hub, template).await?;
    tools.helm_release("install", values)?;
    let status = tools.helm(&["status", RELEASE, "--namespace", RELEASE_NAMESPACE])?;
    ensure!(status.contains("STATUS: deployed"), "helm status: {status}");
    let after = generations(&fleet.hub, template).await?;
    ensure!(
        before == after,
        "taking the install over changed a spec: (Deployment, AddOnTemplate) generations \
         {before:?} -> {after:?}"
    );
    let leader = hub_install::wait_leader(&fleet.hub, WAIT).await?;
    println!("helm: release {RELEASE} took over the fleet's install; {leader} leads");

    let label_key = unique("kmm-e2e.dev/helm");
    let name = unique("helm");
    let mut targets = vec![];
    for cluster in fleet.spoke_names() {
        label_cluster(&fleet.hub, &cluster, &label_key, true).await?;
        for (node, _) in nodes_with_images(fleet, &cluster)? {
            label_node(fleet.spoke(&cluster)?, &node, &label_key, true).await?;
            targets.push((cluster.clone(), node));
        }
    }
    ensure!(!targets.is_empty(), "no spoke node has a sample image");
    create(
        &fleet.hub,
        &module(&name, &label_key, sample_mapping(fleet))?,
    )
    .await?;
    let upgraded = async {
        wait_labelled(fleet, &name, &targets).await?;
        upgrade_without_unloading(fleet, tools, values, tag, &name, &targets).await
    }
    .await;
    let removed = async {
        delete(&fleet.hub, &name).await?;
        wait_labelled(fleet, &name, &[]).await?;
        for cluster in fleet.spoke_names() {
            label_cluster(&fleet.hub, &cluster, &label_key, false).await?;
        }
        anyhow::Ok(())
    }
    .await;
    upgraded?;
    removed
}

async fn upgrade_without_unloading(
    fleet: &Fleet,
    tools: &Tools,
    values: &Value,
    tag: &str,
    name: &str,
    targets: &[(String, String)],
) -> Result<()> {
    let agents: Vec<&Agent> = kmm(fleet)?
        .agents
        .iter()
        .filter(|a| targets.contains(&(a.cluster.clone(), a.node.clone())))
        .collect();
    ensure!(
        agents.len() == targets.len(),
        "an agent for every target node: {} of {}",
        agents.len(),
        targets.len()
    );
    let new_tag = format!("{tag}-helm");
    for image in IMAGES {
        kmm_e2e::kmod::retag(&fleet.state.registry, image, tag, &new_tag).await?;
    }
    let mut upgraded = values.clone();
    upgraded["global"]["imageTag"] = Value::from(new_tag.clone());

    let logs: Vec<usize> = agents.iter().map(|a| log_len(a)).collect();
    let watch = NoLoss::watch(fleet, &ready_label(NAMESPACE, name), targets).await?;
    let rolled = async {
        tools.helm_release("upgrade", &upgraded)?;
        wait_hub_on(&fleet.hub, &new_tag).await?;
        for cluster in fleet.spoke_names() {
            wait_addon_on(fleet.spoke(&cluster)?, &new_tag, ROLL).await?;
        }
        wait_labelled(fleet, name, targets).await
    }
    .await;
    let losses = watch.stop();
    rolled?;
    println!("helm: upgraded to {new_tag}; the hub and every spoke's add-on rolled");
    ensure!(
        losses.is_empty(),
        "nodes lost the module's ready label during the upgrade:\n{}",
        losses.join("\n")
    );
    for (agent, from) in agents.iter().zip(logs) {
        let events = kernel_events(agent, from)?;
        ensure!(
            events.is_empty(),
            "{}/{}: the kernel changed during the upgrade: {events:?}",
            agent.cluster,
            agent.node
        );
        // The agents are new processes: their counters start at zero.
        for what in ["loads", "unloads"] {
            let attempts = agent_attempts(fleet, agent, what).await?;
            ensure!(
                attempts == 0,
                "{}/{}: {attempts} {what} since the upgrade",
                agent.cluster,
                agent.node
            );
        }
    }
    Ok(())
}

/// Hands the install back to the fleet's kustomize overlay (see the module's comment)
/// and waits until everything runs `tag` again.
async fn hand_back(
    fleet: &Fleet,
    tools: &Tools,
    objects: &Path,
    overlay_dir: &Path,
    tag: &str,
) -> Result<()> {
    tools.forget_release()?;
    let file = objects.to_string_lossy();
    tools.kubectl(&["label", "-f", &file, &format!("{MANAGED_BY}-")])?;
    tools.kubectl(&[
        "annotate",
        "-f",
        &file,
        &format!("{RELEASE_NAME}-"),
        &format!("{RELEASE_NAMESPACE_ANNOTATION}-"),
    ])?;
    hub_install::apply_written(&tools.kubectl, &tools.kubeconfig, overlay_dir, true)?;
    wait_hub_on(&fleet.hub, tag).await?;
    for cluster in fleet.spoke_names() {
        wait_addon_on(fleet.spoke(&cluster)?, tag, ROLL).await?;
    }
    let listed: Value = serde_json::from_str(&tools.kubectl(&["get", "-f", &file, "-o", "json"])?)?;
    let still: Vec<String> = listed["items"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|o| {
            o["metadata"]["labels"].get(MANAGED_BY).is_some()
                || o["metadata"]["annotations"].get(RELEASE_NAME).is_some()
        })
        .map(|o| format!("{} {}", o["kind"], o["metadata"]["name"]))
        .collect();
    ensure!(still.is_empty(), "still marked as Helm's: {still:?}");
    Ok(())
}
