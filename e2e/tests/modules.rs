//! The fleet data path end to end: a ManagedClusterModule on the hub becomes modules
//! loaded (simulated kernels, real images, real modprobe resolution) and labelled on the
//! right nodes of the right clusters, through the real kmm-hub, kmm-spoke-proxy and
//! kmm-node-agent of the local fleet (Pods deployed by OCM; KWOK nodes' agents run by
//! `kwok-pod-runner`).
//!
//! The tests restart and stop fleet components, so they run one at a time.

mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use anyhow::{Context, Result, bail, ensure};
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kmm_api::ManagedClusterModule;
use kmm_e2e::fixture::{Fleet, wait_until};
use kmm_e2e::fleet::hub_install;
use kmm_e2e::fleet::kmm::{self as fleet_kmm, Agent};
use kmm_e2e::hops::{self, Hop};
use kmm_runtime::pki::IssuedCertificate;
use kube::api::{Patch, PatchParams};
use kube::{Api, ResourceExt};
use serde_json::{Value, json};
use support::*;
use tokio::sync::Mutex;

/// One disruptive test at a time.
static SERIAL: Mutex<()> = Mutex::const_new(());
/// A killed leader's Lease expires after its duration (15 s); then a standby takes it.
const LEASE_TAKEOVER: Duration = Duration::from_secs(40);

#[tokio::test]
async fn a_module_labels_exactly_the_selected_nodes_of_the_selected_cluster_until_deleted()
-> Result<()> {
    let _serial = SERIAL.lock().await;
    let fleet = Fleet::get().await?;
    kmm(&fleet)?;
    let (id, name) = (unique("kmm-e2e.dev/select"), unique("select"));
    let spoke = fleet.spoke_names()[0].clone();
    let candidates = nodes_with_images(&fleet, &spoke)?;
    ensure!(
        candidates.len() >= 2,
        "{spoke} needs two nodes with images: {candidates:?}"
    );
    let chosen: Vec<(String, String)> = candidates[..2]
        .iter()
        .map(|(node, _)| (spoke.clone(), node.clone()))
        .collect();
    label_cluster(&fleet.hub, &spoke, &id, true).await?;
    for (_, node) in &chosen {
        label_node(fleet.spoke(&spoke)?, node, &id, true).await?;
    }
    // The other spokes' nodes carry the node label too: the cluster selector must
    // keep them out.
    for other in fleet.spoke_names().iter().filter(|s| **s != spoke) {
        for (node, _) in nodes_with_images(&fleet, other)? {
            label_node(fleet.spoke(other)?, &node, &id, true).await?;
        }
    }

    create(&fleet.hub, &module(&name, &id, sample_mapping(&fleet))?).await?;
    wait_labelled(&fleet, &name, &chosen).await?;
    let seen = wait_until(
        "the module's status to count both nodes loaded",
        WAIT,
        || async {
            let status = status(&fleet.hub, &name).await.map_err(|e| e.to_string())?;
            if status["nodes"]["loaded"] == 2 && status["clusters"]["selected"] == 1 {
                Ok(status)
            } else {
                Err(status.to_string())
            }
        },
    )
    .await?;
    ensure!(seen["nodes"]["failed"] == 0, "unexpected failures: {seen}");

    delete(&fleet.hub, &name).await?;
    wait_labelled(&fleet, &name, &[]).await?;
    label_cluster(&fleet.hub, &spoke, &id, false).await?;
    Ok(())
}

/// Every component publishes when it did its part of a load (the timestamp gauges the
/// convergence bench turns into hops): each stage moves within the round of a create.
#[tokio::test]
async fn every_stage_of_a_load_publishes_its_moment_within_the_round() -> Result<()> {
    let _serial = SERIAL.lock().await;
    let fleet = Fleet::get().await?;
    kmm(&fleet)?;
    let (id, name) = (unique("kmm-e2e.dev/hops"), unique("hops"));
    let spoke = fleet.spoke_names()[0].clone();
    let (node, _) = nodes_with_images(&fleet, &spoke)?
        .into_iter()
        .next()
        .with_context(|| format!("{spoke} has no node with an image"))?;
    let spoke_client = fleet.spoke(&spoke)?;
    label_cluster(&fleet.hub, &spoke, &id, true).await?;
    label_node(spoke_client, &node, &id, true).await?;
    let unix_now = || kmm_runtime::timestamp::unix_seconds(std::time::SystemTime::now());
    let agent_metrics = || fleet_kmm::agent_metrics(spoke_client, &node);
    let steps_before = hops::step_totals(&[agent_metrics().await?])?;
    let created = unix_now();
    create(&fleet.hub, &module(&name, &id, sample_mapping(&fleet))?).await?;
    let chosen = [(spoke.clone(), node.clone())];
    wait_labelled(&fleet, &name, &chosen).await?;
    let seen = unix_now();
    let mut texts = fleet_kmm::hub_metrics(&fleet.hub).await?;
    texts.push(fleet_kmm::proxy_metrics(spoke_client).await?);
    texts.push(agent_metrics().await?);
    let round = hops::hops(created, &hops::latest_moments(&texts)?, seen);

    let unmoved: Vec<String> = round
        .iter()
        .filter(|h| matches!(h, Hop::Missing(_) | Hop::Stale(_)))
        .map(ToString::to_string)
        .collect();
    ensure!(
        unmoved.is_empty(),
        "stages that did not move in the round: {unmoved:?} (every hop: {})",
        hops::round_line(&round, &Default::default())
    );
    let steps = hops::step_means(
        &steps_before,
        &hops::step_totals(&texts[texts.len() - 1..])?,
    );
    ensure!(
        steps.contains_key("modprobe"),
        "the agent of {node} timed no modprobe step in the round: {steps:?}"
    );

    delete(&fleet.hub, &name).await?;
    wait_labelled(&fleet, &name, &[]).await?;
    label_node(spoke_client, &node, &id, false).await?;
    label_cluster(&fleet.hub, &spoke, &id, false).await?;
    Ok(())
}

