//! kmm-hub on the hub cluster's real node, installed the way a user installs it:
//! `kubectl apply -k` of an overlay whose only base is `addon-manifests/hub`. The overlay
//! changes what a platform team's own overlay would: the image's registry (and the
//! builder image's, a flag), how the proxies reach the gRPC endpoint (a NodePort on the
//! hub's real node, and that address as a SAN), and which modules the fleet's hub leaves
//! to the hub tests' own hubs.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{ListParams, Patch, PatchParams};
use kube::{Api, Client};
use nix::sys::signal::Signal;
use nix::unistd::Pid;

use super::kmm::{HUB_NAMESPACE, TEST_HUB_LABEL};
use crate::wait::wait_until;
use crate::{Error, IoContext, Result};

/// The Deployment, and the label of its Pods.
pub const DEPLOYMENT: &str = "kmm-hub";
/// The port proxies reach the leader on, on the hub's real node.
pub const GRPC_NODE_PORT: u16 = 30443;
/// The hub's leader Lease, in its namespace.
pub const LEASE: &str = "kmm-hub";
/// The Pod label the leader sets on itself.
pub const ROLE_LABEL: &str = "hub.kmm.sigs.x-k8s.io/role";
/// From `kubectl apply` to both replicas ready and one leading: image pulls on a fresh
/// node included.
const INSTALL_TIMEOUT: Duration = Duration::from_secs(180);

/// What the overlay sets.
#[derive(Debug)]
pub struct Overlay<'a> {
    /// `host:port` of the registry as the nodes reach it.
    pub registry: &'a str,
    pub tag: &'a str,
    /// The hub's real node's address: proxies connect to it.
    pub node_ip: &'a str,
}

/// The images the overlay points at the fleet's registry: the hub's, and the two the
/// AddOnTemplate deploys on the spokes.
const IMAGES: [&str; 3] = ["kmm-hub", "kmm-spoke-proxy", "kmm-node-agent"];
/// Where the simulated kernel of a node lives (a hostPath of the agents' DaemonSet).
pub const SIMULATED_KERNEL_DIR: &str = "/var/lib/kmm/simulated-kernel";
/// The fleet hub's `--image-follow-interval`: its shortest, so that a test's moved tag
/// reaches nodes within seconds.
pub const IMAGE_FOLLOW_INTERVAL: &str = "5s";

