//! The real nodes' network. One host bridge per fleet, named after its base port
//! (`kmmf16000`), on the link subnet `198.18.F.0/24` of the benchmarking range
//! 198.18.0.0/15 (never routed), with `F = (base port / 1000) % 256`: the bridge is
//! `198.18.F.1`, node `k` of the fleet `198.18.F.(10+k)` on a veth inside its network
//! namespace `kmmf<port>-<node>`. Node `k`'s pods get `198.19.((F % 32) * 8 + k).0/24`,
//! and the host routes that subnet via the node.
//!
//! The apiservers and the registry keep listening on 127.0.0.1; a `socat` forwarder per
//! port makes each reachable from the nodes at the bridge address. A node routes only
//! the bridge subnet and the service range (via the bridge), never a default route:
//! nothing a node or pod sends can leave through the machine's own interfaces.

use crate::process::run;
use std::net::Ipv4Addr;
use std::path::Path;
use std::process::Command;

use kmm_kwok_pod_runner::{NETNS_DIR, netns_path};
use serde::{Deserialize, Serialize};

use super::{Starting, wait_for};
use crate::{Error, Result};

/// Real nodes per fleet: each gets its own /24 of pods out of the fleet's /21.
pub const MAX_REAL_NODES: usize = 8;
/// Every cluster's service range (kube-apiserver `--service-cluster-ip-range`); the
/// `kubernetes` Service is its first address.
pub const SERVICE_CIDR: &str = "10.0.0.0/24";
/// All pod subnets of all fleets: what kube-proxy treats as cluster traffic.
pub const POD_RANGE: &str = "198.19.0.0/16";

/// The fleet's node network, derived from its base port alone, so that `down` finds
/// everything of a fleet even when its state is lost.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Network {
    /// `kmmf<base port>`: the bridge, and the prefix of this fleet's network
    /// namespaces, veths and cgroups.
    pub prefix: String,
    /// The bridge's address (`198.18.F.1`), where nodes reach the apiservers and the
    /// registry.
    pub gateway: Ipv4Addr,
}

/// One real node's place in the network.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeAddress {
    /// Network namespace (`ip netns`), also the node's cgroup.
    pub netns: String,
    /// Host end of the node's veth (the node's end is `eth0`).
    pub veth: String,
    pub ip: Ipv4Addr,
    /// The pods' subnet, `198.19.X.0/24`.
    pub pod_cidr: String,
}

impl Network {
    pub fn of(base_port: u16) -> Self {
        let subnet = u8::try_from((base_port / 1000) % 256).unwrap_or_default();
        Self {
            prefix: format!("kmmf{base_port}"),
            gateway: Ipv4Addr::new(198, 18, subnet, 1),
        }
    }

    /// The bridge's name (<= 15 characters for any u16 port).
    pub fn bridge(&self) -> &str {
        &self.prefix
    }

    /// The place of the fleet's `index`-th real node (0-based, < [`MAX_REAL_NODES`]).
    pub fn node(&self, index: usize, name: &str) -> Result<NodeAddress> {
        let k = u8::try_from(index)
            .ok()
            .filter(|k| usize::from(*k) < MAX_REAL_NODES)
            .ok_or_else(|| {
                Error::Invalid(format!(
                    "at most {MAX_REAL_NODES} real nodes per fleet (pod subnets and addresses)"
                ))
            })?;
        let subnet = self.gateway.octets()[2];
        Ok(NodeAddress {
            netns: format!("{}-{name}", self.prefix),
            veth: format!("{}v{k}", self.prefix),
            ip: Ipv4Addr::new(198, 18, subnet, 10 + k),
            pod_cidr: format!("198.19.{}.0/24", (subnet % 32) * 8 + k),
        })
    }

    /// Whether the bridge exists (only then is the gateway a local address: before,
    /// a connection to it would be routed out of the machine).
    pub fn exists(&self) -> bool {
        link_exists(self.bridge())
    }

    /// The host bridge with the gateway address. Fails if it exists (another fleet with
    /// the same base port, or one `down` did not clean).
    pub fn create(&self) -> Result<()> {
        if self.exists() {
            return Err(Error::Invalid(format!(
                "the bridge {} exists: a fleet with this base port runs or was not cleaned up \
                 (`cargo xtask env down` with the same KMM_FLEET_BASE_PORT)",
                self.bridge()
            )));
        }
        let bridge = self.bridge();
        ip(&["link", "add", bridge, "type", "bridge"])?;
        ip(&[
            "addr",
            "add",
            &format!("{}/24", self.gateway),
            "dev",
            bridge,
        ])?;
        ip(&["link", "set", bridge, "up"])
    }

