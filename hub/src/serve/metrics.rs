//! The hub's Prometheus metrics.

use std::time::Duration;

use kmm_api::ManagedClusterModuleStatus;
use kmm_runtime::http_server::ConnectionMetrics;
use kmm_runtime::timestamp::TimestampGauge;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;
use tokio::sync::watch;

use super::fleet_view::Connections;
use crate::fleet::rollout::HALTED;
use crate::images::ImageState;

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

/// A module's nodes, clusters or images in one state. Per module rather than per cluster:
/// a fleet has a handful of modules but thousands of clusters.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ModuleStateLabels {
    pub module: String,
    pub state: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ModuleLabels {
    pub module: String,
}

/// One of the hub's certificates.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct CertificateLabels {
    /// `ca`, `grpc` or `webhook`.
    pub certificate: &'static str,
}

const NODE_STATES: [&str; 4] = ["loaded", "pending", "failed", "skipped"];
const CLUSTER_STATES: [&str; 4] = ["selected", "connected", "converged", "held"];

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
    /// Streams whose proxy held its cluster's snapshot already (its hello's digest), so
    /// that none was sent.
    pub snapshots_resumed: Counter,
    /// When the modules' watch last delivered a change (create, edit, delete) to the
    /// fleet view, which recomputes the clusters' intents from it.
    pub module_change_received: TimestampGauge,
    /// When a cluster's intents (a snapshot or a delta) were last handed to its stream.
    pub intents_sent: TimestampGauge,
    pub streams_refused: Counter,
    pub streams_replaced: Counter,
    pub reconcile_errors: Counter,
    /// Every run of the module controller, by result: a broken watch shows here.
    pub controller_results: Family<ControllerLabels, Counter>,
    /// ManagedClusterModule status writes (server-side apply of `status`).
    pub status_writes: Counter,
    pub rollout_clusters: Family<RolloutLabels, Gauge>,
    /// 1 while a module's rollout is halted (too many failed clusters), else 0.
    pub rollout_halted: Family<ModuleLabels, Gauge>,
    /// Each module's matching nodes by state, as its status counts them.
    pub module_nodes: Family<ModuleStateLabels, Gauge>,
    /// Each module's clusters by state, as its status counts them.
    pub module_clusters: Family<ModuleStateLabels, Gauge>,
    /// Each module's images (as listed in status) by lifecycle state.
    pub module_images: Family<ModuleStateLabels, Gauge>,
    /// Clusters whose proxy connected to this hub and has no stream now.
    pub disconnected_clusters: Gauge,
    /// When the longest-disconnected of them lost its stream (Unix seconds); 0 when none.
    pub oldest_disconnection: Gauge,
    /// NotAfter of the hub's CA and serving certificates, in Unix seconds.
    pub certificate_expiry: Family<CertificateLabels, Gauge>,
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
            snapshots_resumed: Counter::default(),
            module_change_received: TimestampGauge::default(),
            intents_sent: TimestampGauge::default(),
            streams_refused: Counter::default(),
            streams_replaced: Counter::default(),
            reconcile_errors: Counter::default(),
            controller_results: Family::default(),
            status_writes: Counter::default(),
            rollout_clusters: Family::default(),
            rollout_halted: Family::default(),
            module_nodes: Family::default(),
            module_clusters: Family::default(),
            module_images: Family::default(),
            disconnected_clusters: Gauge::default(),
            oldest_disconnection: Gauge::default(),
            certificate_expiry: Family::default(),
            webhook_connections: ConnectionMetrics::default(),
            ui_connections: ConnectionMetrics::default(),
            proxy_bounds: Family::default(),
        }
    }
}

