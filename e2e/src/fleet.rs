//! Starting, inspecting and stopping the local fleet.
//!
//! Everything runs as processes on 127.0.0.1: one etcd (each cluster under its own key
//! prefix), a hub control plane with the OCM hub controllers, `N` spoke control planes
//! each with KWOK and the OCM klusterlet agent, and an OCI registry. Every cluster also
//! gets real nodes (containerd, kubelet, kube-proxy), each in its own network and mount
//! namespace on the fleet's bridge ([`network`], [`nodes`]). The state directory holds
//! certificates, kubeconfigs, logs and `state.json` (PIDs, ports, nodes).

use std::net::{IpAddr, Ipv4Addr};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use base64::Engine as _;
use k8s_openapi::api::authentication::v1::{TokenRequest, TokenRequestSpec};
use k8s_openapi::api::core::v1::{Namespace, Node, ServiceAccount};
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{ApiResource, DynamicObject, GroupVersionKind, Patch, PatchParams, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Api, Client};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::pki::{self, Ca};
use crate::process::{self, Confinement, Tracked, spawn};
use crate::toolchain::{BIN_DIR_ENV, Toolchain};
use crate::versions::Versions;
use crate::{Error, IoContext, Result, cache_dir, kmod};

pub mod hub_install;
pub mod kmm;
pub mod network;
pub mod nodes;

use network::{MAX_REAL_NODES, Network, SERVICE_CIDR};
use nodes::images::NodeImages;
use nodes::{NODE_TYPE_LABEL, RealNode};

/// Field manager for everything the environment applies.
const MANAGER: &str = "kmm-fleet-env";
/// Namespaces the OCM hub controllers and the klusterlet agent expect.
const HUB_NAMESPACES: &[&str] = &["open-cluster-management", "open-cluster-management-hub"];
const SPOKE_NAMESPACES: &[&str] = &[
    "open-cluster-management-agent",
    "open-cluster-management-agent-addon",
];
/// The add-on CRDs the OCM addon manager serves in two versions through its conversion webhook.
const CONVERTED_CRDS: &[&str] = &[
    "clustermanagementaddons.addon.open-cluster-management.io",
    "managedclusteraddons.addon.open-cluster-management.io",
];
/// CRDs the klusterlet agent needs on a managed cluster.
const SPOKE_CRDS: &[&str] = &[
    "clusterclaims.cluster.open-cluster-management.io",
    "appliedmanifestworks.work.open-cluster-management.io",
];
/// ManagedCluster label naming its ManagedClusterSet.
pub const CLUSTER_SET_LABEL: &str = "cluster.open-cluster-management.io/clusterset";
/// Annotation by which KWOK recognises the nodes it simulates.
pub const KWOK_NODE_ANNOTATION: &str = "kwok.x-k8s.io/node";
/// Node label carrying the simulated kernel (the real one is in `status.nodeInfo`).
pub const KERNEL_LABEL: &str = "kmm-fleet.dev/kernel";

const STARTUP: Duration = Duration::from_secs(120);
const POLL: Duration = Duration::from_millis(250);

/// How big a fleet `up` starts.
#[derive(Debug, Clone)]
pub struct Options {
    pub spokes: usize,
    /// KWOK (simulated) nodes per spoke.
    pub nodes_per_spoke: usize,
    /// Real nodes (containerd + kubelet + kube-proxy) per cluster, hub included; at most
    /// [`MAX_REAL_NODES`] in the whole fleet.
    pub real_nodes_per_cluster: usize,
    /// Run Open Cluster Management (hub controllers, klusterlet agents, acceptance).
    /// Without it, spokes are bare clusters and kmm-fleet cannot run; only one fleet
    /// with OCM fits on a host (its webhook-server binds :8000).
    pub ocm: bool,
    /// Also start kmm-fleet's own components (hub, proxies, node agents).
    pub kmm: bool,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            spokes: 2,
            nodes_per_spoke: 3,
            real_nodes_per_cluster: 1,
            ocm: true,
            kmm: true,
        }
    }
}

/// What `up` started, persisted as `state.json` in the state directory.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct State {
    pub clusters: Vec<Cluster>,
    /// `host:port` of the OCI registry, on loopback.
    pub registry: String,
    /// The same registry as pods and containerd on the real nodes reach it, at the
    /// bridge address (`198.18.F.1:<port>`): images pods pull are named with it.
    #[serde(default)]
    pub node_registry: String,
    /// The real nodes' bridge, addresses and names.
    #[serde(default)]
    pub network: Option<Network>,
    /// Images pushed for the real nodes (sandbox, busybox), named by `node_registry`.
    #[serde(default)]
    pub node_images: Option<NodeImages>,
    /// Sample images pushed to the registry, by kernel.
    pub images: Vec<kmod::SampleImage>,
    pub processes: Vec<Tracked>,
    /// kmm-fleet's components, unless started with `--no-kmm`.
    #[serde(default)]
    pub kmm: Option<kmm::Kmm>,
}

/// One cluster of the fleet.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Cluster {
    /// `hub`, `spoke1`, `spoke2`, ...
    pub name: String,
    pub kubeconfig: PathBuf,
    pub server: String,
    /// Simulated nodes and their kernels (empty on the hub).
    pub nodes: Vec<SimulatedNode>,
    /// Real nodes (`<cluster>-real1`, ...), labelled `kmm-fleet.dev/node-type=real`.
    #[serde(default)]
    pub real_nodes: Vec<RealNode>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SimulatedNode {
    pub name: String,
    pub kernel: String,
}

impl State {
    pub fn cluster(&self, name: &str) -> Result<&Cluster> {
        self.clusters
            .iter()
            .find(|c| c.name == name)
            .ok_or_else(|| Error::Invalid(format!("no cluster {name} in the running fleet")))
    }

    pub fn spokes(&self) -> impl Iterator<Item = &Cluster> {
        self.clusters.iter().filter(|c| c.name != "hub")
    }

    /// Every real node of every cluster.
    pub fn real_nodes(&self) -> impl Iterator<Item = &RealNode> {
        self.clusters.iter().flat_map(|c| &c.real_nodes)
    }

    pub fn load(dir: &Path) -> Result<Option<Self>> {
        let path = dir.join("state.json");
        match std::fs::read(&path) {
            Ok(bytes) => serde_json::from_slice(&bytes)
                .map(Some)
                .map_err(|e| Error::Invalid(format!("{}: {e}", path.display()))),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(Error::Io {
                context: format!("reading {}", path.display()),
                source: e,
            }),
        }
    }

    fn save(&self, dir: &Path) -> Result<()> {
        let path = dir.join("state.json");
        let text = serde_json::to_vec_pretty(self).map_err(|e| Error::Invalid(e.to_string()))?;
        std::fs::write(&path, text).context(|| format!("writing {}", path.display()))
    }
}

/// Where a fleet lives: its state directory, its ports, and the binaries it runs.
#[derive(Debug, Clone)]
pub struct Settings {
    /// Certificates, kubeconfigs, logs and `state.json`.
    pub state_dir: PathBuf,
    /// Every port is `base_port` plus a fixed offset (see README).
    pub base_port: u16,
    /// Prebuilt upstream binaries instead of the built, cached toolchain.
    pub bin_dir: Option<PathBuf>,
}

