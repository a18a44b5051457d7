//! What the controller, the image worker and the preflight writer read of the fleet
//! view, and the image worker's records coming back.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use k8s_openapi::jiff::Timestamp;
use kmm_api::{ManagedClusterModule, PreflightModuleStatus, PreflightValidation};
use kube::ResourceExt;

use crate::fleet::cluster_states::state_counts;
use crate::fleet::cluster_view::ClusterView;
use crate::fleet::image_needs::ServedKernels;
use crate::fleet::module_view::{ModuleView, ModuleViewBuilder};
use crate::fleet::preflight::preflight_statuses;
use crate::fleet::revisions::RevisionMark;
use crate::images::awaited_checks::AwaitedChecks;
use crate::images::need::pin_generation;
use crate::images::{ImageKey, ImageNeed, ImageRecord, SpokePins};

use super::{FleetView, lock};

impl FleetView {
    /// The module's status over its selected clusters and, when it is being deleted, where
    /// its unload is not yet confirmed. Each cluster's lock is held only while that
    /// cluster is counted.
    pub fn module_view(&self, module: &ManagedClusterModule) -> ModuleView {
        let started = Instant::now();
        let name = module.name_any();
        let namespace = module.spec.spoke_namespace.as_str();
        let mark = RevisionMark::of(module);
        let selected = self.index.selected_clusters(module);
        let mut view = ModuleViewBuilder::new(module);
        for (cluster, (wave, hold)) in selected.iter() {
            let session = self.sessions.get(cluster);
            let session = session.as_ref().map(|s| lock(s));
            let sight = session.as_ref().map(|s| s.sight(namespace, &name, mark));
            match (hold, sight) {
                (None, sight) => view.selected(cluster, wave.clone(), sight),
                // Held only where the module still runs.
                (Some(hold), Some(sight)) if sight.statuses.lingers(namespace, &name) => {
                    view.held(cluster, hold, sight);
                }
                (Some(_), sight) => {
                    if let Some(sight) = sight {
                        view.unselected(cluster, sight);
                    }
                }
            }
        }
        if view.counts_unselected() {
            for (cluster, session) in self.sessions.all() {
                if selected
                    .binary_search_by(|(selected, _)| selected.cmp(&cluster))
                    .is_ok()
                {
                    continue;
                }
                let session = lock(&session);
                view.unselected(&cluster, session.sight(namespace, &name, mark));
            }
        }
        let persisted = module.status.as_ref().map_or(&[][..], |s| &s.images[..]);
        let mut view = view.finish(self.images.statuses(&name, persisted));
        let pinned = self.images.pin_generation(&name, pin_generation(module));
        view.status.pin_generation = (pinned > 0).then_some(pinned);
        let counts = state_counts(&view);
        if self
            .caches
            .remember_counts(&name, counts, started.elapsed())
        {
            self.signals.bump_counted();
        }
        view
    }

    /// What counting the module's view took last time, when it was counted.
    pub fn count_cost(&self, module: &str) -> Option<Duration> {
        self.caches.count_cost(module)
    }

    /// Why the module's spec is invalid, when it is (validated once per generation).
    pub fn invalid(&self, module: &ManagedClusterModule) -> Option<String> {
        self.caches.resolutions().invalid(module).map(str::to_owned)
    }

    /// Every image the fleet needs now: each module (not being unloaded) resolved for the
    /// kernels of the connected clusters that select it, and what preflights ask. The
    /// tags of `imagePullPolicy: Always` images are resolved again every `follow`.
    pub fn image_needs(&self, follow: Option<Duration>) -> BTreeMap<ImageKey, ImageNeed> {
        let modules = self.index.modules();
        let mut served = ServedKernels::default();
        let mut reported = BTreeSet::new();
        for (cluster, session) in self.sessions.all() {
            let view = self.index.cluster_view(&cluster);
            let facts = view.as_ref().map(ClusterView::facts);
            let session = lock(&session);
            let Some(kernels) = &session.kernels else {
                continue;
            };
            let at_revisions = self.served_modules(&modules, &cluster, facts);
            served.add_cluster(&at_revisions, facts, &session.statuses, kernels);
            reported.extend(kernels.iter().cloned());
        }
        let preflights = self.index.preflights();
        let mut resolutions = self.caches.resolutions();
        // What no cluster reports any more (a proxy's made-up kernels, say) is forgotten,
        // so that the cache follows the fleet's kernels rather than every kernel ever named.
        resolutions.retain_kernels(|kernel| {
            reported.contains(kernel) || preflights.iter().any(|p| p.spec.kernel_version == kernel)
        });
        let mut needs = served.needs(
            &modules,
            preflights.iter().map(AsRef::as_ref),
            &mut resolutions,
            follow,
        );
        drop(resolutions);
        self.pin_needs(&mut needs);
        needs
    }

    /// Brings the needs' pin generations up to date with the image records: a move is
    /// pinned past every generation the module has, its current object's included (an
    /// earlier revision served somewhere has its own, older one). The image worker calls
    /// it on needs it keeps between reads of the fleet, as records change under them.
    pub fn pin_needs(&self, needs: &mut BTreeMap<ImageKey, ImageNeed>) {
        for (key, need) in needs {
            let persisted = self
                .index
                .module(&key.module)
                .map_or(need.pin_generation, |m| pin_generation(&m));
            need.pin_generation = self.images.pin_generation(&key.module, persisted);
        }
    }

    /// Every module's preflight answer for `preflight`, sorted by module name.
    pub fn preflight_statuses(
        &self,
        preflight: &PreflightValidation,
        now: Timestamp,
    ) -> Vec<PreflightModuleStatus> {
        let modules = self.index.modules();
        let images = self.images.read();
        preflight_statuses(
            preflight,
            &modules,
            &images.records,
            &mut self.caches.resolutions(),
            now,
        )
    }

    /// Where `key` stands, as the image worker last recorded it.
    pub fn image(&self, key: &ImageKey) -> Option<ImageRecord> {
        self.images.get(key)
    }

    /// The image worker's new record for `key`; returns the one kept (a spoke-resolved
    /// image stays so where the hub's finding would move a cluster). Snapshots are
    /// recomputed only when what nodes get changes; status follows every change.
    pub fn set_image(&self, key: ImageKey, record: ImageRecord) -> ImageRecord {
        let module = key.module.clone();
        let change = self.images.set(key.clone(), record);
        if change.verdict
            && let Some(module) = self.index.module(&module)
        {
            self.mark_image_stale(&module, &key);
        }
        if change.reported {
            self.signals.touched.add([module]);
            self.signals.preflight_changed.notify_one();
        }
        change.kept
    }

    /// The clusters' pins an earlier leader persisted for a spoke-resolved image, before
    /// its record ([`FleetView::set_image`]) makes snapshots of them.
    pub fn seed_spoke_pins(&self, key: ImageKey, pins: SpokePins) {
        self.images.seed_spoke_pins(key, pins);
    }

    /// Takes the image worker's latest `needs`: status lists each image with the kernels
    /// needing it now (see `ImageBook::track`).
    pub fn track_images(&self, needs: &BTreeMap<ImageKey, ImageNeed>) {
        let modules: BTreeSet<String> = self.index.modules().iter().map(|m| m.name_any()).collect();
        let touched = self.images.track(needs, &modules);
        self.signals.touched.add(touched);
        self.release_waits(Some(&AwaitedChecks::needed(needs.keys())));
    }
}
