//! Writes a module's status by server-side apply, paced: a fleet converging writes a
//! module's status about once a second, however many clusters report; a transition (the
//! `Ready` condition, the rollout's assignment) is written at once.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use kmm_api::{ManagedClusterModule, ManagedClusterModuleStatus};
use kube::api::{Patch, PatchParams};
use kube::{Api, Resource};
use serde_json::json;

use super::error::ReconcileError;

/// Field manager of the hub's status writes.
pub const FIELD_MANAGER: &str = "kmm-hub";

/// Least time between two status writes of one module that only change counts.
pub const STATUS_WRITE_INTERVAL: Duration = Duration::from_secs(1);

/// When each module's status was last written.
#[derive(Debug, Default)]
pub struct StatusPacer {
    written: Mutex<HashMap<String, Instant>>,
}

impl StatusPacer {
    /// How long a write must wait, if at all; otherwise the write is recorded as made
    /// `now`. A transition never waits.
    pub fn wait(&self, name: &str, transition: bool, now: Instant) -> Option<Duration> {
        let mut written = self
            .written
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        written.retain(|_, at| now.duration_since(*at) < STATUS_WRITE_INTERVAL);
        match written.get(name) {
            Some(at) if !transition => Some(STATUS_WRITE_INTERVAL - now.duration_since(*at)),
            _ => {
                written.insert(name.to_owned(), now);
                None
            }
        }
    }
}

pub async fn write_status(
    api: &Api<ManagedClusterModule>,
    name: &str,
    status: &ManagedClusterModuleStatus,
) -> Result<(), ReconcileError> {
    let patch = json!({
        "apiVersion": ManagedClusterModule::api_version(&()),
        "kind": ManagedClusterModule::kind(&()),
        "status": status,
    });
    api.patch_status(
        name,
        &PatchParams::apply(FIELD_MANAGER).force(),
        &Patch::Apply(&patch),
    )
    .await
    .map(drop)
    .map_err(|source| ReconcileError::Api {
        name: name.to_owned(),
        action: "writing status",
        source,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_wait_out_the_interval_and_transitions_never_wait() {
        let pacer = StatusPacer::default();
        let start = Instant::now();
        assert_eq!(pacer.wait("a", false, start), None);
        let later = start + Duration::from_millis(300);
        assert_eq!(
            pacer.wait("a", false, later),
            Some(Duration::from_millis(700))
        );
        assert_eq!(
            pacer.wait("b", false, later),
            None,
            "each module has its own"
        );
        assert_eq!(pacer.wait("a", true, later), None);
        // The transition's write restarts the interval.
        let after = later + Duration::from_millis(900);
        assert_eq!(
            pacer.wait("a", false, after),
            Some(Duration::from_millis(100))
        );
        assert_eq!(pacer.wait("a", false, later + STATUS_WRITE_INTERVAL), None);
    }
}