impl Settings {
    /// `$KMM_FLEET_STATE_DIR` (default `<cache>/env`), `$KMM_FLEET_BASE_PORT` (default
    /// 16000) and `$KMM_FLEET_BIN_DIR`.
    pub fn from_env() -> Result<Self> {
        let base_port = match std::env::var("KMM_FLEET_BASE_PORT") {
            Ok(v) => v
                .parse()
                .map_err(|e| Error::Invalid(format!("KMM_FLEET_BASE_PORT={v}: {e}")))?,
            Err(_) => 16000,
        };
        Ok(Self {
            state_dir: std::env::var_os("KMM_FLEET_STATE_DIR")
                .map_or_else(|| cache_dir().join("env"), PathBuf::from),
            base_port,
            bin_dir: std::env::var_os(BIN_DIR_ENV).map(PathBuf::from),
        })
    }
}

/// The running fleet's state; an error if none is running.
pub fn running(settings: &Settings) -> Result<State> {
    let dir = &settings.state_dir;
    match State::load(dir)? {
        Some(state) if state.processes.iter().all(Tracked::alive) => Ok(state),
        Some(state) => {
            let dead: Vec<_> = state
                .processes
                .iter()
                .filter(|p| !p.alive())
                .map(|p| format!("{} (log: {})", p.name, p.log.display()))
                .collect();
            Err(Error::Invalid(format!(
                "the fleet in {} is degraded; not running: {}",
                dir.display(),
                dead.join(", ")
            )))
        }
        None => Err(Error::Invalid(format!(
            "no fleet is running (no state in {}); start one with `cargo xtask env up`",
            dir.display()
        ))),
    }
}

/// Ports, all on 127.0.0.1: the base port plus fixed offsets; cluster `i` (hub = 0,
/// spokeN = N) gets the block `base + 100 * i`.
#[derive(Debug, Clone, Copy)]
struct Ports {
    base: u16,
}

impl Ports {
    fn etcd_client(self) -> u16 {
        self.base + 1
    }
    fn etcd_peer(self) -> u16 {
        self.base + 2
    }
    fn registry(self) -> u16 {
        self.base + 5
    }
    fn cluster(self, index: usize, offset: u16) -> u16 {
        self.base + 100 * u16::try_from(index).unwrap_or(u16::MAX / 200) + offset
    }
}

const APISERVER: u16 = 43;
const CONTROLLER_MANAGER: u16 = 57;
const SCHEDULER: u16 = 59;
const KWOK: u16 = 47;
const OCM_AGENT: u16 = 80;
const OCM_REGISTRATION: u16 = 81;
const OCM_ADDON_MANAGER: u16 = 82;
const OCM_PLACEMENT: u16 = 83;
const OCM_ADDON_WEBHOOK: u16 = 84;

/// Start a fleet. Fails if one is already running; on failure stops what it started
/// and names the component that did not come up and its log.
pub async fn up(settings: &Settings, opts: &Options) -> Result<State> {
    let dir = settings.state_dir.clone();
    if let Some(state) = State::load(&dir)?
        && state.processes.iter().any(Tracked::alive)
    {
        return Err(Error::Invalid(format!(
            "a fleet is already running from {}; `cargo xtask env down` first",
            dir.display()
        )));
    }
    let real_nodes = (opts.spokes + 1) * opts.real_nodes_per_cluster;
    if real_nodes > MAX_REAL_NODES {
        return Err(Error::Invalid(format!(
            "{real_nodes} real nodes asked for; a fleet has at most {MAX_REAL_NODES}"
        )));
    }
    if opts.kmm && !opts.ocm {
        return Err(Error::Invalid(
            "kmm-fleet runs on Open Cluster Management: kmm needs ocm".into(),
        ));
    }
    if opts.kmm && opts.real_nodes_per_cluster == 0 {
        return Err(Error::Invalid(
            "kmm-fleet runs as Pods on real nodes (and runs KWOK nodes' agents in a real \
             node's network): kmm needs --real-nodes-per-cluster of at least 1"
                .into(),
        ));
    }
    // Another fleet with this base port (from another state directory) owns the bridge
    // and everything named after it; a fleet that was not brought down left them.
    let network = Network::of(settings.base_port);
    let hub_apiserver = Ports {
        base: settings.base_port,
    }
    .cluster(0, APISERVER);
    if network.exists()
        && tokio::net::TcpStream::connect((network.gateway, hub_apiserver))
            .await
            .is_ok()
    {
        return Err(Error::Invalid(format!(
            "a fleet with base port {} runs (its hub answers on {}:{hub_apiserver}); \
             bring it down or choose another KMM_FLEET_BASE_PORT",
            settings.base_port, network.gateway
        )));
    }
    release_host(settings)?;
    if dir.exists() {
        std::fs::remove_dir_all(&dir).context(|| format!("removing stale {}", dir.display()))?;
    }
    std::fs::create_dir_all(&dir).context(|| format!("creating {}", dir.display()))?;
    let versions = Versions::pinned();
    let toolchain = Toolchain::ensure(&versions, settings.bin_dir.as_deref())?;
    let mut starting = Starting {
        dir: dir.clone(),
        toolchain,
        versions,
        ports: Ports {
            base: settings.base_port,
        },
        network: network.clone(),
        state: State {
            clusters: vec![],
            registry: String::new(),
            node_registry: String::new(),
            network: Some(network),
            node_images: None,
            images: vec![],
            processes: vec![],
            kmm: None,
        },
    };
    let started = Instant::now();
    match starting.run(opts).await {
        Ok(()) => {
            eprintln!("fleet: up in {:.1}s", started.elapsed().as_secs_f64());
            Ok(starting.state)
        }
        Err(e) => {
            for p in starting.state.processes.iter().rev() {
                p.stop(Duration::from_secs(5));
            }
            starting.state.processes.clear();
            starting.state.save(&dir)?;
            // The failure that stopped `up` is the one to report; a cleanup failure
            // on top is only printed (`down` retries the cleanup).
            if let Err(cleanup) = release_host(settings) {
                eprintln!("fleet: cleaning up after the failed start: {cleanup}");
            }
            Err(e)
        }
    }
}

/// Stop every process of the fleet, release what its real nodes hold on the host
/// (cgroups with containerd's shims and the containers, mount and network namespaces,
/// the bridge) and remove its state directory.
pub fn down(settings: &Settings) -> Result<()> {
    let dir = &settings.state_dir;
    for p in recorded_processes(dir)?.iter().rev() {
        p.stop(Duration::from_secs(10));
    }
    release_host(settings)?;
    if dir.exists() {
        std::fs::remove_dir_all(dir).context(|| format!("removing {}", dir.display()))?;
    }
    Ok(())
}

/// The processes in `state.json`, read on their own: a state written by another
/// version of this crate still names what `down` must stop.
fn recorded_processes(dir: &Path) -> Result<Vec<Tracked>> {
    #[derive(Deserialize)]
    struct Recorded {
        processes: Vec<Tracked>,
    }
    let path = dir.join("state.json");
    match std::fs::read(&path) {
        Ok(bytes) => serde_json::from_slice::<Recorded>(&bytes)
            .map(|r| r.processes)
            .map_err(|e| Error::Invalid(format!("{}: {e}", path.display()))),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(vec![]),
        Err(e) => Err(Error::Io {
            context: format!("reading {}", path.display()),
            source: e,
        }),
    }
}

/// Everything of the fleet's real nodes outside its processes, found by the names
/// derived from the base port and by the state directory, so that it works without
/// (or with a stale) `state.json`: the nodes' cgroups (killing what is left in them),
/// the mount namespace files, the network namespaces and the bridge.
fn release_host(settings: &Settings) -> Result<()> {
    let network = Network::of(settings.base_port);
    nodes::remove_cgroups(&network.prefix)?;
    nodes::unmount_below(&settings.state_dir)?;
    network.remove()
}

