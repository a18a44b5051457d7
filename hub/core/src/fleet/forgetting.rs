//! When a snapshot that only forgets unloads already done goes out. A module whose unload
//! a cluster confirmed leaves its snapshot once the cluster is no longer selected, or once
//! the hub released the deleted module; deleting twenty modules then sent every cluster
//! one snapshot per release (ten or more a cluster, each decoded, applied and acknowledged
//! by its proxy), though forgetting an unload changes nothing any node does. Such a snapshot waits while the cluster still
//! unloads other modules, and goes with the last of them, or after [`FORGET_BOUND`] at the
//! latest: a stuck unload holds the others' forgetting no longer. Pure.

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::outbox::Outbox;
use super::shared_snapshot::SharedSnapshot;

/// Longest a snapshot that only forgets waits. The recompute task's timer for clusters
/// waiting for image checks wakes it (`images::awaited_checks::AWAIT_BOUND`): one bound
/// serves both.
pub const FORGET_BOUND: Duration = crate::images::awaited_checks::AWAIT_BOUND;

/// Whether `next` only forgets modules whose unload the last snapshot sent carries, while
/// it still unloads others: every intent it carries is the one the stream was sent, it
/// carries fewer, and every one it leaves out was an unload. A stream that has not got the
/// last snapshot yet (a reconnect) is sent `next` whatever it holds.
pub fn only_forgets(outbox: &Outbox, next: &SharedSnapshot) -> bool {
    let Some(last) = outbox.last().filter(|_| outbox.delivered()) else {
        return false;
    };
    let unloads = |s: &SharedSnapshot| s.modules.iter().filter(|m| m.unload).count();
    // The counts first: most recomputes change nothing, or add.
    next.modules.len() < last.modules.len()
        && unloads(next) > 0
        // What it leaves out are unloads: as many loads as before.
        && next.modules.len() - unloads(next) == last.modules.len() - unloads(last)
        && next.modules.iter().all(|intent| {
            intent.key.as_ref().is_some_and(|key| {
                outbox.carried(&key.namespace, &key.name).is_some_and(|sent| {
                    std::ptr::eq(sent.intent, Arc::as_ptr(intent)) || sent.intent == &**intent
                })
            })
        })
        && next
            .credentials
            .iter()
            .all(|credential| last.credentials.contains(credential))
}

/// Since when a cluster holds back a snapshot that only forgets.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HeldForgetting {
    since: Option<Instant>,
}

impl HeldForgetting {
    /// A snapshot that only forgets was computed at `now`: whether it waits (within
    /// [`FORGET_BOUND`] of the first one held back).
    pub fn hold(&mut self, now: Instant) -> bool {
        let since = *self.since.get_or_insert(now);
        now < since + FORGET_BOUND
    }

    /// A snapshot goes out, or none is held back any more.
    pub fn release(&mut self) {
        self.since = None;
    }

    /// When the snapshot held back is to go at the latest.
    pub fn due(&self) -> Option<Instant> {
        self.since.map(|since| since + FORGET_BOUND)
    }
}

#[cfg(test)]
mod tests {
    use kmm_proto::v1::{ModuleIntent, ModuleKey, PullCredential};

    use super::*;

    fn intent(name: &str, unload: bool) -> Arc<ModuleIntent> {
        Arc::new(ModuleIntent {
            key: Some(ModuleKey {
                namespace: "drivers".into(),
                name: name.into(),
            }),
            unload,
            ..ModuleIntent::default()
        })
    }

    fn snapshot(modules: &[&Arc<ModuleIntent>]) -> SharedSnapshot {
        SharedSnapshot {
            revision: 0,
            modules: modules.iter().map(|m| Arc::clone(m)).collect(),
            credentials: Vec::new(),
        }
    }

    /// An outbox whose stream got a snapshot of `modules`.
    fn sent(modules: &[&Arc<ModuleIntent>]) -> Outbox {
        let mut outbox = Outbox::default();
        outbox.offer(snapshot(modules)).expect("sent");
        outbox
    }

    #[test]
    fn only_a_snapshot_dropping_unloads_while_others_remain_only_forgets() {
        let (a, b, c) = (intent("a", true), intent("b", true), intent("c", true));
        let loaded = intent("loaded", false);
        let outbox = sent(&[&a, &b, &c, &loaded]);
        assert!(only_forgets(&outbox, &snapshot(&[&b, &c, &loaded])));
        assert!(only_forgets(&outbox, &snapshot(&[&c, &loaded])));
        // Equal intents built anew are the same intents.
        let c_again = intent("c", true);
        assert!(only_forgets(&outbox, &snapshot(&[&c_again, &loaded])));

        // The last unload done: the snapshot goes at once.
        assert!(!only_forgets(&outbox, &snapshot(&[&loaded])));
        // A loaded module left out is an unload to make, not one to forget.
        assert!(!only_forgets(&outbox, &snapshot(&[&b, &c])));
        // Any intent changed, or added, is news for the nodes.
        let b_loaded = intent("b", false);
        assert!(!only_forgets(&outbox, &snapshot(&[&b_loaded, &c, &loaded])));
        let d = intent("d", true);
        assert!(!only_forgets(&outbox, &snapshot(&[&b, &c, &d, &loaded])));
        // Nothing left out: nothing to forget.
        assert!(!only_forgets(&outbox, &snapshot(&[&a, &b, &c, &loaded])));
    }

    #[test]
    fn a_new_credential_or_a_stream_without_the_last_snapshot_is_sent() {
        let (a, b) = (intent("a", true), intent("b", true));
        let mut outbox = sent(&[&a, &b]);
        let mut next = snapshot(&[&b]);
        next.credentials.push(PullCredential::default());
        assert!(!only_forgets(&outbox, &next));

        outbox.new_stream(crate::fleet::outbox::Held::default());
        assert!(!only_forgets(&outbox, &snapshot(&[&b])));
        assert!(!only_forgets(&Outbox::default(), &snapshot(&[&b])));
    }

    #[test]
    fn a_snapshot_that_only_forgets_waits_the_bound_from_the_first_held_back() {
        let start = Instant::now();
        let mut held = HeldForgetting::default();
        assert_eq!(held.due(), None);
        assert!(held.hold(start));
        assert!(held.hold(start + FORGET_BOUND - Duration::from_millis(1)));
        assert_eq!(held.due(), Some(start + FORGET_BOUND));
        assert!(!held.hold(start + FORGET_BOUND), "due: it goes");
        held.release();
        assert_eq!(held.due(), None);
        assert!(held.hold(start + FORGET_BOUND), "a new wait starts");
    }
}
