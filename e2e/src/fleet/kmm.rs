//! kmm-fleet's own components in the local fleet, deployed the way a user deploys them:
//!
//! * `kmm-hub` runs as Pods on the hub's real node from the images the fleet builds,
//!   installed with `kubectl apply -k` of an overlay of `addon-manifests/hub`
//!   ([`hub_install`]), which also installs the add-on (`ClusterManagementAddOn` kmm, its
//!   `AddOnTemplate` and `AddOnDeploymentConfig`);
//! * every spoke gets the add-on with `clusteradm addon enable --names kmm`: OCM's
//!   addon-manager renders the template into a ManifestWork, signs the proxy's client
//!   certificate with kmm-hub's CA, and reports health. The proxy and the node agents on
//!   real nodes are Pods; the fleet issues no certificate for any kmm component;
//! * on KWOK nodes, whose Pods are API objects only, `kwok-pod-runner` (one per spoke)
//!   runs the agent binary as a process per Pod with the command, arguments,
//!   environment and volumes of the Pod OCM's DaemonSet created: the only simulated
//!   part. Agents everywhere use the simulated kernel backend (the overlay's patch):
//!   this machine's kernel cannot load modules.

use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::authentication::v1::{BoundObjectReference, TokenRequest, TokenRequestSpec};
use k8s_openapi::api::core::v1::{Pod, Secret, ServiceAccount};
use kmm_api::ocm::MANAGED_CLUSTER_ADD_ON;
use kmm_runtime::pki::CertificateAuthority;
use kube::api::{DeleteParams, DynamicObject, ListParams, PostParams};
use kube::{Api, Client, ResourceExt};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::{ControlPlane, Starting, condition_true, hub_install};
use crate::wait::wait_until;
use crate::{Error, IoContext, Result, kmod_builder};

/// The hub's namespace: its CA Secret and the pull secrets modules reference.
pub const HUB_NAMESPACE: &str = "kmm-hub";
/// The add-on's namespace on every spoke.
pub const SPOKE_NAMESPACE: &str = "kmm";
/// The add-on's name: the ClusterManagementAddOn, and every ManagedClusterAddOn.
pub const ADDON: &str = "kmm";
pub const AGENT_SERVICE_ACCOUNT: &str = "kmm-node-agent";
/// Audience of the agents' tokens; the proxy accepts no other.
pub const TOKEN_AUDIENCE: &str = "kmm-spoke-proxy";
/// The Secret OCM's registration agent writes the proxy's hub client certificate to
/// (`<addon>-<signer, "/" -> "-">-client-cert`), in the add-on's namespace.
pub const CLIENT_CERT_SECRET: &str = "kmm-kmm.sigs.x-k8s.io-hub-client-client-cert";
const HUB_CA_SECRET: &str = "kmm-hub-ca";
/// Modules carrying this label belong to a hub started by a test, not the fleet's.
pub const TEST_HUB_LABEL: &str = "test.kmm.sigs.x-k8s.io/hub";
pub const PROXY_LABEL: &str = "app.kubernetes.io/name=kmm-spoke-proxy";
pub const AGENT_LABEL: &str = "app.kubernetes.io/name=kmm-node-agent";
const AGENT_DAEMONSET: &str = "kmm-node-agent";
/// The proxy's and the agents' ports, as the AddOnTemplate sets them.
pub const PROXY_AGENTS_PORT: u16 = 7444;
pub const PROXY_METRICS_PORT: u16 = 8081;
pub const AGENT_METRICS_PORT: u16 = 8082;
/// kmm-hub's `--metrics-addr` port (addon-manifests/hub/deployment.yaml).
pub const HUB_METRICS_PORT: u16 = 8080;
/// KWOK's Pods are marked running with an IP from this part of the spoke's real node's
/// pod subnet (the CNI's host-local range keeps to the lower half).
pub const KWOK_POD_RANGE: &str = "128/25";
/// From `clusteradm addon enable` to the add-on Available and every agent ready, image
/// pulls on a fresh node included.
const ENABLE_TIMEOUT: Duration = Duration::from_secs(180);
/// The agent name in the proxy's certificate subject (OCM's `<addon>-agent` default).
const PROXY_AGENT_NAME: &str = "kmm-agent";
const TOKEN_LIFETIME: i64 = 7 * 24 * 3600;