/// Stops process `name` of the running fleet (SIGTERM, then SIGKILL after `grace`); it
/// stays in the state, so [`start_process`] can start it again.
pub fn stop_process(settings: &Settings, name: &str, grace: Duration) -> Result<Tracked> {
    let state = State::load(&settings.state_dir)?
        .ok_or_else(|| Error::Invalid("no fleet is running".into()))?;
    let process = state
        .processes
        .iter()
        .find(|p| p.name == name)
        .ok_or_else(|| Error::Invalid(format!("the fleet has no process {name}")))?;
    process.stop(grace);
    Ok(process.clone())
}

/// (Re)starts process `name` of the running fleet with its recorded command line, or
/// with `args` instead (recorded for later restarts); a running one is stopped first.
pub fn start_process(
    settings: &Settings,
    name: &str,
    args: Option<Vec<String>>,
) -> Result<Tracked> {
    let dir = &settings.state_dir;
    let mut state =
        State::load(dir)?.ok_or_else(|| Error::Invalid("no fleet is running".into()))?;
    let process = state
        .processes
        .iter_mut()
        .find(|p| p.name == name)
        .ok_or_else(|| Error::Invalid(format!("the fleet has no process {name}")))?;
    process.stop(Duration::from_secs(10));
    let previous = process.clone();
    let args = args.unwrap_or(previous.args);
    let env: Vec<(&str, String)> = previous
        .env
        .iter()
        .map(|(k, v)| (k.as_str(), v.clone()))
        .collect();
    *process = spawn(
        name,
        &previous.program,
        &args,
        &env,
        &previous.log,
        previous.confinement.as_ref(),
    )?;
    let started = process.clone();
    state.save(dir)?;
    Ok(started)
}

/// One line per component: name, PID, health, memory (current RSS and peak), log;
/// then one per real node (Ready, and everything in its cgroup: daemons, shims,
/// containers) and the fleet's total. An apiserver is healthy when `/readyz` says ok,
/// a kubelet or kube-proxy when its `/healthz` does, containerd when it serves its
/// metrics (all three on the node's address); any other component while it runs.
pub async fn status(settings: &Settings) -> Result<Vec<String>> {
    let dir = &settings.state_dir;
    let Some(state) = State::load(dir)? else {
        return Ok(vec![format!("no fleet (no state in {})", dir.display())]);
    };
    let mut lines = vec![format!(
        "state: {}  registry: {} (from real nodes: {})",
        dir.display(),
        state.registry,
        state.node_registry
    )];
    let (mut total_rss, mut total_peak) = (0, 0);
    for p in &state.processes {
        let node_daemon = state.real_nodes().find_map(|node| {
            let daemon = p.name.strip_prefix(&node.process(""))?;
            Some((node, daemon))
        });
        let health = if !p.alive() {
            "NOT RUNNING".to_string()
        } else if let Some(cluster) = p.name.strip_suffix("/kube-apiserver") {
            let client = client_for(&state.cluster(cluster)?.kubeconfig).await?;
            match get_text(&client, "/readyz").await {
                Some(text) if text.trim() == "ok" => "ready".into(),
                _ => "NOT READY".into(),
            }
        } else if let Some((node, daemon)) = node_daemon
            && let Some(healthy) = node.healthy(daemon).await
        {
            if healthy { "healthy" } else { "NOT HEALTHY" }.into()
        } else {
            "running".into()
        };
        let (rss, peak) = p.memory_kib().unwrap_or_default();
        total_rss += rss;
        total_peak += peak;
        lines.push(format!(
            "{:<32} pid {:<8} {:<12} rss {:>5} MiB  peak {:>5} MiB  {}",
            p.name,
            p.pid,
            health,
            rss / 1024,
            peak / 1024,
            p.log.display()
        ));
    }
    if let Some(kmm) = &state.kmm {
        let hub = client_for(&state.cluster("hub")?.kubeconfig).await?;
        lines.extend(hub_install::status_lines(&hub).await);
        lines.extend(kmm::memory_lines(&state, kmm));
    }
    for cluster in &state.clusters {
        if cluster.real_nodes.is_empty() {
            continue;
        }
        let nodes: Api<Node> = Api::all(client_for(&cluster.kubeconfig).await?);
        for node in &cluster.real_nodes {
            let ready = match nodes.get(&node.name).await {
                Ok(n) if node_ready(&n) => "Ready",
                Ok(_) => "NOT READY",
                Err(_) => "NOT REGISTERED",
            };
            let pids = node.processes().unwrap_or_default();
            let rss: u64 = pids
                .iter()
                .filter_map(|pid| process::memory_kib(*pid))
                .map(|(rss, _)| rss)
                .sum();
            lines.push(format!(
                "node {:<26} {} pods {}  {:<14} cgroup: {} processes, rss {} MiB",
                node.name,
                node.ip,
                node.pod_cidr,
                ready,
                pids.len(),
                rss / 1024
            ));
        }
    }
    lines.push(format!(
        "total: {} processes, rss {} MiB, sum of per-process peaks {} MiB",
        state.processes.len(),
        total_rss / 1024,
        total_peak / 1024
    ));
    Ok(lines)
}

struct Starting {
    dir: PathBuf,
    toolchain: Toolchain,
    versions: Versions,
    ports: Ports,
    network: Network,
    state: State,
}

/// A cluster's control plane while it is being started.
struct ControlPlane {
    name: String,
    index: usize,
    dir: PathBuf,
    ca: Ca,
    server: String,
    kubeconfig: PathBuf,
    client: Client,
}

impl Starting {
    async fn run(&mut self, opts: &Options) -> Result<()> {
        let api_dir = go_module_dir(&format!(
            "open-cluster-management.io/api@{}",
            self.versions.ocm.api_version
        ))?;
        let crds = ocm_crds(&api_dir)?;
        let kwok_dir = go_module_dir(&format!("sigs.k8s.io/kwok@{}", self.versions.kwok.version))?;

        nodes::check_host_packages()?;
        self.network.create()?;
        self.etcd().await?;
        // First: the real nodes pull their sandbox image from it.
        self.registry().await?;
        let hub = self.control_plane("hub", 0).await?;
        self.real_nodes(&hub, opts.real_nodes_per_cluster).await?;
        let bootstrap = match opts.ocm {
            true => Some(self.ocm_hub(&hub, &crds).await?),
            false => None,
        };

        let kernels = self.versions.kernels.all();
        let mut spokes = vec![];
        for s in 1..=opts.spokes {
            let spoke = self.control_plane(&format!("spoke{s}"), s).await?;
            self.real_nodes(&spoke, opts.real_nodes_per_cluster).await?;
            let nodes = simulated_nodes_of(s, opts.nodes_per_spoke, &kernels);
            self.simulated_nodes(&spoke, &nodes, &kwok_dir).await?;
            if let Some(bootstrap) = &bootstrap {
                self.ocm_agent(&spoke, &hub, bootstrap, &crds).await?;
            }
            self.cluster_mut(&spoke.name).nodes = nodes;
            self.state.save(&self.dir)?;
            spokes.push(spoke);
        }
        let clusters: Vec<&ControlPlane> = std::iter::once(&hub).chain(&spokes).collect();
        self.start_probes(&clusters).await?;
        if opts.ocm {
            for spoke in &spokes {
                self.accept(&hub, &spoke.name).await?;
            }
        }
        let with_image = &self.versions.kernels.with_image;
        self.state.images = kmod::push_samples(&self.state.registry, with_image).await?;
        // The real nodes report this machine's kernel, which has no headers: their sample
        // is the first kernel's, retargeted (the simulated backend checks the release).
        let mut real_kernels: Vec<String> =
            self.state.real_nodes().map(|n| n.kernel.clone()).collect();
        real_kernels.sort();
        real_kernels.dedup();
        if let Some(donor) = with_image.first() {
            for release in real_kernels.iter().filter(|k| !with_image.contains(k)) {
                self.state
                    .images
                    .push(kmod::push_retargeted(&self.state.registry, donor, release).await?);
            }
        }
        self.state.save(&self.dir)?;
        self.await_real_nodes(&clusters).await?;
        if opts.kmm {
            self.kmm(&hub, &spokes).await?;
        }
        Ok(())
    }

