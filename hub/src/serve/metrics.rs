//! The hub's Prometheus metrics.

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

/// Handles to every metric; clones share the values.
#[derive(Clone, Debug, Default)]
pub struct Metrics {
    pub connected_clusters: Gauge,
    pub snapshots_sent: Counter,
    pub streams_refused: Counter,
    pub streams_replaced: Counter,
    pub reconcile_errors: Counter,
}

impl Metrics {
    pub fn register(&self, registry: &mut Registry) {
        registry.register(
            "kmm_hub_connected_clusters",
            "Managed clusters whose spoke proxy has a live stream",
            self.connected_clusters.clone(),
        );
        registry.register(
            "kmm_hub_intent_snapshots_sent",
            "Intent snapshots sent to spoke proxies",
            self.snapshots_sent.clone(),
        );
        registry.register(
            "kmm_hub_streams_refused",
            "Proxy streams refused (bad identity or protocol)",
            self.streams_refused.clone(),
        );
        registry.register(
            "kmm_hub_streams_replaced",
            "Proxy streams ended because a newer stream of the same cluster arrived",
            self.streams_replaced.clone(),
        );
        registry.register(
            "kmm_hub_reconcile_errors",
            "ManagedClusterModule reconciliations that failed",
            self.reconcile_errors.clone(),
        );
    }
}
