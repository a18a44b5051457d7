//! The ManagedClusterModule controller: a finalizer guards every module, the spec is
//! validated, the fleet view recomputes the clusters' snapshots, status (counts, failure
//! sample, `Ready`) is written by server-side apply, transitions become Events, and a
//! deleted module's finalizer goes once every affected node confirmed the unload or the
//! unload timeout elapsed (and its Warning Event is recorded). A refused finalizer patch
//! is never taken for done: it is logged, reported as an Event and retried.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use k8s_openapi::api::apps::v1::ControllerRevision;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kmm_api::{ManagedClusterModule, ManagedClusterModuleStatus};
use kmm_resolver::{ModuleIdentity, validate};
use kube::api::{Patch, PatchParams};
use kube::runtime::controller::Action;
use kube::runtime::events::{Event, EventType, Recorder};
use kube::{Api, Resource, ResourceExt};
use serde_json::json;
use thiserror::Error;

use crate::fleet::deletion::{Deletion, decide};
use crate::fleet::module_view::ModuleView;
use crate::fleet::readiness::{READY, is_transition, phase, ready_condition, summary};
use crate::fleet::rollout::{assignment_changed, milestones};
use crate::fleet::served_revisions::is_progressive;

use super::fleet_view::FleetView;
use super::metrics::Metrics;
use super::rollout;

pub use crate::fleet::assignment::FINALIZER;
/// Field manager of the hub's status writes.
pub const FIELD_MANAGER: &str = "kmm-hub";
/// Level-based safety net: every module is reconciled at least this often.
const RESYNC: Duration = Duration::from_secs(300);
/// How soon a module reconciled before the fleet view synced is looked at again.
const SYNC_RECHECK: Duration = Duration::from_millis(200);
/// While unloading, check again at least this often (reports also trigger a check).
const UNLOAD_RECHECK: Duration = Duration::from_secs(10);
/// Least time between two status writes of one module that only change counts: a fleet
/// converging writes a module's status about once a second, however many clusters
/// report. A change of the `Ready` condition is written at once.
pub const STATUS_WRITE_INTERVAL: Duration = Duration::from_secs(1);
/// What the apiserver answers when a JSON patch's `test` op fails: our view was stale.
const PATCH_TEST_FAILED: &str = "the server rejected our request due to an error in our request";

#[derive(Debug, Error)]
pub enum ReconcileError {
    #[error("ManagedClusterModule {name}: {action}: {source}")]
    Api {
        name: String,
        action: &'static str,
        source: kube::Error,
    },
    #[error("ManagedClusterModule {name}: the Event {reason} cannot be recorded: {source}")]
    Event {
        name: String,
        reason: &'static str,
        source: kube::Error,
    },
}

/// What every reconciliation shares.
pub struct Context {
    pub api: Api<ManagedClusterModule>,
    /// The kept revisions of the modules' specs, in the hub's namespace.
    pub revisions: Api<ControllerRevision>,
    /// The hub's namespace.
    pub namespace: String,
    pub state: Arc<FleetView>,
    pub recorder: Recorder,
    pub unload_timeout: Duration,
    pub metrics: Metrics,
    /// When each module's status was last written.
    pub status_written: std::sync::Mutex<HashMap<String, Instant>>,
}

impl std::fmt::Debug for Context {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Context")
            .field("unload_timeout", &self.unload_timeout)
            .finish_non_exhaustive()
    }
}

