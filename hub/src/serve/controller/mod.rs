//! The ManagedClusterModule controller, as a pipeline: the finalizer guards every module;
//! the module is looked up in the fleet view, which its watch feeds (its spec validated
//! once per generation, its clusters counted); the rollout advances; a deleted module's finalizer goes once
//! every affected node confirmed the unload or the unload timeout elapsed; status
//! (counts, failure sample, `Ready`) is written by server-side apply; transitions become
//! Events.

pub mod deletion_clock;
mod error;
pub mod finalizer;
mod rollout;
pub mod status_writer;
#[cfg(test)]
mod tests;

use std::sync::Arc;
use std::time::{Duration, Instant};

use k8s_openapi::api::apps::v1::ControllerRevision;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kmm_api::{ManagedClusterModule, ManagedClusterModuleStatus, SharedKernelModule};
use kmm_proto::REASON_KERNEL_MODULE_SHARED;
use kmm_runtime::events::EventType;
use kube::runtime::controller::Action;
use kube::{Api, ResourceExt};

use self::deletion_clock::DeletionClock;
pub use self::error::ReconcileError;
pub use self::finalizer::FINALIZER;
use self::finalizer::Guard;
pub use self::status_writer::{FIELD_MANAGER, STATUS_WRITE_INTERVAL};
use self::status_writer::{StatusPacer, write_status};
use crate::fleet::deletion::{Deletion, decide};
use crate::fleet::module_view::ModuleView;
use crate::fleet::readiness::{READY, is_transition, phase, ready_condition, summary};
use crate::fleet::rollout::{Milestone, assignment_changed, milestones};
use crate::fleet::served_revisions::is_progressive;
use crate::fleet::status::newly_shared;

use super::events::EventPublisher;
use super::fleet_view::FleetView;
use super::metrics::Metrics;

/// Level-based safety net: every module is reconciled at least this often.
const RESYNC: Duration = Duration::from_secs(300);
/// How soon a module reconciled before the fleet view synced is looked at again.
const SYNC_RECHECK: Duration = Duration::from_millis(200);
/// While unloading, check again at least this often (reports also trigger a check).
const UNLOAD_RECHECK: Duration = Duration::from_secs(10);
/// How soon a failed reconciliation is retried.
const ERROR_RETRY: Duration = Duration::from_secs(5);
/// How soon a reconciliation refused for a stale view is retried, should the watch not
/// bring the newer object first.
const STALE_RETRY: Duration = Duration::from_millis(500);

/// What every reconciliation shares.
pub struct Context {
    pub api: Api<ManagedClusterModule>,
    /// The kept revisions of the modules' specs, in the hub's namespace.
    pub revisions: Api<ControllerRevision>,
    /// The hub's namespace.
    pub namespace: String,
    pub state: Arc<FleetView>,
    pub events: EventPublisher,
    pub unload_timeout: Duration,
    pub metrics: Metrics,
    pub status_pacer: StatusPacer,
    pub deletion_clock: DeletionClock,
}

impl std::fmt::Debug for Context {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Context")
            .field("unload_timeout", &self.unload_timeout)
            .finish_non_exhaustive()
    }
}

