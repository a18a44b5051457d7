//! Simulated spoke proxies: one tokio task per cluster, each a real `Hub.Sync` client
//! over its own TLS connection with its own client certificate, as OCM's add-on
//! registration would issue it.
//!
//! Each behaves as `kmm-spoke-proxy` does towards the hub, with node agents that load
//! and unload at once: hello (with the revision it last applied), the full kernel
//! inventory, a full node status report; then every intent snapshot is applied to its M
//! nodes (LOADED at the target's version, FAILED with the hub's reason for an unresolved
//! kernel, PENDING for a kernel the snapshot has no target for, UNLOADED on `unload`)
//! and answered with a delta report carrying the snapshot's revision (empty when nothing
//! changed). A stream that ends is reopened after the real proxy's jittered backoff.
//! Every unload is recorded per (cluster, node, module), so that a lost or repeated one
//! shows.

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicI64, AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use kmm_proto::limits::REPORT_PART;
use kmm_proto::report_parts;
use kmm_proto::v1::{
    HubMessage, IntentSnapshot, Kernel, KernelInventory, ModuleIntent, ModuleKey, ModuleNodeKey,
    ModuleNodeStatus, ModuleState, NodeStatusReport, ProxyHello, ProxyMessage, PullCredential,
    hub_client::HubClient, hub_message, kernel_target::Target, proxy_message,
};
use kmm_runtime::backoff::{Backoff, random_fraction};
use prost::Message as _;
use tokio::sync::{mpsc, watch};
use tokio::task::JoinSet;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::{Certificate, ClientTlsConfig, Endpoint, Identity};

use super::{Error, Result, Shape};

/// Distinct kernels in the fleet per kernel wave; each cluster runs
/// [`KERNELS_PER_CLUSTER`] of them.
pub const KERNELS_PER_WAVE: usize = 6;
pub const KERNELS_PER_CLUSTER: usize = 3;
/// The real proxy's defaults (`--reconnect-initial-ms`, `--reconnect-max-seconds`).
const RECONNECT_INITIAL: Duration = Duration::from_millis(500);
const RECONNECT_MAX: Duration = Duration::from_secs(30);
/// The real proxy's bounds on the TLS handshake and on the hub answering the stream.
const HANDSHAKE: Duration = Duration::from_secs(10);

/// Kernel `k` of wave `wave` (0 at the start, one more per upgrade).
pub fn kernel(wave: u32, k: usize) -> String {
    format!(
        "6.1.0-{}-amd64",
        100 + wave as usize * 10 + k % KERNELS_PER_WAVE
    )
}

/// The kernel of node `node` of cluster `cluster` in wave `wave`: each cluster runs
/// three neighbouring kernels of the wave, its nodes spread over them.
pub fn node_kernel(wave: u32, cluster: usize, node: usize) -> String {
    kernel(wave, cluster + node % KERNELS_PER_CLUSTER)
}

/// Every kernel the fleet of `shape` runs in wave `wave`.
pub fn fleet_kernels(shape: &Shape, wave: u32) -> BTreeSet<String> {
    (0..shape.clusters.min(KERNELS_PER_WAVE))
        .flat_map(|c| (0..shape.nodes_per_cluster).map(move |n| node_kernel(wave, c, n)))
        .collect()
}

pub fn node_name(node: usize) -> String {
    format!("node-{node:03}")
}

/// One cluster's identity towards the hub.
#[derive(Clone)]
pub struct ProxyIdentity {
    pub cluster: String,
    pub cert_pem: String,
    pub key_pem: String,
}

impl std::fmt::Debug for ProxyIdentity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProxyIdentity")
            .field("cluster", &self.cluster)
            .finish_non_exhaustive()
    }
}

/// (cluster, node, module name).
pub type LoadKey = (String, String, String);

/// What the simulated nodes did, for the unload audit.
#[derive(Debug, Default)]
pub struct Outcome {
    /// Unloads done, per (cluster, node, module).
    pub unloads: BTreeMap<LoadKey, u32>,
    /// Modules still loaded when the proxies stopped.
    pub loaded: BTreeSet<LoadKey>,
}

/// Counters shared by every simulated proxy.
#[derive(Debug, Default)]
struct Shared {
    /// Encoded size of every HubMessage received.
    bytes_received: AtomicU64,
    snapshots_received: AtomicU64,
    streams_open: AtomicI64,
    /// Modules in each cluster's latest snapshot.
    modules_listed: Vec<AtomicUsize>,
}

