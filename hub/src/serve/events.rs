//! Events on ManagedClusterModules, from the controller and the image worker alike.
//! Best effort: a failure to record one is logged and never fails the work that
//! announced it (but for the Events that must be on record, see `publish_required`).

use std::sync::Arc;

use kmm_api::ManagedClusterModule;
use kmm_runtime::events::{EventType, Record, Recorder};
use kube::Resource;

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
