//! Real nodes: a kubelet with its own containerd and kube-proxy per node, registered
//! with its cluster's kube-apiserver. Each node runs confined:
//!
//! * in its network namespace (see [`network`](super::network)): the kubelet's, CNI's
//!   and kube-proxy's iptables rules and the pods' interfaces stay there;
//! * in its own persistent mount namespace (private propagation) with fresh tmpfs on
//!   `/run`, `/var/cache`, `/var/lib` and `/var/log` and the node's state directory bound onto
//!   `/var/lib/kubelet`, `/var/log/pods` and `/var/log/containers`: the kubelet's
//!   hard-coded socket paths, containerd's `/run/containerd` (shim sockets included),
//!   CNI state, pod network namespaces and every volume mount stay inside it;
//! * in its own cgroup in every hierarchy (the kubelet's `cgroupRoot`), the daemons in
//!   its `node` child: everything the node starts stays below it, which is how `down`
//!   finds containerd's shims and the containers.
//!
//! The node's settings are those measured in the notes on real nodes: cgroupfs driver,
//! cgroup v1 allowed, swap allowed, no kubelet iptables chains, containerd with
//! `restrict_oom_score_adj` (this machine's bounding set lacks CAP_SYS_RESOURCE).

pub mod images;

use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use k8s_openapi::api::core::v1::{Node, Pod};
use kmm_kwok_pod_runner::netns_path;
use kube::Api;
use kube::api::{DeleteParams, LogParams, PostParams};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use super::network::{NodeAddress, POD_RANGE};
use super::{
    APISERVER, ControlPlane, Credentials, Starting, http_get_plain, wait_for, write_kubeconfig,
};
use crate::process::run;
use crate::process::{Confinement, Tracked};
use crate::{Error, IoContext, Result, cgroup};

/// Node label telling real nodes (`real`) from KWOK's simulated ones (`kwok`).
pub const NODE_TYPE_LABEL: &str = "kmm-fleet.dev/node-type";
/// Debian packages a real node needs, and why.
pub const HOST_PACKAGES: &[(&str, &str)] = &[
    ("containerd", "each node's container runtime"),
    ("runc", "containerd's OCI runtime"),
    (
        "containernetworking-plugins",
        "the pods' bridge, host-local and portmap CNI plugins",
    ),
    ("iptables", "kube-proxy's and CNI's rules inside each node"),
    (
        "socat",
        "forwards the apiservers and the registry to the bridge",
    ),
    ("gcc", "compiles the sandbox (pause) image's program"),
    ("libc6-dev", "links the sandbox program statically"),
    (
        "iproute2",
        "the bridge, network namespaces, veths and routes",
    ),
];

// Ports inside each node's network namespace, on the node's address (every node has
// its own, so they are the upstream defaults).
const KUBELET_PORT: u16 = 10250;
const KUBELET_HEALTHZ_PORT: u16 = 10248;
const KUBE_PROXY_METRICS_PORT: u16 = 10249;
const KUBE_PROXY_HEALTHZ_PORT: u16 = 10256;
const CONTAINERD_METRICS_PORT: u16 = 1338;
/// containerd's socket inside the node's mount namespace.
const CONTAINERD_SOCKET: &str = "/run/containerd/containerd.sock";
/// The kubelet's root directory inside the node's mount namespace: its device-plugin
/// and pod-resources socket paths are hard-coded below it.
const KUBELET_ROOT: &str = "/var/lib/kubelet";
/// The node's daemons' cgroup, below the node's (the kubelet's `cgroupRoot`).
const DAEMONS_CGROUP: &str = "node";
/// Where the CNI plugins are in Debian's `containernetworking-plugins`.
const CNI_BIN_DIR: &str = "/usr/lib/cni";
const CONTAINERD: &str = "/usr/bin/containerd";
/// What the node's daemons find on PATH (runc, the shim, iptables, mount).
const NODE_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";
/// The kernel release (what `uname -r` prints and the kubelet reports).
const OSRELEASE: &str = "/proc/sys/kernel/osrelease";
/// Host directories each node gets a private tmpfs over (`/var/cache`: the node agent's
/// image cache is a hostPath there, each node's own as on separate machines).
const PRIVATE_DIRS: &[&str] = &["/run", "/var/cache", "/var/lib", "/var/log"];

