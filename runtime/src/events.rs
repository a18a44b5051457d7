//! Events recorded as a Kubernetes controller records them (`events.k8s.io/v1`): a repeat
//! within [`SERIES_WINDOW`] is counted on the Event already recorded, as a series.
//!
//! Unlike kube's `Recorder`, whose series key leaves the note out (a second Event of the
//! same reason on the same object is counted under the first one's note), the note is part
//! of what makes two Events the same: "image a exists" and "image b exists" are two Events.

use std::collections::HashMap;
use std::sync::Mutex;

use k8s_openapi::api::core::v1::ObjectReference;
use k8s_openapi::api::events::v1::{Event, EventSeries};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kube::api::{Patch, PatchParams, PostParams};
use kube::{Api, Client};

/// How long a repeat counts on the Event already recorded (kube's recorder uses the same).
pub const SERIES_WINDOW: SignedDuration = SignedDuration::from_mins(6);
/// Series remembered at most; the oldest is forgotten first (its next repeat is a new
/// Event, nothing worse).
pub const MAX_SERIES: usize = 4096;

/// Normal or Warning.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum EventType {
    Normal,
    Warning,
}

impl EventType {
    fn as_str(self) -> &'static str {
        match self {
            Self::Normal => "Normal",
            Self::Warning => "Warning",
        }
    }
}

/// One Event to record.
#[derive(Clone, Debug, PartialEq)]
pub struct Record {
    pub type_: EventType,
    pub reason: String,
    pub action: String,
    pub note: String,
    /// The object the Event is about.
    pub regarding: ObjectReference,
    /// Another object it involves.
    pub related: Option<ObjectReference>,
}

/// What makes two Events the same.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct Key {
    type_: EventType,
    reason: String,
    action: String,
    note: String,
    regarding: [Option<String>; 5],
    related: Option<[Option<String>; 5]>,
}

fn reference_key(r: &ObjectReference) -> [Option<String>; 5] {
    [
        r.api_version.clone(),
        r.kind.clone(),
        r.namespace.clone(),
        r.name.clone(),
        r.uid.clone(),
    ]
}

impl Key {
    fn of(record: &Record) -> Self {
        Self {
            type_: record.type_,
            reason: record.reason.clone(),
            action: record.action.clone(),
            note: record.note.clone(),
            regarding: reference_key(&record.regarding),
            related: record.related.as_ref().map(reference_key),
        }
    }
}

/// An Event recorded, and how often so far.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Recorded {
    name: String,
    count: i32,
    last: Timestamp,
}

/// What to do for an Event.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Next {
    /// Record a new Event.
    Create,
    /// Count a repeat on the Event `name`: the series' count becomes `count`.
    Repeat { name: String, count: i32 },
}

/// The series recorded within the window. Pure.
#[derive(Debug, Default)]
struct Series {
    recorded: HashMap<Key, Recorded>,
}

impl Series {
    fn next(&mut self, key: &Key, now: Timestamp) -> Next {
        self.recorded.retain(|_, r| r.last + SERIES_WINDOW > now);
        match self.recorded.get(key) {
            Some(r) => Next::Repeat {
                name: r.name.clone(),
                count: r.count.saturating_add(1),
            },
            None => Next::Create,
        }
    }

    fn recorded(&mut self, key: Key, name: String, count: i32, now: Timestamp) {
        if !self.recorded.contains_key(&key)
            && self.recorded.len() >= MAX_SERIES
            && let Some(oldest) = self
                .recorded
                .iter()
                .min_by_key(|(_, r)| r.last)
                .map(|(k, _)| k.clone())
        {
            self.recorded.remove(&oldest);
        }
        self.recorded.insert(
            key,
            Recorded {
                name,
                count,
                last: now,
            },
        );
    }
}

/// Records Events as one controller's instance.
pub struct Recorder {
    client: Client,
    controller: String,
    instance: String,
    series: Mutex<Series>,
}

impl std::fmt::Debug for Recorder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Recorder")
            .field("controller", &self.controller)
            .field("instance", &self.instance)
            .finish_non_exhaustive()
    }
}

impl Recorder {
    pub fn new(client: Client, controller: &str, instance: &str) -> Self {
        Self {
            client,
            controller: controller.to_owned(),
            instance: instance.to_owned(),
            series: Mutex::default(),
        }
    }

