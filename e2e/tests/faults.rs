//! Faults on the real fleet. A module loaded on every node with an image must stay loaded
//! and labelled through each fault, sampled the whole time: the registry down during a
//! load, the hub's kube-apiserver restarted, etcd restarted, the leading hub and a proxy
//! killed mid-change, a spoke cut off from the hub's network (its processes running)
//! until both sides notice. After each fault a change made during or right after it
//! converges; its recovery time is printed. No agent unloads anything throughout.

mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use k8s_openapi::api::core::v1::Node;
use kmm_api::labels::ready_label;
use kmm_e2e::fixture::{Fleet, wait_until};
use kmm_e2e::fleet;
use kmm_e2e::fleet::hub_install;
use kmm_e2e::fleet::kmm::{self as fleet_kmm, Agent};
use kmm_e2e::fleet::nodes::RealNode;
use kube::{Api, Client, ResourceExt};
use serde_json::Value;
use support::*;

/// How long a stopped etcd or apiserver gets to come back, and the hub to follow.
const RECOVERY: Duration = Duration::from_secs(180);

#[tokio::test]
async fn the_fleet_converges_after_each_fault_and_never_unloads_or_mislabels() -> Result<()> {
    let fleet = Fleet::get().await?;
    let kmm = kmm(&fleet)?.clone();
    let settings = settings()?;
    let (steady_id, steady) = (unique("kmm-e2e.dev/steady"), unique("steady"));
    let mut targets = vec![];
    for spoke in fleet.spoke_names() {
        label_cluster(&fleet.hub, &spoke, &steady_id, true).await?;
        for (node, _) in nodes_with_images(&fleet, &spoke)? {
            label_node(fleet.spoke(&spoke)?, &node, &steady_id, true).await?;
            targets.push((spoke.clone(), node));
        }
    }
    create(
        &fleet.hub,
        &module(&steady, &steady_id, sample_mapping(&fleet))?,
    )
    .await?;
    wait_labelled(&fleet, &steady, &targets).await?;
    let unloads_before = unloads(&fleet, &kmm).await?;
    let sampler = Sampler::start(&fleet, &kmm, &steady, &targets)?;

    // Changes during the faults: a module each, on one KWOK node of the first spoke.
    let spoke = fleet.spoke_names()[0].clone();
    let (node, _) = nodes_with_images(&fleet, &spoke)?
        .into_iter()
        .find(|(n, _)| kmm.agents.iter().any(|a| a.node == *n && a.simulated))
        .context("a KWOK node with an image")?;
    let change = Change {
        fleet: &fleet,
        spoke: &spoke,
        node: &node,
    };
    let mut recoveries = vec![];

    // The registry is down while a new module's image is needed: the hub cannot check
    // it and says so; once the registry is back the node loads it.
    let mut started = vec![];
    let first = change.start("registry").await?;
    fleet::stop_process(&settings, "registry", Duration::from_secs(10))?;
    wait_until(
        "the hub to report the registry's absence",
        RECOVERY,
        || async {
            let status = status(&fleet.hub, &first.name)
                .await
                .map_err(|e| e.to_string())?;
            let images = status["images"].as_array().cloned().unwrap_or_default();
            images
                .iter()
                .any(|i| i["state"] != "Exists" && !i["state"].is_null())
                .then_some(())
                .ok_or_else(|| status.to_string())
        },
    )
    .await?;
    fleet::start_process(&settings, "registry", None)?;
    let back = Instant::now();
    first.converged(&fleet).await?;
    recoveries.push(("registry down during a load", back.elapsed()));
    started.push(first);

    // The hub's kube-apiserver restarts; then etcd, under every cluster. A change made
    // as each comes back converges.
    for (process, what) in [("hub/kube-apiserver", "apiserver"), ("etcd", "etcd")] {
        fleet::stop_process(&settings, process, Duration::from_secs(10))?;
        fleet::start_process(&settings, process, None)?;
        let back = Instant::now();
        let next = wait_until(
            &format!("a change accepted after {process}"),
            RECOVERY,
            || {
                let change = &change;
                async move { change.start(what).await.map_err(|e| format!("{e:#}")) }
            },
        )
        .await?;
        next.converged(&fleet).await?;
        recoveries.push((process, back.elapsed()));
        started.push(next);
    }

    // Mid-change, the leading hub is killed (its Lease not released) and a proxy restarts.
    let next = change.start("killed").await?;
    let killed = Instant::now();
    let former = hub_install::lease_holder(&fleet.hub).await?;
    hub_install::crash_leader(&fleet.hub).await?;
    fleet_kmm::restart_proxy(fleet.spoke(&spoke)?, RECOVERY).await?;
    hub_install::wait_lease_moved(&fleet.hub, RECOVERY, &former).await?;
    next.converged(&fleet).await?;
    recoveries.push(("hub leader and proxy killed mid-change", killed.elapsed()));
    started.push(next);
    hub_install::scale(&fleet.hub, 2).await?;

    // The spoke's nodes lose the hub's network (not their processes) until the proxy and
    // the hub both know; a change made meanwhile reaches the spoke once the network heals.
    let hub_node = fleet
        .state
        .cluster("hub")?
        .real_nodes
        .first()
        .context("the hub's real node")?
        .clone();
    let cut = Partition::cut(&fleet.state.cluster(&spoke)?.real_nodes, &hub_node).await?;
    let spoke_client = fleet.spoke(&spoke)?;
    wait_until("the proxy to lose the hub", RECOVERY, || async {
        let text = fleet_kmm::proxy_metrics(spoke_client)
            .await
            .map_err(|e| e.to_string())?;
        text.lines()
            .any(|l| l.trim() == "kmm_spoke_proxy_hub_connected 0")
            .then_some(())
            .ok_or("the proxy still says it is connected".to_owned())
    })
    .await?;
    wait_until("the hub to lose the spoke", RECOVERY, || async {
        let status = status(&fleet.hub, &steady)
            .await
            .map_err(|e| e.to_string())?;
        (status["clusters"]["connected"].as_u64() < status["clusters"]["selected"].as_u64())
            .then_some(())
            .ok_or_else(|| status["clusters"].to_string())
    })
    .await?;
    let next = change.start("partition").await?;
    cut.heal().await?;
    let healed = Instant::now();
    next.converged(&fleet).await?;
    recoveries.push(("spoke partitioned from the hub", healed.elapsed()));
    started.push(next);

    let samples = sampler.stop().await?;
    for (fault, took) in &recoveries {
        eprintln!("fault: {fault}: recovered in {:.1}s", took.as_secs_f64());
    }
    eprintln!(
        "fault: steady module sampled {} times ({} unanswered)",
        samples.taken, samples.unanswered
    );
    ensure!(
        samples.violations.is_empty(),
        "wrong labels while faults ran: {:#?}",
        samples.violations
    );
    ensure!(samples.taken > 20, "too few samples: {samples:?}");
    let unloads_after = unloads(&fleet, &kmm).await?;
    ensure!(
        unloads_after == unloads_before,
        "the faults caused {} unload(s)",
        unloads_after - unloads_before
    );

    for module in started {
        module.clean_up(&fleet).await?;
    }
    delete(&fleet.hub, &steady).await?;
    wait_labelled(&fleet, &steady, &[]).await?;
    for spoke in fleet.spoke_names() {
        label_cluster(&fleet.hub, &spoke, &steady_id, false).await?;
    }
    Ok(())
}