#[tokio::test]
async fn a_node_whose_kernel_has_no_mapping_is_skipped_and_not_labelled() -> Result<()> {
    let _serial = SERIAL.lock().await;
    let fleet = Fleet::get().await?;
    kmm(&fleet)?;
    let (id, name) = (unique("kmm-e2e.dev/unmapped"), unique("unmapped"));
    let spoke = fleet.spoke_names()[0].clone();
    let nodes = fleet.state.cluster(&spoke)?.nodes.clone();
    let (mapped, unmapped) = nodes
        .iter()
        .zip(nodes.iter().skip(1))
        .find(|(a, b)| a.kernel != b.kernel)
        .context("the spoke needs two nodes with different kernels")?;
    label_cluster(&fleet.hub, &spoke, &id, true).await?;
    for node in [mapped, unmapped] {
        label_node(fleet.spoke(&spoke)?, &node.name, &id, true).await?;
    }
    let mapping = json!([{
        "literal": mapped.kernel,
        "containerImage": format!("{}/samples/kmm-hello:{}", fleet.state.node_registry, mapped.kernel),
    }]);
    create(&fleet.hub, &module(&name, &id, mapping)?).await?;

    wait_labelled(&fleet, &name, &[(spoke.clone(), mapped.name.clone())]).await?;
    // As upstream: the unmapped node is skipped, not failed, and Ready does not wait for it.
    let status = wait_until(
        "the unmapped node skipped and the module ready",
        WAIT,
        || async {
            let status = status(&fleet.hub, &name).await.map_err(|e| e.to_string())?;
            let ready = status["conditions"].as_array().is_some_and(|conditions| {
                conditions
                    .iter()
                    .any(|c| c["type"] == "Ready" && c["status"] == "True")
            });
            if status["nodes"]["skipped"] == 1 && ready {
                Ok(status)
            } else {
                Err(status.to_string())
            }
        },
    )
    .await?;
    ensure!(
        status["nodes"]["failed"] == 0 && status["nodes"]["matching"] == 1,
        "{status}"
    );
    ensure!(
        status["failures"].as_array().is_none_or(Vec::is_empty),
        "a skipped node is no failure: {status}"
    );
    ensure!(
        (
            &status["numberDesired"],
            &status["numberApplied"],
            &status["numberDegraded"]
        ) == (&json!(1), &json!(1), &json!(0)),
        "upstream's counters: {status}"
    );
    ensure!(
        labelled(&fleet, &name).await?.len() == 1,
        "only the mapped node is labelled"
    );

    delete(&fleet.hub, &name).await?;
    wait_labelled(&fleet, &name, &[]).await?;
    label_cluster(&fleet.hub, &spoke, &id, false).await?;
    Ok(())
}

/// What the agent of `agent` recorded as loaded for the module: the image reference.
fn recorded_image(agent: &Agent, name: &str) -> Result<Option<String>> {
    let path = agent.state_file();
    let state: Value = match std::fs::read(&path) {
        Ok(bytes) => serde_json::from_slice(&bytes)?,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e).with_context(|| format!("reading {}", path.display())),
    };
    Ok(state["modules"][format!("kmm-e2e/{name}")]["image"]
        .as_str()
        .map(str::to_owned))
}

/// Moves a simulated node to `kernel` as a node upgrade would: the node powers off (its
/// agent is killed), reboots into the new kernel (a fresh simulated kernel reporting the
/// new release), the kubelet reports it, and the agent of the same Pod starts again.
async fn upgrade_node(fleet: &Fleet, agent: &Agent, kernel: &str) -> Result<()> {
    agent.power_off().await?;
    let kernel_dir = agent.kernel_dir();
    std::fs::remove_dir_all(&kernel_dir)?;
    std::fs::create_dir_all(&kernel_dir)?;
    std::fs::write(kernel_dir.join("release"), kernel)?;
    Api::<Node>::all(fleet.spoke(&agent.cluster)?.clone())
        .patch_status(
            &agent.node,
            &PatchParams::default(),
            &Patch::Merge(json!({ "status": { "nodeInfo": { "kernelVersion": kernel } } })),
        )
        .await?;
    agent.power_on()?;
    Ok(())
}

#[tokio::test]
async fn a_kernel_upgrade_switches_the_node_to_the_image_of_its_new_kernel() -> Result<()> {
    let _serial = SERIAL.lock().await;
    let fleet = Fleet::get().await?;
    let kmm = kmm(&fleet)?;
    let (id, name) = (unique("kmm-e2e.dev/upgrade"), unique("upgrade"));
    let spoke = fleet.spoke_names()[0].clone();
    let (node, old_kernel) = nodes_with_images(&fleet, &spoke)?
        .into_iter()
        .next()
        .context("a node with an image")?;
    let new_kernel = fleet
        .state
        .images
        .iter()
        .map(|i| i.kernel.clone())
        .find(|k| *k != old_kernel)
        .context("a second kernel with an image")?;
    let agent = kmm
        .agents
        .iter()
        .find(|a| a.node == node)
        .context("the node's agent")?
        .clone();
    label_cluster(&fleet.hub, &spoke, &id, true).await?;
    label_node(fleet.spoke(&spoke)?, &node, &id, true).await?;
    create(&fleet.hub, &module(&name, &id, sample_mapping(&fleet))?).await?;
    let target = [(spoke.clone(), node.clone())];
    wait_labelled(&fleet, &name, &target).await?;
    let before = recorded_image(&agent, &name)?.context("the agent recorded the load")?;
    ensure!(
        before.ends_with(&old_kernel),
        "loaded {before} on {old_kernel}"
    );

    upgrade_node(&fleet, &agent, &new_kernel).await?;
    let after = wait_until("the node to run the new kernel's image", WAIT, || async {
        match recorded_image(&agent, &name) {
            Ok(Some(image)) if image.ends_with(&new_kernel) => Ok(image),
            other => Err(format!("recorded: {other:?}")),
        }
    })
    .await?;
    wait_labelled(&fleet, &name, &target).await?;
    ensure!(after.ends_with(&new_kernel), "{after}");

    upgrade_node(&fleet, &agent, &old_kernel).await?;
    wait_labelled(&fleet, &name, &target).await?;
    delete(&fleet.hub, &name).await?;
    wait_labelled(&fleet, &name, &[]).await?;
    label_cluster(&fleet.hub, &spoke, &id, false).await?;
    Ok(())
}