    fn cluster_mut(&mut self, name: &str) -> &mut Cluster {
        self.state
            .clusters
            .iter_mut()
            .find(|c| c.name == name)
            .expect("clusters are recorded when their control plane starts")
    }

    /// Start a toolchain binary as component `name`.
    fn start(
        &mut self,
        name: &str,
        bin: &str,
        args: Vec<String>,
        env: &[(&str, String)],
    ) -> Result<Tracked> {
        let program = self.toolchain.bin(bin).to_path_buf();
        self.start_program(name, &program, args, env)
    }

    /// Start `program` as component `name`, logging to `logs/<name>.log`, and record it.
    fn start_program(
        &mut self,
        name: &str,
        program: &Path,
        args: Vec<String>,
        env: &[(&str, String)],
    ) -> Result<Tracked> {
        self.start_in(name, program, args, env, None)
    }

    /// [`Starting::start_program`] inside a real node's namespaces and cgroup.
    fn start_confined(
        &mut self,
        name: &str,
        program: &Path,
        args: Vec<String>,
        env: &[(&str, String)],
        confinement: &Confinement,
    ) -> Result<Tracked> {
        self.start_in(name, program, args, env, Some(confinement))
    }

    fn start_in(
        &mut self,
        name: &str,
        program: &Path,
        args: Vec<String>,
        env: &[(&str, String)],
        confinement: Option<&Confinement>,
    ) -> Result<Tracked> {
        let logs = self.dir.join("logs");
        std::fs::create_dir_all(&logs).context(|| format!("creating {}", logs.display()))?;
        let log = logs.join(format!("{}.log", name.replace('/', "-")));
        let tracked = spawn(name, program, &args, env, &log, confinement)?;
        self.state.processes.push(tracked.clone());
        self.state.save(&self.dir)?;
        Ok(tracked)
    }

    async fn etcd(&mut self) -> Result<()> {
        let data = self.dir.join("etcd");
        let (client, peer) = (self.ports.etcd_client(), self.ports.etcd_peer());
        let args = vec![
            "--name=kmm-fleet".into(),
            format!("--data-dir={}", data.display()),
            format!("--listen-client-urls=http://127.0.0.1:{client}"),
            format!("--advertise-client-urls=http://127.0.0.1:{client}"),
            format!("--listen-peer-urls=http://127.0.0.1:{peer}"),
            format!("--initial-advertise-peer-urls=http://127.0.0.1:{peer}"),
            format!("--initial-cluster=kmm-fleet=http://127.0.0.1:{peer}"),
            // A throwaway test store: durability across power loss is not needed.
            "--unsafe-no-fsync=true".into(),
            "--log-level=warn".into(),
        ];
        let etcd = self.start("etcd", "etcd", args, &[])?;
        wait_for(&etcd, "etcd /health", || async move {
            http_get_plain(LOOPBACK, client, "/health")
                .await
                .is_some_and(|body| body.contains("\"health\":\"true\""))
        })
        .await
    }

    /// A cluster's kube-apiserver (reachable from the real nodes at the bridge address
    /// through a forwarder), kube-controller-manager and kube-scheduler.
    async fn control_plane(&mut self, name: &str, index: usize) -> Result<ControlPlane> {
        let dir = self.dir.join(name);
        let pki_dir = dir.join("pki");
        std::fs::create_dir_all(&pki_dir).context(|| format!("creating {}", pki_dir.display()))?;
        let ca = Ca::create(&pki_dir, "ca", &format!("kmm-fleet {name} CA"))?;
        let gateway = self.network.gateway.to_string();
        let serving = ca.serving(
            &pki_dir,
            "apiserver",
            &[
                "localhost",
                "kubernetes",
                "kubernetes.default",
                "kubernetes.default.svc",
                "kubernetes.default.svc.cluster.local",
            ],
            // Loopback for the host, the bridge for the kubelets, the `kubernetes`
            // Service's ClusterIP for pods.
            &["127.0.0.1", &gateway, "10.0.0.1"],
        )?;
        let admin = ca.client(&pki_dir, "admin", "kmm-fleet-admin", "system:masters")?;
        // The apiserver's identity towards kubelets (logs, exec, port-forward).
        let kubelet_client = ca.client(
            &pki_dir,
            "apiserver-kubelet-client",
            "kube-apiserver-kubelet-client",
            "system:masters",
        )?;
        let sa = pki::key_pair(&pki_dir, "service-account")?;
        let port = self.ports.cluster(index, APISERVER);
        let server = format!("https://127.0.0.1:{port}");
        let kubeconfig = dir.join("admin.kubeconfig");
        write_kubeconfig(
            &kubeconfig,
            name,
            &server,
            &ca.pem,
            Credentials::Certificate(&admin),
        )?;

        let p = |path: &Path| path.display().to_string();
        let apiserver = self.start(
            &format!("{name}/kube-apiserver"),
            "kube-apiserver",
            vec![
                format!(
                    "--etcd-servers=http://127.0.0.1:{}",
                    self.ports.etcd_client()
                ),
                format!("--etcd-prefix=/kmm-fleet/{name}"),
                "--bind-address=127.0.0.1".into(),
                // The `kubernetes` Service's endpoint: pods reach it through their
                // node and the forwarder on the bridge.
                format!("--advertise-address={gateway}"),
                format!("--secure-port={port}"),
                format!("--cert-dir={}", p(&dir.join("apiserver-certs"))),
                format!("--tls-cert-file={}", p(&serving.cert)),
                format!("--tls-private-key-file={}", p(&serving.key)),
                format!("--client-ca-file={}", p(&ca.cert)),
                "--service-account-issuer=https://kubernetes.default.svc.cluster.local".into(),
                format!("--service-account-key-file={}", p(&sa.cert)),
                format!("--service-account-signing-key-file={}", p(&sa.key)),
                format!("--service-cluster-ip-range={SERVICE_CIDR}"),
                // Node: what kubelets may read and write, as in any kubeadm cluster.
                "--authorization-mode=Node,RBAC".into(),
                "--allow-privileged=true".into(),
                format!("--kubelet-certificate-authority={}", p(&ca.cert)),
                format!("--kubelet-client-certificate={}", p(&kubelet_client.cert)),
                format!("--kubelet-client-key={}", p(&kubelet_client.key)),
                // Nodes' host names do not resolve; their InternalIP is on the bridge.
                "--kubelet-preferred-address-types=InternalIP".into(),
                // Webhooks and aggregated APIs by endpoint (pod) IP, which the host
                // routes to the real nodes; ClusterIPs exist only inside the nodes.
                "--enable-aggregator-routing=true".into(),
                // Only to give aggregated/extension servers a client CA to read.
                format!("--requestheader-client-ca-file={}", p(&ca.cert)),
                "--requestheader-allowed-names=front-proxy-client".into(),
                "--requestheader-username-headers=X-Remote-User".into(),
                "--requestheader-group-headers=X-Remote-Group".into(),
                "--requestheader-extra-headers-prefix=X-Remote-Extra-".into(),
            ],
            &[],
        )?;
        let client = client_for(&kubeconfig).await?;
        let probe = client.clone();
        wait_for(&apiserver, "kube-apiserver /readyz", || {
            let probe = probe.clone();
            async move {
                get_text(&probe, "/readyz")
                    .await
                    .is_some_and(|t| t.trim() == "ok")
            }
        })
        .await?;
        self.state.clusters.push(Cluster {
            name: name.into(),
            kubeconfig: kubeconfig.clone(),
            server: server.clone(),
            nodes: vec![],
            real_nodes: vec![],
        });
        self.state.save(&self.dir)?;
        self.forward(&format!("{name}/apiserver-forward"), port)
            .await?;

        let kc = p(&kubeconfig);
        let kcm_port = self.ports.cluster(index, CONTROLLER_MANAGER);
        let kcm = self.start(
            &format!("{name}/kube-controller-manager"),
            "kube-controller-manager",
            vec![
                format!("--kubeconfig={kc}"),
                format!("--authentication-kubeconfig={kc}"),
                format!("--authorization-kubeconfig={kc}"),
                "--bind-address=127.0.0.1".into(),
                format!("--secure-port={kcm_port}"),
                format!("--cert-dir={}", p(&dir.join("kcm-certs"))),
                "--leader-elect=false".into(),
                format!("--cluster-name={name}"),
                // Signs kubernetes.io/kube-apiserver-client CSRs, e.g. OCM's cluster registration.
                format!("--cluster-signing-cert-file={}", p(&ca.cert)),
                format!("--cluster-signing-key-file={}", p(&ca.key)),
                format!("--root-ca-file={}", p(&ca.cert)),
                format!("--service-account-private-key-file={}", p(&sa.key)),
                // KWOK's heartbeat stage renews a Node every 20-45 s: with the default
                // grace a busy machine sees KWOK nodes go NotReady, and their Pods with
                // them (for good: KWOK never marks them ready again).
                "--node-monitor-grace-period=2m".into(),
            ],
            &[],
        )?;
        wait_healthz(&kcm, kcm_port, "/healthz").await?;
        // The hub's too: Deployments on its real nodes (kmm-hub's own) need one.
        let sched_port = self.ports.cluster(index, SCHEDULER);
        let sched = self.start(
            &format!("{name}/kube-scheduler"),
            "kube-scheduler",
            vec![
                format!("--kubeconfig={kc}"),
                format!("--authentication-kubeconfig={kc}"),
                format!("--authorization-kubeconfig={kc}"),
                "--bind-address=127.0.0.1".into(),
                format!("--secure-port={sched_port}"),
                "--leader-elect=false".into(),
            ],
            &[],
        )?;
        wait_healthz(&sched, sched_port, "/healthz").await?;
        Ok(ControlPlane {
            name: name.into(),
            index,
            dir,
            ca,
            server,
            kubeconfig,
            client,
        })
    }

