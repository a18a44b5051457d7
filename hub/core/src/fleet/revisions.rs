//! Revisions of a module's `spec.moduleSpec`, the unit a rollout moves across clusters.
//! Pure.
//!
//! A revision is named by a digest of the spec's content, so that a change made and
//! undone is the same revision, and a change of anything else (the selector, the strategy)
//! is none. A followed tag that moved (`imagePullPolicy: Always`) is a change too: the
//! module's pin generation (`status.pinGeneration`) is part of the revision, so that the
//! new digest rolls out like a new spec. Each one the hub serves is kept in a
//! `ControllerRevision` in the hub's namespace, as DaemonSets keep theirs: the spec a
//! cluster still runs after the module moved on must survive hub restarts.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;

use k8s_openapi::api::apps::v1::ControllerRevision;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use k8s_openapi::apimachinery::pkg::runtime::RawExtension;
use kmm_api::{ManagedClusterModule, ManagedClusterModuleStatus, ModuleSpec};
use kmm_proto::v1::ModuleIntent;
use kube::{Resource, ResourceExt};
use sha2::{Digest, Sha256};

use crate::images::need::pin_generation;

/// Label on every `ControllerRevision` of a module: the module's name.
pub const MODULE_LABEL: &str = "hub.kmm.sigs.x-k8s.io/module";
/// Label naming the revision itself.
pub const REVISION_LABEL: &str = "hub.kmm.sigs.x-k8s.io/revision";

/// The revision name of a spec: 10 hex digits of the digest of its JSON.
pub fn revision_of(spec: &ModuleSpec) -> String {
    let json = serde_json::to_vec(spec).expect("a ModuleSpec serialises");
    hex10(&json)
}

/// The revision name of a spec at a pin generation: the spec's alone at 0, so that
/// modules that never followed a moved tag keep the names they always had.
pub fn revision_at(spec: &ModuleSpec, pin_generation: i64) -> String {
    if pin_generation == 0 {
        return revision_of(spec);
    }
    let json = serde_json::to_vec(&serde_json::json!({
        "moduleSpec": spec,
        "pinGeneration": pin_generation,
    }))
    .expect("a ModuleSpec serialises");
    hex10(&json)
}

/// The module's current revision: its spec at the pin generation its status records.
pub fn module_revision(module: &ManagedClusterModule) -> String {
    revision_at(&module.spec.module_spec, pin_generation(module))
}

/// What tells a module's revisions apart where they run: the generation (its spec) and the
/// pin generation (the digests a followed tag moved to). An intent carries both, so that
/// a cluster's reports count for a revision only once it applied an intent of it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RevisionMark {
    pub generation: i64,
    pub pin_generation: i64,
}

impl RevisionMark {
    /// The mark of the module's current revision (none before the apiserver gave it a
    /// generation).
    pub fn of(module: &ManagedClusterModule) -> Option<Self> {
        Some(Self {
            generation: module.metadata.generation?,
            pin_generation: pin_generation(module),
        })
    }

    /// The mark of the revision an intent was made of.
    pub fn of_intent(intent: &ModuleIntent) -> Self {
        Self {
            generation: intent.generation,
            pin_generation: intent.pin_generation,
        }
    }
}

fn hex10(bytes: &[u8]) -> String {
    let digest = Sha256::digest(bytes);
    digest[..5].iter().map(|b| format!("{b:02x}")).collect()
}

/// The `ControllerRevision` name of `revision` of `module` (names of at most 253
/// characters).
pub fn object_name(module: &str, revision: &str) -> String {
    let prefix: String = module.chars().take(253 - 1 - revision.len()).collect();
    format!("{prefix}-{revision}")
}

/// The `ControllerRevision` keeping the module's current spec, owned by the module so
/// that it goes with it.
pub fn controller_revision(
    module: &ManagedClusterModule,
    revision: &str,
    namespace: &str,
) -> ControllerRevision {
    let name = module.name_any();
    ControllerRevision {
        metadata: ObjectMeta {
            name: Some(object_name(&name, revision)),
            namespace: Some(namespace.to_owned()),
            labels: Some(BTreeMap::from([
                (MODULE_LABEL.to_owned(), name),
                (REVISION_LABEL.to_owned(), revision.to_owned()),
            ])),
            owner_references: owner(module).map(|o| vec![o]),
            ..ObjectMeta::default()
        },
        data: Some(RawExtension(match pin_generation(module) {
            0 => serde_json::json!({"moduleSpec": module.spec.module_spec}),
            generation => serde_json::json!({
                "moduleSpec": module.spec.module_spec,
                "pinGeneration": generation,
            }),
        })),
        revision: module.metadata.generation.unwrap_or_default(),
    }
}