/// Fail naming every package of [`HOST_PACKAGES`] that is not installed.
pub(super) fn check_host_packages() -> Result<()> {
    let missing: Vec<&str> = HOST_PACKAGES
        .iter()
        .map(|(package, _)| *package)
        .filter(|package| {
            !Command::new("dpkg-query")
                .args(["-W", "-f", "${db:Status-Status}", package])
                .output()
                .is_ok_and(|out| out.status.success() && out.stdout == b"installed")
        })
        .collect();
    if missing.is_empty() {
        return Ok(());
    }
    Err(Error::Invalid(format!(
        "real nodes need Debian packages that are not installed: {}; \
         `cargo xtask env setup` installs them",
        missing.join(" ")
    )))
}

/// A real node of a cluster.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RealNode {
    /// `<cluster>-real<N>`: the Node's name.
    pub name: String,
    pub cluster: String,
    /// The Node's InternalIP, on the fleet's bridge.
    pub ip: Ipv4Addr,
    /// Its pods' subnet (`198.19.X.0/24`), routed from the host via `ip`.
    pub pod_cidr: String,
    /// The kernel release it reports: this machine's.
    #[serde(default)]
    pub kernel: String,
    /// Its network namespace (`ip netns`), also its cgroup below every hierarchy root.
    pub netns: String,
    /// Its state: certificates, configuration, containerd's images and snapshots, the
    /// kubelet's root directory (`kubelet/`), pod logs (`logs/`).
    pub dir: PathBuf,
}

impl RealNode {
    /// The fleet process name of one of its daemons (`containerd`, `kubelet`,
    /// `kube-proxy`), e.g. `spoke1/spoke1-real1/kubelet`.
    pub fn process(&self, daemon: &str) -> String {
        format!("{}/{}/{daemon}", self.cluster, self.name)
    }

    /// How `env status` judges one of its daemons: the kubelet's and kube-proxy's
    /// `/healthz` and containerd's metrics endpoint, all on the node's address.
    pub(super) async fn healthy(&self, daemon: &str) -> Option<bool> {
        let (port, path) = match daemon {
            "kubelet" => (KUBELET_HEALTHZ_PORT, "/healthz"),
            "kube-proxy" => (KUBE_PROXY_HEALTHZ_PORT, "/healthz"),
            "containerd" => (CONTAINERD_METRICS_PORT, "/v1/metrics"),
            _ => return None,
        };
        Some(http_get_plain(self.ip.into(), port, path).await.is_some())
    }

    /// PIDs in the node's cgroup: its daemons, containerd's shims and the containers.
    pub fn processes(&self) -> Result<Vec<i32>> {
        cgroup::processes(&self.netns)
    }
}

/// The state directory holding the nodes' mount namespace files. It is a private
/// bind mount of itself: a namespace file cannot be bound into a mount that
/// propagates (on machines whose `/` is shared).
fn namespace_dir(state_dir: &Path) -> PathBuf {
    state_dir.join("ns")
}

/// Unmount everything mounted below `dir` on the host (the nodes' mount namespace
/// files and their directory), deepest first. A namespace whose file is unmounted and
/// whose processes have exited is gone, with all its mounts.
pub(super) fn unmount_below(dir: &Path) -> Result<()> {
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo")
        .context(|| "reading /proc/self/mountinfo".into())?;
    let mut points: Vec<PathBuf> = mountinfo
        .lines()
        .filter_map(|line| line.split_whitespace().nth(4))
        .map(|p| PathBuf::from(unescape_mountinfo(p)))
        .filter(|p| p.starts_with(dir))
        .collect();
    points.sort_by_key(|p| std::cmp::Reverse(p.components().count()));
    for point in points {
        run(Command::new("umount").arg(&point))?;
    }
    Ok(())
}