    /// The OCM hub controllers; returns the bootstrap kubeconfig for klusterlet agents.
    async fn ocm_hub(&mut self, hub: &ControlPlane, crds: &[Value]) -> Result<PathBuf> {
        ensure_namespaces(&hub.client, HUB_NAMESPACES).await?;
        let webhook_port = self.ports.cluster(hub.index, OCM_ADDON_WEBHOOK);
        let webhook_dir = hub.dir.join("addon-webhook");
        std::fs::create_dir_all(&webhook_dir)
            .context(|| format!("creating {}", webhook_dir.display()))?;
        // Named tls.crt/tls.key: the file names controller-runtime's webhook server reads.
        hub.ca
            .serving(&webhook_dir, "tls", &["localhost"], &["127.0.0.1"])?;
        let ca_bundle = base64::engine::general_purpose::STANDARD.encode(&hub.ca.pem);
        for crd in crds {
            let mut crd = crd.clone();
            if CONVERTED_CRDS.contains(&crd_name(&crd)) {
                crd["spec"]["conversion"] = json!({
                    "strategy": "Webhook",
                    "webhook": {
                        "clientConfig": {
                            "url": format!("https://127.0.0.1:{webhook_port}/convert"),
                            "caBundle": ca_bundle,
                        },
                        "conversionReviewVersions": ["v1", "v1beta1"],
                    },
                });
            }
            apply_crd(&hub.client, &crd).await?;
        }
        let kc = hub.kubeconfig.display().to_string();
        let webhook = self.start(
            "hub/ocm-addon-webhook",
            "addon",
            vec![
                "webhook-server".into(),
                format!("--port={webhook_port}"),
                format!("--certdir={}", webhook_dir.display()),
            ],
            // This subcommand has no --kubeconfig; controller-runtime reads $KUBECONFIG.
            &[("KUBECONFIG", kc.clone())],
        )?;
        wait_for(
            &webhook,
            "OCM addon conversion webhook to listen",
            || async move {
                tokio::net::TcpStream::connect(("127.0.0.1", webhook_port))
                    .await
                    .is_ok()
            },
        )
        .await?;
        for (component, bin, subcommand, offset) in [
            (
                "hub/ocm-registration",
                "registration",
                "controller",
                OCM_REGISTRATION,
            ),
            (
                "hub/ocm-addon-manager",
                "addon",
                "manager",
                OCM_ADDON_MANAGER,
            ),
            (
                "hub/ocm-placement",
                "placement",
                "controller",
                OCM_PLACEMENT,
            ),
        ] {
            let port = self.ports.cluster(hub.index, offset);
            let tracked = self.start(
                component,
                bin,
                vec![
                    subcommand.into(),
                    format!("--kubeconfig={kc}"),
                    "--namespace=open-cluster-management-hub".into(),
                    format!("--listen=127.0.0.1:{port}"),
                    "--disable-leader-election".into(),
                ],
                &[],
            )?;
            wait_healthz(&tracked, port, "/healthz").await?;
        }
        bootstrap_kubeconfig(hub).await
    }

    async fn simulated_nodes(
        &mut self,
        spoke: &ControlPlane,
        nodes: &[SimulatedNode],
        kwok_dir: &Path,
    ) -> Result<()> {
        let api: Api<Node> = Api::all(spoke.client.clone());
        for node in nodes {
            let object = json!({
                "apiVersion": "v1",
                "kind": "Node",
                "metadata": {
                    "name": node.name,
                    "annotations": { KWOK_NODE_ANNOTATION: "fake" },
                    "labels": {
                        "kubernetes.io/hostname": node.name,
                        "kubernetes.io/os": "linux",
                        "kubernetes.io/arch": "amd64",
                        "type": "kwok",
                        NODE_TYPE_LABEL: "kwok",
                        KERNEL_LABEL: node.kernel,
                    },
                },
            });
            api.patch(
                &node.name,
                &PatchParams::apply(MANAGER).force(),
                &Patch::Apply(&object),
            )
            .await?;
            // Set before KWOK starts: its node-initialize stage keeps an existing nodeInfo.
            let status = json!({
                "apiVersion": "v1",
                "kind": "Node",
                "status": { "nodeInfo": {
                    "kernelVersion": node.kernel,
                    "osImage": self.versions.kernels.os_image,
                    "operatingSystem": "linux",
                    "architecture": "amd64",
                    "kubeletVersion": self.versions.kubernetes.version,
                    "containerRuntimeVersion": "kwok",
                    "machineID": "", "systemUUID": "", "bootID": "", "kubeProxyVersion": "",
                }},
            });
            api.patch_status(
                &node.name,
                &PatchParams::apply(MANAGER).force(),
                &Patch::Apply(&status),
            )
            .await?;
        }
        let stages = kwok_dir.join("kustomize/stage");
        let mut args = vec![
            format!("--kubeconfig={}", spoke.kubeconfig.display()),
            "--manage-all-nodes=false".into(),
            format!("--manage-nodes-with-annotation-selector={KWOK_NODE_ANNOTATION}=fake"),
            format!(
                "--server-address=127.0.0.1:{}",
                self.ports.cluster(spoke.index, KWOK)
            ),
            "--node-ip=127.0.0.1".into(),
            format!(
                "--cidr={}",
                kwok_pod_cidr(&self.state.cluster(&spoke.name)?.real_nodes, spoke.index)
            ),
        ];
        for stage in [
            "node/fast/node-initialize.yaml",
            "node/heartbeat/node-heartbeat.yaml",
            "pod/fast/pod-ready.yaml",
            "pod/fast/pod-complete.yaml",
            "pod/fast/pod-delete.yaml",
        ] {
            args.push(format!("--config={}", stages.join(stage).display()));
        }
        let kwok = self.start(&format!("{}/kwok", spoke.name), "kwok", args, &[])?;
        let names: Vec<String> = nodes.iter().map(|n| n.name.clone()).collect();
        wait_for(&kwok, "KWOK nodes to become Ready", || {
            let api = api.clone();
            let names = names.clone();
            async move {
                for name in &names {
                    let Ok(node) = api.get(name).await else {
                        return false;
                    };
                    if !node_ready(&node) {
                        return false;
                    }
                }
                true
            }
        })
        .await
    }