/// Where kmm-fleet's components of a running fleet are.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Kmm {
    /// `host:port` of the hub's gRPC endpoint for proxies: the NodePort of the Service
    /// that selects the leading replica, on the hub's real node.
    pub hub_grpc: String,
    /// The hub CA's certificate (what the proxies trust the hub's serving certificate by).
    pub hub_ca: PathBuf,
    /// Spokes with the add-on enabled.
    pub spokes: Vec<String>,
    pub agents: Vec<Agent>,
}

/// The node agent of one node.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Agent {
    pub cluster: String,
    pub node: String,
    /// The node's root filesystem as the host sees it: the agent's hostPath volumes
    /// (`run/kmm`, the simulated kernel in `var/lib/kmm/simulated-kernel`) are below.
    /// For a KWOK node, the runner's directory of that node; for a real node, its
    /// private mount namespace through `/proc/<kubelet>/root`.
    pub root: PathBuf,
    /// Whether it runs under `kwok-pod-runner` (else it is a real node's Pod).
    pub simulated: bool,
}

impl Agent {
    /// The agent's state file: what it loaded.
    pub fn state_file(&self) -> PathBuf {
        self.root.join("run/kmm/state.json")
    }

    /// The node's simulated kernel.
    pub fn kernel_dir(&self) -> PathBuf {
        self.root
            .join(hub_install::SIMULATED_KERNEL_DIR.trim_start_matches('/'))
    }

    /// The simulated kernel's log of module inserts and removals (the node agent's
    /// `kernel::simulated::KERNEL_LOG`): `<ns since the epoch> insert|remove <module>`.
    pub fn kernel_log(&self) -> PathBuf {
        self.kernel_dir().join("kmsg")
    }

    /// The runner's power switch of a KWOK node: while the file exists the node is off.
    fn power_switch(&self) -> Result<PathBuf> {
        if !self.simulated {
            return Err(Error::Invalid(format!(
                "{} is a real node: only KWOK nodes have a power switch",
                self.node
            )));
        }
        Ok(self.root.parent().unwrap_or(&self.root).join("powered-off"))
    }

    /// The PID of this node's agent process, if `kwok-pod-runner` runs it now (from the
    /// runner's `status.json`).
    pub fn runner_pid(&self) -> Option<u64> {
        let status = self.root.parent()?.parent()?.join("status.json");
        let text = std::fs::read_to_string(status).ok()?;
        runner_pid(&text, &self.node)
    }

    /// Whether `kwok-pod-runner` runs this node's agent now.
    pub fn running(&self) -> bool {
        self.runner_pid().is_some()
    }

    /// Cuts the node's power: `kwok-pod-runner` kills its agent (SIGKILL) and starts
    /// nothing there until [`Agent::power_on`].
    pub async fn power_off(&self) -> Result<()> {
        let switch = self.power_switch()?;
        std::fs::write(&switch, b"").context(|| format!("writing {}", switch.display()))?;
        wait_until(
            &format!("the runner to stop the agent of {}", self.node),
            ENABLE_TIMEOUT,
            || async {
                match self.running() {
                    false => Ok(()),
                    true => Err("the agent still runs".to_owned()),
                }
            },
        )
        .await
    }

    pub fn power_on(&self) -> Result<()> {
        let switch = self.power_switch()?;
        std::fs::remove_file(&switch).context(|| format!("removing {}", switch.display()))
    }
}

