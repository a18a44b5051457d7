//! A module as its clusters show it: its status (but for the rollout and conditions),
//! what each selected cluster shows its rollout, and, while it is being deleted, where
//! its unload is not yet confirmed. Pure: counted one cluster at a time, from what each
//! cluster's session holds, so that no more than one cluster need be at hand at once.

use std::collections::{BTreeMap, BTreeSet};

use kmm_api::{ImageStatus, ManagedClusterModule, ManagedClusterModuleStatus, PlacementRef};
use kmm_proto::v1::KernelTarget;
use kube::ResourceExt;

use super::assignment::is_deleting;
use super::deletion::Leftovers;
use super::device_plugins::counts as device_plugin_counts;
use super::node_statuses::NodeStatuses;
use super::placements::HoldReason;
use super::rollout::{Observation, Wave};
use super::status::{ClusterReport, StatusTally};

/// A module as its clusters show it.
#[derive(Debug)]
pub struct ModuleView {
    /// Its status, but for the rollout and conditions.
    pub status: ManagedClusterModuleStatus,
    /// Where its unload is not yet confirmed, when it is being deleted.
    pub leftovers: Leftovers,
    /// What each selected cluster shows, for its rollout.
    pub observed: BTreeMap<String, Observation>,
    /// The selected clusters held (status lists only a sample of them).
    pub held: BTreeSet<String>,
}

/// What one cluster's session holds about one module.
#[derive(Clone, Copy, Debug)]
pub struct ClusterSight<'a> {
    /// Whether the cluster's proxy is connected now.
    pub connected: bool,
    /// Whether its node statuses were made with the module's current revision applied.
    pub reflects_revision: bool,
    /// The module's per-kernel resolution in the cluster's last snapshot.
    pub kernels: &'a [KernelTarget],
    /// Every node status the cluster reported.
    pub statuses: &'a NodeStatuses,
    /// Whether a full status report arrived since the hub started.
    pub statuses_known: bool,
    /// Whether the cluster was sent the module's unload and has not reported since
    /// applying it: its statuses prove nothing about the module.
    pub unload_unconfirmed: bool,
    /// The module's device plugin Pods there: (desired, available).
    pub device_plugin: Option<(u32, u32)>,
}

/// Counts a module's clusters one at a time into its [`ModuleView`].
#[derive(Debug)]
pub struct ModuleViewBuilder<'m> {
    module: &'m ManagedClusterModule,
    name: String,
    deleting: bool,
    tally: StatusTally,
    /// In the order counted; a map once finished (one bulk build rather than thousands
    /// of inserts).
    observed: Vec<(String, Observation)>,
    held: BTreeSet<String>,
    plugins: Vec<(String, (u32, u32))>,
    leftovers: Leftovers,
}

impl<'m> ModuleViewBuilder<'m> {
    pub fn new(module: &'m ManagedClusterModule) -> Self {
        Self {
            module,
            name: module.name_any(),
            deleting: is_deleting(module),
            tally: StatusTally::default(),
            observed: Vec::new(),
            held: BTreeSet::new(),
            plugins: Vec::new(),
            leftovers: Leftovers::default(),
        }
    }

    /// Whether clusters the module does not select count too: a deletion must confirm
    /// the unload wherever a node still reports the module.
    pub fn counts_unselected(&self) -> bool {
        self.deleting
    }

    /// A selected cluster, moving in `wave`; `sight` is `None` when no proxy of the
    /// cluster ever connected to this hub.
    pub fn selected(&mut self, cluster: &str, wave: Option<Wave>, sight: Option<ClusterSight<'_>>) {
        self.count(cluster, wave, sight);
    }

    /// A cluster the module's Placements no longer decide but that keeps running it
    /// (see `placements::held`): counted as selected, and listed with its reason.
    pub fn held(
        &mut self,
        cluster: &str,
        (placement, reason): &(PlacementRef, HoldReason),
        sight: ClusterSight<'_>,
    ) {
        self.tally.hold(cluster, placement, *reason);
        self.held.insert(cluster.to_owned());
        self.count(cluster, None, Some(sight));
    }

