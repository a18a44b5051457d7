//! Why a reconciliation failed.

use thiserror::Error;

#[derive(Debug, Error)]
pub enum ReconcileError {
    #[error("ManagedClusterModule {name}: {action}: {source}")]
    Api {
        name: String,
        action: &'static str,
        source: kube::Error,
    },
    /// The module changed since the view the patch was made from (the apiserver refused
    /// its resourceVersion): the watch brings the newer object, and it is reconciled
    /// again.
    #[error("ManagedClusterModule {name}: {action}: the object changed meanwhile")]
    Stale { name: String, action: &'static str },
    #[error("ManagedClusterModule {name}: the Event {reason} cannot be recorded: {source}")]
    Event {
        name: String,
        reason: &'static str,
        source: kube::Error,
    },
}