#[tokio::test]
async fn killing_the_leader_hub_mid_rollout_moves_the_lease_and_unloads_nothing() -> Result<()> {
    let _serial = SERIAL.lock().await;
    let fleet = Fleet::get().await?;
    let kmm = kmm(&fleet)?.clone();
    let (id, name) = (unique("kmm-e2e.dev/failover"), unique("failover"));
    let mut targets = vec![];
    for spoke in fleet.spoke_names() {
        label_cluster(&fleet.hub, &spoke, &id, true).await?;
        for (node, _) in nodes_with_images(&fleet, &spoke)? {
            label_node(fleet.spoke(&spoke)?, &node, &id, true).await?;
            targets.push((spoke.clone(), node));
        }
    }
    let unloads_before = unloads(&fleet, &kmm).await?;

    create(&fleet.hub, &module(&name, &id, sample_mapping(&fleet))?).await?;
    // Mid-rollout the leader crashes (SIGKILL) without releasing its Lease. (A spec change
    // during the handover is kmm-hub's leadership test; see the closing note of issue 10.)
    let former = hub_install::lease_holder(&fleet.hub).await?;
    hub_install::crash_leader(&fleet.hub).await?;
    hub_install::wait_lease_moved(&fleet.hub, LEASE_TAKEOVER, &former).await?;
    wait_labelled(&fleet, &name, &targets).await?;
    wait_until(
        "the new leader's status to count every node",
        WAIT,
        || async {
            let status = status(&fleet.hub, &name).await.map_err(|e| e.to_string())?;
            if status["nodes"]["loaded"] == targets.len() {
                Ok(())
            } else {
                Err(status.to_string())
            }
        },
    )
    .await?;
    // A proxy restart after the failover resyncs without unloading either.
    fleet_kmm::restart_proxy(fleet.spoke(&fleet.spoke_names()[0])?, WAIT).await?;
    wait_labelled(&fleet, &name, &targets).await?;
    let unloads_after = unloads(&fleet, &kmm).await?;
    ensure!(
        unloads_after == unloads_before,
        "the failover caused {} unload(s)",
        unloads_after - unloads_before
    );
    // The Deployment replaces the killed replica.
    hub_install::scale(&fleet.hub, 2).await?;

    delete(&fleet.hub, &name).await?;
    wait_labelled(&fleet, &name, &[]).await?;
    for spoke in fleet.spoke_names() {
        label_cluster(&fleet.hub, &spoke, &id, false).await?;
    }
    Ok(())
}

#[tokio::test]
async fn a_severed_hub_connection_leaves_modules_loaded_and_labelled() -> Result<()> {
    let _serial = SERIAL.lock().await;
    let fleet = Fleet::get().await?;
    let kmm = kmm(&fleet)?.clone();
    let (id, name) = (unique("kmm-e2e.dev/severed"), unique("severed"));
    let spoke = fleet.spoke_names()[0].clone();
    let (node, _) = nodes_with_images(&fleet, &spoke)?
        .into_iter()
        .next()
        .context("a node with an image")?;
    label_cluster(&fleet.hub, &spoke, &id, true).await?;
    label_node(fleet.spoke(&spoke)?, &node, &id, true).await?;
    create(&fleet.hub, &module(&name, &id, sample_mapping(&fleet))?).await?;
    let target = [(spoke.clone(), node.clone())];
    wait_labelled(&fleet, &name, &target).await?;
    let unloads_before = unloads_except(&fleet, &kmm, &node).await?;

    hub_install::scale(&fleet.hub, 0).await?;
    let spoke_client = fleet.spoke(&spoke)?;
    wait_until("the proxy to notice the hub is gone", WAIT, || async {
        let text = fleet_kmm::proxy_metrics(spoke_client)
            .await
            .map_err(|e| e.to_string())?;
        if text
            .lines()
            .any(|l| l.trim() == "kmm_spoke_proxy_hub_connected 0")
        {
            Ok(())
        } else {
            Err("the proxy still reports the hub connected".to_owned())
        }
    })
    .await?;
    // The agent restarts too while the hub is away: still nothing is unloaded.
    let agent = kmm
        .agents
        .iter()
        .find(|a| a.node == node)
        .context("the node's agent")?;
    fleet_kmm::restart_agent(spoke_client, &agent.node, WAIT).await?;
    ensure!(
        labelled(&fleet, &name).await?.len() == 1,
        "the label stays while the hub is away"
    );
    ensure!(
        recorded_image(agent, &name)?.is_some(),
        "the module stays loaded while the hub is away"
    );
    // The restarted agent counts from zero; it neither reloads nor unloads.
    ensure!(
        agent_attempts(&fleet, agent, "loads").await? == 0,
        "the restarted agent reloaded the module"
    );
    ensure!(
        unloads_except(&fleet, &kmm, &node).await?
            + agent_attempts(&fleet, agent, "unloads").await?
            == unloads_before,
        "nothing was unloaded"
    );

    hub_install::scale(&fleet.hub, 2).await?;
    wait_until("the module's status to be fresh again", WAIT, || async {
        let status = status(&fleet.hub, &name).await.map_err(|e| e.to_string())?;
        if status["nodes"]["loaded"] == 1 && status["clusters"]["connected"] == 1 {
            Ok(())
        } else {
            Err(status.to_string())
        }
    })
    .await?;
    ensure!(
        unloads_except(&fleet, &kmm, &node).await?
            + agent_attempts(&fleet, agent, "unloads").await?
            == unloads_before,
        "nothing was unloaded once the hub returned"
    );

    delete(&fleet.hub, &name).await?;
    wait_labelled(&fleet, &name, &[]).await?;
    label_cluster(&fleet.hub, &spoke, &id, false).await?;
    Ok(())
}

