//! The soak's judge: a task sampling, the whole time, the agents' own state (state files
//! and the simulated kernel's log), the spokes' Node labels and the hub replicas'
//! metrics, against the soak's record of what it asked for and when.
//!
//! - A wrong unload is a kmod removal on a node inside a *stable* spell: the spell opens
//!   when a sample taken [`GRACE`] after the node's last change finds the node's state
//!   file holding exactly the module and version the soak asked for, and closes the
//!   moment the soak starts its next change touching the node. Removals outside a spell
//!   are not judged (a change may still be on its way).
//! - A wrong label is a module's ready label on a node whose state file, read just
//!   before and just after the labels, holds the module at the labelled version neither
//!   time, in every sample for [`LABEL_LAG`] (the proxy changes labels on the agent's
//!   proof only, so a label outlives an unload by the time the proof takes to come back).
//! - Two leaders: both hub replicas report `kmm_hub_leader 1`, or both a connected
//!   cluster, with the first read again after the second (so the two reads overlap).
//! - Orphans and what did not converge: [`observe`], at each settle.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result};
use k8s_openapi::api::core::v1::{Node, Pod};
use kmm_api::ManagedClusterModule;
use kmm_api::labels::{ready_label, version_ready_label};
use kube::api::ListParams;
use kube::{Api, Client, ResourceExt};
use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::changes::{Model, NodeInfo, SPOKE_NAMESPACE};
use crate::fixture::Fleet;
use crate::fleet::kmm::{Agent, HUB_NAMESPACE, SPOKE_NAMESPACE as KMM_NAMESPACE};
use crate::fleet::{State, hub_install};

/// A sampling period, not a wait for anything.
const PERIOD: Duration = Duration::from_millis(300);
/// How long one metrics read may take.
const SCRAPE: Duration = Duration::from_secs(2);
const HUB_METRICS_PORT: u16 = 8080;
/// How long after a change a node's state is not yet taken as settled on it: a label
/// removed and set again 0.5 s later may still be acted on in order (an unload, then a
/// load), which is what was asked for.
const GRACE: Duration = Duration::from_secs(5);
/// How long a label may lag behind its agent before it counts as wrong.
const LABEL_LAG: Duration = Duration::from_secs(5);

fn now_ns() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos())
}

/// The chaos modules in an agent's state file: name -> version.
fn loaded(agent: &Agent) -> Option<BTreeMap<String, String>> {
    let bytes = std::fs::read(agent.state_file()).ok()?;
    let state: Value = serde_json::from_slice(&bytes).ok()?;
    let prefix = format!("{SPOKE_NAMESPACE}/");
    Some(
        state["modules"]
            .as_object()?
            .iter()
            .filter_map(|(key, record)| {
                let name = key.strip_prefix(&prefix)?;
                Some((
                    name.to_owned(),
                    record["version"].as_str().unwrap_or_default().to_owned(),
                ))
            })
            .collect(),
    )
}

struct Tracked {
    info: NodeInfo,
    agent: Agent,
    desired: Option<(String, String)>,
    /// Changes touching the node begun and not written yet.
    in_flight: usize,
    /// When the last of them was written (ns since the epoch).
    written_ns: u128,
    /// Stable spells: (from, until), ns since the epoch.
    stable: Vec<(u128, Option<u128>)>,
    log_offset: usize,
}

#[derive(Debug, Default, Clone)]
pub struct Counts {
    pub wrong_unloads: usize,
    pub wrong_labels: usize,
    pub two_leaders: usize,
    /// Peak resident memory seen, KiB, by component.
    pub peak_kib: BTreeMap<&'static str, u64>,
    pub samples: usize,
}

struct Shared {
    nodes: Vec<Tracked>,
    names: BTreeSet<String>,
    counts: Counts,
    /// (node, module) labelled without the module loaded, since when (ns), and whether
    /// it was counted.
    mislabelled: BTreeMap<(String, String), (u128, bool)>,
    two_leaders_now: bool,
}

/// The running judge.
pub struct Checker {
    shared: Arc<Mutex<Shared>>,
    stop: Arc<AtomicBool>,
    task: tokio::task::JoinHandle<()>,
}

impl std::fmt::Debug for Checker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Checker").finish_non_exhaustive()
    }
}

