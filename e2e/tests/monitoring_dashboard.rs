//! Every query of the dashboard (`addon-manifests/monitoring/dashboard.json`) returns
//! data from a real Prometheus scraping the local fleet's hub replicas, spoke proxies and
//! node agents. Needs the local fleet (`cargo xtask env up`) running this tree's kmm.
//!
//! The test loads a module on one spoke first, so that the per-module panels and the
//! agents' load histogram have something to show; it starts the toolchain's
//! `prometheus` on 127.0.0.1 with a scrape config naming every Pod's metrics address
//! (Pod addresses are routed from the host).

mod support;

use std::time::Duration;

use anyhow::{Context, Result, ensure};
use k8s_openapi::api::core::v1::Pod;
use kmm_e2e::fixture::{Fleet, wait_until};
use kmm_e2e::fleet::hub_install;
use kmm_e2e::fleet::kmm::{
    AGENT_LABEL, AGENT_METRICS_PORT, HUB_NAMESPACE, PROXY_LABEL, PROXY_METRICS_PORT,
    SPOKE_NAMESPACE,
};
use kmm_e2e::monitoring::{Prometheus, dashboard_queries};
use kmm_e2e::toolchain::Toolchain;
use kmm_e2e::versions::Versions;
use kube::api::ListParams;
use kube::{Api, Client};
use serde_json::{Value, json};
use support::*;

/// The hub's `--metrics-addr` port (addon-manifests/hub/deployment.yaml).
const HUB_METRICS_PORT: u16 = 8080;
/// Short, so that the queries' 5-minute rate windows hold two samples within seconds.
const SCRAPE_INTERVAL: &str = "5s";
const DATA_WAIT: Duration = Duration::from_secs(180);

async fn pod_addresses(
    client: &Client,
    namespace: &str,
    selector: &str,
    port: u16,
) -> Result<Vec<String>> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), namespace);
    Ok(pods
        .list(&ListParams::default().labels(selector))
        .await?
        .items
        .iter()
        .filter(|p| p.metadata.deletion_timestamp.is_none())
        .filter_map(|p| p.status.as_ref()?.pod_ip.clone())
        .map(|ip| format!("{ip}:{port}"))
        .collect())
}

/// One scrape job per component, over every Pod of it in the fleet.
async fn scrape_config(fleet: &Fleet) -> Result<Value> {
    let hub = pod_addresses(
        &fleet.hub,
        HUB_NAMESPACE,
        &format!("app.kubernetes.io/name={}", hub_install::DEPLOYMENT),
        HUB_METRICS_PORT,
    )
    .await?;
    let (mut proxies, mut agents) = (vec![], vec![]);
    for spoke in fleet.spoke_names() {
        let client = fleet.spoke(&spoke)?;
        proxies
            .extend(pod_addresses(client, SPOKE_NAMESPACE, PROXY_LABEL, PROXY_METRICS_PORT).await?);
        agents
            .extend(pod_addresses(client, SPOKE_NAMESPACE, AGENT_LABEL, AGENT_METRICS_PORT).await?);
    }
    for (what, targets) in [("hub", &hub), ("proxy", &proxies), ("agent", &agents)] {
        ensure!(
            !targets.is_empty(),
            "no {what} Pod with an address in the fleet"
        );
    }
    Ok(json!({
        "global": { "scrape_interval": SCRAPE_INTERVAL, "evaluation_interval": SCRAPE_INTERVAL },
        "scrape_configs": [
            { "job_name": "kmm-hub", "static_configs": [{ "targets": hub }] },
            { "job_name": "kmm-spoke-proxy", "static_configs": [{ "targets": proxies }] },
            { "job_name": "kmm-node-agent", "static_configs": [{ "targets": agents }] },
        ],
    }))
}

/// Polls every query until each returns data; the queries still empty otherwise.
async fn wait_for_data(prometheus: &Prometheus) -> Result<()> {
    let queries = dashboard_queries()?;
    wait_until(
        "every dashboard query to return data",
        DATA_WAIT,
        || async {
            let mut empty = vec![];
            for q in &queries {
                match prometheus.query(&q.expr).await {
                    Ok(result) if !result.is_empty() => {}
                    Ok(_) => empty.push(format!("{}: {}", q.panel, q.expr)),
                    Err(e) => empty.push(format!("{}: {e}", q.panel)),
                }
            }
            match empty.is_empty() {
                true => Ok(()),
                false => Err(format!("no data for:\n  {}", empty.join("\n  "))),
            }
        },
    )
    .await
    .with_context(|| format!("Prometheus' log:\n{}", prometheus.log()))
}

#[tokio::test]
async fn every_dashboard_panel_query_returns_data_from_the_fleet() -> Result<()> {
    let toolchain =
        Toolchain::ensure_monitoring(&Versions::pinned(), settings()?.bin_dir.as_deref())?;
    let fleet = Fleet::get().await?;
    let cluster = fleet
        .spoke_names()
        .into_iter()
        .next()
        .context("the fleet has no spoke")?;
    let (id, name) = (unique("kmm-e2e.dev/dashboard"), unique("dashboard"));
    label_cluster(&fleet.hub, &cluster, &id, true).await?;
    let mut targets = vec![];
    for (node, _) in nodes_with_images(&fleet, &cluster)? {
        label_node(fleet.spoke(&cluster)?, &node, &id, true).await?;
        targets.push((cluster.clone(), node));
    }
    ensure!(
        !targets.is_empty(),
        "{cluster} has no node with a sample image"
    );
    create(&fleet.hub, &module(&name, &id, sample_mapping(&fleet))?).await?;
    wait_labelled(&fleet, &name, &targets).await?;

    let prometheus =
        Prometheus::start(toolchain.bin("prometheus"), &scrape_config(&fleet).await?).await?;
    let checked = wait_for_data(&prometheus).await;
    drop(prometheus);

    delete(&fleet.hub, &name).await?;
    for (_, node) in &targets {
        label_node(fleet.spoke(&cluster)?, node, &id, false).await?;
    }
    label_cluster(&fleet.hub, &cluster, &id, false).await?;
    checked
}