/// `/proc/self/mountinfo` writes space, tab, newline and backslash as `\ooo`.
fn unescape_mountinfo(field: &str) -> String {
    let mut out = String::new();
    let mut chars = field.chars().peekable();
    while let Some(c) = chars.next() {
        let code: String = chars.clone().take(3).collect();
        if c == '\\'
            && code.len() == 3
            && let Ok(byte) = u8::from_str_radix(&code, 8)
        {
            out.push(char::from(byte));
            chars.nth(2);
        } else {
            out.push(c);
        }
    }
    out
}

/// The paths and names of one node while it is being set up.
struct Layout {
    node: RealNode,
    mount_ns: PathBuf,
    pki: PathBuf,
}

impl Layout {
    fn confinement(&self) -> Confinement {
        Confinement {
            net: netns_path(&self.node.netns),
            mount: self.mount_ns.clone(),
            cgroup: format!("{}/{DAEMONS_CGROUP}", self.node.netns),
        }
    }

    fn path(&self, relative: &str) -> PathBuf {
        self.node.dir.join(relative)
    }
}

impl Starting {
    /// Start `count` real nodes for cluster `cp`: network namespace, mount namespace,
    /// cgroup, certificates and configuration, then containerd, the kubelet and
    /// kube-proxy. [`Starting::await_real_nodes`] waits for them later, so that they come
    /// up while the rest of the fleet starts.
    pub(super) async fn real_nodes(&mut self, cp: &ControlPlane, count: usize) -> Result<()> {
        for n in 1..=count {
            let index = self.state.clusters.iter().map(|c| c.real_nodes.len()).sum();
            let name = format!("{}-real{n}", cp.name);
            let address = self.network.node(index, &name)?;
            let layout = self.layout(cp, &name, &address)?;
            self.network.attach(&address)?;
            self.mount_namespace(&layout)?;
            cgroup::create(&layout.confinement().cgroup)?;
            self.node_files(cp, &layout, &address)?;
            self.node_daemons(&layout).await?;
            self.cluster_mut(&cp.name).real_nodes.push(layout.node);
            self.state.save(&self.dir)?;
        }
        Ok(())
    }

    fn layout(&self, cp: &ControlPlane, name: &str, address: &NodeAddress) -> Result<Layout> {
        let dir = cp.dir.join("real-nodes").join(name);
        // The node's tmpfs mounts would hide a state directory below them.
        if let Some(hidden) = PRIVATE_DIRS.iter().find(|d| dir.starts_with(d)) {
            return Err(Error::Invalid(format!(
                "the state directory {} is below {hidden}, which real nodes mount over; \
                 set KMM_FLEET_STATE_DIR elsewhere",
                self.dir.display()
            )));
        }
        for sub in [
            "pki",
            "kubelet",
            "logs/pods",
            "logs/containers",
            "cni",
            "containerd/root",
            "containerd/opt",
        ] {
            let path = dir.join(sub);
            std::fs::create_dir_all(&path).context(|| format!("creating {}", path.display()))?;
        }
        let ns_dir = namespace_dir(&self.dir);
        if !ns_dir.exists() {
            std::fs::create_dir_all(&ns_dir)
                .context(|| format!("creating {}", ns_dir.display()))?;
            run(Command::new("mount")
                .arg("--bind")
                .arg(&ns_dir)
                .arg(&ns_dir))?;
            run(Command::new("mount").arg("--make-private").arg(&ns_dir))?;
        }
        let kernel = std::fs::read_to_string(OSRELEASE)
            .context(|| format!("reading {OSRELEASE}"))?
            .trim()
            .to_string();
        Ok(Layout {
            mount_ns: ns_dir.join(name),
            pki: dir.join("pki"),
            node: RealNode {
                name: name.to_string(),
                cluster: cp.name.clone(),
                ip: address.ip,
                pod_cidr: address.pod_cidr.clone(),
                kernel,
                netns: address.netns.clone(),
                dir,
            },
        })
    }

