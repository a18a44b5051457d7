//! The watched objects the fleet view computes from, and the indexes built from them:
//! each ManagedCluster's view (labels, acceptance, Placements), the Placements' decisions
//! per cluster, and which module generations the snapshots were computed for.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Instant;

use k8s_openapi::api::apps::v1::ControllerRevision;
use k8s_openapi::api::core::v1::Secret;
use kmm_api::{ManagedClusterModule, PlacementRef, PreflightValidation, ocm};
use kmm_proto::v1::PullCredential;
use kube::ResourceExt;
use kube::core::{ApiResource, DynamicObject};
use kube::runtime::reflector::{ObjectRef, Store};

use crate::fleet::assignment::{ClusterFacts, Selection, is_deleting, is_selected, selection};
use crate::fleet::cluster_view::{ClusterView, is_unreachable};
use crate::fleet::credentials;
use crate::fleet::placements::{Departures, Excuses, HoldReason, Placed, decided, deciding, wave};
use crate::fleet::revisions::MODULE_LABEL;
use crate::fleet::rollout::Wave;
use crate::fleet::served_revisions::assignment_key;

use super::lock;
use super::selections::{Selected, Selections};

/// The watched objects the hub computes from.
#[derive(Clone, Debug)]
pub struct Stores {
    pub modules: Store<ManagedClusterModule>,
    pub clusters: Store<DynamicObject>,
    pub secrets: Store<Secret>,
    /// The kept revisions of every module's spec (the hub's namespace).
    pub revisions: Store<ControllerRevision>,
    pub preflights: Store<PreflightValidation>,
    /// Every PlacementDecision: which clusters the modules' Placements chose.
    pub decisions: Store<DynamicObject>,
}

/// A ManagedCluster's view before and after a change (`None`: no such cluster).
#[derive(Debug)]
pub struct ViewChange {
    pub before: Option<ClusterView>,
    pub now: Option<ClusterView>,
}

/// What of a module the snapshots depend on changed since they were last computed for it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ModuleChange {
    None,
    /// Only which revision clusters are to run (a progressive rollout moved).
    Assignment,
    /// A new module, another generation, or its deletion began.
    Spec,
}

/// Per module: what the snapshots were last computed for.
#[derive(Debug, Default)]
struct ModuleBook {
    /// The generation, deletion state and rollout assignment.
    seen: BTreeMap<String, (Option<i64>, bool, u64)>,
    /// UIDs of modules whose finalizer the hub removed: gone, even before the watch says so.
    gone: BTreeSet<String>,
}

#[derive(Debug)]
pub struct FleetIndex {
    pub stores: Stores,
    cluster_resource: ApiResource,
    /// What each ManagedCluster looked like when its change was last handled.
    views: Mutex<HashMap<String, ClusterView>>,
    /// Per cluster, the Placements that decided it, from the PlacementDecisions.
    placed: RwLock<HashMap<String, Placed>>,
    /// The Placements that decide at least one cluster.
    deciding: RwLock<Arc<BTreeSet<PlacementRef>>>,
    /// When clusters recently left Placements' decisions.
    departures: Mutex<Departures>,
    modules: Mutex<ModuleBook>,
    selections: Selections,
}

/// A cluster a module selects or holds: the wave its rollout moves it in, and why it is
/// held (`None`: selected).
pub type ClusterPick = (Option<Wave>, Option<(PlacementRef, HoldReason)>);

impl FleetIndex {
    pub fn new(stores: Stores) -> Self {
        Self {
            stores,
            cluster_resource: ocm::MANAGED_CLUSTER.api_resource(),
            views: Mutex::default(),
            placed: RwLock::default(),
            deciding: RwLock::default(),
            departures: Mutex::default(),
            modules: Mutex::default(),
            selections: Selections::default(),
        }
    }

    /// The ManagedCluster as the hub reads it; `None` when there is none.
    pub fn cluster_view(&self, cluster: &str) -> Option<ClusterView> {
        let reference = ObjectRef::new_with(cluster, self.cluster_resource.clone());
        let placed = self
            .placed
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .get(cluster)
            .cloned()
            .unwrap_or_default();
        let excuses = Excuses {
            unreachable: false,
            recently_left: lock(&self.departures).recently_left(cluster),
            deciding: self
                .deciding
                .read()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .clone(),
        };
        self.stores
            .clusters
            .get(&reference)
            .map(|mc| ClusterView::of(&mc, placed, excuses))
    }