impl Checker {
    pub fn start(fleet: &Fleet, model: &Model) -> Result<Self> {
        let kmm = fleet
            .state
            .kmm
            .as_ref()
            .context("the fleet runs without kmm")?;
        let mut nodes = vec![];
        for info in &model.nodes {
            let agent = kmm
                .agents
                .iter()
                .find(|a| a.node == info.node)
                .with_context(|| format!("the agent of {}", info.node))?
                .clone();
            let log_offset = std::fs::metadata(agent.kernel_log()).map_or(0, |m| m.len() as usize);
            nodes.push(Tracked {
                info: info.clone(),
                desired: model.desired(info),
                agent,
                in_flight: 0,
                written_ns: now_ns(),
                stable: vec![],
                log_offset,
            });
        }
        let shared = Arc::new(Mutex::new(Shared {
            nodes,
            names: model.names.iter().cloned().collect(),
            counts: Counts::default(),
            mislabelled: BTreeMap::new(),
            two_leaders_now: false,
        }));
        let stop = Arc::new(AtomicBool::new(false));
        let task = tokio::spawn(sample_until(fleet.clone(), shared.clone(), stop.clone()));
        Ok(Self { shared, stop, task })
    }

    fn with<T>(&self, f: impl FnOnce(&mut Shared) -> T) -> T {
        let mut shared = self.shared.lock().unwrap_or_else(|e| e.into_inner());
        f(&mut shared)
    }

    /// A change touching `nodes` is about to be written: their stable spells end now.
    pub fn begin(&self, nodes: &[String]) {
        let now = now_ns();
        self.with(|s| {
            for tracked in s.nodes.iter_mut().filter(|t| nodes.contains(&t.info.node)) {
                tracked.in_flight += 1;
                if let Some((_, until @ None)) = tracked.stable.last_mut() {
                    *until = Some(now);
                }
            }
        });
    }

    /// The change is written: what the model now asks of each node.
    pub fn written(&self, nodes: &[String], model: &Model) {
        let now = now_ns();
        self.with(|s| {
            s.names.extend(model.names.iter().cloned());
            for tracked in s.nodes.iter_mut().filter(|t| nodes.contains(&t.info.node)) {
                tracked.in_flight = tracked.in_flight.saturating_sub(1);
                tracked.written_ns = now;
                tracked.desired = model.desired(&tracked.info);
            }
        });
    }

    pub fn counts(&self) -> Counts {
        self.with(|s| s.counts.clone())
    }

    pub async fn stop(self) -> Counts {
        self.stop.store(true, Ordering::Relaxed);
        let _ = self.task.await;
        let shared = self.shared.lock().unwrap_or_else(|e| e.into_inner());
        shared.counts.clone()
    }
}

