//! The agent's main loop: reconcile on every new desired snapshot, retry failures
//! with backoff, resync periodically. It never acts before the first snapshot and
//! never unloads because the control plane went quiet. A new snapshot interrupts a pass
//! that waits for pulls, so its unloads never wait for them.

use std::time::Duration;

use tokio::time::Instant;

use crate::control::{EventSender, IntentReceiver};
use crate::desired::DesiredSnapshot;
use crate::reconcile::Reconciler;

/// Timing of the loop.
#[derive(Clone, Copy, Debug)]
pub struct LoopTiming {
    /// First retry delay after a failure; doubles up to `retry_max`.
    pub retry_initial: Duration,
    pub retry_max: Duration,
    /// Reconcile this often anyway (a module removed behind the agent's back is
    /// loaded again).
    pub resync: Duration,
}

impl Default for LoopTiming {
    fn default() -> Self {
        Self {
            retry_initial: Duration::from_secs(2),
            retry_max: Duration::from_secs(120),
            resync: Duration::from_secs(60),
        }
    }
}

/// Runs until the task is dropped (SIGTERM handling is the caller's: dropping this
/// future never unloads anything).
pub async fn run(
    mut reconciler: Reconciler,
    mut intents: IntentReceiver,
    events: EventSender,
    timing: LoopTiming,
) {
    let mut desired: Option<DesiredSnapshot> = intents.borrow_and_update().clone();
    // Set when a snapshot arrives, cleared after its first pass.
    let mut fresh = desired.is_some();
    let mut intents_open = true;
    let mut backoff = timing.retry_initial;
    loop {
        let mut next = Instant::now() + timing.resync;
        if let Some(snapshot) = &desired {
            if std::mem::take(&mut fresh) {
                for event in reconciler.confirm_already_unloaded(snapshot) {
                    let _ = events.send(event);
                }
            }
            let mut failed = false;
            let complete = reconciler
                .reconcile_until(
                    snapshot,
                    new_intents(&mut intents, &mut intents_open),
                    |event| {
                        failed |= !event.is_success();
                        let _ = events.send(event);
                    },
                )
                .await;
            if !complete {
                // A new snapshot came while loads waited for their pulls: its unloads
                // go now, the pulls go on.
                desired = intents.borrow_and_update().clone();
                fresh = desired.is_some();
                backoff = timing.retry_initial;
                continue;
            }
            if failed {
                next = Instant::now() + backoff;
                backoff = (backoff * 2).min(timing.retry_max);
            } else {
                backoff = timing.retry_initial;
            }
        }
        tokio::select! {
            changed = intents.changed(), if intents_open => {
                match changed {
                    Ok(()) => {
                        desired = intents.borrow_and_update().clone();
                        fresh = desired.is_some();
                        backoff = timing.retry_initial;
                    }
                    // The control plane is gone: keep the last intent in force.
                    Err(_) => intents_open = false,
                }
            }
            () = tokio::time::sleep_until(next) => {}
        }
    }
}

/// Completes when the control plane sends a new snapshot; never once it has gone.
async fn new_intents(intents: &mut IntentReceiver, open: &mut bool) {
    if *open {
        if intents.changed().await.is_ok() {
            return;
        }
        *open = false;
    }
    std::future::pending().await
}