impl Overlay<'_> {
    /// The overlay's `kustomization.yaml`, referring to `base` relative to `dir` (kustomize
    /// takes no absolute bases). `manifests` locates the proxy and the agents among the
    /// AddOnTemplate's manifests.
    pub fn kustomization(
        &self,
        dir: &Path,
        base: &Path,
        manifests: TemplateManifests,
    ) -> Result<String> {
        let relative = relative_path(dir, base)?;
        let images: String = IMAGES
            .iter()
            .map(|image| {
                format!(
                    "  - name: 127.0.0.1:16005/kmm-fleet/{image}\n    newName: {registry}/kmm-fleet/{image}\n    newTag: \"{tag}\"\n",
                    registry = self.registry,
                    tag = self.tag,
                )
            })
            .collect();
        let pod_spec =
            |index: usize| format!("/spec/agentSpec/workload/manifests/{index}/spec/template/spec");
        let (proxy, agent) = (pod_spec(manifests.proxy), pod_spec(manifests.agent));
        Ok(format!(
            r#"# Written by the local fleet: addon-manifests/hub with the fleet's registry, the
# address its proxies use, and node agents on the simulated kernel backend (this
# machine's kernel cannot load modules).
apiVersion: kustomize.config.k8s.io/v1beta1
kind: Kustomization
resources:
  - {base}
images:
{images}patches:
  - target: {{kind: Deployment, name: kmm-hub}}
    patch: |-
      - {{op: add, path: /spec/template/spec/containers/0/args/-, value: "--grpc-san={node_ip}"}}
      - {{op: add, path: /spec/template/spec/containers/0/args/-, value: "--module-selector=!{test_label}"}}
      - {{op: add, path: /spec/template/spec/containers/0/args/-, value: "--builder-image={registry}/kmm-fleet/{builder}:{tag}"}}
      - {{op: add, path: /spec/template/spec/containers/0/args/-, value: "--image-follow-interval={follow}"}}
  - target: {{kind: Service, name: kmm-hub}}
    patch: |-
      - {{op: add, path: /spec/type, value: NodePort}}
      - {{op: add, path: /spec/ports/0/nodePort, value: {node_port}}}
  - target: {{kind: AddOnDeploymentConfig, name: kmm}}
    patch: |-
      - {{op: add, path: /spec/customizedVariables/-, value: {{name: HUB_ADDRESS, value: "https://{node_ip}:{node_port}"}}}}
  - target: {{kind: AddOnTemplate}}
    patch: |-
      - {{op: add, path: {proxy}/nodeSelector, value: {{{node_type}: real}}}}
      - {{op: add, path: {agent}/containers/0/args/-, value: "--kernel-backend=simulated"}}
      - {{op: add, path: {agent}/containers/0/args/-, value: "--simulated-dir={kernel_dir}"}}
      - {{op: add, path: {agent}/containers/0/args/-, value: "--retry-seconds=1"}}
      - {{op: add, path: {agent}/containers/0/volumeMounts/-, value: {{name: simulated-kernel, mountPath: {kernel_dir}}}}}
      - {{op: add, path: {agent}/volumes/-, value: {{name: simulated-kernel, hostPath: {{path: {kernel_dir}, type: DirectoryOrCreate}}}}}}
"#,
            base = relative.display(),
            node_ip = self.node_ip,
            test_label = TEST_HUB_LABEL,
            follow = IMAGE_FOLLOW_INTERVAL,
            registry = self.registry,
            builder = kmm_images::BUILDER.name,
            tag = self.tag,
            node_port = GRPC_NODE_PORT,
            kernel_dir = SIMULATED_KERNEL_DIR,
            node_type = super::nodes::NODE_TYPE_LABEL,
        ))
    }
}

impl Overlay<'_> {
    /// The values under which `charts/kmm-fleet` renders what [`Overlay::kustomization`]
    /// does (e2e/tests/helm_chart.rs compares the two): the same registry and tag, the
    /// gRPC NodePort and its address, the fleet's module selector and builder image, and
    /// the simulated kernel backend of the node agents.
    pub fn helm_values(&self) -> serde_json::Value {
        serde_json::json!({
            "global": { "imageRegistry": self.registry, "imageTag": self.tag },
            "hub": {
                "grpcSANs": [self.node_ip],
                "moduleSelector": format!("!{TEST_HUB_LABEL}"),
                "extraArgs": [format!("--image-follow-interval={IMAGE_FOLLOW_INTERVAL}")],
                "grpcService": { "type": "NodePort", "nodePort": GRPC_NODE_PORT },
            },
            "addon": {
                "hubAddress": format!("https://{}:{GRPC_NODE_PORT}", self.node_ip),
                "proxy": { "nodeSelector": { super::nodes::NODE_TYPE_LABEL: "real" } },
                "agent": {
                    "extraArgs": [
                        "--kernel-backend=simulated",
                        format!("--simulated-dir={SIMULATED_KERNEL_DIR}"),
                        "--retry-seconds=1",
                    ],
                    "extraVolumeMounts": [
                        { "name": "simulated-kernel", "mountPath": SIMULATED_KERNEL_DIR },
                    ],
                    "extraVolumes": [{
                        "name": "simulated-kernel",
                        "hostPath": { "path": SIMULATED_KERNEL_DIR, "type": "DirectoryOrCreate" },
                    }],
                },
            },
        })
    }
}

/// Where the proxy's Deployment and the agents' DaemonSet are among the AddOnTemplate's
/// manifests: the overlay patches them (the proxy stays off KWOK nodes, whose Pods do not
/// run; the agents use the simulated kernel).
#[derive(Debug, Clone, Copy)]
pub struct TemplateManifests {
    pub proxy: usize,
    pub agent: usize,
}