#[derive(Debug)]
enum Command {
    /// End the stream now, as a broken connection would; reconnect after the backoff.
    Drop,
    /// Reboot every node into the kernels of this wave.
    Kernels(u32),
}

/// The simulated proxies of a run.
#[derive(Debug)]
pub struct Proxies {
    commands: Vec<mpsc::UnboundedSender<Command>>,
    shared: Arc<Shared>,
    stop: watch::Sender<bool>,
    tasks: JoinSet<Outcome>,
}

impl Proxies {
    /// Starts one proxy per identity, connecting to the hub at `hub` (whose serving
    /// certificate `ca_pem` signs), each reporting `nodes` nodes on wave 0's kernels.
    pub fn start(
        hub: SocketAddr,
        ca_pem: &str,
        identities: Vec<ProxyIdentity>,
        nodes: usize,
    ) -> Result<Self> {
        let shared = Arc::new(Shared {
            modules_listed: (0..identities.len()).map(|_| AtomicUsize::new(0)).collect(),
            ..Shared::default()
        });
        let (stop, stopped) = watch::channel(false);
        let mut tasks = JoinSet::new();
        let mut commands = Vec::with_capacity(identities.len());
        for (index, identity) in identities.into_iter().enumerate() {
            let tls = ClientTlsConfig::new()
                .ca_certificate(Certificate::from_pem(ca_pem))
                .identity(Identity::from_pem(&identity.cert_pem, &identity.key_pem))
                .domain_name(hub.ip().to_string());
            let endpoint = Endpoint::from_shared(format!("https://{hub}"))
                .map_err(|e| Error::Invalid(format!("hub address {hub}: {e}")))?
                .tls_config(tls)?
                .connect_timeout(HANDSHAKE)
                .http2_keep_alive_interval(Duration::from_secs(30))
                .keep_alive_timeout(Duration::from_secs(20))
                .keep_alive_while_idle(true);
            let (tx, rx) = mpsc::unbounded_channel();
            commands.push(tx);
            let sim = ClusterSim::new(index, identity.cluster, nodes);
            tasks.spawn(run(sim, endpoint, rx, stopped.clone(), shared.clone()));
        }
        Ok(Self {
            commands,
            shared,
            stop,
            tasks,
        })
    }

    pub fn len(&self) -> usize {
        self.commands.len()
    }

    pub fn is_empty(&self) -> bool {
        self.commands.is_empty()
    }

    /// Breaks the streams of these clusters (indices) at once.
    pub fn drop_streams(&self, clusters: impl IntoIterator<Item = usize>) {
        for index in clusters {
            let _ = self.commands[index].send(Command::Drop);
        }
    }

    /// Every cluster reboots its nodes into the kernels of `wave`.
    pub fn upgrade_kernels(&self, wave: u32) {
        for tx in &self.commands {
            let _ = tx.send(Command::Kernels(wave));
        }
    }

    /// Encoded bytes of every HubMessage received so far.
    pub fn bytes_received(&self) -> u64 {
        self.shared.bytes_received.load(Ordering::Relaxed)
    }

    pub fn snapshots_received(&self) -> u64 {
        self.shared.snapshots_received.load(Ordering::Relaxed)
    }

    /// Streams open now, as the proxies see them.
    pub fn streams_open(&self) -> i64 {
        self.shared.streams_open.load(Ordering::Relaxed)
    }

    /// Clusters whose latest snapshot still lists some module.
    pub fn clusters_with_modules(&self) -> usize {
        self.shared
            .modules_listed
            .iter()
            .filter(|n| n.load(Ordering::Relaxed) > 0)
            .count()
    }

    /// Stops every proxy (their streams end) and returns what their nodes did.
    pub async fn stop(mut self) -> Result<Outcome> {
        let _ = self.stop.send(true);
        let mut outcome = Outcome::default();
        while let Some(done) = self.tasks.join_next().await {
            let one = done.map_err(|e| Error::Invalid(format!("a simulated proxy failed: {e}")))?;
            outcome.unloads.extend(one.unloads);
            outcome.loaded.extend(one.loaded);
        }
        Ok(outcome)
    }
}

#[derive(Debug)]
struct SimNode {
    name: String,
    kernel: String,
    labels: BTreeMap<String, String>,
}

