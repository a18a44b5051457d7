//! The faults the soak injects, each undone by [`Active::restore`] or, when the soak
//! fails first, by [`Active`]'s drop.

use std::path::Path;
use std::time::Duration;

use anyhow::{Context, Result, ensure};
use k8s_openapi::api::core::v1::Pod;
use kmm_api::ocm::UNREACHABLE_TAINT;
use kube::api::ListParams;
use kube::{Api, Client, ResourceExt};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use serde_json::Value;

use super::schedule::Dice;
use crate::fixture::{Fleet, wait_until};
use crate::fleet::disruption::{
    SHORT_OCM_LEASE_SECONDS, cut_rules, iptables, set_ocm_lease, wait_ocm_renewing_short,
};
use crate::fleet::kmm::{self as fleet_kmm, HUB_NAMESPACE, SPOKE_NAMESPACE};
use crate::fleet::{Settings, State, hub_install, managed_clusters, start_process, stop_process};

/// A container's exit code after SIGKILL.
const KILLED: i32 = 128 + 9;

/// How long the fleet gets to come back from a fault, and a fault to take effect.
const RECOVERY: Duration = Duration::from_secs(180);

#[derive(Clone, Debug)]
pub enum Fault {
    /// SIGKILL of the leading kmm-hub (its Lease is not released).
    HubLeaderKill,
    /// SIGKILL of the standing-by kmm-hub.
    HubStandbyKill,
    ProxyKill(String),
    /// SIGKILL of a node's agent (a real node's container, a KWOK node's process).
    AgentKill(String),
    /// A cluster's kube-apiserver stopped until the fault is restored.
    ApiserverDown(String),
    /// A spoke's OCM agent stopped (SIGSTOP) until its lease lapses and OCM taints the
    /// cluster unreachable.
    OcmStall(String),
    RegistryDown,
    /// A spoke's real nodes cut from the hub's node (iptables in their netns).
    NetworkCut(String),
    /// The leading kmm-hub's Pod cut from the hub's kube-apiserver until the Lease moved.
    LeaderCut,
}

impl std::fmt::Display for Fault {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::HubLeaderKill => write!(f, "SIGKILL the leading kmm-hub"),
            Self::HubStandbyKill => write!(f, "SIGKILL the standby kmm-hub"),
            Self::ProxyKill(spoke) => write!(f, "SIGKILL the proxy of {spoke}"),
            Self::AgentKill(node) => write!(f, "SIGKILL the agent of {node}"),
            Self::ApiserverDown(cluster) => write!(f, "stop the kube-apiserver of {cluster}"),
            Self::OcmStall(spoke) => write!(f, "stall the OCM agent of {spoke}"),
            Self::RegistryDown => write!(f, "stop the registry"),
            Self::NetworkCut(spoke) => write!(f, "cut the real nodes of {spoke} from the hub"),
            Self::LeaderCut => write!(f, "cut the leading kmm-hub from its apiserver"),
        }
    }
}

impl Fault {
    /// Draws a fault (and its target) for a fleet of `spokes` and agent `nodes`.
    pub fn draw(dice: &mut Dice, spokes: &[String], nodes: &[String]) -> Self {
        match dice.below(9) {
            0 => Self::HubLeaderKill,
            1 => Self::HubStandbyKill,
            2 => Self::ProxyKill(dice.pick(spokes).clone()),
            3 => Self::AgentKill(dice.pick(nodes).clone()),
            4 => {
                let mut clusters = vec!["hub".to_owned()];
                clusters.extend(spokes.iter().cloned());
                Self::ApiserverDown(dice.pick(&clusters).clone())
            }
            5 => Self::OcmStall(dice.pick(spokes).clone()),
            6 => Self::RegistryDown,
            7 => Self::NetworkCut(dice.pick(spokes).clone()),
            _ => Self::LeaderCut,
        }
    }

