//! One reconciliation's step of a module's rollout: keep the current revision of its
//! spec in a `ControllerRevision`, advance the record that the module's status carries,
//! and delete the kept revisions no cluster runs any more. The record is written (by the
//! controller) before the fleet view serves a released cluster its new revision.

use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::api::apps::v1::ControllerRevision;
use k8s_openapi::jiff::Timestamp;
use kmm_api::{ManagedClusterModule, RolloutStatus};
use kube::api::{DeleteParams, PostParams};
use kube::{Api, ResourceExt};

use crate::fleet::revisions::{REVISION_LABEL, controller_revision};
use crate::fleet::rollout::{Observation, advance, revisions_in_use};

use super::error::ReconcileError;
use crate::serve::fleet_view::FleetView;

/// The record to write, and when to look again.
#[derive(Debug)]
pub struct Step {
    pub record: RolloutStatus,
    pub next_check: Option<Duration>,
}

/// Advances the module's rollout. An invalid strategy (stored before admission checked
/// it) moves nothing: the record stays as it was, and the error says why.
pub async fn step(
    revisions: &Api<ControllerRevision>,
    state: &FleetView,
    namespace: &str,
    module: &ManagedClusterModule,
    observed: &BTreeMap<String, Observation>,
) -> Result<Result<Step, String>, ReconcileError> {
    let name = module.name_any();
    let current = state.current_revision(module);
    let kept = state.kept_revisions(&name);
    if !kept
        .iter()
        .any(|r| r.labels().get(REVISION_LABEL) == Some(&current))
    {
        let object = controller_revision(module, &current, namespace);
        match revisions.create(&PostParams::default(), &object).await {
            Ok(_) => tracing::info!(revision = current, "kept a new revision"),
            Err(kube::Error::Api(s)) if s.code == 409 => {}
            Err(source) => {
                return Err(ReconcileError::Api {
                    name,
                    action: "keeping the spec's revision",
                    source,
                });
            }
        }
    }
    let previous = module.status.as_ref().and_then(|s| s.rollout.as_ref());
    let strategy = match module
        .spec
        .rollout_strategy
        .clone()
        .unwrap_or_default()
        .check()
    {
        Ok(strategy) => strategy,
        Err(problems) => {
            let why = problems
                .iter()
                .map(|p| {
                    format!(
                        "spec.rolloutStrategy.{} {:?}: {}",
                        p.field, p.value, p.message
                    )
                })
                .collect::<Vec<_>>()
                .join("; ");
            return Ok(Err(why));
        }
    };
    let (record, next_check) = advance(&strategy, &current, previous, observed, Timestamp::now());
    let in_use = revisions_in_use(&current, previous, &record);
    for unused in kept.iter().filter(|r| {
        r.labels()
            .get(REVISION_LABEL)
            .is_none_or(|rev| !in_use.contains(rev.as_str()))
    }) {
        match revisions
            .delete(&unused.name_any(), &DeleteParams::default())
            .await
        {
            Ok(_) => tracing::info!(revision = unused.name_any(), "deleted an unused revision"),
            Err(kube::Error::Api(s)) if s.code == 404 => {}
            Err(source) => {
                return Err(ReconcileError::Api {
                    name,
                    action: "deleting an unused revision",
                    source,
                });
            }
        }
    }
    Ok(Ok(Step { record, next_check }))
}
