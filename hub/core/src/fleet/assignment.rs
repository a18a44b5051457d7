//! Which modules a cluster's snapshot carries, and which of them it must unload. Pure.
//!
//! A selected module is loaded; a module being deleted is unloaded wherever it is selected
//! or still reported; a cluster no longer selected unloads the module while any of its
//! nodes still reports it not unloaded, after which the module leaves the snapshot (absent
//! means forgotten, never unloaded). A cluster its Placements dropped for a reason that is
//! not a request is held: it keeps what it runs, and gets nothing new (see
//! `placements::held`). A module goes nowhere until it carries the hub's finalizer:
//! loading one whose deletion the hub could miss would leave it loaded forever.

use std::collections::BTreeMap;
use std::sync::Arc;

use kmm_api::{ManagedClusterModule, PlacementRef};

use super::intents::{ModuleInput, selects};
use super::node_statuses::NodeStatuses;
use super::placements::{Excuses, HoldReason, Placed, held, is_placed};

/// What a module's selection of a ManagedCluster reads: its labels, the Placements that
/// decided it, and what excuses the others' silence.
#[derive(Clone, Copy, Debug)]
pub struct ClusterFacts<'a> {
    pub labels: &'a BTreeMap<String, String>,
    pub placed: &'a Placed,
    pub excuses: &'a Excuses,
}

/// How a module stands towards a cluster.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Selection {
    Selected,
    /// Its Placements no longer decide the cluster, for a reason that is not a request:
    /// what runs there stays, nothing new is loaded.
    Held(PlacementRef, HoldReason),
    Unselected,
}

/// How a ManagedClusterModule stands towards a cluster (`None`: the ManagedCluster does
/// not exist, so nothing selects it).
pub fn selection(module: &ManagedClusterModule, cluster: Option<ClusterFacts<'_>>) -> Selection {
    let Some(c) = cluster.filter(|c| selects(&module.spec.selector, c.labels)) else {
        return Selection::Unselected;
    };
    if is_placed(module, c.placed) {
        return Selection::Selected;
    }
    match held(module, c.placed, c.excuses) {
        Some((placement, reason)) => Selection::Held(placement, reason),
        None => Selection::Unselected,
    }
}

/// Held by every ManagedClusterModule the hub acts on, until its unload is confirmed or
/// timed out.
pub const FINALIZER: &str = "hub.kmm.sigs.x-k8s.io/unload";

/// Whether the hub's finalizer guards the module, so that its deletion waits for the hub.
pub fn is_guarded(module: &ManagedClusterModule) -> bool {
    module
        .metadata
        .finalizers
        .iter()
        .flatten()
        .any(|f| f == FINALIZER)
}

/// Whether a ManagedClusterModule selects a cluster: its labels match the module's
/// selector and, when the module names Placements, one of them decided it (`None`: the
/// ManagedCluster does not exist, so nothing selects it).
pub fn is_selected(module: &ManagedClusterModule, cluster: Option<ClusterFacts<'_>>) -> bool {
    selection(module, cluster) == Selection::Selected
}

/// Whether the module is being deleted.
pub fn is_deleting(module: &ManagedClusterModule) -> bool {
    module.metadata.deletion_timestamp.is_some()
}

