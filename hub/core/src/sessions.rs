//! The clusters' sessions: per cluster, its current stream, what the hub sent it (the
//! outbox) and what it reported (kernels, node statuses, device plugins). Each cluster
//! has a lock of its own: a report from one cluster never waits for another's.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, RwLock};

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kmm_proto::limits::{INVENTORY_KERNELS, KERNEL_RELEASE};
use kmm_proto::v1::{DevicePluginReport, KernelInventory, ModuleIntent};
use tokio::sync::watch;

use crate::fleet::forgetting::HeldForgetting;
use crate::fleet::inventory::{self, InventoryRefused};
use crate::fleet::module_id::{ModuleId, module_id, module_key};
use crate::fleet::module_view::ClusterSight;
use crate::fleet::node_statuses::{self, NodeStatuses};
use crate::fleet::outbox::{Held, Outbox};
use crate::fleet::revisions::RevisionMark;
use crate::images::awaited_checks::AwaitedChecks;
use crate::outbound::OutboundSender;

/// Identifies one stream among all the streams the hub has accepted.
pub type SessionId = u64;

/// Which clusters' proxies have a session with this hub, and when the others' last one
/// closed (as far as this hub saw).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Connections {
    pub open: BTreeSet<String>,
    pub closed_at: BTreeMap<String, Time>,
}

/// What a kept kernel and a device plugin count cost beyond their names (allocation and
/// map slot; approximate, on the high side).
const KERNEL_OVERHEAD: usize = 48;
const PLUGIN_OVERHEAD: usize = 96;

/// The most [`ClusterSession::reported_bytes`] can be when the hub knows `modules`
/// modules whose (namespace, name) take at most `module_name_bytes` each.
pub fn reported_bytes_bound(modules: usize, module_name_bytes: usize) -> usize {
    INVENTORY_KERNELS * (KERNEL_RELEASE + KERNEL_OVERHEAD)
        + node_statuses::MAX_BYTES
        + modules * (module_name_bytes + PLUGIN_OVERHEAD)
}

/// One cluster's session state.
#[derive(Debug, Default)]
pub struct ClusterSession {
    /// The current stream: the newest wins.
    pub stream: Option<(SessionId, OutboundSender)>,
    pub outbox: Outbox,
    /// The kernels of the current stream's latest inventory; `None` until it sent one.
    pub kernels: Option<BTreeSet<String>>,
    inventory_revision: u64,
    pub statuses: NodeStatuses,
    /// A full status report arrived since the hub started.
    pub statuses_known: bool,
    /// The intent revision the current stream's statuses were made with (its hello, then
    /// every report).
    pub acked_revision: u64,
    /// Per module (namespace, name): its device plugin's (desired, available) Pods.
    device_plugins: BTreeMap<ModuleId, (u32, u32)>,
    /// The image checks its last recompute found unchecked.
    pub awaited: AwaitedChecks,
    /// A snapshot that only forgets unloads done, held back (see `fleet::forgetting`).
    pub forgetting: HeldForgetting,
}

impl ClusterSession {
    /// Whether `id` is the current stream.
    pub fn current(&self, id: SessionId) -> bool {
        self.stream
            .as_ref()
            .is_some_and(|(current, _)| *current == id)
    }

    /// Makes `outbound` the current stream; returns the stream it replaces. What the old
    /// stream reported of kernels and unfinished reports goes with it; its node statuses
    /// stay until the new one reports, and so does the revision they were made with: the
    /// revision a hello claims counts only once a report made with it arrives (were the
    /// report of that revision lost, the old statuses would count for it).
    pub fn start(
        &mut self,
        id: SessionId,
        held: Held,
        outbound: OutboundSender,
    ) -> Option<OutboundSender> {
        let replaced = self.stream.replace((id, outbound)).map(|(_, old)| old);
        self.outbox.new_stream(held);
        self.kernels = None;
        self.inventory_revision = 0;
        self.awaited = AwaitedChecks::default();
        self.forgetting = HeldForgetting::default();
        self.statuses.forget_partial();
        replaced
    }

    /// Whether the last snapshot carries the module.
    pub fn carries(&self, namespace: &str, name: &str) -> bool {
        self.carried_intent(namespace, name).is_some()
    }

