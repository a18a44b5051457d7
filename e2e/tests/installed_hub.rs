//! kmm-hub as the local fleet installs it: `kubectl apply -k` of `addon-manifests/hub`
//! (an overlay naming the fleet's registry), two replicas as Pods on the hub's real node,
//! from the images the fleet built.
//!
//! * One replica leads (Lease, Pod label, `/readyz`, `kmm_hub_leader`), the other stands
//!   by ready and says so.
//! * The installed webhook refuses an invalid module naming the field and admits a valid
//!   one; the configuration's caBundle is the hub's CA.
//! * Each image runs its binary (and the agent image `modprobe`) as a real Pod.
//!
//! The failover itself (leader killed mid-rollout) is in `modules.rs`, beside the other
//! disruptive data-path tests. These fail, never skip, when the fleet cannot start.

mod support;

use std::net::IpAddr;
use std::time::Duration;

use anyhow::{Context, Result, bail, ensure};
use k8s_openapi::api::admissionregistration::v1::ValidatingWebhookConfiguration;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Pod, Secret};
use kmm_api::ManagedClusterModule;
use kmm_e2e::fixture::{Fleet, TempNamespace, wait_until};
use kmm_e2e::fleet::hub_install::{self, DEPLOYMENT, ROLE_LABEL};
use kmm_e2e::fleet::kmm::HUB_NAMESPACE;
use kube::api::{ListParams, LogParams, PostParams};
use kube::{Api, Client};
use serde_json::json;
use support::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const POD_WAIT: Duration = Duration::from_secs(120);

/// `GET path` on a Pod's metrics port, from the host (routed to the node's pod network).
async fn get(ip: IpAddr, path: &str) -> Result<String> {
    let mut stream = tokio::net::TcpStream::connect((ip, 8080)).await?;
    let request = format!("GET {path} HTTP/1.0\r\nHost: {ip}\r\n\r\n");
    stream.write_all(request.as_bytes()).await?;
    let mut response = String::new();
    stream.read_to_string(&mut response).await?;
    Ok(response)
}

fn hub_pods(hub: &Client) -> Api<Pod> {
    Api::namespaced(hub.clone(), HUB_NAMESPACE)
}

#[tokio::test]
async fn two_replicas_run_one_leads_and_the_other_stands_by_ready() -> Result<()> {
    let fleet = Fleet::get().await?;
    kmm(&fleet)?;
    let leader = hub_install::wait_leader(&fleet.hub, POD_WAIT).await?;
    let pods = hub_pods(&fleet.hub)
        .list(&ListParams::default().labels(&format!("app.kubernetes.io/name={DEPLOYMENT}")))
        .await?;
    ensure!(pods.items.len() == 2, "{} hub Pods", pods.items.len());
    let holder = Api::<Lease>::namespaced(fleet.hub.clone(), HUB_NAMESPACE)
        .get("kmm-hub")
        .await?
        .spec
        .and_then(|s| s.holder_identity)
        .context("the Lease has a holder")?;
    ensure!(
        holder.starts_with(&leader),
        "Lease held by {holder}, leader Pod {leader}"
    );
    let hub_node = &fleet.state.cluster("hub")?.real_nodes[0].name;
    for pod in &pods.items {
        let name = pod.metadata.name.clone().unwrap_or_default();
        let spec = pod.spec.as_ref().context("a Pod spec")?;
        ensure!(
            spec.node_name.as_ref() == Some(hub_node),
            "{name} runs on {:?}",
            spec.node_name
        );
        let ip: IpAddr = pod
            .status
            .as_ref()
            .and_then(|s| s.pod_ip.as_ref())
            .context("a Pod IP")?
            .parse()?;
        let role = pod
            .metadata
            .labels
            .as_ref()
            .and_then(|l| l.get(ROLE_LABEL))
            .cloned()
            .unwrap_or_default();
        let readyz = get(ip, "/readyz").await?;
        let metrics = get(ip, "/metrics").await?;
        ensure!(
            readyz.starts_with("HTTP/1.0 200") || readyz.starts_with("HTTP/1.1 200"),
            "{name}: {readyz}"
        );
        if name == leader {
            ensure!(role == "leader", "{name}: role {role}");
            ensure!(
                readyz.ends_with("\n\nok\n") || readyz.trim_end().ends_with("ok"),
                "{name}: {readyz}"
            );
            ensure!(
                metrics.contains("kmm_hub_leader 1"),
                "{name} does not say it leads"
            );
        } else {
            ensure!(role == "standby", "{name}: role {role}");
            ensure!(readyz.contains("ok: standing by"), "{name}: {readyz}");
            ensure!(
                metrics.contains("kmm_hub_leader 0"),
                "{name} does not say it stands by"
            );
        }
    }
    Ok(())
}

