//! kmm as an OCM add-on, end to end with OCM's real addon-manager, registration and work
//! agents: `clusteradm addon enable` deploys the proxy and the agents' DaemonSet (real
//! Pods on the real nodes; KWOK nodes' Pods run by `kwok-pod-runner`), OCM signs and
//! renews the proxy's hub certificate with kmm-hub's CA, and disabling, re-enabling and
//! upgrading the add-on never unloads a module.
//!
//! The tests disable, renew and roll the add-on of whole spokes, so they run one at a time.

mod support;

use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use k8s_openapi::api::apps::v1::{DaemonSet, Deployment};
use k8s_openapi::api::certificates::v1::CertificateSigningRequest;
use k8s_openapi::api::core::v1::{Namespace, Secret};
use kmm_api::ocm::{self, ADD_ON_TEMPLATE, CLUSTER_MANAGEMENT_ADD_ON, MANIFEST_WORK};
use kmm_e2e::fixture::{Fleet, wait_until};
use kmm_e2e::fleet::kmm::{self as fleet_kmm, ADDON, CLIENT_CERT_SECRET, SPOKE_NAMESPACE};
use kmm_e2e::toolchain::Toolchain;
use kmm_e2e::versions::Versions;
use kube::api::{DeleteParams, DynamicObject, ListParams, Patch, PatchParams, PostParams};
use kube::{Api, Client, ResourceExt};
use serde_json::{Value, json};
use support::*;
use tokio::sync::Mutex;

static SERIAL: Mutex<()> = Mutex::const_new(());
const SIGNER: &str = "kmm.sigs.x-k8s.io/hub-client";
/// OCM's klusterlet notices a missing certificate Secret and the addon-manager signs a
/// new CSR within seconds; the kubelet then updates the mounted files (sync period 10 s).
const RENEWAL: Duration = Duration::from_secs(120);

fn toolchain() -> Result<Toolchain> {
    Ok(Toolchain::locate(
        &Versions::pinned(),
        settings()?.bin_dir.as_deref(),
    )?)
}

fn addon_api(hub: &Client, resource: ocm::Resource) -> Api<DynamicObject> {
    Api::all_with(hub.clone(), &resource.api_resource())
}

fn condition<'a>(object: &'a Value, type_: &str) -> Option<&'a Value> {
    object["status"]["conditions"]
        .as_array()?
        .iter()
        .find(|c| c["type"] == type_)
}

/// Labels `cluster` and its nodes that have a sample image, creates a module for them
/// and waits until they are labelled; returns the module's name and the nodes.
async fn loaded_module(
    fleet: &Fleet,
    cluster: &str,
    prefix: &str,
) -> Result<(String, String, Vec<(String, String)>)> {
    let (id, name) = (unique(&format!("kmm-e2e.dev/{prefix}")), unique(prefix));
    label_cluster(&fleet.hub, cluster, &id, true).await?;
    let mut targets = vec![];
    for (node, _) in nodes_with_images(fleet, cluster)? {
        label_node(fleet.spoke(cluster)?, &node, &id, true).await?;
        targets.push((cluster.to_owned(), node));
    }
    ensure!(
        !targets.is_empty(),
        "{cluster} has no node with a sample image"
    );
    create(&fleet.hub, &module(&name, &id, sample_mapping(fleet))?).await?;
    wait_labelled(fleet, &name, &targets).await?;
    Ok((id, name, targets))
}

async fn unload_module(fleet: &Fleet, cluster: &str, id: &str, name: &str) -> Result<()> {
    delete(&fleet.hub, name).await?;
    wait_labelled(fleet, name, &[]).await?;
    label_cluster(&fleet.hub, cluster, id, false).await
}

/// The sum of `kmm_agent_<what>_total` over the agents of `cluster`.
async fn attempts_on(fleet: &Fleet, cluster: &str, what: &str) -> Result<u64> {
    let mut total = 0;
    for agent in kmm(fleet)?.agents.iter().filter(|a| a.cluster == cluster) {
        total += agent_attempts(fleet, agent, what).await?;
    }
    Ok(total)
}

async fn proxy_gauge(spoke: &Client, name: &str) -> Result<f64> {
    let text = fleet_kmm::proxy_metrics(spoke).await?;
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.trim().parse::<f64>().ok())
        .with_context(|| format!("no {name} in the proxy's metrics"))
}

