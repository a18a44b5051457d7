//! A module's device plugin on a spoke's real node (real kubelet, containerd, image
//! pulled from the fleet's registry).
//!
//! With a module loader: the proxy's DaemonSet starts the sample plugin only once the
//! module is loaded, the kubelet then advertises its devices in the node's allocatable,
//! and on deletion the plugin stops before the module is unloaded. The order is read from
//! the two records the node keeps: the simulated kernel's log of inserts and removals,
//! and the plugin's own journal.
//!
//! Without one (upstream's in-tree driver with its plugin): the plugin runs on the
//! selected node, nothing reaches the node agent, and the module is Ready once the plugin
//! is; deleting it removes the plugin and its labels before the deletion completes.
//!
//! In both, upstream's `device-plugin-ready` label is compared with the plugin Pod's
//! Ready condition at the moment the Node's watch shows it appear: it must never come
//! before the Pod is Ready.

mod support;

use std::collections::BTreeMap;
use std::time::Duration;

use anyhow::{Context, Result, bail, ensure};
use futures::StreamExt;
use futures::stream::BoxStream;
use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::{Node, Pod};
use kmm_api::ManagedClusterModule;
use kmm_api::labels::{
    device_plugin_ready_label, device_plugin_scheduling_label, ready_label, version_ready_label,
};
use kmm_e2e::fixture::{Fleet, wait_until};
use kmm_e2e::fleet::kmm::{Agent, Kmm};
use kube::api::{DeleteParams, ListParams, WatchEvent, WatchParams};
use kube::{Api, ResourceExt};
use serde_json::{Value, json};
use support::*;
use tokio::sync::Mutex;

/// Pulling the plugin's image onto a fresh node and its registration included.
const PLUGIN_WAIT: Duration = Duration::from_secs(180);
/// Where the plugin's journal lives on the node.
const JOURNAL_DIR: &str = "/var/lib/kmm-sample-device-plugin";
/// On the plugin's Pods: the module whose plugin they run (the proxy's label).
const PLUGIN_POD_LABEL: &str = "kmm.sigs.x-k8s.io/device-plugin";

/// One test at a time on the real node: the module-less test counts the node agent's
/// loads and unloads, which the other test's module changes.
static SERIAL: Mutex<()> = Mutex::const_new(());

/// The node's allocatable count of `resource`, if it advertises it.
async fn allocatable(spoke: &kube::Client, node: &str, resource: &str) -> Result<Option<String>> {
    let node = Api::<Node>::all(spoke.clone()).get(node).await?;
    Ok(node
        .status
        .and_then(|s| s.allocatable)
        .and_then(|a| a.get(resource).map(|q| q.0.clone())))
}

/// The plugin's journal: (nanoseconds, what).
fn journal(path: &std::path::Path) -> Result<Vec<(u128, String)>> {
    let text = std::fs::read_to_string(path).with_context(|| format!("{}", path.display()))?;
    text.lines()
        .map(|line| {
            let (at, what) = line.split_once(' ').context("a journal line")?;
            Ok((at.parse()?, what.to_owned()))
        })
        .collect()
}

/// The sample plugin advertising 3 devices of `resource`, journalling to `name`.
fn sample_plugin(fleet: &Fleet, resource: &str, name: &str) -> Result<kmm_api::DevicePluginSpec> {
    Ok(serde_json::from_value(json!({
        "container": {
            "image": format!(
                "{}/{}/kmm-sample-device-plugin:{}",
                fleet.state.node_registry,
                kmm_images::NAMESPACE,
                kmm_images::VERSION
            ),
            "args": ["--resource", resource, "--devices", "3", "--journal", format!("/journal/{name}")],
            "volumeMounts": [{"name": "journal", "mountPath": "/journal"}],
        },
        "volumes": [{"name": "journal", "hostPath": {"path": JOURNAL_DIR, "type": "DirectoryOrCreate"}}],
    }))?)
}

