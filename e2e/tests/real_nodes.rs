//! The fleet's real nodes: a kubelet with containerd and kube-proxy per cluster, each in
//! its own network and mount namespace on the fleet's bridge.
//!
//! * On the running fleet (or one the fixture starts): a pod scheduled onto each
//!   cluster's real node pulls from the fleet registry under both of its names, reaches
//!   its cluster's apiserver in-cluster through the `kubernetes` Service, its log is
//!   read through the apiserver from the kubelet, and the apiserver reaches it by pod IP.
//! * On a fleet of its own (base port 28000, below the host's ephemeral ports; no OCM,
//!   so it fits beside the default one):
//!   `down` leaves no process, network namespace, link, route, cgroup or mount behind.
//!
//! Both fail, never skip, when a fleet cannot start.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, Result, bail, ensure};
use k8s_openapi::api::core::v1::{Node, Pod};
use kmm_e2e::fixture::{Fleet, TempNamespace, wait_until};
use kmm_e2e::fleet::network::Network;
use kmm_e2e::fleet::nodes::{NODE_TYPE_LABEL, RealNode};
use kmm_e2e::fleet::{self, Options, Settings, State, client_for, node_ready};
use kube::api::{LogParams, PostParams};
use kube::{Api, Client};
use serde_json::json;

const WAIT: Duration = Duration::from_secs(120);

#[tokio::test]
async fn a_pod_on_each_clusters_real_node_reaches_its_apiserver_and_is_reached_by_it() -> Result<()>
{
    let fleet = Fleet::get().await?;
    let state = &fleet.state;
    let images = state.node_images.as_ref().context("no node images")?;
    // An image under the registry's loopback name: containerd's hosts.toml sends that
    // name to the bridge too.
    let by_loopback = images
        .pause
        .replacen(&state.node_registry, &state.registry, 1);
    ensure!(by_loopback != images.pause, "{by_loopback}");
    let uname = std::fs::read_to_string("/proc/sys/kernel/osrelease")?;
    let uname = uname.trim();
    for cluster in &state.clusters {
        ensure!(
            !cluster.real_nodes.is_empty(),
            "{} has no real node",
            cluster.name
        );
        let client = client_for(&cluster.kubeconfig).await?;
        for node in &cluster.real_nodes {
            ensure!(
                node.kernel == uname,
                "{}: kernel {}",
                node.name,
                node.kernel
            );
            check_node(&client, node).await?;
            let ns = TempNamespace::create(&client, "kmm-e2e-real-node").await?;
            probe(&client, &ns.name, node, &images.probe, &by_loopback)
                .await
                .with_context(|| format!("{}/{}", cluster.name, node.name))?;
            ns.delete().await?;
        }
    }
    Ok(())
}

/// Registered, Ready, labelled real, at its bridge address, with this machine's kernel.
async fn check_node(client: &Client, expected: &RealNode) -> Result<()> {
    let node = Api::<Node>::all(client.clone()).get(&expected.name).await?;
    ensure!(node_ready(&node), "{} is not Ready", expected.name);
    let label = node
        .metadata
        .labels
        .as_ref()
        .and_then(|l| l.get(NODE_TYPE_LABEL));
    ensure!(
        label.map(String::as_str) == Some("real"),
        "{}: {NODE_TYPE_LABEL}={label:?}",
        expected.name
    );
    let status = node.status.as_ref().context("no status")?;
    let internal_ip = status
        .addresses
        .iter()
        .flatten()
        .find(|a| a.type_ == "InternalIP")
        .map(|a| a.address.clone());
    ensure!(
        internal_ip == Some(expected.ip.to_string()),
        "{}: InternalIP {internal_ip:?}",
        expected.name
    );
    let info = status.node_info.as_ref().context("no nodeInfo")?;
    ensure!(
        info.kernel_version == expected.kernel,
        "{}: kernel {}",
        expected.name,
        info.kernel_version
    );
    Ok(())
}