#[tokio::test]
async fn ocm_deploys_kmm_signs_its_certificate_and_reports_it_available() -> Result<()> {
    let _serial = SERIAL.lock().await;
    let fleet = Fleet::get().await?;
    let spoke = fleet.spoke_names()[0].clone();
    let client = fleet.spoke(&spoke)?;
    fleet_kmm::wait_proxy_ready(client, WAIT).await?;

    let works: Api<DynamicObject> =
        Api::namespaced_with(fleet.hub.clone(), &spoke, &MANIFEST_WORK.api_resource());
    // The work agent and the addon-manager report asynchronously: after an earlier test
    // rolled the proxy, its Deployment's feedback (readyReplicas) lags the Pod's readiness.
    wait_until(
        "ManifestWork addon-kmm-deploy-0 Applied and Available",
        WAIT,
        || async {
            let work = works
                .get("addon-kmm-deploy-0")
                .await
                .map_err(|e| e.to_string())?;
            if ["Applied", "Available"]
                .iter()
                .all(|t| condition(&work.data, t).is_some_and(|c| c["status"] == "True"))
            {
                Ok(())
            } else {
                Err(work.data["status"].to_string())
            }
        },
    )
    .await?;

    let csrs = Api::<CertificateSigningRequest>::all(fleet.hub.clone())
        .list(&ListParams::default().labels(&format!(
            "open-cluster-management.io/cluster-name={spoke},open-cluster-management.io/addon-name={ADDON}"
        )))
        .await?;
    let signed = csrs
        .items
        .iter()
        .filter(|csr| csr.spec.signer_name == SIGNER)
        .filter(|csr| {
            let status = csr.status.clone().unwrap_or_default();
            status
                .conditions
                .unwrap_or_default()
                .iter()
                .any(|c| c.type_ == "Approved" && c.status == "True")
                && status.certificate.is_some_and(|c| !c.0.is_empty())
        })
        .count();
    ensure!(
        signed >= 1,
        "no CSR of {spoke} for {SIGNER} was approved and signed ({} CSRs)",
        csrs.items.len()
    );

    let (cert, _) = fleet_kmm::ocm_client_certificate(client).await?;
    ensure!(
        cert.contains("BEGIN CERTIFICATE"),
        "the Secret holds a certificate"
    );
    let proxy = fleet_kmm::proxy_pod(client).await?;
    let mounted = proxy
        .spec
        .as_ref()
        .and_then(|s| s.volumes.as_ref())
        .is_some_and(|volumes| {
            volumes.iter().any(|v| {
                v.secret.as_ref().and_then(|s| s.secret_name.as_deref()) == Some(CLIENT_CERT_SECRET)
            })
        });
    ensure!(mounted, "the proxy Pod mounts {CLIENT_CERT_SECRET}");
    ensure!(
        proxy_gauge(client, "kmm_spoke_proxy_hub_connected").await? == 1.0,
        "the proxy's hub session is open"
    );

    fleet_kmm::wait_available(&fleet.hub, &spoke, WAIT).await?;
    let addon = fleet_kmm::addons(&fleet.hub, &spoke).get(ADDON).await?;
    let degraded = condition(&addon.data, "Degraded").context("kmm-hub's Degraded condition")?;
    ensure!(
        degraded["status"] == "False" && degraded["reason"] == "HubSessionOpen",
        "kmm-hub reports the session open: {degraded}"
    );

    // Every node of the cluster with an image loads it: real-node Pods and KWOK agents.
    let (id, name, targets) = loaded_module(&fleet, &spoke, "enabled").await?;
    let kinds: Vec<bool> = kmm(&fleet)?
        .agents
        .iter()
        .filter(|a| targets.iter().any(|(_, n)| *n == a.node))
        .map(|a| a.simulated)
        .collect();
    println!(
        "loaded on {} nodes ({} KWOK)",
        kinds.len(),
        kinds.iter().filter(|k| **k).count()
    );
    unload_module(&fleet, &spoke, &id, &name).await
}

