//! The hub's in-memory view of the fleet, fed by watches (ManagedClusterModules,
//! ManagedClusters, pull Secrets) and by the proxies' streams (inventory, node status).
//!
//! It is built to cost what an event touches, not what the fleet holds: every cluster has
//! a lock of its own (a report from one cluster never waits for another's), an event
//! recomputes only the snapshots it can change (a ManagedCluster's own, a module's
//! clusters', none for a status report unless an unload was confirmed), resolutions are
//! computed once per module generation, and only the modules an event touches are queued
//! for reconciliation. A snapshot goes to a stream only when its content changed.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, RwLock};

use k8s_openapi::api::apps::v1::ControllerRevision;
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kmm_api::{
    ManagedClusterModule, ManagedClusterModuleStatus, PreflightModuleStatus, PreflightValidation,
    RolloutType,
};
use kmm_proto::v1::{
    DevicePluginReport, KernelInventory, ModuleIntent, NodeStatusReport, PullCredential,
    pull_credential::Content,
};
use kube::ResourceExt;
use kube::core::{ApiResource, DynamicObject, GroupVersionKind};
use kube::runtime::reflector::{ObjectRef, Store};
use tokio::sync::{Notify, watch};

use crate::fleet::assignment::{ClusterFacts, cluster_modules, is_deleting, is_selected};
use crate::fleet::deletion::Leftovers;
use crate::fleet::device_plugins::counts as device_plugin_counts;
use crate::fleet::intents::cluster_intents;
use crate::fleet::node_statuses::{Applied, NodeStatuses, TooManyStatuses};
use crate::fleet::outbox::Outbox;
use crate::fleet::placements::{Placed, decided, wave};
use crate::fleet::preflight::{Finding, module_status, preflight_needs};
use crate::fleet::resolutions::Resolutions;
use crate::fleet::revisions::{MODULE_LABEL, Missing, Revisions, object_name};
use crate::fleet::rollout::{Assigned, Observation, assigned};
use crate::fleet::shared_snapshot::IntentPool;
use crate::fleet::status::{ClusterReport, StatusTally};
use crate::images::status::{image_statuses, with_persisted};
use crate::images::{ImageKey, ImageNeed, ImageRecord, module_needs};

use super::metrics::Metrics;
use super::outbound::OutboundSender;

/// `cluster.open-cluster-management.io/v1` `ManagedCluster`.
pub fn managed_cluster_resource() -> ApiResource {
    let gvk = GroupVersionKind::gvk("cluster.open-cluster-management.io", "v1", "ManagedCluster");
    ApiResource::from_gvk_with_plural(&gvk, "managedclusters")
}

/// Strips a ManagedCluster down to what [`FleetState`] reads of it (name, labels,
/// `spec.hubAcceptsClient`) before the store keeps it: a real cluster's status (claims,
/// capacity, conditions) and managed fields are kilobytes each, times the fleet.
pub fn trim_managed_cluster(cluster: &mut DynamicObject) {
    cluster.metadata.managed_fields = None;
    cluster.metadata.annotations = None;
    cluster.metadata.owner_references = None;
    let accepts = cluster.data["spec"]["hubAcceptsClient"].take();
    cluster.data = serde_json::json!({ "spec": { "hubAcceptsClient": accepts } });
}

/// Identifies one stream among all the streams the hub has accepted.
pub type SessionId = u64;

/// Which clusters' proxies have a session with this hub, and when the others' last one
/// closed (as far as this hub saw).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Connections {
    pub open: BTreeSet<String>,
    pub closed_at: BTreeMap<String, Time>,
}

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

#[derive(Debug, Default)]
struct ClusterEntry {
    /// The current stream: the newest wins.
    stream: Option<(SessionId, OutboundSender)>,
    outbox: Outbox,
    /// The kernels of the current stream's latest inventory; `None` until it sent one.
    kernels: Option<BTreeSet<String>>,
    inventory_revision: u64,
    statuses: NodeStatuses,
    /// A full status report arrived since the hub started.
    statuses_known: bool,
    /// The intent revision the current stream's statuses were made with (its hello, then
    /// every report).
    acked_revision: u64,
    /// Per module (namespace, name): its device plugin's (desired, available) Pods.
    device_plugins: BTreeMap<(String, String), (u32, u32)>,
}

impl ClusterEntry {
    fn current(&self, id: SessionId) -> bool {
        self.stream
            .as_ref()
            .is_some_and(|(current, _)| *current == id)
    }

    /// Whether the last snapshot carries the module.
    fn carries(&self, namespace: &str, name: &str) -> bool {
        self.carried_intent(namespace, name).is_some()
    }

    /// The module's intent in the last snapshot.
    fn carried_intent(&self, namespace: &str, name: &str) -> Option<&ModuleIntent> {
        self.outbox
            .last()?
            .modules
            .iter()
            .map(AsRef::as_ref)
            .find(|m| {
                m.key
                    .as_ref()
                    .is_some_and(|k| k.name == name && k.namespace == namespace)
            })
    }

    /// The modules of the last snapshot, by name.
    fn carried(&self) -> impl Iterator<Item = &str> {
        self.outbox
            .last()
            .into_iter()
            .flat_map(|s| &s.modules)
            .filter_map(|m| m.key.as_ref().map(|k| k.name.as_str()))
    }
}

type Entry = Arc<Mutex<ClusterEntry>>;

/// What the hub last saw of a ManagedCluster: what its snapshot and its modules'
/// selection depend on.
#[derive(Clone, Debug, PartialEq)]
struct ClusterView {
    labels: BTreeMap<String, String>,
    placed: Placed,
    accepted: bool,
}

impl ClusterView {
    fn facts(&self) -> ClusterFacts<'_> {
        ClusterFacts {
            labels: &self.labels,
            placed: &self.placed,
        }
    }
}

