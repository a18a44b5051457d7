//! Watches the cluster's Nodes and feeds their facts into the shared state.

use futures::StreamExt;
use k8s_openapi::api::core::v1::Node;
use kube::runtime::WatchStreamExt;
use kube::runtime::watcher::{self, Event};
use kube::{Api, Client};
use tokio_util::sync::CancellationToken;

use crate::metrics::Metrics;
use crate::node_facts::NodeFacts;
use crate::shared_state::SharedState;

/// Runs until `cancel` fires.
pub async fn run(client: Client, state: SharedState, metrics: Metrics, cancel: CancellationToken) {
    let api: Api<Node> = Api::all(client);
    let mut events = watcher::watcher(api, watcher::Config::default())
        .default_backoff()
        .boxed();
    let mut listing: Vec<NodeFacts> = Vec::new();
    loop {
        let event = tokio::select! {
            () = cancel.cancelled() => return,
            event = events.next() => event,
        };
        match event {
            None => return,
            Some(Err(error)) => tracing::warn!(%error, "watching Nodes failed; retrying"),
            Some(Ok(Event::Init)) => listing.clear(),
            Some(Ok(Event::InitApply(node))) => listing.extend(NodeFacts::from_node(&node)),
            Some(Ok(Event::InitDone)) => {
                let nodes = std::mem::take(&mut listing);
                metrics.nodes.set(nodes.len() as i64);
                tracing::info!(nodes = nodes.len(), "Nodes listed");
                state.update(|s| s.replace_nodes(nodes));
            }
            Some(Ok(Event::Apply(node))) => {
                if let Some(facts) = NodeFacts::from_node(&node) {
                    state.update_if(|s| s.upsert_node(facts));
                }
                metrics.nodes.set(state.read(|s| s.node_count()) as i64);
            }
            Some(Ok(Event::Delete(node))) => {
                if let Some(name) = node.metadata.name {
                    state.update_if(|s| s.remove_node(&name));
                }
                metrics.nodes.set(state.read(|s| s.node_count()) as i64);
            }
        }
    }
}
