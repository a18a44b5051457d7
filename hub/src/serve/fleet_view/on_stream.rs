//! The proxies' streams as they reach the fleet view: sessions opening and closing, and
//! what each reports. This is the whole of what the gRPC service may do with the view
//! ([`ClusterStreams`]).
//!
//! What a proxy sends is bounded (see `fleet::inventory` and `fleet::node_statuses`):
//! an inventory or a status report breaking a bound is refused and the stream ended with
//! `RESOURCE_EXHAUSTED` (or `INVALID_ARGUMENT`), naming the cluster, field and limit, so
//! that the proxy's next stream starts over with a complete report (the hub throttles how
//! often a cluster may reconnect). Entries naming modules the hub never sent the cluster
//! (node statuses, device plugin counts) are dropped instead: a proxy may report a module
//! deleted a moment ago. Every refusal counts in `kmm_hub_proxy_bounds_tripped`; no other
//! cluster's session is touched.

use std::collections::BTreeSet;
use std::sync::Arc;

use kmm_api::ManagedClusterModule;
use kmm_proto::v1::{DevicePluginReport, KernelInventory, NodeStatusReport, SpokeImageReport};
use tokio::sync::watch;

use crate::fleet::node_statuses::{Applied, Arrival};
use crate::fleet::outbox::{Held, Outbox};
use crate::fleet::spoke_answers::spoke_answers;
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
    fn open_session(&self, cluster: &str, held: Held, outbound: OutboundSender) -> SessionId {
        let id = self.sessions.next_id();
        let session = self.sessions.get_or_new(cluster);
        let mut session = lock(&session);
        if let Some(old) = session.start(id, held, outbound) {
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
        let new_kernels = match session.receive_inventory(inventory) {
            Ok(Some(new_kernels)) => new_kernels,
            Ok(None) => return,
            Err(refused) => {
                return self.refuse(
                    cluster,
                    &session,
                    tonic::Code::InvalidArgument,
                    refused.limit(),
                    &refused,
                );
            }
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
        let known_modules = known_modules(&modules, outbox);
        let known = |namespace: &str, name: &str| known_modules.contains(&(namespace, name));
        let Applied {
            changed,
            full,
            intent_revision: acked,
        } = match statuses.receive(part, known, Arrival::now()) {
            Ok(Some(applied)) => applied,
            Ok(None) => return,
            Err(refused) => {
                return self.refuse(
                    cluster,
                    &session,
                    tonic::Code::ResourceExhausted,
                    refused.limit(),
                    &refused,
                );
            }
        };
        session.statuses_known |= full;
        let acked = session.outbox.acknowledged(acked);
        let newly_acked = acked > session.acked_revision;
        session.acked_revision = session.acked_revision.max(acked);
        // Only a confirmed unload (the module leaves the snapshot: its statuses changed,
        // or the report is the first made with the unload applied) or a module the
        // snapshot does not carry but some node may still run (it must be unloaded) can
        // change what the cluster must run. The recompute task does it: the reports of a
        // fleet-wide deletion come faster than clusters are recomputed, and a cluster
        // reporting again meanwhile costs one recompute, not one per report.
        let snapshot_may_change = (newly_acked && session.outbox.unloads())
            || changed.iter().any(|(namespace, name)| {
                match session.carried_intent(namespace, name) {
                    Some(intent) => intent.unload,
                    None => session.statuses.lingers(namespace, name),
                }
            });
        if snapshot_may_change {
            self.signals.stale.add([cluster.to_owned()]);
        }
        let mut touched: BTreeSet<String> = changed
            .into_iter()
            .map(|(_, name)| name.into_string())
            .collect();
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
        let modules = self.index.stores.modules.state();
        // Owned: the session is changed while they are looked up (device plugin reports
        // are rare, a copy of a few names each).
        let known_modules: BTreeSet<(String, String)> = known_modules(&modules, &session.outbox)
            .into_iter()
            .map(|(namespace, name)| (namespace.to_owned(), name.to_owned()))
            .collect();
        let known = |namespace: &str, name: &str| {
            known_modules.contains(&(namespace.to_owned(), name.to_owned()))
        };
        let (changed, unknown) = session.receive_device_plugins(report, known);
        drop(session);
        if unknown > 0 {
            tracing::warn!(
                cluster,
                unknown,
                "dropped device plugin counts (DevicePluginReport.plugins[].module) of modules the hub never sent the cluster"
            );
            self.metrics.bound_tripped("device_plugin_module");
        }
        if !changed.is_empty() {
            self.signals.touched.add(changed);
        }
    }

    /// The cluster's answers for the images it was asked to resolve: each new pin (or
    /// failure) changes what the cluster gets, and the module's status.
    fn spoke_images(&self, cluster: &str, id: SessionId, report: SpokeImageReport) {
        let Some(session) = self.sessions.get(cluster) else {
            return;
        };
        let mut session = lock(&session);
        if !session.current(id) {
            return;
        }
        let (answers, dropped) = spoke_answers(report);
        if dropped > 0 {
            tracing::warn!(
                cluster,
                dropped,
                "dropped answers (SpokeImageReport.images[]) beyond the limit or without a module, an image or a valid digest"
            );
            self.metrics.bound_tripped("spoke_image");
        }
        let changed = self.images.answer(cluster, answers);
        if changed.is_empty() {
            return;
        }
        tracing::info!(cluster, modules = ?changed, "the cluster resolved images");
        self.recompute(cluster, &mut session);
        drop(session);
        self.signals.touched.add(changed);
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

impl FleetView {
    /// Ends the cluster's stream for a message that broke `limit`.
    fn refuse(
        &self,
        cluster: &str,
        session: &ClusterSession,
        code: tonic::Code,
        limit: &'static str,
        refused: &dyn std::error::Error,
    ) {
        tracing::warn!(cluster, limit, error = %refused, "refused a proxy's message; ending its stream");
        self.metrics.bound_tripped(limit);
        if let Some((_, stream)) = &session.stream {
            stream.end(code, format!("cluster {cluster}: {refused}"));
        }
    }
}

/// The modules whose entries a cluster's reports may carry, as (namespace, name): every
/// ManagedClusterModule, and whatever the cluster's last snapshot carries.
fn known_modules<'a>(
    modules: &'a [Arc<ManagedClusterModule>],
    outbox: &'a Outbox,
) -> BTreeSet<(&'a str, &'a str)> {
    let mut known: BTreeSet<(&str, &str)> = modules
        .iter()
        .filter_map(|m| Some((m.spec.spoke_namespace.as_str(), m.metadata.name.as_deref()?)))
        .collect();
    if let Some(sent) = outbox.last() {
        known.extend(
            sent.modules
                .iter()
                .filter_map(|m| m.key.as_ref())
                .map(|k| (k.namespace.as_str(), k.name.as_str())),
        );
    }
    known
}