async fn sample_until(fleet: Fleet, shared: Arc<Mutex<Shared>>, stop: Arc<AtomicBool>) {
    let mut every = tokio::time::interval(PERIOD);
    let mut hub_pods: Vec<(String, IpAddr)> = vec![];
    while !stop.load(Ordering::Relaxed) {
        every.tick().await;
        let agents: Vec<(Agent, String)> = {
            let s = shared.lock().unwrap_or_else(|e| e.into_inner());
            s.nodes
                .iter()
                .map(|t| (t.agent.clone(), t.info.cluster.clone()))
                .collect()
        };
        let taken_ns = now_ns();
        let before: Vec<_> = agents.iter().map(|(a, _)| loaded(a)).collect();
        let mut labels: BTreeMap<String, BTreeMap<String, String>> = BTreeMap::new();
        for spoke in fleet.spoke_names() {
            let Ok(client) = fleet.spoke(&spoke) else {
                continue;
            };
            // An apiserver down under a fault: its nodes' labels go unjudged meanwhile.
            let list = tokio::time::timeout(
                SCRAPE,
                Api::<Node>::all(client.clone()).list(&ListParams::default()),
            )
            .await;
            if let Ok(Ok(list)) = list {
                for node in list {
                    labels.insert(node.name_any(), node.labels().clone());
                }
            }
        }
        let after: Vec<_> = agents.iter().map(|(a, _)| loaded(a)).collect();
        let events: Vec<Vec<(u128, String)>> = {
            let mut s = shared.lock().unwrap_or_else(|e| e.into_inner());
            s.nodes.iter_mut().map(removals).collect()
        };
        let leaders = two_leaders(&fleet.hub, &mut hub_pods).await;
        let memory = memory(&fleet.state);
        let mut s = shared.lock().unwrap_or_else(|e| e.into_inner());
        s.counts.samples += 1;
        for (component, kib) in memory {
            let peak = s.counts.peak_kib.entry(component).or_default();
            *peak = (*peak).max(kib);
        }
        if let Some(figures) = &leaders
            && !s.two_leaders_now
        {
            s.counts.two_leaders += 1;
            println!("chaos: VIOLATION two hub replicas lead or serve streams at once: {figures}");
        }
        s.two_leaders_now = leaders.is_some();
        let names: Vec<String> = s.names.iter().cloned().collect();
        let mut mislabelled = BTreeMap::new();
        let Shared {
            nodes,
            counts,
            mislabelled: before_now,
            ..
        } = &mut *s;
        for (i, tracked) in nodes.iter_mut().enumerate() {
            let node = tracked.info.node.clone();
            if let Some(labels) = labels.get(&node) {
                for name in &names {
                    if !labels.contains_key(&ready_label(SPOKE_NAMESPACE, name)) {
                        continue;
                    }
                    let version = labels.get(&version_ready_label(SPOKE_NAMESPACE, name));
                    let holds = |state: &Option<BTreeMap<String, String>>| {
                        state.as_ref().is_none_or(|m| {
                            m.get(name).is_some_and(|v| version.is_none_or(|l| l == v))
                        })
                    };
                    if !holds(&before[i]) && !holds(&after[i]) {
                        let key = (node.clone(), name.clone());
                        let (since, counted) =
                            before_now.get(&key).copied().unwrap_or((taken_ns, false));
                        let stuck = taken_ns.saturating_sub(since) >= LABEL_LAG.as_nanos();
                        if stuck && !counted {
                            counts.wrong_labels += 1;
                            println!(
                                "chaos: VIOLATION wrong label: {node} has been labelled ready \
                                 for {name} at {version:?} for {:?} while its agent holds {:?}",
                                LABEL_LAG, after[i]
                            );
                        }
                        mislabelled.insert(key, (since, counted || stuck));
                    }
                }
            } else {
                // Labels not read (its apiserver away): the node's episodes go on.
                mislabelled.extend(
                    before_now
                        .iter()
                        .filter(|((n, _), _)| *n == node)
                        .map(|(k, v)| (k.clone(), *v)),
                );
            }
            for (at, kmod) in &events[i] {
                let inside = tracked
                    .stable
                    .iter()
                    .any(|(from, until)| from < at && until.is_none_or(|u| *at < u));
                if inside {
                    counts.wrong_unloads += 1;
                    println!(
                        "chaos: VIOLATION wrong unload: {node} removed {kmod} at {at} ns while \
                         it should hold {:?} and nothing about it changed",
                        tracked.desired
                    );
                }
            }
            let open = matches!(tracked.stable.last(), Some((_, None)));
            let wanted = tracked
                .desired
                .as_ref()
                .map(|(name, version)| BTreeMap::from([(name.clone(), version.clone())]));
            if !open
                && tracked.in_flight == 0
                && taken_ns > tracked.written_ns + GRACE.as_nanos()
                && wanted.is_some()
                && before[i] == wanted
                && after[i] == wanted
            {
                tracked.stable.push((now_ns(), None));
            }
        }
        s.mislabelled = mislabelled;
    }
}

/// The kmod removals logged by the node's simulated kernel since the last read.
fn removals(tracked: &mut Tracked) -> Vec<(u128, String)> {
    let Ok(log) = std::fs::read_to_string(tracked.agent.kernel_log()) else {
        return vec![];
    };
    // Only whole lines: the agent may be writing the last one.
    let end = log.rfind('\n').map_or(0, |i| i + 1);
    let fresh = log.get(tracked.log_offset..end).unwrap_or_default();
    tracked.log_offset = end.max(tracked.log_offset);
    fresh
        .lines()
        .filter_map(|line| {
            let mut words = line.split(' ');
            match (words.next(), words.next(), words.next()) {
                (Some(at), Some("remove"), Some(kmod)) => Some((at.parse().ok()?, kmod.to_owned())),
                _ => None,
            }
        })
        .collect()
}