#[tokio::test]
async fn the_hub_refuses_proxies_without_a_valid_certificate_of_its_ca() -> Result<()> {
    let _serial = SERIAL.lock().await;
    let fleet = Fleet::get().await?;
    let kmm = kmm(&fleet)?;
    let spoke = fleet.spoke_names()[0].clone();
    let hub_ca = std::fs::read_to_string(&kmm.hub_ca)?;

    let good = probe::hub_client_certificate(&fleet.hub, &spoke, false).await?;
    let reply = probe::first_hub_message(&kmm.hub_grpc, &hub_ca, &good).await;
    ensure!(reply.is_ok(), "a valid certificate is served: {reply:?}");

    let expired = probe::hub_client_certificate(&fleet.hub, &spoke, true).await?;
    let reply = probe::first_hub_message(&kmm.hub_grpc, &hub_ca, &expired).await;
    ensure!(
        reply.is_err(),
        "an expired certificate is refused: {reply:?}"
    );

    let foreign = probe::foreign_client_certificate(&spoke)?;
    let reply = probe::first_hub_message(&kmm.hub_grpc, &hub_ca, &foreign).await;
    ensure!(
        reply.is_err(),
        "a certificate of another CA is refused: {reply:?}"
    );

    let stranger = probe::hub_client_certificate(&fleet.hub, "no-such-cluster", false).await?;
    let reply = probe::first_hub_message(&kmm.hub_grpc, &hub_ca, &stranger).await;
    ensure!(
        reply.is_err(),
        "a certificate of a cluster the hub does not manage is refused: {reply:?}"
    );
    Ok(())
}

#[tokio::test]
async fn a_clusters_ocm_certificate_receives_only_that_clusters_intents() -> Result<()> {
    let _serial = SERIAL.lock().await;
    let fleet = Fleet::get().await?;
    let kmm = kmm(&fleet)?;
    let hub_ca = std::fs::read_to_string(&kmm.hub_ca)?;
    let names = fleet.spoke_names();
    let (this, other) = (names[0].clone(), names[1].clone());
    // A module for the other cluster only, applied there before the probe.
    let (id, name) = (unique("kmm-e2e.dev/isolation"), unique("isolation"));
    label_cluster(&fleet.hub, &other, &id, true).await?;
    let mut targets = vec![];
    for (node, _) in nodes_with_images(&fleet, &other)? {
        label_node(fleet.spoke(&other)?, &node, &id, true).await?;
        targets.push((other.clone(), node));
    }
    create(&fleet.hub, &module(&name, &id, sample_mapping(&fleet))?).await?;
    wait_labelled(&fleet, &name, &targets).await?;

    let identity = |(cert_pem, key_pem): (String, String)| IssuedCertificate {
        cert_pem,
        key_pem: key_pem.into(),
    };
    let theirs = identity(fleet_kmm::ocm_client_certificate(fleet.spoke(&other)?).await?);
    let reply = probe::first_hub_message(&kmm.hub_grpc, &hub_ca, &theirs).await;
    ensure!(
        reply.as_ref().is_ok_and(|m| m.contains(&name)),
        "{other}'s own OCM certificate receives its intent: {reply:?}"
    );
    let ours = identity(fleet_kmm::ocm_client_certificate(fleet.spoke(&this)?).await?);
    let reply = probe::first_hub_message(&kmm.hub_grpc, &hub_ca, &ours).await;
    ensure!(
        reply.as_ref().is_ok_and(|m| !m.contains(&name)),
        "{this}'s OCM certificate is served, without {other}'s intent: {reply:?}"
    );
    // The probes displaced the real proxies' sessions; they reconnect.
    for spoke in [&this, &other] {
        fleet_kmm::wait_available(&fleet.hub, spoke, WAIT).await?;
    }
    delete(&fleet.hub, &name).await?;
    wait_labelled(&fleet, &name, &[]).await?;
    label_cluster(&fleet.hub, &other, &id, false).await?;
    Ok(())
}

