//! The proxies' streams as they reach the fleet view: sessions opening and closing, and
//! what each reports. This is the whole of what the gRPC service may do with the view
//! ([`ClusterStreams`]).

use std::collections::BTreeSet;

use kmm_proto::v1::{DevicePluginReport, KernelInventory, NodeStatusReport};
use tokio::sync::watch;

use crate::fleet::node_statuses::{Applied, TooManyStatuses};
use crate::serve::outbound::OutboundSender;

use super::sessions::{ClusterSession, SessionId};
use super::{ClusterStreams, FleetView, gauge, lock};

impl ClusterStreams for FleetView {
    fn ending(&self) -> watch::Receiver<Option<String>> {
        self.sessions.ending()
    }

    fn synced(&self) -> watch::Receiver<bool> {
        self.signals.synced.subscribe()
    }

    /// Whether `cluster` is a ManagedCluster the hub accepts (`spec.hubAcceptsClient`);
    /// `None` until the watches have listed. A certificate of the hub's CA outlives the
    /// cluster it was issued to: a removed or refused cluster gets no stream.
    fn accepts_cluster(&self, cluster: &str) -> Option<bool> {
        if !self.is_synced() {
            return None;
        }
        Some(self.index.cluster_view(cluster).is_some_and(|v| v.accepted))
    }

    /// A proxy said hello on a new stream: it becomes the cluster's stream, replacing any
    /// older one, which ends with a status saying why.
    fn open_session(
        &self,
        cluster: &str,
        applied_revision: u64,
        outbound: OutboundSender,
    ) -> SessionId {
        let id = self.sessions.next_id();
        let session = self.sessions.get_or_new(cluster);
        let mut session = lock(&session);
        if let Some(old) = session.start(id, applied_revision, outbound) {
            self.metrics.streams_replaced.inc();
            old.end(
                tonic::Code::Aborted,
                format!("replaced by a newer stream of cluster {cluster}"),
            );
        }
        // After registering, so that `end_streams` either sees this stream or was called
        // before this check.
        if let (Some(why), Some((_, stream))) = (self.sessions.ending_reason(), &session.stream) {
            stream.end(tonic::Code::Unavailable, why);
        }
        // Likewise for a denial: one that came between the service's check and now found
        // no stream to end.
        if self.is_synced() && !self.index.cluster_view(cluster).is_some_and(|v| v.accepted) {
            self.deny(cluster, &session);
        }
        self.sessions.opened(cluster);
        self.connection_changed(cluster, &session);
        id
    }

    /// The stream ended. Only the current stream's end disconnects the cluster.
    fn close_session(&self, cluster: &str, id: SessionId) {
        let Some(session) = self.sessions.get(cluster) else {
            return;
        };
        let mut session = lock(&session);
        if !session.current(id) {
            return;
        }
        session.stream = None;
        self.sessions.closed(cluster);
        self.connection_changed(cluster, &session);
    }

    /// A kernel inventory arrived on stream `id`; late duplicates are ignored.
    fn inventory(&self, cluster: &str, id: SessionId, inventory: KernelInventory) {
        let Some(session) = self.sessions.get(cluster) else {
            return;
        };
        let mut session = lock(&session);
        if !session.current(id) {
            return;
        }
        let Some(new_kernels) = session.receive_inventory(inventory) else {
            return;
        };
        if !new_kernels {
            return;
        }
        self.recompute(cluster, &mut session);
        let touched = self.modules_counting(cluster, &session);
        drop(session);
        self.signals.bump_needs();
        self.signals.touched.add(touched);
    }

    /// A node status report (or a part of one) arrived on stream `id`.
    fn status(&self, cluster: &str, id: SessionId, part: NodeStatusReport) {
        let Some(session) = self.sessions.get(cluster) else {
            return;
        };
        let mut session = lock(&session);
        if !session.current(id) {
            return;
        }
        // Statuses of modules the hub does not know (no ManagedClusterModule, nothing
        // sent) mean nothing here: a proxy cannot make the hub keep them.
        let modules = self.index.stores.modules.state();
        let ClusterSession {
            outbox, statuses, ..
        } = &mut *session;
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
        let Applied {
            changed,
            full,
            intent_revision: acked,
        } = match statuses.receive(part, known) {
            Ok(Some(applied)) => applied,
            Ok(None) => return,
            Err(refused) => return refuse_report(cluster, &session, &refused),
        };
        session.statuses_known |= full;
        let acked = session.outbox.acknowledged(acked);
        let newly_acked = acked > session.acked_revision;
        session.acked_revision = session.acked_revision.max(acked);
        // Only a confirmed unload (the module leaves the snapshot: its statuses changed,
        // or the report is the first made with the unload applied) or a module the
        // snapshot does not carry yet (still loaded somewhere: it must be unloaded) can
        // change what the cluster must run.
        let snapshot_may_change = (newly_acked && session.outbox.unloads())
            || changed.iter().any(|(namespace, name)| {
                session
                    .carried_intent(namespace, name)
                    .is_none_or(|m| m.unload)
            });
        if snapshot_may_change {
            self.recompute(cluster, &mut session);
        }
        let mut touched: BTreeSet<String> = changed.into_iter().map(|(_, name)| name).collect();
        if newly_acked {
            // The statuses now reflect newer intents: a generation may have converged.
            touched.extend(session.carried().map(str::to_owned));
        }
        drop(session);
        self.signals.touched.add(touched);
    }

    /// A device plugin report arrived on stream `id`: the modules whose counts changed
    /// are reconciled (their status).
    fn device_plugins(&self, cluster: &str, id: SessionId, report: DevicePluginReport) {
        let Some(session) = self.sessions.get(cluster) else {
            return;
        };
        let mut session = lock(&session);
        if !session.current(id) {
            return;
        }
        let changed = session.receive_device_plugins(report);
        drop(session);
        if !changed.is_empty() {
            self.signals.touched.add(changed);
        }
    }
}

impl FleetView {
    /// Ends every stream (shutdown): proxies reconnect, to this hub or another replica.
    pub fn end_streams(&self, why: &str) {
        self.sessions.end_all(why);
    }

    /// A session opened or closed (under the cluster's lock): the gauge follows, and the
    /// modules counting the cluster are touched.
    fn connection_changed(&self, cluster: &str, session: &ClusterSession) {
        self.metrics
            .connected_clusters
            .set(gauge(self.sessions.open_count()));
        self.signals
            .touched
            .add(self.modules_counting(cluster, session));
    }

    /// The modules whose status counts `cluster`: those selecting it, and those its last
    /// snapshot carries.
    fn modules_counting(&self, cluster: &str, session: &ClusterSession) -> BTreeSet<String> {
        let view = self.index.cluster_view(cluster);
        let mut names = self.index.modules_selecting(view.as_ref());
        names.extend(session.carried().map(str::to_owned));
        names
    }
}

fn refuse_report(cluster: &str, session: &ClusterSession, refused: &TooManyStatuses) {
    tracing::warn!(cluster, error = %refused, "refused a node status report; ending the stream");
    if let Some((_, stream)) = &session.stream {
        stream.end(tonic::Code::ResourceExhausted, refused.to_string());
    }
}