pub async fn reconcile(
    module: Arc<ManagedClusterModule>,
    ctx: Arc<Context>,
) -> Result<Action, ReconcileError> {
    let name = module.name_any();
    let has_finalizer = module.finalizers().iter().any(|f| f == FINALIZER);
    let deleting = module.metadata.deletion_timestamp.is_some();
    if !deleting && !has_finalizer {
        // The update it causes reconciles the module again.
        add_finalizer(&ctx, &module).await?;
        return Ok(Action::await_change());
    }
    if deleting && !has_finalizer {
        return Ok(Action::await_change());
    }
    if !ctx.state.is_synced() {
        // Until every watch listed, the fleet view lacks clusters: counting none would
        // release a deleted module's finalizer unconfirmed, or fold a rollout that has
        // clusters still to reach. Only a hub's first moments take this path.
        return Ok(Action::requeue(SYNC_RECHECK));
    }
    ctx.state.note_module(&module);
    let invalid = validate(
        &module.spec.module_spec,
        ModuleIdentity {
            name: &name,
            namespace: &module.spec.spoke_namespace,
            spec_path: "spec.moduleSpec",
        },
    )
    .err()
    .map(|errors| errors.to_string());
    let ModuleView {
        mut status,
        leftovers,
        observed,
    } = ctx.state.module_view(&module);
    let mut detail = invalid.clone().unwrap_or_default();
    let mut requeue = RESYNC;
    let previous_rollout = module.status.as_ref().and_then(|s| s.rollout.as_ref());
    status.rollout = previous_rollout.cloned();
    if !deleting {
        match rollout::step(
            &ctx.revisions,
            &ctx.state,
            &ctx.namespace,
            &module,
            &observed,
        )
        .await?
        {
            Ok(step) => {
                if let Some(next) = step.next_check {
                    // A moment past the instant, so that the check finds it passed.
                    requeue = requeue.min(next + Duration::from_millis(100));
                }
                status.rollout = Some(step.record);
            }
            Err(why) if detail.is_empty() => detail = why,
            Err(why) => detail = format!("{detail}; {why}"),
        }
    }
    let rollout_moved = status
        .rollout
        .as_ref()
        .is_some_and(|next| assignment_changed(previous_rollout, next));
    let milestones = status
        .rollout
        .as_ref()
        .filter(|_| is_progressive(&module))
        .map(|next| milestones(previous_rollout, next))
        .unwrap_or_default();
    if let Some(rollout) = &status.rollout {
        ctx.metrics.observe_rollout(&name, &rollout.counts);
    }
    if deleting {
        let since = module
            .metadata
            .deletion_timestamp
            .as_ref()
            .map_or(Timestamp::now(), |t| t.0);
        let elapsed =
            Duration::try_from(Timestamp::now().duration_since(since)).unwrap_or_default();
        match decide(leftovers, elapsed, ctx.unload_timeout) {
            Deletion::Complete => {
                tracing::info!(
                    module = name,
                    "unload confirmed everywhere; releasing the finalizer"
                );
                publish(
                    &ctx,
                    &module,
                    EventType::Normal,
                    "Unloaded",
                    "the module is unloaded on every affected node".into(),
                )
                .await;
                return release(&ctx, &module).await;
            }
            Deletion::TimedOut(leftovers) => {
                let list = leftovers.to_string();
                tracing::warn!(module = name, leftovers = %list, timeout = ?ctx.unload_timeout, "unload not confirmed in time; releasing the finalizer");
                // The leftovers must be on record before the module can go.
                let event = warning(
                    "UnloadTimedOut",
                    format!(
                        "unload not confirmed within {}s on: {list}",
                        ctx.unload_timeout.as_secs()
                    ),
                );
                ctx.recorder
                    .publish(&event, &module.object_ref(&()))
                    .await
                    .map_err(|source| ReconcileError::Event {
                        name: name.clone(),
                        reason: "UnloadTimedOut",
                        source,
                    })?;
                return release(&ctx, &module).await;
            }
            Deletion::Waiting(leftovers) => {
                detail = format!("waiting for the unload on: {leftovers}");
                requeue = UNLOAD_RECHECK
                    .min(ctx.unload_timeout.saturating_sub(elapsed) + Duration::from_millis(100));
            }
        }
    }
    let current = module.status.as_ref();
    let previous = current.and_then(|s| s.conditions.iter().find(|c| c.type_ == READY));
    let phase = phase(&status, invalid.is_some(), deleting);
    let condition = ready_condition(
        phase,
        summary(&status, phase, &detail),
        module.metadata.generation,
        previous,
        Time(Timestamp::now()),
    );
    // A released cluster gets its new revision only once the record is written.
    let transition = is_transition(previous, &condition) || rollout_moved || !milestones.is_empty();
    status.conditions = vec![condition.clone()];
    if current != Some(&status) {
        if let Some(wait) = status_write_wait(&ctx, &name, transition) {
            return Ok(Action::requeue(wait));
        }
        write_status(&ctx.api, &name, &status).await?;
        ctx.metrics.status_writes.inc();
    }
    if transition {
        let type_ = if phase.is_warning() {
            EventType::Warning
        } else {
            EventType::Normal
        };
        publish(
            &ctx,
            &module,
            type_,
            phase.reason(),
            condition.message.clone(),
        )
        .await;
    }
    for milestone in milestones {
        let type_ = if milestone.warning {
            EventType::Warning
        } else {
            EventType::Normal
        };
        publish(&ctx, &module, type_, milestone.reason, milestone.note).await;
    }
    Ok(Action::requeue(requeue))
}