/// The PID `kwok-pod-runner`'s `status.json` records for `node`'s agent, if running.
fn runner_pid(status: &str, node: &str) -> Option<u64> {
    let status: Value = serde_json::from_str(status).ok()?;
    status["containers"]
        .as_array()?
        .iter()
        .filter(|p| p["node"] == node)
        .find_map(|p| p["pid"].as_u64())
}

/// The kmm-fleet binaries the fleet runs as processes: the node agent (on KWOK nodes)
/// and the runner that starts it.
#[derive(Debug, Clone)]
pub struct Binaries {
    pub agent: PathBuf,
    pub runner: PathBuf,
}

impl Binaries {
    /// Both from `$KMM_BIN_DIR` when it is set. Otherwise the agent the images hold, from
    /// `release` (the build `kmm_images::build` made), so that simulated nodes run what
    /// real nodes run, and the runner from the workspace's `target/debug`. Fails naming
    /// the missing binary and the command that builds it.
    pub fn locate(release: &Path) -> Result<Self> {
        let chosen = std::env::var_os("KMM_BIN_DIR").map(PathBuf::from);
        let find = |dir: &Path, name: &str, built_by: &str| {
            let path = dir.join(name);
            if path.is_file() {
                Ok(path)
            } else {
                Err(Error::Invalid(format!(
                    "{} is missing; {built_by} builds it",
                    path.display()
                )))
            }
        };
        let (agent_dir, agent_built_by) = match &chosen {
            Some(dir) => (dir.as_path(), "`cargo build --bins`"),
            None => (release, "`cargo xtask images`"),
        };
        Ok(Self {
            agent: find(agent_dir, "kmm-node-agent", agent_built_by)?,
            runner: find(
                &crate::binaries::dir(),
                "kwok-pod-runner",
                "`cargo build --bins` (`cargo xtask env up` and `cargo xtask test` do)",
            )?,
        })
    }

    /// Copies the binaries into the fleet's own directory, so that rebuilding the
    /// workspace never changes (or, for the liveness check, kills) a running fleet.
    fn copy_to(self, dir: &Path) -> Result<Self> {
        std::fs::create_dir_all(dir).context(|| format!("creating {}", dir.display()))?;
        let copy = |from: &Path| {
            let to = dir.join(from.file_name().unwrap_or_default());
            std::fs::copy(from, &to)
                .context(|| format!("copying {} to {}", from.display(), to.display()))?;
            Ok::<_, Error>(to)
        };
        Ok(Self {
            agent: copy(&self.agent)?,
            runner: copy(&self.runner)?,
        })
    }
}

