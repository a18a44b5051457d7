//! A module's device plugin on a spoke's real node (real kubelet, containerd, image
//! pulled from the fleet's registry): the proxy's DaemonSet starts the sample plugin only
//! once the module is loaded, the kubelet then advertises its devices in the node's
//! allocatable, and on deletion the plugin stops before the module is unloaded. The order
//! is read from the two records the node keeps: the simulated kernel's log of inserts and
//! removals, and the plugin's own journal.

mod support;

use std::time::Duration;

use anyhow::{Context, Result, ensure};
use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::Node;
use kmm_e2e::fixture::{Fleet, wait_until};
use kube::Api;
use serde_json::json;
use support::*;

/// Pulling the plugin's image onto a fresh node and its registration included.
const PLUGIN_WAIT: Duration = Duration::from_secs(180);
/// Where the plugin's journal lives on the node.
const JOURNAL_DIR: &str = "/var/lib/kmm-sample-device-plugin";

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

#[tokio::test]
async fn the_device_plugin_advertises_only_while_its_module_is_loaded() -> Result<()> {
    let fleet = Fleet::get().await?;
    let kmm = kmm(&fleet)?;
    let spoke = fleet.spoke_names()[0].clone();
    let real = fleet
        .state
        .cluster(&spoke)?
        .real_nodes
        .first()
        .context("the spoke has no real node")?
        .name
        .clone();
    let agent = kmm
        .agents
        .iter()
        .find(|a| a.node == real)
        .with_context(|| format!("no agent on {real}"))?;
    let (id, name) = (unique("kmm-e2e.dev/plugin"), unique("plugin"));
    let resource = format!("kmm-e2e.dev/{name}");
    let client = fleet.spoke(&spoke)?.clone();
    let journal_file = agent
        .root
        .join(JOURNAL_DIR.trim_start_matches('/'))
        .join(&name);
    let log_from = log_len(agent);

    label_cluster(&fleet.hub, &spoke, &id, true).await?;
    label_node(&client, &real, &id, true).await?;
    let mut module = module(&name, &id, sample_mapping(&fleet))?;
    module.spec.module_spec.device_plugin = Some(serde_json::from_value(json!({
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
    }))?);
    create(&fleet.hub, &module).await?;

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
    wait_until(
        "the node to stop advertising the devices",
        PLUGIN_WAIT,
        || async {
            match allocatable(&client, &real, &resource).await {
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

    label_node(&client, &real, &id, false).await?;
    label_cluster(&fleet.hub, &spoke, &id, false).await?;
    let _ = std::fs::remove_file(&journal_file);
    Ok(())
}