    /// Waits until the component the fault stops runs again (none for the other
    /// faults), replacing a Pod the kubelet holds in its back-off after the soak's doing.
    async fn component_back(&self, fleet: &Fleet) -> Result<()> {
        match self {
            Self::HubLeaderKill | Self::HubStandbyKill | Self::LeaderCut => {
                let selector = format!("app.kubernetes.io/name={}", hub_install::DEPLOYMENT);
                replace_backed_off(&fleet.hub, HUB_NAMESPACE, &selector, &[KILLED, 1]).await?;
                hub_install::scale(&fleet.hub, 2).await?;
            }
            Self::ProxyKill(spoke) => {
                let client = fleet.spoke(spoke)?;
                replace_backed_off(client, SPOKE_NAMESPACE, fleet_kmm::PROXY_LABEL, &[KILLED])
                    .await?;
                fleet_kmm::wait_proxy_ready(client, RECOVERY).await?;
            }
            Self::AgentKill(node) => {
                let client = fleet.spoke(&agent(fleet, node)?.cluster)?;
                replace_backed_off(client, SPOKE_NAMESPACE, fleet_kmm::AGENT_LABEL, &[KILLED])
                    .await?;
                fleet_kmm::wait_agents_ready(client, RECOVERY).await?;
            }
            _ => {}
        }
        Ok(())
    }

    pub async fn inject(&self, fleet: &Fleet, settings: &Settings) -> Result<Active> {
        let mut active = Active {
            fault: self.clone(),
            undo: vec![],
            hub: fleet.hub.clone(),
        };
        // A component a fault kills must be running first: one still in the kubelet's
        // restart back-off from an earlier fault (or an earlier suite) has no process.
        self.component_back(fleet).await?;
        match self {
            Self::HubLeaderKill => {
                hub_install::crash_leader(&fleet.hub).await?;
            }
            Self::HubStandbyKill => {
                let leader = hub_install::wait_leader(&fleet.hub, RECOVERY).await?;
                // The Deployment may still count a standby ready whose container just
                // exited (one started while the apiserver was away exits, and waits out
                // the kubelet's back-off): the kill waits for its process.
                wait_until("a kmm-hub process in the standby Pod", RECOVERY, || async {
                    let pods = hub_install::pods(&fleet.hub)
                        .await
                        .map_err(|e| e.to_string())?;
                    let standby = pods
                        .iter()
                        .find(|p| p.name_any() != leader)
                        .ok_or("no standby kmm-hub Pod")?;
                    kill_container(standby, "kmm-hub").map_err(|e| e.to_string())
                })
                .await?;
            }
            Self::ProxyKill(spoke) => {
                let pod = fleet_kmm::proxy_pod(fleet.spoke(spoke)?).await?;
                kill_container(&pod, "kmm-spoke-proxy")?;
            }
            Self::AgentKill(node) => {
                let agent = agent(fleet, node)?;
                if agent.simulated {
                    let pid = agent.runner_pid().context("the KWOK agent's process")?;
                    kill(Pid::from_raw(i32::try_from(pid)?), Signal::SIGKILL)?;
                } else {
                    let pod = fleet_kmm::agent_pod(fleet.spoke(&agent.cluster)?, node).await?;
                    kill_container(&pod, "kmm-node-agent")?;
                }
            }
            Self::ApiserverDown(cluster) => {
                let name = format!("{cluster}/kube-apiserver");
                stop_process(settings, &name, Duration::from_secs(10))?;
                active.undo.push(Undo::Start(settings.clone(), name));
            }
            Self::RegistryDown => {
                stop_process(settings, "registry", Duration::from_secs(10))?;
                active
                    .undo
                    .push(Undo::Start(settings.clone(), "registry".to_owned()));
            }
            Self::OcmStall(spoke) => stall_ocm_agent(fleet, settings, spoke, &mut active).await?,
            Self::NetworkCut(spoke) => {
                let hub_ip = hub_node(fleet)?.ip.to_string();
                for node in &fleet.state.cluster(spoke)?.real_nodes {
                    for rule in cut_rules(&hub_ip) {
                        iptables(&node.netns, "-I", &rule)?;
                        active.undo.push(Undo::Iptables(node.netns.clone(), rule));
                    }
                }
            }
            Self::LeaderCut => {
                let leader = hub_install::wait_leader(&fleet.hub, RECOVERY).await?;
                let pods: Api<Pod> = Api::namespaced(fleet.hub.clone(), HUB_NAMESPACE);
                let ip = pods
                    .get(&leader)
                    .await?
                    .status
                    .and_then(|s| s.pod_ip)
                    .context("the leader's Pod IP")?;
                let gateway = fleet
                    .state
                    .network
                    .as_ref()
                    .context("the fleet's network")?
                    .gateway
                    .to_string();
                let port = apiserver_port(&fleet.state, "hub")?;
                // The Pod reaches its apiserver as the `kubernetes` Service, which
                // kube-proxy turns into the bridge address before the node forwards it.
                let rule = [
                    "FORWARD", "-s", &ip, "-d", &gateway, "-p", "tcp", "--dport", &port, "-j",
                    "DROP",
                ]
                .map(str::to_owned);
                let netns = hub_node(fleet)?.netns.clone();
                iptables(&netns, "-I", &rule)?;
                active.undo.push(Undo::Iptables(netns, rule.to_vec()));
                active.undo.push(Undo::Note(leader));
            }
        }
        Ok(active)
    }
}