/// Both hub replicas' figures when both lead, or both serve streams, at once. `pods`
/// keeps the replicas' addresses while the hub's apiserver is away.
async fn two_leaders(hub: &Client, pods: &mut Vec<(String, IpAddr)>) -> Option<String> {
    let api: Api<Pod> = Api::namespaced(hub.clone(), HUB_NAMESPACE);
    let listed = tokio::time::timeout(
        SCRAPE,
        api.list(&ListParams::default().labels(&format!(
            "app.kubernetes.io/name={}",
            hub_install::DEPLOYMENT
        ))),
    )
    .await;
    if let Ok(Ok(list)) = listed {
        *pods = list
            .items
            .iter()
            .filter_map(|p| {
                let ip = p.status.as_ref()?.pod_ip.as_ref()?.parse().ok()?;
                Some((p.name_any(), ip))
            })
            .collect();
    }
    let [(first, first_ip), (second, second_ip)] = pods.as_slice() else {
        return None;
    };
    let a = hub_figures(*first_ip).await?;
    let b = hub_figures(*second_ip).await?;
    let again = hub_figures(*first_ip).await?;
    let both = |f: fn(&(f64, f64)) -> bool| f(&a) && f(&b) && f(&again);
    (both(|m| m.0 >= 1.0) || both(|m| m.1 >= 1.0)).then(|| {
        format!(
            "{first}: leader {} connected {} (then {} {}); {second}: leader {} connected {}",
            a.0, a.1, again.0, again.1, b.0, b.1
        )
    })
}

/// `kmm_hub_leader` and `kmm_hub_connected_clusters` of one replica.
async fn hub_figures(ip: IpAddr) -> Option<(f64, f64)> {
    let text = tokio::time::timeout(SCRAPE, http_get(ip, HUB_METRICS_PORT, "/metrics"))
        .await
        .ok()??;
    let value = |name: &str| {
        text.lines()
            .find(|l| l.split_whitespace().next() == Some(name))
            .and_then(|l| l.split_whitespace().nth(1)?.parse::<f64>().ok())
    };
    Some((
        value("kmm_hub_leader")?,
        value("kmm_hub_connected_clusters")?,
    ))
}

/// A plain-HTTP GET of a Pod's metrics endpoint; `None` unless 200 OK.
async fn http_get(ip: IpAddr, port: u16, path: &str) -> Option<String> {
    let mut stream = tokio::net::TcpStream::connect((ip, port)).await.ok()?;
    let request = format!("GET {path} HTTP/1.0\r\nHost: {ip}\r\n\r\n");
    stream.write_all(request.as_bytes()).await.ok()?;
    let mut response = String::new();
    stream.read_to_string(&mut response).await.ok()?;
    let (head, body) = response.split_once("\r\n\r\n")?;
    (head.split_whitespace().nth(1) == Some("200")).then(|| body.to_owned())
}

/// The resident memory of kmm's processes now, KiB, the largest per component: those
/// in the real nodes' cgroups and the KWOK agents the runners start.
fn memory(state: &State) -> Vec<(&'static str, u64)> {
    let mut found = vec![];
    for node in state.real_nodes() {
        for pid in node.processes().unwrap_or_default() {
            let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
            let component = match comm.trim() {
                "kmm-hub" => "hub",
                "kmm-spoke-proxy" => "proxy",
                "kmm-node-agent" => "agent (real node)",
                _ => continue,
            };
            if let Some((rss, _)) = crate::process::memory_kib(pid) {
                found.push((component, rss));
            }
        }
    }
    for agent in state.kmm.iter().flat_map(|k| &k.agents) {
        if let Some(pid) = agent.runner_pid().and_then(|p| i32::try_from(p).ok())
            && let Some((rss, _)) = crate::process::memory_kib(pid)
        {
            found.push(("agent (KWOK)", rss));
        }
    }
    found
}