    /// The module's intent in the last snapshot.
    pub fn carried_intent(&self, namespace: &str, name: &str) -> Option<&ModuleIntent> {
        self.outbox
            .carried(namespace, name)
            .map(|carried| carried.intent)
    }

    /// The modules of the last snapshot, by name.
    pub fn carried(&self) -> impl Iterator<Item = &str> {
        self.outbox
            .last()
            .into_iter()
            .flat_map(|s| &s.modules)
            .filter_map(|m| m.key.as_ref().map(|k| k.name.as_str()))
    }

    /// A kernel inventory: whether the kernels changed; `Ok(None)` for a late duplicate.
    /// An inventory breaking a bound (see `fleet::inventory`) is refused and changes
    /// nothing.
    pub fn receive_inventory(
        &mut self,
        inventory: KernelInventory,
    ) -> Result<Option<bool>, InventoryRefused> {
        if self.kernels.is_some() && inventory.revision <= self.inventory_revision {
            return Ok(None);
        }
        let revision = inventory.revision;
        let kernels = inventory::kernels(inventory)?;
        self.inventory_revision = revision;
        let changed = self.kernels.as_ref() != Some(&kernels);
        self.kernels = Some(kernels);
        Ok(Some(changed))
    }

    /// A device plugin report: the modules whose counts changed, by name. Counts of
    /// modules `known` denies (modules the hub never sent the cluster) are dropped, so a
    /// proxy cannot make the hub keep entries for names of its own; how many were dropped
    /// is returned beside.
    pub fn receive_device_plugins(
        &mut self,
        report: DevicePluginReport,
        known: impl Fn(&str, &str) -> bool,
    ) -> (BTreeSet<String>, usize) {
        let mut unknown = 0;
        let now: BTreeMap<ModuleId, (u32, u32)> = report
            .plugins
            .into_iter()
            .filter_map(|p| {
                let key = p.module?;
                if !known(&key.namespace, &key.name) {
                    unknown += 1;
                    return None;
                }
                Some((
                    module_id(&key.namespace, &key.name),
                    (p.desired, p.available),
                ))
            })
            .collect();
        let changed = now
            .iter()
            .filter(|(key, counts)| self.device_plugins.get(*key) != Some(counts))
            .chain(
                self.device_plugins
                    .iter()
                    .filter(|(key, _)| !now.contains_key(*key)),
            )
            .map(|((_, name), _)| name.to_string())
            .collect();
        self.device_plugins = now;
        (changed, unknown)
    }

    /// The bytes the session holds of what its proxy reported (kernels, node statuses,
    /// device plugin counts), accounted as `NodeStatuses::bytes` does: bounded by
    /// [`reported_bytes_bound`] for the modules the hub knows.
    pub fn reported_bytes(&self) -> usize {
        let kernels = self.kernels.as_ref().map_or(0, |kernels| {
            kernels.iter().map(|k| k.len() + KERNEL_OVERHEAD).sum()
        });
        let plugins: usize = self
            .device_plugins
            .keys()
            .map(|(namespace, name)| namespace.len() + name.len() + PLUGIN_OVERHEAD)
            .sum();
        kernels + self.statuses.bytes() + plugins
    }

    /// What the session shows of one module at revision `mark`.
    pub fn sight(
        &self,
        namespace: &str,
        name: &str,
        mark: Option<RevisionMark>,
    ) -> ClusterSight<'_> {
        // Counted for every selected cluster of a module, up to ten times a second: the
        // module is looked up once.
        let carried = self.outbox.carried(namespace, name);
        let acked = self.acked_revision;
        ClusterSight {
            connected: self.stream.is_some(),
            reflects_revision: carried.is_some_and(|c| c.reflects(mark, acked)),
            kernels: carried.map_or(&[], |c| c.intent.kernels.as_slice()),
            statuses: &self.statuses,
            statuses_known: self.statuses_known,
            unload_unconfirmed: carried.is_some_and(|c| c.unload_unconfirmed(acked)),
            device_plugin: self
                .device_plugins
                .get(module_key(&(namespace, name)))
                .copied(),
        }
    }
}

pub type Session = Arc<Mutex<ClusterSession>>;

