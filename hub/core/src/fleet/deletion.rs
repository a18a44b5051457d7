//! When a deleted ManagedClusterModule may let its finalizer go: once every affected
//! cluster confirmed the unload on every node, or once the unload timeout elapsed, with
//! the leftovers named. Pure.

use std::collections::BTreeSet;
use std::fmt;
use std::time::Duration;

/// How many leftovers an Event, a log line or the Ready message names.
pub const SHOWN: usize = 20;

/// A place where the unload is not confirmed.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Leftover {
    pub cluster: String,
    /// The node, or `None` when the whole cluster has not reported.
    pub node: Option<String>,
}

impl fmt::Display for Leftover {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.node {
            Some(node) => write!(f, "{}/{}", self.cluster, node),
            None => write!(f, "{} (unload not reported)", self.cluster),
        }
    }
}

/// Where the unload is not confirmed: how many places, and the first [`SHOWN`] of them
/// by cluster then node. Only those few are kept: a fleet-wide deletion starts with every
/// node of every cluster unconfirmed (70,000 at 3,500 clusters of 20 nodes), and each
/// deleted module is looked at up to once a second until it is done.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Leftovers {
    total: usize,
    first: BTreeSet<Leftover>,
}

impl Leftovers {
    /// Counts one cluster: each node that still reports the module in a state other than
    /// UNLOADED, or the cluster itself when none does but its statuses prove nothing
    /// (`unconfirmed`: see `fleet::module_view`).
    pub fn add<'a>(
        &mut self,
        cluster: &str,
        unconfirmed: bool,
        not_unloaded: impl IntoIterator<Item = &'a str>,
    ) {
        let before = self.total;
        for node in not_unloaded {
            self.push(cluster, Some(node));
        }
        if self.total == before && unconfirmed {
            self.push(cluster, None);
        }
    }

    fn push(&mut self, cluster: &str, node: Option<&str>) {
        self.total += 1;
        let kept = self.first.len() < SHOWN
            || self.first.last().is_some_and(|last| {
                (cluster, node) < (last.cluster.as_str(), last.node.as_deref())
            });
        if kept {
            self.first.insert(Leftover {
                cluster: cluster.to_owned(),
                node: node.map(str::to_owned),
            });
            if self.first.len() > SHOWN {
                self.first.pop_last();
            }
        }
    }

    /// How many places are unconfirmed.
    pub fn len(&self) -> usize {
        self.total
    }

    pub fn is_empty(&self) -> bool {
        self.total == 0
    }

    /// The first [`SHOWN`], by cluster then node.
    pub fn first(&self) -> impl Iterator<Item = &Leftover> {
        self.first.iter()
    }
}

impl fmt::Display for Leftovers {
    /// The first few, then how many more.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, leftover) in self.first.iter().enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            write!(f, "{leftover}")?;
        }
        if self.total > self.first.len() {
            write!(f, " and {} more", self.total - self.first.len())?;
        }
        Ok(())
    }
}

/// The deletion's state.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Deletion {
    /// Every affected node confirmed: the finalizer goes.
    Complete,
    /// Waiting for these confirmations.
    Waiting(Leftovers),
    /// The timeout elapsed: the finalizer goes and these are reported.
    TimedOut(Leftovers),
}

/// Decides the deletion given how long ago it was requested.
pub fn decide(leftovers: Leftovers, elapsed: Duration, timeout: Duration) -> Deletion {
    if leftovers.is_empty() {
        Deletion::Complete
    } else if elapsed >= timeout {
        Deletion::TimedOut(leftovers)
    } else {
        Deletion::Waiting(leftovers)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MINUTE: Duration = Duration::from_secs(60);

    fn leftovers(clusters: &[(&str, bool, &[&str])]) -> Leftovers {
        let mut leftovers = Leftovers::default();
        for (cluster, unconfirmed, nodes) in clusters {
            leftovers.add(cluster, *unconfirmed, nodes.iter().copied());
        }
        leftovers
    }

    #[test]
    fn confirmed_everywhere_completes() {
        let left = leftovers(&[("a", false, &[]), ("b", false, &[])]);
        assert_eq!(decide(left, Duration::ZERO, MINUTE), Deletion::Complete);
    }

    #[test]
    fn unconfirmed_nodes_and_silent_selected_clusters_wait() {
        let left = leftovers(&[
            ("b", false, &["n2", "n1"]),
            ("a", true, &[]),
            ("c", true, &["n9"]),
        ]);
        assert_eq!(
            left.first().map(Leftover::to_string).collect::<Vec<_>>(),
            ["a (unload not reported)", "b/n1", "b/n2", "c/n9"]
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
    fn only_the_first_few_are_kept_and_the_rest_counted() {
        let nodes: Vec<String> = (0..100).rev().map(|n| format!("n{n:03}")).collect();
        let mut left = Leftovers::default();
        for cluster in ["c", "a", "b"] {
            left.add(cluster, false, nodes.iter().map(String::as_str));
        }
        assert_eq!(left.len(), 300);
        let shown: Vec<String> = left.first().map(Leftover::to_string).collect();
        assert_eq!(shown.len(), SHOWN);
        assert_eq!(shown[0], "a/n000");
        assert_eq!(shown[SHOWN - 1], format!("a/n{:03}", SHOWN - 1));
        assert!(
            left.to_string()
                .ends_with(&format!(" and {} more", 300 - SHOWN))
        );
    }

    #[test]
    fn descriptions_name_each_shown_one() {
        let left = leftovers(&[("a", false, &["n1", "n2", "n3"])]);
        assert_eq!(left.to_string(), "a/n1, a/n2, a/n3");
        assert_eq!(Leftovers::default().to_string(), "");
    }
}