#[tokio::test]
async fn an_agent_token_for_one_node_cannot_obtain_another_nodes_work() -> Result<()> {
    let _serial = SERIAL.lock().await;
    let fleet = Fleet::get().await?;
    kmm(&fleet)?;
    let spoke = fleet.spoke_names()[0].clone();
    let client = fleet.spoke(&spoke)?;
    let endpoint = fleet_kmm::proxy_agent_endpoint(client).await?;
    let nodes = &fleet.state.cluster(&spoke)?.nodes;
    ensure!(nodes.len() >= 2, "the spoke needs two nodes");
    let (a, b) = (&nodes[0].name, &nodes[1].name);
    let uid = Api::<Node>::all(client.clone())
        .get(a)
        .await?
        .uid()
        .unwrap_or_default();
    let token_a = fleet_kmm::request_token(
        client,
        fleet_kmm::SPOKE_NAMESPACE,
        fleet_kmm::AGENT_SERVICE_ACCOUNT,
        Some(fleet_kmm::TOKEN_AUDIENCE),
        Some((a, &uid)),
    )
    .await?;
    let agent_ca = probe::agent_ca(client).await?;

    let reply = probe::first_agent_instruction(&endpoint, &agent_ca, &token_a, b).await;
    match reply {
        Err(status) => ensure!(
            status.contains(b.as_str()) || status.contains(a.as_str()),
            "the refusal names the nodes: {status}"
        ),
        Ok(message) => bail!("node {a}'s token obtained work for {b}: {message}"),
    }

    let unbound = fleet_kmm::request_token(
        client,
        fleet_kmm::SPOKE_NAMESPACE,
        fleet_kmm::AGENT_SERVICE_ACCOUNT,
        Some(fleet_kmm::TOKEN_AUDIENCE),
        None,
    )
    .await?;
    let reply = probe::first_agent_instruction(&endpoint, &agent_ca, &unbound, a).await;
    ensure!(
        reply.is_err(),
        "a token bound to no node is refused: {reply:?}"
    );

    let other_audience = fleet_kmm::request_token(
        client,
        fleet_kmm::SPOKE_NAMESPACE,
        fleet_kmm::AGENT_SERVICE_ACCOUNT,
        Some("someone-else"),
        Some((a, &uid)),
    )
    .await?;
    let reply = probe::first_agent_instruction(&endpoint, &agent_ca, &other_audience, a).await;
    ensure!(
        reply.is_err(),
        "a token for another audience is refused: {reply:?}"
    );
    Ok(())
}

/// Clients that speak the hub's and the proxy's gRPC protocols directly, to check whom
/// they refuse.
mod probe {
    use std::time::Duration;

    use anyhow::{Context, Result};
    use k8s_openapi::api::core::v1::{ConfigMap, Secret};
    use kmm_e2e::fleet::kmm::{HUB_NAMESPACE, SPOKE_NAMESPACE, proxy_subject};
    use kmm_proto::v1::{
        AgentHello, AgentMessage, KernelInventory, ProxyHello, ProxyMessage,
        agent_client::AgentClient, agent_message, hub_client::HubClient, proxy_message,
    };
    use kmm_runtime::pki::{CertificateAuthority, IssuedCertificate, Leaf};
    use kube::{Api, Client};
    use time::OffsetDateTime;
    use tokio::sync::mpsc;
    use tokio_stream::wrappers::ReceiverStream;
    use tonic::metadata::MetadataValue;
    use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint, Identity};

    const DAY: Duration = Duration::from_secs(24 * 3600);
    /// The name the proxy's agent-facing certificate carries (the agents' Service).
    const PROXY_SERVER_NAME: &str = "kmm-spoke-proxy.kmm.svc";
    const ANSWER: Duration = Duration::from_secs(10);

    /// A client certificate for `cluster`'s proxy from the hub's own CA.
    pub async fn hub_client_certificate(
        hub: &Client,
        cluster: &str,
        expired: bool,
    ) -> Result<IssuedCertificate> {
        let secret = Api::<Secret>::namespaced(hub.clone(), HUB_NAMESPACE)
            .get("kmm-hub-ca")
            .await?;
        let data = secret.data.context("the CA Secret has no data")?;
        let field = |key: &str| {
            data.get(key)
                .map(|v| String::from_utf8_lossy(&v.0).into_owned())
                .with_context(|| format!("the CA Secret has no {key}"))
        };
        let ca = CertificateAuthority::from_pem(&field("tls.crt")?, &field("tls.key")?)?;
        let (common_name, organizations) = proxy_subject(cluster);
        let mut leaf = Leaf::client(&common_name, &organizations, DAY);
        if expired {
            leaf.not_before = OffsetDateTime::now_utc() - 2 * DAY;
            leaf.not_after = OffsetDateTime::now_utc() - DAY;
        }
        Ok(ca.issue(&leaf)?)
    }

    /// A certificate with the right subject from a CA the hub does not know.
    pub fn foreign_client_certificate(cluster: &str) -> Result<IssuedCertificate> {
        let (common_name, organizations) = proxy_subject(cluster);
        let ca = CertificateAuthority::generate("not-the-hub-ca", DAY)?;
        Ok(ca.issue(&Leaf::client(&common_name, &organizations, DAY))?)
    }

    /// The CA of the proxy's agent endpoint, as it publishes it for the agents.
    pub async fn agent_ca(spoke: &Client) -> Result<String> {
        Api::<ConfigMap>::namespaced(spoke.clone(), SPOKE_NAMESPACE)
            .get("kmm-agent-ca")
            .await?
            .data
            .and_then(|mut d| d.remove("ca.crt"))
            .context("ConfigMap kmm-agent-ca has no ca.crt")
    }

    async fn channel(
        endpoint: &str,
        ca_pem: &str,
        identity: Option<&IssuedCertificate>,
        server_name: Option<&str>,
    ) -> Result<Channel, String> {
        // The serving certificate is checked against the address dialled, as the
        // proxies do, or against the Service name the agents use.
        let host = endpoint.rsplit_once(':').map_or(endpoint, |(host, _)| host);
        let mut tls = ClientTlsConfig::new()
            .ca_certificate(Certificate::from_pem(ca_pem))
            .domain_name(server_name.unwrap_or(host));
        if let Some(cert) = identity {
            tls = tls.identity(Identity::from_pem(&cert.cert_pem, cert.key_pem.as_bytes()));
        }
        Endpoint::from_shared(format!("https://{endpoint}"))
            .map_err(|e| e.to_string())?
            .tls_config(tls)
            .map_err(|e| e.to_string())?
            .connect_timeout(ANSWER)
            .connect()
            .await
            .map_err(|e| format!("{e:?}"))
    }

    /// The hub's first answer to a proxy presenting `cert`, or why there is none.
    pub async fn first_hub_message(
        endpoint: &str,
        ca_pem: &str,
        cert: &IssuedCertificate,
    ) -> Result<String, String> {
        let mut client = HubClient::new(channel(endpoint, ca_pem, Some(cert), None).await?);
        let (tx, rx) = mpsc::channel(4);
        for message in [
            proxy_message::Message::Hello(ProxyHello {
                proxy_version: "e2e-probe".into(),
                applied_intent_revision: 0,
                applied_intent_digest: Vec::new(),
            }),
            proxy_message::Message::Inventory(KernelInventory {
                revision: 1,
                kernels: vec![],
            }),
        ] {
            tx.send(ProxyMessage {
                message: Some(message),
            })
            .await
            .map_err(|e| e.to_string())?;
        }
        let call = async {
            let mut stream = client
                .sync(ReceiverStream::new(rx))
                .await
                .map_err(|s| s.to_string())?
                .into_inner();
            match stream.message().await {
                Ok(Some(message)) => Ok(format!("{message:?}")),
                Ok(None) => Err("the hub ended the stream".to_owned()),
                Err(status) => Err(status.to_string()),
            }
        };
        tokio::time::timeout(ANSWER, call)
            .await
            .unwrap_or_else(|_| Err(format!("no answer within {ANSWER:?}")))
    }

    /// The proxy's first instruction to an agent of `node` presenting `token`, or why
    /// there is none.
    pub async fn first_agent_instruction(
        endpoint: &str,
        ca_pem: &str,
        token: &str,
        node: &str,
    ) -> Result<String, String> {
        let mut client =
            AgentClient::new(channel(endpoint, ca_pem, None, Some(PROXY_SERVER_NAME)).await?);
        let (tx, rx) = mpsc::channel(4);
        tx.send(AgentMessage {
            message: Some(agent_message::Message::Hello(AgentHello {
                node_name: node.to_owned(),
                boot_id: "e2e-probe".into(),
                kernel_release: String::new(),
                agent_version: "e2e-probe".into(),
                loaded: vec![],
            })),
        })
        .await
        .map_err(|e| e.to_string())?;
        let mut request = tonic::Request::new(ReceiverStream::new(rx));
        let bearer: MetadataValue<_> = format!("Bearer {token}")
            .parse()
            .map_err(|_| "token".to_owned())?;
        request.metadata_mut().insert("authorization", bearer);
        let call = async {
            let mut stream = client
                .attach(request)
                .await
                .map_err(|s| s.to_string())?
                .into_inner();
            match stream.message().await {
                Ok(Some(message)) => Ok(format!("{message:?}")),
                Ok(None) => Err("the proxy ended the stream".to_owned()),
                Err(status) => Err(status.to_string()),
            }
        };
        tokio::time::timeout(ANSWER, call)
            .await
            .unwrap_or_else(|_| Err(format!("no answer within {ANSWER:?}")))
    }
}

