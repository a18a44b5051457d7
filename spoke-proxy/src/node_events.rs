//! Events on Nodes for what their agents did, as upstream records them (`ModuleLoaded`,
//! `ModuleUnloaded` and the failures), so that `kubectl describe node` tells a node's
//! story.
//!
//! Bounded twice: an agent retrying a failing load reports the same failure again and
//! again, and a repeat of the last event of a node's module within [`REPEAT_AFTER`] is
//! not recorded; and events wait in a bounded queue for the one task that records them,
//! so a burst over [`QUEUE`] is dropped (and counted) rather than held in memory or sent
//! to the apiserver all at once.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::ObjectReference;
use kmm_proto::v1::{Action, ModuleEvent, Outcome};
use kmm_runtime::events::{EventType, Record, Recorder};
use kube::Client;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::metrics::Metrics;
use crate::module_id::ModuleId;

/// How long a repeat of a node's module's last event is left unrecorded.
pub const REPEAT_AFTER: Duration = Duration::from_secs(300);
/// Events waiting to be recorded, at most.
pub const QUEUE: usize = 256;
/// Longest note recorded (the agent's error text can be long).
const MAX_NOTE: usize = 1024;

/// One Event for a Node.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodeEvent {
    pub node: String,
    /// The module it is about.
    pub module: ModuleId,
    pub warning: bool,
    pub reason: &'static str,
    pub note: String,
}

/// The Event an agent's report makes on its Node.
pub fn of(node: &str, event: &ModuleEvent) -> Option<NodeEvent> {
    let module = ModuleId::from_key(event.key.as_ref());
    let version = if event.version.is_empty() {
        String::new()
    } else {
        format!(" version {}", event.version)
    };
    let (warning, reason, note) = match (event.action(), event.outcome()) {
        (Action::Load, Outcome::Succeeded) => (
            false,
            "ModuleLoaded",
            format!("Module {module}{version} loaded into the kernel"),
        ),
        (Action::Unload, Outcome::Succeeded) => (
            false,
            "ModuleUnloaded",
            format!("Module {module}{version} unloaded from the kernel"),
        ),
        (Action::Load, Outcome::Failed) => (
            true,
            "ModuleLoadFailed",
            format!("Module {module}{version} failed to load: {}", event.error),
        ),
        (Action::Unload, Outcome::Failed) => (
            true,
            "ModuleUnloadFailed",
            format!("Module {module}{version} failed to unload: {}", event.error),
        ),
        _ => return None,
    };
    Some(NodeEvent {
        node: node.to_owned(),
        module: module.clone(),
        warning,
        reason,
        note: {
            let mut note = note;
            kmm_proto::limits::truncate(&mut note, MAX_NOTE);
            note
        },
    })
}

/// The ManagedClusterModule an Event is about, as its related object. Besides telling a
/// reader which module, it keeps each module's Events apart: the recorder merges Events
/// of the same reason on the same Node into one series unless their related objects
/// differ, and the note of the first would then stand for every module.
pub fn related(module: &ModuleId) -> ObjectReference {
    ObjectReference {
        api_version: Some("hub.kmm.sigs.x-k8s.io/v1beta1".into()),
        kind: Some("ManagedClusterModule".into()),
        name: Some(module.name.to_string()),
        ..ObjectReference::default()
    }
}

/// Leaves out a repeat of the last event of the same node and module within
/// [`REPEAT_AFTER`].
#[derive(Debug, Default)]
pub struct Repeats {
    last: HashMap<(String, ModuleId), (NodeEvent, Instant)>,
}

impl Repeats {
    /// Whether `event` is recorded now (and remembered as its module's last on its node).
    pub fn admit(&mut self, event: &NodeEvent, now: Instant) -> bool {
        let key = (event.node.clone(), event.module.clone());
        if let Some((last, at)) = self.last.get(&key)
            && last == event
            && now.duration_since(*at) < REPEAT_AFTER
        {
            return false;
        }
        // What is older than the repeat window needs no memory.
        self.last
            .retain(|_, (_, at)| now.duration_since(*at) < REPEAT_AFTER);
        self.last.insert(key, (event.clone(), now));
        true
    }
}

/// The agents' side: hands events to [`run`] without waiting.
#[derive(Clone, Debug)]
pub struct NodeEvents {
    queue: mpsc::Sender<NodeEvent>,
    metrics: Metrics,
}

impl NodeEvents {
    pub fn new(metrics: Metrics) -> (Self, mpsc::Receiver<NodeEvent>) {
        let (queue, events) = mpsc::channel(QUEUE);
        (Self { queue, metrics }, events)
    }

    /// Queues the Event of `event` on `node`, or drops it when the queue is full.
    pub fn record(&self, node: &str, event: &ModuleEvent) {
        if let Some(event) = of(node, event)
            && self.queue.try_send(event).is_err()
        {
            self.metrics.node_events_dropped.inc();
        }
    }
}