impl Starting {
    /// Installs the hub, starts a KWOK runner per spoke, enables the add-on on every
    /// spoke and waits until each reports Available with every node's agent ready.
    pub(super) async fn kmm(&mut self, hub: &ControlPlane, spokes: &[ControlPlane]) -> Result<()> {
        let kmm_dir = self.dir.join("kmm");
        std::fs::create_dir_all(&kmm_dir).context(|| format!("creating {}", kmm_dir.display()))?;

        // kmm-hub and the add-on as a user installs them: images in the registry,
        // `kubectl apply -k`.
        let registry = self.state.registry.clone();
        let built = tokio::task::spawn_blocking(move || {
            kmm_images::build(&kmm_images::Options::new(Some(registry)))
        })
        .await
        .map_err(|e| Error::Invalid(format!("building the images panicked: {e}")))??;
        let binaries = Binaries::locate(&built.release_dir)?.copy_to(&kmm_dir.join("bin"))?;
        let tag = built
            .images
            .first()
            .and_then(|i| i.reference.rsplit_once(':'))
            .map(|(_, tag)| tag.to_owned())
            .ok_or_else(|| Error::Invalid("no image was built".into()))?;
        // What the hub's builds start FROM here: the headers of the kernel no sample image
        // exists for.
        let registry = self.state.registry.clone();
        let kernel = self.versions.kernels.without_image.clone();
        let base =
            tokio::task::spawn_blocking(move || kmod_builder::ensure(&kernel, Some(&registry)))
                .await
                .map_err(|e| {
                    Error::Invalid(format!("building the kmod builder base panicked: {e}"))
                })??;
        println!(
            "fleet: {} pushed ({})",
            base.pushed.as_deref().unwrap_or(&base.reference),
            if base.rebuilt { "built" } else { "unchanged" }
        );
        let node_ip = self
            .state
            .cluster(&hub.name)?
            .real_nodes
            .first()
            .map(|n| n.ip.to_string())
            .ok_or_else(|| {
                Error::Invalid("kmm-hub runs on the hub's real node, and there is none".into())
            })?;
        let installed = Instant::now();
        hub_install::apply(
            self.toolchain.bin("kubectl"),
            &hub.kubeconfig,
            &kmm_dir.join("hub-install"),
            &hub_install::Overlay {
                registry: &self.state.node_registry,
                tag: &tag,
                node_ip: &node_ip,
            },
        )?;
        let leader = hub_install::wait_installed(&hub.client).await?;
        println!(
            "fleet: kmm-hub installed (kubectl apply -k) and ready in {:.1}s; leader {leader}",
            installed.elapsed().as_secs_f64()
        );
        let ca = hub_ca(&hub.client).await?;
        let hub_ca = kmm_dir.join("hub-ca.crt");
        std::fs::write(&hub_ca, ca.cert_pem())
            .context(|| format!("writing {}", hub_ca.display()))?;

        let mut agents = vec![];
        for spoke in spokes {
            agents.extend(self.kwok_runner(spoke, &binaries)?);
        }
        let names: Vec<String> = spokes.iter().map(|s| s.name.clone()).collect();
        let enabled = Instant::now();
        enable(self.toolchain.bin("clusteradm"), &hub.kubeconfig, &names)?;
        for spoke in spokes {
            wait_available(&hub.client, &spoke.name, ENABLE_TIMEOUT).await?;
            let available = enabled.elapsed();
            wait_agents_ready(&spoke.client, ENABLE_TIMEOUT).await?;
            println!(
                "fleet: add-on kmm on {}: Available {:.1}s and every agent ready {:.1}s after \
                 `clusteradm addon enable`",
                spoke.name,
                available.as_secs_f64(),
                enabled.elapsed().as_secs_f64()
            );
        }
        self.state.kmm = Some(Kmm {
            hub_grpc: format!("{node_ip}:{}", hub_install::GRPC_NODE_PORT),
            hub_ca,
            spokes: names,
            agents,
        });
        self.state.save(&self.dir)
    }