    /// A persistent mount namespace (bound to a file, so containerd and the kubelet,
    /// started separately, share it) with the node's private directories.
    fn mount_namespace(&self, layout: &Layout) -> Result<()> {
        let file = &layout.mount_ns;
        std::fs::write(file, "").context(|| format!("creating {}", file.display()))?;
        run(Command::new("unshare")
            .arg(format!("--mount={}", file.display()))
            .args(["--propagation", "private", "true"]))?;
        let inside = |args: &[&str]| {
            run(Command::new("nsenter")
                .arg(format!("--mount={}", file.display()))
                .arg("--")
                .args(args))
        };
        for dir in PRIVATE_DIRS {
            inside(&[
                "mount",
                "-t",
                "tmpfs",
                "-o",
                "mode=0755",
                "kmm-fleet-node",
                dir,
            ])?;
        }
        for (target, source) in [
            (KUBELET_ROOT, "kubelet"),
            ("/var/log/pods", "logs/pods"),
            ("/var/log/containers", "logs/containers"),
        ] {
            let source = layout.path(source).display().to_string();
            inside(&["mkdir", "-p", target])?;
            inside(&["mount", "--bind", &source, target])?;
        }
        Ok(())
    }

    /// Certificates from the cluster's CA, kubeconfigs, and the daemons' configuration.
    fn node_files(&self, cp: &ControlPlane, layout: &Layout, address: &NodeAddress) -> Result<()> {
        let node = &layout.node;
        let server = format!(
            "https://{}:{}",
            self.network.gateway,
            self.ports.cluster(cp.index, APISERVER)
        );
        // The Node authorizer knows a kubelet by exactly this identity.
        let kubelet_client = cp.ca.client(
            &layout.pki,
            "kubelet-client",
            &format!("system:node:{}", node.name),
            "system:nodes",
        )?;
        let serving = cp.ca.serving(
            &layout.pki,
            "kubelet",
            &[&node.name],
            &[&node.ip.to_string()],
        )?;
        // `system:kube-proxy` is the user the default `system:node-proxier` binding names.
        let proxy_client = cp.ca.client(
            &layout.pki,
            "kube-proxy",
            "system:kube-proxy",
            "system:node-proxier",
        )?;
        let kubelet_kubeconfig = layout.path("kubelet.kubeconfig");
        write_kubeconfig(
            &kubelet_kubeconfig,
            &cp.name,
            &server,
            &cp.ca.pem,
            Credentials::Certificate(&kubelet_client),
        )?;
        let proxy_kubeconfig = layout.path("kube-proxy.kubeconfig");
        write_kubeconfig(
            &proxy_kubeconfig,
            &cp.name,
            &server,
            &cp.ca.pem,
            Credentials::Certificate(&proxy_client),
        )?;
        let registry = &self.state.node_registry;
        let certs_d = layout.path("containerd/certs.d");
        // Pods name the registry by the bridge address; the loopback name the rest of
        // the fleet uses means the node's own loopback inside its namespace, so both go
        // to the bridge, over plain HTTP.
        for host in [registry.as_str(), self.state.registry.as_str()] {
            let dir = certs_d.join(host);
            std::fs::create_dir_all(&dir).context(|| format!("creating {}", dir.display()))?;
            write(&dir.join("hosts.toml"), &registry_hosts(registry))?;
        }
        let pause = &self.node_images()?.pause;
        write(
            &layout.path("containerd.toml"),
            &containerd_config(&node.dir, node.ip, pause)?,
        )?;
        write_json(
            &layout.path("cni/10-kmm-fleet.conflist"),
            &cni_config(&address.pod_cidr),
        )?;
        write_json(
            &layout.path("kubelet.yaml"),
            &kubelet_config(node, &cp.ca.cert, &serving),
        )?;
        write_json(
            &layout.path("kube-proxy.yaml"),
            &kube_proxy_config(node, &proxy_kubeconfig),
        )?;
        Ok(())
    }