/// (module namespace, module name, node).
type StatusKey = (String, String, String);
/// (module namespace, module name).
type ModuleId = (String, String);

/// One cluster's proxy and nodes; owned by its task.
#[derive(Debug)]
struct ClusterSim {
    index: usize,
    name: String,
    nodes: Vec<SimNode>,
    inventory_revision: u64,
    /// Revision of the last snapshot applied: sent in hello, carried by every report.
    applied: u64,
    intents: Vec<ModuleIntent>,
    /// The applied snapshot's credentials: with the intents, what its digest is of.
    credentials: Vec<PullCredential>,
    /// Statuses as last reported to the hub, per module then node.
    sent: BTreeMap<ModuleId, BTreeMap<String, ModuleNodeStatus>>,
    /// Version loaded per (module, node), as the node agents would have it.
    loaded: BTreeMap<StatusKey, String>,
    unloads: BTreeMap<StatusKey, u32>,
    /// Modules whose statuses may differ from those last reported: their intent changed
    /// or left, or the nodes rebooted. Only these are acted on and reported again, so
    /// that a snapshot changing one module of twenty costs the harness one module's work
    /// (the harness must not be what limits the hub's figures).
    dirty: BTreeSet<ModuleId>,
}

impl ClusterSim {
    fn new(index: usize, name: String, nodes: usize) -> Self {
        let nodes = (0..nodes)
            .map(|n| SimNode {
                name: node_name(n),
                kernel: node_kernel(0, index, n),
                labels: BTreeMap::from([
                    (
                        super::modules::NODE_SELECTOR.0.to_owned(),
                        super::modules::NODE_SELECTOR.1.to_owned(),
                    ),
                    ("kubernetes.io/hostname".to_owned(), node_name(n)),
                ]),
            })
            .collect();
        Self {
            index,
            name,
            nodes,
            inventory_revision: 1,
            applied: 0,
            intents: Vec::new(),
            credentials: Vec::new(),
            sent: BTreeMap::new(),
            loaded: BTreeMap::new(),
            unloads: BTreeMap::new(),
            dirty: BTreeSet::new(),
        }
    }

    fn inventory(&self) -> KernelInventory {
        let releases: BTreeSet<&str> = self.nodes.iter().map(|n| n.kernel.as_str()).collect();
        KernelInventory {
            revision: self.inventory_revision,
            kernels: releases
                .into_iter()
                .map(|release| Kernel {
                    release: release.to_owned(),
                })
                .collect(),
        }
    }

    /// What the hello names as held, as a real proxy does: empty before any snapshot.
    fn held_digest(&self) -> Vec<u8> {
        if self.applied == 0 {
            return Vec::new();
        }
        kmm_proto::snapshot_digest(&self.intents, &self.credentials).to_vec()
    }

    /// Applies a snapshot (a delta onto the one before, as a real proxy does): loads and
    /// unloads as the intents that changed say.
    fn apply(&mut self, snapshot: IntentSnapshot) {
        let previous = IntentSnapshot {
            revision: self.applied,
            modules: std::mem::take(&mut self.intents),
            ..IntentSnapshot::default()
        };
        let snapshot = kmm_proto::apply_snapshot(Some(&previous), snapshot);
        self.applied = snapshot.revision;
        self.intents = snapshot.modules;
        self.credentials = snapshot.credentials;
        let mut before: BTreeMap<ModuleId, &ModuleIntent> = previous
            .modules
            .iter()
            .filter_map(|intent| Some((module_id(intent.key.as_ref()?), intent)))
            .collect();
        for intent in &self.intents {
            let Some(id) = intent.key.as_ref().map(module_id) else {
                continue;
            };
            if before.remove(&id) != Some(intent) {
                Self::reconcile(&self.nodes, &mut self.loaded, &mut self.unloads, intent);
                self.dirty.insert(id);
            }
        }
        // What is left was removed. A module absent from the snapshot is forgotten, never
        // unloaded: what stays loaded of it shows in the audit as a lost unload.
        self.dirty.extend(before.into_keys());
    }

