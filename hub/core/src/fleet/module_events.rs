//! The recent Events of each ManagedClusterModule, as a watch of the API's Events hands
//! them over, for the fleet view's module page. Pure, and bounded: anyone allowed to
//! create Events can name any module, so a module keeps its [`PER_MODULE`] newest and at
//! most [`MODULES`] module names are kept.

use std::collections::BTreeMap;

use k8s_openapi::jiff::Timestamp;

/// Events kept per module, newest first.
pub const PER_MODULE: usize = 10;
/// Module names kept; Events naming others are not kept until one goes.
pub const MODULES: usize = 10_000;
/// Longest note kept (the API allows 1 KiB).
const NOTE: usize = 1024;

/// One Event, as the module page shows it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RecentEvent {
    /// The Event object's uid: a series' later counts replace the earlier.
    pub uid: String,
    /// `Normal` or `Warning`.
    pub type_: String,
    pub reason: String,
    pub note: String,
    /// How many times it happened (a series counts on the same object).
    pub count: i32,
    /// When it last happened.
    pub last: Timestamp,
    /// Which component reported it.
    pub reporter: String,
}

/// The recent Events by module name.
#[derive(Clone, Debug, Default)]
pub struct RecentEvents {
    modules: BTreeMap<String, Vec<RecentEvent>>,
}

impl RecentEvents {
    /// Keeps `event` of `module` (replacing the same uid's): whether the module's recent
    /// Events changed.
    pub fn note(&mut self, module: &str, mut event: RecentEvent) -> bool {
        if !self.modules.contains_key(module) && self.modules.len() >= MODULES {
            return false;
        }
        kmm_proto::limits::truncate(&mut event.note, NOTE);
        let events = self.modules.entry(module.to_owned()).or_default();
        let before = events.clone();
        events.retain(|e| e.uid != event.uid);
        events.push(event);
        // Newest first; ties by uid so that the order does not depend on arrival.
        events.sort_by(|a, b| b.last.cmp(&a.last).then_with(|| a.uid.cmp(&b.uid)));
        events.truncate(PER_MODULE);
        *events != before
    }

    /// Forgets the Event `uid` of `module` (it expired or was deleted): whether it was kept.
    pub fn forget(&mut self, module: &str, uid: &str) -> bool {
        let Some(events) = self.modules.get_mut(module) else {
            return false;
        };
        let before = events.len();
        events.retain(|e| e.uid != uid);
        let forgotten = events.len() != before;
        if events.is_empty() {
            self.modules.remove(module);
        }
        forgotten
    }

    /// Forgets everything (the watch lists anew).
    pub fn clear(&mut self) {
        self.modules.clear();
    }

    /// The module's recent Events, newest first.
    pub fn of(&self, module: &str) -> &[RecentEvent] {
        self.modules.get(module).map_or(&[], Vec::as_slice)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(uid: &str, at: i64, count: i32) -> RecentEvent {
        RecentEvent {
            uid: uid.into(),
            type_: "Normal".into(),
            reason: "ImageExists".into(),
            note: format!("event {uid}"),
            count,
            last: Timestamp::from_second(at).unwrap(),
            reporter: "kmm-hub".into(),
        }
    }

    fn uids(events: &RecentEvents, module: &str) -> Vec<String> {
        events.of(module).iter().map(|e| e.uid.clone()).collect()
    }

    #[test]
    fn a_module_keeps_its_newest_events_newest_first() {
        let mut events = RecentEvents::default();
        for i in 0..(PER_MODULE as i64 + 5) {
            assert!(events.note("hello", event(&format!("e{i:02}"), 1_000 + i, 1)));
        }
        let kept = uids(&events, "hello");
        assert_eq!(kept.len(), PER_MODULE);
        assert_eq!(kept[0], format!("e{:02}", PER_MODULE + 4), "newest first");
        // An Event older than all kept ones is not kept.
        assert!(!events.note("hello", event("old", 1, 1)));
        assert!(events.of("other").is_empty());
    }

    #[test]
    fn a_series_replaces_its_earlier_count_and_a_repeat_changes_nothing() {
        let mut events = RecentEvents::default();
        events.note("hello", event("a", 10, 1));
        events.note("hello", event("b", 20, 1));
        assert!(events.note("hello", event("a", 30, 2)));
        assert_eq!(uids(&events, "hello"), ["a", "b"]);
        assert_eq!(events.of("hello")[0].count, 2);
        assert!(!events.note("hello", event("a", 30, 2)), "the same again");
    }

    #[test]
    fn a_forgotten_event_goes_and_so_does_a_module_left_without_any() {
        let mut events = RecentEvents::default();
        events.note("hello", event("a", 10, 1));
        assert!(!events.forget("hello", "b"));
        assert!(events.forget("hello", "a"));
        assert!(events.of("hello").is_empty());
        assert!(events.modules.is_empty());
    }

    #[test]
    fn module_names_beyond_the_bound_are_not_kept_and_notes_are_cut() {
        let mut events = RecentEvents::default();
        for i in 0..MODULES {
            events.note(&format!("m{i}"), event("a", 10, 1));
        }
        assert!(!events.note("one-more", event("a", 10, 1)));
        assert!(events.of("one-more").is_empty());
        assert!(
            events.note("m0", event("b", 20, 1)),
            "a kept module still gets Events"
        );

        let mut long = event("long", 30, 1);
        long.note = "x".repeat(10 * NOTE);
        events.note("m1", long);
        assert_eq!(events.of("m1")[0].note.len(), NOTE);
    }
}
