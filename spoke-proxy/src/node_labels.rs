//! Applies the ready labels the shared state asks for, with JSON merge patches that
//! touch only the kmm.node.kubernetes.io keys of modules the proxy knows.

use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::api::core::v1::Node;
use kube::api::{Patch, PatchParams};
use kube::{Api, Client};
use serde_json::Value;
use tokio_util::sync::CancellationToken;

use crate::metrics::Metrics;
use crate::shared_state::SharedState;

/// Also retried on this period, so a failed patch is not forgotten until the next change.
const RESYNC: Duration = Duration::from_secs(15);

/// Runs until `cancel` fires.
pub async fn run(client: Client, state: SharedState, metrics: Metrics, cancel: CancellationToken) {
    let api: Api<Node> = Api::all(client);
    let mut changes = state.subscribe();
    let mut resync = tokio::time::interval(RESYNC);
    // What was last sent per node: the watch may not have delivered its effect yet, and
    // sending the same patch again before it does would only add load.
    let mut in_flight: BTreeMap<String, Value> = BTreeMap::new();
    loop {
        let resyncing = tokio::select! {
            () = cancel.cancelled() => return,
            _ = changes.changed() => false,
            _ = resync.tick() => true,
        };
        if resyncing {
            in_flight.clear();
        }
        let patches: Vec<(String, Value)> = state.read(|s| {
            s.node_names()
                .into_iter()
                .filter_map(|node| s.label_patch(&node).map(|p| (node, p)))
                .collect()
        });
        in_flight.retain(|node, _| patches.iter().any(|(n, _)| n == node));
        for (node, patch) in patches {
            if in_flight.get(&node) == Some(&patch) {
                continue;
            }
            match api
                .patch(&node, &PatchParams::default(), &Patch::Merge(&patch))
                .await
            {
                Ok(_) => {
                    metrics.label_patches.inc();
                    tracing::info!(node, labels = %patch["metadata"]["labels"], "node labels patched");
                    in_flight.insert(node, patch);
                }
                Err(error) => {
                    metrics.label_patch_errors.inc();
                    tracing::warn!(node, %error, "patching node labels failed; will retry");
                }
            }
        }
    }
}