#[tokio::test]
async fn a_renewed_certificate_is_used_without_a_restart_or_an_unload() -> Result<()> {
    let _serial = SERIAL.lock().await;
    let fleet = Fleet::get().await?;
    let spoke = fleet.spoke_names()[0].clone();
    let client = fleet.spoke(&spoke)?;
    let (id, name, targets) = loaded_module(&fleet, &spoke, "renewal").await?;
    let (loads, unloads) = (
        attempts_on(&fleet, &spoke, "loads").await?,
        attempts_on(&fleet, &spoke, "unloads").await?,
    );
    let proxy = fleet_kmm::proxy_pod(client).await?;
    let (old_cert, _) = fleet_kmm::ocm_client_certificate(client).await?;
    let old_expiry = proxy_gauge(
        client,
        "kmm_spoke_proxy_hub_client_certificate_expiry_timestamp_seconds",
    )
    .await?;

    // Forces a renewal: OCM's registration agent issues a new CSR for the missing Secret.
    let started = Instant::now();
    Api::<Secret>::namespaced(client.clone(), SPOKE_NAMESPACE)
        .delete(CLIENT_CERT_SECRET, &DeleteParams::default())
        .await?;
    wait_until("OCM to write a new certificate", RENEWAL, || async {
        match fleet_kmm::ocm_client_certificate(client).await {
            Ok((cert, _)) if cert != old_cert => Ok(()),
            Ok(_) => Err("the old certificate".to_owned()),
            Err(e) => Err(e.to_string()),
        }
    })
    .await?;
    let issued = started.elapsed();
    wait_until("the proxy to use the new certificate", RENEWAL, || async {
        let expiry = proxy_gauge(
            client,
            "kmm_spoke_proxy_hub_client_certificate_expiry_timestamp_seconds",
        )
        .await
        .map_err(|e| e.to_string())?;
        let connected = proxy_gauge(client, "kmm_spoke_proxy_hub_connected")
            .await
            .map_err(|e| e.to_string())?;
        if expiry > old_expiry && connected == 1.0 {
            Ok(())
        } else {
            Err(format!(
                "expiry {expiry} (was {old_expiry}), connected {connected}"
            ))
        }
    })
    .await?;
    println!(
        "renewal: new certificate issued after {:.1}s, in use after {:.1}s",
        issued.as_secs_f64(),
        started.elapsed().as_secs_f64()
    );
    let same = fleet_kmm::proxy_pod(client).await?;
    ensure!(
        same.uid() == proxy.uid()
            && same
                .status
                .and_then(|s| s.container_statuses)
                .is_some_and(|c| c.iter().all(|c| c.restart_count == 0)),
        "the proxy was not restarted"
    );
    wait_labelled(&fleet, &name, &targets).await?;
    ensure!(
        attempts_on(&fleet, &spoke, "loads").await? == loads
            && attempts_on(&fleet, &spoke, "unloads").await? == unloads,
        "the renewal caused no load and no unload"
    );
    unload_module(&fleet, &spoke, &id, &name).await
}

/// Waits until nothing of kmm is left on the spoke: the add-on's namespace is gone and
/// no KWOK agent process runs.
async fn wait_removed(fleet: &Fleet, spoke: &str) -> Result<()> {
    let client = fleet.spoke(spoke)?;
    let agents: Vec<_> = kmm(fleet)?
        .agents
        .iter()
        .filter(|a| a.cluster == spoke && a.simulated)
        .cloned()
        .collect();
    wait_until("the add-on's components to be removed", WAIT, || async {
        if Api::<Namespace>::all(client.clone())
            .get_opt(SPOKE_NAMESPACE)
            .await
            .map_err(|e| e.to_string())?
            .is_some()
        {
            return Err(format!("namespace {SPOKE_NAMESPACE} still exists"));
        }
        let running: Vec<&str> = agents
            .iter()
            .filter(|a| a.running())
            .map(|a| a.node.as_str())
            .collect();
        match running.is_empty() {
            true => Ok(()),
            false => Err(format!("agents still run on {running:?}")),
        }
    })
    .await?;
    Ok(())
}

