//! A node's page: each module the node's cluster reported on it, with its state, the
//! version sent for the node's kernel, and the reason and message of its status.

use crate::serve::fleet_view::FleetView;

use super::cluster_page::{ModuleOnNode, module_on_node};

#[derive(Clone, Debug, PartialEq)]
pub struct NodePage {
    pub cluster: String,
    pub node: String,
    pub kernel: String,
    /// Whether the cluster's proxy is connected now.
    pub connected: bool,
    /// By module name.
    pub modules: Vec<ModuleOnNode>,
}

/// The node's page from the view as it is now; `None` when the cluster reported no
/// status of the node.
pub fn node_page(view: &FleetView, cluster: &str, node: &str) -> Option<NodePage> {
    view.read_cluster(cluster, |readout| {
        let mut kernel = None;
        let mut modules = Vec::new();
        for (module, statuses) in readout.statuses().modules() {
            // Each module's statuses are sorted by node name.
            let Ok(at) = statuses.binary_search_by(|s| (*s.node.name).cmp(node)) else {
                continue;
            };
            let status = &statuses[at];
            kernel.get_or_insert_with(|| status.node.kernel.to_string());
            modules.push(module_on_node(readout, module, status));
        }
        modules.sort_by(|a, b| (&a.module, &a.namespace).cmp(&(&b.module, &b.namespace)));
        Some(NodePage {
            cluster: cluster.to_owned(),
            node: node.to_owned(),
            kernel: kernel?,
            connected: readout.connected(),
            modules,
        })
    })
    .flatten()
}