/// The module's plugin Pods on `node`: (uid, Ready and not being deleted).
async fn plugin_pods(
    spoke: &kube::Client,
    module: &str,
    node: &str,
) -> Result<Vec<(String, bool)>> {
    let pods = Api::<Pod>::namespaced(spoke.clone(), NAMESPACE)
        .list(&ListParams::default().labels(&format!("{PLUGIN_POD_LABEL}={module}")))
        .await?;
    Ok(pods
        .items
        .iter()
        .filter(|pod| pod.spec.as_ref().and_then(|s| s.node_name.as_deref()) == Some(node))
        .map(|pod| {
            let ready = pod.metadata.deletion_timestamp.is_none()
                && pod
                    .status
                    .iter()
                    .flat_map(|s| s.conditions.iter().flatten())
                    .any(|c| c.type_ == "Ready" && c.status == "True");
            (pod.uid().unwrap_or_default(), ready)
        })
        .collect())
}

/// Every version of one Node's labels from the moment it is made, in the order the API
/// server wrote them: a watch from the Node's resourceVersion, taken up again from the
/// last version seen when the server ends it.
struct NodeLabels {
    api: Api<Node>,
    node: String,
    version: String,
    events: Option<BoxStream<'static, kube::Result<WatchEvent<Node>>>>,
}

impl NodeLabels {
    async fn follow(spoke: &kube::Client, node: &str) -> Result<Self> {
        let api = Api::<Node>::all(spoke.clone());
        let version = api
            .get(node)
            .await?
            .resource_version()
            .context("a Node has a resourceVersion")?;
        Ok(Self {
            api,
            node: node.to_owned(),
            version,
            events: None,
        })
    }

    /// The next version of the Node's labels.
    async fn next(&mut self) -> Result<BTreeMap<String, String>> {
        loop {
            let events = match &mut self.events {
                Some(events) => events,
                None => {
                    let params =
                        WatchParams::default().fields(&format!("metadata.name={}", self.node));
                    let events = self.api.watch(&params, &self.version).await?.boxed();
                    self.events.insert(events)
                }
            };
            match events.next().await {
                None => self.events = None,
                Some(Err(e)) => return Err(e.into()),
                Some(Ok(WatchEvent::Error(e))) => bail!("watching Node {}: {e}", self.node),
                Some(Ok(WatchEvent::Bookmark(_))) => {}
                Some(Ok(WatchEvent::Deleted(_))) => bail!("Node {} was deleted", self.node),
                Some(Ok(WatchEvent::Added(node) | WatchEvent::Modified(node))) => {
                    if let Some(version) = node.resource_version() {
                        self.version = version;
                    }
                    return Ok(node.labels().clone());
                }
            }
        }
    }

    /// The first version of the labels, from now on, for which `wanted` holds.
    async fn until(
        &mut self,
        what: &str,
        within: Duration,
        wanted: impl Fn(&BTreeMap<String, String>) -> bool,
    ) -> Result<BTreeMap<String, String>> {
        tokio::time::timeout(within, async {
            loop {
                let labels = self.next().await?;
                if wanted(&labels) {
                    return Ok(labels);
                }
            }
        })
        .await
        .with_context(|| format!("{what}: not within {} s", within.as_secs()))?
    }
}

/// Waits until the Node's watch shows `device-plugin-ready` for the module and checks,
/// at that moment, that the node's plugin Pod is Ready; the labels then and the Ready
/// Pod's uid.
async fn plugin_ready_on(
    labels: &mut NodeLabels,
    spoke: &kube::Client,
    module: &str,
    node: &str,
    within: Duration,
) -> Result<(BTreeMap<String, String>, String)> {
    let label = device_plugin_ready_label(NAMESPACE, module);
    let seen = labels
        .until(&format!("{label} on {node}"), within, |l| {
            l.contains_key(&label)
        })
        .await?;
    let pods = plugin_pods(spoke, module, node).await?;
    let ready = pods
        .iter()
        .find(|(_, ready)| *ready)
        .with_context(|| format!("{label} set while no plugin Pod on {node} is Ready: {pods:?}"))?;
    Ok((seen, ready.0.clone()))
}

