//! KWOK's simulated nodes on each spoke: many nodes on a mix of kernels at the cost of
//! API objects, for tests and scale where no container has to run.

use std::path::Path;

use k8s_openapi::api::core::v1::Node;
use kube::Api;
use kube::api::{Patch, PatchParams};
use serde_json::json;

use super::control_plane::{ControlPlane, KWOK};
use super::nodes::{NODE_TYPE_LABEL, RealNode, node_ready};
use super::{MANAGER, SimulatedNode, Starting, kmm, wait_for};
use crate::Result;

/// Annotation by which KWOK recognises the nodes it simulates.
pub const KWOK_NODE_ANNOTATION: &str = "kwok.x-k8s.io/node";
/// Node label carrying the simulated kernel (the real one is in `status.nodeInfo`).
pub const KERNEL_LABEL: &str = "kmm-fleet.dev/kernel";

impl Starting {
    /// Creates `nodes` on `spoke` with their kernels, and the KWOK controller that keeps
    /// them Ready and runs their Pods' lifecycle.
    pub(super) async fn simulated_nodes(
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
}

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

/// The nodes of spoke `spoke` (1-based): kernels are dealt round-robin across the whole
/// fleet, so that `spokes * nodes_per_spoke >= kernels.len()` covers every kernel.
pub(super) fn simulated_nodes_of(
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fleet::Options;
    use crate::versions::Versions;

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
}