/// The modules of one cluster's snapshot. `unconfirmed` says whether the cluster has yet
/// to confirm a module's unload (see `Outbox::unload_unconfirmed`): such a module stays,
/// to be unloaded, whatever the statuses say.
pub fn cluster_modules<'a>(
    modules: &'a [Arc<ManagedClusterModule>],
    cluster: Option<ClusterFacts<'_>>,
    reported: &NodeStatuses,
    unconfirmed: &dyn Fn(&str, &str) -> bool,
) -> Vec<ModuleInput<'a>> {
    modules
        .iter()
        .filter(|module| is_guarded(module))
        .filter_map(|module| {
            let selection = selection(module, cluster);
            let selected = selection == Selection::Selected;
            let name = module.metadata.name.as_deref().unwrap_or_default();
            let namespace = module.spec.spoke_namespace.as_str();
            let lingering = reported.lingers(namespace, name) || unconfirmed(namespace, name);
            let unload = is_deleting(module) || selection == Selection::Unselected;
            (selected || lingering).then_some(ModuleInput { module, unload })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use kmm_proto::v1::ModuleState;

    use kmm_api::testing::ModuleBuilder;

    use super::*;

    /// A guarded module selecting the clusters labelled `fleet: <fleet>` (all: `None`).
    fn module(name: &str, fleet: Option<&str>) -> ModuleBuilder {
        let selector: Vec<(&str, &str)> = fleet.map(|f| ("fleet", f)).into_iter().collect();
        ModuleBuilder::new(name)
            .without("/metadata/generation")
            .finalizers(&[FINALIZER])
            .selector(&selector)
    }

    fn mcm(name: &str, fleet: Option<&str>) -> ManagedClusterModule {
        module(name, fleet).build()
    }

    fn deleting(name: &str, fleet: Option<&str>) -> ManagedClusterModule {
        module(name, fleet).deleting().build()
    }

    fn reported(entries: &[(&str, ModuleState)]) -> NodeStatuses {
        let on_n1: Vec<_> = entries.iter().map(|&(m, state)| (m, "n1", state)).collect();
        NodeStatuses::reported(&on_n1)
    }

    fn plan(
        modules: &[&ManagedClusterModule],
        labels: Option<&BTreeMap<String, String>>,
        statuses: &NodeStatuses,
    ) -> Vec<(String, bool)> {
        let placed = Placed::new();
        let excuses = Excuses::default();
        let cluster = labels.map(|labels| ClusterFacts {
            labels,
            placed: &placed,
            excuses: &excuses,
        });
        let modules: Vec<Arc<ManagedClusterModule>> =
            modules.iter().map(|m| Arc::new((*m).clone())).collect();
        cluster_modules(&modules, cluster, statuses, &|_, _| false)
            .iter()
            .map(|input| (input.module.metadata.name.clone().unwrap(), input.unload))
            .collect()
    }

    fn labels() -> BTreeMap<String, String> {
        BTreeMap::from([("fleet".to_string(), "a".to_string())])
    }

    #[test]
    fn selected_modules_load_and_unselected_unreported_ones_are_absent() {
        let a = mcm("a", Some("a"));
        let b = mcm("b", Some("b"));
        let all = mcm("all", None);
        assert_eq!(
            plan(&[&a, &b, &all], Some(&labels()), &NodeStatuses::default()),
            [("a".to_string(), false), ("all".to_string(), false)]
        );
    }

    #[test]
    fn a_module_naming_placements_selects_only_clusters_one_of_them_decided() {
        let mut gpu = mcm("gpu", Some("a"));
        let placement = kmm_api::PlacementRef {
            namespace: "fleet".into(),
            name: "gpu".into(),
        };
        gpu.spec.placement_refs = Some(vec![placement.clone()]);
        let labels = labels();
        let undecided = Placed::new();
        let decided = Placed::from([(placement, Default::default())]);
        let excuses = Excuses::default();
        let facts = |placed| {
            Some(ClusterFacts {
                labels: &labels,
                placed,
                excuses: &excuses,
            })
        };
        assert!(!is_selected(&gpu, facts(&undecided)));
        assert!(is_selected(&gpu, facts(&decided)));
        gpu.spec.selector = BTreeMap::from([("fleet".into(), "b".into())]);
        assert!(
            !is_selected(&gpu, facts(&decided)),
            "the selector still applies"
        );
    }

    #[test]
    fn a_module_not_yet_guarded_by_the_finalizer_goes_nowhere() {
        let mut fresh = mcm("fresh", Some("a"));
        fresh.metadata.finalizers = None;
        assert!(plan(&[&fresh], Some(&labels()), &NodeStatuses::default()).is_empty());
        assert!(
            plan(
                &[&fresh],
                Some(&labels()),
                &reported(&[("fresh", ModuleState::Loaded)])
            )
            .is_empty()
        );
    }

    #[test]
    fn a_missing_managed_cluster_is_selected_by_nothing() {
        let all = mcm("all", None);
        assert!(plan(&[&all], None, &NodeStatuses::default()).is_empty());
        assert_eq!(
            plan(&[&all], None, &reported(&[("all", ModuleState::Loaded)])),
            [("all".to_string(), true)]
        );
    }

    #[test]
    fn deselection_unloads_until_every_node_confirms() {
        let b = mcm("b", Some("b"));
        for state in [
            ModuleState::Loaded,
            ModuleState::Pending,
            ModuleState::Failed,
        ] {
            assert_eq!(
                plan(&[&b], Some(&labels()), &reported(&[("b", state)])),
                [("b".to_string(), true)],
                "{state:?} may still be loaded"
            );
        }
        assert!(
            plan(
                &[&b],
                Some(&labels()),
                &reported(&[("b", ModuleState::Unloaded)])
            )
            .is_empty(),
            "confirmed unloaded: forgotten"
        );
    }

    #[test]
    fn deletion_unloads_where_selected_or_still_reported() {
        let a = deleting("a", Some("a"));
        let b = deleting("b", Some("b"));
        let none = NodeStatuses::default();
        assert_eq!(
            plan(&[&a, &b], Some(&labels()), &none),
            [("a".to_string(), true)]
        );
        assert_eq!(
            plan(
                &[&a],
                Some(&labels()),
                &reported(&[("a", ModuleState::Unloaded)])
            ),
            [("a".to_string(), true)],
            "still selected: the unload stays explicit until the finalizer goes"
        );
        assert_eq!(
            plan(
                &[&b],
                Some(&labels()),
                &reported(&[("b", ModuleState::Loaded)])
            ),
            [("b".to_string(), true)]
        );
    }

    /// `builder`'s module placed by Placement `fleet/gpu`.
    fn placed_by_gpu(builder: ModuleBuilder) -> ManagedClusterModule {
        let mut module = builder.build();
        module.spec.placement_refs = Some(vec![gpu_placement()]);
        module
    }

    /// `module`'s plan on a cluster labelled `fleet: a` that Placement `fleet/gpu` no
    /// longer decides, with `excuses`.
    fn plan_on(
        module: &ManagedClusterModule,
        excuses: &Excuses,
        statuses: &NodeStatuses,
    ) -> Vec<(String, bool)> {
        let labels = labels();
        let placed = Placed::new();
        let facts = ClusterFacts {
            labels: &labels,
            placed: &placed,
            excuses,
        };
        cluster_modules(
            &[Arc::new(module.clone())],
            Some(facts),
            statuses,
            &|_, _| false,
        )
        .iter()
        .map(|input| (input.module.metadata.name.clone().unwrap(), input.unload))
        .collect()
    }

    /// The `gpu` module selecting `fleet: a`, on that cluster.
    fn plan_undecided(excuses: &Excuses, statuses: &NodeStatuses) -> Vec<(String, bool)> {
        plan_on(&placed_by_gpu(module("gpu", Some("a"))), excuses, statuses)
    }

    fn gpu_placement() -> PlacementRef {
        PlacementRef {
            namespace: "fleet".into(),
            name: "gpu".into(),
        }
    }

    fn deciding_gpu() -> std::sync::Arc<std::collections::BTreeSet<PlacementRef>> {
        std::sync::Arc::new([gpu_placement()].into())
    }

    #[test]
    fn ocm_losing_sight_of_a_cluster_holds_what_runs_there() {
        let loaded = reported(&[("gpu", ModuleState::Loaded)]);
        let unreachable = Excuses {
            unreachable: true,
            deciding: deciding_gpu(),
            ..Excuses::default()
        };
        let placement_gone = Excuses::default();
        let moving = Excuses {
            recently_left: [gpu_placement()].into(),
            deciding: deciding_gpu(),
            ..Excuses::default()
        };
        for (excuses, why) in [
            (&unreachable, "tainted unreachable"),
            (&placement_gone, "the Placement decides nothing"),
            (&moving, "left the decisions moments ago"),
        ] {
            assert_eq!(
                plan_undecided(excuses, &loaded),
                [("gpu".to_string(), false)],
                "{why}: kept loaded, not unloaded"
            );
            assert!(
                plan_undecided(excuses, &NodeStatuses::default()).is_empty(),
                "{why}: nothing new is loaded where the module does not run"
            );
        }
    }

    #[test]
    fn a_placement_that_still_decides_others_and_settled_unloads_the_cluster_it_dropped() {
        let settled = Excuses {
            deciding: deciding_gpu(),
            ..Excuses::default()
        };
        assert_eq!(
            plan_undecided(&settled, &reported(&[("gpu", ModuleState::Loaded)])),
            [("gpu".to_string(), true)]
        );
    }

    #[test]
    fn a_held_cluster_unloads_on_a_request_all_the_same() {
        let unreachable = Excuses {
            unreachable: true,
            ..Excuses::default()
        };
        let loaded = reported(&[("gpu", ModuleState::Loaded)]);
        let relabelled = placed_by_gpu(module("gpu", Some("b")));
        assert_eq!(
            plan_on(&relabelled, &unreachable, &loaded),
            [("gpu".to_string(), true)],
            "a label change is a request"
        );
        let deleting = placed_by_gpu(module("gpu", Some("a")).deleting());
        assert_eq!(
            plan_on(&deleting, &unreachable, &loaded),
            [("gpu".to_string(), true)],
            "so is a deletion"
        );
    }
}