/// Module-level bookkeeping.
#[derive(Debug, Default)]
struct ModuleBook {
    /// Per module: the generation, deletion state and rollout assignment the snapshots
    /// were last computed for.
    seen: BTreeMap<String, (Option<i64>, bool, u64)>,
    /// UIDs of modules whose finalizer the hub removed: gone, even before the watch says so.
    gone: BTreeSet<String>,
}

#[derive(Debug, Default)]
struct ImageBook {
    /// Where every image the fleet needs stands, as the image worker found it.
    records: BTreeMap<ImageKey, ImageRecord>,
    /// The kernels needing each image now, as the image worker last computed them.
    needed: BTreeMap<ImageKey, BTreeSet<String>>,
}

/// Modules whose status an event may have changed, waiting for their reconciliation.
#[derive(Debug, Default)]
pub struct Touched {
    modules: Mutex<BTreeSet<String>>,
    notify: Notify,
}

impl Touched {
    fn add(&self, modules: impl IntoIterator<Item = String>) {
        let mut touched = lock(&self.modules);
        let before = touched.len();
        touched.extend(modules);
        if touched.len() != before {
            self.notify.notify_one();
        }
    }

    /// Waits for touched modules and takes them all.
    pub async fn take(&self) -> BTreeSet<String> {
        loop {
            let taken = std::mem::take(&mut *lock(&self.modules));
            if !taken.is_empty() {
                return taken;
            }
            self.notify.notified().await;
        }
    }
}

/// A module as its clusters show it.
#[derive(Debug)]
pub struct ModuleView {
    /// Its status, but for the rollout and conditions.
    pub status: ManagedClusterModuleStatus,
    /// Where its unload is not yet confirmed, when it is being deleted.
    pub leftovers: Leftovers,
    /// What each selected cluster shows, for its rollout.
    pub observed: BTreeMap<String, Observation>,
}

/// The shared fleet view.
#[derive(Debug)]
pub struct FleetState {
    stores: Stores,
    cluster_resource: ApiResource,
    synced: watch::Sender<bool>,
    next_session: AtomicU64,
    clusters: RwLock<HashMap<String, Entry>>,
    views: Mutex<HashMap<String, ClusterView>>,
    /// Per cluster, the Placements that decided it, from the PlacementDecisions.
    placed: RwLock<HashMap<String, Placed>>,
    modules: Mutex<ModuleBook>,
    resolutions: Mutex<Resolutions>,
    revisions: Mutex<Revisions>,
    /// The intents of every cluster's snapshot, each distinct one held once.
    intents: Mutex<IntentPool>,
    images: RwLock<ImageBook>,
    touched: Touched,
    /// Bumped when what the fleet's images are needed for may have changed (kernels,
    /// modules, selection): wakes the image worker.
    needs: watch::Sender<u64>,
    /// Changes only when a session opens or closes.
    connections: watch::Sender<Connections>,
    /// Why every stream ends, once the hub stops: no stream may open after it.
    ending: watch::Sender<Option<String>>,
    /// A snapshot waits for an image check: wakes the image worker.
    unchecked_images: Notify,
    /// An image record or a PreflightValidation changed: wakes the preflight writer.
    preflight_changed: Notify,
    metrics: Metrics,
}

