//! How long a module has been deleted, on this hub's own monotonic clock: from when this
//! hub first saw its deletion, never from the apiserver's `deletionTimestamp`, so that a
//! clock skew between the two cannot release a finalizer early. A new leader starts
//! counting afresh: a failover can make an unload wait longer, never shorter.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

#[derive(Debug, Default)]
pub struct DeletionClock {
    first_seen: Mutex<HashMap<String, Instant>>,
}

impl DeletionClock {
    /// Time since the deletion of module `uid` was first seen (zero the first time).
    pub fn elapsed(&self, uid: &str, now: Instant) -> Duration {
        let mut seen = self
            .first_seen
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        now.saturating_duration_since(*seen.entry(uid.to_owned()).or_insert(now))
    }

    /// The module is gone: its deletion need not be remembered.
    pub fn forget(&self, uid: &str) {
        self.first_seen
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .remove(uid);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_deletion_counts_from_when_it_was_first_seen() {
        let clock = DeletionClock::default();
        let start = Instant::now();
        assert_eq!(clock.elapsed("a", start), Duration::ZERO);
        let later = start + Duration::from_secs(30);
        assert_eq!(clock.elapsed("a", later), Duration::from_secs(30));
        assert_eq!(
            clock.elapsed("b", later),
            Duration::ZERO,
            "each module its own"
        );
        clock.forget("a");
        assert_eq!(clock.elapsed("a", later), Duration::ZERO, "counted afresh");
    }
}
