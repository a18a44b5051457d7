//! The cluster state shared by the proxy's tasks, with a change signal: every task that
//! reacts to changes (hub link, agent streams, label patcher) waits on it and reads what
//! it needs, so bursts of changes coalesce.

use std::sync::{Arc, Mutex, MutexGuard};

use tokio::sync::watch;

use crate::cluster_state::ClusterState;

/// See the module documentation. Clones share the state.
#[derive(Clone, Debug)]
pub struct SharedState {
    state: Arc<Mutex<ClusterState>>,
    changed: watch::Sender<u64>,
}

impl SharedState {
    pub fn new(state: ClusterState) -> Self {
        Self {
            state: Arc::new(Mutex::new(state)),
            changed: watch::Sender::new(0),
        }
    }

    fn lock(&self) -> MutexGuard<'_, ClusterState> {
        // A panic while holding the lock leaves a consistent value (every mutation is a
        // single call on ClusterState), so poisoning is not a reason to stop.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Changes the state and wakes every subscriber.
    pub fn update<R>(&self, f: impl FnOnce(&mut ClusterState) -> R) -> R {
        let result = f(&mut self.lock());
        self.changed.send_modify(|n| *n = n.wrapping_add(1));
        result
    }

    /// Changes the state and wakes the subscribers only if `f` says something changed.
    pub fn update_if(&self, f: impl FnOnce(&mut ClusterState) -> bool) {
        if f(&mut self.lock()) {
            self.changed.send_modify(|n| *n = n.wrapping_add(1));
        }
    }

    /// Changes bookkeeping that nobody waits for (taking dirty-node sets), without
    /// waking anyone.
    pub fn update_quietly<R>(&self, f: impl FnOnce(&mut ClusterState) -> R) -> R {
        f(&mut self.lock())
    }

    pub fn read<R>(&self, f: impl FnOnce(&ClusterState) -> R) -> R {
        f(&self.lock())
    }

    /// A receiver that sees every later change (and the current one as already seen).
    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.changed.subscribe()
    }
}