    async fn node_daemons(&mut self, layout: &Layout) -> Result<()> {
        let node = &layout.node;
        let confinement = layout.confinement();
        let path = [("PATH", NODE_PATH.to_string())];
        let containerd = self.start_confined(
            &node.process("containerd"),
            Path::new(CONTAINERD),
            vec![format!(
                "--config={}",
                layout.path("containerd.toml").display()
            )],
            &path,
            &confinement,
        )?;
        let ip = node.ip;
        wait_for(
            &containerd,
            "containerd's metrics endpoint",
            || async move {
                http_get_plain(ip.into(), CONTAINERD_METRICS_PORT, "/v1/metrics")
                    .await
                    .is_some()
            },
        )
        .await?;
        let kubelet = self.toolchain.bin("kubelet").to_path_buf();
        self.start_confined(
            &node.process("kubelet"),
            &kubelet,
            vec![
                format!("--config={}", layout.path("kubelet.yaml").display()),
                format!(
                    "--kubeconfig={}",
                    layout.path("kubelet.kubeconfig").display()
                ),
                format!("--root-dir={KUBELET_ROOT}"),
                // Not derived from --root-dir.
                format!("--cert-dir={KUBELET_ROOT}/pki"),
                format!("--hostname-override={}", node.name),
                format!("--node-ip={}", node.ip),
                format!("--node-labels={NODE_TYPE_LABEL}=real"),
            ],
            &path,
            &confinement,
        )?;
        let proxy = self.toolchain.bin("kube-proxy").to_path_buf();
        self.start_confined(
            &node.process("kube-proxy"),
            &proxy,
            vec![format!(
                "--config={}",
                layout.path("kube-proxy.yaml").display()
            )],
            &path,
            &confinement,
        )?;
        Ok(())
    }

    /// Create a probe pod on every real node, bound to it (no scheduling): it pulls the
    /// probe image from the registry through the bridge, gets a pod address from CNI, and
    /// asks its cluster's apiserver who it is through the `kubernetes` Service
    /// (in-cluster configuration). Created early, the pods start while the rest of the
    /// fleet does; [`Starting::await_real_nodes`] checks their outcome.
    pub(super) async fn start_probes(&self, clusters: &[&ControlPlane]) -> Result<()> {
        let images = self.node_images()?;
        for cp in clusters {
            for node in &self.state.cluster(&cp.name)?.real_nodes {
                let kubelet = self.process(&node.process("kubelet"))?;
                let pods: Api<Pod> = Api::namespaced(cp.client.clone(), PROBE_NAMESPACE);
                let pod = probe_pod(&node.name, &images.probe);
                let name = probe_name(&node.name);
                // The namespace's ServiceAccount appears shortly after the controller
                // manager starts; until then pods are refused.
                wait_for(&kubelet, &format!("pod {name} to be accepted"), || {
                    let (pods, pod) = (pods.clone(), pod.clone());
                    async move { pods.create(&PostParams::default(), &pod).await.is_ok() }
                })
                .await?;
            }
        }
        Ok(())
    }

    /// Wait until every real node is Ready, its kube-proxy has synced, and its probe
    /// pod has succeeded with a log (read through the apiserver from the kubelet) that
    /// names the pod's ServiceAccount; then delete the probe pods.
    pub(super) async fn await_real_nodes(&self, clusters: &[&ControlPlane]) -> Result<()> {
        for cp in clusters {
            for node in &self.state.cluster(&cp.name)?.real_nodes {
                let kubelet = self.process(&node.process("kubelet"))?;
                let proxy = self.process(&node.process("kube-proxy"))?;
                let nodes: Api<Node> = Api::all(cp.client.clone());
                let name = node.name.clone();
                wait_for(&kubelet, &format!("Node {name} to be Ready"), || {
                    let (nodes, name) = (nodes.clone(), name.clone());
                    async move { nodes.get(&name).await.is_ok_and(|n| node_ready(&n)) }
                })
                .await?;
                let ip = node.ip;
                wait_for(
                    &proxy,
                    "kube-proxy's first sync (/healthz)",
                    || async move {
                        http_get_plain(ip.into(), KUBE_PROXY_HEALTHZ_PORT, "/healthz")
                            .await
                            .is_some()
                    },
                )
                .await?;
                let pods: Api<Pod> = Api::namespaced(cp.client.clone(), PROBE_NAMESPACE);
                check_probe(&kubelet, &pods, &probe_name(&node.name)).await?;
            }
        }
        Ok(())
    }