fn owner(module: &ManagedClusterModule) -> Option<OwnerReference> {
    Some(OwnerReference {
        api_version: ManagedClusterModule::api_version(&()).into_owned(),
        kind: ManagedClusterModule::kind(&()).into_owned(),
        name: module.name_any(),
        uid: module.metadata.uid.clone()?,
        ..OwnerReference::default()
    })
}

/// The module as it was at a stored revision: its current object (selection, finalizers,
/// deletion, node upgrade) with that revision's `moduleSpec`, generation and pin
/// generation (the only status it keeps: which digests its images load).
pub fn module_at(
    current: &ManagedClusterModule,
    stored: &ControllerRevision,
) -> Result<ManagedClusterModule, serde_json::Error> {
    let data = stored
        .data
        .as_ref()
        .map_or(&serde_json::Value::Null, |d| &d.0);
    let spec: ModuleSpec = serde_json::from_value(data["moduleSpec"].clone())?;
    let pinned: Option<i64> = serde_json::from_value(data["pinGeneration"].clone())?;
    let mut module = current.clone();
    module.spec.module_spec = spec;
    module.metadata.generation = Some(stored.revision);
    module.status = pinned.map(|generation| ManagedClusterModuleStatus {
        pin_generation: Some(generation),
        ..ManagedClusterModuleStatus::default()
    });
    Ok(module)
}

/// The current revision of each module, computed once per generation, and each earlier
/// revision's module, rebuilt only when the current object changes.
#[derive(Debug, Default)]
pub struct Revisions {
    /// Per module: its generation and pin generation, and the revision they make.
    current: HashMap<String, ((Option<i64>, i64), String)>,
    earlier: HashMap<(String, String), (Option<String>, Arc<ManagedClusterModule>)>,
    /// (module, revision) found missing since last found: said once, not per recompute.
    missing: HashSet<(String, String)>,
}

/// An earlier revision that is not kept (or unreadable).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Missing {
    /// It was found, or not looked for, before: its absence is worth saying once.
    pub newly: bool,
}

impl Revisions {
    /// The module's current revision.
    pub fn current(&mut self, module: &ManagedClusterModule) -> String {
        let made_of = (module.metadata.generation, pin_generation(module));
        let entry = self
            .current
            .entry(module.name_any())
            .or_insert_with(|| (made_of, module_revision(module)));
        if entry.0 != made_of {
            *entry = (made_of, module_revision(module));
        }
        entry.1.clone()
    }

    /// The module at an earlier `revision`; `Err` when `stored` (the kept
    /// `ControllerRevision`) is missing or unreadable.
    pub fn earlier(
        &mut self,
        current: &ManagedClusterModule,
        revision: &str,
        stored: impl FnOnce() -> Option<Arc<ControllerRevision>>,
    ) -> Result<Arc<ManagedClusterModule>, Missing> {
        let key = (current.name_any(), revision.to_owned());
        let version = current.metadata.resource_version.clone();
        if let Some((seen, module)) = self.earlier.get(&key)
            && *seen == version
        {
            return Ok(module.clone());
        }
        let module = stored().and_then(|stored| module_at(current, &stored).ok());
        let Some(module) = module.map(Arc::new) else {
            let newly = self.missing.insert(key);
            return Err(Missing { newly });
        };
        self.missing.remove(&key);
        self.earlier.insert(key, (version, module.clone()));
        Ok(module)
    }

    /// Forgets every module `keep` refuses (deleted modules).
    pub fn retain(&mut self, keep: impl Fn(&str) -> bool) {
        self.current.retain(|name, _| keep(name));
        self.earlier.retain(|(name, _), _| keep(name));
        self.missing.retain(|(name, _)| keep(name));
    }
}

#[cfg(test)]
mod tests {
    use kmm_api::testing::ModuleBuilder;

    use super::*;

    fn mcm(generation: i64, image: &str) -> ManagedClusterModule {
        ModuleBuilder::new("hello")
            .uid("u1")
            .generation(generation)
            .resource_version(&generation.to_string())
            .selector(&[("env", "prod")])
            .kernel_mappings(serde_json::json!([{"literal": "6.1", "containerImage": image}]))
            .build()
    }

