//! The hub's in-memory view of the fleet, fed by watches (ManagedClusterModules,
//! ManagedClusters, pull Secrets) and by the proxies' streams (inventory, node status).
//! Every change recomputes the affected clusters' snapshots with the pure fleet core and
//! hands a snapshot to a stream only when its content changed.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};

use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kmm_api::{ManagedClusterModule, ManagedClusterModuleStatus};
use kmm_proto::v1::{
    IntentSnapshot, KernelInventory, NodeStatusReport, PullCredential, pull_credential::Content,
};
use kube::ResourceExt;
use kube::core::{ApiResource, DynamicObject, GroupVersionKind};
use kube::runtime::reflector::{ObjectRef, Store};
use tokio::sync::watch;

use crate::fleet::assignment::{cluster_modules, is_deleting, is_selected};
use crate::fleet::deletion::{ClusterUnload, Leftover, leftovers};
use crate::fleet::intents::cluster_intents;
use crate::fleet::node_statuses::NodeStatuses;
use crate::fleet::outbox::Outbox;
use crate::fleet::sessions::{SessionId, Sessions};
use crate::fleet::status::{ClusterReport, module_status};
use crate::images::status::image_statuses;
use crate::images::{ImageKey, ImageNeed, ImageRecord, module_needs};

use super::metrics::Metrics;

/// `cluster.open-cluster-management.io/v1` `ManagedCluster`.
pub fn managed_cluster_resource() -> ApiResource {
    let gvk = GroupVersionKind::gvk("cluster.open-cluster-management.io", "v1", "ManagedCluster");
    ApiResource::from_gvk_with_plural(&gvk, "managedclusters")
}

/// What a stream's outbound half must do next; only the latest value matters, so a slow
/// proxy gets the newest snapshot rather than a backlog.
#[derive(Clone, Debug, PartialEq)]
pub enum Outbound {
    Idle,
    Snapshot(IntentSnapshot),
    /// End the stream with this gRPC status.
    End(tonic::Code, String),
}

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
}

#[derive(Debug, Default)]
struct ClusterEntry {
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
}

#[derive(Debug, Default)]
struct Inner {
    sessions: Sessions<watch::Sender<Outbound>>,
    clusters: BTreeMap<String, ClusterEntry>,
    /// Per module: the generation and deletion state the snapshots were last computed for.
    seen_modules: BTreeMap<String, (Option<i64>, bool)>,
    /// UIDs of modules whose finalizer the hub removed: gone, even before the watch says so.
    gone: BTreeSet<String>,
    /// Where every image the fleet needs stands, as the image worker found it.
    images: BTreeMap<ImageKey, ImageRecord>,
    /// The kernels needing each image now, as the image worker last computed them.
    needed_images: BTreeMap<ImageKey, BTreeSet<String>>,
}

/// The shared fleet view.
#[derive(Debug)]
pub struct FleetState {
    inner: Mutex<Inner>,
    stores: Stores,
    cluster_resource: ApiResource,
    synced: AtomicBool,
    /// Bumped on every change a module's status may depend on.
    changes: watch::Sender<u64>,
    /// Changes only when a session opens or closes, unlike `changes`.
    connections: watch::Sender<Connections>,
    /// A snapshot waits for an image check: wakes the image worker.
    unchecked_images: tokio::sync::Notify,
    metrics: Metrics,
}

impl FleetState {
    pub fn new(stores: Stores, metrics: Metrics) -> Self {
        Self {
            inner: Mutex::default(),
            stores,
            cluster_resource: managed_cluster_resource(),
            synced: AtomicBool::new(false),
            changes: watch::Sender::new(0),
            connections: watch::Sender::new(Connections::default()),
            unchecked_images: tokio::sync::Notify::new(),
            metrics,
        }
    }

    /// Follows the clusters' sessions as they open and close.
    pub fn connections(&self) -> watch::Receiver<Connections> {
        self.connections.subscribe()
    }

    /// Resolves when a snapshot waits for images that were never checked.
    pub async fn images_unchecked(&self) {
        self.unchecked_images.notified().await;
    }

    /// Fires whenever module statuses may have changed.
    pub fn changes(&self) -> watch::Receiver<u64> {
        self.changes.subscribe()
    }