/// Deletes the Pods (their controller starts fresh ones) whose container the kubelet
/// holds in a long crash back-off (a minute or more) after an exit the soak caused: its
/// own SIGKILL (137, not an OOM kill), or, for the hub, the exit of a replica that lost
/// its Lease (1). Over a long soak the back-off of a component stopped again and again
/// grows to five minutes; sitting it out tests nothing of kmm's. A short back-off is
/// waited for (the kubelet restarting the container is the fault's point), and any other
/// exit (a panic's 101) is left alone, to fail the recovery wait that follows.
async fn replace_backed_off(
    client: &Client,
    namespace: &str,
    selector: &str,
    caused: &[i32],
) -> Result<()> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), namespace);
    for pod in pods.list(&ListParams::default().labels(selector)).await? {
        let killed_and_backed_off = pod
            .status
            .as_ref()
            .and_then(|s| s.container_statuses.as_ref())
            .into_iter()
            .flatten()
            .any(|c| {
                let waiting = c.state.as_ref().and_then(|s| s.waiting.as_ref());
                let last = c.last_state.as_ref().and_then(|s| s.terminated.as_ref());
                waiting.and_then(|w| w.reason.as_deref()) == Some("CrashLoopBackOff")
                    && waiting
                        .and_then(|w| back_off(w.message.as_deref()?))
                        .is_some_and(|b| b >= LONG_BACK_OFF)
                    && last.is_some_and(|t| {
                        caused.contains(&t.exit_code) && t.reason.as_deref() != Some("OOMKilled")
                    })
            });
        if killed_and_backed_off {
            println!(
                "chaos: replacing Pod {namespace}/{} (in the kubelet's crash back-off after a kill)",
                pod.name_any()
            );
            pods.delete(&pod.name_any(), &Default::default()).await?;
        }
    }
    Ok(())
}

/// A back-off the soak does not sit out.
const LONG_BACK_OFF: Duration = Duration::from_secs(60);

/// The back-off the kubelet names in a waiting container's message, `back-off 2m40s
/// restarting failed container=...` (a Go duration of hours, minutes and seconds).
fn back_off(message: &str) -> Option<Duration> {
    let go = message
        .strip_prefix("back-off ")?
        .split_whitespace()
        .next()?;
    let (mut seconds, mut number) = (0u64, String::new());
    for c in go.chars() {
        match c {
            '0'..='9' => number.push(c),
            'h' | 'm' | 's' => {
                let unit = match c {
                    'h' => 3600,
                    'm' => 60,
                    _ => 1,
                };
                seconds += number.parse::<u64>().ok()? * unit;
                number.clear();
            }
            _ => return None,
        }
    }
    number.is_empty().then(|| Duration::from_secs(seconds))
}

/// The hub's real node (where kmm-hub runs).
fn hub_node(fleet: &Fleet) -> Result<&crate::fleet::nodes::RealNode> {
    fleet
        .state
        .cluster("hub")?
        .real_nodes
        .first()
        .context("the hub's real node")
}

fn agent<'a>(fleet: &'a Fleet, node: &str) -> Result<&'a fleet_kmm::Agent> {
    fleet
        .state
        .kmm
        .as_ref()
        .and_then(|k| k.agents.iter().find(|a| a.node == node))
        .with_context(|| format!("the agent of {node}"))
}