impl TemplateManifests {
    fn of(template_yaml: &str) -> Result<Self> {
        let template: serde_json::Value = serde_yaml_ng::from_str(template_yaml).map_err(|e| {
            Error::Invalid(format!("addon-manifests/addon/addon-template.yaml: {e}"))
        })?;
        let manifests = template["spec"]["agentSpec"]["workload"]["manifests"].as_array();
        let find = |kind: &str| {
            manifests
                .and_then(|m| m.iter().position(|m| m["kind"] == kind))
                .ok_or_else(|| {
                    Error::Invalid(format!(
                        "addon-manifests/addon/addon-template.yaml has no {kind}"
                    ))
                })
        };
        Ok(Self {
            proxy: find("Deployment")?,
            agent: find("DaemonSet")?,
        })
    }
}

/// `to` relative to `from` (both absolute).
fn relative_path(from: &Path, to: &Path) -> Result<PathBuf> {
    let canonical = |p: &Path| {
        p.canonicalize()
            .context(|| format!("resolving {}", p.display()))
    };
    let (from, to) = (canonical(from)?, canonical(to)?);
    let common = from
        .components()
        .zip(to.components())
        .take_while(|(a, b)| a == b)
        .count();
    let mut relative = PathBuf::new();
    for _ in from.components().skip(common) {
        relative.push("..");
    }
    relative.extend(to.components().skip(common));
    Ok(relative)
}

/// Writes the overlay into `dir` and applies it with `kubectl apply --server-side -k`
/// (kmm-hub owns one entry of the AddOnDeploymentConfig's variables, the user the others).
pub fn apply(kubectl: &Path, kubeconfig: &Path, dir: &Path, overlay: &Overlay<'_>) -> Result<()> {
    write(dir, overlay)?;
    apply_written(kubectl, kubeconfig, dir, false)
}

/// Writes the overlay's `kustomization.yaml` into `dir`.
pub fn write(dir: &Path, overlay: &Overlay<'_>) -> Result<()> {
    std::fs::create_dir_all(dir).context(|| format!("creating {}", dir.display()))?;
    let manifests = Path::new(env!("CARGO_MANIFEST_DIR")).join("../addon-manifests");
    let template = manifests.join("addon/addon-template.yaml");
    let template =
        std::fs::read_to_string(&template).context(|| format!("reading {}", template.display()))?;
    let file = dir.join("kustomization.yaml");
    std::fs::write(
        &file,
        overlay.kustomization(
            dir,
            &manifests.join("hub"),
            TemplateManifests::of(&template)?,
        )?,
    )
    .context(|| format!("writing {}", file.display()))
}

/// `kubectl apply --server-side -k dir` of an overlay [`write`] wrote. `force_conflicts`
/// takes back the fields another manager changed since (e.g. Helm's, after the Helm test
/// upgraded the install it had adopted).
pub fn apply_written(
    kubectl: &Path,
    kubeconfig: &Path,
    dir: &Path,
    force_conflicts: bool,
) -> Result<()> {
    let mut cmd = Command::new(kubectl);
    cmd.arg("--kubeconfig")
        .arg(kubeconfig)
        .args(["apply", "--server-side"]);
    if force_conflicts {
        cmd.arg("--force-conflicts");
    }
    let output = cmd
        .arg("-k")
        .arg(dir)
        .output()
        .context(|| format!("running {}", kubectl.display()))?;
    if !output.status.success() {
        return Err(Error::Invalid(format!(
            "kubectl apply -k {} failed: {}",
            dir.display(),
            String::from_utf8_lossy(&output.stderr).trim()
        )));
    }
    Ok(())
}

/// kmm-hub's Pods, those being deleted left out.
pub async fn pods(hub: &Client) -> Result<Vec<Pod>> {
    let pods: Api<Pod> = Api::namespaced(hub.clone(), HUB_NAMESPACE);
    Ok(pods
        .list(&ListParams::default().labels(&format!("app.kubernetes.io/name={DEPLOYMENT}")))
        .await?
        .items
        .into_iter()
        .filter(|p| p.metadata.deletion_timestamp.is_none())
        .collect())
}

/// Waits until every replica is ready and one Pod is labelled leader; returns its name.
pub async fn wait_installed(hub: &Client) -> Result<String> {
    wait_until("kmm-hub: every replica ready", INSTALL_TIMEOUT, || {
        replicas_ready(hub)
    })
    .await?;
    wait_leader(hub, INSTALL_TIMEOUT).await
}