/// Whether a module's status has its `Ready` condition True.
fn is_ready(status: &Value) -> bool {
    status["conditions"].as_array().is_some_and(|conditions| {
        conditions
            .iter()
            .any(|c| c["type"] == "Ready" && c["status"] == "True")
    })
}

fn count(value: &Value) -> i64 {
    value.as_i64().unwrap_or_default()
}

/// Waits until `real` advertises none of the plugin's devices and the module `name`'s
/// plugin DaemonSet is gone.
async fn wait_plugin_gone(
    client: &kube::Client,
    real: &str,
    resource: &str,
    name: &str,
) -> Result<()> {
    wait_until(
        "the node to stop advertising the devices",
        PLUGIN_WAIT,
        || async {
            match allocatable(client, real, resource).await {
                Ok(Some(count)) if count == "0" => Ok(()),
                Ok(None) => Ok(()),
                other => Err(format!("{other:?}")),
            }
        },
    )
    .await?;
    let daemon_sets: Api<DaemonSet> = Api::namespaced(client.clone(), NAMESPACE);
    wait_until("the plugin's DaemonSet to go", WAIT, || async {
        match daemon_sets.get_opt(&format!("{name}-device-plugin")).await {
            Ok(None) => Ok(()),
            other => Err(format!("{:?}", other.map(|d| d.map(|d| d.metadata.name)))),
        }
    })
    .await?;
    Ok(())
}

/// The first spoke's real node and its agent, and the names a plugin test's module uses.
struct PluginCase<'a> {
    spoke: String,
    real: String,
    agent: &'a Agent,
    client: kube::Client,
    id: String,
    name: String,
    /// The extended resource the sample plugin advertises.
    resource: String,
    /// The plugin's journal, as the node keeps it.
    journal_file: std::path::PathBuf,
    /// kmm-fleet's label that schedules the plugin, and upstream's `device-plugin-ready`.
    scheduling: String,
    plugin_ready: String,
}

fn plugin_case<'a>(fleet: &'a Fleet, kmm: &'a Kmm, prefix: &str) -> Result<PluginCase<'a>> {
    let spoke = fleet.spoke_names()[0].clone();
    let real = real_node(fleet, &spoke)?.name;
    let agent = kmm
        .agents
        .iter()
        .find(|a| a.node == real)
        .with_context(|| format!("no agent on {real}"))?;
    let (id, name) = (unique(&format!("kmm-e2e.dev/{prefix}")), unique(prefix));
    let journal_file = agent
        .root
        .join(JOURNAL_DIR.trim_start_matches('/'))
        .join(&name);
    Ok(PluginCase {
        client: fleet.spoke(&spoke)?.clone(),
        resource: format!("kmm-e2e.dev/{name}"),
        scheduling: device_plugin_scheduling_label(NAMESPACE, &name),
        plugin_ready: device_plugin_ready_label(NAMESPACE, &name),
        spoke,
        real,
        agent,
        id,
        name,
        journal_file,
    })
}

