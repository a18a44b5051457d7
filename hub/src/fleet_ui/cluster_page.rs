//! A cluster's page: its connection, kernels, and each node with its modules by state
//! and those that fail, from what the cluster's proxy last reported to this hub.

use std::collections::BTreeMap;
use std::sync::Arc;

use kmm_proto::v1::ModuleState;
use kmm_proto::v1::kernel_target::Target;

use crate::fleet::module_id::ModuleId;
use crate::fleet::node_statuses::{Node, NodeStatus};
use crate::serve::fleet_view::{ClusterReadout, FleetView};

/// Most nodes the page lists; the rest are counted, and found with the filter.
pub const NODES_SHOWN: usize = 1_000;

/// Most failing modules a node's row names.
pub const PROBLEMS_PER_NODE: usize = 5;

#[derive(Clone, Debug, PartialEq)]
pub struct ClusterPage {
    pub name: String,
    /// Whether a ManagedCluster of this name exists.
    pub managed: bool,
    /// What its session holds; `None` when its proxy never connected to this hub.
    pub session: Option<ClusterSessionModel>,
    /// Shown only nodes whose name contains it.
    pub filter: Option<String>,
}

#[derive(Clone, Debug, PartialEq)]
pub struct ClusterSessionModel {
    pub connected: bool,
    /// The kernels of its latest inventory.
    pub kernels: Vec<String>,
    pub nodes: Vec<NodeRow>,
    /// Nodes matching the filter beyond [`NODES_SHOWN`].
    pub hidden: usize,
}

/// One node: its modules counted by state, and those that fail.
#[derive(Clone, Debug, PartialEq)]
pub struct NodeRow {
    pub name: String,
    pub kernel: String,
    pub loaded: usize,
    pub pending: usize,
    pub failed: usize,
    /// Unloaded or skipped.
    pub idle: usize,
    /// The first [`PROBLEMS_PER_NODE`] failing modules.
    pub problems: Vec<ModuleOnNode>,
    /// When the latest of its modules' statuses changed, as this hub heard it.
    pub changed: Option<String>,
}

/// One module on one node.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ModuleOnNode {
    pub module: String,
    pub namespace: String,
    pub state: &'static str,
    /// The version the node was sent for its kernel: what `Loaded` means it runs.
    pub version: Option<String>,
    pub reason: String,
    pub message: String,
    /// When the status became what it is, as this hub heard it.
    pub since: Option<String>,
}

/// A status's [`NodeStatus::since`] as pages show it: UTC to the second; `None` when the
/// status was never stamped.
pub fn heard_at(unix_seconds: u32) -> Option<String> {
    (unix_seconds > 0)
        .then(|| k8s_openapi::jiff::Timestamp::from_second(i64::from(unix_seconds)).ok())
        .flatten()
        .map(|t| t.strftime("%Y-%m-%d %H:%M:%S UTC").to_string())
}

/// A node status's state as pages name it.
pub fn state_name(state: ModuleState) -> &'static str {
    match state {
        ModuleState::Unspecified => "unknown",
        ModuleState::Pending => "pending",
        ModuleState::Loaded => "loaded",
        ModuleState::Failed => "failed",
        ModuleState::Unloaded => "unloaded",
        ModuleState::Skipped => "skipped",
    }
}

/// One module's status on one node, with the version the node's kernel was sent.
pub fn module_on_node(
    cluster: ClusterReadout<'_>,
    (namespace, name): &ModuleId,
    status: &NodeStatus,
) -> ModuleOnNode {
    let version = cluster
        .resolutions(namespace, name)
        .iter()
        .find(|t| *t.kernel == *status.node.kernel)
        .and_then(|t| match &t.target {
            Some(Target::Load(load)) => Some(load.version.clone()),
            _ => None,
        });
    ModuleOnNode {
        module: name.to_string(),
        namespace: namespace.to_string(),
        state: state_name(status.state),
        version,
        reason: status.reason().to_owned(),
        message: status.message().to_owned(),
        since: heard_at(status.since),
    }
}

/// The session's nodes as rows, those whose name contains `filter`.
pub fn session_model(cluster: ClusterReadout<'_>, filter: Option<&str>) -> ClusterSessionModel {
    let mut nodes: BTreeMap<Arc<str>, NodeRow> = BTreeMap::new();
    // Stamps compare as numbers; only the shown rows' are formatted.
    let mut changed: BTreeMap<Arc<str>, u32> = BTreeMap::new();
    for (module, statuses) in cluster.statuses().modules() {
        for status in statuses {
            let Node { name, kernel } = &*status.node;
            if filter.is_some_and(|part| !name.contains(part)) {
                continue;
            }
            let row = nodes.entry(name.clone()).or_insert_with(|| NodeRow {
                name: name.to_string(),
                kernel: kernel.to_string(),
                loaded: 0,
                pending: 0,
                failed: 0,
                idle: 0,
                problems: Vec::new(),
                changed: None,
            });
            let latest = changed.entry(name.clone()).or_default();
            *latest = (*latest).max(status.since);
            match status.state {
                ModuleState::Loaded => row.loaded += 1,
                ModuleState::Failed => {
                    row.failed += 1;
                    if row.problems.len() < PROBLEMS_PER_NODE {
                        row.problems.push(module_on_node(cluster, module, status));
                    }
                }
                ModuleState::Unloaded | ModuleState::Skipped => row.idle += 1,
                ModuleState::Pending | ModuleState::Unspecified => row.pending += 1,
            }
        }
    }
    let matching = nodes.len();
    let nodes: Vec<NodeRow> = nodes
        .into_iter()
        .take(NODES_SHOWN)
        .map(|(name, row)| NodeRow {
            changed: changed.get(&name).copied().and_then(heard_at),
            ..row
        })
        .collect();
    ClusterSessionModel {
        connected: cluster.connected(),
        kernels: cluster
            .kernels()
            .map(|k| k.iter().cloned().collect())
            .unwrap_or_default(),
        hidden: matching - nodes.len(),
        nodes,
    }
}

/// The cluster's page from the view as it is now; `None` when the hub knows no such
/// cluster (no ManagedCluster, no session).
pub fn cluster_page(view: &FleetView, name: &str, filter: Option<String>) -> Option<ClusterPage> {
    let managed = view.cluster_names().iter().any(|c| c == name);
    let session = view.read_cluster(name, |cluster| session_model(cluster, filter.as_deref()));
    (managed || session.is_some()).then(|| ClusterPage {
        name: name.to_owned(),
        managed,
        session,
        filter,
    })
}

#[cfg(test)]
mod tests {
    use super::heard_at;

    #[test]
    fn a_stamp_reads_as_utc_to_the_second_and_none_is_shown_for_no_stamp() {
        assert_eq!(heard_at(0), None);
        assert_eq!(
            heard_at(1_795_737_600).as_deref(),
            Some("2026-11-27 00:00:00 UTC")
        );
    }
}
