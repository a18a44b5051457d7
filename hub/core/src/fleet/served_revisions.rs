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

use super::assignment::{ClusterFacts, Selection, is_deleting, selection};
use super::revisions::{Missing, Revisions, object_name};
use super::rollout::{Assigned, assigned};
use crate::images::need::pin_generation;

/// Whether the module rolls out progressively: then each cluster runs the revision the
/// rollout record in its status assigns it.
pub fn is_progressive(module: &ManagedClusterModule) -> bool {
    module
        .spec
        .rollout_strategy
        .as_ref()
        .is_some_and(|s| s.type_ == RolloutType::Progressive)
}

/// A digest of which revision each cluster is assigned, and of the pin generation: a
/// change (a cluster released, a followed tag's new digest on record) must recompute the
/// module's clusters even though its generation stayed.
pub fn assignment_key(module: &ManagedClusterModule) -> u64 {
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    pin_generation(module).hash(&mut hasher);
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
            // A held cluster keeps the revision it was assigned, like a selected one.
            if !is_progressive(module)
                || is_deleting(module)
                || selection(module, facts) == Selection::Unselected
            {
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

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use kmm_api::testing::ModuleBuilder;

    use super::*;
    use crate::fleet::placements::Placed;
    use crate::fleet::revisions::{controller_revision, revision_of};

    fn mcm(image: &str, progressive: bool) -> ManagedClusterModule {
        let module = ModuleBuilder::new("hello")
            .uid("u1")
            .resource_version("1")
            .kernel_mappings(serde_json::json!([{"literal": "6.1", "containerImage": image}]));
        if progressive {
            module.with("/spec/rolloutStrategy/type", "Progressive")
        } else {
            module
        }
        .build()
    }

    /// `module` with a rollout record (clusters sorted, as records keep them): clusters
    /// not listed run `base`.
    fn with_record(
        mut module: ManagedClusterModule,
        base: Option<&str>,
        clusters: &[(&str, &str)],
    ) -> ManagedClusterModule {
        let record = serde_json::json!({
            "revision": revision_of(&module.spec.module_spec),
            "baseRevision": base,
            "state": "Progressing",
            "summary": "",
            "clusters": clusters.iter().map(|(cluster, revision)| serde_json::json!({
                "cluster": cluster, "revision": revision, "state": "ToApply",
                "since": "2026-01-01T00:00:00Z",
            })).collect::<Vec<_>>(),
        });
        module.status =
            Some(serde_json::from_value(serde_json::json!({"rollout": record})).unwrap());
        module
    }

    fn image(module: &ManagedClusterModule) -> String {
        let loader = module.spec.module_spec.module_loader.as_ref().unwrap();
        loader.container.kernel_mappings[0]
            .container_image
            .clone()
            .unwrap()
    }

    #[test]
    fn each_cluster_runs_what_the_rollout_record_assigns_it() {
        let v1 = mcm("r/x:1", true);
        let old = revision_of(&v1.spec.module_spec);
        let kept = Arc::new(controller_revision(&v1, &old, "kmm-hub"));
        let current = revision_of(&mcm("r/x:2", true).spec.module_spec);
        let module = Arc::new(with_record(
            mcm("r/x:2", true),
            Some(&old),
            &[("gone", "0123456789"), ("released", &current)],
        ));
        let labels = BTreeMap::new();
        let placed = Placed::new();
        let facts = Some(ClusterFacts {
            labels: &labels,
            placed: &placed,
            excuses: &Default::default(),
        });
        let mut revisions = Revisions::default();
        let stored = |object: &str| (object == kept.name_any()).then(|| kept.clone());
        let mut served = |cluster: &str, missing: &mut Vec<MissingRevision>| {
            at_revisions(
                std::slice::from_ref(&module),
                cluster,
                facts,
                &mut revisions,
                stored,
                missing,
            )
            .iter()
            .map(|m| image(m))
            .collect::<Vec<_>>()
        };
        let mut missing = Vec::new();
        assert_eq!(served("released", &mut missing), ["r/x:2"]);
        assert_eq!(
            served("waiting", &mut missing),
            ["r/x:1"],
            "the base revision"
        );
        assert!(missing.is_empty());
        assert!(served("gone", &mut missing).is_empty());
        assert_eq!(
            missing,
            [MissingRevision {
                module: "hello".into(),
                revision: "0123456789".into(),
            }]
        );
        // Said once, not at every recompute.
        assert!(served("gone", &mut missing).is_empty());
        assert_eq!(missing.len(), 1);
    }

    #[test]
    fn a_new_progressive_module_goes_nowhere_and_others_go_as_they_are() {
        let labels = BTreeMap::new();
        let placed = Placed::new();
        let facts = Some(ClusterFacts {
            labels: &labels,
            placed: &placed,
            excuses: &Default::default(),
        });
        let fresh = Arc::new(mcm("r/x:1", true));
        let plain = Arc::new(mcm("r/x:1", false));
        let mut missing = Vec::new();
        let served = at_revisions(
            &[fresh, plain.clone()],
            "a",
            facts,
            &mut Revisions::default(),
            |_| None,
            &mut missing,
        );
        assert_eq!(served.len(), 1);
        assert!(Arc::ptr_eq(&served[0], &plain));
        assert!(missing.is_empty());
        // A cluster that is not selected (no ManagedCluster) gets the current object:
        // whatever it still runs is unloaded from it.
        let fresh = Arc::new(mcm("r/x:1", true));
        let unselected = at_revisions(
            std::slice::from_ref(&fresh),
            "a",
            None,
            &mut Revisions::default(),
            |_| None,
            &mut missing,
        );
        assert!(Arc::ptr_eq(&unselected[0], &fresh));
    }

    #[test]
    fn the_assignment_key_follows_a_progressive_record_only() {
        let v2 = revision_of(&mcm("r/x:2", true).spec.module_spec);
        let before = with_record(mcm("r/x:2", true), Some("a1"), &[]);
        let released = with_record(mcm("r/x:2", true), Some("a1"), &[("c1", &v2)]);
        assert_ne!(assignment_key(&before), assignment_key(&released));
        let plain = with_record(mcm("r/x:2", false), Some("a1"), &[]);
        let plain_released = with_record(mcm("r/x:2", false), Some("a1"), &[("c1", &v2)]);
        assert_eq!(assignment_key(&plain), assignment_key(&plain_released));
        let mut moved = plain.clone();
        moved.status.as_mut().unwrap().pin_generation = Some(1);
        assert_ne!(
            assignment_key(&plain),
            assignment_key(&moved),
            "a followed tag's new digest on record"
        );
    }
}