#[tokio::test]
async fn the_readme_example_loads_on_every_node_of_the_labelled_cluster() -> Result<()> {
    let _serial = SERIAL.lock().await;
    let fleet = Fleet::get().await?;
    kmm(&fleet)?;
    // The other spoke is not labelled.
    let ReadmeExample {
        module,
        spoke,
        nodes: expected,
    } = readme_example(&fleet)?;
    let (namespace, name) = (module.spec.spoke_namespace.clone(), module.name_any());
    let cluster = fleet.state.cluster(&spoke)?;
    label_cluster_with(&fleet.hub, &spoke, "kmm.fleet/demo", Some("true")).await?;
    create(&fleet.hub, &module).await?;
    wait_labelled_in(&fleet, &namespace, &name, &expected).await?;
    // The real node's story, as `kubectl describe node` tells it (upstream's Events).
    let real = &cluster.real_nodes.first().context("a real node")?.name;
    let told = |reason: &'static str| {
        let fleet = &fleet;
        let spoke = &spoke;
        let module = format!("Module {namespace}/{name} ");
        move || {
            let module = module.clone();
            async move {
                let described = describe_node(fleet, spoke, real).map_err(|e| e.to_string())?;
                described
                    .lines()
                    .any(|line| line.contains(reason) && line.contains(&module))
                    .then_some(())
                    .ok_or_else(|| format!("no {reason} Event for {module}in:\n{described}"))
            }
        }
    };
    wait_until("ModuleLoaded on the real node", WAIT, told("ModuleLoaded")).await?;
    delete(&fleet.hub, &name).await?;
    wait_labelled_in(&fleet, &namespace, &name, &[]).await?;
    wait_until(
        "ModuleUnloaded on the real node",
        WAIT,
        told("ModuleUnloaded"),
    )
    .await?;
    label_cluster_with(&fleet.hub, &spoke, "kmm.fleet/demo", None).await?;
    Ok(())
}

