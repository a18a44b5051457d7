//! Keeps the shared state's cluster pull Secret (see [`cluster_pull_secret`]) as the API
//! has it, reading it by name on a period.
//!
//! Polled, not watched: the proxy's Role grants `get` on that one name only. `list` and
//! `watch` cannot be limited to a name the add-on's template renders from a variable: an
//! unset variable renders as an empty name, and an empty entry in `resourceNames` matches
//! a list of every Secret of the namespace.
//!
//! [`cluster_pull_secret`]: crate::cluster_pull_secret

use std::time::Duration;

use k8s_openapi::api::core::v1::Secret;
use kube::{Api, Client};
use tokio_util::sync::CancellationToken;

use crate::cluster_pull_secret::{ClusterPullSecret, SecretRef};
use crate::shared_state::SharedState;

/// How often the Secret is read by default.
pub const DEFAULT_POLL: Duration = Duration::from_secs(10);

/// Reads the Secret once into `state`: before the hub's first snapshot, so that loads
/// never go out without a credential the cluster has.
pub async fn read_once(client: &Client, state: &SharedState, secret: &SecretRef) {
    let api: Api<Secret> = Api::namespaced(client.clone(), &secret.namespace);
    let read = api.get_opt(&secret.name).await;
    let (before, next) = state.read(|s| {
        let before = s.cluster_pull_secret().clone();
        let next = match read {
            Ok(found) => ClusterPullSecret::read(secret, found.as_ref()),
            Err(error) => {
                tracing::debug!(%secret, %error, "reading the cluster pull Secret failed");
                before.read_failed(secret, error.to_string())
            }
        };
        (before, next)
    });
    if next != before {
        // The state's Display names the Secret and its problem, never its content.
        match &next {
            ClusterPullSecret::Unusable { .. } => {
                tracing::warn!(secret = %next, "cluster pull Secret")
            }
            _ => tracing::info!(secret = %next, "cluster pull Secret"),
        }
    }
    state.update_if(|s| s.set_cluster_pull_secret(next));
}

/// Reads the Secret every `every` until `cancel` fires.
pub async fn run(
    client: Client,
    state: SharedState,
    secret: SecretRef,
    every: Duration,
    cancel: CancellationToken,
) {
    let mut period = tokio::time::interval(every);
    period.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            () = cancel.cancelled() => return,
            _ = period.tick() => read_once(&client, &state, &secret).await,
        }
    }
}