#[tokio::test]
async fn disabling_leaves_modules_loaded_and_labelled_and_enabling_resumes_without_loading()
-> Result<()> {
    let _serial = SERIAL.lock().await;
    let fleet = Fleet::get().await?;
    let spoke = fleet.spoke_names().last().context("a spoke")?.clone();
    let hub_kubeconfig = fleet.state.cluster("hub")?.kubeconfig.clone();
    let clusteradm = toolchain()?.bin("clusteradm").to_path_buf();
    let (id, name, targets) = loaded_module(&fleet, &spoke, "disable").await?;
    let loaded_on: Vec<_> = kmm(&fleet)?
        .agents
        .iter()
        .filter(|a| targets.iter().any(|(_, n)| *n == a.node))
        .cloned()
        .collect();

    fleet_kmm::disable(&clusteradm, &hub_kubeconfig, std::slice::from_ref(&spoke))?;
    wait_removed(&fleet, &spoke).await?;
    ensure!(
        labelled(&fleet, &name).await?.len() == targets.len(),
        "the ready labels stay while the add-on is disabled"
    );
    for agent in &loaded_on {
        let state = std::fs::read_to_string(agent.state_file())
            .with_context(|| format!("the state of {}", agent.node))?;
        ensure!(
            state.contains(&name),
            "{} still records the module loaded",
            agent.node
        );
    }

    let enabled = Instant::now();
    fleet_kmm::enable(&clusteradm, &hub_kubeconfig, std::slice::from_ref(&spoke))?;
    fleet_kmm::wait_available(&fleet.hub, &spoke, WAIT).await?;
    let available = enabled.elapsed();
    fleet_kmm::wait_agents_ready(fleet.spoke(&spoke)?, WAIT).await?;
    println!(
        "re-enable on {spoke}: Available after {:.1}s, every agent ready after {:.1}s",
        available.as_secs_f64(),
        enabled.elapsed().as_secs_f64()
    );
    wait_labelled(&fleet, &name, &targets).await?;
    ensure!(
        attempts_on(&fleet, &spoke, "loads").await? == 0
            && attempts_on(&fleet, &spoke, "unloads").await? == 0,
        "re-enabling loaded or unloaded nothing"
    );
    unload_module(&fleet, &spoke, &id, &name).await
}

#[tokio::test]
async fn enabling_a_cluster_loads_the_modules_waiting_for_it() -> Result<()> {
    let _serial = SERIAL.lock().await;
    let fleet = Fleet::get().await?;
    let spoke = fleet.spoke_names().last().context("a spoke")?.clone();
    let hub_kubeconfig = fleet.state.cluster("hub")?.kubeconfig.clone();
    let clusteradm = toolchain()?.bin("clusteradm").to_path_buf();
    fleet_kmm::disable(&clusteradm, &hub_kubeconfig, std::slice::from_ref(&spoke))?;
    wait_removed(&fleet, &spoke).await?;

    // A module for the cluster while it has no kmm: it waits on the hub.
    let (id, name) = (unique("kmm-e2e.dev/waiting"), unique("waiting"));
    label_cluster(&fleet.hub, &spoke, &id, true).await?;
    let mut targets = vec![];
    for (node, _) in nodes_with_images(&fleet, &spoke)? {
        label_node(fleet.spoke(&spoke)?, &node, &id, true).await?;
        targets.push((spoke.clone(), node));
    }
    create(&fleet.hub, &module(&name, &id, sample_mapping(&fleet))?).await?;

    let enabled = Instant::now();
    fleet_kmm::enable(&clusteradm, &hub_kubeconfig, std::slice::from_ref(&spoke))?;
    fleet_kmm::wait_available(&fleet.hub, &spoke, WAIT).await?;
    let available = enabled.elapsed();
    let first = wait_until("a first node to load the module", WAIT, || async {
        match labelled(&fleet, &name).await {
            Ok(now) if !now.is_empty() => Ok(enabled.elapsed()),
            Ok(_) => Err("no node labelled yet".to_owned()),
            Err(e) => Err(e.to_string()),
        }
    })
    .await?;
    wait_labelled(&fleet, &name, &targets).await?;
    println!(
        "enable on {spoke}: Available after {:.1}s, first module loaded after {:.1}s, on all \
         {} nodes after {:.1}s",
        available.as_secs_f64(),
        first.as_secs_f64(),
        targets.len(),
        enabled.elapsed().as_secs_f64()
    );
    fleet_kmm::wait_agents_ready(fleet.spoke(&spoke)?, WAIT).await?;
    unload_module(&fleet, &spoke, &id, &name).await
}

/// Points the ClusterManagementAddOn at the AddOnTemplate `template`.
async fn use_template(hub: &Client, template: &str) -> Result<()> {
    let cmas = addon_api(hub, CLUSTER_MANAGEMENT_ADD_ON);
    let mut cma = cmas.get(ADDON).await?;
    let configs = cma.data["spec"]["supportedConfigs"]
        .as_array_mut()
        .context("supportedConfigs")?;
    for config in configs {
        if config["resource"] == ADD_ON_TEMPLATE.plural {
            config["defaultConfig"] = json!({ "name": template });
        }
    }
    cmas.replace(ADDON, &PostParams::default(), &cma).await?;
    Ok(())
}

