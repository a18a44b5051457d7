//! The module intents built for the clusters' snapshots, kept by what each was built from,
//! so that clusters alike get the intent built for the first of them without building it
//! again. A module's intent for a cluster depends on the module object, whether the
//! cluster unloads it, the cluster's kernels and image mirrors, whether its pull Secret
//! exists, and the module's image records; a fleet-wide event recomputes every cluster,
//! and building every module's per-kernel targets for each of them, then finding the
//! equal intent held already, was a third of a busy hub's recompute. An intent that
//! depends on the cluster itself (the digests it resolved) is built every time. Pure.

use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;

use kmm_api::ManagedClusterModule;
use kmm_proto::v1::ModuleIntent;

use super::mirrors::ImageMirror;
use super::shared_snapshot::IntentPool;
use crate::images::ImageKey;

/// What a module's intent for one cluster is built from, besides the module itself and
/// whether the cluster unloads it.
#[derive(Clone, Copy, Debug)]
pub struct BuiltFrom<'a> {
    pub kernels: &'a BTreeSet<String>,
    pub mirrors: &'a [ImageMirror],
    /// Whether the module's `imageRepoSecret` names a Secret the hub has (or names none).
    pub secret_found: bool,
    /// The module's image records' version (see `ClusterImages::versions`).
    pub images_version: u64,
}

/// An intent, with what building it found besides.
#[derive(Clone, Debug)]
pub struct Built {
    pub intent: Arc<ModuleIntent>,
    /// Its images without a record yet.
    pub unchecked: BTreeSet<ImageKey>,
    /// The pull credential its loads name.
    pub needed: Option<String>,
}

/// The intents built for one module object.
#[derive(Debug)]
struct ForModule {
    /// Held so that the object's address, the key, names this object while it is kept.
    module: Arc<ManagedClusterModule>,
    /// The version of the module's image records every intent in `built` was built at.
    images_version: u64,
    built: Vec<(Inputs, Built)>,
}

/// What an intent was built from besides the module object and its image records.
#[derive(Debug, PartialEq)]
struct Inputs {
    unload: bool,
    kernels: BTreeSet<String>,
    mirrors: Vec<ImageMirror>,
    secret_found: bool,
}

impl Inputs {
    fn matches(&self, unload: bool, from: &BuiltFrom<'_>) -> bool {
        self.unload == unload
            && self.secret_found == from.secret_found
            && self.mirrors == from.mirrors
            && &self.kernels == from.kernels
    }
}

/// Every intent some snapshot holds, shared by content, and those built for module
/// objects the hub still holds, by what they were built from.
#[derive(Debug, Default)]
pub struct BuiltIntents {
    pool: IntentPool,
    /// By the module object's address.
    by_module: HashMap<usize, ForModule>,
    /// Module objects kept after the last sweep: the next waits until they doubled.
    swept: usize,
}

impl BuiltIntents {
    /// The intent built for `module` from `from`, if one was and it still holds: one built
    /// from older image records is forgotten.
    pub fn get(
        &mut self,
        module: &Arc<ManagedClusterModule>,
        unload: bool,
        from: &BuiltFrom<'_>,
    ) -> Option<&Built> {
        let kept = self.by_module.get_mut(&address(module))?;
        kept.moved_to(from.images_version);
        kept.built
            .iter()
            .find(|(inputs, _)| inputs.matches(unload, from))
            .map(|(_, built)| built)
    }

    /// Keeps `intent`, built for `module` from `from`, and returns it shared.
    pub fn keep(
        &mut self,
        module: &Arc<ManagedClusterModule>,
        unload: bool,
        from: &BuiltFrom<'_>,
        intent: ModuleIntent,
        unchecked: BTreeSet<ImageKey>,
        needed: Option<String>,
    ) -> Arc<ModuleIntent> {
        let built = Built {
            intent: self.pool.intent(intent),
            unchecked,
            needed,
        };
        let shared = built.intent.clone();
        let inputs = Inputs {
            unload,
            kernels: from.kernels.clone(),
            mirrors: from.mirrors.to_vec(),
            secret_found: from.secret_found,
        };
        let kept = self
            .by_module
            .entry(address(module))
            .or_insert_with(|| ForModule {
                module: module.clone(),
                images_version: from.images_version,
                built: Vec::new(),
            });
        kept.moved_to(from.images_version);
        kept.built.push((inputs, built));
        shared
    }

    /// `intent` shared by content, not kept by what it was built from (it depends on the
    /// cluster it was built for).
    pub fn share(&mut self, intent: ModuleIntent) -> Arc<ModuleIntent> {
        self.pool.intent(intent)
    }

    /// Forgets the intents of module objects nobody else holds any more (a newer object
    /// replaced them), once the objects kept doubled since the last time, and the shared
    /// intents no snapshot holds.
    pub fn sweep(&mut self) {
        self.pool.sweep();
        if self.by_module.len() <= 64 || self.by_module.len() <= 2 * self.swept {
            return;
        }
        self.by_module
            .retain(|_, kept| Arc::strong_count(&kept.module) > 1);
        self.swept = self.by_module.len();
    }