    /// Starts `kwok-pod-runner` for `spoke` (its agents' processes run in the network
    /// namespace of the spoke's first real node) and returns every node's agent.
    fn kwok_runner(&mut self, spoke: &ControlPlane, binaries: &Binaries) -> Result<Vec<Agent>> {
        let cluster = self.state.cluster(&spoke.name)?.clone();
        let real = cluster.real_nodes.first().ok_or_else(|| {
            Error::Invalid(format!(
                "{}: KWOK nodes' agents run in a real node's network, and there is none",
                spoke.name
            ))
        })?;
        let root = spoke.dir.join("kwok-pods");
        let mut agents = vec![];
        for node in &cluster.nodes {
            let agent = Agent {
                cluster: spoke.name.clone(),
                node: node.name.clone(),
                root: root.join(&node.name).join("host"),
                simulated: true,
            };
            // The simulated node's `uname -r`.
            let kernel = agent.kernel_dir();
            std::fs::create_dir_all(&kernel)
                .context(|| format!("creating {}", kernel.display()))?;
            std::fs::write(kernel.join("release"), &node.kernel)
                .context(|| format!("writing {}", kernel.join("release").display()))?;
            agents.push(agent);
        }
        let kubelet = self
            .state
            .processes
            .iter()
            .find(|p| p.name == real.process("kubelet"))
            .map(|p| p.pid)
            .ok_or_else(|| Error::Invalid(format!("{}: no kubelet process", real.name)))?;
        for node in &cluster.real_nodes {
            agents.push(Agent {
                cluster: spoke.name.clone(),
                node: node.name.clone(),
                root: PathBuf::from(format!("/proc/{kubelet}/root")),
                simulated: false,
            });
        }
        let logs = self
            .dir
            .join("logs")
            .join(format!("{}-kwok-pods", spoke.name));
        std::fs::create_dir_all(&logs).context(|| format!("creating {}", logs.display()))?;
        self.start_program(
            &format!("{}/kwok-pod-runner", spoke.name),
            &binaries.runner,
            vec![
                format!("--kubeconfig={}", spoke.kubeconfig.display()),
                format!("--namespace={SPOKE_NAMESPACE}"),
                format!("--selector={AGENT_LABEL}"),
                format!("--node-annotation={}=fake", super::KWOK_NODE_ANNOTATION),
                format!("--netns={}", real.netns),
                format!("--root={}", root.display()),
                format!(
                    "--program=/usr/local/bin/kmm-node-agent={}",
                    binaries.agent.display()
                ),
                format!("--logs={}", logs.display()),
            ],
            &[],
        )?;
        Ok(agents)
    }
}

/// The resident memory of kmm's spoke components: the proxy and agent containers on the
/// real nodes (found in the nodes' cgroups) and the KWOK agents' processes.
pub fn memory_lines(state: &super::State, kmm: &Kmm) -> Vec<String> {
    let mut found: Vec<(String, i32)> = vec![];
    for node in state
        .real_nodes()
        .filter(|n| kmm.spokes.contains(&n.cluster))
    {
        for pid in node.processes().unwrap_or_default() {
            let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
            if comm.trim().starts_with("kmm-") {
                found.push((format!("{} {} (Pod)", node.name, comm.trim()), pid));
            }
        }
    }
    for agent in kmm.agents.iter().filter(|a| a.simulated) {
        if let Some(pid) = agent.runner_pid() {
            let pid = i32::try_from(pid).unwrap_or_default();
            found.push((format!("{} kmm-node-agent (KWOK runner)", agent.node), pid));
        }
    }
    found
        .into_iter()
        .filter_map(|(what, pid)| {
            let (rss, peak) = crate::process::memory_kib(pid)?;
            Some(format!(
                "kmm {what:<48} pid {pid:<8} rss {:>4} MiB  peak {:>4} MiB",
                rss / 1024,
                peak / 1024
            ))
        })
        .collect()
}

/// `clusteradm addon enable --names kmm --clusters <clusters>` against the hub.
pub fn enable(clusteradm: &Path, hub_kubeconfig: &Path, clusters: &[String]) -> Result<()> {
    clusteradm_addon(clusteradm, hub_kubeconfig, "enable", clusters)
}

/// `clusteradm addon disable --names kmm --clusters <clusters>`.
pub fn disable(clusteradm: &Path, hub_kubeconfig: &Path, clusters: &[String]) -> Result<()> {
    clusteradm_addon(clusteradm, hub_kubeconfig, "disable", clusters)
}

fn clusteradm_addon(
    clusteradm: &Path,
    hub_kubeconfig: &Path,
    verb: &str,
    clusters: &[String],
) -> Result<()> {
    let out = crate::process::run(
        std::process::Command::new(clusteradm)
            .args(["addon", verb, "--names", ADDON, "--clusters"])
            .arg(clusters.join(","))
            .arg("--kubeconfig")
            .arg(hub_kubeconfig),
    )?;
    println!("fleet: clusteradm addon {verb}: {}", out.trim());
    Ok(())
}