    fn process(&self, name: &str) -> Result<Tracked> {
        self.state
            .processes
            .iter()
            .find(|p| p.name == name)
            .cloned()
            .ok_or_else(|| Error::Invalid(format!("the fleet has no process {name}")))
    }

    fn node_images(&self) -> Result<&images::NodeImages> {
        self.state
            .node_images
            .as_ref()
            .ok_or_else(|| Error::Invalid("the node images are pushed with the registry".into()))
    }
}

const PROBE_NAMESPACE: &str = "default";

/// Wait for probe pod `name` to finish; fail with its phase and log unless it succeeded
/// and named its ServiceAccount.
async fn check_probe(kubelet: &Tracked, pods: &Api<Pod>, name: &str) -> Result<()> {
    let phase = |pod: Option<Pod>| {
        pod.and_then(|p| p.status)
            .and_then(|s| s.phase)
            .unwrap_or_default()
    };
    wait_for(kubelet, &format!("probe pod {name} to finish"), || {
        let (pods, name) = (pods.clone(), name.to_string());
        async move {
            let now = phase(pods.get(&name).await.ok());
            now == "Succeeded" || now == "Failed"
        }
    })
    .await?;
    let phase = phase(Some(pods.get(name).await?));
    let log = pods
        .logs(name, &LogParams::default())
        .await
        .unwrap_or_else(|e| format!("(no log: {e})"));
    let identity = format!("system:serviceaccount:{PROBE_NAMESPACE}:default");
    if phase != "Succeeded" || !log.contains(&identity) {
        return Err(Error::Component {
            component: kubelet.name.clone(),
            reason: format!(
                "probe pod {name} ended {phase}; it did not reach the apiserver in-cluster \
                 as {identity}; its log:\n{log}"
            ),
            log: kubelet.log.clone(),
        });
    }
    pods.delete(name, &DeleteParams::background()).await?;
    Ok(())
}

fn probe_name(node: &str) -> String {
    format!("kmm-fleet-probe-{node}")
}

/// A pod on `node` asking the apiserver, through the `kubernetes` Service and with its
/// ServiceAccount token, who it is (the probe prints the SelfSubjectReview's answer).
fn probe_pod(node: &str, probe: &str) -> Pod {
    serde_json::from_value(json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": { "name": probe_name(node) },
        "spec": {
            "nodeName": node,
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 0,
            "containers": [{ "name": "probe", "image": probe }],
        },
    }))
    .expect("a literal Pod")
}

fn write(path: &Path, text: &str) -> Result<()> {
    std::fs::write(path, text).context(|| format!("writing {}", path.display()))
}

fn write_json(path: &Path, value: &Value) -> Result<()> {
    let text = serde_json::to_string_pretty(value).map_err(|e| Error::Invalid(e.to_string()))?;
    write(path, &text)
}

/// containerd's `hosts.toml`: pull from the fleet registry over plain HTTP.
fn registry_hosts(registry: &str) -> String {
    format!(
        "server = \"http://{registry}\"\n\n[host.\"http://{registry}\"]\n  capabilities = [\"pull\", \"resolve\"]\n"
    )
}