#[tokio::test]
async fn the_device_plugin_advertises_only_while_its_module_is_loaded() -> Result<()> {
    let _serial = SERIAL.lock().await;
    let fleet = Fleet::get().await?;
    let kmm = kmm(&fleet)?;
    let PluginCase {
        spoke,
        real,
        agent,
        client,
        id,
        name,
        resource,
        journal_file,
        scheduling,
        plugin_ready,
    } = plugin_case(&fleet, kmm, "plugin")?;
    let log_from = log_len(agent);

    label_cluster(&fleet.hub, &spoke, &id, true).await?;
    label_node(&client, &real, &id, true).await?;
    let mut module = module(&name, &id, sample_mapping(&fleet))?;
    module.spec.module_spec.device_plugin = Some(sample_plugin(&fleet, &resource, &name)?);
    let mut labels = NodeLabels::follow(&client, &real).await?;
    create(&fleet.hub, &module).await?;

    // As upstream: device-plugin-ready once the plugin's Pod is Ready, not before.
    let (seen, _) = plugin_ready_on(&mut labels, &client, &name, &real, PLUGIN_WAIT).await?;
    ensure!(
        seen.contains_key(&scheduling) && seen.contains_key(&ready_label(NAMESPACE, &name)),
        "device-plugin-ready without the module's other labels: {seen:?}"
    );
    wait_until(
        "the node to advertise the plugin's devices",
        PLUGIN_WAIT,
        || async {
            match allocatable(&client, &real, &resource).await {
                Ok(Some(count)) if count == "3" => Ok(()),
                other => Err(format!("{other:?}")),
            }
        },
    )
    .await?;
    let inserted = first_event(agent, log_from, true)?.context("no insert in the kernel log")?;
    let registered = journal(&journal_file)?
        .into_iter()
        .find(|(_, what)| what == "registered")
        .context("the plugin never registered")?
        .0;
    ensure!(
        inserted < registered,
        "the plugin registered ({registered}) before the module was inserted ({inserted})"
    );

    delete(&fleet.hub, &name).await?;
    let removed = kernel_events(agent, log_from)?
        .into_iter()
        .find(|(at, _, insert, _)| !insert && *at > inserted)
        .map(|(at, ..)| at)
        .context("the module was never removed")?;
    let stopping = journal(&journal_file)?
        .into_iter()
        .find(|(_, what)| what == "stopping")
        .context("the plugin never stopped")?
        .0;
    ensure!(
        stopping < removed,
        "the module was removed ({removed}) before its plugin stopped ({stopping})"
    );
    // The module is unloaded only once the plugin's Pod is gone, and its labels went
    // when the plugin was to stop.
    let pods = plugin_pods(&client, &name, &real).await?;
    ensure!(pods.is_empty(), "plugin Pods after the unload: {pods:?}");
    wait_until("the plugin's labels to go", WAIT, || async {
        let node = Api::<Node>::all(client.clone())
            .get(&real)
            .await
            .map_err(|e| e.to_string())?;
        let left: Vec<&String> = [&scheduling, &plugin_ready]
            .into_iter()
            .filter(|l| node.labels().contains_key(*l))
            .collect();
        left.is_empty().then_some(()).ok_or(format!("{left:?}"))
    })
    .await?;
    wait_plugin_gone(&client, &real, &resource, &name).await?;

    label_node(&client, &real, &id, false).await?;
    label_cluster(&fleet.hub, &spoke, &id, false).await?;
    let _ = std::fs::remove_file(&journal_file);
    Ok(())
}

/// A module with a device plugin and no loader, selecting the real node (and only it) of
/// the first spoke.
fn plugin_only_module(
    fleet: &Fleet,
    name: &str,
    selector_key: &str,
    resource: &str,
) -> Result<ManagedClusterModule> {
    let mut module = module(name, selector_key, sample_mapping(fleet))?;
    module.spec.module_spec.module_loader = None;
    module.spec.module_spec.device_plugin = Some(sample_plugin(fleet, resource, name)?);
    Ok(module)
}

