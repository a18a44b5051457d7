//! Convergence of the default local fleet, printed as figures (not a timed test):
//! time from creating a ManagedClusterModule to every selected simulated node labelled
//! ready, time from deleting it to every label removed, and the resident memory of the
//! spoke proxies and the node agents (kmm-hub's Pods: `cargo xtask env status`).
//!
//! `cargo bench -p kmm-e2e --bench convergence` (attaches to `cargo xtask env up`, or
//! starts the fleet). `KMM_BENCH_ROUNDS` sets the number of rounds (default 3).
//!
//! The moments are taken from watches of the spokes' Nodes and the hub's modules, so
//! the figures are the fleet's own and not rounded up to a polling interval. Each round
//! also prints the hops of its create (hub, proxies, agents, label patches), from the
//! timestamp gauges every component publishes (`kmm_e2e::hops`), read once the round
//! converged, and the medians of the hops follow the rounds.

#[path = "../tests/support/mod.rs"]
mod support;

use std::collections::BTreeSet;
use std::time::Instant;

use anyhow::{Context, Result};
use k8s_openapi::api::core::v1::Node;
use kmm_api::ManagedClusterModule;
use kmm_api::labels::{ready_label, version_ready_label};
use kmm_e2e::fixture::Fleet;
use kmm_e2e::fleet::kmm::{Kmm, agent_metrics, hub_metrics, proxy_metrics};
use kmm_e2e::hops::{self, Hop};
use kmm_e2e::watched::Watched;
use kube::{Api, ResourceExt};
use support::*;

/// Every spoke's Nodes, each kept current by a watch.
struct SpokeNodes(Vec<(String, Watched<Node>)>);

impl SpokeNodes {
    fn start(fleet: &Fleet) -> Result<Self> {
        let mut spokes = vec![];
        for spoke in fleet.spoke_names() {
            let api = Api::<Node>::all(fleet.spoke(&spoke)?.clone());
            spokes.push((spoke, Watched::start(api, Default::default())));
        }
        Ok(Self(spokes))
    }

    /// Until exactly `targets` carry module `name`'s ready label at [`VERSION`].
    async fn wait_labelled(&mut self, name: &str, targets: &[(String, String)]) -> Result<()> {
        let (ready, version) = (
            ready_label(NAMESPACE, name),
            version_ready_label(NAMESPACE, name),
        );
        for (spoke, nodes) in &mut self.0 {
            let expected: BTreeSet<&str> = targets
                .iter()
                .filter(|(s, _)| s == spoke)
                .map(|(_, node)| node.as_str())
                .collect();
            let what = format!("{spoke}: exactly {expected:?} labelled for {name}");
            nodes
                .wait_for(&what, WAIT, |nodes| {
                    let labelled: BTreeSet<&str> = nodes
                        .values()
                        .filter(|n| {
                            n.labels().contains_key(&ready)
                                && n.labels().get(&version).map(String::as_str) == Some(VERSION)
                        })
                        .map(|n| n.metadata.name.as_deref().unwrap_or_default())
                        .collect();
                    if labelled == expected {
                        Ok(())
                    } else {
                        Err(format!("labelled: {labelled:?}"))
                    }
                })
                .await?;
        }
        Ok(())
    }
}

/// Every kmm process's `/metrics`.
struct Scrape {
    /// kmm-hub's replicas and the spokes' proxies.
    components: Vec<String>,
    agents: Vec<String>,
}

impl Scrape {
    async fn read(fleet: &Fleet, kmm: &Kmm) -> Result<Self> {
        let mut components = hub_metrics(&fleet.hub)
            .await
            .context("/metrics of kmm-hub")?;
        for spoke in fleet.spoke_names() {
            components.push(
                proxy_metrics(fleet.spoke(&spoke)?)
                    .await
                    .with_context(|| format!("/metrics of the proxy of {spoke}"))?,
            );
        }
        let mut agents = vec![];
        for agent in &kmm.agents {
            agents.push(
                agent_metrics(fleet.spoke(&agent.cluster)?, &agent.node)
                    .await
                    .with_context(|| format!("/metrics of the agent of {}", agent.node))?,
            );
        }
        Ok(Self { components, agents })
    }