fn apiserver_port(state: &State, cluster: &str) -> Result<String> {
    let server = &state.cluster(cluster)?.server;
    server
        .rsplit(':')
        .next()
        .map(|p| p.trim_end_matches('/').to_owned())
        .with_context(|| format!("the port of {server}"))
}

/// SIGKILL to the `comm` processes of a Pod's containers (found on the host by the Pod's
/// cgroup, `.../pod<uid>/...`): the kubelet restarts the container.
fn kill_container(pod: &Pod, comm: &str) -> Result<()> {
    let uid = pod.metadata.uid.as_deref().context("the Pod's uid")?;
    let cgroup = format!("/pod{uid}/");
    let mut killed = 0;
    for entry in std::fs::read_dir("/proc")? {
        let Ok(pid) = entry?.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        let read = |file: &str| {
            std::fs::read_to_string(Path::new("/proc").join(pid.to_string()).join(file))
        };
        let ours = read("cgroup").is_ok_and(|c| c.contains(&cgroup))
            && read("comm").is_ok_and(|c| c.trim() == comm);
        if ours && kill(Pid::from_raw(pid), Signal::SIGKILL).is_ok() {
            killed += 1;
        }
    }
    ensure!(
        killed > 0,
        "no {comm} process of Pod {} found",
        pod.name_any()
    );
    Ok(())
}

/// Shortens the spoke's ManagedCluster lease, waits until its agent renews at that
/// period and stops the agent.
async fn stall_ocm_agent(
    fleet: &Fleet,
    settings: &Settings,
    spoke: &str,
    active: &mut Active,
) -> Result<()> {
    let lease = set_ocm_lease(&fleet.hub, spoke, SHORT_OCM_LEASE_SECONDS.into()).await?;
    active.undo.push(Undo::Lease(spoke.to_owned(), lease));
    let state = State::load(&settings.state_dir)?.context("the fleet's state")?;
    let name = format!("{spoke}/ocm-agent");
    let agent = state
        .processes
        .iter()
        .find(|p| p.name == name)
        .with_context(|| format!("process {name}"))?;
    wait_ocm_renewing_short(&fleet.hub, spoke, RECOVERY).await?;
    let pid = Pid::from_raw(agent.pid);
    kill(pid, Signal::SIGSTOP)?;
    active.undo.push(Undo::Continue(pid));
    Ok(())
}

fn tainted(cluster: &Value) -> bool {
    cluster["spec"]["taints"]
        .as_array()
        .into_iter()
        .flatten()
        .any(|t| t["key"] == UNREACHABLE_TAINT)
}

/// One step of undoing a fault.
enum Undo {
    Start(Settings, String),
    Iptables(String, Vec<String>),
    Continue(Pid),
    /// The spoke's ManagedCluster lease duration to put back.
    Lease(String, Value),
    /// The Pod a cut concerns (nothing to undo).
    Note(String),
}

/// An injected fault.
pub struct Active {
    pub fault: Fault,
    undo: Vec<Undo>,
    hub: Client,
}

impl std::fmt::Debug for Active {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Active")
            .field("fault", &self.fault)
            .finish_non_exhaustive()
    }
}

impl Active {
    /// Waits (within [`RECOVERY`]) until the fault did what it is for: OCM tainted the
    /// stalled cluster, the Lease left the cut leader. Other faults act at once.
    pub async fn took_effect(&self, fleet: &Fleet) -> Result<()> {
        match &self.fault {
            Fault::OcmStall(spoke) => {
                let clusters = managed_clusters(&fleet.hub);
                wait_until("OCM to taint the stalled cluster", RECOVERY, || async {
                    let cluster = clusters.get(spoke).await.map_err(|e| e.to_string())?;
                    tainted(&cluster.data)
                        .then_some(())
                        .ok_or_else(|| cluster.data["spec"]["taints"].to_string())
                })
                .await?;
            }
            Fault::LeaderCut => {
                let cut = self
                    .undo
                    .iter()
                    .find_map(|u| match u {
                        Undo::Note(pod) => Some(pod.clone()),
                        _ => None,
                    })
                    .context("the cut Pod")?;
                wait_until("the Lease to leave the cut leader", RECOVERY, || async {
                    let holder = hub_install::lease_holder(&fleet.hub)
                        .await
                        .map_err(|e| e.to_string())?;
                    (!holder.starts_with(&format!("{cut}_")))
                        .then_some(())
                        .ok_or(format!("held by {holder}"))
                })
                .await?;
            }
            _ => {}
        }
        Ok(())
    }

