//! A module's page: its clusters by state as a grid, the rollout's waves and where it
//! stands or why it halted, failures with node, kernel, reason and message, its
//! images with digest and build or signature state, and its recent Events.

use kmm_api::{FailureSample, HeldCluster, ImageStatus, ManagedClusterModule, NodeCounts};
use kube::ResourceExt;

use crate::serve::fleet_view::FleetView;

use super::cluster_grid::{GridFilter, GridGroup, grid};
use crate::fleet::cluster_states::{StateCounts, cluster_states};
use crate::fleet::module_events::RecentEvent;

#[derive(Clone, Debug, PartialEq)]
pub struct ModulePage {
    pub name: String,
    pub spoke_namespace: String,
    pub generation: Option<i64>,
    pub deleting: bool,
    /// Why its spec is invalid, when it is.
    pub invalid: Option<String>,
    /// Selected clusters by state.
    pub counts: StateCounts,
    /// Matching nodes of the selected clusters, by state.
    pub nodes: NodeCounts,
    pub rollout: Option<RolloutModel>,
    pub filter: GridFilter,
    pub grid: Vec<GridGroup>,
    /// A sample of the failures, newest first.
    pub failures: Vec<FailureSample>,
    /// A sample of the clusters held, with why.
    pub held: Vec<HeldCluster>,
    pub images: Vec<ImageStatus>,
    /// The newest Events about it, newest first.
    pub events: Vec<RecentEvent>,
}

/// Where the rollout stands, as the controller last wrote it in status.
#[derive(Clone, Debug, PartialEq)]
pub struct RolloutModel {
    pub revision: String,
    pub state: String,
    /// Where it stands, or why it halted.
    pub summary: String,
    pub waves: Vec<WaveRow>,
}

/// One wave (a Placement's decision group) of the rollout.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WaveRow {
    pub group: String,
    pub total: i32,
    pub succeeded: i32,
    pub progressing: i32,
    pub failed: i32,
    pub to_apply: i32,
}

/// The module's page from the view as it is now, its grid filtered by `filter`.
pub fn module_page(
    view: &FleetView,
    module: &ManagedClusterModule,
    filter: GridFilter,
) -> ModulePage {
    let module_view = view.module_view(module);
    let states = cluster_states(&module_view);
    let rollout = module
        .status
        .as_ref()
        .and_then(|s| s.rollout.as_ref())
        .map(|rollout| RolloutModel {
            revision: rollout.revision.clone(),
            state: rollout.state.clone(),
            summary: rollout.summary.clone(),
            waves: rollout
                .groups
                .iter()
                .map(|g| WaveRow {
                    group: g.group.clone(),
                    total: g.counts.total,
                    succeeded: g.counts.succeeded,
                    progressing: g.counts.progressing,
                    failed: g.counts.failed,
                    to_apply: g.counts.to_apply,
                })
                .collect(),
        });
    let status = module_view.status;
    ModulePage {
        name: module.name_any(),
        spoke_namespace: module.spec.spoke_namespace.clone(),
        generation: module.metadata.generation,
        deleting: module.metadata.deletion_timestamp.is_some(),
        invalid: view.invalid(module),
        counts: StateCounts::of(states.values()),
        nodes: status.nodes,
        rollout,
        grid: grid(&states, &filter),
        filter,
        failures: status.failures,
        held: status.held,
        images: status.images,
        events: view.recent_events(&module.name_any()),
    }
}