    fn changed(&self) {
        self.changes.send_modify(|n| *n = n.wrapping_add(1));
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        // A panic while holding the lock leaves plain data behind, still consistent enough
        // to serve: every recompute starts from the watched objects again.
        self.inner
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Every watch has listed once: snapshots may now go out.
    pub fn set_synced(&self) {
        self.synced.store(true, Ordering::SeqCst);
        self.recompute_all();
    }

    fn is_synced(&self) -> bool {
        self.synced.load(Ordering::SeqCst)
    }

    /// Whether `cluster` is a ManagedCluster the hub accepts (`spec.hubAcceptsClient`);
    /// `None` until the watches have listed. A certificate of the hub's CA outlives the
    /// cluster it was issued to: a removed or refused cluster gets no stream.
    pub fn accepts_cluster(&self, cluster: &str) -> Option<bool> {
        if !self.is_synced() {
            return None;
        }
        let reference = ObjectRef::new_with(cluster, self.cluster_resource.clone());
        Some(
            self.stores
                .clusters
                .get(&reference)
                .is_some_and(|mc| mc.data["spec"]["hubAcceptsClient"] == true),
        )
    }

    /// A proxy said hello on a new stream: it becomes the cluster's stream, replacing any
    /// older one, which ends with a status saying why.
    pub fn open_session(
        &self,
        cluster: &str,
        applied_revision: u64,
        outbound: watch::Sender<Outbound>,
    ) -> SessionId {
        let mut inner = self.lock();
        let (id, replaced) = inner.sessions.open(cluster, outbound);
        if let Some(old) = replaced {
            self.metrics.streams_replaced.inc();
            old.send_replace(Outbound::End(
                tonic::Code::Aborted,
                format!("replaced by a newer stream of cluster {cluster}"),
            ));
        }
        let entry = inner.clusters.entry(cluster.to_owned()).or_default();
        entry.outbox.new_stream(applied_revision);
        entry.acked_revision = applied_revision;
        entry.kernels = None;
        entry.inventory_revision = 0;
        self.metrics
            .connected_clusters
            .set(gauge(inner.sessions.len()));
        // Under the lock: a close and an open of the same cluster must not swap places.
        self.connections.send_if_modified(|c| {
            c.closed_at.remove(cluster);
            c.open.insert(cluster.to_owned())
        });
        drop(inner);
        self.changed();
        id
    }

    /// Ends every stream (shutdown): proxies reconnect, to this hub or another replica.
    pub fn end_streams(&self, why: &str) {
        let inner = self.lock();
        for cluster in inner.sessions.connected() {
            if let Some(stream) = inner.sessions.get(cluster) {
                stream.send_replace(Outbound::End(tonic::Code::Unavailable, why.to_owned()));
            }
        }
    }

    /// The stream ended. Only the current stream's end disconnects the cluster.
    pub fn close_session(&self, cluster: &str, id: SessionId) {
        let mut inner = self.lock();
        if inner.sessions.close(cluster, id) {
            self.metrics
                .connected_clusters
                .set(gauge(inner.sessions.len()));
            self.connections.send_modify(|c| {
                c.open.remove(cluster);
                c.closed_at
                    .insert(cluster.to_owned(), Time(Timestamp::now()));
            });
            drop(inner);
            self.changed();
        }
    }

    /// A kernel inventory arrived on stream `id`; late duplicates are ignored.
    pub fn inventory(&self, cluster: &str, id: SessionId, inventory: KernelInventory) {
        let mut inner = self.lock();
        if !inner.sessions.is_current(cluster, id) {
            return;
        }
        let entry = inner.clusters.entry(cluster.to_owned()).or_default();
        if entry.kernels.is_some() && inventory.revision <= entry.inventory_revision {
            return;
        }
        entry.inventory_revision = inventory.revision;
        entry.kernels = Some(inventory.kernels.into_iter().map(|k| k.release).collect());
        self.recompute(&mut inner, cluster);
        drop(inner);
        self.changed();
    }

    /// A node status report arrived on stream `id`.
    pub fn status(&self, cluster: &str, id: SessionId, report: NodeStatusReport) {
        let mut inner = self.lock();
        if !inner.sessions.is_current(cluster, id) {
            return;
        }
        let entry = inner.clusters.entry(cluster.to_owned()).or_default();
        let acked = report.intent_revision;
        let full = report.full;
        // Statuses of modules the hub does not know (no ManagedClusterModule, nothing
        // sent) mean nothing here: a proxy cannot make the hub keep them.
        let mut known_modules: BTreeSet<(String, String)> = self
            .stores
            .modules
            .state()
            .iter()
            .map(|m| (m.spec.spoke_namespace.clone(), m.name_any()))
            .collect();
        if let Some(sent) = entry.outbox.last() {
            known_modules.extend(
                sent.modules
                    .iter()
                    .filter_map(|m| m.key.as_ref())
                    .map(|k| (k.namespace.clone(), k.name.clone())),
            );
        }
        let known = |namespace: &str, name: &str| {
            known_modules.contains(&(namespace.to_owned(), name.to_owned()))
        };
        if let Err(refused) = entry.statuses.apply(report, known) {
            tracing::warn!(cluster, error = %refused, "refused a node status report; ending the stream");
            if let Some(stream) = inner.sessions.get(cluster) {
                stream.send_replace(Outbound::End(
                    tonic::Code::ResourceExhausted,
                    refused.to_string(),
                ));
            }
            return;
        }
        entry.statuses_known |= full;
        entry.acked_revision = entry.acked_revision.max(acked);
        // Confirmed unloads of deselected modules take them out of the snapshot.
        self.recompute(&mut inner, cluster);
        drop(inner);
        self.changed();
    }

    /// A ManagedClusterModule was reconciled: recompute when what snapshots depend on
    /// (generation, deletion) changed since last time.
    pub fn note_module(&self, module: &ManagedClusterModule) {
        let key = (module.metadata.generation, is_deleting(module));
        let mut inner = self.lock();
        if inner.seen_modules.get(&module.name_any()) == Some(&key) {
            return;
        }
        inner.seen_modules.insert(module.name_any(), key);
        self.recompute_locked(&mut inner);
    }

    /// The hub released the module's finalizer: drop it from every snapshot now.
    pub fn forget_module(&self, module: &ManagedClusterModule) {
        let mut inner = self.lock();
        inner.seen_modules.remove(&module.name_any());
        if let Some(uid) = module.uid() {
            inner.gone.insert(uid);
        }
        self.recompute_locked(&mut inner);
    }

    /// ManagedClusters or Secrets changed. A connected cluster the hub no longer accepts
    /// (`hubAcceptsClient` false, or deleted) loses its stream at once, before any other
    /// snapshot could reach it.
    pub fn recompute_all(&self) {
        let mut inner = self.lock();
        let denied: Vec<String> = inner
            .sessions
            .connected()
            .filter(|cluster| self.accepts_cluster(cluster) == Some(false))
            .map(str::to_owned)
            .collect();
        for cluster in &denied {
            if let Some(stream) = inner.sessions.get(cluster) {
                tracing::warn!(
                    cluster,
                    "the cluster is no longer accepted; ending its stream"
                );
                self.metrics.streams_refused.inc();
                stream.send_replace(Outbound::End(
                    tonic::Code::PermissionDenied,
                    format!("cluster {cluster} is no longer a ManagedCluster this hub accepts"),
                ));
            }
        }
        self.recompute_locked(&mut inner);
        drop(inner);
        self.changed();
    }

    fn recompute_locked(&self, inner: &mut Inner) {
        // Once the watch dropped a released module, its UID need not be remembered.
        if !inner.gone.is_empty() {
            let present: BTreeSet<String> = self
                .stores
                .modules
                .state()
                .iter()
                .filter_map(|m| m.uid())
                .collect();
            inner.gone.retain(|uid| present.contains(uid));
        }
        let clusters: Vec<String> = inner
            .sessions
            .connected()
            .filter(|cluster| self.accepts_cluster(cluster) != Some(false))
            .map(str::to_owned)
            .collect();
        for cluster in clusters {
            self.recompute(inner, &cluster);
        }
    }

    fn labels(&self, cluster: &str) -> Option<BTreeMap<String, String>> {
        let reference = ObjectRef::new_with(cluster, self.cluster_resource.clone());
        self.stores
            .clusters
            .get(&reference)
            .map(|c| c.labels().clone())
    }

    fn modules(&self, inner: &Inner) -> Vec<std::sync::Arc<ManagedClusterModule>> {
        let mut modules: Vec<_> = self
            .stores
            .modules
            .state()
            .into_iter()
            .filter(|m| m.uid().is_none_or(|uid| !inner.gone.contains(&uid)))
            .collect();
        modules.sort_by_key(|m| m.name_any());
        modules
    }

    fn recompute(&self, inner: &mut Inner, cluster: &str) {
        if !self.is_synced() {
            return;
        }
        let modules = self.modules(inner);
        let labels = self.labels(cluster);
        let Some(entry) = inner.clusters.get_mut(cluster) else {
            return;
        };
        let Some(kernels) = &entry.kernels else {
            return;
        };
        let refs: Vec<&ManagedClusterModule> = modules.iter().map(AsRef::as_ref).collect();
        let inputs = cluster_modules(&refs, labels.as_ref(), &entry.statuses);
        let credentials = self.credentials(inputs.iter().map(|i| i.module));
        let intents = cluster_intents(&inputs, kernels, &credentials, &inner.images);
        if intents.unchecked {
            // The image worker checks it within moments and recomputes.
            self.unchecked_images.notify_one();
            return;
        }
        let Some(snapshot) = entry.outbox.offer(intents.snapshot) else {
            return;
        };
        if let Some(stream) = inner.sessions.get(cluster) {
            tracing::info!(
                cluster,
                revision = snapshot.revision,
                modules = snapshot.modules.len(),
                unloads = snapshot.modules.iter().filter(|m| m.unload).count(),
                credentials = snapshot.credentials.len(),
                "sending intents"
            );
            self.metrics.snapshots_sent.inc();
            stream.send_replace(Outbound::Snapshot(snapshot));
        }
    }

    /// Every image the fleet needs now: each module (not being unloaded) resolved for the
    /// kernels of the connected clusters that select it.
    pub fn image_needs(&self) -> BTreeMap<ImageKey, ImageNeed> {
        let inner = self.lock();
        let modules = self.modules(&inner);
        let refs: Vec<&ManagedClusterModule> = modules.iter().map(AsRef::as_ref).collect();
        let mut kernels: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
        for (cluster, entry) in &inner.clusters {
            let Some(cluster_kernels) = &entry.kernels else {
                continue;
            };
            let labels = self.labels(cluster);
            for input in cluster_modules(&refs, labels.as_ref(), &entry.statuses) {
                if !input.unload {
                    kernels
                        .entry(input.module.name_any())
                        .or_default()
                        .extend(cluster_kernels.iter().cloned());
                }
            }
        }
        modules
            .iter()
            .filter_map(|m| Some(module_needs(m, kernels.get(&m.name_any())?)))
            .flatten()
            .collect()
    }

    /// Where `key` stands, as the image worker last recorded it.
    pub fn image(&self, key: &ImageKey) -> Option<ImageRecord> {
        self.lock().images.get(key).cloned()
    }

    /// The image worker's new record for `key`. Snapshots are recomputed only when what
    /// nodes get changes; status follows every change.
    pub fn set_image(&self, key: ImageKey, record: ImageRecord) {
        let mut inner = self.lock();
        let previous = inner.images.insert(key, record.clone());
        if previous.as_ref().map(ImageRecord::verdict) != Some(record.verdict()) {
            self.recompute_locked(&mut inner);
        }
        drop(inner);
        if previous.is_none_or(|p| !p.reported_alike(&record)) {
            self.changed();
        }
    }

    /// Takes the image worker's latest `needs`: status lists each image with the kernels
    /// needing it now. Forgets the images of modules that are gone; the images of a
    /// module that exists are kept even while no kernel needs them (a cluster
    /// reconnecting has not sent its kernels yet): their pins must survive, so the same
    /// bytes load again.
    pub fn track_images(&self, needs: &BTreeMap<ImageKey, ImageNeed>) {
        let mut inner = self.lock();
        let modules: BTreeSet<String> = self.modules(&inner).iter().map(|m| m.name_any()).collect();
        let before = inner.images.len();
        inner.images.retain(|key, _| modules.contains(&key.module));
        let needed: BTreeMap<ImageKey, BTreeSet<String>> = needs
            .iter()
            .map(|(key, need)| (key.clone(), need.kernels.clone()))
            .collect();
        let changed = inner.images.len() != before || inner.needed_images != needed;
        inner.needed_images = needed;
        drop(inner);
        if changed {
            self.changed();
        }
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
        self.stores
            .secrets
            .state()
            .iter()
            .filter(|s| names.contains(&s.name_any()))
            .filter_map(|s| pull_credential(s).map(|c| (s.name_any(), c)))
            .collect()
    }

    /// The module's status over its selected clusters and, when it is being deleted, where
    /// its unload is not yet confirmed.
    pub fn module_view(
        &self,
        module: &ManagedClusterModule,
    ) -> (ManagedClusterModuleStatus, Vec<Leftover>) {
        let inner = self.lock();
        let name = module.name_any();
        let namespace = module.spec.spoke_namespace.as_str();
        let selected: BTreeSet<String> = self
            .stores
            .clusters
            .state()
            .iter()
            .filter(|c| is_selected(module, Some(c.labels())))
            .map(|c| c.name_any())
            .collect();
        let empty = ClusterEntry::default();
        let per_cluster: Vec<(
            &str,
            &ClusterEntry,
            Vec<kmm_proto::v1::KernelTarget>,
            Vec<kmm_proto::v1::ModuleNodeStatus>,
        )> = selected
            .iter()
            .map(|cluster| {
                let entry = inner.clusters.get(cluster).unwrap_or(&empty);
                let kernels = entry
                    .outbox
                    .last()
                    .and_then(|s| {
                        s.modules.iter().find(|m| {
                            m.key
                                .as_ref()
                                .is_some_and(|k| k.name == name && k.namespace == namespace)
                        })
                    })
                    .map(|m| m.kernels.clone())
                    .unwrap_or_default();
                (
                    cluster.as_str(),
                    entry,
                    kernels,
                    entry.statuses.module(namespace, &name),
                )
            })
            .collect();
        let reports: Vec<ClusterReport<'_>> = per_cluster
            .iter()
            .map(|(cluster, entry, kernels, nodes)| ClusterReport {
                cluster,
                connected: inner.sessions.is_connected(cluster),
                reflects_generation: entry.outbox.reflects(
                    namespace,
                    &name,
                    module.metadata.generation,
                    entry.acked_revision,
                ),
                kernels,
                nodes,
            })
            .collect();
        let mut status = module_status(module.metadata.generation, &reports);
        status.images = image_statuses(
            inner.images.iter().filter(|(key, _)| key.module == name),
            &inner.needed_images,
        );
        let unloads: Vec<ClusterUnload<'_>> = inner
            .clusters
            .iter()
            .filter(|(cluster, _)| !selected.contains(*cluster))
            .map(|(cluster, entry)| (cluster.as_str(), entry, false))
            .chain(
                per_cluster
                    .iter()
                    .map(|(cluster, entry, _, _)| (*cluster, *entry, true)),
            )
            .map(|(cluster, entry, selected)| ClusterUnload {
                cluster,
                selected,
                statuses_known: entry.statuses_known,
                not_unloaded: entry.statuses.not_unloaded(namespace, &name),
            })
            .collect();
        (status, leftovers(&unloads))
    }
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

    fn state() -> FleetState {
        let stores = Stores {
            modules: store().0,
            clusters: Writer::<DynamicObject>::new(managed_cluster_resource()).as_reader(),
            secrets: store().0,
        };
        FleetState::new(stores, Metrics::default())
    }

    #[test]
    fn connections_follow_the_current_stream_of_each_cluster() {
        let state = state();
        let mut connections = state.connections();
        let first = state.open_session("spoke1", 0, watch::Sender::new(Outbound::Idle));
        assert!(connections.has_changed().unwrap());
        assert!(connections.borrow_and_update().open.contains("spoke1"));
        let second = state.open_session("spoke1", 0, watch::Sender::new(Outbound::Idle));
        // The replaced stream's end leaves the cluster connected.
        state.close_session("spoke1", first);
        assert!(!connections.has_changed().unwrap());
        state.close_session("spoke1", second);
        let now = connections.borrow_and_update().clone();
        assert!(now.open.is_empty());
        assert!(now.closed_at.contains_key("spoke1"));
        state.open_session("spoke1", 0, watch::Sender::new(Outbound::Idle));
        let again = connections.borrow_and_update().clone();
        assert!(again.open.contains("spoke1"));
        assert!(again.closed_at.is_empty(), "open again: no longer closed");
    }
}
