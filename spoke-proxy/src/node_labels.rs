//! Applies the ready labels the shared state asks for, with JSON merge patches that
//! touch only the kmm.node.kubernetes.io keys of modules the proxy knows.

use std::collections::BTreeMap;
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::Node;
use kube::api::{Patch, PatchParams};
use kube::{Api, Client};
use serde_json::Value;
use tokio_util::sync::CancellationToken;

use crate::metrics::Metrics;
use crate::shared_state::SharedState;

/// Also retried on this period, so a failed patch is not forgotten until the next change.
const RESYNC: Duration = Duration::from_secs(15);

/// Patches sent at once: the nodes of a rollout wave load together, and one patch after
/// the other made the last node's labels wait for all the others' round trips.
const PATCHES_AT_ONCE: usize = 16;

/// Runs until `cancel` fires.
pub async fn run(client: Client, state: SharedState, metrics: Metrics, cancel: CancellationToken) {
    let api: Api<Node> = Api::all(client);
    let mut changes = state.subscribe();
    let mut resync = tokio::time::interval(RESYNC);
    // What was last sent per node: the watch may not have delivered its effect yet, and
    // sending the same patch again before it does would only add load. Cleared on every
    // resync, which also retries failed patches.
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
        let patches: Vec<(String, Option<Value>)> = state.update_quietly(|s| {
            let dirty = s.take_label_dirty();
            let nodes = if resyncing {
                s.node_names()
            } else {
                dirty.into_iter().collect()
            };
            nodes
                .into_iter()
                .map(|node| {
                    let patch = s.label_patch(&node);
                    (node, patch)
                })
                .collect()
        });
        let to_send: Vec<(String, Value)> = patches
            .into_iter()
            .filter_map(|(node, patch)| match patch {
                None => {
                    in_flight.remove(&node);
                    None
                }
                Some(patch) if in_flight.get(&node) == Some(&patch) => None,
                Some(patch) => Some((node, patch)),
            })
            .collect();
        let api = &api;
        let mut sent = futures::stream::iter(to_send)
            .map(|(node, patch)| async move {
                let result = api
                    .patch(&node, &PatchParams::default(), &Patch::Merge(&patch))
                    .await;
                (node, patch, result)
            })
            .buffer_unordered(PATCHES_AT_ONCE);
        while let Some((node, patch, result)) = sent.next().await {
            match result {
                Ok(_) => {
                    metrics.label_patched.set_now();
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