    /// Records `record` in the namespace of the object it is about (`default` for a
    /// cluster-scoped one), or counts it on the same Event recorded within the window.
    pub async fn publish(&self, record: &Record) -> Result<(), kube::Error> {
        let namespace = record
            .regarding
            .namespace
            .clone()
            .unwrap_or_else(|| "default".to_owned());
        let events: Api<Event> = Api::namespaced(self.client.clone(), &namespace);
        let key = Key::of(record);
        let now = Timestamp::now();
        let next = self.lock().next(&key, now);
        if let Next::Repeat { name, count } = next {
            let series = serde_json::json!({"series": EventSeries {
                count,
                last_observed_time: MicroTime(now),
            }});
            match events
                .patch(&name, &PatchParams::default(), &Patch::Merge(&series))
                .await
            {
                Ok(_) => {
                    self.lock().recorded(key, name, count, now);
                    return Ok(());
                }
                // Expired or deleted meanwhile: recorded anew.
                Err(kube::Error::Api(status)) if status.code == 404 => {}
                Err(error) => return Err(error),
            }
        }
        let event = self.event(record, namespace, now);
        let created = events.create(&PostParams::default(), &event).await?;
        let name = created.metadata.name.unwrap_or_default();
        self.lock().recorded(key, name, 1, now);
        Ok(())
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Series> {
        self.series
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn event(&self, record: &Record, namespace: String, now: Timestamp) -> Event {
        let object = record.regarding.name.as_deref().unwrap_or(&self.controller);
        Event {
            metadata: ObjectMeta {
                name: Some(format!("{object}.{:x}", now.as_nanosecond())),
                namespace: Some(namespace),
                ..ObjectMeta::default()
            },
            action: Some(record.action.clone()),
            reason: Some(record.reason.clone()),
            note: Some(record.note.clone()),
            type_: Some(record.type_.as_str().to_owned()),
            event_time: Some(MicroTime(now)),
            regarding: Some(record.regarding.clone()),
            related: record.related.clone(),
            reporting_controller: Some(self.controller.clone()),
            reporting_instance: Some(self.instance.clone()),
            ..Event::default()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(reason: &str, note: &str) -> Record {
        Record {
            type_: EventType::Normal,
            reason: reason.into(),
            action: "Check".into(),
            note: note.into(),
            regarding: ObjectReference {
                kind: Some("ManagedClusterModule".into()),
                name: Some("hello".into()),
                uid: Some("u1".into()),
                ..ObjectReference::default()
            },
            related: None,
        }
    }

    fn at(second: i64) -> Timestamp {
        Timestamp::from_second(1_800_000_000 + second).unwrap()
    }

    #[test]
    fn the_same_reason_with_another_note_is_another_event() {
        let mut series = Series::default();
        let a = Key::of(&record("ImageExists", "image a exists"));
        let b = Key::of(&record("ImageExists", "image b exists"));
        assert_eq!(series.next(&a, at(0)), Next::Create);
        series.recorded(a.clone(), "hello.1".into(), 1, at(0));
        assert_eq!(
            series.next(&b, at(1)),
            Next::Create,
            "kube's recorder counts it on a"
        );
        series.recorded(b, "hello.2".into(), 1, at(1));
        assert_eq!(
            series.next(&a, at(2)),
            Next::Repeat {
                name: "hello.1".into(),
                count: 2
            }
        );
    }

    #[test]
    fn a_repeat_counts_on_within_the_window_and_starts_anew_after() {
        let mut series = Series::default();
        let a = Key::of(&record("Converged", "4 loaded"));
        series.recorded(a.clone(), "hello.1".into(), 1, at(0));
        series.recorded(a.clone(), "hello.1".into(), 2, at(60));
        assert_eq!(
            series.next(&a, at(60 + SERIES_WINDOW.as_secs() - 1)),
            Next::Repeat {
                name: "hello.1".into(),
                count: 3
            }
        );
        assert_eq!(
            series.next(&a, at(60 + SERIES_WINDOW.as_secs())),
            Next::Create
        );
    }

    #[test]
    fn other_objects_and_related_objects_make_other_events() {
        let mut series = Series::default();
        let base = record("ModuleLoaded", "loaded");
        let mut other = base.clone();
        other.regarding.uid = Some("u2".into());
        let mut related = base.clone();
        related.related = Some(ObjectReference {
            name: Some("other-module".into()),
            ..ObjectReference::default()
        });
        series.recorded(Key::of(&base), "e".into(), 1, at(0));
        assert_eq!(series.next(&Key::of(&other), at(1)), Next::Create);
        assert_eq!(series.next(&Key::of(&related), at(1)), Next::Create);
    }

    #[test]
    fn series_beyond_the_bound_forget_the_oldest() {
        let mut series = Series::default();
        for i in 0..MAX_SERIES {
            let key = Key::of(&record("R", &format!("note {i}")));
            series.recorded(key, format!("e{i}"), 1, at(i as i64));
        }
        let newest = Key::of(&record("R", "newest"));
        series.recorded(newest.clone(), "new".into(), 1, at(MAX_SERIES as i64));
        assert_eq!(series.recorded.len(), MAX_SERIES);
        assert!(series.recorded.contains_key(&newest));
        assert!(
            !series
                .recorded
                .contains_key(&Key::of(&record("R", "note 0")))
        );
    }
}