/// Keeps the disconnection gauges following the sessions as they open and close.
pub async fn follow_connections(mut connections: watch::Receiver<Connections>, metrics: Metrics) {
    loop {
        metrics.observe_connections(&connections.borrow_and_update());
        if connections.changed().await.is_err() {
            return;
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

    /// A module's nodes, clusters, images and rollout, as the status about to be written
    /// says. Every state is set, zeros included, so that a count dropping to zero shows.
    pub fn observe_module(&self, module: &str, status: &ManagedClusterModuleStatus) {
        let nodes = &status.nodes;
        let pending = nodes.matching - nodes.loaded - nodes.failed;
        for (state, value) in
            NODE_STATES
                .into_iter()
                .zip([nodes.loaded, pending.max(0), nodes.failed, nodes.skipped])
        {
            set(&self.module_nodes, module, state, value);
        }
        let clusters = &status.clusters;
        for (state, value) in CLUSTER_STATES.into_iter().zip([
            clusters.selected,
            clusters.connected,
            clusters.converged,
            clusters.held,
        ]) {
            set(&self.module_clusters, module, state, value);
        }
        for state in ImageState::ALL.map(ImageState::as_str) {
            let count = status.images.iter().filter(|i| i.state == state).count();
            set(
                &self.module_images,
                module,
                state,
                i32::try_from(count).unwrap_or(i32::MAX),
            );
        }
        let Some(rollout) = &status.rollout else {
            return;
        };
        let counts = &rollout.counts;
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
        self.rollout_halted
            .get_or_create(&ModuleLabels {
                module: module.to_owned(),
            })
            .set(i64::from(rollout.state == HALTED));
    }

    /// A module that is gone has no series left.
    pub fn forget_module(&self, module: &str) {
        for state in ["succeeded", "progressing", "failed", "to_apply"] {
            self.rollout_clusters.remove(&RolloutLabels {
                module: module.to_owned(),
                state,
            });
        }
        self.rollout_halted.remove(&ModuleLabels {
            module: module.to_owned(),
        });
        let forget = |family: &Family<ModuleStateLabels, Gauge>, states: &[&'static str]| {
            for &state in states {
                family.remove(&ModuleStateLabels {
                    module: module.to_owned(),
                    state,
                });
            }
        };
        forget(&self.module_nodes, &NODE_STATES);
        forget(&self.module_clusters, &CLUSTER_STATES);
        forget(
            &self.module_images,
            &ImageState::ALL.map(ImageState::as_str),
        );
    }

    /// The clusters that connected and lost their stream: how many, and since when the
    /// longest-lost one. Only clusters seen since this hub started count: one that never
    /// connected shows in its modules' `kmm_hub_module_clusters` (selected > connected).
    pub fn observe_connections(&self, connections: &Connections) {
        self.disconnected_clusters
            .set(i64::try_from(connections.closed_at.len()).unwrap_or(i64::MAX));
        let oldest = connections
            .closed_at
            .values()
            .map(|t| t.0.as_second())
            .min()
            .unwrap_or(0);
        self.oldest_disconnection.set(oldest);
    }

    /// The gauge of one certificate's NotAfter (Unix seconds); whoever renews it sets it.
    pub fn certificate_expiry(&self, certificate: &'static str) -> Gauge {
        self.certificate_expiry
            .get_or_create(&CertificateLabels { certificate })
            .clone()
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
            "kmm_hub_intent_snapshots_resumed",
            "Streams opened by a spoke proxy that held its cluster's intents already, so that no snapshot was sent",
            self.snapshots_resumed.clone(),
        );
        registry.register(
            "kmm_hub_module_change_last_received_timestamp_seconds",
            "When the ManagedClusterModule watch last delivered a change (a create, an edit or a delete) to the reconciliation of the clusters' intents, in Unix seconds (0 until then)",
            self.module_change_received.metric(),
        );
        registry.register(
            "kmm_hub_intents_last_sent_timestamp_seconds",
            "When a cluster's intents (a snapshot or a delta) were last handed to its proxy's stream, in Unix seconds (0 until then)",
            self.intents_sent.metric(),
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
            "kmm_hub_rollout_halted",
            "1 while the ManagedClusterModule's rollout is halted (more failed clusters than it tolerates), else 0",
            self.rollout_halted.clone(),
        );
        registry.register(
            "kmm_hub_module_nodes",
            "Nodes of each ManagedClusterModule, by state (loaded, pending, failed, skipped), as its status counts them",
            self.module_nodes.clone(),
        );
        registry.register(
            "kmm_hub_module_clusters",
            "Clusters of each ManagedClusterModule, by state (selected, connected, converged, held), as its status counts them",
            self.module_clusters.clone(),
        );
        registry.register(
            "kmm_hub_module_images",
            "Images of each ManagedClusterModule listed in its status, by state (Exists, NeedsBuild, NeedsSign, Building, Signing, Failed, NotFound, SpokeResolved)",
            self.module_images.clone(),
        );
        registry.register(
            "kmm_hub_disconnected_clusters",
            "Clusters whose spoke proxy connected to this hub since it started and has no stream now",
            self.disconnected_clusters.clone(),
        );
        registry.register(
            "kmm_hub_oldest_disconnection_timestamp_seconds",
            "When the longest-disconnected cluster's proxy lost its stream, in Unix seconds (0 when none is disconnected)",
            self.oldest_disconnection.clone(),
        );
        registry.register(
            "kmm_hub_certificate_expiry_timestamp_seconds",
            "NotAfter of the hub's certificates, in Unix seconds, by certificate (ca, grpc, webhook)",
            self.certificate_expiry.clone(),
        );
        registry.register(
            "kmm_hub_proxy_bounds_tripped",
            "Proxy messages refused, or entries dropped, for breaking a bound, by limit (inventory_kernels, kernel_release, status_entries, status_bytes, report_deadline, device_plugin_module)",
            self.proxy_bounds.clone(),
        );
    }
}

fn set(family: &Family<ModuleStateLabels, Gauge>, module: &str, state: &'static str, value: i32) {
    family
        .get_or_create(&ModuleStateLabels {
            module: module.to_owned(),
            state,
        })
        .set(i64::from(value));
}

#[cfg(test)]
mod tests {
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
    use k8s_openapi::jiff::Timestamp;
    use kmm_api::{ClusterCounts, ImageStatus, NodeCounts, RolloutCounts, RolloutStatus};
    use prometheus_client::encoding::text::encode;

    use super::*;

    fn text(metrics: &Metrics) -> String {
        let mut registry = Registry::default();
        metrics.register(&mut registry);
        let mut text = String::new();
        encode(&mut text, &registry).unwrap();
        text
    }

    fn image(state: &str) -> ImageStatus {
        ImageStatus {
            state: state.into(),
            ..ImageStatus::default()
        }
    }

    #[test]
    fn a_module_status_shows_per_state_and_goes_with_the_module() {
        let metrics = Metrics::default();
        let status = ManagedClusterModuleStatus {
            nodes: NodeCounts {
                matching: 10,
                loaded: 6,
                failed: 1,
                skipped: 2,
            },
            clusters: ClusterCounts {
                selected: 3,
                connected: 2,
                converged: 1,
                held: 1,
            },
            images: vec![image("Exists"), image("Failed"), image("Exists")],
            rollout: Some(RolloutStatus {
                state: HALTED.into(),
                counts: RolloutCounts {
                    failed: 2,
                    ..RolloutCounts::default()
                },
                ..RolloutStatus::default()
            }),
            ..ManagedClusterModuleStatus::default()
        };
        metrics.observe_module("kmod-a", &status);
        let shown = text(&metrics);
        for line in [
            r#"kmm_hub_module_nodes{module="kmod-a",state="loaded"} 6"#,
            r#"kmm_hub_module_nodes{module="kmod-a",state="pending"} 3"#,
            r#"kmm_hub_module_nodes{module="kmod-a",state="failed"} 1"#,
            r#"kmm_hub_module_nodes{module="kmod-a",state="skipped"} 2"#,
            r#"kmm_hub_module_clusters{module="kmod-a",state="connected"} 2"#,
            r#"kmm_hub_module_clusters{module="kmod-a",state="held"} 1"#,
            r#"kmm_hub_module_images{module="kmod-a",state="Exists"} 2"#,
            r#"kmm_hub_module_images{module="kmod-a",state="Failed"} 1"#,
            r#"kmm_hub_module_images{module="kmod-a",state="NotFound"} 0"#,
            r#"kmm_hub_rollout_halted{module="kmod-a"} 1"#,
            r#"kmm_hub_rollout_clusters{module="kmod-a",state="failed"} 2"#,
        ] {
            assert!(
                shown.lines().any(|l| l == line),
                "{line} missing in:\n{shown}"
            );
        }

        metrics.forget_module("kmod-a");
        let shown = text(&metrics);
        assert!(!shown.contains("kmod-a"), "{shown}");
    }

    #[test]
    fn disconnections_count_and_date_the_oldest() {
        let metrics = Metrics::default();
        let mut connections = Connections::default();
        metrics.observe_connections(&connections);
        assert_eq!(metrics.disconnected_clusters.get(), 0);
        assert_eq!(metrics.oldest_disconnection.get(), 0);

        connections.open.insert("c".into());
        for (cluster, at) in [("a", 2_000), ("b", 1_000)] {
            connections
                .closed_at
                .insert(cluster.into(), Time(Timestamp::from_second(at).unwrap()));
        }
        metrics.observe_connections(&connections);
        assert_eq!(metrics.disconnected_clusters.get(), 2);
        assert_eq!(metrics.oldest_disconnection.get(), 1_000);
    }

    #[test]
    fn certificate_expiry_gauges_share_their_value() {
        let metrics = Metrics::default();
        metrics.certificate_expiry("grpc").set(42);
        let shown = text(&metrics);
        assert!(
            shown
                .lines()
                .any(|l| l
                    == r#"kmm_hub_certificate_expiry_timestamp_seconds{certificate="grpc"} 42"#),
            "{shown}"
        );
    }

    #[test]
    fn the_moments_of_a_loads_hops_are_exposed_in_unix_seconds() {
        let metrics = Metrics::default();
        let shown = text(&metrics);
        for name in [
            "kmm_hub_module_change_last_received_timestamp_seconds",
            "kmm_hub_intents_last_sent_timestamp_seconds",
        ] {
            assert!(
                shown.lines().any(|l| l == format!("{name} 0.0")),
                "{name} at 0 until set, in:\n{shown}"
            );
        }
        let at = std::time::UNIX_EPOCH + Duration::from_millis(1_733_000_000_250);
        metrics.module_change_received.set(at);
        metrics.intents_sent.set(at + Duration::from_millis(20));
        let shown = text(&metrics);
        for line in [
            "kmm_hub_module_change_last_received_timestamp_seconds 1733000000.25",
            "kmm_hub_intents_last_sent_timestamp_seconds 1733000000.27",
        ] {
            assert!(
                shown.lines().any(|l| l == line),
                "{line} missing in:\n{shown}"
            );
        }
    }
}