/// containerd's configuration: state in the node's directory (persistent) and its
/// private `/run/containerd`; the sandbox image from the fleet's registry.
fn containerd_config(dir: &Path, ip: Ipv4Addr, pause: &str) -> Result<String> {
    let p = |relative: &str| dir.join(relative).display().to_string();
    let config = json!({
        "version": 2,
        "root": p("containerd/root"),
        "state": "/run/containerd",
        "disabled_plugins": [
            "io.containerd.snapshotter.v1.aufs",
            "io.containerd.snapshotter.v1.btrfs",
            "io.containerd.snapshotter.v1.devmapper",
            "io.containerd.snapshotter.v1.zfs",
            "io.containerd.tracing.processor.v1.otlp",
        ],
        "grpc": { "address": CONTAINERD_SOCKET },
        "metrics": { "address": format!("{ip}:{CONTAINERD_METRICS_PORT}") },
        "plugins": {
            // Defaults to /opt/containerd on the host.
            "io.containerd.internal.v1.opt": { "path": p("containerd/opt") },
            "io.containerd.grpc.v1.cri": {
                "sandbox_image": pause,
                // Without it every sandbox fails: the kubelet asks for oom_score_adj
                // -998, which needs CAP_SYS_RESOURCE.
                "restrict_oom_score_adj": true,
                "containerd": {
                    "snapshotter": "overlayfs",
                    "default_runtime_name": "runc",
                    "runtimes": { "runc": { "runtime_type": "io.containerd.runc.v2" } },
                },
                "cni": { "bin_dir": CNI_BIN_DIR, "conf_dir": p("cni") },
                "registry": { "config_path": p("containerd/certs.d") },
            },
        },
    });
    toml::to_string(&config).map_err(|e| Error::Invalid(format!("containerd config: {e}")))
}

/// One bridge (`cni0`, the pods' gateway) per node with host-local addresses from the
/// lower half of its pod subnet (KWOK's Pods, run by `kwok-pod-runner` in this node's
/// network, take the upper half); no masquerading: the host routes the subnet to the node.
fn cni_config(pod_cidr: &str) -> Value {
    let range_end = pod_cidr.replace("0/24", "127");
    json!({
        "cniVersion": "0.4.0",
        "name": "kmm-fleet",
        "plugins": [
            {
                "type": "bridge",
                "bridge": "cni0",
                "isGateway": true,
                "ipMasq": false,
                "hairpinMode": true,
                "ipam": {
                    "type": "host-local",
                    "ranges": [[{ "subnet": pod_cidr, "rangeEnd": range_end }]],
                    "routes": [{ "dst": "0.0.0.0/0" }],
                },
            },
            { "type": "portmap", "capabilities": { "portMappings": true } },
        ],
    })
}

fn kubelet_config(node: &RealNode, ca: &Path, serving: &crate::pki::Pair) -> Value {
    json!({
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        "cgroupDriver": "cgroupfs",
        // Mounted Secrets and ConfigMaps (OCM's renewed client certificate) follow their
        // objects within seconds rather than the default minute.
        "syncFrequency": "10s",
        "cgroupRoot": format!("/{}", node.netns),
        "failCgroupV1": false,
        "failSwapOn": false,
        // Otherwise it installs KUBE-FIREWALL rules (in the node's namespace, but
        // nothing needs them).
        "makeIPTablesUtilChains": false,
        "address": node.ip.to_string(),
        "port": KUBELET_PORT,
        "readOnlyPort": 0,
        "healthzBindAddress": node.ip.to_string(),
        "healthzPort": KUBELET_HEALTHZ_PORT,
        "tlsCertFile": serving.cert,
        "tlsPrivateKeyFile": serving.key,
        // The apiserver (logs, exec) presents a client certificate from the cluster CA.
        "authentication": {
            "anonymous": { "enabled": false },
            "webhook": { "enabled": true },
            "x509": { "clientCAFile": ca },
        },
        "authorization": { "mode": "Webhook" },
        "containerRuntimeEndpoint": format!("unix://{CONTAINERD_SOCKET}"),
        // Pods get no name servers: nothing outside the fleet is reachable anyway.
        "resolvConf": "",
        // A throwaway node on a shared development disk: evict only when it is
        // really full, not at the default 10-15% free.
        "evictionHard": {
            "memory.available": "100Mi",
            "nodefs.available": "1%",
            "imagefs.available": "1%",
            "nodefs.inodesFree": "1%",
        },
    })
}