/// Container restarts of kmm's Pods (hub and spokes) and of the KWOK agents so far.
pub async fn restarts(fleet: &Fleet) -> Result<u64> {
    let mut total = 0;
    let mut count = |pods: Vec<Pod>| {
        total += pods
            .iter()
            .flat_map(|p| {
                p.status
                    .iter()
                    .flat_map(|s| s.container_statuses.iter().flatten())
            })
            .map(|c| u64::try_from(c.restart_count).unwrap_or_default())
            .sum::<u64>();
    };
    count(
        Api::<Pod>::namespaced(fleet.hub.clone(), HUB_NAMESPACE)
            .list(&ListParams::default())
            .await?
            .items,
    );
    for spoke in fleet.spoke_names() {
        count(
            Api::<Pod>::namespaced(fleet.spoke(&spoke)?.clone(), KMM_NAMESPACE)
                .list(&ListParams::default())
                .await?
                .items,
        );
    }
    // KWOK marks its Pods running whatever the runner does: the runner counts.
    for agent in fleet.state.kmm.iter().flat_map(|k| &k.agents) {
        let Some(status) = agent.root.parent().and_then(|p| p.parent()) else {
            continue;
        };
        let Ok(text) = std::fs::read_to_string(status.join("status.json")) else {
            continue;
        };
        let status: Value = serde_json::from_str(&text)?;
        total += status["containers"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|c| c["node"] == agent.node.as_str())
            .filter_map(|c| c["restarts"].as_u64())
            .sum::<u64>();
    }
    Ok(total)
}

/// What keeps the fleet from being settled on the model, by kind.
#[derive(Debug, Default)]
pub struct Observation {
    /// A module loaded where the soak does not ask for it (deleted, deselected, or
    /// narrowed away).
    pub orphans: Vec<String>,
    /// A module the soak asks for not loaded, or at another version.
    pub missing: Vec<String>,
    pub labels: Vec<String>,
    /// Deleted modules the hub has not let go.
    pub undeleted: Vec<String>,
}

impl Observation {
    pub fn settled(&self) -> bool {
        self.orphans.is_empty()
            && self.missing.is_empty()
            && self.labels.is_empty()
            && self.undeleted.is_empty()
    }
}

/// Compares the fleet with the model: agents' state files, Node labels, modules.
pub async fn observe(fleet: &Fleet, model: &Model) -> Result<Observation> {
    let kmm = fleet
        .state
        .kmm
        .as_ref()
        .context("the fleet runs without kmm")?;
    let mut seen = Observation::default();
    let mut labels: BTreeMap<String, BTreeMap<String, String>> = BTreeMap::new();
    for spoke in fleet.spoke_names() {
        for node in Api::<Node>::all(fleet.spoke(&spoke)?.clone())
            .list(&ListParams::default())
            .await?
        {
            labels.insert(node.name_any(), node.labels().clone());
        }
    }
    for info in &model.nodes {
        let agent = kmm
            .agents
            .iter()
            .find(|a| a.node == info.node)
            .with_context(|| format!("the agent of {}", info.node))?;
        let desired = model.desired(info);
        let held = loaded(agent).unwrap_or_default();
        for (name, version) in &held {
            match &desired {
                Some((n, v)) if n == name && v != version => seen
                    .missing
                    .push(format!("{}: {name} at {version}, not {v}", info.node)),
                Some((n, _)) if n == name => {}
                _ => seen
                    .orphans
                    .push(format!("{}: {name} {version}", info.node)),
            }
        }
        if let Some((name, version)) = &desired
            && !held.contains_key(name)
        {
            seen.missing
                .push(format!("{}: {name} {version} not loaded", info.node));
        }
        let node_labels = labels.get(&info.node).cloned().unwrap_or_default();
        for name in &model.names {
            let ready = node_labels.contains_key(&ready_label(SPOKE_NAMESPACE, name));
            let version = node_labels.get(&version_ready_label(SPOKE_NAMESPACE, name));
            let wanted = desired.as_ref().filter(|(n, _)| n == name).map(|(_, v)| v);
            if ready != wanted.is_some() || (ready && version != wanted) {
                seen.labels.push(format!(
                    "{}: {name} ready {ready} version {version:?}, wanted {wanted:?}",
                    info.node
                ));
            }
        }
    }
    let modules = Api::<ManagedClusterModule>::all(fleet.hub.clone());
    for (_, name) in &model.deleting {
        if modules.get_opt(name).await?.is_some() {
            seen.undeleted.push(name.clone());
        }
    }
    Ok(seen)
}
