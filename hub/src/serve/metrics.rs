//! The hub's Prometheus metrics.

use std::time::Duration;

use kmm_api::RolloutCounts;
use kmm_runtime::http_server::ConnectionMetrics;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

/// Admission decisions, by outcome.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct AdmissionLabels {
    /// `allowed` or `refused`.
    pub decision: &'static str,
}

/// What the module controller's runs ended in.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ControllerLabels {
    /// `reconciled`, `reconcile_failed`, `object_not_found`, `watch_failed` or
    /// `controller_failed`.
    pub result: &'static str,
}

/// A module's clusters in one rollout state.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RolloutLabels {
    pub module: String,
    /// `succeeded`, `progressing`, `failed` or `to_apply`.
    pub state: &'static str,
}

/// What a proxy sent that broke a bound, by the bound's name.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct BoundLabels {
    /// `inventory_kernels`, `kernel_release`, `status_entries`, `status_bytes`,
    /// `report_deadline` or `device_plugin_module`.
    pub limit: &'static str,
}

/// Handles to every metric; clones share the values.
#[derive(Clone, Debug)]
pub struct Metrics {
    /// 1 while this replica holds the leader Lease (or runs without election), 0 while it
    /// stands by.
    pub leader: Gauge,
    pub admission_reviews: Family<AdmissionLabels, Counter>,
    pub admission_seconds: Histogram,
    pub connected_clusters: Gauge,
    pub snapshots_sent: Counter,
    pub streams_refused: Counter,
    pub streams_replaced: Counter,
    pub reconcile_errors: Counter,
    /// Every run of the module controller, by result: a broken watch shows here.
    pub controller_results: Family<ControllerLabels, Counter>,
    /// ManagedClusterModule status writes (server-side apply of `status`).
    pub status_writes: Counter,
    pub rollout_clusters: Family<RolloutLabels, Gauge>,
    /// The admission webhook's connections: open, refused over the cap, timed out.
    pub webhook_connections: ConnectionMetrics,
    /// The fleet UI's connections, live pages' event streams included.
    pub ui_connections: ConnectionMetrics,
    /// Proxy messages (or their entries) refused for breaking a bound.
    pub proxy_bounds: Family<BoundLabels, Counter>,
}

impl Default for Metrics {
    fn default() -> Self {
        Self {
            leader: Gauge::default(),
            admission_reviews: Family::default(),
            // 50 µs .. ~0.4 s: validation compiles the module's regexps.
            admission_seconds: Histogram::new(exponential_buckets(0.000_05, 2.0, 14)),
            connected_clusters: Gauge::default(),
            snapshots_sent: Counter::default(),
            streams_refused: Counter::default(),
            streams_replaced: Counter::default(),
            reconcile_errors: Counter::default(),
            controller_results: Family::default(),
            status_writes: Counter::default(),
            rollout_clusters: Family::default(),
            webhook_connections: ConnectionMetrics::default(),
            ui_connections: ConnectionMetrics::default(),
            proxy_bounds: Family::default(),
        }
    }
}

impl Metrics {
    pub fn observe_admission(&self, allowed: bool, took: Duration) {
        let decision = if allowed { "allowed" } else { "refused" };
        self.admission_reviews
            .get_or_create(&AdmissionLabels { decision })
            .inc();
        self.admission_seconds.observe(took.as_secs_f64());
    }

    pub fn observe_controller(&self, result: &'static str) {
        self.controller_results
            .get_or_create(&ControllerLabels { result })
            .inc();
    }

    /// A proxy's message broke `limit`: it was refused (or some of its entries dropped).
    pub fn bound_tripped(&self, limit: &'static str) {
        self.proxy_bounds
            .get_or_create(&BoundLabels { limit })
            .inc();
    }

    /// A module's clusters by rollout state, as its status says.
    pub fn observe_rollout(&self, module: &str, counts: &RolloutCounts) {
        for (state, value) in [
            ("succeeded", counts.succeeded),
            ("progressing", counts.progressing),
            ("failed", counts.failed),
            ("to_apply", counts.to_apply),
        ] {
            self.rollout_clusters
                .get_or_create(&RolloutLabels {
                    module: module.to_owned(),
                    state,
                })
                .set(i64::from(value));
        }
    }

    /// A module that is gone has no rollout.
    pub fn forget_rollout(&self, module: &str) {
        for state in ["succeeded", "progressing", "failed", "to_apply"] {
            self.rollout_clusters.remove(&RolloutLabels {
                module: module.to_owned(),
                state,
            });
        }
    }

    pub fn register(&self, registry: &mut Registry) {
        self.webhook_connections
            .register(registry.sub_registry_with_prefix(super::webhook::METRICS_PREFIX));
        self.ui_connections
            .register(registry.sub_registry_with_prefix(crate::fleet_ui::server::METRICS_PREFIX));
        registry.register(
            "kmm_hub_leader",
            "1 while this replica leads (reconciles, writes status, serves proxies), 0 while it stands by",
            self.leader.clone(),
        );
        registry.register(
            "kmm_hub_admission_reviews",
            "ManagedClusterModule admission reviews answered, by decision",
            self.admission_reviews.clone(),
        );
        registry.register(
            "kmm_hub_admission_duration_seconds",
            "Time to decide one admission review",
            self.admission_seconds.clone(),
        );
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
        registry.register(
            "kmm_hub_controller_results",
            "Runs of the ManagedClusterModule controller, by result (reconciled, reconcile_failed, object_not_found, watch_failed, controller_failed)",
            self.controller_results.clone(),
        );
        registry.register(
            "kmm_hub_status_writes",
            "ManagedClusterModule status writes",
            self.status_writes.clone(),
        );
        registry.register(
            "kmm_hub_rollout_clusters",
            "Selected clusters of each ManagedClusterModule, by rollout state (succeeded, progressing, failed, to_apply)",
            self.rollout_clusters.clone(),
        );
        registry.register(
            "kmm_hub_proxy_bounds_tripped",
            "Proxy messages refused, or entries dropped, for breaking a bound, by limit (inventory_kernels, kernel_release, status_entries, status_bytes, report_deadline, device_plugin_module)",
            self.proxy_bounds.clone(),
        );
    }
}