    /// The node agents act on one module's intent.
    fn reconcile(
        nodes: &[SimNode],
        loaded: &mut BTreeMap<StatusKey, String>,
        unloads: &mut BTreeMap<StatusKey, u32>,
        intent: &ModuleIntent,
    ) {
        let Some(module) = &intent.key else { return };
        for node in nodes.iter().filter(|n| selects(intent, n)) {
            let key = status_key(module, node);
            if intent.unload {
                if loaded.remove(&key).is_some() {
                    *unloads.entry(key).or_default() += 1;
                }
                continue;
            }
            let target = intent
                .kernels
                .iter()
                .find(|t| t.kernel == node.kernel)
                .and_then(|t| t.target.as_ref());
            if let Some(Target::Load(load)) = target {
                // A new version replaces the old: a reload, not an unload.
                loaded.insert(key, load.version.clone());
            }
        }
    }

    /// Every node reboots into the kernels of `wave`: nothing is loaded after a reboot,
    /// then the agents load what the intents they have target the new kernels with.
    fn reboot(&mut self, wave: u32) {
        for (n, node) in self.nodes.iter_mut().enumerate() {
            node.kernel = node_kernel(wave, self.index, n);
        }
        self.loaded.clear();
        self.inventory_revision += 1;
        for intent in &self.intents {
            Self::reconcile(&self.nodes, &mut self.loaded, &mut self.unloads, intent);
            if let Some(key) = &intent.key {
                self.dirty.insert(module_id(key));
            }
        }
    }

    /// The current status of every node the module's intent concerns.
    fn statuses(&self, intent: &ModuleIntent) -> BTreeMap<String, ModuleNodeStatus> {
        let mut statuses = BTreeMap::new();
        let Some(module) = &intent.key else {
            return statuses;
        };
        for node in self.nodes.iter().filter(|n| selects(intent, n)) {
            let loaded = self.loaded.get(&status_key(module, node));
            let (state, version, reason, message) = if intent.unload {
                (ModuleState::Unloaded, None, "", String::new())
            } else {
                match intent
                    .kernels
                    .iter()
                    .find(|t| t.kernel == node.kernel)
                    .and_then(|t| t.target.as_ref())
                {
                    Some(Target::Load(_)) => (ModuleState::Loaded, loaded, "", String::new()),
                    Some(Target::Unresolved(u)) => (
                        ModuleState::Failed,
                        None,
                        u.reason.as_str(),
                        u.message.clone(),
                    ),
                    // This stand-in resolves no image for the hub: it waits, as a
                    // proxy does until the hub pins what it resolved.
                    Some(Target::Resolve(_)) | None => (
                        ModuleState::Pending,
                        None,
                        "",
                        format!("no image resolved yet for kernel {:?}", node.kernel),
                    ),
                }
            };
            let status = ModuleNodeStatus {
                key: Some(ModuleNodeKey {
                    module: Some(module.clone()),
                    node: node.name.clone(),
                }),
                kernel: node.kernel.clone(),
                state: state.into(),
                loaded_version: version.cloned().unwrap_or_default(),
                message,
                reason: reason.to_owned(),
            };
            statuses.insert(node.name.clone(), status);
        }
        statuses
    }

    fn full_report(&mut self) -> NodeStatusReport {
        self.sent = self
            .intents
            .iter()
            .filter_map(|intent| Some((module_id(intent.key.as_ref()?), self.statuses(intent))))
            .collect();
        self.dirty.clear();
        NodeStatusReport {
            full: true,
            statuses: self
                .sent
                .values()
                .flat_map(|s| s.values().cloned())
                .collect(),
            removed: Vec::new(),
            intent_revision: self.applied,
            continued: false,
        }
    }

    /// What changed since the last report, made with the applied revision.
    fn delta_report(&mut self) -> NodeStatusReport {
        let mut statuses = Vec::new();
        let mut removed = Vec::new();
        for id in std::mem::take(&mut self.dirty) {
            let now = self
                .intents
                .iter()
                .find(|intent| intent.key.as_ref().is_some_and(|key| module_id(key) == id))
                .map(|intent| self.statuses(intent))
                .unwrap_or_default();
            let before = self.sent.remove(&id).unwrap_or_default();
            statuses.extend(
                now.iter()
                    .filter(|(node, status)| before.get(*node) != Some(*status))
                    .map(|(_, status)| status.clone()),
            );
            removed.extend(
                before
                    .keys()
                    .filter(|node| !now.contains_key(*node))
                    .map(|node| ModuleNodeKey {
                        module: Some(ModuleKey {
                            namespace: id.0.clone(),
                            name: id.1.clone(),
                        }),
                        node: node.clone(),
                    }),
            );
            if !now.is_empty() {
                self.sent.insert(id, now);
            }
        }
        NodeStatusReport {
            full: false,
            statuses,
            removed,
            intent_revision: self.applied,
            continued: false,
        }
    }

