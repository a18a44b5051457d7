//! Ordered upgrades inside the cluster: whether a node running another version of a
//! module may move to the intent's version now. Pure.
//!
//! A node moves when the user released it with upstream's
//! `kmm.node.kubernetes.io/version-module.<ns>.<name>` label, or, without that label,
//! when fewer than `maxUnavailable` other matching nodes lack the module. A node without
//! the module (new, failed, rebooted, or half-way through its own upgrade) has nothing to
//! lose and is never held. Only what agents proved counts: a node whose agent has not
//! said hello yet counts as lacking the module, so a restarted proxy moves no more nodes
//! than before.

use kmm_api::MaxUnavailable;
use kmm_proto::v1::{ModuleIntent, module_intent};

/// Reason of a node kept at its version because a label pins it.
pub const REASON_VERSION_PINNED: &str = "VersionPinned";
/// Reason of a node kept at its version until fewer nodes lack the module.
pub const REASON_AWAITING_TURN: &str = "AwaitingUpgradeTurn";
/// Reason of a node kept as it is until the module's device plugin pod left it.
pub const REASON_DEVICE_PLUGIN_STOPPING: &str = "DevicePluginStopping";

/// What keeps a node at the version it runs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Hold {
    /// The node's version-module label names another version.
    Pinned { label: String },
    /// `max` matching nodes already lack the module.
    Waiting { max: usize },
    /// The module's device plugin pod still runs on the node: it stops before the module
    /// is unloaded (`unload`) or moves to another version (upstream's order).
    DevicePluginStopping { unload: bool },
}

/// Where one node stands in a module's version change.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Node<'a> {
    /// The version the intent loads on the node.
    pub target: &'a str,
    /// The version the node's agent proved loaded, if any.
    pub running: Option<&'a str>,
    /// The value of the node's version-module label, if it carries one.
    pub pinned: Option<&'a str>,
}

/// The cluster around the node, for one module.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Cluster {
    /// Nodes the module is placed on, this one included.
    pub matching: usize,
    /// Other matching nodes without the module at their target version.
    pub unavailable: usize,
}

/// `None`: the node moves to (or stays at) the target now. `cluster` is asked only when
/// the limit decides.
pub fn hold(
    node: &Node<'_>,
    limit: Option<MaxUnavailable>,
    cluster: impl FnOnce() -> Cluster,
) -> Option<Hold> {
    if let Some(label) = node.pinned {
        return (label != node.target).then(|| Hold::Pinned {
            label: label.to_owned(),
        });
    }
    let running = node.running?;
    if running == node.target {
        return None;
    }
    let limit = limit?;
    let cluster = cluster();
    let max = limit.nodes_of(cluster.matching);
    (cluster.unavailable >= max).then_some(Hold::Waiting { max })
}

/// The intent's `maxUnavailable`, if it sets one.
pub fn limit(intent: &ModuleIntent) -> Option<MaxUnavailable> {
    intent.max_unavailable.map(|m| match m {
        module_intent::MaxUnavailable::MaxUnavailableNodes(n) => MaxUnavailable::Nodes(n),
        module_intent::MaxUnavailable::MaxUnavailablePercent(p) => MaxUnavailable::Percent(p),
    })
}

/// The status message of a held node.
pub fn describe(hold: &Hold, running: Option<&str>, target: &str) -> (&'static str, String) {
    let runs = running.map_or_else(
        || "runs no version of the module".to_owned(),
        |v| format!("runs version {v:?}"),
    );
    match hold {
        Hold::Pinned { label } => (
            REASON_VERSION_PINNED,
            format!(
                "the node's version-module label pins version {label:?} and the module is at \
                 {target:?}; the node {runs} until the label names {target:?} or is removed"
            ),
        ),
        Hold::Waiting { max } => (
            REASON_AWAITING_TURN,
            format!(
                "the node {runs} and moves to {target:?} once fewer than {max} matching nodes \
                 lack the module (nodeUpgrade.maxUnavailable)"
            ),
        ),
        Hold::DevicePluginStopping { unload } => (
            REASON_DEVICE_PLUGIN_STOPPING,
            format!(
                "the node {runs}; the module's device plugin pod stops on it before {}",
                if *unload {
                    "the module is unloaded".to_owned()
                } else {
                    format!("the module moves to {target:?}")
                }
            ),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node<'a>(running: Option<&'a str>, pinned: Option<&'a str>) -> Node<'a> {
        Node {
            target: "v2",
            running,
            pinned,
        }
    }

    const ONE: Option<MaxUnavailable> = Some(MaxUnavailable::Nodes(1));

    fn cluster(unavailable: usize) -> impl FnOnce() -> Cluster {
        move || Cluster {
            matching: 3,
            unavailable,
        }
    }

    #[test]
    fn a_node_moves_while_fewer_than_max_nodes_lack_the_module() {
        assert_eq!(hold(&node(Some("v1"), None), ONE, cluster(0)), None);
        assert_eq!(
            hold(&node(Some("v1"), None), ONE, cluster(1)),
            Some(Hold::Waiting { max: 1 })
        );
        let half = Some(MaxUnavailable::Percent(50));
        assert_eq!(hold(&node(Some("v1"), None), half, cluster(1)), None);
        assert_eq!(
            hold(&node(Some("v1"), None), half, cluster(2)),
            Some(Hold::Waiting { max: 2 })
        );
    }

    #[test]
    fn without_a_limit_every_node_moves_at_once() {
        assert_eq!(hold(&node(Some("v1"), None), None, cluster(2)), None);
    }

    #[test]
    fn a_node_at_the_target_or_without_the_module_is_never_held() {
        assert_eq!(hold(&node(Some("v2"), None), ONE, cluster(2)), None);
        assert_eq!(hold(&node(None, None), ONE, cluster(2)), None);
    }

    #[test]
    fn the_version_module_label_decides_whatever_the_limit() {
        assert_eq!(hold(&node(Some("v1"), Some("v2")), ONE, cluster(2)), None);
        let pinned = Some(Hold::Pinned { label: "v1".into() });
        assert_eq!(
            hold(&node(Some("v1"), Some("v1")), None, cluster(0)),
            pinned
        );
        assert_eq!(hold(&node(None, Some("v1")), ONE, cluster(0)), pinned);
    }

    #[test]
    fn a_held_nodes_status_names_both_versions_and_the_reason() {
        let (reason, message) = describe(&Hold::Waiting { max: 1 }, Some("v1"), "v2");
        assert_eq!(reason, REASON_AWAITING_TURN);
        assert!(
            message.contains("\"v1\"") && message.contains("\"v2\""),
            "{message}"
        );
        let (reason, message) = describe(&Hold::Pinned { label: "v0".into() }, None, "v2");
        assert_eq!(reason, REASON_VERSION_PINNED);
        assert!(
            message.contains("\"v0\"") && message.contains("runs no version"),
            "{message}"
        );
    }
}