#[tokio::test]
async fn a_new_template_version_rolls_the_proxy_and_agents_without_unloading() -> Result<()> {
    let _serial = SERIAL.lock().await;
    let fleet = Fleet::get().await?;
    let spoke = fleet.spoke_names()[0].clone();
    let client = fleet.spoke(&spoke)?;
    let (id, name, targets) = loaded_module(&fleet, &spoke, "upgrade").await?;

    let templates = addon_api(&fleet.hub, ADD_ON_TEMPLATE);
    let current = templates.get("kmm-0.1.0").await?;
    let old_tag = serde_json::to_string(&current.data)?
        .split("kmm-node-agent:")
        .nth(1)
        .and_then(|rest| rest.split('"').next())
        .context("the agent image's tag in the template")?
        .to_owned();
    let new_tag = format!("{old_tag}-next");
    for image in ["kmm-fleet/kmm-spoke-proxy", "kmm-fleet/kmm-node-agent"] {
        kmm_e2e::kmod::retag(&fleet.state.registry, image, &old_tag, &new_tag).await?;
    }
    let next_name = unique("kmm-next");
    let mut next: Value = serde_json::from_str(
        &serde_json::to_string(&current.data)?
            .replace(&format!(":{old_tag}\""), &format!(":{new_tag}\"")),
    )?;
    next["metadata"] = json!({ "name": next_name });
    templates
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({
                "apiVersion": ADD_ON_TEMPLATE.api_version(),
                "kind": ADD_ON_TEMPLATE.kind,
                "metadata": next["metadata"],
                "spec": next["spec"],
            }))?,
        )
        .await?;
    let (loads, unloads) = (
        attempts_on(&fleet, &spoke, "loads").await?,
        attempts_on(&fleet, &spoke, "unloads").await?,
    );

    let started = Instant::now();
    use_template(&fleet.hub, &next_name).await?;
    wait_addon_on(client, &new_tag, WAIT).await?;
    println!(
        "template {next_name}: proxy and agents rolled in {:.1}s",
        started.elapsed().as_secs_f64()
    );
    wait_labelled(&fleet, &name, &targets).await?;
    // The agents are new processes: their counters start at zero.
    ensure!(
        attempts_on(&fleet, &spoke, "loads").await? == 0
            && attempts_on(&fleet, &spoke, "unloads").await? == 0,
        "the roll loaded or unloaded something (before: {loads} loads, {unloads} unloads)"
    );

    use_template(&fleet.hub, "kmm-0.1.0").await?;
    wait_addon_on(client, &old_tag, WAIT).await?;
    templates
        .delete(&next_name, &DeleteParams::default())
        .await?;
    wait_labelled(&fleet, &name, &targets).await?;
    unload_module(&fleet, &spoke, &id, &name).await
}

/// The agents' firmware directory as the spoke's DaemonSet has it: the `--firmware-dir`
/// argument, the firmware volume's hostPath and its mount path.
fn firmware_dirs(daemonset: &DaemonSet) -> (Option<String>, Option<String>, Option<String>) {
    let pod = daemonset
        .spec
        .as_ref()
        .and_then(|s| s.template.spec.as_ref());
    let container = pod.map(|p| &p.containers[0]);
    let argument = container
        .and_then(|c| c.args.as_ref())
        .and_then(|args| args.iter().find_map(|a| a.strip_prefix("--firmware-dir=")))
        .map(str::to_owned);
    let host_path = pod
        .and_then(|p| p.volumes.as_ref())
        .and_then(|v| v.iter().find(|v| v.name == "firmware"))
        .and_then(|v| v.host_path.as_ref())
        .map(|h| h.path.clone());
    let mount = container
        .and_then(|c| c.volume_mounts.as_ref())
        .and_then(|m| m.iter().find(|m| m.name == "firmware"))
        .map(|m| m.mount_path.clone());
    (argument, host_path, mount)
}

/// Waits until the agents of `spoke` use `dir` as their firmware directory everywhere
/// and are ready again.
async fn wait_firmware_dir(spoke: &Client, dir: &str) -> Result<()> {
    let daemonsets = Api::<DaemonSet>::namespaced(spoke.clone(), SPOKE_NAMESPACE);
    wait_until(
        &format!("the agents on firmware dir {dir}"),
        WAIT,
        || async {
            let daemonset = daemonsets
                .get("kmm-node-agent")
                .await
                .map_err(|e| e.to_string())?;
            let dirs = firmware_dirs(&daemonset);
            let status = daemonset.status.clone().unwrap_or_default();
            let wanted = Some(dir.to_owned());
            let rolled = status.observed_generation == daemonset.metadata.generation
                && status.updated_number_scheduled == Some(status.desired_number_scheduled)
                && status.number_ready == status.desired_number_scheduled;
            if (&dirs.0, &dirs.1, &dirs.2) == (&wanted, &wanted, &wanted) && rolled {
                Ok(())
            } else {
                Err(format!("argument, hostPath, mount: {dirs:?}; {status:?}"))
            }
        },
    )
    .await?;
    fleet_kmm::wait_agents_ready(spoke, WAIT).await?;
    Ok(())
}

