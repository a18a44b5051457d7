//! Ways the fault tests and the chaos soak disturb the fleet the way real fleets are
//! disturbed: a network cut inside a node's network namespace, and an OCM agent whose
//! lease is made short enough to lapse in seconds once it stops.

use std::time::Duration;

use k8s_openapi::api::coordination::v1::Lease;
use kube::api::{Patch, PatchParams};
use kube::{Api, Client};
use serde_json::{Value, json};

use super::managed_clusters;
use crate::wait::wait_until;
use crate::{Error, Result};

/// Inserts (`-I`) or deletes (`-D`) an iptables rule in a node's network namespace.
pub fn iptables(netns: &str, op: &str, rule: &[String]) -> Result<()> {
    let status = std::process::Command::new("ip")
        .args(["netns", "exec", netns, "iptables", "-w", op])
        .args(rule)
        .status()
        .map_err(|source| Error::Io {
            context: format!("running iptables in network namespace {netns}"),
            source,
        })?;
    if !status.success() {
        return Err(Error::Command {
            command: format!("ip netns exec {netns} iptables -w {op} {}", rule.join(" ")),
            status: status.to_string(),
        });
    }
    Ok(())
}

/// The rules that cut a node from `peer` both ways: forwarded Pod traffic and the node's
/// own.
pub fn cut_rules(peer: &str) -> Vec<Vec<String>> {
    [
        ("FORWARD", "-d"),
        ("FORWARD", "-s"),
        ("OUTPUT", "-d"),
        ("INPUT", "-s"),
    ]
    .into_iter()
    .map(|(chain, direction)| {
        [chain, direction, peer, "-j", "DROP"]
            .map(str::to_owned)
            .to_vec()
    })
    .collect()
}

/// The lease OCM's agents are given before they are stalled: short enough to lapse in
/// seconds.
pub const SHORT_OCM_LEASE_SECONDS: i64 = 4;

/// Sets `spoke`'s ManagedCluster lease duration (`Value::Null` for OCM's default) and
/// returns the one it had, to restore.
pub async fn set_ocm_lease(hub: &Client, spoke: &str, seconds: Value) -> Result<Value> {
    let clusters = managed_clusters(hub);
    let before = clusters.get(spoke).await?.data["spec"]["leaseDurationSeconds"].clone();
    clusters
        .patch(
            spoke,
            &PatchParams::default(),
            &Patch::Merge(&json!({"spec": {"leaseDurationSeconds": seconds}})),
        )
        .await?;
    Ok(before)
}

/// Waits until `spoke`'s OCM agent renews at the short period (two renewals close
/// together): once it stops, its lease then lapses in seconds, not minutes.
pub async fn wait_ocm_renewing_short(hub: &Client, spoke: &str, timeout: Duration) -> Result<()> {
    let leases: Api<Lease> = Api::namespaced(hub.clone(), spoke);
    let previous = std::sync::Mutex::new(None);
    wait_until(
        "the OCM agent to renew at the short period",
        timeout,
        || async {
            let lease = leases
                .get("managed-cluster-lease")
                .await
                .map_err(|e| e.to_string())?;
            let renewed = lease.spec.and_then(|s| s.renew_time).ok_or("no renewal")?.0;
            let earlier = previous.lock().map_err(|e| e.to_string())?.replace(renewed);
            match earlier {
                Some(earlier) if earlier != renewed => {
                    let gap = renewed.duration_since(earlier);
                    (gap.as_secs() <= SHORT_OCM_LEASE_SECONDS + 2)
                        .then_some(())
                        .ok_or_else(|| format!("renewed {gap:?} apart"))
                }
                _ => Err("no second renewal yet".to_owned()),
            }
        },
    )
    .await
}