    async fn ocm_agent(
        &mut self,
        spoke: &ControlPlane,
        hub: &ControlPlane,
        bootstrap: &Path,
        crds: &[Value],
    ) -> Result<()> {
        ensure_namespaces(&spoke.client, SPOKE_NAMESPACES).await?;
        for crd in crds.iter().filter(|c| SPOKE_CRDS.contains(&crd_name(c))) {
            apply_crd(&spoke.client, crd).await?;
        }
        let hub_kubeconfig_dir = spoke.dir.join("hub-kubeconfig");
        std::fs::create_dir_all(&hub_kubeconfig_dir)
            .context(|| format!("creating {}", hub_kubeconfig_dir.display()))?;
        let kc = spoke.kubeconfig.display().to_string();
        let port = self.ports.cluster(spoke.index, OCM_AGENT);
        let agent = self.start(
            &format!("{}/ocm-agent", spoke.name),
            "registration-operator",
            vec![
                "agent".into(),
                format!("--spoke-cluster-name={}", spoke.name),
                format!("--spoke-external-server-urls={}", spoke.server),
                format!("--bootstrap-kubeconfig={}", bootstrap.display()),
                format!("--hub-kubeconfig-dir={}", hub_kubeconfig_dir.display()),
                // The work agent reads the hub kubeconfig the registration agent writes.
                format!(
                    "--workload-source-config={}",
                    hub_kubeconfig_dir.join("kubeconfig").display()
                ),
                format!("--spoke-kubeconfig={kc}"),
                format!("--kubeconfig={kc}"),
                "--namespace=open-cluster-management-agent".into(),
                format!("--listen=127.0.0.1:{port}"),
                "--disable-leader-election".into(),
            ],
            &[],
        )?;
        let clusters = managed_clusters(&hub.client);
        let name = spoke.name.clone();
        wait_for(
            &agent,
            "the agent to register its ManagedCluster on the hub",
            || {
                let clusters = clusters.clone();
                let name = name.clone();
                async move { clusters.get_opt(&name).await.ok().flatten().is_some() }
            },
        )
        .await
    }

    /// Run `clusteradm accept` (approve the agent's CSR, set hubAcceptsClient) until
    /// the ManagedCluster is joined and available. `accept` fails until the CSR exists
    /// and again once nothing is left to approve, so its exit status is only logged.
    async fn accept(&mut self, hub: &ControlPlane, spoke: &str) -> Result<()> {
        let agent = self
            .state
            .processes
            .iter()
            .find(|p| p.name == format!("{spoke}/ocm-agent"))
            .cloned()
            .expect("the agent was started before accepting");
        let clusteradm = self.toolchain.bin("clusteradm").to_path_buf();
        let log = self
            .dir
            .join("logs")
            .join(format!("{spoke}-clusteradm-accept.log"));
        let kubeconfig = hub.kubeconfig.clone();
        let clusters = managed_clusters(&hub.client);
        let name = spoke.to_string();
        wait_for(
            &agent,
            "the ManagedCluster to be accepted, joined and available",
            || {
                let (clusteradm, kubeconfig, clusters, name, log) = (
                    clusteradm.clone(),
                    kubeconfig.clone(),
                    clusters.clone(),
                    name.clone(),
                    log.clone(),
                );
                async move {
                    if let Ok(Some(mc)) = clusters.get_opt(&name).await
                        && condition_true(&mc.data, "ManagedClusterJoined")
                        && condition_true(&mc.data, "ManagedClusterConditionAvailable")
                    {
                        return true;
                    }
                    if let Ok(out) = tokio::process::Command::new(&clusteradm)
                        .args(["accept", "--clusters", &name, "--kubeconfig"])
                        .arg(&kubeconfig)
                        .output()
                        .await
                    {
                        use std::io::Write as _;
                        if let Ok(mut file) = std::fs::File::options()
                            .create(true)
                            .append(true)
                            .open(&log)
                        {
                            let _ = writeln!(file, "--- clusteradm accept: {}", out.status);
                            let _ = file.write_all(&out.stdout);
                            let _ = file.write_all(&out.stderr);
                        }
                    }
                    false
                }
            },
        )
        .await?;
        // What OCM's registration webhook would do on creation. Its webhook-server is
        // not run: OCM hard-codes the health probe of every webhook-server to :8000, so
        // only one (the add-on conversion webhook, which is required) fits on a host.
        let label = json!({ "metadata": { "labels": { CLUSTER_SET_LABEL: "default" } } });
        clusters
            .patch(spoke, &PatchParams::default(), &Patch::Merge(&label))
            .await?;
        Ok(())
    }

    /// The registry, its forwarder to the bridge, and the real nodes' images.
    async fn registry(&mut self) -> Result<()> {
        let port = self.ports.registry();
        let dir = self.dir.join("registry");
        let config = kmod::registry_config(&dir, port)?;
        let program = kmod::registry_binary()?;
        let registry = self.start_program(
            "registry",
            &program,
            vec!["serve".into(), config.display().to_string()],
            &[],
        )?;
        wait_for(&registry, "the OCI registry /v2/", || async move {
            http_get_plain(LOOPBACK, port, "/v2/").await.is_some()
        })
        .await?;
        self.forward("registry-forward", port).await?;
        self.state.registry = format!("127.0.0.1:{port}");
        self.state.node_registry = format!("{}:{port}", self.network.gateway);
        self.state.node_images = Some(
            nodes::images::push(
                &self.state.registry,
                &self.state.node_registry,
                &self.versions.kubernetes.version,
            )
            .await?,
        );
        self.state.save(&self.dir)
    }
}