#[tokio::test]
async fn the_installed_webhook_refuses_an_invalid_module_and_admits_a_valid_one() -> Result<()> {
    let fleet = Fleet::get().await?;
    kmm(&fleet)?;
    let ca = Api::<Secret>::namespaced(fleet.hub.clone(), HUB_NAMESPACE)
        .get("kmm-hub-ca")
        .await?
        .data
        .and_then(|mut d| d.remove("tls.crt"))
        .context("the hub's CA certificate")?;
    let configuration = Api::<ValidatingWebhookConfiguration>::all(fleet.hub.clone())
        .get("kmm-hub")
        .await?;
    let webhooks = configuration.webhooks.unwrap_or_default();
    ensure!(
        !webhooks.is_empty()
            && webhooks
                .iter()
                .all(|w| w.client_config.ca_bundle.as_ref() == Some(&ca)),
        "the hub put its CA into every webhook's caBundle"
    );

    let api: Api<ManagedClusterModule> = Api::all(fleet.hub.clone());
    let dry_run = PostParams {
        dry_run: true,
        ..PostParams::default()
    };
    let valid = module(
        &unique("admitted"),
        "kmm-e2e.dev/none",
        sample_mapping(&fleet),
    )?;
    api.create(&dry_run, &valid)
        .await
        .context("a valid module is admitted")?;
    let mut invalid: serde_json::Value = serde_json::to_value(&valid)?;
    invalid["spec"]["moduleSpec"]["moduleLoader"]["container"]["kernelMappings"] =
        json!([{"regexp": "(", "containerImage": "r.example/m"}]);
    let invalid: ManagedClusterModule = serde_json::from_value(invalid)?;
    match api.create(&dry_run, &invalid).await {
        Err(kube::Error::Api(status)) => {
            let field = "spec.moduleSpec.moduleLoader.container.kernelMappings[0]";
            ensure!(
                status.message.contains("denied the request")
                    && status.message.contains(&format!("{field}.regexp"))
                    && status.message.contains(&format!("{field}.containerImage")),
                "the webhook names both fields: {}",
                status.message
            );
        }
        other => bail!("an invalid module was not refused: {other:?}"),
    }
    Ok(())
}

#[tokio::test]
async fn each_image_runs_its_binary_as_a_pod() -> Result<()> {
    let fleet = Fleet::get().await?;
    kmm(&fleet)?;
    let node = fleet.state.cluster("hub")?.real_nodes[0].name.clone();
    let namespace = TempNamespace::create(&fleet.hub, "kmm-e2e-images").await?;
    let pods: Api<Pod> = Api::namespaced(fleet.hub.clone(), &namespace.name);
    let image = |name: &str| {
        format!(
            "{}/kmm-fleet/{name}:{}",
            fleet.state.node_registry,
            kmm_images::VERSION
        )
    };
    let runs = [
        (
            "hub",
            image("kmm-hub"),
            vec!["kmm-hub", "--version"],
            "kmm-hub ",
        ),
        (
            "proxy",
            image("kmm-spoke-proxy"),
            vec!["kmm-spoke-proxy", "--version"],
            "kmm-spoke-proxy ",
        ),
        (
            "agent",
            image("kmm-node-agent"),
            vec!["kmm-node-agent", "--version"],
            "kmm-node-agent ",
        ),
        (
            "agent-help",
            image("kmm-node-agent"),
            vec!["kmm-node-agent", "--help"],
            "Usage",
        ),
        (
            "modprobe",
            image("kmm-node-agent"),
            vec!["modprobe", "--version"],
            "kmod version",
        ),
    ];
    for (name, image, command, _) in &runs {
        let pod: Pod = serde_json::from_value(json!({
            "metadata": {"name": name},
            "spec": {
                "nodeName": node,
                "restartPolicy": "Never",
                "containers": [{"name": "run", "image": image, "command": command}],
            },
        }))?;
        pods.create(&PostParams::default(), &pod).await?;
    }
    for (name, image, command, expected) in &runs {
        let phase = wait_until(&format!("{name} ({image}) to finish"), POD_WAIT, || async {
            let pod = pods.get(name).await.map_err(|e| e.to_string())?;
            match pod.status.and_then(|s| s.phase).as_deref() {
                Some(phase @ ("Succeeded" | "Failed")) => Ok(phase.to_owned()),
                other => Err(format!("phase {other:?}")),
            }
        })
        .await?;
        let log = pods.logs(name, &LogParams::default()).await?;
        ensure!(
            phase == "Succeeded",
            "{command:?} in {image}: {phase}: {log}"
        );
        ensure!(
            log.contains(expected),
            "{command:?} in {image} printed {log:?}"
        );
    }
    namespace.delete().await?;
    Ok(())
}