#[tokio::test]
async fn a_node_whose_image_is_missing_is_reported_with_the_registrys_answer() -> Result<()> {
    let _serial = SERIAL.lock().await;
    let fleet = Fleet::get().await?;
    kmm(&fleet)?;
    let (id, name) = (unique("kmm-e2e.dev/missing"), unique("missing"));
    let (spoke, node) = node_without_image(&fleet)?;
    label_cluster(&fleet.hub, &spoke, &id, true).await?;
    label_node(fleet.spoke(&spoke)?, &node.name, &id, true).await?;
    create(&fleet.hub, &module(&name, &id, sample_mapping(&fleet))?).await?;

    let failure = wait_until(
        "the node's failure in the module's status",
        WAIT,
        || async {
            let status = status(&fleet.hub, &name).await.map_err(|e| e.to_string())?;
            status["failures"]
                .as_array()
                .and_then(|failures| {
                    failures
                        .iter()
                        .find(|f| f["node"] == node.name.as_str())
                        .cloned()
                })
                .ok_or_else(|| status.to_string())
        },
    )
    .await?;
    ensure!(
        failure["cluster"] == spoke.as_str() && failure["kernel"] == node.kernel.as_str(),
        "the failure names cluster and kernel: {failure}"
    );
    let message = failure["message"].as_str().unwrap_or_default();
    ensure!(
        message.contains(&node.kernel),
        "the failure carries the registry's answer about the image: {failure}"
    );
    ensure!(
        labelled(&fleet, &name).await?.is_empty(),
        "a node that could not load is not labelled"
    );

    delete(&fleet.hub, &name).await?;
    label_cluster(&fleet.hub, &spoke, &id, false).await?;
    Ok(())
}

#[tokio::test]
async fn a_version_change_with_max_unavailable_one_takes_one_node_down_at_a_time() -> Result<()> {
    let _serial = SERIAL.lock().await;
    let fleet = Fleet::get().await?;
    let kmm = kmm(&fleet)?;
    let (id, name) = (unique("kmm-e2e.dev/ordered"), unique("ordered"));
    let spoke = fleet.spoke_names()[0].clone();
    let with_images: Vec<String> = nodes_with_images(&fleet, &spoke)?
        .into_iter()
        .map(|(node, _)| node)
        .collect();
    let agents: Vec<Agent> = kmm
        .agents
        .iter()
        .filter(|a| a.cluster == spoke && a.simulated && with_images.contains(&a.node))
        .take(3)
        .cloned()
        .collect();
    ensure!(
        agents.len() == 3,
        "{spoke} has {} KWOK nodes with a sample image; the test needs 3",
        agents.len()
    );
    label_cluster(&fleet.hub, &spoke, &id, true).await?;
    for agent in &agents {
        label_node(fleet.spoke(&spoke)?, &agent.node, &id, true).await?;
    }
    let mut mcm = module(&name, &id, sample_mapping(&fleet))?;
    mcm.spec.node_upgrade = Some(kmm_api::NodeUpgrade {
        max_unavailable: Some(IntOrString::Int(1)),
    });
    create(&fleet.hub, &mcm).await?;
    let target: Vec<(String, String)> = agents
        .iter()
        .map(|a| (spoke.clone(), a.node.clone()))
        .collect();
    wait_labelled(&fleet, &name, &target).await?;

    let offsets: Vec<usize> = agents.iter().map(log_len).collect();
    Api::<ManagedClusterModule>::all(fleet.hub.clone())
        .patch(
            &name,
            &PatchParams::default(),
            &Patch::Merge(json!({ "spec": { "moduleSpec": { "moduleLoader": {
                "container": { "version": "2.0" } } } } })),
        )
        .await?;
    wait_labelled_at(&fleet, NAMESPACE, &name, &target, "2.0").await?;

    let mut events = Vec::new();
    for (agent, from) in agents.iter().zip(&offsets) {
        events.extend(kernel_events(agent, *from)?);
    }
    events.sort();
    // Replays the merged logs: a node lacks the module from its first removal until
    // every kmod it removed is back.
    let mut removed: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    let mut most_down = 0;
    for (_, node, inserted, kmod) in &events {
        let kmods = removed.entry(node.clone()).or_default();
        if *inserted {
            kmods.remove(kmod);
        } else {
            kmods.insert(kmod.clone());
        }
        let down = removed.values().filter(|k| !k.is_empty()).count();
        most_down = most_down.max(down);
    }
    ensure!(
        removed.len() == 3 && removed.values().all(BTreeSet::is_empty),
        "every node must have reloaded the module: {events:?}"
    );
    ensure!(
        most_down == 1,
        "{most_down} nodes were without the module at once: {events:?}"
    );

    delete(&fleet.hub, &name).await?;
    wait_labelled(&fleet, &name, &[]).await?;
    label_cluster(&fleet.hub, &spoke, &id, false).await?;
    Ok(())
}

/// Nanoseconds since the epoch, the clock of the simulated kernels' logs.
fn now_ns() -> u128 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos())
}