    /// Undoes the fault and waits until the part of the fleet it broke is back (the
    /// modules' convergence is the soak's to wait for).
    pub async fn restore(mut self, fleet: &Fleet) -> Result<()> {
        while let Some(step) = self.undo.pop() {
            undo_now(&step)?;
            if let Undo::Lease(spoke, lease) = &step {
                set_ocm_lease(&fleet.hub, spoke, lease.clone()).await?;
            }
        }
        self.fault.component_back(fleet).await?;
        match &self.fault {
            Fault::NetworkCut(spoke) => {
                fleet_kmm::wait_proxy_ready(fleet.spoke(spoke)?, RECOVERY).await?;
            }
            Fault::ApiserverDown(cluster) => {
                let client = if cluster == "hub" {
                    &fleet.hub
                } else {
                    fleet.spoke(cluster)?
                };
                wait_until("the apiserver to answer", RECOVERY, || async {
                    client
                        .apiserver_version()
                        .await
                        .map(drop)
                        .map_err(|e| e.to_string())
                })
                .await?;
            }
            Fault::OcmStall(spoke) => {
                let clusters = managed_clusters(&fleet.hub);
                wait_until("OCM to see the cluster again", RECOVERY, || async {
                    let cluster = clusters.get(spoke).await.map_err(|e| e.to_string())?;
                    (!tainted(&cluster.data))
                        .then_some(())
                        .ok_or_else(|| cluster.data["spec"]["taints"].to_string())
                })
                .await?;
            }
            Fault::HubLeaderKill
            | Fault::HubStandbyKill
            | Fault::LeaderCut
            | Fault::ProxyKill(_)
            | Fault::AgentKill(_)
            | Fault::RegistryDown => {}
        }
        Ok(())
    }
}

fn undo_now(step: &Undo) -> Result<()> {
    match step {
        Undo::Start(settings, name) => {
            start_process(settings, name, None)?;
        }
        Undo::Iptables(netns, rule) => iptables(netns, "-D", rule)?,
        Undo::Continue(pid) => kill(*pid, Signal::SIGCONT)?,
        Undo::Lease(..) | Undo::Note(_) => {}
    }
    Ok(())
}

impl Drop for Active {
    /// The soak failed with the fault on: undo what needs no API first, then put the
    /// lease back if the runtime allows blocking here.
    fn drop(&mut self) {
        for step in self.undo.iter().rev() {
            if let Err(e) = undo_now(step) {
                eprintln!("chaos: undoing {}: {e:#}", self.fault);
            }
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        if runtime.runtime_flavor() != tokio::runtime::RuntimeFlavor::MultiThread {
            return;
        }
        for step in &self.undo {
            if let Undo::Lease(spoke, lease) = step {
                let restored = tokio::task::block_in_place(|| {
                    runtime.block_on(set_ocm_lease(&self.hub, spoke, lease.clone()))
                });
                if let Err(e) = restored {
                    eprintln!("chaos: restoring the lease of {spoke}: {e:#}");
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_kubelets_back_off_is_read_from_its_message() {
        let message = |d: &str| format!("back-off {d} restarting failed container=kmm-hub pod=x");
        assert_eq!(back_off(&message("10s")), Some(Duration::from_secs(10)));
        assert_eq!(back_off(&message("2m40s")), Some(Duration::from_secs(160)));
        assert_eq!(back_off(&message("5m0s")), Some(Duration::from_secs(300)));
        assert!(back_off(&message("5m0s")).unwrap() >= LONG_BACK_OFF);
        assert!(back_off(&message("40s")).unwrap() < LONG_BACK_OFF);
        assert_eq!(back_off("container is waiting"), None);
        assert_eq!(back_off(&message("1.5s")), None);
    }
}