    #[test]
    fn a_revision_names_the_module_spec_alone() {
        let v1 = mcm(1, "r/hello:1");
        let mut reselected = mcm(2, "r/hello:1");
        reselected.spec.selector.insert("zone".into(), "a".into());
        assert_eq!(
            revision_of(&v1.spec.module_spec),
            revision_of(&reselected.spec.module_spec)
        );
        let v2 = mcm(3, "r/hello:2");
        assert_ne!(
            revision_of(&v1.spec.module_spec),
            revision_of(&v2.spec.module_spec)
        );
        assert_eq!(revision_of(&v1.spec.module_spec).len(), 10);
    }

    #[test]
    fn a_stored_revision_gives_back_its_spec_on_the_current_object() {
        let v1 = mcm(1, "r/hello:1");
        let stored = controller_revision(&v1, &revision_of(&v1.spec.module_spec), "kmm-hub");
        assert_eq!(
            stored.metadata.owner_references.as_ref().unwrap()[0].uid,
            "u1"
        );
        assert_eq!(stored.revision, 1);
        let mut v2 = mcm(4, "r/hello:2");
        v2.metadata.finalizers = Some(vec!["f".into()]);
        let back = module_at(&v2, &stored).unwrap();
        assert_eq!(back.spec.module_spec, v1.spec.module_spec);
        assert_eq!(back.metadata.generation, Some(1));
        assert_eq!(back.metadata.finalizers, v2.metadata.finalizers);
    }

    #[test]
    fn earlier_modules_are_rebuilt_only_when_the_current_object_changes() {
        let v1 = mcm(1, "r/hello:1");
        let r1 = revision_of(&v1.spec.module_spec);
        let stored = Arc::new(controller_revision(&v1, &r1, "kmm-hub"));
        let mut revisions = Revisions::default();
        let v2 = mcm(2, "r/hello:2");
        let first = revisions
            .earlier(&v2, &r1, || Some(stored.clone()))
            .unwrap();
        let again = revisions.earlier(&v2, &r1, || None).unwrap();
        assert!(Arc::ptr_eq(&first, &again));
        let v3 = mcm(3, "r/hello:3");
        assert_eq!(
            revisions.earlier(&v3, &r1, || None).unwrap_err(),
            Missing { newly: true }
        );
        assert_eq!(
            revisions.earlier(&v3, &r1, || None).unwrap_err(),
            Missing { newly: false },
            "a revision still missing is said once"
        );
        assert_ne!(revisions.current(&v2), revisions.current(&v3));
        revisions
            .earlier(&v3, &r1, || Some(stored.clone()))
            .unwrap();
        assert_eq!(
            revisions.earlier(&mcm(4, "r/hello:4"), &r1, || None),
            Err(Missing { newly: true }),
            "found again, then lost again: said again"
        );
    }

    fn pinned(mut module: ManagedClusterModule, generation: i64) -> ManagedClusterModule {
        module.status = Some(ManagedClusterModuleStatus {
            pin_generation: Some(generation),
            ..ManagedClusterModuleStatus::default()
        });
        module
    }

    #[test]
    fn a_followed_tag_move_is_a_new_revision_kept_with_its_pin_generation() {
        let v1 = mcm(1, "r/hello:1");
        let at0 = module_revision(&v1);
        assert_eq!(
            at0,
            revision_of(&v1.spec.module_spec),
            "names before 0 stay"
        );
        let moved = pinned(v1.clone(), 1);
        let at1 = module_revision(&moved);
        assert_ne!(at0, at1, "the same spec, another digest: another revision");
        assert_ne!(at1, module_revision(&pinned(v1.clone(), 2)));
        let mut revisions = Revisions::default();
        assert_eq!(revisions.current(&v1), at0);
        assert_eq!(revisions.current(&moved), at1, "recomputed on a move alone");

        // Kept with it: the cluster on it loads that generation's digests.
        let stored = Arc::new(controller_revision(&moved, &at1, "kmm-hub"));
        let later = pinned(mcm(2, "r/hello:2"), 3);
        let back = module_at(&later, &stored).unwrap();
        assert_eq!(pin_generation(&back), 1);
        assert_eq!(module_revision(&back), at1);
        let first = controller_revision(&v1, &at0, "kmm-hub");
        assert_eq!(
            first.data.as_ref().unwrap().0,
            serde_json::json!({"moduleSpec": v1.spec.module_spec}),
            "a revision without a move is kept as before"
        );
        assert_eq!(pin_generation(&module_at(&later, &first).unwrap()), 0);
    }

    #[test]
    fn long_module_names_still_give_valid_object_names() {
        let name = "m".repeat(253);
        assert_eq!(object_name(&name, "0123456789").len(), 253);
        assert_eq!(object_name("hello", "0123456789"), "hello-0123456789");
    }
}