/// Records the queued events on their Nodes, as the kubelet does (the Node's name as its
/// uid, which is what `kubectl describe node` looks for), until cancelled.
pub async fn run(
    client: Client,
    instance: String,
    mut events: mpsc::Receiver<NodeEvent>,
    metrics: Metrics,
    cancel: CancellationToken,
) {
    let recorder = Recorder::new(client, "kmm-spoke-proxy", &instance);
    let mut repeats = Repeats::default();
    loop {
        let event = tokio::select! {
            () = cancel.cancelled() => return,
            event = events.recv() => match event {
                Some(event) => event,
                None => return,
            },
        };
        if !repeats.admit(&event, Instant::now()) {
            continue;
        }
        let node = ObjectReference {
            api_version: Some("v1".into()),
            kind: Some("Node".into()),
            name: Some(event.node.clone()),
            uid: Some(event.node.clone()),
            ..ObjectReference::default()
        };
        let recorded = recorder
            .publish(&Record {
                type_: if event.warning {
                    EventType::Warning
                } else {
                    EventType::Normal
                },
                reason: event.reason.to_owned(),
                action: event.reason.to_owned(),
                note: event.note,
                regarding: node,
                related: Some(related(&event.module)),
            })
            .await;
        match recorded {
            Ok(()) => {
                metrics.node_events.inc();
            }
            Err(error) => {
                metrics.node_events_dropped.inc();
                tracing::warn!(node = event.node, %error, "cannot record a Node event");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use kmm_proto::v1::ModuleKey;

    use super::*;

    fn event(action: Action, outcome: Outcome, error: &str) -> ModuleEvent {
        ModuleEvent {
            key: Some(ModuleKey {
                namespace: "ops".into(),
                name: "nic".into(),
            }),
            action: action.into(),
            outcome: outcome.into(),
            version: "2".into(),
            error: error.into(),
            ..ModuleEvent::default()
        }
    }

    #[test]
    fn each_outcome_has_upstreams_reason_and_names_the_module() {
        let cases = [
            (Action::Load, Outcome::Succeeded, false, "ModuleLoaded"),
            (Action::Unload, Outcome::Succeeded, false, "ModuleUnloaded"),
            (Action::Load, Outcome::Failed, true, "ModuleLoadFailed"),
            (Action::Unload, Outcome::Failed, true, "ModuleUnloadFailed"),
        ];
        for (action, outcome, warning, reason) in cases {
            let made = of("n1", &event(action, outcome, "modprobe: FATAL")).unwrap();
            assert_eq!((made.warning, made.reason), (warning, reason));
            assert!(
                made.note.starts_with("Module ops/nic version 2 "),
                "{made:?}"
            );
            assert_eq!(made.note.contains("modprobe: FATAL"), warning, "{made:?}");
        }
        let unspecified = event(Action::Unspecified, Outcome::Succeeded, "");
        assert_eq!(of("n1", &unspecified), None);
    }

    #[test]
    fn each_modules_events_name_it_as_their_related_object() {
        let made = of("n1", &event(Action::Load, Outcome::Succeeded, "")).unwrap();
        let other = ModuleId {
            namespace: "ops".into(),
            name: "other".into(),
        };
        assert_eq!(related(&made.module).name.as_deref(), Some("nic"));
        assert_ne!(related(&made.module), related(&other));
    }

    #[test]
    fn a_long_error_is_cut() {
        let made = of(
            "n1",
            &event(Action::Load, Outcome::Failed, &"é".repeat(4000)),
        )
        .unwrap();
        assert!(made.note.len() <= MAX_NOTE);
    }

    #[test]
    fn a_repeat_within_the_window_is_left_out() {
        let mut repeats = Repeats::default();
        let start = Instant::now();
        let failed = of("n1", &event(Action::Load, Outcome::Failed, "boom")).unwrap();
        assert!(repeats.admit(&failed, start));
        assert!(!repeats.admit(&failed, start + Duration::from_secs(30)));
        // Another node, another module, another outcome: recorded.
        let elsewhere = NodeEvent {
            node: "n2".into(),
            ..failed.clone()
        };
        assert!(repeats.admit(&elsewhere, start));
        let other_module = NodeEvent {
            module: ModuleId {
                namespace: "ops".into(),
                name: "other".into(),
            },
            ..failed.clone()
        };
        assert!(repeats.admit(&other_module, start));
        let loaded = of("n1", &event(Action::Load, Outcome::Succeeded, "")).unwrap();
        assert!(repeats.admit(&loaded, start + Duration::from_secs(31)));
        // The failure again after the load: a new story, recorded.
        assert!(repeats.admit(&failed, start + Duration::from_secs(32)));
        // And once the window passed.
        assert!(repeats.admit(&failed, start + REPEAT_AFTER * 2));
    }

    #[tokio::test]
    async fn a_full_queue_drops_and_counts() {
        let metrics = Metrics::default();
        let (events, _held) = NodeEvents::new(metrics.clone());
        for _ in 0..QUEUE + 5 {
            events.record("n1", &event(Action::Load, Outcome::Succeeded, ""));
        }
        assert_eq!(metrics.node_events_dropped.get(), 5);
    }
}