/// How long a status write that only changes counts must wait, if at all; otherwise the
/// write is recorded as made now.
fn status_write_wait(ctx: &Context, name: &str, transition: bool) -> Option<Duration> {
    let mut written = ctx
        .status_written
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let now = Instant::now();
    written.retain(|_, at| now.duration_since(*at) < STATUS_WRITE_INTERVAL);
    match written.get(name) {
        Some(at) if !transition => Some(STATUS_WRITE_INTERVAL - now.duration_since(*at)),
        _ => {
            written.insert(name.to_owned(), now);
            None
        }
    }
}

pub fn error_policy(
    module: Arc<ManagedClusterModule>,
    error: &ReconcileError,
    ctx: Arc<Context>,
) -> Action {
    ctx.metrics.reconcile_errors.inc();
    tracing::warn!(module = module.name_any(), %error, "reconcile failed");
    Action::requeue(Duration::from_secs(5))
}

async fn add_finalizer(ctx: &Context, module: &ManagedClusterModule) -> Result<(), ReconcileError> {
    // `test` on resourceVersion: never overwrite finalizers someone changed meanwhile.
    let mut finalizers = module.finalizers().to_vec();
    finalizers.push(FINALIZER.to_owned());
    let patch = json!([
        {"op": "test", "path": "/metadata/resourceVersion", "value": module.resource_version()},
        {"op": "add", "path": "/metadata/finalizers", "value": finalizers},
    ]);
    patch_json(ctx, module, patch, "adding the finalizer").await
}

async fn release(ctx: &Context, module: &ManagedClusterModule) -> Result<Action, ReconcileError> {
    let Some(index) = module.finalizers().iter().position(|f| f == FINALIZER) else {
        return Ok(Action::await_change());
    };
    let patch = json!([
        {"op": "test", "path": format!("/metadata/finalizers/{index}"), "value": FINALIZER},
        {"op": "remove", "path": format!("/metadata/finalizers/{index}")},
    ]);
    patch_json(ctx, module, patch, "removing the finalizer").await?;
    ctx.state.forget_module(module);
    ctx.metrics.forget_rollout(&module.name_any());
    Ok(Action::await_change())
}

/// Applies a finalizer patch. Only "gone already" counts as done; anything else is an
/// error the controller logs and retries. A refusal (an admission policy or webhook, RBAC)
/// is also reported as a Warning Event on the module; a stale view (the patch's `test`
/// failed, a conflict) is not, the watch brings the newer state.
async fn patch_json(
    ctx: &Context,
    module: &ManagedClusterModule,
    patch: serde_json::Value,
    action: &'static str,
) -> Result<(), ReconcileError> {
    let name = module.name_any();
    let patch: json_patch::Patch = serde_json::from_value(patch).expect("a well-formed JSON patch");
    match ctx
        .api
        .patch(&name, &PatchParams::default(), &Patch::<()>::Json(patch))
        .await
    {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(s)) if s.code == 404 => Ok(()),
        Err(source) => {
            // A failed `test` op is answered 422 with this message and nothing else.
            let stale = matches!(&source, kube::Error::Api(s)
                if s.code == 409 || (s.code == 422 && s.message == PATCH_TEST_FAILED));
            if !stale {
                publish(
                    ctx,
                    module,
                    EventType::Warning,
                    "FinalizerPatchFailed",
                    format!("{action} failed, will retry: {source}"),
                )
                .await;
            }
            Err(ReconcileError::Api {
                name,
                action,
                source,
            })
        }
    }
}

async fn write_status(
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

fn warning(reason: &str, note: String) -> Event {
    Event {
        type_: EventType::Warning,
        reason: reason.to_owned(),
        note: Some(truncate(note, 1024)),
        action: "Reconcile".to_owned(),
        secondary: None,
    }
}

/// Events are best effort (but for the unload timeout's, see above): a failure to record
/// one is logged, never fails reconciliation.
async fn publish(
    ctx: &Context,
    module: &ManagedClusterModule,
    type_: EventType,
    reason: &str,
    note: String,
) {
    let event = Event {
        type_,
        ..warning(reason, note)
    };
    if let Err(error) = ctx.recorder.publish(&event, &module.object_ref(&())).await {
        tracing::warn!(module = module.name_any(), reason, %error, "cannot record an Event");
    }
}

/// `text` cut to at most `max` bytes, on a character boundary (Event notes are bounded).
pub(super) fn truncate(mut text: String, max: usize) -> String {
    if text.len() > max {
        let mut end = max;
        while !text.is_char_boundary(end) {
            end -= 1;
        }
        text.truncate(end);
    }
    text
}
