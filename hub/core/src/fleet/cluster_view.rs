//! What the hub reads of a ManagedCluster: its labels, its acceptance, the Placements
//! that decided it and what excuses their silence about it. Pure.

use std::collections::BTreeMap;

use kmm_api::ocm::{UNAVAILABLE_TAINT, UNREACHABLE_TAINT};
use kube::ResourceExt;
use kube::core::DynamicObject;

use super::assignment::ClusterFacts;
use super::placements::{Excuses, Placed};

/// Strips a ManagedCluster down to what [`ClusterView`] reads of it (name, labels,
/// `spec.hubAcceptsClient`, OCM's reachability taints) before a store keeps it: a real
/// cluster's status (claims, capacity, conditions) and managed fields are kilobytes each,
/// times the fleet.
pub fn trim_managed_cluster(cluster: &mut DynamicObject) {
    cluster.metadata.managed_fields = None;
    cluster.metadata.annotations = None;
    cluster.metadata.owner_references = None;
    let accepts = cluster.data["spec"]["hubAcceptsClient"].take();
    let taints: Vec<serde_json::Value> = cluster.data["spec"]["taints"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|taint| taint["key"].as_str())
        .filter(|key| is_reachability_taint(key))
        .map(|key| serde_json::json!({ "key": key }))
        .collect();
    cluster.data = serde_json::json!({ "spec": { "hubAcceptsClient": accepts, "taints": taints } });
}

fn is_reachability_taint(key: &str) -> bool {
    key == UNREACHABLE_TAINT || key == UNAVAILABLE_TAINT
}

/// Whether OCM tainted the (trimmed) ManagedCluster unreachable or unavailable.
pub fn is_unreachable(cluster: &DynamicObject) -> bool {
    cluster.data["spec"]["taints"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|taint| taint["key"].as_str())
        .any(is_reachability_taint)
}

/// What the hub last saw of a ManagedCluster: what its snapshot and its modules'
/// selection depend on.
#[derive(Clone, Debug, PartialEq)]
pub struct ClusterView {
    pub labels: BTreeMap<String, String>,
    pub placed: Placed,
    /// What excuses a Placement no longer deciding it.
    pub excuses: Excuses,
    /// `spec.hubAcceptsClient`: a cluster the hub does not accept gets no stream.
    pub accepted: bool,
}

impl ClusterView {
    /// The view of a (trimmed) ManagedCluster decided by `placed`; `excuses` carries the
    /// fleet's side of them (`unreachable` is read from the cluster here).
    pub fn of(cluster: &DynamicObject, placed: Placed, excuses: Excuses) -> Self {
        Self {
            labels: cluster.labels().clone(),
            placed,
            excuses: Excuses {
                unreachable: is_unreachable(cluster),
                ..excuses
            },
            accepted: cluster.data["spec"]["hubAcceptsClient"] == true,
        }
    }

    pub fn facts(&self) -> ClusterFacts<'_> {
        ClusterFacts {
            labels: &self.labels,
            placed: &self.placed,
            excuses: &self.excuses,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn managed_cluster(accepts: serde_json::Value) -> DynamicObject {
        serde_json::from_value(serde_json::json!({
            "apiVersion": "cluster.open-cluster-management.io/v1",
            "kind": "ManagedCluster",
            "metadata": {
                "name": "spoke1",
                "labels": {"env": "prod"},
                "annotations": {"note": "x".repeat(1000)},
                "managedFields": [{"manager": "registration", "operation": "Update"}],
            },
            "spec": {
                "hubAcceptsClient": accepts,
                "leaseDurationSeconds": 60,
                "taints": [
                    {"key": UNREACHABLE_TAINT, "effect": "NoSelect", "timeAdded": "2026-01-01T00:00:00Z"},
                    {"key": "example.com/other", "effect": "NoSelect"},
                ],
            },
            "status": {"clusterClaims": [{"name": "id.k8s.io", "value": "x".repeat(1000)}]},
        }))
        .unwrap()
    }

    #[test]
    fn a_trimmed_managed_cluster_keeps_what_the_hub_reads() {
        let mut cluster = managed_cluster(serde_json::json!(true));
        let before = serde_json::to_vec(&cluster).unwrap().len();
        trim_managed_cluster(&mut cluster);
        assert!(serde_json::to_vec(&cluster).unwrap().len() < before / 4);
        assert_eq!(cluster.name_any(), "spoke1");
        assert_eq!(
            cluster.labels().get("env").map(String::as_str),
            Some("prod")
        );
        assert_eq!(cluster.data["spec"]["hubAcceptsClient"], true);
        assert_eq!(
            cluster.data["spec"]["taints"],
            serde_json::json!([{"key": UNREACHABLE_TAINT}])
        );
        assert!(cluster.data.get("status").is_none());
    }

    #[test]
    fn only_ocm_reachability_taints_make_a_cluster_unreachable() {
        let mut cluster = managed_cluster(serde_json::json!(true));
        trim_managed_cluster(&mut cluster);
        assert!(is_unreachable(&cluster));
        assert!(
            ClusterView::of(&cluster, Placed::new(), Excuses::default())
                .excuses
                .unreachable
        );
        cluster.data["spec"]["taints"] = serde_json::json!([{"key": UNAVAILABLE_TAINT}]);
        assert!(is_unreachable(&cluster));
        let mut other = managed_cluster(serde_json::json!(true));
        other.data["spec"]["taints"] = serde_json::json!([{"key": "example.com/other"}]);
        trim_managed_cluster(&mut other);
        assert!(!is_unreachable(&other));
    }

    #[test]
    fn only_a_cluster_the_hub_accepts_by_a_true_flag_is_accepted() {
        for (flag, accepted) in [
            (serde_json::json!(true), true),
            (serde_json::json!(false), false),
            (serde_json::json!("true"), false),
            (serde_json::Value::Null, false),
        ] {
            let mut cluster = managed_cluster(flag.clone());
            trim_managed_cluster(&mut cluster);
            let view = ClusterView::of(&cluster, Placed::new(), Excuses::default());
            assert_eq!(view.accepted, accepted, "hubAcceptsClient: {flag}");
            assert_eq!(view.labels.get("env").map(String::as_str), Some("prod"));
        }
    }
}