/// Every cluster's session, the connections they make, and the hub's end of them all.
#[derive(Debug)]
pub struct Sessions {
    /// Looked up for every selected cluster of a module at each count: hashed with
    /// foldhash, several times cheaper than the default SipHash on a cluster's name and
    /// still seeded per process (names come from ManagedClusters and client certificates).
    clusters: RwLock<HashMap<String, Session, foldhash::fast::RandomState>>,
    next_id: AtomicU64,
    /// Changes only when a session opens or closes.
    connections: watch::Sender<Connections>,
    /// Why every stream ends, once the hub stops: no stream may open after it.
    ending: watch::Sender<Option<String>>,
}

impl Default for Sessions {
    fn default() -> Self {
        Self {
            clusters: RwLock::default(),
            next_id: AtomicU64::new(1),
            connections: watch::Sender::new(Connections::default()),
            ending: watch::Sender::new(None),
        }
    }
}

impl Sessions {
    pub fn get(&self, cluster: &str) -> Option<Session> {
        self.clusters
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .get(cluster)
            .cloned()
    }

    pub fn get_or_new(&self, cluster: &str) -> Session {
        if let Some(session) = self.get(cluster) {
            return session;
        }
        self.clusters
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .entry(cluster.to_owned())
            .or_default()
            .clone()
    }

    /// Every cluster's session (a copy of the index: no lock is held while they are used).
    pub fn all(&self) -> Vec<(String, Session)> {
        self.clusters
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .iter()
            .map(|(name, session)| (name.clone(), session.clone()))
            .collect()
    }

    /// Forgets a cluster's session (its ManagedCluster is gone): a cluster that left the
    /// fleet is not disconnected.
    pub fn remove(&self, cluster: &str) {
        self.clusters
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .remove(cluster);
        self.connections
            .send_if_modified(|c| c.closed_at.remove(cluster).is_some());
    }

    pub fn next_id(&self) -> SessionId {
        self.next_id.fetch_add(1, Ordering::Relaxed)
    }

    /// Follows the clusters' sessions as they open and close.
    pub fn connections(&self) -> watch::Receiver<Connections> {
        self.connections.subscribe()
    }

    /// How many clusters are connected.
    pub fn open_count(&self) -> usize {
        self.connections.borrow().open.len()
    }

    /// The cluster's stream opened (call under its lock: an open and a close of the same
    /// cluster must not swap places).
    pub fn opened(&self, cluster: &str) {
        self.connections.send_if_modified(|c| {
            c.closed_at.remove(cluster);
            c.open.insert(cluster.to_owned())
        });
    }

    /// The cluster's current stream closed (under its lock).
    pub fn closed(&self, cluster: &str) {
        self.connections.send_modify(|c| {
            c.open.remove(cluster);
            c.closed_at
                .insert(cluster.to_owned(), Time(Timestamp::now()));
        });
    }

    /// Set once, with the reason, when the hub ends every stream.
    pub fn ending(&self) -> watch::Receiver<Option<String>> {
        self.ending.subscribe()
    }

    /// Why streams end, once the hub stops.
    pub fn ending_reason(&self) -> Option<String> {
        self.ending.borrow().clone()
    }

    /// Ends every stream (shutdown), and every stream that opens later.
    pub fn end_all(&self, why: &str) {
        self.ending.send_replace(Some(why.to_owned()));
        for (_, session) in self.all() {
            if let Some((_, stream)) = &lock(&session).stream {
                stream.end(tonic::Code::Unavailable, why);
            }
        }
    }
}

/// Takes a lock. A panic while holding it leaves plain data behind, still consistent
/// enough to serve: every recompute starts from the watched objects again.
pub fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

#[cfg(test)]
mod tests {
    use kmm_proto::v1::{DevicePluginCount, Kernel, ModuleKey};

    use super::*;

    fn inventory(revision: u64, kernels: &[&str]) -> KernelInventory {
        KernelInventory {
            revision,
            kernels: kernels
                .iter()
                .map(|k| Kernel {
                    release: (*k).to_owned(),
                })
                .collect(),
        }
    }

