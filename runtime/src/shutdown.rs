//! Graceful shutdown: Kubernetes stops a pod with SIGTERM, a terminal with SIGINT.

use tokio::signal::unix::{SignalKind, signal as unix_signal};

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
