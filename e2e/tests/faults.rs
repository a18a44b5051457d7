//! Faults on the real fleet. A module loaded on every node with an image must stay loaded
//! and labelled through each fault, sampled the whole time: the registry down during a
//! load, the hub's kube-apiserver restarted, etcd restarted, the leading hub and a proxy
//! killed mid-change, a spoke cut off from the hub's network (its processes running)
//! until both sides notice, the spoke's OCM agent stalled until its lease lapses and OCM
//! drops it from a Placement's decisions. After each fault a change made during or right after it
//! converges; its recovery time is printed. No agent unloads anything throughout.

mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use k8s_openapi::api::core::v1::Node;
use kmm_api::labels::ready_label;
use kmm_api::ocm::{MANAGED_CLUSTER_SET_BINDING, PLACEMENT, PLACEMENT_DECISION, UNREACHABLE_TAINT};
use kmm_e2e::fixture::{Fleet, wait_until};
use kmm_e2e::fleet;
use kmm_e2e::fleet::disruption::{
    SHORT_OCM_LEASE_SECONDS, cut_rules, iptables, set_ocm_lease, wait_ocm_renewing_short,
};
use kmm_e2e::fleet::hub_install;
use kmm_e2e::fleet::kmm::{self as fleet_kmm, Agent};
use kmm_e2e::fleet::nodes::RealNode;
use kube::core::DynamicObject;
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

    // The leader is cut from its apiserver (its Pod's traffic to it dropped, its process
    // running): it must stop serving before the standby may take the Lease, and a change
    // made meanwhile converges under the new leader.
    let next = change.start("leader-cut").await?;
    let cut_at = Instant::now();
    let handover = cut_leader_from_apiserver(&fleet).await?;
    next.converged(&fleet).await?;
    recoveries.push(("hub leader cut from its apiserver", cut_at.elapsed()));
    eprintln!(
        "fault: the cut leader stopped {:.1}s after the cut, the standby took the Lease {:.1}s after it",
        handover.stopped.as_secs_f64(),
        handover.taken_over.as_secs_f64()
    );
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

    // OCM loses sight of the spoke: its agent stalls, its lease lapses, OCM's registration
    // taints it unreachable and OCM's placement controller drops it from the decisions of
    // the Placement that placed a module there. The module stays loaded and labelled, and
    // its status says the cluster is held; once the agent resumes, OCM decides the
    // cluster again and the hold ends.
    let lost = OcmSightLoss::place(&fleet, &spoke, &node).await?;
    let stall = lost.stall(&fleet).await?;
    lost.wait_held(&fleet, "ClusterUnreachable").await?;
    stall.resume(&fleet).await?;
    let resumed = Instant::now();
    lost.wait_held(&fleet, "").await?;
    recoveries.push(("spoke's OCM agent lease lapsed", resumed.elapsed()));

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
    lost.clean_up(&fleet).await?;
    delete(&fleet.hub, &steady).await?;
    wait_labelled(&fleet, &steady, &[]).await?;
    for spoke in fleet.spoke_names() {
        label_cluster(&fleet.hub, &spoke, &steady_id, false).await?;
    }
    Ok(())
}

/// When, after the cut, the cut leader stopped and the standby took the Lease.
struct Handover {
    stopped: Duration,
    taken_over: Duration,
}