/// The identity klusterlet agents bootstrap with, as OCM's cluster-manager sets it up:
/// the ServiceAccount open-cluster-management/agent-registration-bootstrap, allowed only
/// to create its ManagedCluster and CSR (`clusteradm accept` approves CSRs from exactly
/// this requester). Its token goes into `<hub>/bootstrap.kubeconfig`.
async fn bootstrap_kubeconfig(hub: &ControlPlane) -> Result<PathBuf> {
    const SA: &str = "agent-registration-bootstrap";
    const ROLE: &str = "system:open-cluster-management:bootstrap";
    let apply = PatchParams::apply(MANAGER).force();
    let sas: Api<ServiceAccount> = Api::namespaced(hub.client.clone(), "open-cluster-management");
    let sa = json!({ "apiVersion": "v1", "kind": "ServiceAccount", "metadata": { "name": SA } });
    sas.patch(SA, &apply, &Patch::Apply(&sa)).await?;
    let role = json!({
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRole",
        "metadata": { "name": ROLE },
        "rules": [
            { "apiGroups": [""], "resources": ["configmaps"], "verbs": ["get"] },
            { "apiGroups": ["certificates.k8s.io"], "resources": ["certificatesigningrequests"],
              "verbs": ["create", "get", "list", "watch"] },
            { "apiGroups": ["cluster.open-cluster-management.io"], "resources": ["managedclusters"],
              "verbs": ["get", "create", "list", "watch"] },
            { "apiGroups": ["cluster.open-cluster-management.io"], "resources": ["managedclustersets/join"],
              "verbs": ["create"] },
        ],
    });
    Api::<ClusterRole>::all(hub.client.clone())
        .patch(ROLE, &apply, &Patch::Apply(&role))
        .await?;
    let binding = json!({
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRoleBinding",
        "metadata": { "name": ROLE },
        "roleRef": { "apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": ROLE },
        "subjects": [{ "kind": "ServiceAccount", "name": SA, "namespace": "open-cluster-management" }],
    });
    Api::<ClusterRoleBinding>::all(hub.client.clone())
        .patch(ROLE, &apply, &Patch::Apply(&binding))
        .await?;
    let request = TokenRequest {
        spec: TokenRequestSpec {
            // Long enough for any test session; agents switch to their signed
            // certificate right after joining.
            expiration_seconds: Some(7 * 24 * 3600),
            ..Default::default()
        },
        ..Default::default()
    };
    let token = sas
        .create_token_request(SA, &PostParams::default(), &request)
        .await?;
    let token = token
        .status
        .map(|s| s.token)
        .ok_or_else(|| Error::Invalid("the bootstrap TokenRequest returned no token".into()))?;
    let path = hub.dir.join("bootstrap.kubeconfig");
    write_kubeconfig(
        &path,
        &hub.name,
        &hub.server,
        &hub.ca.pem,
        Credentials::Token(&token),
    )?;
    Ok(path)
}

/// The nodes of spoke `spoke` (1-based): kernels are dealt round-robin across the whole
/// fleet, so that `spokes * nodes_per_spoke >= kernels.len()` covers every kernel.
/// Where KWOK takes its Pods' IPs from: the upper half of the spoke's first real node's
/// pod subnet (routed to that node, where `kwok-pod-runner` runs their processes), else
/// a range of its own no route leads to.
fn kwok_pod_cidr(real_nodes: &[RealNode], spoke_index: usize) -> String {
    match real_nodes.first() {
        Some(node) => {
            let network = node.pod_cidr.trim_end_matches("0/24");
            format!("{network}{}", kmm::KWOK_POD_RANGE)
        }
        None => format!("10.{}.0.0/16", 100 + spoke_index),
    }
}

fn simulated_nodes_of(
    spoke: usize,
    nodes_per_spoke: usize,
    kernels: &[String],
) -> Vec<SimulatedNode> {
    (0..nodes_per_spoke)
        .map(|n| SimulatedNode {
            name: format!("spoke{spoke}-node{}", n + 1),
            kernel: kernels[((spoke - 1) * nodes_per_spoke + n) % kernels.len()].clone(),
        })
        .collect()
}

/// Poll `check` every 250ms until it holds, failing at once if `process` exits and
/// after [`STARTUP`] otherwise; both failures name the process and its log.
pub(crate) async fn wait_for<F, Fut>(process: &Tracked, what: &str, mut check: F) -> Result<()>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + STARTUP;
    loop {
        if check().await {
            return Ok(());
        }
        if !process.alive() {
            return Err(Error::Component {
                component: process.name.clone(),
                reason: format!("exited while waiting for {what}:\n{}", process.log_tail(15)),
                log: process.log.clone(),
            });
        }
        if Instant::now() >= deadline {
            return Err(Error::Component {
                component: process.name.clone(),
                reason: format!(
                    "no {what} within {}s:\n{}",
                    STARTUP.as_secs(),
                    process.log_tail(15)
                ),
                log: process.log.clone(),
            });
        }
        tokio::time::sleep(POLL).await;
    }
}

async fn wait_healthz(process: &Tracked, port: u16, path: &'static str) -> Result<()> {
    let client = insecure_client(port)?;
    wait_for(process, &format!("{path} on port {port}"), || {
        let client = client.clone();
        async move {
            get_text(&client, path)
                .await
                .is_some_and(|t| t.trim() == "ok")
        }
    })
    .await
}

/// A client for a component's own serving endpoint (self-signed, no credentials).
fn insecure_client(port: u16) -> Result<Client> {
    let url = format!("https://127.0.0.1:{port}")
        .parse()
        .map_err(|e| Error::Invalid(format!("url: {e}")))?;
    let mut config = kube::Config::new(url);
    config.accept_invalid_certs = true;
    Ok(Client::try_from(config)?)
}

async fn get_text(client: &Client, path: &str) -> Option<String> {
    let request = http::Request::get(path).body(Vec::new()).ok()?;
    client.request_text(request).await.ok()
}

const LOOPBACK: IpAddr = IpAddr::V4(Ipv4Addr::LOCALHOST);

/// A plain-HTTP GET, for etcd, the registry and the real nodes' daemons; `None` unless
/// 200 OK.
async fn http_get_plain(ip: IpAddr, port: u16, path: &str) -> Option<String> {
    let mut stream = tokio::net::TcpStream::connect((ip, port)).await.ok()?;
    let request = format!("GET {path} HTTP/1.0\r\nHost: {ip}\r\n\r\n");
    stream.write_all(request.as_bytes()).await.ok()?;
    let mut response = String::new();
    stream.read_to_string(&mut response).await.ok()?;
    ok_body(&response)
}

/// The body of an HTTP/1.x response whose status is 200.
fn ok_body(response: &str) -> Option<String> {
    let (head, body) = response.split_once("\r\n\r\n")?;
    let status_line = head.lines().next()?;
    status_line
        .split_whitespace()
        .nth(1)
        .is_some_and(|code| code == "200")
        .then(|| body.to_string())
}

/// A client from a kubeconfig file written by the fleet.
pub async fn client_for(kubeconfig: &Path) -> Result<Client> {
    let kc = Kubeconfig::read_from(kubeconfig)?;
    let config = kube::Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default()).await?;
    Ok(Client::try_from(config)?)
}

/// Who a kubeconfig authenticates as.
enum Credentials<'a> {
    Certificate(&'a pki::Pair),
    Token(&'a str),
}

fn write_kubeconfig(
    path: &Path,
    cluster: &str,
    server: &str,
    ca_pem: &str,
    credentials: Credentials<'_>,
) -> Result<()> {
    let b64 = |s: &[u8]| base64::engine::general_purpose::STANDARD.encode(s);
    let read = |p: &Path| std::fs::read(p).context(|| format!("reading {}", p.display()));
    let user = match credentials {
        Credentials::Certificate(pair) => json!({
            "client-certificate-data": b64(&read(&pair.cert)?),
            "client-key-data": b64(&read(&pair.key)?),
        }),
        Credentials::Token(token) => json!({ "token": token }),
    };
    let config = json!({
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{ "name": cluster, "cluster": {
            "server": server,
            "certificate-authority-data": b64(ca_pem.as_bytes()),
        }}],
        "users": [{ "name": "user", "user": user }],
        "contexts": [{ "name": cluster, "context": { "cluster": cluster, "user": "user" } }],
        "current-context": cluster,
    });
    let text = serde_yaml_ng::to_string(&config).map_err(|e| Error::Invalid(e.to_string()))?;
    std::fs::write(path, text).context(|| format!("writing {}", path.display()))
}