#[tokio::test]
async fn a_progressive_rollout_halts_on_a_missing_image_survives_a_hub_crash_and_resumes()
-> Result<()> {
    let _serial = SERIAL.lock().await;
    let fleet = Fleet::get().await?;
    let kmm = kmm(&fleet)?;
    let (id, name) = (unique("kmm-e2e.dev/waves"), unique("waves"));
    // One simulated node with a sample image per spoke: its kernel log is the record of
    // what the cluster loaded and when.
    let (mut agents, mut kernels): (Vec<Agent>, BTreeSet<String>) = Default::default();
    for spoke in fleet.spoke_names() {
        let with_images: BTreeMap<String, String> =
            nodes_with_images(&fleet, &spoke)?.into_iter().collect();
        let agent = kmm
            .agents
            .iter()
            .find(|a| a.cluster == spoke && a.simulated && with_images.contains_key(&a.node))
            .with_context(|| format!("{spoke} has no KWOK node with a sample image"))?;
        label_cluster(&fleet.hub, &spoke, &id, true).await?;
        label_node(fleet.spoke(&spoke)?, &agent.node, &id, true).await?;
        kernels.insert(with_images[&agent.node].clone());
        agents.push(agent.clone());
    }
    ensure!(agents.len() >= 2, "the test needs two spokes");
    let (first, second) = (&agents[0], &agents[1]);
    let targets: Vec<(String, String)> = agents
        .iter()
        .map(|a| (a.cluster.clone(), a.node.clone()))
        .collect();
    create(&fleet.hub, &module(&name, &id, sample_mapping(&fleet))?).await?;
    wait_labelled(&fleet, &name, &targets).await?;

    wait_until("the module's rollout record", WAIT, || async {
        let status = status(&fleet.hub, &name).await.map_err(|e| e.to_string())?;
        status["rollout"]["baseRevision"]
            .is_string()
            .then_some(())
            .ok_or_else(|| status.to_string())
    })
    .await?;
    // Version 2.0 names an image that is not there yet (a tag of this run's own), one
    // cluster at a time.
    let offsets: Vec<usize> = agents.iter().map(log_len).collect();
    let image = format!("{}/samples/kmm-hello", fleet.state.node_registry);
    Api::<ManagedClusterModule>::all(fleet.hub.clone())
        .patch(
            &name,
            &PatchParams::default(),
            &Patch::Merge(json!({ "spec": {
                "rolloutStrategy": { "type": "Progressive",
                    "progressive": { "maxConcurrency": 1 } },
                "moduleSpec": { "moduleLoader": { "container": {
                    "version": "2.0",
                    "kernelMappings": [{ "regexp": "^.+$",
                        "containerImage": format!("{image}:${{KERNEL_FULL_VERSION}}-{name}") }],
                } } },
            } })),
        )
        .await?;
    let halted = wait_until("the rollout to halt on the first cluster", WAIT, || async {
        let status = status(&fleet.hub, &name).await.map_err(|e| e.to_string())?;
        let rollout = &status["rollout"];
        (rollout["state"] == "Halted")
            .then(|| rollout.clone())
            .ok_or_else(|| status.to_string())
    })
    .await?;
    let summary = halted["summary"].as_str().unwrap_or_default();
    ensure!(
        summary.contains(&format!("{} Failed", first.cluster)) && summary.contains("ImageNotFound"),
        "the halt names the failing cluster and why: {halted}"
    );
    ensure!(
        halted["counts"]["toApply"] == 1,
        "the second cluster was not reached: {halted}"
    );
    let second_label = |labels: &BTreeMap<(String, String), Option<String>>| {
        labels
            .get(&(second.cluster.clone(), second.node.clone()))
            .cloned()
            .flatten()
    };
    ensure!(
        second_label(&labelled(&fleet, &name).await?).as_deref() == Some(VERSION),
        "the cluster not reached keeps the previous version labelled"
    );

    // The leader dies mid-rollout; its successor serves every cluster what it served.
    let former = hub_install::lease_holder(&fleet.hub).await?;
    hub_install::crash_leader(&fleet.hub).await?;
    hub_install::wait_lease_moved(&fleet.hub, LEASE_TAKEOVER, &former).await?;
    let after = status(&fleet.hub, &name).await?;
    ensure!(
        after["rollout"]["state"] == "Halted" && after["rollout"]["clusters"] == halted["clusters"],
        "the record survives the crash: {after}"
    );
    ensure!(
        second_label(&labelled(&fleet, &name).await?).as_deref() == Some(VERSION),
        "after the crash the second cluster still runs the previous version"
    );

    // The image appears: the first cluster loads 2.0, then the rollout reaches the second.
    let fixed_at = now_ns();
    for kernel in &kernels {
        kmm_e2e::kmod::retag(
            &fleet.state.registry,
            "samples/kmm-hello",
            kernel,
            &format!("{kernel}-{name}"),
        )
        .await?;
    }
    wait_labelled_at(&fleet, NAMESPACE, &name, &targets, "2.0").await?;
    wait_until("the rollout to succeed", WAIT, || async {
        let status = status(&fleet.hub, &name).await.map_err(|e| e.to_string())?;
        (status["rollout"]["state"] == "Succeeded")
            .then_some(())
            .ok_or_else(|| status.to_string())
    })
    .await?;

    // The kernels' own record: the second node kept the old module until the image was
    // fixed and the first node had loaded the new one.
    let first_loaded = first_event(first, offsets[0], true)?
        .context("the first node never inserted the new version")?;
    let second_moved = first_event(second, offsets[1], false)?
        .context("the second node never moved to the new version")?;
    ensure!(
        second_moved > fixed_at,
        "the second cluster unloaded the previous version before the image was fixed"
    );
    ensure!(
        second_moved > first_loaded,
        "the second cluster moved before the first had loaded the new version"
    );
    let reasons: BTreeSet<String> =
        Api::<k8s_openapi::api::events::v1::Event>::namespaced(fleet.hub.clone(), "default")
            .list(&Default::default())
            .await?
            .into_iter()
            .filter(|e| e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(name.as_str()))
            .filter_map(|e| e.reason)
            .collect();
    for reason in ["RolloutReleased", "RolloutHalted", "RolloutSucceeded"] {
        ensure!(reasons.contains(reason), "no {reason} Event: {reasons:?}");
    }

    delete(&fleet.hub, &name).await?;
    wait_labelled(&fleet, &name, &[]).await?;
    for spoke in fleet.spoke_names() {
        label_cluster(&fleet.hub, &spoke, &id, false).await?;
    }
    Ok(())
}