    fn count(&mut self, cluster: &str, wave: Option<Wave>, sight: Option<ClusterSight<'_>>) {
        let namespace = self.module.spec.spoke_namespace.as_str();
        let device_plugin_only = self.module.spec.module_spec.module_loader.is_none();
        let report = match &sight {
            None => ClusterReport {
                cluster,
                connected: false,
                reflects_revision: false,
                kernels: &[],
                nodes: &[],
                device_plugin_only,
                device_plugin: None,
            },
            Some(sight) => ClusterReport {
                cluster,
                connected: sight.connected,
                reflects_revision: sight.reflects_revision,
                kernels: sight.kernels,
                nodes: sight.statuses.module(namespace, &self.name),
                device_plugin_only,
                device_plugin: sight.device_plugin,
            },
        };
        let mut observation = self.tally.add(&report);
        observation.wave = wave;
        self.observed.push((cluster.to_owned(), observation));
        if let Some(counts) = sight.and_then(|s| s.device_plugin) {
            self.plugins.push((cluster.to_owned(), counts));
        }
        if self.deleting {
            match sight {
                None => self.leftovers.add(cluster, true, []),
                Some(sight) => self.leftovers.add(
                    cluster,
                    !sight.statuses_known || sight.unload_unconfirmed,
                    sight.statuses.not_unloaded(namespace, &self.name),
                ),
            }
        }
    }

    /// A cluster the module does not select (counted only while it is being deleted): a
    /// connected one that has not reported since the hub started may still run it.
    pub fn unselected(&mut self, cluster: &str, sight: ClusterSight<'_>) {
        if !self.deleting {
            return;
        }
        let namespace = self.module.spec.spoke_namespace.as_str();
        self.leftovers.add(
            cluster,
            (sight.connected && !sight.statuses_known) || sight.unload_unconfirmed,
            sight.statuses.not_unloaded(namespace, &self.name),
        );
    }

    /// The view, with the module's image statuses.
    pub fn finish(self, images: Vec<ImageStatus>) -> ModuleView {
        let mut status = self.tally.finish(self.module.metadata.generation);
        if self.module.spec.module_spec.device_plugin.is_some() {
            status.device_plugins = Some(device_plugin_counts(
                self.plugins
                    .iter()
                    .map(|(cluster, counts)| (cluster.as_str(), *counts)),
            ));
        }
        status.images = images;
        ModuleView {
            status,
            leftovers: self.leftovers,
            observed: self.observed.into_iter().collect(),
            held: self.held,
        }
    }
}

#[cfg(test)]
mod tests {
    use kmm_proto::v1::ModuleState;

    use kmm_api::testing::ModuleBuilder;

    use super::*;
    use crate::fleet::deletion::Leftover;

    fn module(device_plugin: bool) -> ModuleBuilder {
        let module = ModuleBuilder::new("hello").generation(2);
        if device_plugin {
            module.with(
                "/spec/moduleSpec/devicePlugin/container/image",
                "r/plugin:1",
            )
        } else {
            module
        }
    }

    fn mcm(device_plugin: bool) -> ManagedClusterModule {
        module(device_plugin).build()
    }

    fn reported(nodes: &[(&str, ModuleState)]) -> NodeStatuses {
        let of_hello: Vec<_> = nodes
            .iter()
            .map(|&(n, state)| ("hello", n, state))
            .collect();
        NodeStatuses::reported(&of_hello)
    }