    fn all(&self) -> Vec<String> {
        self.components
            .iter()
            .chain(&self.agents)
            .cloned()
            .collect()
    }
}

fn unix_now() -> f64 {
    kmm_runtime::timestamp::unix_seconds(std::time::SystemTime::now())
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

#[tokio::main]
async fn main() -> Result<()> {
    let rounds: usize = std::env::var("KMM_BENCH_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(3);
    let fleet = Fleet::get().await?;
    let kmm = kmm(&fleet)?;
    let id = unique("kmm-bench.dev/all");
    let mut targets = vec![];
    for spoke in fleet.spoke_names() {
        label_cluster(&fleet.hub, &spoke, &id, true).await?;
        for (node, _) in nodes_with_images(&fleet, &spoke)? {
            label_node(fleet.spoke(&spoke)?, &node, &id, true).await?;
            targets.push((spoke.clone(), node));
        }
    }
    println!(
        "fleet: {} spokes, {} nodes selected (every node whose kernel has an image)",
        fleet.spoke_names().len(),
        targets.len()
    );

    let mut nodes = SpokeNodes::start(&fleet)?;
    let modules_api = Api::<ManagedClusterModule>::all(fleet.hub.clone());
    let mut modules = Watched::start(modules_api.clone(), Default::default());
    let (mut converge, mut cleanup) = (vec![], vec![]);
    let mut round_hops: Vec<Vec<Hop>> = vec![];
    for round in 1..=rounds {
        let name = unique("bench");
        let steps_before = hops::step_totals(&Scrape::read(&fleet, kmm).await?.agents)?;
        let created = unix_now();
        let started = Instant::now();
        create(&fleet.hub, &module(&name, &id, sample_mapping(&fleet))?).await?;
        nodes.wait_labelled(&name, &targets).await?;
        let up = started.elapsed().as_secs_f64();
        let seen = unix_now();
        let scrape = Scrape::read(&fleet, kmm).await?;
        let this_round = hops::hops(created, &hops::latest_moments(&scrape.all())?, seen);
        let steps = hops::step_means(&steps_before, &hops::step_totals(&scrape.agents)?);
        println!(
            "round {round} hops: {}",
            hops::round_line(&this_round, &steps)
        );
        round_hops.push(this_round);
        let started = Instant::now();
        modules_api.delete(&name, &Default::default()).await?;
        modules
            .wait_for(&format!("{name} released"), WAIT, |all| {
                if all.contains_key(&name) {
                    Err("still there".to_owned())
                } else {
                    Ok(())
                }
            })
            .await?;
        nodes.wait_labelled(&name, &[]).await?;
        let down = started.elapsed().as_secs_f64();
        println!(
            "round {round}: create -> all ready {up:.2}s; delete -> all unlabelled and released {down:.2}s"
        );
        converge.push(up);
        cleanup.push(down);
    }
    println!(
        "convergence (MCM created -> all {} nodes ready): median {:.2}s over {rounds} rounds",
        targets.len(),
        median(converge)
    );
    println!(
        "deletion (MCM deleted -> labels gone, finalizer done): median {:.2}s",
        median(cleanup)
    );
    println!(
        "hops (create -> all ready), median over {rounds} rounds: {}",
        hops::medians_line(&hops::median_hops(&round_hops), rounds)
    );

    let state = kmm_e2e::fleet::running(&settings()?).context("the fleet stopped")?;
    // The proxies and agents as Pods (the nodes' cgroups) and KWOK runner processes.
    let kmm = state.kmm.as_ref().context("the fleet runs no kmm")?;
    for line in kmm_e2e::fleet::kmm::memory_lines(&state, kmm) {
        println!("memory {line}");
    }
    for spoke in fleet.spoke_names() {
        label_cluster(&fleet.hub, &spoke, &id, false).await?;
    }
    Ok(())
}