    fn outcome(self) -> Outcome {
        let cluster = &self.name;
        let key = |(_, module, node): StatusKey| (cluster.clone(), node, module);
        Outcome {
            unloads: self.unloads.into_iter().map(|(k, n)| (key(k), n)).collect(),
            loaded: self.loaded.into_keys().map(key).collect(),
        }
    }
}

fn module_id(key: &ModuleKey) -> ModuleId {
    (key.namespace.clone(), key.name.clone())
}

fn status_key(module: &ModuleKey, node: &SimNode) -> StatusKey {
    (
        module.namespace.clone(),
        module.name.clone(),
        node.name.clone(),
    )
}

/// Whether the intent's node selector selects the node (the simulated nodes have no
/// taints, so tolerations do not matter).
fn selects(intent: &ModuleIntent, node: &SimNode) -> bool {
    intent
        .node_selector
        .iter()
        .all(|(k, v)| node.labels.get(k) == Some(v))
}

/// The encoded size of the HubMessage that carried `snapshot` (field 1, length-delimited).
fn hub_message_len(snapshot: &IntentSnapshot) -> u64 {
    let len = snapshot.encoded_len();
    (1 + prost::length_delimiter_len(len) + len) as u64
}

fn message(message: proxy_message::Message) -> ProxyMessage {
    ProxyMessage {
        message: Some(message),
    }
}

enum SessionEnd {
    Stopped,
    /// Dropped on command, or ended by the hub, or never opened.
    Ended,
}

async fn run(
    mut sim: ClusterSim,
    endpoint: Endpoint,
    mut commands: mpsc::UnboundedReceiver<Command>,
    mut stop: watch::Receiver<bool>,
    shared: Arc<Shared>,
) -> Outcome {
    let mut backoff = Backoff::new(RECONNECT_INITIAL, RECONNECT_MAX);
    loop {
        if let SessionEnd::Stopped = session(
            &mut sim,
            &endpoint,
            &mut commands,
            &mut stop,
            &shared,
            &mut backoff,
        )
        .await
        {
            break;
        }
        let pause = tokio::time::sleep(backoff.next_delay(random_fraction()));
        tokio::pin!(pause);
        loop {
            tokio::select! {
                () = &mut pause => break,
                _ = stop.changed() => return sim.outcome(),
                command = commands.recv() => match command {
                    // Nodes reboot whether or not the hub is reachable.
                    Some(Command::Kernels(wave)) => sim.reboot(wave),
                    Some(Command::Drop) => {}
                    None => return sim.outcome(),
                },
            }
        }
    }
    sim.outcome()
}