    #[test]
    fn an_inventory_counts_once_and_only_newer_ones_follow() {
        let mut session = ClusterSession::default();
        assert_eq!(
            session.receive_inventory(inventory(3, &["6.1"])),
            Ok(Some(true))
        );
        assert_eq!(session.receive_inventory(inventory(3, &["6.2"])), Ok(None));
        assert_eq!(
            session.receive_inventory(inventory(4, &["6.1"])),
            Ok(Some(false))
        );
        assert_eq!(
            session.receive_inventory(inventory(5, &["6.2"])),
            Ok(Some(true))
        );
        // A new stream starts over: its first inventory counts whatever its revision.
        session.start(7, Held::default(), OutboundSender::default());
        assert_eq!(session.kernels, None);
        assert_eq!(
            session.receive_inventory(inventory(1, &["6.2"])),
            Ok(Some(true))
        );
    }

    #[test]
    fn a_refused_inventory_leaves_the_kernels_and_revision_as_they_were() {
        let mut session = ClusterSession::default();
        session.receive_inventory(inventory(1, &["6.1"])).unwrap();
        let flood: Vec<String> = (0..=kmm_proto::limits::INVENTORY_KERNELS)
            .map(|i| format!("6.1.{i}"))
            .collect();
        let flood: Vec<&str> = flood.iter().map(String::as_str).collect();
        assert!(session.receive_inventory(inventory(2, &flood)).is_err());
        assert!(
            session
                .receive_inventory(inventory(3, &["bad kernel"]))
                .is_err()
        );
        assert_eq!(session.kernels, Some(BTreeSet::from(["6.1".to_owned()])));
        assert_eq!(
            session.receive_inventory(inventory(2, &["6.2"])),
            Ok(Some(true)),
            "a refused inventory's revision does not count"
        );
    }

    #[test]
    fn device_plugin_counts_name_the_modules_that_changed_or_went() {
        let plugin = |name: &str, desired, available| DevicePluginCount {
            module: Some(ModuleKey {
                namespace: "kmm".into(),
                name: name.into(),
            }),
            desired,
            available,
        };
        let mut session = ClusterSession::default();
        let all = |_: &str, _: &str| true;
        let first = DevicePluginReport {
            plugins: vec![plugin("a", 2, 1), plugin("b", 1, 1)],
        };
        assert_eq!(
            session.receive_device_plugins(first.clone(), all),
            (BTreeSet::from(["a".to_owned(), "b".to_owned()]), 0)
        );
        assert!(session.receive_device_plugins(first, all).0.is_empty());
        let next = DevicePluginReport {
            plugins: vec![plugin("a", 2, 2)],
        };
        assert_eq!(
            session.receive_device_plugins(next, all),
            (BTreeSet::from(["a".to_owned(), "b".to_owned()]), 0)
        );
        assert_eq!(session.sight("kmm", "a", None).device_plugin, Some((2, 2)));
        assert_eq!(session.sight("kmm", "b", None).device_plugin, None);
    }

    #[test]
    fn device_plugin_counts_of_modules_never_sent_are_dropped() {
        let plugin = |name: String| DevicePluginCount {
            module: Some(ModuleKey {
                namespace: "kmm".into(),
                name,
            }),
            desired: 1,
            available: 0,
        };
        let mut session = ClusterSession::default();
        let report = DevicePluginReport {
            plugins: std::iter::once("a".to_owned())
                .chain((0..10_000).map(|i| format!("stranger{i}")))
                .map(plugin)
                .collect(),
        };
        let (changed, unknown) = session.receive_device_plugins(report, |_, name| name == "a");
        assert_eq!(changed, BTreeSet::from(["a".to_owned()]));
        assert_eq!(unknown, 10_000);
        assert_eq!(session.device_plugins.len(), 1);
    }

    #[test]
    fn a_replaced_stream_is_handed_back() {
        let mut session = ClusterSession::default();
        assert!(
            session
                .start(1, Held::default(), OutboundSender::default())
                .is_none()
        );
        assert!(session.current(1));
        session.acked_revision = 3;
        assert!(
            session
                .start(
                    2,
                    Held {
                        revision: 5,
                        digest: None,
                    },
                    OutboundSender::default()
                )
                .is_some()
        );
        assert!(!session.current(1));
        assert!(session.current(2));
        assert_eq!(
            session.acked_revision, 3,
            "the hello's revision counts only once a report made with it arrives"
        );
    }
}
