//! Starting, inspecting and stopping the local fleet.
//!
//! Everything runs as processes on 127.0.0.1: one etcd (each cluster under its own key
//! prefix), a hub control plane with the OCM hub controllers, `N` spoke control planes
//! each with KWOK and the OCM klusterlet agent, and an OCI registry. Every cluster also
//! gets real nodes (containerd, kubelet, kube-proxy), each in its own network and mount
//! namespace on the fleet's bridge ([`network`], [`nodes`]). The state directory holds
//! certificates, kubeconfigs, logs and `state.json` (PIDs, ports, nodes).
//!
//! One room per concern: [`state`] (what runs, where), `control_plane` (etcd and each
//! cluster's Kubernetes control plane), `ocm` (Open Cluster Management), [`nodes`] and
//! `simulated_nodes` (real and KWOK nodes), `registry`, [`kmm`] and [`hub_install`]
//! (kmm-fleet itself), [`ui`] (the hub's fleet view, forwarded to this machine). This
//! file starts, inspects and stops them in order.

use std::ops::RangeInclusive;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Node;
use kube::Api;

use crate::process::{self, Confinement, Tracked, spawn};
use crate::toolchain::{Toolchain, go_module_dir};
use crate::versions::Versions;
use crate::{Error, IoContext, Result, kmod};

mod control_plane;
pub mod disruption;
pub mod hub_install;
pub mod kmm;
pub mod network;
pub mod nodes;
mod ocm;
mod registry;
mod simulated_nodes;
pub mod spoke_registry;
mod state;
pub mod ui;

use control_plane::{APISERVER, ControlPlane, Credentials, Ports, get_text, write_kubeconfig};
// The scale harness reads its own hub's /metrics and /readyz with it.
pub(crate) use control_plane::http_get_plain;
pub use control_plane::{apply_crd, client_for};
use network::{MAX_REAL_NODES, Network};
pub use nodes::node_ready;
use ocm::ocm_crds;
pub use ocm::{condition_true, managed_clusters};
use simulated_nodes::simulated_nodes_of;
pub use simulated_nodes::{KERNEL_LABEL, KWOK_NODE_ANNOTATION};
use state::recorded_processes;
pub use state::{Cluster, Settings, SimulatedNode, State, running, start_process, stop_process};

/// Field manager for everything the environment applies.
const MANAGER: &str = "kmm-fleet-env";

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
    outside_ephemeral_ports(settings.base_port, opts.spokes)?;
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
            ui_forward: None,
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

/// Stop every process of the fleet (`env ui`'s port-forward too, by its recorded PID),
/// release what its real nodes hold on the host
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

/// Everything of the fleet's real nodes outside its processes, found by the names
/// derived from the base port and by the state directory, so that it works without
/// (or with a stale) `state.json`: the nodes' cgroups (killing what is left in them),
/// the mount namespace files, the network namespaces and the bridge.
/// The fleet's loopback ports must not be ones the kernel hands out to outgoing
/// connections: a listener cannot bind a port a connection (of this fleet or anything
/// else on the host) already holds, so a fleet inside that range fails at random.
fn outside_ephemeral_ports(base_port: u16, spokes: usize) -> Result<()> {
    const RANGE: &str = "/proc/sys/net/ipv4/ip_local_port_range";
    let text = std::fs::read_to_string(RANGE).context(|| format!("reading {RANGE}"))?;
    let ephemeral = parse_port_range(&text)
        .ok_or_else(|| Error::Invalid(format!("{RANGE}: unexpected content {text:?}")))?;
    if let Some(last) = overlap(base_port, spokes, &ephemeral) {
        return Err(Error::Invalid(format!(
            "KMM_FLEET_BASE_PORT={base_port}: the fleet's ports {base_port}..={last} overlap \
             the host's ephemeral ports {}..={} ({RANGE}); choose a base port outside them",
            ephemeral.start(),
            ephemeral.end()
        )));
    }
    Ok(())
}

/// The fleet's last port when its block (cluster `i` at base + 100 * i .. + 99, the hub
/// at 0) meets `range`.
fn overlap(base_port: u16, spokes: usize, range: &RangeInclusive<u16>) -> Option<u32> {
    let clusters = u32::try_from(spokes + 1).unwrap_or(u32::MAX / 200);
    let last = u32::from(base_port) + 100 * clusters - 1;
    (u32::from(base_port) <= u32::from(*range.end()) && last >= u32::from(*range.start()))
        .then_some(last)
}

fn parse_port_range(text: &str) -> Option<RangeInclusive<u16>> {
    let mut bounds = text.split_whitespace().map(str::parse::<u16>);
    match (bounds.next(), bounds.next(), bounds.next()) {
        (Some(Ok(low)), Some(Ok(high)), None) if low <= high => Some(low..=high),
        _ => None,
    }
}

fn release_host(settings: &Settings) -> Result<()> {
    let network = Network::of(settings.base_port);
    nodes::remove_cgroups(&network.prefix)?;
    nodes::unmount_below(&settings.state_dir)?;
    network.remove()
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
    if let Some(forward) = &state.ui_forward {
        lines.push(format!(
            "fleet view {}/ -> pod/{}  pid {} {}",
            forward.url,
            forward.pod,
            forward.process.pid,
            if forward.process.alive() {
                "running"
            } else {
                "NOT RUNNING (`cargo xtask env ui` starts another)"
            }
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

#[cfg(test)]
mod tests {
    use super::{overlap, parse_port_range};

    #[test]
    fn a_fleet_overlaps_the_ephemeral_ports_when_any_clusters_block_does() {
        let ephemeral = 32768..=60999;
        assert_eq!(overlap(16000, 2, &ephemeral), None);
        assert_eq!(overlap(28000, 1, &ephemeral), None);
        assert_eq!(overlap(36000, 1, &ephemeral), Some(36199));
        assert_eq!(overlap(32568, 1, &ephemeral), None, "ends at 32767");
        assert_eq!(overlap(32569, 1, &ephemeral), Some(32768));
        assert_eq!(overlap(61000, 2, &ephemeral), None);
        assert_eq!(overlap(60999, 0, &ephemeral), Some(61098));
    }

    #[test]
    fn the_ephemeral_port_range_is_read_from_the_sysctl_text() {
        assert_eq!(parse_port_range("32768\t60999\n"), Some(32768..=60999));
        assert_eq!(parse_port_range("1024 1024"), Some(1024..=1024));
        for bad in ["", "32768", "60999 32768", "1 2 3", "a b", "70000 80000"] {
            assert_eq!(parse_port_range(bad), None, "{bad:?}");
        }
    }
}
