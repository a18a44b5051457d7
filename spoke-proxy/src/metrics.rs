//! The proxy's Prometheus metrics.

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