/// Takes a lock. A panic while holding it leaves plain data behind, still consistent
/// enough to serve: every recompute starts from the watched objects again.
fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl FleetState {
    pub fn new(stores: Stores, metrics: Metrics) -> Self {
        Self {
            stores,
            cluster_resource: managed_cluster_resource(),
            synced: watch::Sender::new(false),
            next_session: AtomicU64::new(1),
            clusters: RwLock::default(),
            views: Mutex::default(),
            placed: RwLock::default(),
            modules: Mutex::default(),
            resolutions: Mutex::default(),
            revisions: Mutex::default(),
            intents: Mutex::default(),
            images: RwLock::default(),
            touched: Touched::default(),
            needs: watch::Sender::new(0),
            connections: watch::Sender::new(Connections::default()),
            ending: watch::Sender::new(None),
            unchecked_images: Notify::new(),
            preflight_changed: Notify::new(),
            metrics,
        }
    }

    /// Set once, with the reason, when the hub ends every stream.
    pub fn ending(&self) -> watch::Receiver<Option<String>> {
        self.ending.subscribe()
    }

    /// Follows the clusters' sessions as they open and close.
    pub fn connections(&self) -> watch::Receiver<Connections> {
        self.connections.subscribe()
    }

    /// Resolves when a snapshot waits for images that were never checked.
    pub async fn images_unchecked(&self) {
        self.unchecked_images.notified().await;
    }

    /// Changes whenever the images the fleet needs may have changed.
    pub fn needs_changed(&self) -> watch::Receiver<u64> {
        self.needs.subscribe()
    }

    /// True once every watch has listed.
    pub fn synced(&self) -> watch::Receiver<bool> {
        self.synced.subscribe()
    }

    /// The modules whose status may have changed, for the controller.
    pub fn touched(&self) -> &Touched {
        &self.touched
    }

    fn bump_needs(&self) {
        self.needs.send_modify(|n| *n = n.wrapping_add(1));
    }

    pub fn is_synced(&self) -> bool {
        *self.synced.borrow()
    }

    fn entry(&self, cluster: &str) -> Option<Entry> {
        self.clusters
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .get(cluster)
            .cloned()
    }

    fn entry_or_new(&self, cluster: &str) -> Entry {
        if let Some(entry) = self.entry(cluster) {
            return entry;
        }
        self.clusters
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .entry(cluster.to_owned())
            .or_default()
            .clone()
    }

    fn entries(&self) -> Vec<(String, Entry)> {
        self.clusters
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .iter()
            .map(|(name, entry)| (name.clone(), entry.clone()))
            .collect()
    }

    /// Every watch has listed once: snapshots may now go out.
    pub fn set_synced(&self) {
        self.synced.send_replace(true);
        self.recompute_all();
    }

    /// Whether `cluster` is a ManagedCluster the hub accepts (`spec.hubAcceptsClient`);
    /// `None` until the watches have listed. A certificate of the hub's CA outlives the
    /// cluster it was issued to: a removed or refused cluster gets no stream.
    pub fn accepts_cluster(&self, cluster: &str) -> Option<bool> {
        if !self.is_synced() {
            return None;
        }
        Some(self.cluster_view(cluster).is_some_and(|v| v.accepted))
    }

    fn cluster_view(&self, cluster: &str) -> Option<ClusterView> {
        let reference = ObjectRef::new_with(cluster, self.cluster_resource.clone());
        let placed = self
            .placed
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .get(cluster)
            .cloned()
            .unwrap_or_default();
        self.stores.clusters.get(&reference).map(|mc| ClusterView {
            labels: mc.labels().clone(),
            placed,
            accepted: mc.data["spec"]["hubAcceptsClient"] == true,
        })
    }

    /// The modules whose status counts `cluster`: those selecting it, and those its last
    /// snapshot carries.
    fn modules_of(&self, cluster: &str, entry: Option<&ClusterEntry>) -> BTreeSet<String> {
        let view = self.cluster_view(cluster);
        let mut names: BTreeSet<String> = self
            .stores
            .modules
            .state()
            .iter()
            .filter(|m| is_selected(m, view.as_ref().map(ClusterView::facts)))
            .map(|m| m.name_any())
            .collect();
        if let Some(entry) = entry {
            names.extend(entry.carried().map(str::to_owned));
        }
        names
    }

    /// A proxy said hello on a new stream: it becomes the cluster's stream, replacing any
    /// older one, which ends with a status saying why.
    pub fn open_session(
        &self,
        cluster: &str,
        applied_revision: u64,
        outbound: OutboundSender,
    ) -> SessionId {
        let id = self.next_session.fetch_add(1, Ordering::Relaxed);
        let entry = self.entry_or_new(cluster);
        let mut entry = lock(&entry);
        if let Some((_, old)) = entry.stream.replace((id, outbound)) {
            self.metrics.streams_replaced.inc();
            old.end(
                tonic::Code::Aborted,
                format!("replaced by a newer stream of cluster {cluster}"),
            );
        }
        // After registering, so that `end_streams` either sees this stream or was called
        // before this check.
        if let (Some(why), Some((_, stream))) = (&*self.ending.borrow(), &entry.stream) {
            stream.end(tonic::Code::Unavailable, why.clone());
        }
        entry.outbox.new_stream(applied_revision);
        entry.acked_revision = applied_revision;
        entry.kernels = None;
        entry.inventory_revision = 0;
        entry.statuses.forget_partial();
        // Under the cluster's lock: a close and an open of the same cluster must not swap
        // places.
        self.connections.send_if_modified(|c| {
            c.closed_at.remove(cluster);
            c.open.insert(cluster.to_owned())
        });
        self.connection_changed(cluster, entry);
        id
    }

    /// A session opened or closed (under the cluster's lock, handed over): the gauge
    /// follows, and the modules counting the cluster are touched.
    fn connection_changed(&self, cluster: &str, entry: MutexGuard<'_, ClusterEntry>) {
        self.metrics
            .connected_clusters
            .set(gauge(self.connections.borrow().open.len()));
        let touched = self.modules_of(cluster, Some(&entry));
        drop(entry);
        self.touched.add(touched);
    }

    /// Ends every stream (shutdown): proxies reconnect, to this hub or another replica.
    pub fn end_streams(&self, why: &str) {
        self.ending.send_replace(Some(why.to_owned()));
        for (_, entry) in self.entries() {
            if let Some((_, stream)) = &lock(&entry).stream {
                stream.end(tonic::Code::Unavailable, why);
            }
        }
    }

    /// The stream ended. Only the current stream's end disconnects the cluster.
    pub fn close_session(&self, cluster: &str, id: SessionId) {
        let Some(entry) = self.entry(cluster) else {
            return;
        };
        let mut entry = lock(&entry);
        if !entry.current(id) {
            return;
        }
        entry.stream = None;
        self.connections.send_modify(|c| {
            c.open.remove(cluster);
            c.closed_at
                .insert(cluster.to_owned(), Time(Timestamp::now()));
        });
        self.connection_changed(cluster, entry);
    }

    /// A device plugin report arrived on stream `id`: the modules whose counts changed
    /// are reconciled (their status).
    pub fn device_plugins(&self, cluster: &str, id: SessionId, report: DevicePluginReport) {
        let Some(entry) = self.entry(cluster) else {
            return;
        };
        let mut entry = lock(&entry);
        if !entry.current(id) {
            return;
        }
        let now: BTreeMap<(String, String), (u32, u32)> = report
            .plugins
            .into_iter()
            .filter_map(|p| {
                let key = p.module?;
                Some(((key.namespace, key.name), (p.desired, p.available)))
            })
            .collect();
        let changed: BTreeSet<String> = now
            .iter()
            .filter(|(key, counts)| entry.device_plugins.get(*key) != Some(counts))
            .chain(
                entry
                    .device_plugins
                    .iter()
                    .filter(|(key, _)| !now.contains_key(*key)),
            )
            .map(|((_, name), _)| name.clone())
            .collect();
        entry.device_plugins = now;
        drop(entry);
        if !changed.is_empty() {
            self.touched.add(changed);
        }
    }

    /// A kernel inventory arrived on stream `id`; late duplicates are ignored.
    pub fn inventory(&self, cluster: &str, id: SessionId, inventory: KernelInventory) {
        let Some(entry) = self.entry(cluster) else {
            return;
        };
        let mut entry = lock(&entry);
        if !entry.current(id)
            || (entry.kernels.is_some() && inventory.revision <= entry.inventory_revision)
        {
            return;
        }
        entry.inventory_revision = inventory.revision;
        let kernels: BTreeSet<String> = inventory.kernels.into_iter().map(|k| k.release).collect();
        let new_kernels = entry.kernels.as_ref() != Some(&kernels);
        entry.kernels = Some(kernels);
        if new_kernels {
            self.recompute(cluster, &mut entry);
        }
        let touched = self.modules_of(cluster, Some(&entry));
        drop(entry);
        if new_kernels {
            self.bump_needs();
            self.touched.add(touched);
        }
    }

    /// A node status report (or a part of one) arrived on stream `id`.
    pub fn status(&self, cluster: &str, id: SessionId, part: NodeStatusReport) {
        let Some(entry) = self.entry(cluster) else {
            return;
        };
        let mut entry = lock(&entry);
        if !entry.current(id) {
            return;
        }
        // Statuses of modules the hub does not know (no ManagedClusterModule, nothing
        // sent) mean nothing here: a proxy cannot make the hub keep them.
        let modules = self.stores.modules.state();
        let ClusterEntry {
            outbox, statuses, ..
        } = &mut *entry;
        let mut known_modules: BTreeSet<(&str, &str)> = modules
            .iter()
            .filter_map(|m| Some((m.spec.spoke_namespace.as_str(), m.metadata.name.as_deref()?)))
            .collect();
        if let Some(sent) = outbox.last() {
            known_modules.extend(
                sent.modules
                    .iter()
                    .filter_map(|m| m.key.as_ref())
                    .map(|k| (k.namespace.as_str(), k.name.as_str())),
            );
        }
        let known = |namespace: &str, name: &str| known_modules.contains(&(namespace, name));
        let received = statuses.receive(part, known);
        let Applied {
            changed,
            full,
            intent_revision: acked,
        } = match received {
            Ok(Some(applied)) => applied,
            Ok(None) => return,
            Err(refused) => return self.refuse_report(cluster, &entry, &refused),
        };
        entry.statuses_known |= full;
        let newly_acked = acked > entry.acked_revision;
        entry.acked_revision = entry.acked_revision.max(acked);
        // Only a confirmed unload (the module leaves the snapshot) or a module the
        // snapshot does not carry yet (still loaded somewhere: it must be unloaded) can
        // change what the cluster must run.
        let snapshot_may_change = changed.iter().any(|(namespace, name)| {
            entry
                .carried_intent(namespace, name)
                .is_none_or(|m| m.unload)
        });
        if snapshot_may_change {
            self.recompute(cluster, &mut entry);
        }
        let mut touched: BTreeSet<String> = changed.into_iter().map(|(_, name)| name).collect();
        if newly_acked {
            // The statuses now reflect newer intents: a generation may have converged.
            touched.extend(entry.carried().map(str::to_owned));
        }
        drop(entry);
        self.touched.add(touched);
    }

    fn refuse_report(&self, cluster: &str, entry: &ClusterEntry, refused: &TooManyStatuses) {
        tracing::warn!(cluster, error = %refused, "refused a node status report; ending the stream");
        if let Some((_, stream)) = &entry.stream {
            stream.end(tonic::Code::ResourceExhausted, refused.to_string());
        }
    }

    /// A ManagedClusterModule was reconciled: recompute the clusters it concerns when what
    /// snapshots depend on (generation, deletion) changed since last time.
    pub fn note_module(&self, module: &ManagedClusterModule) {
        let key = (
            module.metadata.generation,
            is_deleting(module),
            assignment_key(module),
        );
        let name = module.name_any();
        {
            let mut book = lock(&self.modules);
            if book.seen.get(&name) == Some(&key) {
                return;
            }
            book.seen.insert(name, key);
        }
        self.recompute_module(module);
        self.bump_needs();
        self.preflight_changed.notify_one();
    }

    /// The hub released the module's finalizer: drop it from every snapshot now.
    pub fn forget_module(&self, module: &ManagedClusterModule) {
        let name = module.name_any();
        {
            let mut book = lock(&self.modules);
            book.seen.remove(&name);
            if let Some(uid) = module.uid() {
                book.gone.insert(uid);
            }
        }
        lock(&self.resolutions).retain(|n| n != name);
        lock(&self.revisions).retain(|n| n != name);
        self.recompute_module(module);
        self.bump_needs();
    }

    /// Recomputes the connected clusters the module is selected by or sent to.
    fn recompute_module(&self, module: &ManagedClusterModule) {
        let name = module.name_any();
        let namespace = module.spec.spoke_namespace.as_str();
        for (cluster, entry) in self.entries() {
            let view = self.cluster_view(&cluster);
            let mut entry = lock(&entry);
            if entry.stream.is_some()
                && (is_selected(module, view.as_ref().map(ClusterView::facts))
                    || entry.carries(namespace, &name)
                    || entry.statuses.lingers(namespace, &name))
            {
                self.recompute(&cluster, &mut entry);
            }
        }
    }

    /// A ManagedCluster was created, changed or deleted. Only a change of its labels or
    /// of its acceptance matters: a cluster no longer accepted (`hubAcceptsClient` false,
    /// or deleted) loses its stream at once, before any other snapshot could reach it;
    /// new labels recompute its snapshot and touch the modules whose selection changed.
    pub fn cluster_changed(&self, cluster: &str) {
        if !self.is_synced() {
            return;
        }
        let now = self.cluster_view(cluster);
        let before = {
            let mut views = lock(&self.views);
            let before = match &now {
                Some(view) => views.insert(cluster.to_owned(), view.clone()),
                None => views.remove(cluster),
            };
            if before == now {
                return;
            }
            before
        };
        let selection_changed: Vec<String> = self
            .stores
            .modules
            .state()
            .iter()
            .filter(|m| {
                is_selected(m, before.as_ref().map(ClusterView::facts))
                    != is_selected(m, now.as_ref().map(ClusterView::facts))
            })
            .map(|m| m.name_any())
            .collect();
        if let Some(entry) = self.entry(cluster) {
            let mut entry = lock(&entry);
            if now.as_ref().is_none_or(|v| !v.accepted) {
                self.deny(cluster, &entry);
            } else {
                self.recompute(cluster, &mut entry);
            }
        }
        if !selection_changed.is_empty() {
            self.bump_needs();
            self.touched.add(selection_changed);
        }
    }

    /// A PlacementDecision was created, changed or deleted: the clusters whose Placements
    /// changed are looked at again, as if their labels had changed.
    pub fn decisions_changed(&self) {
        if !self.is_synced() {
            return;
        }
        for cluster in self.index_placements() {
            self.cluster_changed(&cluster);
        }
    }

    /// Rebuilds the Placements index from the PlacementDecisions; returns the clusters
    /// whose Placements changed. A fleet has a few decisions per Placement (each lists up
    /// to 100 clusters), so a rebuild costs little beside what it may trigger.
    fn index_placements(&self) -> Vec<String> {
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
        *placed = now;
        changed
    }

    fn deny(&self, cluster: &str, entry: &ClusterEntry) {
        if let Some((_, stream)) = &entry.stream {
            tracing::warn!(
                cluster,
                "the cluster is no longer accepted; ending its stream"
            );
            self.metrics.streams_refused.inc();
            stream.end(
                tonic::Code::PermissionDenied,
                format!("cluster {cluster} is no longer a ManagedCluster this hub accepts"),
            );
        }
    }

    /// A pull Secret changed: recompute the clusters of the modules referencing it.
    pub fn secret_changed(&self, secret: &str) {
        let referencing: Vec<Arc<ManagedClusterModule>> = self
            .stores
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
            .collect();
        for module in referencing {
            self.recompute_module(&module);
        }
    }

    /// The module's current revision (computed once per generation).
    pub fn current_revision(&self, module: &ManagedClusterModule) -> String {
        lock(&self.revisions).current(module)
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

    /// A kept revision appeared, changed or went: the module's clusters that run it are
    /// recomputed (after a restart, a cluster on an earlier revision waits for it).
    pub fn revision_changed(&self, revision: &ControllerRevision) {
        let Some(name) = revision.labels().get(MODULE_LABEL) else {
            return;
        };
        if let Some(module) = self.stores.modules.get(&ObjectRef::new(name)) {
            self.recompute_module(&module);
            self.bump_needs();
        }
    }

    /// Recomputes every connected cluster and touches every module: after the watches
    /// listed (again), when any change may have been missed.
    pub fn recompute_all(&self) {
        self.index_placements();
        {
            let mut views = lock(&self.views);
            views.clear();
            for cluster in self.stores.clusters.state() {
                if let Some(view) = self.cluster_view(&cluster.name_any()) {
                    views.insert(cluster.name_any(), view);
                }
            }
        }
        for (cluster, entry) in self.entries() {
            let mut entry = lock(&entry);
            if self.accepts_cluster(&cluster) == Some(false) {
                self.deny(&cluster, &entry);
            } else if entry.stream.is_some() {
                self.recompute(&cluster, &mut entry);
            }
        }
        self.bump_needs();
        self.touched
            .add(self.stores.modules.state().iter().map(|m| m.name_any()));
    }

    fn modules(&self) -> Vec<Arc<ManagedClusterModule>> {
        let mut book = lock(&self.modules);
        // Once the watch dropped a released module, its UID need not be remembered.
        let modules = self.stores.modules.state();
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

    /// The modules as `cluster` is to run them: a progressive module's selected cluster
    /// gets the revision its rollout record assigns (an earlier one from its kept
    /// `ControllerRevision`), or nothing before the rollout reaches it. Unloads always
    /// use the current object.
    fn at_revisions(
        &self,
        modules: &[Arc<ManagedClusterModule>],
        cluster: &str,
        facts: Option<ClusterFacts<'_>>,
    ) -> Vec<Arc<ManagedClusterModule>> {
        let mut revisions = lock(&self.revisions);
        modules
            .iter()
            .filter_map(|module| {
                if !is_progressive(module) || is_deleting(module) || !is_selected(module, facts) {
                    return Some(module.clone());
                }
                let current = revisions.current(module);
                let record = module.status.as_ref().and_then(|s| s.rollout.as_ref());
                match assigned(&current, record, cluster) {
                    Assigned::Current => Some(module.clone()),
                    Assigned::Nothing => None,
                    Assigned::Earlier(revision) => {
                        let name = module.name_any();
                        let object = object_name(&name, revision);
                        let kept = revisions.earlier(module, revision, || {
                            self.stores.revisions.find(|r| r.name_any() == object)
                        });
                        if let Err(Missing { newly: true }) = kept {
                            tracing::warn!(
                                module = name,
                                cluster,
                                revision,
                                "the revision the cluster runs is not kept (or unreadable); \
                                 the snapshots of the clusters on it leave the module out \
                                 until the rollout moves them"
                            );
                        }
                        kept.ok()
                    }
                }
            })
            .collect()
    }

    /// Recomputes one cluster's snapshot (its lock held) and sends it when it changed.
    fn recompute(&self, cluster: &str, entry: &mut ClusterEntry) {
        if !self.is_synced() || entry.stream.is_none() {
            return;
        }
        let Some(kernels) = &entry.kernels else {
            return;
        };
        let view = self.cluster_view(cluster);
        let facts = view.as_ref().map(ClusterView::facts);
        let modules = self.at_revisions(&self.modules(), cluster, facts);
        let refs: Vec<&ManagedClusterModule> = modules.iter().map(AsRef::as_ref).collect();
        let inputs = cluster_modules(&refs, facts, &entry.statuses);
        let credentials = self.credentials(inputs.iter().map(|i| i.module));
        let intents = {
            let images = self
                .images
                .read()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            cluster_intents(
                &inputs,
                kernels,
                &credentials,
                &images.records,
                &mut lock(&self.resolutions),
            )
        };
        if intents.unchecked {
            // The image worker checks it within moments and recomputes.
            self.unchecked_images.notify_one();
            return;
        }
        let shared = lock(&self.intents).share(intents.snapshot);
        let Some(snapshot) = entry.outbox.offer(shared) else {
            return;
        };
        if let Some((_, stream)) = &entry.stream {
            tracing::info!(
                cluster,
                revision = snapshot.revision,
                modules = snapshot.modules.len(),
                unloads = snapshot.modules.iter().filter(|m| m.unload).count(),
                credentials = snapshot.credentials.len(),
                "sending intents"
            );
            self.metrics.snapshots_sent.inc();
            stream.snapshot(snapshot);
        }
    }

    /// Every image the fleet needs now: each module (not being unloaded) resolved for the
    /// kernels of the connected clusters that select it.
    pub fn image_needs(&self) -> BTreeMap<ImageKey, ImageNeed> {
        let modules = self.modules();
        // Per module and generation (a rollout serves several at once): the module as
        // served, and the kernels it is served for.
        type Served = (Arc<ManagedClusterModule>, BTreeSet<String>);
        let mut served: BTreeMap<(String, Option<i64>), Served> = BTreeMap::new();
        for (cluster, entry) in self.entries() {
            let view = self.cluster_view(&cluster);
            let facts = view.as_ref().map(ClusterView::facts);
            let entry = lock(&entry);
            let Some(cluster_kernels) = &entry.kernels else {
                continue;
            };
            let at_revisions = self.at_revisions(&modules, &cluster, facts);
            let refs: Vec<&ManagedClusterModule> = at_revisions.iter().map(AsRef::as_ref).collect();
            for input in cluster_modules(&refs, facts, &entry.statuses) {
                if input.unload {
                    continue;
                }
                let key = (input.module.name_any(), input.module.metadata.generation);
                let kernels = &mut served
                    .entry(key)
                    .or_insert_with(|| {
                        let module = at_revisions
                            .iter()
                            .find(|m| std::ptr::eq(m.as_ref(), input.module))
                            .expect("an input is one of the modules given");
                        (module.clone(), BTreeSet::new())
                    })
                    .1;
                // Most clusters run kernels seen already: look before copying.
                for kernel in cluster_kernels {
                    if !kernels.contains(kernel) {
                        kernels.insert(kernel.clone());
                    }
                }
            }
        }
        // Every module's resolutions come from the cache, compiled once per generation.
        let mut resolutions = lock(&self.resolutions);
        let mut needs: BTreeMap<ImageKey, ImageNeed> = served
            .values()
            .flat_map(|(module, kernels)| {
                module_needs(module, resolutions.resolve(module, kernels), kernels)
            })
            .collect();
        // Preflights add what no cluster needs yet; a kernel clusters run keeps its needs.
        for preflight in self.stores.preflights.state() {
            let spec = &preflight.spec;
            let kernel = BTreeSet::from([spec.kernel_version.clone()]);
            for module in modules.iter().filter(|m| !is_deleting(m)) {
                let resolved = resolutions.resolve(module, &kernel);
                for (key, need) in preflight_needs(
                    module,
                    resolved,
                    &spec.kernel_version,
                    spec.push_built_image,
                ) {
                    needs.entry(key).or_insert(need);
                }
            }
        }
        needs
    }

    /// A PreflightValidation changed or went: its image needs follow.
    pub fn preflight_changed(&self) {
        self.bump_needs();
        self.preflight_changed.notify_one();
    }

    /// Wakes when an image record or a PreflightValidation changed.
    pub fn preflight_events(&self) -> &Notify {
        &self.preflight_changed
    }

    /// Every module's preflight answer for `preflight`, sorted by module name.
    pub fn preflight_statuses(
        &self,
        preflight: &PreflightValidation,
        now: Timestamp,
    ) -> Vec<PreflightModuleStatus> {
        let kernel = preflight.spec.kernel_version.as_str();
        let push = preflight.spec.push_built_image;
        let kernels = BTreeSet::from([kernel.to_owned()]);
        let previous = preflight
            .status
            .as_ref()
            .map_or(&[][..], |s| &s.modules[..]);
        let modules = self.modules();
        let images = self
            .images
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        modules
            .iter()
            .filter(|m| !is_deleting(m))
            .map(|module| {
                let name = module.name_any();
                let (unresolved, recipes) = {
                    let mut resolutions = lock(&self.resolutions);
                    let resolved = resolutions.resolve(module, &kernels);
                    let unresolved = match (resolved.invalid(), resolved.kernel(kernel)) {
                        (Some(errors), _) => Some(format!("InvalidSpec: {errors}")),
                        (None, Some(Err(e))) => Some(format!("{}: {e}", e.kind.reason())),
                        _ => None,
                    };
                    (unresolved, preflight_needs(module, resolved, kernel, true))
                };
                let finding = match unresolved {
                    Some(why) => Finding::Unresolved(why),
                    None => Finding::Images(
                        recipes
                            .iter()
                            .map(|(key, need)| {
                                let recipe = need.build.is_some() || need.sign.is_some();
                                (key, recipe, images.records.get(key))
                            })
                            .collect(),
                    ),
                };
                let before = previous.iter().find(|p| p.name == name);
                module_status(module, &finding, push, before, now)
            })
            .collect()
    }

    /// Where `key` stands, as the image worker last recorded it.
    pub fn image(&self, key: &ImageKey) -> Option<ImageRecord> {
        self.images
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .records
            .get(key)
            .cloned()
    }

    /// The image worker's new record for `key`. Snapshots are recomputed only when what
    /// nodes get changes; status follows every change.
    pub fn set_image(&self, key: ImageKey, record: ImageRecord) {
        let previous = self
            .images
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .records
            .insert(key.clone(), record.clone());
        if previous.as_ref().map(ImageRecord::verdict) != Some(record.verdict()) {
            let module = self.stores.modules.get(&ObjectRef::new(&key.module));
            if let Some(module) = module {
                self.recompute_module(&module);
            }
        }
        if previous.is_none_or(|p| !p.reported_alike(&record)) {
            self.touched.add([key.module]);
            self.preflight_changed.notify_one();
        }
    }

    /// Takes the image worker's latest `needs`: status lists each image with the kernels
    /// needing it now. Forgets the images of modules that are gone; the images of a
    /// module that exists are kept even while no kernel needs them (a cluster
    /// reconnecting has not sent its kernels yet): their pins must survive, so the same
    /// bytes load again.
    pub fn track_images(&self, needs: &BTreeMap<ImageKey, ImageNeed>) {
        let modules: BTreeSet<String> = self.modules().iter().map(|m| m.name_any()).collect();
        let needed: BTreeMap<ImageKey, BTreeSet<String>> = needs
            .iter()
            .map(|(key, need)| (key.clone(), need.kernels.clone()))
            .collect();
        let mut images = self
            .images
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let mut touched: BTreeSet<String> = images
            .records
            .keys()
            .filter(|key| !modules.contains(&key.module))
            .map(|key| key.module.clone())
            .collect();
        images
            .records
            .retain(|key, _| modules.contains(&key.module));
        let keys: BTreeSet<&ImageKey> = images.needed.keys().chain(needed.keys()).collect();
        touched.extend(
            keys.into_iter()
                .filter(|key| images.needed.get(*key) != needed.get(*key))
                .map(|key| key.module.clone()),
        );
        images.needed = needed;
        drop(images);
        self.touched.add(touched);
    }

    /// The pull credentials the modules reference, from Secrets in the hub's namespace.
    fn credentials<'a>(
        &self,
        modules: impl Iterator<Item = &'a ManagedClusterModule>,
    ) -> BTreeMap<String, PullCredential> {
        let names: BTreeSet<String> = modules
            .filter_map(|m| m.spec.module_spec.image_repo_secret.as_ref())
            .map(|s| s.name.clone())
            .filter(|n| !n.is_empty())
            .collect();
        if names.is_empty() {
            return BTreeMap::new();
        }
        self.stores
            .secrets
            .state()
            .iter()
            .filter(|s| names.contains(&s.name_any()))
            .filter_map(|s| pull_credential(s).map(|c| (s.name_any(), c)))
            .collect()
    }

    /// The module's status over its selected clusters and, when it is being deleted, where
    /// its unload is not yet confirmed. Each cluster's lock is held only while that
    /// cluster is counted.
    pub fn module_view(&self, module: &ManagedClusterModule) -> ModuleView {
        let name = module.name_any();
        let namespace = module.spec.spoke_namespace.as_str();
        let deleting = is_deleting(module);
        // Each selected cluster, with the wave its rollout moves it in.
        let selected: BTreeMap<String, _> = {
            let placed = self
                .placed
                .read()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            let nowhere = Placed::new();
            self.stores
                .clusters
                .state()
                .iter()
                .filter_map(|c| {
                    let name = c.name_any();
                    let placed = placed.get(&name).unwrap_or(&nowhere);
                    let facts = ClusterFacts {
                        labels: c.labels(),
                        placed,
                    };
                    is_selected(module, Some(facts)).then(|| (name, wave(module, placed)))
                })
                .collect()
        };
        let mut tally = StatusTally::default();
        let mut observed = BTreeMap::new();
        let mut plugins: Vec<(String, (u32, u32))> = Vec::new();
        let mut leftovers = Leftovers::default();
        for (cluster, wave) in &selected {
            let Some(entry) = self.entry(cluster) else {
                let mut observation = tally.add(&ClusterReport {
                    cluster,
                    connected: false,
                    reflects_generation: false,
                    kernels: &[],
                    nodes: &[],
                });
                observation.wave.clone_from(wave);
                observed.insert(cluster.clone(), observation);
                if deleting {
                    leftovers.add(cluster, true, false, []);
                }
                continue;
            };
            let entry = lock(&entry);
            let kernels = entry
                .carried_intent(namespace, &name)
                .map(|m| m.kernels.as_slice())
                .unwrap_or_default();
            let mut observation = tally.add(&ClusterReport {
                cluster,
                connected: entry.stream.is_some(),
                reflects_generation: entry.outbox.reflects(
                    namespace,
                    &name,
                    module.metadata.generation,
                    entry.acked_revision,
                ),
                kernels,
                nodes: entry.statuses.module(namespace, &name),
            });
            observation.wave.clone_from(wave);
            observed.insert(cluster.clone(), observation);
            if let Some(counts) = entry
                .device_plugins
                .get(&(namespace.to_owned(), name.clone()))
            {
                plugins.push((cluster.clone(), *counts));
            }
            if deleting {
                leftovers.add(
                    cluster,
                    true,
                    entry.statuses_known,
                    entry.statuses.not_unloaded(namespace, &name),
                );
            }
        }
        if deleting {
            for (cluster, entry) in self.entries() {
                if selected.contains_key(&cluster) {
                    continue;
                }
                let entry = lock(&entry);
                leftovers.add(
                    &cluster,
                    false,
                    entry.statuses_known,
                    entry.statuses.not_unloaded(namespace, &name),
                );
            }
        }
        let mut status = tally.finish(module.metadata.generation);
        if module.spec.module_spec.device_plugin.is_some() {
            status.device_plugins = Some(device_plugin_counts(
                plugins
                    .iter()
                    .map(|(cluster, counts)| (cluster.as_str(), *counts)),
            ));
        }
        {
            let images = self
                .images
                .read()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            status.images = with_persisted(
                image_statuses(
                    images.records.iter().filter(|(key, _)| key.module == name),
                    &images.needed,
                ),
                module.status.as_ref().map_or(&[], |s| s.images.as_slice()),
            );
        }
        ModuleView {
            status,
            leftovers,
            observed,
        }
    }
}

/// Whether the module rolls out progressively: then each cluster runs the revision the
/// rollout record in its status assigns it.
pub fn is_progressive(module: &ManagedClusterModule) -> bool {
    module
        .spec
        .rollout_strategy
        .as_ref()
        .is_some_and(|s| s.type_ == RolloutType::Progressive)
}

/// A digest of which revision each cluster is assigned: a change (a cluster released)
/// must recompute the module's clusters even though its generation stayed.
fn assignment_key(module: &ManagedClusterModule) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    if is_progressive(module) {
        let record = module.status.as_ref().and_then(|s| s.rollout.as_ref());
        record.map(|r| &r.base_revision).hash(&mut hasher);
        for cluster in record.iter().flat_map(|r| &r.clusters) {
            (&cluster.cluster, &cluster.revision).hash(&mut hasher);
        }
    }
    hasher.finish()
}