    /// Remembers the cluster's view as it is now; `None` when it did not change since
    /// last remembered.
    pub fn remember_view(&self, cluster: &str) -> Option<ViewChange> {
        // The store holds the change already: a selection kept from before it is stale.
        self.selections.facts_changed();
        let now = self.cluster_view(cluster);
        let mut views = lock(&self.views);
        let before = match &now {
            Some(view) => views.insert(cluster.to_owned(), view.clone()),
            None => views.remove(cluster),
        };
        (before != now).then_some(ViewChange { before, now })
    }

    /// Remembers every cluster's view afresh (after a re-list).
    pub fn remember_all_views(&self) {
        self.selections.facts_changed();
        let mut views = lock(&self.views);
        views.clear();
        for cluster in self.stores.clusters.state() {
            if let Some(view) = self.cluster_view(&cluster.name_any()) {
                views.insert(cluster.name_any(), view);
            }
        }
    }

    /// Rebuilds the Placements index from the PlacementDecisions; returns the clusters
    /// whose Placements changed. A fleet has a few decisions per Placement (each lists up
    /// to 100 clusters), so a rebuild costs little beside what it may trigger.
    pub fn index_placements(&self) -> Vec<String> {
        let now = decided(self.stores.decisions.state().iter().map(AsRef::as_ref));
        let mut placed = self
            .placed
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let changed = placed
            .iter()
            .filter(|(cluster, before)| now.get(*cluster) != Some(before))
            .map(|(cluster, _)| cluster.clone())
            .chain(
                now.keys()
                    .filter(|cluster| !placed.contains_key(*cluster))
                    .cloned(),
            )
            .collect();
        lock(&self.departures).note(&placed, &now, Instant::now());
        *self
            .deciding
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Arc::new(deciding(&now));
        *placed = now;
        self.selections.facts_changed();
        changed
    }

    /// Forgets departures from Placements' decisions that are old enough to be meant;
    /// returns the clusters that lost one.
    pub fn expire_departures(&self, now: Instant) -> Vec<String> {
        let expired = lock(&self.departures).expire(now);
        if !expired.is_empty() {
            self.selections.facts_changed();
        }
        expired
    }

    /// Each cluster the module selects or holds, sorted by name, with the wave its rollout
    /// moves it in and why it is held.
    pub fn selected_clusters(&self, module: &ManagedClusterModule) -> Selected {
        self.selections.get_or(module, || self.select(module))
    }

    fn select(&self, module: &ManagedClusterModule) -> Vec<(String, ClusterPick)> {
        let placed = self
            .placed
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let departures = lock(&self.departures);
        let deciding = self
            .deciding
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone();
        let nowhere = Placed::new();
        // Only a module's Placements can hold a cluster: for a module without any, the
        // excuses (read from each cluster's taints and departures) would go unread.
        let holds = module.spec.placement_refs.is_some();
        self.stores
            .clusters
            .state()
            .iter()
            .filter_map(|c| {
                let name = c.name_any();
                let placed = placed.get(&name).unwrap_or(&nowhere);
                let excuses = if holds {
                    Excuses {
                        unreachable: is_unreachable(c),
                        recently_left: departures.recently_left(&name),
                        deciding: deciding.clone(),
                    }
                } else {
                    Excuses::default()
                };
                let facts = ClusterFacts {
                    labels: c.labels(),
                    placed,
                    excuses: &excuses,
                };
                let hold = match selection(module, Some(facts)) {
                    Selection::Selected => None,
                    Selection::Held(placement, reason) => Some((placement, reason)),
                    Selection::Unselected => return None,
                };
                Some((name, (wave(module, placed), hold)))
            })
            .collect()
    }

    /// The names of the modules selecting a cluster seen as `view`.
    pub fn modules_selecting(&self, view: Option<&ClusterView>) -> BTreeSet<String> {
        self.stores
            .modules
            .state()
            .iter()
            .filter(|m| is_selected(m, view.map(ClusterView::facts)))
            .map(|m| m.name_any())
            .collect()
    }