    fn sight(statuses: &NodeStatuses, known: bool) -> ClusterSight<'_> {
        ClusterSight {
            connected: true,
            reflects_revision: true,
            kernels: &[],
            statuses,
            statuses_known: known,
            unload_unconfirmed: false,
            device_plugin: Some((2, 1)),
        }
    }

    fn leftovers(view: &ModuleView) -> Vec<(String, Option<String>)> {
        view.leftovers
            .first()
            .map(|Leftover { cluster, node }| (cluster.clone(), node.clone()))
            .collect()
    }

    #[test]
    fn every_selected_cluster_is_counted_and_observed_with_its_wave() {
        let module = mcm(false);
        let statuses = reported(&[("n1", ModuleState::Loaded)]);
        let mut builder = ModuleViewBuilder::new(&module);
        assert!(!builder.counts_unselected());
        let wave = Wave {
            label: "ns/p/0".into(),
            ..Wave::default()
        };
        builder.selected("a", Some(wave.clone()), Some(sight(&statuses, true)));
        builder.selected("b", None, None);
        builder.unselected("c", sight(&statuses, true));
        let view = builder.finish(Vec::new());
        assert_eq!(view.status.clusters.selected, 2);
        assert_eq!(view.status.clusters.connected, 1);
        assert_eq!(view.observed.keys().collect::<Vec<_>>(), ["a", "b"]);
        assert_eq!(view.observed["a"].wave, Some(wave));
        assert_eq!(view.observed["b"].wave, None);
        assert!(
            view.leftovers.is_empty(),
            "nothing is left over unless deleting"
        );
        assert_eq!(view.status.device_plugins, None, "no plugin, no counts");
    }

    #[test]
    fn a_deletion_waits_on_every_node_not_unloaded_and_on_selected_clusters_never_heard() {
        let module = module(false).deleting().build();
        let loaded = reported(&[("n1", ModuleState::Loaded), ("n2", ModuleState::Unloaded)]);
        let unheard = NodeStatuses::default();
        let mut builder = ModuleViewBuilder::new(&module);
        assert!(builder.counts_unselected());
        builder.selected("a", None, Some(sight(&loaded, true)));
        // Selected, connected, but no full report yet: no node reporting proves nothing.
        builder.selected("b", None, Some(sight(&unheard, false)));
        // Selected and never connected.
        builder.selected("c", None, None);
        // Not selected: its nodes still reporting the module count, and, connected but
        // not reported since the hub started, the cluster itself.
        builder.unselected("d", sight(&loaded, true));
        builder.unselected("e", sight(&unheard, false));
        let gone = ClusterSight {
            connected: false,
            ..sight(&unheard, false)
        };
        builder.unselected("f", gone);
        let view = builder.finish(Vec::new());
        assert_eq!(
            leftovers(&view),
            [
                ("a".to_owned(), Some("n1".to_owned())),
                ("b".to_owned(), None),
                ("c".to_owned(), None),
                ("d".to_owned(), Some("n1".to_owned())),
                ("e".to_owned(), None),
            ]
        );
    }

    #[test]
    fn device_plugin_counts_come_from_the_selected_clusters_of_a_plugin_module() {
        let module = mcm(true);
        let statuses = reported(&[]);
        let mut builder = ModuleViewBuilder::new(&module);
        builder.selected("a", None, Some(sight(&statuses, true)));
        builder.selected("b", None, Some(sight(&statuses, true)));
        builder.unselected("c", sight(&statuses, true));
        let image = ImageStatus {
            image: "r/x:1".into(),
            ..ImageStatus::default()
        };
        let view = builder.finish(vec![image.clone()]);
        let plugins = view.status.device_plugins.expect("a plugin module counts");
        assert_eq!((plugins.desired, plugins.available), (4, 2));
        assert_eq!(view.status.images, [image]);
    }

    #[test]
    fn no_status_confirms_an_unload_reported_before_it_was_applied() {
        // A restarted proxy's first report is empty: no node reports the module. Made
        // before the unload was applied, it confirms nothing, selected or not.
        let module = module(false).deleting().build();
        let empty = NodeStatuses::default();
        let restarted = ClusterSight {
            unload_unconfirmed: true,
            ..sight(&empty, true)
        };
        let mut builder = ModuleViewBuilder::new(&module);
        builder.selected("a", None, Some(restarted));
        builder.unselected("b", restarted);
        builder.unselected("c", sight(&empty, true));
        let view = builder.finish(Vec::new());
        assert_eq!(
            leftovers(&view),
            [("a".to_owned(), None), ("b".to_owned(), None)]
        );
    }

    fn plugin_only() -> ModuleBuilder {
        module(true).without("/spec/moduleSpec/moduleLoader")
    }

    #[test]
    fn a_module_that_loads_nothing_is_ready_where_its_plugin_runs_on_every_selected_node() {
        let module = plugin_only().build();
        let none = NodeStatuses::default();
        let mut builder = ModuleViewBuilder::new(&module);
        let everywhere = ClusterSight {
            device_plugin: Some((2, 2)),
            ..sight(&none, true)
        };
        builder.selected("a", None, Some(everywhere));
        builder.selected("b", None, Some(sight(&none, true)));
        let unreported = ClusterSight {
            device_plugin: None,
            ..sight(&none, true)
        };
        builder.selected("c", None, Some(unreported));
        let view = builder.finish(Vec::new());
        assert_eq!(view.status.clusters.converged, 1);
        assert!(view.observed["a"].converged);
        assert!(
            !view.observed["b"].converged,
            "one of two plugin Pods available"
        );
        assert!(!view.observed["c"].converged, "no counts yet");
        let plugins = view.status.device_plugins.expect("counted");
        assert_eq!((plugins.desired, plugins.available), (4, 3));
        assert_eq!(view.status.nodes.matching, 0);
    }

    #[test]
    fn deleting_a_module_that_loads_nothing_waits_for_its_plugin_to_stop_on_each_node() {
        let module = plugin_only().deleting().build();
        let stopping = reported(&[("n1", ModuleState::Pending), ("n2", ModuleState::Unloaded)]);
        let stopped = reported(&[("n1", ModuleState::Unloaded), ("n2", ModuleState::Unloaded)]);
        let mut builder = ModuleViewBuilder::new(&module);
        builder.selected("a", None, Some(sight(&stopping, true)));
        builder.selected("b", None, Some(sight(&stopped, true)));
        let view = builder.finish(Vec::new());
        assert_eq!(leftovers(&view), [("a".to_owned(), Some("n1".to_owned()))]);
    }
}