    /// How many module objects have intents kept.
    #[cfg(test)]
    pub fn modules_kept(&self) -> usize {
        self.by_module.len()
    }

    /// How many distinct intents are shared (see [`IntentPool::len`]).
    #[cfg(test)]
    pub fn shared_len(&self) -> usize {
        self.pool.len()
    }
}

impl ForModule {
    /// Forgets what was built from image records older than `images_version`.
    fn moved_to(&mut self, images_version: u64) {
        if self.images_version != images_version {
            self.built.clear();
            self.images_version = images_version;
        }
    }
}

fn address(module: &Arc<ManagedClusterModule>) -> usize {
    Arc::as_ptr(module) as usize
}

#[cfg(test)]
mod tests {
    use kmm_api::testing::ModuleBuilder;
    use kmm_proto::v1::{KernelTarget, ModuleKey};

    use super::*;

    fn module(name: &str) -> Arc<ManagedClusterModule> {
        Arc::new(ModuleBuilder::new(name).build())
    }

    fn intent(name: &str, kernel: &str) -> ModuleIntent {
        ModuleIntent {
            key: Some(ModuleKey {
                namespace: "drivers".into(),
                name: name.into(),
            }),
            kernels: vec![KernelTarget {
                kernel: kernel.into(),
                target: None,
            }],
            ..ModuleIntent::default()
        }
    }

    fn from(kernels: &BTreeSet<String>, images_version: u64) -> BuiltFrom<'_> {
        BuiltFrom {
            kernels,
            mirrors: &[],
            secret_found: true,
            images_version,
        }
    }

    #[test]
    fn an_intent_is_found_only_for_the_same_object_and_inputs() {
        let mut built = BuiltIntents::default();
        let hello = module("hello");
        let k1 = BTreeSet::from(["k1".to_owned()]);
        let k2 = BTreeSet::from(["k2".to_owned()]);
        let kept = built.keep(
            &hello,
            false,
            &from(&k1, 3),
            intent("hello", "k1"),
            BTreeSet::new(),
            Some("pull".into()),
        );
        let found = built.get(&hello, false, &from(&k1, 3)).unwrap();
        assert!(Arc::ptr_eq(&found.intent, &kept));
        assert_eq!(found.needed.as_deref(), Some("pull"));
        assert!(built.get(&hello, true, &from(&k1, 3)).is_none(), "unload");
        assert!(built.get(&hello, false, &from(&k2, 3)).is_none(), "kernels");
        let mirrored = BuiltFrom {
            mirrors: &[ImageMirror {
                source: "r".into(),
                mirror: "m".into(),
            }],
            ..from(&k1, 3)
        };
        assert!(built.get(&hello, false, &mirrored).is_none(), "mirrors");
        let no_secret = BuiltFrom {
            secret_found: false,
            ..from(&k1, 3)
        };
        assert!(built.get(&hello, false, &no_secret).is_none(), "secret");
        let same_content = module("hello");
        assert!(
            built.get(&same_content, false, &from(&k1, 3)).is_none(),
            "another object, even an equal one"
        );
        assert!(built.get(&hello, false, &from(&k1, 4)).is_none(), "records");
        assert!(
            built.get(&hello, false, &from(&k1, 3)).is_none(),
            "newer records forget what older ones built"
        );
    }

    #[test]
    fn equal_intents_are_shared_whether_kept_or_not() {
        let mut built = BuiltIntents::default();
        let k1 = BTreeSet::from(["k1".to_owned()]);
        let kept = built.keep(
            &module("hello"),
            false,
            &from(&k1, 0),
            intent("hello", "k1"),
            BTreeSet::new(),
            None,
        );
        assert!(Arc::ptr_eq(&kept, &built.share(intent("hello", "k1"))));
    }

    #[test]
    fn intents_of_objects_nobody_holds_are_forgotten() {
        let mut built = BuiltIntents::default();
        let k1 = BTreeSet::from(["k1".to_owned()]);
        let held = module("held");
        built.keep(
            &held,
            false,
            &from(&k1, 0),
            intent("held", "k1"),
            BTreeSet::new(),
            None,
        );
        for i in 0..200 {
            let name = format!("m{i}");
            built.keep(
                &module(&name),
                false,
                &from(&k1, 0),
                intent(&name, "k1"),
                BTreeSet::new(),
                None,
            );
            built.sweep();
        }
        assert!(
            built.modules_kept() < 150,
            "{} objects kept for one held",
            built.modules_kept()
        );
        assert!(built.shared_len() < 150, "{} intents", built.shared_len());
        assert!(built.get(&held, false, &from(&k1, 0)).is_some());
    }
}