#[tokio::test]
async fn a_module_with_only_a_device_plugin_runs_it_on_its_nodes_and_loads_nothing() -> Result<()> {
    let _serial = SERIAL.lock().await;
    let fleet = Fleet::get().await?;
    let kmm = kmm(&fleet)?;
    let PluginCase {
        spoke,
        real,
        agent,
        client,
        id,
        name,
        resource,
        journal_file,
        scheduling,
        plugin_ready,
    } = plugin_case(&fleet, kmm, "plugin-only")?;
    let agent_work = || async {
        Ok::<_, anyhow::Error>(
            agent_attempts(&fleet, agent, "loads").await?
                + agent_attempts(&fleet, agent, "unloads").await?,
        )
    };
    let work_before = agent_work().await?;

    label_cluster(&fleet.hub, &spoke, &id, true).await?;
    label_node(&client, &real, &id, true).await?;
    let mut labels = NodeLabels::follow(&client, &real).await?;
    create(
        &fleet.hub,
        &plugin_only_module(&fleet, &name, &id, &resource)?,
    )
    .await?;

    let (seen, first_pod) =
        plugin_ready_on(&mut labels, &client, &name, &real, PLUGIN_WAIT).await?;
    ensure!(seen.contains_key(&scheduling), "{seen:?}");
    for label in [
        ready_label(NAMESPACE, &name),
        version_ready_label(NAMESPACE, &name),
    ] {
        ensure!(
            !seen.contains_key(&label),
            "{label} on a module that loads nothing"
        );
    }
    wait_until(
        "the node to advertise the plugin's devices",
        PLUGIN_WAIT,
        || async {
            match allocatable(&client, &real, &resource).await {
                Ok(Some(count)) if count == "3" => Ok(()),
                other => Err(format!("{other:?}")),
            }
        },
    )
    .await?;
    let status = wait_until(
        "the module Ready with its plugin available on its one node",
        WAIT,
        || async {
            let status = status(&fleet.hub, &name).await.map_err(|e| e.to_string())?;
            let plugins = &status["devicePlugins"];
            let running = count(&plugins["desired"]) == 1 && count(&plugins["available"]) == 1;
            if running && is_ready(&status) {
                Ok(status)
            } else {
                Err(status.to_string())
            }
        },
    )
    .await?;
    let nodes = &status["nodes"];
    ensure!(
        [&nodes["matching"], &nodes["loaded"], &nodes["failed"]]
            .into_iter()
            .all(|n| count(n) == 0),
        "nothing is loaded, no node counts: {status}"
    );

    // The Pod stops (deleted; the DaemonSet replaces it): the label goes, and comes back
    // once the new Pod is Ready.
    let mut labels = NodeLabels::follow(&client, &real).await?;
    let pod_name = Api::<Pod>::namespaced(client.clone(), NAMESPACE)
        .list(&ListParams::default().labels(&format!("{PLUGIN_POD_LABEL}={name}")))
        .await?
        .items
        .into_iter()
        .find(|pod| pod.uid().as_deref() == Some(first_pod.as_str()))
        .context("the Ready plugin Pod is gone")?
        .name_any();
    Api::<Pod>::namespaced(client.clone(), NAMESPACE)
        .delete(&pod_name, &DeleteParams::default())
        .await?;
    labels
        .until(&format!("{plugin_ready} to go with its Pod"), WAIT, |l| {
            !l.contains_key(&plugin_ready)
        })
        .await?;
    let (_, second_pod) = plugin_ready_on(&mut labels, &client, &name, &real, PLUGIN_WAIT).await?;
    ensure!(
        second_pod != first_pod,
        "device-plugin-ready came back for the Pod that was deleted"
    );

    ensure!(
        agent_work().await? == work_before,
        "the node agent loaded or unloaded something for a module without a loader"
    );
    let state = std::fs::read_to_string(agent.state_file()).unwrap_or_default();
    ensure!(
        !state.contains(&name),
        "the agent's state names the module: {state}"
    );

    // Deleting it completes only once the plugin's Pod and labels are gone.
    delete(&fleet.hub, &name).await?;
    let pods = plugin_pods(&client, &name, &real).await?;
    ensure!(pods.is_empty(), "plugin Pods after the deletion: {pods:?}");
    let node = Api::<Node>::all(client.clone()).get(&real).await?;
    for label in [&scheduling, &plugin_ready] {
        ensure!(
            !node.labels().contains_key(label),
            "{label} after the deletion"
        );
    }
    wait_plugin_gone(&client, &real, &resource, &name).await?;
    ensure!(
        agent_work().await? == work_before,
        "the node agent acted on the deletion of a module without a loader"
    );

    label_node(&client, &real, &id, false).await?;
    label_cluster(&fleet.hub, &spoke, &id, false).await?;
    let _ = std::fs::remove_file(&journal_file);
    Ok(())
}