/// The ManagedClusterAddOns on the hub, in `cluster`'s namespace.
pub fn addons(hub: &Client, cluster: &str) -> Api<DynamicObject> {
    Api::namespaced_with(hub.clone(), cluster, &MANAGED_CLUSTER_ADD_ON.api_resource())
}

/// Waits until the add-on on `cluster` is Available on the hub (OCM's health check: the
/// proxy ready, i.e. connected to the hub, and every agent Pod ready).
pub async fn wait_available(hub: &Client, cluster: &str, timeout: Duration) -> Result<()> {
    let api = addons(hub, cluster);
    wait_until(
        &format!("ManagedClusterAddOn {cluster}/{ADDON} to be Available"),
        timeout,
        || {
            let api = api.clone();
            async move {
                let addon = api
                    .get_opt(ADDON)
                    .await
                    .map_err(|e| e.to_string())?
                    .ok_or("no ManagedClusterAddOn")?;
                if condition_true(&addon.data, "Available") {
                    Ok(())
                } else {
                    Err(format!("conditions {}", addon.data["status"]["conditions"]))
                }
            }
        },
    )
    .await
}

/// Waits until the agents' DaemonSet covers every node and each agent answers `/readyz`
/// (real Pods and KWOK runner processes alike: KWOK marks its Pods ready regardless).
pub async fn wait_agents_ready(spoke: &Client, timeout: Duration) -> Result<()> {
    wait_until("every node's agent to be ready", timeout, || async {
        let daemonsets: Api<DaemonSet> = Api::namespaced(spoke.clone(), SPOKE_NAMESPACE);
        let status = daemonsets
            .get_opt(AGENT_DAEMONSET)
            .await
            .map_err(|e| e.to_string())?
            .ok_or("no DaemonSet")?
            .status
            .unwrap_or_default();
        if status.desired_number_scheduled == 0
            || status.number_ready < status.desired_number_scheduled
        {
            return Err(format!(
                "{} of {} agent Pods ready",
                status.number_ready, status.desired_number_scheduled
            ));
        }
        let pods = pods(spoke, AGENT_LABEL).await.map_err(|e| e.to_string())?;
        let mut waiting = vec![];
        for pod in &pods {
            if !answers_ok(pod, AGENT_METRICS_PORT, "/readyz").await {
                waiting.push(
                    pod.spec
                        .as_ref()
                        .and_then(|s| s.node_name.clone())
                        .unwrap_or_default(),
                );
            }
        }
        match waiting.is_empty() {
            true => Ok(()),
            false => Err(format!("not ready on {}", waiting.join(", "))),
        }
    })
    .await
}

async fn pods(spoke: &Client, selector: &str) -> Result<Vec<Pod>> {
    let api: Api<Pod> = Api::namespaced(spoke.clone(), SPOKE_NAMESPACE);
    Ok(api
        .list(&ListParams::default().labels(selector))
        .await?
        .items
        .into_iter()
        .filter(|p| p.metadata.deletion_timestamp.is_none())
        .collect())
}

fn pod_ip(pod: &Pod) -> Option<IpAddr> {
    pod.status.as_ref()?.pod_ip.as_ref()?.parse().ok()
}

async fn answers_ok(pod: &Pod, port: u16, path: &str) -> bool {
    match pod_ip(pod) {
        Some(ip) => super::http_get_plain(ip, port, path)
            .await
            .is_some_and(|body| body.trim() == "ok"),
        None => false,
    }
}

/// The agent Pod on `node`.
pub async fn agent_pod(spoke: &Client, node: &str) -> Result<Pod> {
    pods(spoke, AGENT_LABEL)
        .await?
        .into_iter()
        .find(|p| p.spec.as_ref().and_then(|s| s.node_name.as_deref()) == Some(node))
        .ok_or_else(|| Error::Invalid(format!("no kmm-node-agent Pod on {node}")))
}