/// The directory of a module in the Go module cache, downloading it if needed.
fn go_module_dir(module_at_version: &str) -> Result<PathBuf> {
    let mut cmd = std::process::Command::new("go");
    cmd.args(["mod", "download", "-json", module_at_version])
        .current_dir(cache_dir());
    if std::env::var_os("GOSUMDB").is_none() {
        cmd.env("GOSUMDB", "off");
    }
    std::fs::create_dir_all(cache_dir())
        .context(|| format!("creating {}", cache_dir().display()))?;
    let out = cmd
        .output()
        .context(|| format!("go mod download {module_at_version}"))?;
    let info: Value = serde_json::from_slice(&out.stdout).map_err(|e| {
        Error::Invalid(format!(
            "go mod download {module_at_version}: {e}: {}",
            String::from_utf8_lossy(&out.stderr)
        ))
    })?;
    info["Dir"]
        .as_str()
        .map(PathBuf::from)
        .ok_or_else(|| Error::Invalid(format!("go mod download {module_at_version}: {info}")))
}

/// The OCM CRDs of the api module (operator CRDs excluded). The module ships some CRDs
/// twice (a single-version file and a multi-version one); the file with the most
/// versions wins.
fn ocm_crds(api_dir: &Path) -> Result<Vec<Value>> {
    let mut files = vec![];
    for group in ["addon", "cluster", "work"] {
        collect_crd_files(&api_dir.join(group), &mut files)?;
    }
    files.sort();
    let mut parsed = vec![];
    for file in files {
        let text =
            std::fs::read_to_string(&file).context(|| format!("reading {}", file.display()))?;
        parsed.push(
            serde_yaml_ng::from_str(&text)
                .map_err(|e| Error::Invalid(format!("{}: {e}", file.display())))?,
        );
    }
    Ok(most_versions_per_crd(parsed))
}

/// One CRD per name: the one serving the most versions.
fn most_versions_per_crd(all: Vec<Value>) -> Vec<Value> {
    let versions = |c: &Value| c["spec"]["versions"].as_array().map_or(0, Vec::len);
    let mut crds: Vec<Value> = vec![];
    for crd in all {
        match crds.iter_mut().find(|c| crd_name(c) == crd_name(&crd)) {
            Some(existing) if versions(existing) < versions(&crd) => *existing = crd,
            Some(_) => {}
            None => crds.push(crd),
        }
    }
    crds
}

fn collect_crd_files(dir: &Path, out: &mut Vec<PathBuf>) -> Result<()> {
    for entry in std::fs::read_dir(dir).context(|| format!("reading {}", dir.display()))? {
        let path = entry
            .context(|| format!("reading {}", dir.display()))?
            .path();
        if path.is_dir() {
            collect_crd_files(&path, out)?;
        } else if path.to_string_lossy().ends_with(".crd.yaml") {
            out.push(path);
        }
    }
    Ok(())
}

fn crd_name(crd: &Value) -> &str {
    crd["metadata"]["name"].as_str().unwrap_or_default()
}

/// Server-side apply a CRD and wait until it is established.
pub async fn apply_crd(client: &Client, crd: &Value) -> Result<()> {
    let api: Api<CustomResourceDefinition> = Api::all(client.clone());
    let name = crd_name(crd).to_string();
    api.patch(
        &name,
        &PatchParams::apply(MANAGER).force(),
        &Patch::Apply(crd),
    )
    .await?;
    let deadline = Instant::now() + STARTUP;
    loop {
        let current = api.get(&name).await?;
        let established = current
            .status
            .as_ref()
            .and_then(|s| s.conditions.as_ref())
            .is_some_and(|cs| {
                cs.iter()
                    .any(|c| c.type_ == "Established" && c.status == "True")
            });
        if established {
            return Ok(());
        }
        if Instant::now() >= deadline {
            return Err(Error::Timeout {
                what: format!("CRD {name} to be established"),
                seconds: STARTUP.as_secs(),
            });
        }
        tokio::time::sleep(POLL).await;
    }
}

async fn ensure_namespaces(client: &Client, names: &[&str]) -> Result<()> {
    let api: Api<Namespace> = Api::all(client.clone());
    for name in names {
        let ns = json!({ "apiVersion": "v1", "kind": "Namespace", "metadata": { "name": name } });
        api.patch(
            name,
            &PatchParams::apply(MANAGER).force(),
            &Patch::Apply(&ns),
        )
        .await?;
    }
    Ok(())
}

/// `ManagedCluster`s on the hub, as dynamic objects.
pub fn managed_clusters(hub: &Client) -> Api<DynamicObject> {
    let gvk = GroupVersionKind::gvk("cluster.open-cluster-management.io", "v1", "ManagedCluster");
    Api::all_with(
        hub.clone(),
        &ApiResource::from_gvk_with_plural(&gvk, "managedclusters"),
    )
}

/// Whether `status.conditions` of a dynamic object has `type` with status True.
pub fn condition_true(data: &Value, type_: &str) -> bool {
    data["status"]["conditions"].as_array().is_some_and(|cs| {
        cs.iter()
            .any(|c| c["type"] == type_ && c["status"] == "True")
    })
}

pub fn node_ready(node: &Node) -> bool {
    node.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_fleet_runs_every_kernel_and_several_per_spoke() {
        let kernels = Versions::pinned().kernels.all();
        let defaults = Options::default();
        let mut seen = vec![];
        for spoke in 1..=defaults.spokes {
            let nodes = simulated_nodes_of(spoke, defaults.nodes_per_spoke, &kernels);
            let mut distinct: Vec<_> = nodes.iter().map(|n| &n.kernel).collect();
            distinct.dedup();
            assert!(distinct.len() > 1, "spoke{spoke} is homogeneous: {nodes:?}");
            seen.extend(nodes.into_iter().map(|n| n.kernel));
        }
        for kernel in &kernels {
            assert!(seen.contains(kernel), "no node runs {kernel}");
        }
    }

    #[test]
    fn only_200_responses_have_a_body() {
        assert_eq!(
            ok_body("HTTP/1.0 200 OK\r\nA: b\r\n\r\n{}"),
            Some("{}".into())
        );
        assert_eq!(ok_body("HTTP/1.1 404 Not Found\r\n\r\nno"), None);
        assert_eq!(ok_body("garbage"), None);
    }

    #[test]
    fn the_multi_version_copy_of_a_crd_wins() {
        let crd = |versions: &[&str]| {
            json!({
                "metadata": { "name": "things.example.io" },
                "spec": { "versions": versions.iter().map(|v| json!({ "name": v })).collect::<Vec<_>>() },
            })
        };
        let other =
            json!({ "metadata": { "name": "others.example.io" }, "spec": { "versions": [] } });
        let merged = most_versions_per_crd(vec![
            crd(&["v1alpha1"]),
            other.clone(),
            crd(&["v1alpha1", "v1beta1"]),
            crd(&["v1beta1"]),
        ]);
        assert_eq!(merged, vec![crd(&["v1alpha1", "v1beta1"]), other]);
    }
}