async fn session(
    sim: &mut ClusterSim,
    endpoint: &Endpoint,
    commands: &mut mpsc::UnboundedReceiver<Command>,
    stop: &mut watch::Receiver<bool>,
    shared: &Shared,
    backoff: &mut Backoff,
) -> SessionEnd {
    let channel = tokio::select! {
        _ = stop.changed() => return SessionEnd::Stopped,
        connected = endpoint.connect() => match connected {
            Ok(channel) => channel,
            Err(_) => return SessionEnd::Ended,
        },
    };
    let mut first = vec![
        proxy_message::Message::Hello(ProxyHello {
            proxy_version: "fleet-scale-sim".into(),
            applied_intent_revision: sim.applied,
            applied_intent_digest: sim.held_digest(),
        }),
        proxy_message::Message::Inventory(sim.inventory()),
    ];
    first.extend(
        report_parts(sim.full_report(), REPORT_PART)
            .into_iter()
            .map(proxy_message::Message::Status),
    );
    let (tx, rx) = mpsc::channel(first.len() + 16);
    for m in first {
        // A fresh channel larger than these messages: cannot block or fail.
        let _ = tx.send(message(m)).await;
    }
    let mut client = HubClient::new(channel)
        .max_encoding_message_size(kmm_proto::limits::PROXY_MESSAGE)
        .max_decoding_message_size(kmm_proto::limits::HUB_MESSAGE);
    let mut inbound = tokio::select! {
        _ = stop.changed() => return SessionEnd::Stopped,
        response = tokio::time::timeout(HANDSHAKE, client.sync(ReceiverStream::new(rx))) => {
            match response {
                Ok(Ok(response)) => response.into_inner(),
                _ => return SessionEnd::Ended,
            }
        }
    };
    backoff.reset();
    shared.streams_open.fetch_add(1, Ordering::Relaxed);
    let end = loop {
        let (report, inventory) = tokio::select! {
            _ = stop.changed() => break SessionEnd::Stopped,
            received = inbound.message() => match received {
                Ok(Some(HubMessage { message: Some(hub_message::Message::Intents(snapshot)) })) => {
                    shared.bytes_received.fetch_add(hub_message_len(&snapshot), Ordering::Relaxed);
                    shared.snapshots_received.fetch_add(1, Ordering::Relaxed);
                    sim.apply(snapshot);
                    shared.modules_listed[sim.index].store(sim.intents.len(), Ordering::Relaxed);
                    (sim.delta_report(), None)
                }
                Ok(Some(_)) => continue,
                Ok(None) | Err(_) => break SessionEnd::Ended,
            },
            command = commands.recv() => match command {
                Some(Command::Drop) => break SessionEnd::Ended,
                // The nodes' statuses change as they go down, before the inventory: the
                // hub knows they are no longer loaded by the time it sees new kernels.
                Some(Command::Kernels(wave)) => {
                    sim.reboot(wave);
                    (sim.delta_report(), Some(sim.inventory()))
                }
                None => break SessionEnd::Stopped,
            },
        };
        let mut outgoing: Vec<_> = report_parts(report, REPORT_PART)
            .into_iter()
            .map(proxy_message::Message::Status)
            .collect();
        outgoing.extend(inventory.map(proxy_message::Message::Inventory));
        let mut sent = true;
        for m in outgoing {
            sent = sent && tx.send(message(m)).await.is_ok();
        }
        if !sent {
            break SessionEnd::Ended;
        }
    };
    shared.streams_open.fetch_sub(1, Ordering::Relaxed);
    end
}

#[cfg(test)]
mod tests {
    use kmm_proto::v1::{KernelTarget, ModuleLoad, Unresolved};

    use super::*;

    fn intent(name: &str, unload: bool, kernels: Vec<KernelTarget>) -> ModuleIntent {
        ModuleIntent {
            key: Some(ModuleKey {
                namespace: "ns".into(),
                name: name.into(),
            }),
            generation: 1,
            pin_generation: 0,
            node_selector: [("kubernetes.io/os".to_owned(), "linux".to_owned())].into(),
            tolerations: vec![],
            kernels,
            unload,
            max_unavailable: None,
            device_plugin: None,
            device_plugin_only: false,
        }
    }

    fn load(kernel: &str, version: &str) -> KernelTarget {
        KernelTarget {
            kernel: kernel.into(),
            target: Some(Target::Load(ModuleLoad {
                version: version.into(),
                ..ModuleLoad::default()
            })),
        }
    }

    fn states(report: &NodeStatusReport) -> Vec<(String, i32, String)> {
        report
            .statuses
            .iter()
            .map(|s| {
                (
                    s.key.as_ref().unwrap().node.clone(),
                    s.state,
                    s.loaded_version.clone(),
                )
            })
            .collect()
    }

    #[test]
    fn loads_fails_and_waits_per_kernel_and_answers_every_snapshot() {
        // Cluster 0, 3 nodes: kernels 100, 101, 102.
        let mut sim = ClusterSim::new(0, "c".into(), 3);
        assert_eq!(sim.inventory().kernels.len(), 3);
        assert!(sim.full_report().statuses.is_empty());
        let unresolved = KernelTarget {
            kernel: kernel(0, 1),
            target: Some(Target::Unresolved(Unresolved {
                reason: "ImageNotFound".into(),
                message: "no image".into(),
            })),
        };
        sim.apply(IntentSnapshot {
            revision: 7,
            modules: vec![intent(
                "m",
                false,
                vec![load(&kernel(0, 0), "1"), unresolved],
            )],
            credentials: vec![],
            ..IntentSnapshot::default()
        });
        let report = sim.delta_report();
        assert_eq!(report.intent_revision, 7);
        let loaded = ModuleState::Loaded as i32;
        assert_eq!(
            states(&report),
            vec![
                ("node-000".into(), loaded, "1".into()),
                ("node-001".into(), ModuleState::Failed as i32, String::new()),
                (
                    "node-002".into(),
                    ModuleState::Pending as i32,
                    String::new()
                ),
            ]
        );
        // The same intents again: an empty answer with the new revision.
        sim.apply(IntentSnapshot {
            revision: 8,
            modules: sim.intents.clone(),
            credentials: vec![],
            ..IntentSnapshot::default()
        });
        let again = sim.delta_report();
        assert_eq!(again.intent_revision, 8);
        assert!(again.statuses.is_empty() && again.removed.is_empty());
    }