/// The proxy's Pod.
pub async fn proxy_pod(spoke: &Client) -> Result<Pod> {
    pods(spoke, PROXY_LABEL)
        .await?
        .into_iter()
        .next()
        .ok_or_else(|| Error::Invalid("no kmm-spoke-proxy Pod".into()))
}

async fn get(pod: &Pod, port: u16, path: &str) -> Result<String> {
    let ip = pod_ip(pod)
        .ok_or_else(|| Error::Invalid(format!("Pod {} has no IP yet", pod.name_any())))?;
    super::http_get_plain(ip, port, path)
        .await
        .ok_or_else(|| Error::Invalid(format!("no {path} on {ip}:{port} ({})", pod.name_any())))
}

/// The `/metrics` text of the agent on `node`.
pub async fn agent_metrics(spoke: &Client, node: &str) -> Result<String> {
    get(
        &agent_pod(spoke, node).await?,
        AGENT_METRICS_PORT,
        "/metrics",
    )
    .await
}

/// The `/metrics` text of every kmm-hub replica on the hub (the leader's and the
/// standby's).
pub async fn hub_metrics(hub: &Client) -> Result<Vec<String>> {
    let mut texts = vec![];
    for pod in hub_install::pods(hub).await? {
        texts.push(get(&pod, HUB_METRICS_PORT, "/metrics").await?);
    }
    Ok(texts)
}

/// The `/metrics` text of the spoke's proxy.
pub async fn proxy_metrics(spoke: &Client) -> Result<String> {
    get(&proxy_pod(spoke).await?, PROXY_METRICS_PORT, "/metrics").await
}

/// Waits until the spoke's proxy answers `/readyz` (it is connected to the hub).
pub async fn wait_proxy_ready(spoke: &Client, timeout: Duration) -> Result<()> {
    wait_until("the proxy to be ready", timeout, || async {
        let pod = proxy_pod(spoke).await.map_err(|e| e.to_string())?;
        match answers_ok(&pod, PROXY_METRICS_PORT, "/readyz").await {
            true => Ok(()),
            false => Err(format!("{} not ready", pod.name_any())),
        }
    })
    .await
}

/// `ip:port` of the proxy's agent endpoint (the Pod's address, routed from the host).
pub async fn proxy_agent_endpoint(spoke: &Client) -> Result<String> {
    let pod = proxy_pod(spoke).await?;
    let ip = pod_ip(&pod).ok_or_else(|| Error::Invalid("the proxy Pod has no IP".into()))?;
    Ok(format!("{ip}:{PROXY_AGENTS_PORT}"))
}

/// Deletes `old` (its controller creates a replacement, on the same node for an agent) and
/// waits until the replacement answers `/readyz`; returns it.
async fn replace_pod(spoke: &Client, old: Pod, port: u16, timeout: Duration) -> Result<Pod> {
    let api: Api<Pod> = Api::namespaced(spoke.clone(), SPOKE_NAMESPACE);
    let (name, uid) = (old.name_any(), old.uid());
    let labels = old.labels().clone();
    let node = old.spec.as_ref().and_then(|s| s.node_name.clone());
    api.delete(&name, &DeleteParams::default()).await?;
    let selector = labels
        .get("app.kubernetes.io/name")
        .map(|n| format!("app.kubernetes.io/name={n}"))
        .unwrap_or_default();
    wait_until(
        &format!("a ready replacement of Pod {name}"),
        timeout,
        || async {
            let pods = pods(spoke, &selector).await.map_err(|e| e.to_string())?;
            let Some(new) = pods.into_iter().find(|p| {
                p.uid() != uid
                    && (node.is_none() || p.spec.as_ref().and_then(|s| s.node_name.clone()) == node)
            }) else {
                return Err("no replacement yet".to_owned());
            };
            if answers_ok(&new, port, "/readyz").await {
                Ok(new)
            } else {
                Err(format!("{} not ready", new.name_any()))
            }
        },
    )
    .await
}

