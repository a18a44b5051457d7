//! Writes every PreflightValidation's status: each module's answer, as the fleet view
//! computes it from the module's spec and the image worker's records. The image needs the
//! preflights add are the fleet view's (`FleetView::image_needs`); this only reports.

use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::jiff::Timestamp;
use kmm_api::PreflightValidation;
use kube::api::{Patch, PatchParams};
use kube::runtime::reflector::Store;
use kube::{Api, Resource, ResourceExt};
use serde_json::json;

use super::controller::FIELD_MANAGER;
use super::fleet_view::FleetView;

/// A safety net beside the events that wake the writer (image records, preflights and
/// modules changing): an answer computed from state no event announced is still written.
const RESYNC: Duration = Duration::from_secs(30);

pub async fn run(
    state: Arc<FleetView>,
    api: Api<PreflightValidation>,
    preflights: Store<PreflightValidation>,
) {
    loop {
        for preflight in preflights.state() {
            let modules = state.preflight_statuses(&preflight, Timestamp::now());
            if preflight.status.as_ref().map(|s| &s.modules) == Some(&modules) {
                continue;
            }
            let patch = json!({
                "apiVersion": PreflightValidation::api_version(&()),
                "kind": PreflightValidation::kind(&()),
                "status": { "modules": modules },
            });
            let name = preflight.name_any();
            if let Err(error) = api
                .patch_status(
                    &name,
                    &PatchParams::apply(FIELD_MANAGER).force(),
                    &Patch::Apply(&patch),
                )
                .await
            {
                tracing::warn!(preflight = name, %error, "cannot write the preflight's status");
            }
        }
        tokio::select! {
            () = state.preflight_events().notified() => {}
            () = tokio::time::sleep(RESYNC) => {}
        }
    }
}