/// The modules the test creates during the faults, each on the same one node.
struct Change<'a> {
    fleet: &'a Fleet,
    spoke: &'a str,
    node: &'a str,
}

struct Started {
    name: String,
    id: String,
    target: (String, String),
}

impl Change<'_> {
    /// Creates module `fault-<what>-...` selecting the node and its cluster.
    async fn start(&self, what: &str) -> Result<Started> {
        let id = format!("kmm-e2e.dev/fault-{what}");
        let name = unique(&format!("fault-{what}"));
        label_cluster(&self.fleet.hub, self.spoke, &id, true).await?;
        label_node(self.fleet.spoke(self.spoke)?, self.node, &id, true).await?;
        create(
            &self.fleet.hub,
            &module(&name, &id, sample_mapping(self.fleet))?,
        )
        .await?;
        Ok(Started {
            name,
            id,
            target: (self.spoke.to_owned(), self.node.to_owned()),
        })
    }
}

impl Started {
    /// Waits until its node is labelled, within [`RECOVERY`].
    async fn converged(&self, fleet: &Fleet) -> Result<()> {
        wait_until(&format!("{} labelled", self.name), RECOVERY, || async {
            let now = labelled(fleet, &self.name)
                .await
                .map_err(|e| format!("{e:#}"))?;
            now.contains_key(&self.target)
                .then_some(())
                .ok_or_else(|| format!("{now:?}"))
        })
        .await?;
        Ok(())
    }