async fn replicas_ready(hub: &Client) -> std::result::Result<(), String> {
    let deployments: Api<Deployment> = Api::namespaced(hub.clone(), HUB_NAMESPACE);
    let deployment = deployments
        .get_opt(DEPLOYMENT)
        .await
        .map_err(|e| e.to_string())?
        .ok_or("no Deployment")?;
    let generation = deployment.metadata.generation;
    let wanted = deployment.spec.and_then(|s| s.replicas).unwrap_or(1);
    let status = deployment.status.unwrap_or_default();
    // Counts of an older generation say nothing about a change just made.
    if status.observed_generation < generation {
        return Err(format!(
            "generation {generation:?} not observed yet ({:?})",
            status.observed_generation
        ));
    }
    let (ready, updated) = (
        status.ready_replicas.unwrap_or(0),
        status.updated_replicas.unwrap_or(0),
    );
    if ready == wanted && updated == wanted && status.replicas.unwrap_or(0) == wanted {
        Ok(())
    } else {
        Err(format!(
            "{ready} of {wanted} ready, {updated} updated; {}",
            pod_summary(hub).await
        ))
    }
}

/// The ready Pod labelled leader, once there is one.
pub async fn wait_leader(hub: &Client, timeout: Duration) -> Result<String> {
    wait_until("kmm-hub: a ready leader", timeout, || async {
        ready_leader(hub)
            .await?
            .ok_or(format!("no ready leader; {}", pod_summary(hub).await))
    })
    .await
}

/// The Lease's holder identity (`<pod>_<incarnation>`).
pub async fn lease_holder(hub: &Client) -> Result<String> {
    let leases: Api<Lease> = Api::namespaced(hub.clone(), HUB_NAMESPACE);
    leases
        .get(LEASE)
        .await?
        .spec
        .and_then(|s| s.holder_identity)
        .filter(|h| !h.is_empty())
        .ok_or_else(|| Error::Invalid(format!("Lease {HUB_NAMESPACE}/{LEASE} has no holder")))
}

/// Waits until the Lease has a holder other than `former` and that holder's Pod is the
/// ready leader (a crashed leader keeps its label, and its readiness until a probe
/// fails); returns the Pod. The new holder may be the crashed Pod's restarted container.
pub async fn wait_lease_moved(hub: &Client, timeout: Duration, former: &str) -> Result<String> {
    wait_until("kmm-hub: the Lease held anew", timeout, || async {
        let holder = lease_holder(hub).await.map_err(|e| e.to_string())?;
        if holder == former {
            return Err(format!("still held by {former}"));
        }
        match ready_leader(hub).await? {
            Some(pod) if holder.starts_with(&format!("{pod}_")) => Ok(pod),
            other => Err(format!("held by {holder}, ready leader Pod {other:?}")),
        }
    })
    .await
}

async fn ready_leader(hub: &Client) -> std::result::Result<Option<String>, String> {
    let pods: Api<Pod> = Api::namespaced(hub.clone(), HUB_NAMESPACE);
    let leaders = pods
        .list(&ListParams::default().labels(&format!(
            "app.kubernetes.io/name={DEPLOYMENT},{ROLE_LABEL}=leader"
        )))
        .await
        .map_err(|e| e.to_string())?;
    Ok(leaders
        .items
        .iter()
        .find(|p| pod_ready(p) && p.metadata.deletion_timestamp.is_none())
        .and_then(|p| p.metadata.name.clone()))
}