/// Drops the leader Pod's traffic to and from the hub's kube-apiserver (in its node's
/// network namespace), waits until the Lease moved, checks the leader's container
/// stopped first, and heals the cut.
async fn cut_leader_from_apiserver(fleet: &Fleet) -> Result<Handover> {
    use k8s_openapi::api::core::v1::{Endpoints, Pod};
    let leader = hub_install::wait_leader(&fleet.hub, RECOVERY).await?;
    let former = hub_install::lease_holder(&fleet.hub).await?;
    let pods: Api<Pod> = Api::namespaced(fleet.hub.clone(), HUB_NAMESPACE);
    let pod = pods.get(&leader).await?;
    let pod_ip = pod
        .status
        .as_ref()
        .and_then(|s| s.pod_ip.clone())
        .context("the leader's Pod IP")?;
    let node_name = pod.spec.as_ref().and_then(|s| s.node_name.clone());
    let node = fleet
        .state
        .cluster("hub")?
        .real_nodes
        .iter()
        .find(|n| Some(&n.name) == node_name.as_ref())
        .context("the leader's node")?
        .clone();
    let endpoints: Api<Endpoints> = Api::namespaced(fleet.hub.clone(), "default");
    let apiserver = endpoints.get("kubernetes").await?;
    let subset = apiserver
        .subsets
        .as_ref()
        .and_then(|s| s.first())
        .context("the apiserver's endpoint")?;
    let api_ip = subset
        .addresses
        .as_ref()
        .and_then(|a| a.first())
        .map(|a| a.ip.clone())
        .context("the apiserver's address")?;
    let api_port = subset
        .ports
        .as_ref()
        .and_then(|p| p.first())
        .map(|p| p.port.to_string())
        .context("the apiserver's port")?;
    // The container running now: when it ends, and when the standby acquires the Lease,
    // are read from the kubelet's and the apiserver's own timestamps (one host, one
    // clock), not from when this test happens to look.
    let started = |pod: &Pod| {
        pod.status
            .as_ref()
            .and_then(|s| s.container_statuses.as_ref())
            .and_then(|c| c.first())
            .and_then(|c| c.state.as_ref()?.running.as_ref()?.started_at.clone())
    };
    let running_since = started(&pod).context("the leader's container is running")?;
    let finished = move |pod: &Pod| {
        let status = pod.status.as_ref()?.container_statuses.as_ref()?.first()?;
        [status.state.as_ref(), status.last_state.as_ref()]
            .into_iter()
            .flatten()
            .filter_map(|state| state.terminated.as_ref())
            .find(|t| t.started_at.as_ref() == Some(&running_since))
            .and_then(|t| t.finished_at.clone())
    };
    let rules: Vec<Vec<String>> = vec![
        [
            "FORWARD", "-s", &pod_ip, "-d", &api_ip, "-p", "tcp", "--dport", &api_port, "-j",
            "DROP",
        ]
        .map(str::to_owned)
        .to_vec(),
        [
            "FORWARD", "-s", &api_ip, "-d", &pod_ip, "-p", "tcp", "--sport", &api_port, "-j",
            "DROP",
        ]
        .map(str::to_owned)
        .to_vec(),
    ];
    let mut cut = Partition {
        rules: vec![],
        healed: false,
    };
    for rule in rules {
        iptables(&node.netns, "-I", &rule)?;
        cut.rules.push((node.netns.clone(), rule));
    }
    let cut_at = k8s_openapi::jiff::Timestamp::now();
    let leases: Api<k8s_openapi::api::coordination::v1::Lease> =
        Api::namespaced(fleet.hub.clone(), HUB_NAMESPACE);
    let (stopped, taken_over) = wait_until(
        "the cut leader to stop and the Lease to move",
        RECOVERY,
        || async {
            let stopped = pods.get(&leader).await.ok().and_then(|pod| finished(&pod));
            let taken_over = leases
                .get("kmm-hub")
                .await
                .ok()
                .and_then(|lease| lease.spec)
                .filter(|spec| spec.holder_identity.as_ref().is_some_and(|h| *h != former))
                .and_then(|spec| spec.acquire_time);
            match (stopped, taken_over) {
                (Some(s), Some(t)) => Ok((s.0, t.0)),
                other => Err(format!("stopped, taken over: {other:?}")),
            }
        },
    )
    .await?;
    cut.heal().await?;
    // While cut off, the Pod's restarted container cannot rejoin either, and the kubelet
    // backs off between restarts (up to 5 minutes on a fleet that ran this before): a
    // fresh Pod lets the next steps wait on the hub, not on that back-off.
    pods.delete(&leader, &Default::default()).await?;
    let since_cut = |at: k8s_openapi::jiff::Timestamp| {
        Duration::try_from(at.duration_since(cut_at)).unwrap_or_default()
    };
    let (stopped, taken_over) = (since_cut(stopped), since_cut(taken_over));
    ensure!(
        stopped < taken_over,
        "the cut leader stopped {stopped:?} after the cut, after the standby took the Lease \
         ({taken_over:?}): two replicas led at once"
    );
    Ok(Handover {
        stopped,
        taken_over,
    })
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

/// A module placed on one node of a spoke by a Placement of its own.
struct OcmSightLoss {
    module: Started,
    namespace: String,
}

impl OcmSightLoss {
    const PLACEMENT: &str = "fault-ocm";

    /// Places a module on `node` through a Placement choosing clusters by a label only
    /// `spoke` carries, and waits until the node is labelled.
    async fn place(fleet: &Fleet, spoke: &str, node: &str) -> Result<Self> {
        let id = "kmm-e2e.dev/fault-ocm".to_owned();
        let name = unique("fault-ocm");
        let namespace = unique("fault-ocm");
        let namespaces: Api<k8s_openapi::api::core::v1::Namespace> = Api::all(fleet.hub.clone());
        namespaces
            .create(
                &Default::default(),
                &serde_json::from_value(serde_json::json!({"metadata": {"name": namespace}}))?,
            )
            .await?;
        for (resource, object) in [
            (
                MANAGED_CLUSTER_SET_BINDING,
                serde_json::json!({
                    "metadata": {"name": "default"},
                    "spec": {"clusterSet": "default"},
                }),
            ),
            (
                PLACEMENT,
                serde_json::json!({
                    "metadata": {"name": Self::PLACEMENT},
                    "spec": {
                        "clusterSets": ["default"],
                        "predicates": [{"requiredClusterSelector": {
                            "labelSelector": {"matchLabels": {&id: "yes"}}}}],
                    },
                }),
            ),
        ] {
            let mut object: DynamicObject = serde_json::from_value(object)?;
            object.types = Some(kube::core::TypeMeta {
                api_version: resource.api_version(),
                kind: resource.kind.to_owned(),
            });
            Api::<DynamicObject>::namespaced_with(
                fleet.hub.clone(),
                &namespace,
                &resource.api_resource(),
            )
            .create(&Default::default(), &object)
            .await?;
        }
        label_cluster(&fleet.hub, spoke, &id, true).await?;
        label_node(fleet.spoke(spoke)?, node, &id, true).await?;
        let mut placed = module(&name, &id, sample_mapping(fleet))?;
        placed.spec.placement_refs = Some(vec![kmm_api::PlacementRef {
            namespace: namespace.clone(),
            name: Self::PLACEMENT.to_owned(),
        }]);
        create(&fleet.hub, &placed).await?;
        let module = Started {
            name,
            id,
            target: (spoke.to_owned(), node.to_owned()),
        };
        module.converged(fleet).await?;
        Ok(Self { module, namespace })
    }

    /// Stalls the spoke's OCM agent (SIGSTOP) with a lease short enough to lapse in
    /// seconds, and waits until OCM's placement controller dropped the spoke.
    async fn stall(&self, fleet: &Fleet) -> Result<Stalled> {
        let spoke = &self.module.target.0;
        let clusters = fleet::managed_clusters(&fleet.hub);
        let lease = set_ocm_lease(&fleet.hub, spoke, SHORT_OCM_LEASE_SECONDS.into()).await?;
        let agent = fleet
            .state
            .processes
            .iter()
            .find(|p| p.name == format!("{spoke}/ocm-agent"))
            .context("the spoke's OCM agent")?;
        wait_ocm_renewing_short(&fleet.hub, spoke, RECOVERY).await?;
        let stalled = Stalled {
            pid: nix::unistd::Pid::from_raw(agent.pid),
            spoke: spoke.clone(),
            lease,
            resumed: false,
        };
        nix::sys::signal::kill(stalled.pid, nix::sys::signal::Signal::SIGSTOP)?;
        let decisions = Api::<DynamicObject>::namespaced_with(
            fleet.hub.clone(),
            &self.namespace,
            &PLACEMENT_DECISION.api_resource(),
        );
        wait_until("OCM to drop the stalled spoke", RECOVERY, || async {
            let cluster = clusters.get(spoke).await.map_err(|e| e.to_string())?;
            let tainted = cluster.data["spec"]["taints"]
                .as_array()
                .into_iter()
                .flatten()
                .any(|t| t["key"] == UNREACHABLE_TAINT);
            let decided = decided(&decisions).await?;
            (tainted && !decided.contains(spoke))
                .then_some(())
                .ok_or_else(|| format!("tainted: {tainted}, decided: {decided:?}"))
        })
        .await?;
        Ok(stalled)
    }

    /// Waits until the module's status holds exactly its spoke for `reason`, or holds
    /// nothing (`reason` empty), with its node still labelled throughout.
    async fn wait_held(&self, fleet: &Fleet, reason: &str) -> Result<()> {
        let (spoke, node) = &self.module.target;
        wait_until(&format!("held: {reason:?}"), RECOVERY, || async {
            let status = status(&fleet.hub, &self.module.name)
                .await
                .map_err(|e| format!("{e:#}"))?;
            let held: Vec<(String, String)> = status["held"]
                .as_array()
                .into_iter()
                .flatten()
                .map(|h| {
                    let field = |f: &str| h[f].as_str().unwrap_or_default().to_owned();
                    (field("cluster"), field("reason"))
                })
                .collect();
            let expected = if reason.is_empty() {
                vec![]
            } else {
                vec![(spoke.clone(), reason.to_owned())]
            };
            (held == expected)
                .then_some(())
                .ok_or_else(|| format!("{held:?}"))
        })
        .await?;
        let now = labelled(fleet, &self.module.name).await?;
        ensure!(
            now.contains_key(&(spoke.clone(), node.clone())),
            "{node} lost its label while OCM lost sight of {spoke}: {now:?}"
        );
        Ok(())
    }

    async fn clean_up(self, fleet: &Fleet) -> Result<()> {
        self.module.clean_up(fleet).await?;
        let namespaces: Api<k8s_openapi::api::core::v1::Namespace> = Api::all(fleet.hub.clone());
        namespaces
            .delete(&self.namespace, &Default::default())
            .await?;
        Ok(())
    }
}

/// Which clusters a namespace's PlacementDecisions list.
async fn decided(decisions: &Api<DynamicObject>) -> Result<Vec<String>, String> {
    let list = decisions
        .list(&Default::default())
        .await
        .map_err(|e| e.to_string())?;
    Ok(list
        .items
        .iter()
        .flat_map(|d| {
            d.data["status"]["decisions"]
                .as_array()
                .cloned()
                .unwrap_or_default()
        })
        .filter_map(|d| d["clusterName"].as_str().map(str::to_owned))
        .collect())
}

/// A spoke's OCM agent stopped by SIGSTOP; resumed (and its lease restored) on drop if
/// the test fails first.
struct Stalled {
    pid: nix::unistd::Pid,
    spoke: String,
    lease: Value,
    resumed: bool,
}

impl Stalled {
    /// Resumes the agent, restores its lease period and waits until OCM decides the
    /// spoke again.
    async fn resume(mut self, fleet: &Fleet) -> Result<()> {
        self.resumed = true;
        nix::sys::signal::kill(self.pid, nix::sys::signal::Signal::SIGCONT)?;
        let clusters = fleet::managed_clusters(&fleet.hub);
        let lease = serde_json::json!({"spec": {"leaseDurationSeconds": self.lease}});
        clusters
            .patch(
                &self.spoke,
                &Default::default(),
                &kube::api::Patch::Merge(&lease),
            )
            .await?;
        wait_until("OCM to see the spoke again", RECOVERY, || async {
            let cluster = clusters.get(&self.spoke).await.map_err(|e| e.to_string())?;
            let taints = &cluster.data["spec"]["taints"];
            taints
                .as_array()
                .is_none_or(|t| t.iter().all(|t| t["key"] != UNREACHABLE_TAINT))
                .then_some(())
                .ok_or_else(|| taints.to_string())
        })
        .await?;
        Ok(())
    }
}

impl Drop for Stalled {
    fn drop(&mut self) {
        if !self.resumed {
            let _ = nix::sys::signal::kill(self.pid, nix::sys::signal::Signal::SIGCONT);
        }
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
            for rule in cut_rules(&ip) {
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