#[tokio::test]
async fn a_clusters_own_config_moves_its_agents_firmware_dir_and_unloads_nothing() -> Result<()> {
    let _serial = SERIAL.lock().await;
    let fleet = Fleet::get().await?;
    let spoke = fleet.spoke_names()[0].clone();
    let client = fleet.spoke(&spoke)?;
    let (id, name, targets) = loaded_module(&fleet, &spoke, "firmware-dir").await?;
    wait_firmware_dir(client, "/lib/firmware").await?;

    let (loads, unloads) = (
        attempts_on(&fleet, &spoke, "loads").await?,
        attempts_on(&fleet, &spoke, "unloads").await?,
    );
    // The cluster's own AddOnDeploymentConfig: the fleet's variables, another firmware
    // directory (as on hosts whose /lib/firmware is read-only).
    let dir = "/var/lib/kmm-e2e-firmware";
    let own = addon_config::use_own_config(&fleet, &spoke, "FIRMWARE_DIR", dir).await?;
    let moved = async {
        wait_firmware_dir(client, dir).await?;
        wait_labelled(&fleet, &name, &targets).await?;
        // The agents are new processes: their counters start at zero.
        ensure!(
            attempts_on(&fleet, &spoke, "loads").await? == 0
                && attempts_on(&fleet, &spoke, "unloads").await? == 0,
            "moving the firmware directory loaded or unloaded something (before: {loads} \
             loads, {unloads} unloads)"
        );
        Ok(())
    }
    .await;
    // Back to the fleet's default whatever happened, so that other tests find it.
    addon_config::use_fleet_config(&fleet.hub, &spoke).await?;
    moved?;
    wait_firmware_dir(client, "/lib/firmware").await?;
    addon_config::delete_own_config(&fleet.hub, &spoke, &own).await?;
    wait_labelled(&fleet, &name, &targets).await?;
    unload_module(&fleet, &spoke, &id, &name).await
}

#[tokio::test]
async fn kmm_hub_reports_a_spoke_without_a_session_degraded() -> Result<()> {
    let _serial = SERIAL.lock().await;
    let fleet = Fleet::get().await?;
    let spoke = fleet.spoke_names()[0].clone();
    let client = fleet.spoke(&spoke)?;
    let proxies: Api<Deployment> = Api::namespaced(client.clone(), SPOKE_NAMESPACE);
    let scale = |replicas: i32| {
        let proxies = proxies.clone();
        async move {
            proxies
                .patch_scale(
                    "kmm-spoke-proxy",
                    &PatchParams::default(),
                    &Patch::Merge(json!({ "spec": { "replicas": replicas } })),
                )
                .await
        }
    };
    // The work agent restores the replica count OCM rendered; until then the proxy is gone.
    scale(0).await?;
    let addons = fleet_kmm::addons(&fleet.hub, &spoke);
    let seen = wait_until("kmm-hub to report the add-on Degraded", WAIT, || async {
        let addon = addons.get(ADDON).await.map_err(|e| e.to_string())?;
        match condition(&addon.data, "Degraded") {
            Some(c) if c["status"] == "True" && c["reason"] == "NoHubSession" => Ok(c.clone()),
            other => Err(format!("Degraded: {other:?}")),
        }
    })
    .await;
    scale(1).await?;
    let degraded = seen?;
    ensure!(
        degraded["message"].as_str().is_some_and(|m| !m.is_empty()),
        "the condition says why: {degraded}"
    );
    fleet_kmm::wait_proxy_ready(client, WAIT).await?;
    wait_until("kmm-hub to report the session open again", WAIT, || async {
        let addon = addons.get(ADDON).await.map_err(|e| e.to_string())?;
        match condition(&addon.data, "Degraded") {
            Some(c) if c["status"] == "False" && c["reason"] == "HubSessionOpen" => Ok(()),
            other => Err(format!("Degraded: {other:?}")),
        }
    })
    .await?;
    fleet_kmm::wait_available(&fleet.hub, &spoke, WAIT).await?;
    Ok(())
}
