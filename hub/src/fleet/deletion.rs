//! When a deleted ManagedClusterModule may let its finalizer go: once every affected
//! cluster confirmed the unload on every node, or once the unload timeout elapsed, with
//! the leftovers named. Pure.

use std::fmt;
use std::time::Duration;

/// What the hub knows about the module's unload in one cluster.
#[derive(Clone, Debug)]
pub struct ClusterUnload<'a> {
    pub cluster: &'a str,
    /// The cluster is selected by the module.
    pub selected: bool,
    /// The cluster's proxy has sent a full status report since the hub started: without
    /// one, "no node reports the module" proves nothing.
    pub statuses_known: bool,
    /// Nodes that still report the module in a state other than UNLOADED.
    pub not_unloaded: Vec<String>,
}

/// Where the unload is not confirmed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Leftover {
    pub cluster: String,
    /// The node, or `None` when the whole cluster has not reported.
    pub node: Option<String>,
}

impl fmt::Display for Leftover {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.node {
            Some(node) => write!(f, "{}/{}", self.cluster, node),
            None => write!(f, "{} (no status reported)", self.cluster),
        }
    }
}

/// The deletion's state.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Deletion {
    /// Every affected node confirmed: the finalizer goes.
    Complete,
    /// Waiting for these confirmations.
    Waiting(Vec<Leftover>),
    /// The timeout elapsed: the finalizer goes and these are reported.
    TimedOut(Vec<Leftover>),
}

/// Every place the unload is still unconfirmed, ordered by cluster then node.
pub fn leftovers(clusters: &[ClusterUnload<'_>]) -> Vec<Leftover> {
    let mut out = Vec::new();
    for c in clusters {
        if !c.not_unloaded.is_empty() {
            out.extend(c.not_unloaded.iter().map(|node| Leftover {
                cluster: c.cluster.to_owned(),
                node: Some(node.clone()),
            }));
        } else if c.selected && !c.statuses_known {
            out.push(Leftover {
                cluster: c.cluster.to_owned(),
                node: None,
            });
        }
    }
    out.sort_by(|a, b| (&a.cluster, &a.node).cmp(&(&b.cluster, &b.node)));
    out
}

/// Decides the deletion given how long ago it was requested.
pub fn decide(leftovers: Vec<Leftover>, elapsed: Duration, timeout: Duration) -> Deletion {
    if leftovers.is_empty() {
        Deletion::Complete
    } else if elapsed >= timeout {
        Deletion::TimedOut(leftovers)
    } else {
        Deletion::Waiting(leftovers)
    }
}

/// A bounded, readable list of leftovers for an Event or a log line.
pub fn describe(leftovers: &[Leftover], max: usize) -> String {
    let mut text = leftovers
        .iter()
        .take(max)
        .map(Leftover::to_string)
        .collect::<Vec<_>>()
        .join(", ");
    if leftovers.len() > max {
        text.push_str(&format!(" and {} more", leftovers.len() - max));
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cluster<'a>(
        name: &'a str,
        selected: bool,
        known: bool,
        nodes: &[&str],
    ) -> ClusterUnload<'a> {
        ClusterUnload {
            cluster: name,
            selected,
            statuses_known: known,
            not_unloaded: nodes.iter().map(|n| n.to_string()).collect(),
        }
    }

    const MINUTE: Duration = Duration::from_secs(60);

    #[test]
    fn confirmed_everywhere_completes() {
        let left = leftovers(&[
            cluster("a", true, true, &[]),
            cluster("b", false, false, &[]),
        ]);
        assert_eq!(decide(left, Duration::ZERO, MINUTE), Deletion::Complete);
    }

    #[test]
    fn unconfirmed_nodes_and_silent_selected_clusters_wait() {
        let left = leftovers(&[
            cluster("b", true, true, &["n2", "n1"]),
            cluster("a", true, false, &[]),
            cluster("c", false, true, &["n9"]),
        ]);
        assert_eq!(
            left.iter().map(Leftover::to_string).collect::<Vec<_>>(),
            ["a (no status reported)", "b/n1", "b/n2", "c/n9"]
        );
        assert!(
            matches!(decide(left.clone(), MINUTE / 2, MINUTE), Deletion::Waiting(l) if l.len() == 4)
        );
        assert_eq!(
            decide(left.clone(), MINUTE, MINUTE),
            Deletion::TimedOut(left)
        );
    }

    #[test]
    fn descriptions_are_bounded() {
        let left = leftovers(&[cluster("a", true, true, &["n1", "n2", "n3"])]);
        assert_eq!(describe(&left, 2), "a/n1, a/n2 and 1 more");
        assert_eq!(describe(&left, 5), "a/n1, a/n2, a/n3");
        assert_eq!(describe(&[], 5), "");
    }
}
