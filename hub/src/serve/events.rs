//! Events on ManagedClusterModules, from the controller and the image worker alike.
//! Best effort: a failure to record one is logged and never fails the work that
//! announced it (but for the Events that must be on record, see `publish_required`).

use std::sync::Arc;

use kmm_api::ManagedClusterModule;
use kmm_runtime::events::{EventType, Record, Recorder};
use kube::Resource;
use tokio::sync::mpsc;

/// Event notes are bounded by the API; longer ones are cut.
const MAX_NOTE: usize = 1024;

/// Records Events as the hub (`kmm-hub`, this replica).
#[derive(Clone)]
pub struct EventPublisher {
    recorder: Arc<Recorder>,
}

impl std::fmt::Debug for EventPublisher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EventPublisher").finish_non_exhaustive()
    }
}

impl EventPublisher {
    /// Records as `kmm-hub`, instance `instance` (this replica).
    pub fn new(client: kube::Client, instance: &str) -> Self {
        Self {
            recorder: Arc::new(Recorder::new(client, "kmm-hub", instance)),
        }
    }

    /// Records an Event on `module`; a failure is logged.
    pub async fn publish(
        &self,
        module: &ManagedClusterModule,
        type_: EventType,
        reason: &str,
        action: &str,
        note: String,
    ) {
        if let Err(error) = self
            .publish_required(module, type_, reason, action, note)
            .await
        {
            tracing::warn!(reason, %error, "cannot record an Event");
        }
    }

    /// Records an Event that must be on record before the work goes on.
    pub async fn publish_required(
        &self,
        module: &ManagedClusterModule,
        type_: EventType,
        reason: &str,
        action: &str,
        note: String,
    ) -> Result<(), kube::Error> {
        let mut note = note;
        kmm_proto::limits::truncate(&mut note, MAX_NOTE);
        let record = Record {
            type_,
            reason: reason.to_owned(),
            action: action.to_owned(),
            note,
            regarding: module.object_ref(&()),
            related: None,
        };
        self.recorder.publish(&record).await
    }
}

/// Events recorded one after the other, in the order given, by a task of their own, so
/// that the work announcing them does not wait for the apiserver: the image worker's
/// checks held their in-flight slots for their Events' writes (hundreds of milliseconds
/// each on a busy apiserver), which made a kernel upgrade's checks run several times
/// slower than the registry answered them. Unbounded: what is queued is bounded by the
/// work that announces it (one Event per image step), and a stalled apiserver holds only
/// these notes.
#[derive(Clone, Debug)]
pub struct EventQueue {
    queue: mpsc::UnboundedSender<Queued>,
}

#[derive(Debug)]
struct Queued {
    module: Arc<ManagedClusterModule>,
    type_: EventType,
    reason: String,
    action: &'static str,
    note: String,
}

impl EventQueue {
    /// Starts the task recording what is queued; it ends once every clone is dropped
    /// and the queue is drained.
    pub fn start(publisher: EventPublisher) -> Self {
        let (queue, mut queued) = mpsc::unbounded_channel::<Queued>();
        tokio::spawn(async move {
            while let Some(event) = queued.recv().await {
                publisher
                    .publish(
                        &event.module,
                        event.type_,
                        &event.reason,
                        event.action,
                        event.note,
                    )
                    .await;
            }
        });
        Self { queue }
    }

    /// Queues an Event on `module`, recorded best effort (see [`EventPublisher::publish`]).
    pub fn publish(
        &self,
        module: Arc<ManagedClusterModule>,
        type_: EventType,
        reason: &str,
        action: &'static str,
        note: String,
    ) {
        let queued = Queued {
            module,
            type_,
            reason: reason.to_owned(),
            action,
            note,
        };
        if self.queue.send(queued).is_err() {
            tracing::warn!(reason, "cannot record an Event: the hub is stopping");
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use http::{Request, Response, StatusCode};
    use http_body_util::BodyExt;
    use kmm_api::testing::ModuleBuilder;
    use kube::client::Body;
    use serde_json::Value;

    use super::*;

    #[tokio::test]
    async fn queued_events_are_recorded_in_the_order_given_while_their_announcer_goes_on() {
        let (service, mut server) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
        let client = kube::Client::new(service, "default");
        let queue = EventQueue::start(EventPublisher::new(client, "test"));
        let module = Arc::new(ModuleBuilder::new("hello").uid("u1").build());
        // All three queued before the API server answered anything.
        for reason in ["Checking", "ImageExists", "Signed"] {
            let note = format!("{reason} note");
            queue.publish(module.clone(), EventType::Normal, reason, "Image", note);
        }
        let mut recorded = Vec::new();
        for _ in 0..3 {
            let (request, respond) =
                tokio::time::timeout(Duration::from_secs(10), server.next_request())
                    .await
                    .expect("an Event within 10 s")
                    .expect("the client is alive");
            assert!(
                request.uri().path().ends_with("/events"),
                "{}",
                request.uri()
            );
            let bytes = request.into_body().collect().await.unwrap().to_bytes();
            let body: Value = serde_json::from_slice(&bytes).unwrap();
            recorded.push((
                body["reason"].as_str().unwrap_or_default().to_owned(),
                body["note"].as_str().unwrap_or_default().to_owned(),
            ));
            respond.send_response(
                Response::builder()
                    .status(StatusCode::CREATED)
                    .body(Body::from(bytes))
                    .unwrap(),
            );
        }
        assert_eq!(
            recorded,
            [
                ("Checking".to_owned(), "Checking note".to_owned()),
                ("ImageExists".to_owned(), "ImageExists note".to_owned()),
                ("Signed".to_owned(), "Signed note".to_owned()),
            ]
        );
    }
}