    #[test]
    fn records_each_unload_once_and_forgets_without_unloading() {
        let mut sim = ClusterSim::new(0, "c".into(), 2);
        let all = vec![load(&kernel(0, 0), "1"), load(&kernel(0, 1), "1")];
        let snapshot = |revision, unload| IntentSnapshot {
            revision,
            modules: vec![intent("m", unload, all.clone())],
            credentials: vec![],
            ..IntentSnapshot::default()
        };
        sim.apply(snapshot(1, false));
        sim.delta_report();
        sim.apply(snapshot(2, true));
        let report = sim.delta_report();
        assert!(
            report
                .statuses
                .iter()
                .all(|s| s.state == ModuleState::Unloaded as i32)
        );
        // Repeated unload intents unload nothing more.
        sim.apply(snapshot(3, true));
        sim.apply(IntentSnapshot {
            revision: 4,
            modules: vec![],
            credentials: vec![],
            ..IntentSnapshot::default()
        });
        let forgotten = sim.delta_report();
        assert_eq!(forgotten.removed.len(), 2);
        let outcome = sim.outcome();
        assert!(outcome.loaded.is_empty());
        assert_eq!(outcome.unloads.len(), 2);
        assert!(outcome.unloads.values().all(|n| *n == 1));
    }

    #[test]
    fn a_snapshot_changing_one_module_reports_that_module_alone() {
        let mut sim = ClusterSim::new(0, "c".into(), 2);
        let targets =
            |version: &str| vec![load(&kernel(0, 0), version), load(&kernel(0, 1), version)];
        let snapshot = |revision, b_version: &str| IntentSnapshot {
            revision,
            modules: vec![
                intent("a", false, targets("1")),
                intent("b", false, targets(b_version)),
            ],
            ..IntentSnapshot::default()
        };
        sim.apply(snapshot(1, "1"));
        assert_eq!(sim.delta_report().statuses.len(), 4);
        sim.apply(snapshot(2, "2"));
        let report = sim.delta_report();
        let reported: Vec<(String, String, String)> = report
            .statuses
            .iter()
            .map(|s| {
                let key = s.key.as_ref().unwrap();
                let module = key.module.as_ref().unwrap().name.clone();
                (module, key.node.clone(), s.loaded_version.clone())
            })
            .collect();
        assert_eq!(
            reported,
            [
                ("b".into(), "node-000".into(), "2".into()),
                ("b".into(), "node-001".into(), "2".into()),
            ]
        );
        assert_eq!(report.intent_revision, 2);
    }

    #[test]
    fn counts_the_bytes_of_the_hub_message() {
        let snapshot = IntentSnapshot {
            revision: 3,
            modules: vec![intent("m", false, vec![load(&kernel(0, 0), "1")])],
            credentials: vec![],
            ..IntentSnapshot::default()
        };
        let wrapped = HubMessage {
            message: Some(hub_message::Message::Intents(snapshot.clone())),
        };
        assert_eq!(hub_message_len(&snapshot), wrapped.encoded_len() as u64);
    }

    #[test]
    fn a_reboot_into_new_kernels_reports_them_pending() {
        let mut sim = ClusterSim::new(1, "c".into(), 2);
        let targets = (0..KERNELS_PER_WAVE)
            .map(|k| load(&kernel(0, k), "1"))
            .collect();
        sim.apply(IntentSnapshot {
            revision: 1,
            modules: vec![intent("m", false, targets)],
            credentials: vec![],
            ..IntentSnapshot::default()
        });
        sim.delta_report();
        sim.reboot(1);
        assert_eq!(sim.inventory().revision, 2);
        assert!(
            sim.inventory()
                .kernels
                .iter()
                .all(|k| k.release.starts_with("6.1.0-11"))
        );
        let report = sim.delta_report();
        assert_eq!(report.intent_revision, 1);
        assert!(
            report
                .statuses
                .iter()
                .all(|s| s.state == ModuleState::Pending as i32)
        );
        assert!(sim.outcome().unloads.is_empty());
    }
}