/// What the status is to say, and what happens next.
struct Outcome {
    status: ManagedClusterModuleStatus,
    /// The Event of a transition: the phase, its reason and message.
    transition: Option<(EventType, &'static str, String)>,
    milestones: Vec<Milestone>,
    /// Nodes newly sharing a kernel module with another module, each announced once.
    shared: Vec<SharedKernelModule>,
    /// Whether the write must not wait for the status pacing.
    urgent: bool,
    requeue: Duration,
}

#[tracing::instrument(name = "reconcile", skip_all, fields(module = %module.name_any()))]
pub async fn reconcile(
    module: Arc<ManagedClusterModule>,
    ctx: Arc<Context>,
) -> Result<Action, ReconcileError> {
    match finalizer::guard(&module) {
        Guard::Held => {}
        Guard::Missing => {
            // The update it causes reconciles the module again.
            let finalizers = finalizer::added(&module);
            finalizer::set(
                &ctx.api,
                &ctx.events,
                &module,
                finalizers,
                "adding the finalizer",
            )
            .await?;
            return Ok(Action::await_change());
        }
        Guard::Released => return Ok(Action::await_change()),
    }
    if !ctx.state.is_synced() {
        // Until every watch listed, the fleet view lacks clusters: counting none would
        // release a deleted module's finalizer unconfirmed, or fold a rollout that has
        // clusters still to reach. Only a hub's first moments take this path.
        return Ok(Action::requeue(SYNC_RECHECK));
    }
    let invalid = ctx.state.invalid(&module);
    let view = ctx.state.module_view(&module);
    let Some(outcome) = decide_outcome(&ctx, &module, invalid, view).await? else {
        return Ok(Action::await_change());
    };
    let name = module.name_any();
    if module.status.as_ref() != Some(&outcome.status) {
        if let Some(wait) = ctx.status_pacer.wait(&name, outcome.urgent, Instant::now()) {
            return Ok(Action::requeue(wait));
        }
        write_status(&ctx.api, &name, &outcome.status).await?;
        ctx.metrics.status_writes.inc();
    }
    if let Some((type_, reason, note)) = outcome.transition {
        ctx.events
            .publish(&module, type_, reason, "Reconcile", note)
            .await;
    }
    for milestone in outcome.milestones {
        let type_ = if milestone.warning {
            EventType::Warning
        } else {
            EventType::Normal
        };
        ctx.events
            .publish(
                &module,
                type_,
                milestone.reason,
                "Reconcile",
                milestone.note,
            )
            .await;
    }
    for shared in &outcome.shared {
        announce_shared(&ctx.events, &module, shared).await;
    }
    Ok(Action::requeue(outcome.requeue))
}

/// A Warning Event on `module`: on a node, it shares a kernel module with another module
/// (an unload of either left it loaded for the other).
async fn announce_shared(
    events: &EventPublisher,
    module: &ManagedClusterModule,
    shared: &SharedKernelModule,
) {
    let note = format!(
        "cluster {}, node {}: {}",
        shared.cluster, shared.node, shared.message
    );
    events
        .publish(
            module,
            EventType::Warning,
            REASON_KERNEL_MODULE_SHARED,
            "Reconcile",
            note,
        )
        .await;
}

/// The rollout's step and the deletion's verdict, and the status they make; `None` once
/// the module's finalizer is released.
async fn decide_outcome(
    ctx: &Context,
    module: &ManagedClusterModule,
    invalid: Option<String>,
    view: ModuleView,
) -> Result<Option<Outcome>, ReconcileError> {
    let name = module.name_any();
    let deleting = module.metadata.deletion_timestamp.is_some();
    let ModuleView {
        mut status,
        leftovers,
        observed,
        ..
    } = view;
    let shared: Vec<SharedKernelModule> = newly_shared(module.status.as_ref(), &status)
        .into_iter()
        .cloned()
        .collect();
    let mut detail = invalid.clone().unwrap_or_default();
    let mut requeue = RESYNC;
    let previous_rollout = module.status.as_ref().and_then(|s| s.rollout.as_ref());
    status.rollout = previous_rollout.cloned();
    if !deleting {
        match rollout::step(
            &ctx.revisions,
            &ctx.state,
            &ctx.namespace,
            module,
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
        .filter(|_| is_progressive(module))
        .map(|next| milestones(previous_rollout, next))
        .unwrap_or_default();
    ctx.metrics.observe_module(&name, &status);
    if deleting {
        let uid = module.uid().unwrap_or_else(|| name.clone());
        let elapsed = ctx.deletion_clock.elapsed(&uid, Instant::now());
        match decide(leftovers, elapsed, ctx.unload_timeout) {
            Deletion::Complete => {
                tracing::info!("unload confirmed everywhere; releasing the finalizer");
                // No status is written any more: what the unload kept is announced now.
                for shared in &shared {
                    announce_shared(&ctx.events, module, shared).await;
                }
                ctx.events
                    .publish(
                        module,
                        EventType::Normal,
                        "Unloaded",
                        "Reconcile",
                        "the module is unloaded on every affected node".into(),
                    )
                    .await;
                release(ctx, module).await?;
                return Ok(None);
            }
            Deletion::TimedOut(leftovers) => {
                let list = leftovers.to_string();
                tracing::warn!(leftovers = %list, timeout = ?ctx.unload_timeout, "unload not confirmed in time; releasing the finalizer");
                for shared in &shared {
                    announce_shared(&ctx.events, module, shared).await;
                }
                // The leftovers must be on record before the module can go.
                ctx.events
                    .publish_required(
                        module,
                        EventType::Warning,
                        "UnloadTimedOut",
                        "Reconcile",
                        format!(
                            "unload not confirmed within {}s on: {list}",
                            ctx.unload_timeout.as_secs()
                        ),
                    )
                    .await
                    .map_err(|source| ReconcileError::Event {
                        name: name.clone(),
                        reason: "UnloadTimedOut",
                        source,
                    })?;
                release(ctx, module).await?;
                return Ok(None);
            }
            Deletion::Waiting(leftovers) => {
                detail = format!("waiting for the unload on: {leftovers}");
                requeue = UNLOAD_RECHECK
                    .min(ctx.unload_timeout.saturating_sub(elapsed) + Duration::from_millis(100));
            }
        }
    }
    let previous = module
        .status
        .as_ref()
        .and_then(|s| s.conditions.iter().find(|c| c.type_ == READY));
    let phase = phase(&status, invalid.is_some(), deleting);
    let condition = ready_condition(
        phase,
        summary(&status, phase, &detail),
        module.metadata.generation,
        previous,
        Time(Timestamp::now()),
    );
    // A released cluster gets its new revision only once the record is written; a
    // followed tag's new digest reaches clusters once its pin generation is.
    let pins_moved = status.pin_generation != module.status.as_ref().and_then(|s| s.pin_generation);
    let urgent = is_transition(previous, &condition)
        || rollout_moved
        || pins_moved
        || !milestones.is_empty();
    let type_ = if phase.is_warning() {
        EventType::Warning
    } else {
        EventType::Normal
    };
    let transition = urgent.then(|| (type_, phase.reason(), condition.message.clone()));
    status.conditions = vec![condition];
    Ok(Some(Outcome {
        status,
        transition,
        milestones,
        shared,
        urgent,
        requeue,
    }))
}

pub fn error_policy(
    module: Arc<ManagedClusterModule>,
    error: &ReconcileError,
    ctx: Arc<Context>,
) -> Action {
    ctx.metrics.reconcile_errors.inc();
    if let ReconcileError::Stale { .. } = error {
        tracing::debug!(module = module.name_any(), %error, "stale view; reconciling again");
        return Action::requeue(STALE_RETRY);
    }
    tracing::warn!(module = module.name_any(), %error, "reconcile failed");
    Action::requeue(ERROR_RETRY)
}

async fn release(ctx: &Context, module: &ManagedClusterModule) -> Result<(), ReconcileError> {
    let finalizers = finalizer::removed(module);
    finalizer::set(
        &ctx.api,
        &ctx.events,
        module,
        finalizers,
        "removing the finalizer",
    )
    .await?;
    ctx.state.forget_module(module);
    ctx.metrics.forget_module(&module.name_any());
    ctx.deletion_clock
        .forget(&module.uid().unwrap_or_else(|| module.name_any()));
    Ok(())
}