fn pull_credential(secret: &Secret) -> Option<PullCredential> {
    let data = secret.data.as_ref()?;
    let content = if let Some(json) = data.get(".dockerconfigjson") {
        Content::DockerConfigJson(json.0.clone())
    } else {
        Content::DockerCfg(data.get(".dockercfg")?.0.clone())
    };
    Some(PullCredential {
        id: secret.name_any(),
        content: Some(content),
    })
}

fn gauge(n: usize) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

#[cfg(test)]
mod tests {
    use kube::runtime::reflector::store::{Writer, store};

    use super::*;
    use crate::serve::outbound::Outbound;

    fn state() -> FleetState {
        let stores = Stores {
            modules: store().0,
            clusters: Writer::<DynamicObject>::new(managed_cluster_resource()).as_reader(),
            secrets: store().0,
            revisions: store().0,
            preflights: store().0,
            decisions: Writer::<DynamicObject>::new(
                crate::fleet::placements::placement_decision_resource(),
            )
            .as_reader(),
        };
        FleetState::new(stores, Metrics::default())
    }

    #[test]
    fn a_trimmed_managed_cluster_keeps_what_the_hub_reads() {
        let mut cluster: DynamicObject = serde_json::from_value(serde_json::json!({
            "apiVersion": "cluster.open-cluster-management.io/v1",
            "kind": "ManagedCluster",
            "metadata": {
                "name": "spoke1",
                "labels": {"env": "prod"},
                "annotations": {"note": "x".repeat(1000)},
                "managedFields": [{"manager": "registration", "operation": "Update"}],
            },
            "spec": {"hubAcceptsClient": true, "leaseDurationSeconds": 60},
            "status": {"clusterClaims": [{"name": "id.k8s.io", "value": "x".repeat(1000)}]},
        }))
        .unwrap();
        let before = serde_json::to_vec(&cluster).unwrap().len();
        trim_managed_cluster(&mut cluster);
        assert!(serde_json::to_vec(&cluster).unwrap().len() < before / 4);
        assert_eq!(cluster.name_any(), "spoke1");
        assert_eq!(
            cluster.labels().get("env").map(String::as_str),
            Some("prod")
        );
        assert_eq!(cluster.data["spec"]["hubAcceptsClient"], true);
        assert!(cluster.data.get("status").is_none());
    }

