//! What keeps pages live: a page's script listens on `/events` and fetches the page again
//! on each event. Events are coalesced: however busy the fleet, a page is told at most
//! once per [`MIN_INTERVAL`], and a change is told within it.

use std::time::Duration;

use tokio::sync::watch;
use tokio::time::Instant;

use crate::serve::fleet_view::Changes;

use super::replica::Role;

/// Least time between two events of one stream: at most four fetches a second.
pub const MIN_INTERVAL: Duration = Duration::from_millis(250);

/// One page's following of the view: the replica's role, and the leader's changes.
#[derive(Debug)]
pub struct Live {
    role: watch::Receiver<Role>,
    changes: Option<Changes>,
    last: Option<Instant>,
}

impl Live {
    pub fn new(mut role: watch::Receiver<Role>) -> Self {
        let changes = changes_of(&role.borrow_and_update());
        Self {
            role,
            changes,
            last: None,
        }
    }

    /// Waits for the next change, then for [`MIN_INTERVAL`] to have passed since the
    /// previous event; what changed meanwhile is told by the same event. `false` once
    /// nothing can change any more (the hub stops).
    pub async fn next(&mut self) -> bool {
        let changed = match &mut self.changes {
            Some(changes) => tokio::select! {
                changed = changes.changed() => changed,
                changed = self.role.changed() => changed.is_ok(),
            },
            None => self.role.changed().await.is_ok(),
        };
        if !changed {
            return false;
        }
        if self.role.has_changed().unwrap_or(false) || self.changes.is_none() {
            self.changes = changes_of(&self.role.borrow_and_update());
        }
        if let Some(last) = self.last {
            tokio::time::sleep_until(last + MIN_INTERVAL).await;
        }
        // The page fetched on this event shows what changed while it waited.
        if let Some(changes) = &mut self.changes {
            changes.mark_seen();
        }
        self.last = Some(Instant::now());
        true
    }
}

fn changes_of(role: &Role) -> Option<Changes> {
    match role {
        Role::Standby => None,
        Role::Leading(view) => Some(view.changes()),
    }
}
