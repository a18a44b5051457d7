//! Which revision of each module a cluster is served. Pure.
//!
//! A progressive module's selected cluster runs the revision its rollout record assigns
//! (an earlier one rebuilt from its kept `ControllerRevision`), or nothing before the
//! rollout reaches it; every other module, and every unload, is served as the current
//! object.

use std::hash::{Hash, Hasher};
use std::sync::Arc;

use k8s_openapi::api::apps::v1::ControllerRevision;
use kmm_api::{ManagedClusterModule, RolloutType};
use kube::ResourceExt;

use super::assignment::{ClusterFacts, is_deleting, is_selected};
use super::revisions::{Missing, Revisions, object_name};
use super::rollout::{Assigned, assigned};

/// Whether the module rolls out progressively: then each cluster runs the revision the
/// rollout record in its status assigns it.
pub fn is_progressive(module: &ManagedClusterModule) -> bool {
    module
        .spec
        .rollout_strategy
        .as_ref()
        .is_some_and(|s| s.type_ == RolloutType::Progressive)
}

/// A digest of which revision each cluster is assigned: a change (a cluster released)
/// must recompute the module's clusters even though its generation stayed.
pub fn assignment_key(module: &ManagedClusterModule) -> u64 {
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    if is_progressive(module) {
        let record = module.status.as_ref().and_then(|s| s.rollout.as_ref());
        record.map(|r| &r.base_revision).hash(&mut hasher);
        for cluster in record.iter().flat_map(|r| &r.clusters) {
            (&cluster.cluster, &cluster.revision).hash(&mut hasher);
        }
    }
    hasher.finish()
}

/// An earlier revision a cluster runs whose `ControllerRevision` is missing (first seen
/// missing now: worth saying once).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MissingRevision {
    pub module: String,
    pub revision: String,
}

/// The modules as `cluster` is to run them. `stored` finds a kept `ControllerRevision`
/// by its object name; a cluster on an earlier revision that is not kept gets nothing
/// for that module until the rollout moves it (and the revision is listed in `missing`).
pub fn at_revisions(
    modules: &[Arc<ManagedClusterModule>],
    cluster: &str,
    facts: Option<ClusterFacts<'_>>,
    revisions: &mut Revisions,
    stored: impl Fn(&str) -> Option<Arc<ControllerRevision>>,
    missing: &mut Vec<MissingRevision>,
) -> Vec<Arc<ManagedClusterModule>> {
    modules
        .iter()
        .filter_map(|module| {
            if !is_progressive(module) || is_deleting(module) || !is_selected(module, facts) {
                return Some(module.clone());
            }
            let current = revisions.current(module);
            let record = module.status.as_ref().and_then(|s| s.rollout.as_ref());
            match assigned(&current, record, cluster) {
                Assigned::Current => Some(module.clone()),
                Assigned::Nothing => None,
                Assigned::Earlier(revision) => {
                    let name = module.name_any();
                    let object = object_name(&name, revision);
                    let kept = revisions.earlier(module, revision, || stored(&object));
                    if let Err(Missing { newly: true }) = kept {
                        missing.push(MissingRevision {
                            module: name,
                            revision: revision.to_owned(),
                        });
                    }
                    kept.ok()
                }
            }
        })
        .collect()
}