/// Crashes the leader: SIGKILL to its `kmm-hub` process (found on the host by the Pod's
/// cgroup, `.../pod<uid>/...`), so it cannot release the Lease and a standby takes over
/// only once the Lease expires. The kubelet restarts the container, which rejoins as
/// standby. Returns the Pod's name.
pub async fn crash_leader(hub: &Client) -> Result<String> {
    let leader = wait_leader(hub, INSTALL_TIMEOUT).await?;
    let pods: Api<Pod> = Api::namespaced(hub.clone(), HUB_NAMESPACE);
    let uid = pods
        .get(&leader)
        .await?
        .metadata
        .uid
        .ok_or_else(|| Error::Invalid(format!("Pod {leader} has no uid")))?;
    let cgroup = format!("/pod{uid}/");
    let mut killed = 0;
    let proc_dir = Path::new("/proc");
    for entry in std::fs::read_dir(proc_dir).context(|| "listing /proc".to_owned())? {
        let Ok(pid) = entry.map(|e| e.file_name().to_string_lossy().parse::<i32>()) else {
            continue;
        };
        let Ok(pid) = pid else { continue };
        let read = |file: &str| std::fs::read_to_string(proc_dir.join(pid.to_string()).join(file));
        let ours = read("cgroup").is_ok_and(|c| c.contains(&cgroup))
            && read("comm").is_ok_and(|c| c.trim() == "kmm-hub");
        if ours && nix::sys::signal::kill(Pid::from_raw(pid), Signal::SIGKILL).is_ok() {
            killed += 1;
        }
    }
    if killed == 0 {
        return Err(Error::Invalid(format!(
            "no kmm-hub process of Pod {leader} (cgroup pod{uid}) found to kill"
        )));
    }
    Ok(leader)
}

/// Scales the hub to `replicas` and waits until that many are ready (and, above zero, one
/// leads).
pub async fn scale(hub: &Client, replicas: i32) -> Result<()> {
    let deployments: Api<Deployment> = Api::namespaced(hub.clone(), HUB_NAMESPACE);
    let patch = serde_json::json!({"spec": {"replicas": replicas}});
    deployments
        .patch(DEPLOYMENT, &PatchParams::default(), &Patch::Merge(&patch))
        .await?;
    let pods: Api<Pod> = Api::namespaced(hub.clone(), HUB_NAMESPACE);
    wait_until(
        &format!("kmm-hub scaled to {replicas}"),
        INSTALL_TIMEOUT,
        || async {
            replicas_ready(hub).await?;
            let running = pods
                .list(
                    &ListParams::default().labels(&format!("app.kubernetes.io/name={DEPLOYMENT}")),
                )
                .await
                .map_err(|e| e.to_string())?
                .items
                .len();
            (running == usize::try_from(replicas).unwrap_or_default())
                .then_some(())
                .ok_or(format!("{running} Pods"))
        },
    )
    .await?;
    if replicas > 0 {
        wait_leader(hub, INSTALL_TIMEOUT).await?;
    }
    Ok(())
}

/// One `env status` line per hub Pod: role, readiness, node and memory (the kubelet's
/// working set, read through the apiserver's node proxy).
pub async fn status_lines(hub: &Client) -> Vec<String> {
    let pods: Api<Pod> = Api::namespaced(hub.clone(), HUB_NAMESPACE);
    let list = match pods
        .list(&ListParams::default().labels(&format!("app.kubernetes.io/name={DEPLOYMENT}")))
        .await
    {
        Ok(list) => list.items,
        Err(e) => return vec![format!("kmm-hub Pods: cannot list them: {e}")],
    };
    let mut lines = vec![];
    for pod in &list {
        let name = pod.metadata.name.clone().unwrap_or_default();
        let node = pod
            .spec
            .as_ref()
            .and_then(|s| s.node_name.clone())
            .unwrap_or_default();
        let role = pod
            .metadata
            .labels
            .as_ref()
            .and_then(|l| l.get(ROLE_LABEL).cloned())
            .unwrap_or_else(|| "-".into());
        let memory = match working_set_bytes(hub, &node, &name).await {
            Some(bytes) => format!("{} MiB", bytes / (1024 * 1024)),
            None => "? MiB".into(),
        };
        lines.push(format!(
            "pod {HUB_NAMESPACE}/{name:<28} on {node:<14} role {role:<8} {:<9} working set {memory}",
            if pod_ready(pod) { "Ready" } else { "NOT READY" },
        ));
    }
    lines
}