/// A pod placed by the scheduler: its first container asks the apiserver who it is
/// through the `kubernetes` Service, then serves a page on 8080; the second only runs,
/// from the loopback-named image.
async fn probe(
    client: &Client,
    namespace: &str,
    node: &RealNode,
    probe: &str,
    by_loopback: &str,
) -> Result<()> {
    let page = format!("served-by-{}", node.name);
    let pod: Pod = serde_json::from_value(json!({
        "metadata": { "name": "probe" },
        "spec": {
            "nodeSelector": { "kubernetes.io/hostname": node.name },
            "terminationGracePeriodSeconds": 0,
            "containers": [
                {
                    "name": "probe",
                    "image": probe,
                    "args": ["-serve", page],
                    "ports": [{ "containerPort": 8080 }],
                },
                { "name": "loopback-name", "image": by_loopback },
            ],
        },
    }))?;
    let pods: Api<Pod> = Api::namespaced(client.clone(), namespace);
    pods.create(&PostParams::default(), &pod).await?;
    let running = wait_until("the probe pod to be Ready", WAIT, || {
        let pods = pods.clone();
        async move {
            let pod = pods.get("probe").await.map_err(|e| e.to_string())?;
            let status = pod.status.clone().unwrap_or_default();
            let ready = status
                .conditions
                .iter()
                .flatten()
                .any(|c| c.type_ == "Ready" && c.status == "True");
            if ready {
                Ok(pod)
            } else {
                Err(format!(
                    "phase {:?}, containers {:?}",
                    status.phase, status.container_statuses
                ))
            }
        }
    })
    .await?;
    let bound = running.spec.as_ref().and_then(|s| s.node_name.clone());
    ensure!(bound.as_deref() == Some(node.name.as_str()), "on {bound:?}");
    let pod_ip = running
        .status
        .as_ref()
        .and_then(|s| s.pod_ip.clone())
        .unwrap_or_default();
    ensure!(
        pod_ip.starts_with(node.pod_cidr.trim_end_matches("0/24")),
        "pod IP {pod_ip} is not in {}",
        node.pod_cidr
    );

    // Through the apiserver from the kubelet (port 10250 on the node's address).
    let identity = format!("system:serviceaccount:{namespace}:default");
    let log = wait_until("the SelfSubjectReview in the pod's log", WAIT, || {
        let pods = pods.clone();
        let identity = identity.clone();
        async move {
            let params = LogParams {
                container: Some("probe".into()),
                ..Default::default()
            };
            let log = pods
                .logs("probe", &params)
                .await
                .map_err(|e| e.to_string())?;
            if log.contains(&identity) {
                Ok(log)
            } else {
                Err(format!("log: {log}"))
            }
        }
    })
    .await?;
    ensure!(log.contains("\"kind\":\"SelfSubjectReview\""), "{log}");

    // The apiserver dials the pod IP itself: the host routes the node's pod subnet.
    let request = http::Request::get(format!(
        "/api/v1/namespaces/{namespace}/pods/probe:8080/proxy/"
    ))
    .body(Vec::new())?;
    let served = client.request_text(request).await?;
    ensure!(
        served.trim() == page,
        "the apiserver got {served:?} from the pod"
    );
    Ok(())
}

#[tokio::test]
async fn down_leaves_no_process_namespace_link_route_cgroup_or_mount_behind() -> Result<()> {
    let root = std::env::temp_dir().join(format!("kmm-e2e-real-nodes-{}", std::process::id()));
    let settings = Settings {
        state_dir: root.join("state"),
        base_port: 28000,
        bin_dir: Settings::from_env()?.bin_dir,
    };
    let network = Network::of(settings.base_port);
    let before = HostView::take(&network, &settings.state_dir)?;
    ensure!(
        before.of_fleet.is_empty(),
        "leftovers of an earlier run: {:?}",
        before.of_fleet
    );
    let outcome = exercise(&settings).await;
    let down = fleet::down(&settings);
    let after = HostView::take(&network, &settings.state_dir)?;
    let _ = std::fs::remove_dir_all(&root);
    let pids = outcome?;
    down?;

    ensure!(
        after.of_fleet.is_empty(),
        "left behind: {:?}",
        after.of_fleet
    );
    ensure!(
        after.shared_containerd == before.shared_containerd,
        "the host's /run/containerd changed: {:?} -> {:?}",
        before.shared_containerd,
        after.shared_containerd
    );
    let alive: Vec<String> = pids
        .iter()
        .filter(|p| p.alive())
        .map(|p| format!("{} ({})", p.pid, p.command))
        .collect();
    ensure!(alive.is_empty(), "still running: {alive:?}");
    ensure!(
        !settings.state_dir.exists(),
        "the state directory is still there"
    );
    Ok(())
}