    async fn clean_up(self, fleet: &Fleet) -> Result<()> {
        delete(&fleet.hub, &self.name).await?;
        let (cluster, node) = &self.target;
        label_node(fleet.spoke(cluster)?, node, &self.id, false).await?;
        label_cluster(&fleet.hub, cluster, &self.id, false).await?;
        Ok(())
    }
}

/// Samples, every 250 ms while the faults run, that every target node of the steady
/// module carries its ready label and that its agent records the module loaded.
struct Sampler {
    stop: Arc<AtomicBool>,
    task: tokio::task::JoinHandle<Samples>,
}

#[derive(Debug, Default)]
struct Samples {
    taken: usize,
    /// Samples a spoke's apiserver could not answer (etcd restarting).
    unanswered: usize,
    violations: Vec<String>,
}

impl Sampler {
    fn start(
        fleet: &Fleet,
        kmm: &fleet_kmm::Kmm,
        module: &str,
        targets: &[(String, String)],
    ) -> Result<Self> {
        let label = ready_label(NAMESPACE, module);
        let key = format!("{NAMESPACE}/{module}");
        let mut watched: Vec<(Client, String, Agent)> = vec![];
        for (cluster, node) in targets {
            let agent = kmm
                .agents
                .iter()
                .find(|a| a.node == *node)
                .with_context(|| format!("the agent of {node}"))?;
            watched.push((fleet.spoke(cluster)?.clone(), node.clone(), agent.clone()));
        }
        let stop = Arc::new(AtomicBool::new(false));
        let stopping = stop.clone();
        let task = tokio::spawn(async move {
            let mut samples = Samples::default();
            // A sampling period, not a wait for anything.
            let mut every = tokio::time::interval(Duration::from_millis(250));
            while !stopping.load(Ordering::Relaxed) {
                every.tick().await;
                for (client, node, agent) in &watched {
                    let Ok(object) = Api::<Node>::all(client.clone()).get(node).await else {
                        samples.unanswered += 1;
                        continue;
                    };
                    samples.taken += 1;
                    if !object.labels().contains_key(&label) {
                        samples.violations.push(format!("{node} lost {label}"));
                    }
                    let loaded = std::fs::read(agent.state_file())
                        .ok()
                        .and_then(|b| serde_json::from_slice::<Value>(&b).ok())
                        .is_some_and(|s| !s["modules"][&key].is_null());
                    if !loaded {
                        samples
                            .violations
                            .push(format!("{node} labelled, {key} not loaded"));
                    }
                }
            }
            samples
        });
        Ok(Self { stop, task })
    }

    async fn stop(self) -> Result<Samples> {
        self.stop.store(true, Ordering::Relaxed);
        Ok(self.task.await?)
    }
}

/// The real nodes of a spoke cut off from the hub's node (both directions, forwarded
/// Pod traffic and the nodes' own) by iptables rules in their network namespaces;
/// healed on drop if the test fails first.
struct Partition {
    rules: Vec<(String, Vec<String>)>,
    healed: bool,
}

impl Partition {
    async fn cut(nodes: &[RealNode], hub: &RealNode) -> Result<Self> {
        let ip = hub.ip.to_string();
        let mut partition = Self {
            rules: vec![],
            healed: false,
        };
        for node in nodes {
            for (chain, direction) in [
                ("FORWARD", "-d"),
                ("FORWARD", "-s"),
                ("OUTPUT", "-d"),
                ("INPUT", "-s"),
            ] {
                let rule: Vec<String> = [chain, direction, &ip, "-j", "DROP"]
                    .map(str::to_owned)
                    .to_vec();
                iptables(&node.netns, "-I", &rule)?;
                partition.rules.push((node.netns.clone(), rule));
            }
        }
        ensure!(
            !partition.rules.is_empty(),
            "the spoke has no real node to cut"
        );
        Ok(partition)
    }

    async fn heal(mut self) -> Result<()> {
        self.healed = true;
        for (netns, rule) in &self.rules {
            iptables(netns, "-D", rule)?;
        }
        Ok(())
    }
}

impl Drop for Partition {
    fn drop(&mut self) {
        if !self.healed {
            for (netns, rule) in &self.rules {
                let _ = iptables(netns, "-D", rule);
            }
        }
    }
}

fn iptables(netns: &str, op: &str, rule: &[String]) -> Result<()> {
    let status = std::process::Command::new("ip")
        .args(["netns", "exec", netns, "iptables", "-w", op])
        .args(rule)
        .status()
        .context("running iptables in the node's network namespace")?;
    ensure!(
        status.success(),
        "iptables {op} {rule:?} in {netns}: {status}"
    );
    Ok(())
}
