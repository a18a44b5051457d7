//! Graceful shutdown: Kubernetes stops a pod with SIGTERM, a terminal with SIGINT.
//!
//! Every binary stops the same way: one [`CancellationToken`] from [`on_signal`], which
//! each task (and each test, cancelling it itself) watches.

use tokio::signal::unix::{SignalKind, signal as unix_signal};
use tokio_util::sync::CancellationToken;

/// A token cancelled on the first SIGTERM or SIGINT. Must be called inside a runtime.
pub fn on_signal() -> CancellationToken {
    let token = CancellationToken::new();
    let cancel = token.clone();
    tokio::spawn(async move {
        signal().await;
        cancel.cancel();
    });
    token
}

/// Resolves on the first SIGTERM or SIGINT. If the handlers cannot be installed (which
/// only happens when the process is out of resources), it resolves at once so the
/// caller shuts down rather than running without a way to stop.
pub async fn signal() {
    let (Ok(mut term), Ok(mut int)) = (
        unix_signal(SignalKind::terminate()),
        unix_signal(SignalKind::interrupt()),
    ) else {
        tracing::error!("cannot install the SIGTERM/SIGINT handlers; shutting down");
        return;
    };
    tokio::select! {
        _ = term.recv() => tracing::info!("SIGTERM received; shutting down"),
        _ = int.recv() => tracing::info!("SIGINT received; shutting down"),
    }
}