/// Start the fleet, put a pod with volumes (mounts) on each real node, and return every
/// process of the fleet: the tracked ones and everything in the nodes' cgroups
/// (containerd's shims, the containers).
async fn exercise(settings: &Settings) -> Result<Vec<Process>> {
    let state = fleet::up(
        settings,
        &Options {
            spokes: 1,
            nodes_per_spoke: 1,
            real_nodes_per_cluster: 1,
            ocm: false,
            kmm: false,
        },
    )
    .await?;
    let images = state.node_images.as_ref().context("no node images")?;
    for cluster in &state.clusters {
        let client = client_for(&cluster.kubeconfig).await?;
        let pods: Api<Pod> = Api::namespaced(client, "default");
        for node in &cluster.real_nodes {
            let name = format!("sleeper-{}", node.name);
            let pod: Pod = serde_json::from_value(json!({
                "metadata": { "name": name },
                "spec": {
                    "nodeName": node.name,
                    "volumes": [{ "name": "scratch", "emptyDir": { "medium": "Memory" } }],
                    "containers": [{
                        "name": "pause",
                        "image": images.pause,
                        "volumeMounts": [{ "name": "scratch", "mountPath": "/scratch" }],
                    }],
                },
            }))?;
            pods.create(&PostParams::default(), &pod).await?;
            wait_until(&format!("{name} to run"), WAIT, || {
                let (pods, name) = (pods.clone(), name.clone());
                async move {
                    let phase = pods
                        .get(&name)
                        .await
                        .map_err(|e| e.to_string())?
                        .status
                        .and_then(|s| s.phase);
                    match phase.as_deref() {
                        Some("Running") => Ok(()),
                        other => Err(format!("phase {other:?}")),
                    }
                }
            })
            .await?;
        }
    }
    processes_of(&state)
}

fn processes_of(state: &State) -> Result<Vec<Process>> {
    let mut pids: Vec<i32> = state.processes.iter().map(|p| p.pid).collect();
    for node in state.real_nodes() {
        let in_cgroup = node.processes()?;
        // The three daemons and more: shims and containers.
        ensure!(
            in_cgroup.len() > 3,
            "{}: only {in_cgroup:?} in its cgroup",
            node.name
        );
        pids.extend(in_cgroup);
    }
    pids.sort_unstable();
    pids.dedup();
    pids.into_iter()
        .map(|pid| Process::of(pid).with_context(|| format!("process {pid}")))
        .collect()
}

/// A process, told apart from a later one with the same PID by its start time.
struct Process {
    pid: i32,
    started: u64,
    command: String,
}

impl Process {
    fn of(pid: i32) -> Option<Self> {
        let started = start_time(pid)?;
        let command = std::fs::read_to_string(format!("/proc/{pid}/comm")).ok()?;
        Some(Self {
            pid,
            started,
            command: command.trim().into(),
        })
    }

    fn alive(&self) -> bool {
        start_time(self.pid) == Some(self.started)
    }
}

/// Field 22 of `/proc/<pid>/stat`; `None` for a process that is gone or a zombie.
fn start_time(pid: i32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let fields: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
    if fields.first() == Some(&"Z") {
        return None;
    }
    // After the command: state is field 3, start time field 22.
    fields.get(19)?.parse().ok()
}

/// What of a fleet is visible on the host, by its names.
struct HostView {
    of_fleet: Vec<String>,
    shared_containerd: Vec<String>,
}

impl HostView {
    fn take(network: &Network, state_dir: &Path) -> Result<Self> {
        let prefix = &network.prefix;
        let mut of_fleet = vec![];
        for (kind, dir) in [
            ("network namespace", PathBuf::from("/run/netns")),
            ("link", PathBuf::from("/sys/class/net")),
        ] {
            for name in names_in(&dir) {
                if name.starts_with(prefix.as_str()) {
                    of_fleet.push(format!("{kind} {name}"));
                }
            }
        }
        for hierarchy in names_in(Path::new("/sys/fs/cgroup")) {
            for name in names_in(&Path::new("/sys/fs/cgroup").join(&hierarchy)) {
                if name.starts_with(prefix.as_str()) {
                    of_fleet.push(format!("cgroup {hierarchy}/{name}"));
                }
            }
        }
        let gateway = network.gateway.octets();
        let link_net = format!("{}.{}.{}.", gateway[0], gateway[1], gateway[2]);
        let routes = std::process::Command::new("ip").arg("route").output()?;
        if !routes.status.success() {
            bail!("ip route: {routes:?}");
        }
        for route in String::from_utf8_lossy(&routes.stdout).lines() {
            if route.contains(&link_net) || route.contains(prefix.as_str()) {
                of_fleet.push(format!("route {route}"));
            }
        }
        let state_dir = state_dir.display().to_string();
        for mount in std::fs::read_to_string("/proc/self/mountinfo")?.lines() {
            if mount.contains(&state_dir)
                || mount.contains(prefix.as_str())
                || mount.contains("kmm-fleet-node")
            {
                of_fleet.push(format!("mount {mount}"));
            }
        }
        Ok(Self {
            of_fleet,
            shared_containerd: names_in(Path::new("/run/containerd")),
        })
    }
}

fn names_in(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .map(|entries| {
            entries
                .flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    names.sort();
    names
}