    /// The node's network namespace, joined to the bridge by a veth, with `lo` up,
    /// forwarding on (pod traffic passes through the node) and routes to the service
    /// range via the bridge; and the host's route to the node's pods.
    pub fn attach(&self, node: &NodeAddress) -> Result<()> {
        let ns = node.netns.as_str();
        ip(&["netns", "add", ns])?;
        ip(&[
            "link", "add", &node.veth, "type", "veth", "peer", "name", "eth0", "netns", ns,
        ])?;
        ip(&["link", "set", &node.veth, "master", self.bridge(), "up"])?;
        ip(&[
            "-n",
            ns,
            "addr",
            "add",
            &format!("{}/24", node.ip),
            "dev",
            "eth0",
        ])?;
        ip(&["-n", ns, "link", "set", "eth0", "up"])?;
        ip(&["-n", ns, "link", "set", "lo", "up"])?;
        ip(&[
            "-n",
            ns,
            "route",
            "add",
            SERVICE_CIDR,
            "via",
            &self.gateway.to_string(),
        ])?;
        // A flat pod network across the fleet: every other node's pods directly via that
        // node on the bridge (nodes not started yet included: the route waits for its
        // neighbour), so a spoke's pods reach the hub's Pods and back without the host
        // forwarding anything.
        for other in 0..MAX_REAL_NODES {
            let neighbour = self.node(other, "neighbour")?;
            if neighbour.ip == node.ip {
                continue;
            }
            ip(&[
                "-n",
                ns,
                "route",
                "add",
                &neighbour.pod_cidr,
                "via",
                &neighbour.ip.to_string(),
                "dev",
                "eth0",
            ])?;
        }
        // Per network namespace: this changes nothing on the host.
        run(Command::new("nsenter")
            .arg(format!("--net={}", netns_path(ns).display()))
            .args(["sh", "-c", "echo 1 > /proc/sys/net/ipv4/ip_forward"]))?;
        ip(&[
            "route",
            "add",
            &node.pod_cidr,
            "via",
            &node.ip.to_string(),
            "dev",
            self.bridge(),
        ])
    }

    /// Remove every network namespace of this fleet, the veths to them and the bridge
    /// (the routes via it go with it). Finds them by name, so it also cleans up after a
    /// fleet whose state is lost.
    pub fn remove(&self) -> Result<()> {
        let owned = format!("{}-", self.prefix);
        if let Ok(entries) = std::fs::read_dir(NETNS_DIR) {
            for entry in entries.flatten() {
                let name = entry.file_name().to_string_lossy().into_owned();
                if name.starts_with(&owned) {
                    ip(&["netns", "delete", &name])?;
                }
            }
        }
        // A deleted namespace takes its veths with it only when the kernel gets round to
        // destroying it, after `down` has returned: delete the host ends now (each takes
        // its peer). One the kernel removes meanwhile is as good as deleted.
        let veths = format!("{}v", self.prefix);
        if let Ok(entries) = std::fs::read_dir("/sys/class/net") {
            for entry in entries.flatten() {
                let name = entry.file_name().to_string_lossy().into_owned();
                if name.starts_with(&veths)
                    && let Err(error) = ip(&["link", "delete", &name])
                    && link_exists(&name)
                {
                    return Err(error);
                }
            }
        }
        if self.exists() {
            ip(&["link", "delete", self.bridge()])?;
        }
        Ok(())
    }
}

fn link_exists(name: &str) -> bool {
    Path::new("/sys/class/net").join(name).exists()
}

fn ip(args: &[&str]) -> Result<()> {
    run(Command::new("ip").args(args)).map(drop)
}

/// `socat`, which forwards the bridge address to loopback.
const SOCAT: &str = "/usr/bin/socat";

impl Starting {
    /// Make `127.0.0.1:<port>` reachable from the nodes as `<gateway>:<port>`.
    pub(super) async fn forward(&mut self, name: &str, port: u16) -> Result<()> {
        let gateway = self.network.gateway;
        let forwarder = self.start_program(
            name,
            Path::new(SOCAT),
            vec![
                format!("TCP-LISTEN:{port},bind={gateway},fork,reuseaddr"),
                format!("TCP:127.0.0.1:{port}"),
            ],
            &[],
        )?;
        wait_for(
            &forwarder,
            &format!("{gateway}:{port} to accept connections"),
            || async move {
                tokio::net::TcpStream::connect((gateway, port))
                    .await
                    .is_ok()
            },
        )
        .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_fit_linux_interfaces_and_fleets_do_not_collide() {
        let default = Network::of(16000);
        let second = Network::of(26000);
        assert_eq!(default.bridge(), "kmmf16000");
        assert_eq!(default.gateway, Ipv4Addr::new(198, 18, 16, 1));
        assert_eq!(second.gateway, Ipv4Addr::new(198, 18, 26, 1));
        let last = Network::of(u16::MAX)
            .node(MAX_REAL_NODES - 1, "spoke9-real1")
            .unwrap();
        assert!(last.veth.len() <= 15, "{last:?}");
        assert!(Network::of(u16::MAX).bridge().len() <= 15);

        let mut cidrs = vec![];
        for network in [&default, &second] {
            for k in 0..MAX_REAL_NODES {
                let node = network.node(k, "hub-real1").unwrap();
                assert_eq!(node.ip.octets()[..3], network.gateway.octets()[..3]);
                assert_eq!(node.ip.octets()[3], 10 + k as u8);
                cidrs.push(node.pod_cidr);
            }
        }
        let mut distinct = cidrs.clone();
        distinct.sort();
        distinct.dedup();
        assert_eq!(distinct.len(), cidrs.len(), "{cidrs:?}");
        assert_eq!(
            default.node(0, "hub-real1").unwrap(),
            NodeAddress {
                netns: "kmmf16000-hub-real1".into(),
                veth: "kmmf16000v0".into(),
                ip: Ipv4Addr::new(198, 18, 16, 10),
                pod_cidr: "198.19.128.0/24".into(),
            }
        );
        assert!(default.node(MAX_REAL_NODES, "x").is_err());
    }
}
