//! The hub's finalizer on every module: added before the module goes anywhere, removed
//! once its unload is confirmed or timed out. Both patches carry the resourceVersion the
//! decision was made from: the apiserver refuses a stale one with a Conflict, never
//! overwriting finalizers someone changed meanwhile. A refusal (an admission policy or
//! webhook, RBAC) is never taken for done: it is reported as a Warning Event and retried.

use kmm_api::ManagedClusterModule;
use kmm_runtime::events::EventType;
use kube::api::{Patch, PatchParams};
use kube::{Api, ResourceExt};
use serde_json::json;

pub use crate::fleet::assignment::FINALIZER;
use crate::serve::events::EventPublisher;

use super::error::ReconcileError;

/// Where the module stands with the hub's finalizer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Guard {
    /// It holds the finalizer: the hub acts on it.
    Held,
    /// It does not, and is not being deleted: the finalizer must be added first.
    Missing,
    /// It is being deleted and no longer holds it: nothing is left to do.
    Released,
}

pub fn guard(module: &ManagedClusterModule) -> Guard {
    let held = module.finalizers().iter().any(|f| f == FINALIZER);
    match (held, module.metadata.deletion_timestamp.is_some()) {
        (true, _) => Guard::Held,
        (false, false) => Guard::Missing,
        (false, true) => Guard::Released,
    }
}

/// The module's finalizers with the hub's added.
pub fn added(module: &ManagedClusterModule) -> Vec<String> {
    let mut finalizers = module.finalizers().to_vec();
    finalizers.push(FINALIZER.to_owned());
    finalizers
}

/// The module's finalizers without the hub's.
pub fn removed(module: &ManagedClusterModule) -> Vec<String> {
    module
        .finalizers()
        .iter()
        .filter(|f| *f != FINALIZER)
        .cloned()
        .collect()
}

/// Sets the module's finalizers to `finalizers`, provided the module is still at the
/// resourceVersion they were computed from. Only "gone already" counts as done.
pub async fn set(
    api: &Api<ManagedClusterModule>,
    events: &EventPublisher,
    module: &ManagedClusterModule,
    finalizers: Vec<String>,
    action: &'static str,
) -> Result<(), ReconcileError> {
    let name = module.name_any();
    let patch = json!({
        "metadata": {
            "resourceVersion": module.resource_version(),
            "finalizers": finalizers,
        },
    });
    match api
        .patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
        .await
    {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(s)) if s.code == 404 => Ok(()),
        Err(kube::Error::Api(s)) if s.code == 409 => Err(ReconcileError::Stale { name, action }),
        Err(source) => {
            events
                .publish(
                    module,
                    EventType::Warning,
                    "FinalizerPatchFailed",
                    "Reconcile",
                    format!("{action} failed, will retry: {source}"),
                )
                .await;
            Err(ReconcileError::Api {
                name,
                action,
                source,
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use kmm_api::testing::ModuleBuilder;

    use super::*;

    fn module(finalizers: &[&str], deleting: bool) -> ManagedClusterModule {
        let module = ModuleBuilder::new("m").finalizers(finalizers);
        if deleting { module.deleting() } else { module }.build()
    }

    #[test]
    fn the_guard_follows_the_finalizer_and_the_deletion() {
        assert_eq!(guard(&module(&[FINALIZER], false)), Guard::Held);
        assert_eq!(guard(&module(&[FINALIZER], true)), Guard::Held);
        assert_eq!(guard(&module(&["other"], false)), Guard::Missing);
        assert_eq!(guard(&module(&["other"], true)), Guard::Released);
    }

    #[test]
    fn other_finalizers_are_kept_in_their_order() {
        let held = module(&["a", FINALIZER, "b"], true);
        assert_eq!(removed(&held), ["a", "b"]);
        assert_eq!(added(&module(&["a"], false)), ["a", FINALIZER]);
    }
}