fn kube_proxy_config(node: &RealNode, kubeconfig: &Path) -> Value {
    json!({
        "apiVersion": "kubeproxy.config.k8s.io/v1alpha1",
        "kind": "KubeProxyConfiguration",
        "clientConnection": { "kubeconfig": kubeconfig },
        "hostnameOverride": node.name,
        "mode": "iptables",
        "clusterCIDR": POD_RANGE,
        "healthzBindAddress": format!("{}:{KUBE_PROXY_HEALTHZ_PORT}", node.ip),
        "metricsBindAddress": format!("{}:{KUBE_PROXY_METRICS_PORT}", node.ip),
        // Node ports on the node's address only: no route_localnet sysctl.
        "nodePortAddresses": [format!("{}/32", node.ip)],
        "iptables": { "localhostNodePorts": false },
        // nf_conntrack_max and the hash size are global, not per namespace: leave
        // them (and the timeouts) alone.
        "conntrack": {
            "maxPerCore": 0,
            "min": 0,
            "tcpEstablishedTimeout": "0s",
            "tcpCloseWaitTimeout": "0s",
        },
    })
}

/// How long `down` gives a node's leftover processes to die after SIGKILL.
const SWEEP_GRACE: Duration = Duration::from_secs(10);

/// Stop everything left in the fleet's node cgroups (containerd's shims and the
/// containers; the daemons themselves were stopped by PID) and remove the cgroups.
pub(super) fn remove_cgroups(prefix: &str) -> Result<()> {
    for root in cgroup::roots_with_prefix(&format!("{prefix}-"))? {
        cgroup::remove(&root, SWEEP_GRACE)?;
    }
    Ok(())
}

/// Whether the kubelet (or KWOK) reports the node Ready.
pub fn node_ready(node: &Node) -> bool {
    node.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node() -> RealNode {
        RealNode {
            name: "spoke1-real1".into(),
            cluster: "spoke1".into(),
            ip: Ipv4Addr::new(198, 18, 16, 11),
            pod_cidr: "198.19.129.0/24".into(),
            kernel: "6.1.0-56-amd64".into(),
            netns: "kmmf16000-spoke1-real1".into(),
            dir: "/state/spoke1/real-nodes/spoke1-real1".into(),
        }
    }

    #[test]
    fn containerd_config_is_toml_with_the_measured_settings() {
        let node = node();
        let text = containerd_config(&node.dir, node.ip, "198.18.16.1:16005/p:1").unwrap();
        let parsed: toml::Table = toml::from_str(&text).unwrap();
        let cri = &parsed["plugins"]["io.containerd.grpc.v1.cri"];
        assert_eq!(cri["restrict_oom_score_adj"].as_bool(), Some(true));
        assert_eq!(cri["sandbox_image"].as_str(), Some("198.18.16.1:16005/p:1"));
        assert_eq!(parsed["version"].as_integer(), Some(2));
        assert_eq!(parsed["state"].as_str(), Some("/run/containerd"));
    }

    #[test]
    fn kubelet_runs_below_its_own_cgroup_root_without_host_side_effects() {
        let node = node();
        let pair = crate::pki::Pair {
            cert: "/c".into(),
            key: "/k".into(),
        };
        let config = kubelet_config(&node, Path::new("/ca"), &pair);
        assert_eq!(config["cgroupRoot"], "/kmmf16000-spoke1-real1");
        assert_eq!(config["makeIPTablesUtilChains"], false);
        assert_eq!(config["failCgroupV1"], false);
        assert_eq!(config["readOnlyPort"], 0);
        let proxy = kube_proxy_config(&node, Path::new("/kc"));
        assert_eq!(proxy["conntrack"]["maxPerCore"], 0);
    }

    #[test]
    fn mountinfo_escapes_are_decoded() {
        assert_eq!(unescape_mountinfo("/a\\040b/c"), "/a b/c");
        assert_eq!(unescape_mountinfo("/plain"), "/plain");
        assert_eq!(unescape_mountinfo("/x\\"), "/x\\");
    }
}