    #[test]
    fn connections_follow_the_current_stream_of_each_cluster() {
        let state = state();
        let mut connections = state.connections();
        let first = state.open_session("spoke1", 0, OutboundSender::default());
        assert!(connections.has_changed().unwrap());
        assert!(connections.borrow_and_update().open.contains("spoke1"));
        let second = state.open_session("spoke1", 0, OutboundSender::default());
        // The replaced stream's end leaves the cluster connected.
        state.close_session("spoke1", first);
        assert!(!connections.has_changed().unwrap());
        state.close_session("spoke1", second);
        let now = connections.borrow_and_update().clone();
        assert!(now.open.is_empty());
        assert!(now.closed_at.contains_key("spoke1"));
        state.open_session("spoke1", 0, OutboundSender::default());
        let again = connections.borrow_and_update().clone();
        assert!(again.open.contains("spoke1"));
        assert!(again.closed_at.is_empty(), "open again: no longer closed");
    }

    #[test]
    fn streams_end_when_the_hub_stops_even_those_opened_after() {
        let state = state();
        let before = OutboundSender::default();
        let ended_before = before.subscribe();
        state.open_session("spoke1", 0, before);
        state.end_streams("the hub is shutting down");
        let after = OutboundSender::default();
        let ended_after = after.subscribe();
        state.open_session("spoke2", 0, after);
        let shutdown = Outbound::End(tonic::Code::Unavailable, "the hub is shutting down".into());
        assert_eq!(*ended_before.borrow(), shutdown);
        assert_eq!(*ended_after.borrow(), shutdown);
        assert_eq!(
            *state.ending().borrow(),
            Some("the hub is shutting down".to_owned())
        );
    }
}
