//! Which view this replica can show. Only the leader holds the fleet's state; a standby
//! says so, and names the Pod holding the leader Lease, rather than showing an empty
//! fleet.

use std::sync::Arc;

use k8s_openapi::api::coordination::v1::Lease;
use kube::Api;
use tokio::sync::watch;

use crate::serve::fleet_view::FleetView;

/// This replica's part.
#[derive(Clone, Debug)]
pub enum Role {
    /// Standing by for the Lease: it holds no fleet state.
    Standby,
    /// Leading: the view it serves proxies from.
    Leading(Arc<FleetView>),
}

/// The leader Lease, read when a standby's page names the leader.
#[derive(Clone, Debug)]
pub struct LeaseLookup {
    pub api: Api<Lease>,
    pub namespace: String,
    pub name: String,
}

impl LeaseLookup {
    /// The holder's identity, when the Lease is held.
    pub async fn holder(&self) -> Result<Option<String>, kube::Error> {
        let lease = self.api.get_opt(&self.name).await?;
        Ok(lease
            .and_then(|l| l.spec)
            .and_then(|s| s.holder_identity)
            .filter(|h| !h.is_empty()))
    }
}

/// The Pod a holder identity names: replicas hold the Lease as `<pod>_<incarnation>`
/// (a Pod name has no `_`).
pub fn holder_pod(identity: &str) -> &str {
    identity.split_once('_').map_or(identity, |(pod, _)| pod)
}

/// What the UI knows of this replica.
#[derive(Clone, Debug)]
pub struct Replica {
    /// This replica's name (its Pod).
    pub instance: String,
    pub role: watch::Receiver<Role>,
    /// The Lease replicas are elected by (`None`: no election, this one always leads).
    pub lease: Option<LeaseLookup>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_holder_pod_is_the_identity_before_its_incarnation() {
        assert_eq!(
            holder_pod("kmm-hub-7d9f-abcde_1f2e3d"),
            "kmm-hub-7d9f-abcde"
        );
        assert_eq!(holder_pod("kmm-hub-0"), "kmm-hub-0");
    }
}
