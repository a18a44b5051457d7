//! When the agent reports ready on `/readyz`: it has acted on a desired snapshot and,
//! with a proxy, its stream is up. Also keeps the modules-loaded gauge current.

use kmm_runtime::health::Health;
use tokio::sync::watch;

use crate::control::Progress;
use crate::metrics::Metrics;

/// Pure rule: `connected` is `None` when there is no proxy (`--desired-file`).
pub fn is_ready(applied_revision: Option<u64>, connected: Option<bool>) -> bool {
    applied_revision.is_some() && connected.unwrap_or(true)
}

/// Follows the reconciler's progress and the connection state until both senders are
/// gone.
pub async fn track(
    mut progress: watch::Receiver<Progress>,
    mut connected: Option<watch::Receiver<bool>>,
    health: Health,
    metrics: Metrics,
) {
    loop {
        let (applied, loaded) = {
            let p = progress.borrow_and_update();
            (p.applied_revision, p.loaded.len())
        };
        let up = connected.as_mut().map(|c| *c.borrow_and_update());
        metrics.set_modules_loaded(loaded);
        if let Some(up) = up {
            metrics.set_connected(up);
        }
        health.set_ready(is_ready(applied, up));
        let connection_changed = async {
            match connected.as_mut() {
                Some(c) => c.changed().await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            changed = progress.changed() => if changed.is_err() { return },
            changed = connection_changed => if changed.is_err() { return },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ready_once_applied_and_connected() {
        assert!(!is_ready(None, None));
        assert!(is_ready(Some(0), None));
        assert!(!is_ready(None, Some(true)));
        assert!(!is_ready(Some(3), Some(false)));
        assert!(is_ready(Some(3), Some(true)));
    }
}