    /// The names of the modules whose selection of a cluster differs between two views.
    pub fn selection_changed(
        &self,
        before: Option<&ClusterView>,
        now: Option<&ClusterView>,
    ) -> Vec<String> {
        self.stores
            .modules
            .state()
            .iter()
            .filter(|m| {
                selection(m, before.map(ClusterView::facts))
                    != selection(m, now.map(ClusterView::facts))
            })
            .map(|m| m.name_any())
            .collect()
    }

    /// Every module the hub serves, by name: those whose finalizer it released are gone
    /// even before the watch says so.
    pub fn modules(&self) -> Vec<Arc<ManagedClusterModule>> {
        let mut book = lock(&self.modules);
        let modules = self.stores.modules.state();
        // Once the watch dropped a released module, its UID need not be remembered.
        if !book.gone.is_empty() {
            let present: BTreeSet<String> = modules.iter().filter_map(|m| m.uid()).collect();
            book.gone.retain(|uid| present.contains(uid));
        }
        let mut modules: Vec<_> = modules
            .into_iter()
            .filter(|m| m.uid().is_none_or(|uid| !book.gone.contains(&uid)))
            .collect();
        drop(book);
        modules.sort_by_key(|m| m.name_any());
        modules
    }

    pub fn module(&self, name: &str) -> Option<Arc<ManagedClusterModule>> {
        self.stores.modules.get(&ObjectRef::new(name))
    }

    /// Every module's name, as the watch holds them.
    pub fn module_names(&self) -> Vec<String> {
        self.stores
            .modules
            .state()
            .iter()
            .map(|m| m.name_any())
            .collect()
    }

    /// Notes the module as the snapshots are about to be computed for it, and says what
    /// of what they depend on (generation, deletion, rollout assignment) changed since.
    pub fn note(&self, module: &ManagedClusterModule) -> ModuleChange {
        let key = (
            module.metadata.generation,
            is_deleting(module),
            assignment_key(module),
        );
        let mut book = lock(&self.modules);
        let name = module.name_any();
        let change = match book.seen.get(&name) {
            Some(seen) if *seen == key => return ModuleChange::None,
            Some((generation, deleting, _)) if (*generation, *deleting) == (key.0, key.1) => {
                ModuleChange::Assignment
            }
            _ => ModuleChange::Spec,
        };
        book.seen.insert(name, key);
        change
    }

    /// The hub released the module's finalizer: it is gone.
    pub fn forget(&self, module: &ManagedClusterModule) {
        self.selections.forget(&module.name_any());
        let mut book = lock(&self.modules);
        book.seen.remove(&module.name_any());
        if let Some(uid) = module.uid() {
            book.gone.insert(uid);
        }
    }

    /// The modules naming `secret` as their pull Secret.
    pub fn modules_pulling_with(&self, secret: &str) -> Vec<Arc<ManagedClusterModule>> {
        self.stores
            .modules
            .state()
            .into_iter()
            .filter(|m| {
                m.spec
                    .module_spec
                    .image_repo_secret
                    .as_ref()
                    .is_some_and(|s| s.name == secret)
            })
            .collect()
    }

    /// The pull credentials `modules` reference.
    pub fn credentials<'a>(
        &self,
        modules: impl Iterator<Item = &'a ManagedClusterModule>,
    ) -> BTreeMap<String, PullCredential> {
        credentials::referenced(modules, || self.stores.secrets.state())
    }

    /// The module's kept revisions.
    pub fn kept_revisions(&self, module: &str) -> Vec<Arc<ControllerRevision>> {
        self.stores
            .revisions
            .state()
            .into_iter()
            .filter(|r| r.labels().get(MODULE_LABEL).is_some_and(|m| m == module))
            .collect()
    }

    /// A kept revision by its object name.
    pub fn stored_revision(&self, object: &str) -> Option<Arc<ControllerRevision>> {
        self.stores.revisions.find(|r| r.name_any() == object)
    }

    /// Every ManagedCluster's name.
    pub fn cluster_names(&self) -> Vec<String> {
        self.stores
            .clusters
            .state()
            .iter()
            .map(|c| c.name_any())
            .collect()
    }

    pub fn preflights(&self) -> Vec<Arc<PreflightValidation>> {
        self.stores.preflights.state()
    }
}