async fn working_set_bytes(hub: &Client, node: &str, pod: &str) -> Option<u64> {
    let request = http::Request::get(format!("/api/v1/nodes/{node}/proxy/stats/summary"))
        .body(Vec::new())
        .ok()?;
    let summary: serde_json::Value = hub.request(request).await.ok()?;
    summary["pods"]
        .as_array()?
        .iter()
        .find(|p| p["podRef"]["name"] == pod && p["podRef"]["namespace"] == HUB_NAMESPACE)?["memory"]
        ["workingSetBytes"]
        .as_u64()
}

fn pod_ready(pod: &Pod) -> bool {
    pod.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|c| c.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

/// One line about every hub Pod, for the waits' messages.
async fn pod_summary(hub: &Client) -> String {
    let pods: Api<Pod> = Api::namespaced(hub.clone(), HUB_NAMESPACE);
    match pods
        .list(&ListParams::default().labels(&format!("app.kubernetes.io/name={DEPLOYMENT}")))
        .await
    {
        Ok(list) => list
            .items
            .iter()
            .map(|p| {
                let name = p.metadata.name.clone().unwrap_or_default();
                let role = p
                    .metadata
                    .labels
                    .as_ref()
                    .and_then(|l| l.get(ROLE_LABEL).cloned())
                    .unwrap_or_default();
                let status = p.status.clone().unwrap_or_default();
                let waiting: Vec<String> = status
                    .container_statuses
                    .unwrap_or_default()
                    .iter()
                    .filter_map(|c| {
                        let waiting = c.state.as_ref()?.waiting.as_ref()?;
                        Some(format!(
                            "{} {}",
                            waiting.reason.clone().unwrap_or_default(),
                            waiting.message.clone().unwrap_or_default()
                        ))
                    })
                    .collect();
                format!(
                    "{name} {} role={role} ready={} {}",
                    status.phase.unwrap_or_default(),
                    pod_ready(p),
                    waiting.join(", ")
                )
            })
            .collect::<Vec<_>>()
            .join("; "),
        Err(e) => format!("cannot list the hub's Pods: {e}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_overlay_names_its_base_relatively_and_sets_registry_and_address() {
        let dir = std::env::temp_dir().join(format!("kmm-overlay-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let base = Path::new(env!("CARGO_MANIFEST_DIR")).join("../addon-manifests/hub");
        let text = Overlay {
            registry: "198.18.16.1:16005",
            tag: "0.1.0",
            node_ip: "198.18.16.10",
        }
        .kustomization(
            &dir,
            &base,
            TemplateManifests {
                proxy: 9,
                agent: 10,
            },
        )
        .unwrap();
        let yaml: serde_json::Value = serde_yaml_ng::from_str(&text).unwrap();
        let resource = yaml["resources"][0].as_str().unwrap();
        assert!(resource.starts_with("..") && resource.ends_with("addon-manifests/hub"));
        assert!(dir.join(resource).join("kustomization.yaml").is_file());
        assert_eq!(
            yaml["images"][0]["newName"],
            "198.18.16.1:16005/kmm-fleet/kmm-hub"
        );
        assert_eq!(
            yaml["images"][2]["newName"],
            "198.18.16.1:16005/kmm-fleet/kmm-node-agent"
        );
        assert!(text.contains("--grpc-san=198.18.16.10"));
        assert!(text.contains("--builder-image=198.18.16.1:16005/kmm-fleet/kmm-builder:0.1.0"));
        assert!(text.contains("--image-follow-interval=5s"));
        assert!(text.contains("value: \"https://198.18.16.10:30443\""));
        assert!(text.contains("/manifests/10/spec/template/spec/volumes/-"));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn the_proxy_and_the_agents_are_found_in_the_shipped_template() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../addon-manifests/addon/addon-template.yaml");
        let template = std::fs::read_to_string(path).unwrap();
        let found = TemplateManifests::of(&template).unwrap();
        let yaml: serde_json::Value = serde_yaml_ng::from_str(&template).unwrap();
        let manifests = &yaml["spec"]["agentSpec"]["workload"]["manifests"];
        assert_eq!(
            manifests[found.proxy]["metadata"]["name"],
            "kmm-spoke-proxy"
        );
        assert_eq!(manifests[found.agent]["metadata"]["name"], "kmm-node-agent");
        assert!(TemplateManifests::of("spec: {}").is_err());
    }
}
