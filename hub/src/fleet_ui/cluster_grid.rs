//! A module's clusters as a grid of cells coloured by state, grouped by state so that
//! 3,500 clusters stay readable, each group bounded so that the page stays small.

use std::collections::BTreeMap;

use crate::fleet::cluster_states::{ClusterState, StateCounts};

/// Most cells a group shows; the rest are counted, and found with the filter.
pub const CELLS_PER_GROUP: usize = 1_000;

/// The states with clusters, each with its count and its share of a bar `width` wide and
/// where its segment starts, for the rollout bars.
pub fn segments(counts: StateCounts, width: u32) -> Vec<Segment> {
    let total = counts.total().max(1) as f64;
    let mut x = 0.0;
    ClusterState::ALL
        .into_iter()
        .rev()
        .filter(|s| counts.get(*s) > 0)
        .map(|state| {
            let w = counts.get(state) as f64 / total * f64::from(width);
            let segment = Segment {
                state,
                count: counts.get(state),
                x: format!("{x:.1}"),
                width: format!("{w:.1}"),
            };
            x += w;
            segment
        })
        .collect()
}

/// One state's part of a bar.
#[derive(Clone, Debug, PartialEq)]
pub struct Segment {
    pub state: ClusterState,
    pub count: usize,
    pub x: String,
    pub width: String,
}

/// Which clusters the grid shows: a state, and a part of their names.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct GridFilter {
    pub state: Option<ClusterState>,
    /// Shown only clusters whose name contains it.
    pub name: Option<String>,
}

impl GridFilter {
    /// Whether the filter keeps only clusters in `state` (the form shows it chosen).
    pub fn keeps_only(&self, state: &ClusterState) -> bool {
        self.state == Some(*state)
    }
}

/// The clusters of one state.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GridGroup {
    pub state: ClusterState,
    /// Clusters in this state that match the filter.
    pub matching: usize,
    /// The first [`CELLS_PER_GROUP`] of them, by name.
    pub shown: Vec<String>,
}

impl GridGroup {
    pub fn hidden(&self) -> usize {
        self.matching - self.shown.len()
    }
}

/// The grid: a group per state that has matching clusters, failed first.
pub fn grid(states: &BTreeMap<String, ClusterState>, filter: &GridFilter) -> Vec<GridGroup> {
    let mut groups: BTreeMap<ClusterState, GridGroup> = BTreeMap::new();
    for (cluster, state) in states {
        if filter.state.is_some_and(|s| s != *state)
            || filter
                .name
                .as_ref()
                .is_some_and(|part| !cluster.contains(part.as_str()))
        {
            continue;
        }
        let group = groups.entry(*state).or_insert_with(|| GridGroup {
            state: *state,
            matching: 0,
            shown: Vec::new(),
        });
        group.matching += 1;
        if group.shown.len() < CELLS_PER_GROUP {
            group.shown.push(cluster.clone());
        }
    }
    groups.into_values().collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn states(n: usize, state: ClusterState) -> BTreeMap<String, ClusterState> {
        (0..n).map(|i| (format!("c{i:05}"), state)).collect()
    }

    #[test]
    fn a_group_shows_a_bounded_number_of_cells_and_counts_the_rest() {
        let mut all = states(CELLS_PER_GROUP + 5, ClusterState::Loaded);
        all.insert("zz-failing".into(), ClusterState::Failed);
        let groups = grid(&all, &GridFilter::default());
        assert_eq!(groups[0].state, ClusterState::Failed, "failed first");
        assert_eq!(groups[1].matching, CELLS_PER_GROUP + 5);
        assert_eq!(groups[1].shown.len(), CELLS_PER_GROUP);
        assert_eq!(groups[1].hidden(), 5);
    }

    #[test]
    fn the_filter_keeps_one_state_and_names_containing_a_part() {
        let mut all = states(20, ClusterState::Loaded);
        all.insert("c00011-x".into(), ClusterState::Pending);
        let filter = GridFilter {
            state: Some(ClusterState::Loaded),
            name: Some("c0001".into()),
        };
        let groups = grid(&all, &filter);
        assert_eq!(groups.len(), 1);
        assert_eq!(groups[0].matching, 10, "c00010 to c00019");
    }

    #[test]
    fn segments_share_the_bar_by_count() {
        let counts = StateCounts {
            loaded: 3,
            failed: 1,
            ..StateCounts::default()
        };
        let segments = segments(counts, 100);
        assert_eq!(segments.len(), 2);
        assert_eq!(segments[0].state, ClusterState::Loaded);
        assert_eq!(
            (segments[0].x.as_str(), segments[0].width.as_str()),
            ("0.0", "75.0")
        );
        assert_eq!(
            (segments[1].x.as_str(), segments[1].width.as_str()),
            ("75.0", "25.0")
        );
    }
}
