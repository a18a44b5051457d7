//! The proxy's Prometheus metrics.

use kmm_runtime::timestamp::TimestampGauge;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

/// Label of [`Metrics::agent_refusals`].
pub type ReasonLabel = Vec<(&'static str, &'static str)>;

/// Every metric; clones share the values.
#[derive(Clone, Debug, Default)]
pub struct Metrics {
    pub hub_connected: Gauge,
    pub hub_connects: Counter,
    pub hub_disconnects: Counter,
    pub hub_client_certificate_expiry: Gauge,
    pub intent_revision: Gauge,
    /// When intents (a snapshot or a delta) last arrived from the hub.
    pub intents_received: TimestampGauge,
    /// When a node's desired modules were last handed to its agent's stream.
    pub work_sent: TimestampGauge,
    /// When the apiserver last accepted a node label patch.
    pub label_patched: TimestampGauge,
    pub nodes: Gauge,
    pub agents_connected: Gauge,
    pub agent_refusals: Family<ReasonLabel, Counter>,
    pub agent_events: Counter,
    pub agent_events_refused: Counter,
    pub node_events: Counter,
    pub node_events_dropped: Counter,
    pub label_patches: Counter,
    pub label_patch_errors: Counter,
    pub token_reviews: Counter,
    pub token_review_cache_hits: Counter,
}

impl Metrics {
    pub fn register(&self, registry: &mut Registry) {
        let r = registry.sub_registry_with_prefix("kmm_spoke_proxy");
        r.register(
            "hub_connected",
            "1 while the stream to kmm-hub is open",
            self.hub_connected.clone(),
        );
        r.register(
            "hub_connects",
            "Streams to kmm-hub opened",
            self.hub_connects.clone(),
        );
        r.register(
            "hub_disconnects",
            "Streams to kmm-hub that ended or failed to open",
            self.hub_disconnects.clone(),
        );
        r.register(
            "hub_client_certificate_expiry_timestamp_seconds",
            "NotAfter of the client certificate for kmm-hub, in Unix seconds; read at every \
             (re)connect, so a renewal shows (0 until the credential files were first read)",
            self.hub_client_certificate_expiry.clone(),
        );
        r.register(
            "intent_revision",
            "Revision of the last IntentSnapshot applied",
            self.intent_revision.clone(),
        );
        r.register(
            "intents_last_received_timestamp_seconds",
            "When intents (a snapshot or a delta) last arrived from kmm-hub, in Unix seconds (0 until then)",
            self.intents_received.metric(),
        );
        r.register(
            "work_last_sent_timestamp_seconds",
            "When a node's desired modules were last handed to its agent's stream, in Unix seconds (0 until then)",
            self.work_sent.metric(),
        );
        r.register(
            "label_last_patched_timestamp_seconds",
            "When the API server last accepted a node label patch, in Unix seconds (0 until then)",
            self.label_patched.metric(),
        );
        r.register("nodes", "Nodes in the cluster", self.nodes.clone());
        r.register(
            "agents_connected",
            "Node agent streams open",
            self.agents_connected.clone(),
        );
        r.register(
            "agent_refusals",
            "Node agent streams refused, by reason",
            self.agent_refusals.clone(),
        );
        r.register(
            "agent_events",
            "Load and unload events received from node agents",
            self.agent_events.clone(),
        );
        r.register(
            "agent_events_refused",
            "Node agent events dropped for naming a module the proxy never sent the node",
            self.agent_events_refused.clone(),
        );
        r.register(
            "node_events",
            "Events recorded on Nodes for their agents' loads and unloads",
            self.node_events.clone(),
        );
        r.register(
            "node_events_dropped",
            "Node Events not recorded: the queue was full or the apiserver refused them",
            self.node_events_dropped.clone(),
        );
        r.register(
            "label_patches",
            "Node label patches applied",
            self.label_patches.clone(),
        );
        r.register(
            "label_patch_errors",
            "Node label patches that failed",
            self.label_patch_errors.clone(),
        );
        r.register(
            "token_reviews",
            "TokenReviews of agent tokens sent to the API server",
            self.token_reviews.clone(),
        );
        r.register(
            "token_review_cache_hits",
            "Agent attaches answered from the TokenReview cache",
            self.token_review_cache_hits.clone(),
        );
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, UNIX_EPOCH};

    use prometheus_client::encoding::text::encode;

    use super::*;

    #[test]
    fn the_moments_of_a_loads_hops_are_exposed_in_unix_seconds() {
        let metrics = Metrics::default();
        let mut registry = Registry::default();
        metrics.register(&mut registry);
        let at = UNIX_EPOCH + Duration::from_millis(1_733_000_000_500);
        metrics.intents_received.set(at);
        metrics.work_sent.set(at + Duration::from_millis(1));
        metrics.label_patched.set(at + Duration::from_millis(30));
        let mut text = String::new();
        encode(&mut text, &registry).unwrap();
        for line in [
            "kmm_spoke_proxy_intents_last_received_timestamp_seconds 1733000000.5",
            "kmm_spoke_proxy_work_last_sent_timestamp_seconds 1733000000.501",
            "kmm_spoke_proxy_label_last_patched_timestamp_seconds 1733000000.53",
        ] {
            assert!(
                text.lines().any(|l| l == line),
                "{line} missing in:\n{text}"
            );
        }
    }
}