/// Restarts the agent on `node` the way the DaemonSet would: its Pod is deleted and the
/// replacement's agent (a container, or a runner process) comes up ready.
pub async fn restart_agent(spoke: &Client, node: &str, timeout: Duration) -> Result<()> {
    let old = agent_pod(spoke, node).await?;
    replace_pod(spoke, old, AGENT_METRICS_PORT, timeout).await?;
    Ok(())
}

/// Restarts the proxy (its Pod is deleted; the Deployment creates another) and waits
/// until the new one is ready, i.e. connected to the hub.
pub async fn restart_proxy(spoke: &Client, timeout: Duration) -> Result<()> {
    let old = proxy_pod(spoke).await?;
    replace_pod(spoke, old, PROXY_METRICS_PORT, timeout).await?;
    Ok(())
}

/// The hub's CA, read from the Secret the hub created.
async fn hub_ca(hub: &Client) -> Result<CertificateAuthority> {
    let (cert, key) = tls_pair(hub, HUB_NAMESPACE, HUB_CA_SECRET).await?;
    CertificateAuthority::from_pem(&cert, &key)
        .map_err(|e| Error::Invalid(format!("Secret {HUB_NAMESPACE}/{HUB_CA_SECRET}: {e}")))
}

/// `tls.crt` and `tls.key` (PEM) of Secret `namespace/name`.
async fn tls_pair(client: &Client, namespace: &str, name: &str) -> Result<(String, String)> {
    let secret = Api::<Secret>::namespaced(client.clone(), namespace)
        .get(name)
        .await?;
    let field = |key: &str| {
        secret
            .data
            .as_ref()
            .and_then(|d| d.get(key))
            .map(|v| String::from_utf8_lossy(&v.0).into_owned())
            .ok_or_else(|| Error::Invalid(format!("Secret {namespace}/{name} has no {key}")))
    };
    Ok((field("tls.crt")?, field("tls.key")?))
}

/// The subject OCM's add-on registration gives the kmm agent of `cluster`.
pub fn proxy_subject(cluster: &str) -> (String, Vec<String>) {
    (
        format!(
            "system:open-cluster-management:cluster:{cluster}:addon:kmm:agent:{PROXY_AGENT_NAME}"
        ),
        vec![
            format!("system:open-cluster-management:cluster:{cluster}:addon:kmm"),
            "system:open-cluster-management:addon:kmm".to_owned(),
            "system:authenticated".to_owned(),
        ],
    )
}

/// The client certificate and key OCM issued to `cluster`'s proxy, from the Secret the
/// registration agent wrote on that cluster.
pub async fn ocm_client_certificate(spoke: &Client) -> Result<(String, String)> {
    tls_pair(spoke, SPOKE_NAMESPACE, CLIENT_CERT_SECRET).await
}

/// A token of ServiceAccount `namespace/name`, optionally for one audience and bound to
/// a Node (`(name, uid)`), as kubelet projects it into a pod on that node.
pub async fn request_token(
    client: &Client,
    namespace: &str,
    name: &str,
    audience: Option<&str>,
    node: Option<(&str, &str)>,
) -> Result<String> {
    let api: Api<ServiceAccount> = Api::namespaced(client.clone(), namespace);
    let request = TokenRequest {
        spec: TokenRequestSpec {
            audiences: audience.map(|a| vec![a.to_owned()]).unwrap_or_default(),
            expiration_seconds: Some(TOKEN_LIFETIME),
            bound_object_ref: node.map(|(name, uid)| BoundObjectReference {
                api_version: Some("v1".into()),
                kind: Some("Node".into()),
                name: Some(name.into()),
                uid: Some(uid.into()),
            }),
        },
        ..Default::default()
    };
    api.create_token_request(name, &PostParams::default(), &request)
        .await?
        .status
        .map(|s| s.token)
        .ok_or_else(|| Error::Invalid(format!("the TokenRequest for {name} returned no token")))
}
