//! Where each selected cluster stands with a module, as the fleet UI shows it: one state
//! per cluster, from what the module's view observed of it. Pure.

use std::collections::BTreeMap;

use super::module_view::ModuleView;
use super::rollout::Observation;

/// Where a selected cluster stands with one module.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum ClusterState {
    /// A node fails (or cannot load) the module.
    Failed,
    /// Its proxy is not connected: what it runs is not known now.
    Disconnected,
    /// Kept running the module though no Placement decides it any more.
    Held,
    /// Not every matching node runs the revision it was given yet.
    Pending,
    /// Every matching node runs it.
    Loaded,
}

impl ClusterState {
    pub const ALL: [Self; 5] = [
        Self::Failed,
        Self::Disconnected,
        Self::Held,
        Self::Pending,
        Self::Loaded,
    ];

    /// Its name in pages, CSS classes and the `state` query parameter.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Failed => "failed",
            Self::Disconnected => "disconnected",
            Self::Held => "held",
            Self::Pending => "pending",
            Self::Loaded => "loaded",
        }
    }

    pub fn parse(value: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|s| s.as_str() == value)
    }
}

/// Where `cluster` stands, from what the module's view observed of it.
fn state_of(view: &ModuleView, cluster: &str, observation: &Observation) -> ClusterState {
    if observation.failure.is_some() {
        ClusterState::Failed
    } else if !observation.connected {
        ClusterState::Disconnected
    } else if view.held.contains(cluster) {
        ClusterState::Held
    } else if observation.converged {
        ClusterState::Loaded
    } else {
        ClusterState::Pending
    }
}

/// Each selected cluster's state with the module, by cluster name.
pub fn cluster_states(view: &ModuleView) -> BTreeMap<String, ClusterState> {
    view.observed
        .iter()
        .map(|(cluster, observation)| (cluster.clone(), state_of(view, cluster, observation)))
        .collect()
}

/// How many of the module's selected clusters are in each state.
pub fn state_counts(view: &ModuleView) -> StateCounts {
    let mut counts = StateCounts::default();
    for (cluster, observation) in &view.observed {
        *counts.slot(state_of(view, cluster, observation)) += 1;
    }
    counts
}

/// How many clusters are in each state.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StateCounts {
    pub failed: usize,
    pub disconnected: usize,
    pub held: usize,
    pub pending: usize,
    pub loaded: usize,
}

impl StateCounts {
    pub fn of<'a>(states: impl IntoIterator<Item = &'a ClusterState>) -> Self {
        let mut counts = Self::default();
        for state in states {
            *counts.slot(*state) += 1;
        }
        counts
    }

    fn slot(&mut self, state: ClusterState) -> &mut usize {
        match state {
            ClusterState::Failed => &mut self.failed,
            ClusterState::Disconnected => &mut self.disconnected,
            ClusterState::Held => &mut self.held,
            ClusterState::Pending => &mut self.pending,
            ClusterState::Loaded => &mut self.loaded,
        }
    }

    pub fn get(self, state: ClusterState) -> usize {
        match state {
            ClusterState::Failed => self.failed,
            ClusterState::Disconnected => self.disconnected,
            ClusterState::Held => self.held,
            ClusterState::Pending => self.pending,
            ClusterState::Loaded => self.loaded,
        }
    }

    pub fn total(self) -> usize {
        self.failed + self.disconnected + self.held + self.pending + self.loaded
    }
}
