//! A cluster's snapshot as the hub holds it: its module intents shared with every other
//! cluster whose intents are the same. Clusters with the same kernels get identical
//! intents, so 3,500 clusters running 20 modules hold 20 intents per kernel set instead
//! of 70,000 copies. Pure.

use std::collections::HashMap;
use std::collections::hash_map::DefaultHasher;
use std::hash::{Hash, Hasher};
use std::sync::{Arc, Weak};

use kmm_proto::v1::{IntentSnapshot, ModuleIntent, PullCredential};
use prost::Message;

/// A snapshot whose intents are shared.
#[derive(Clone, Debug, Default)]
pub struct SharedSnapshot {
    pub revision: u64,
    pub modules: Vec<Arc<ModuleIntent>>,
    pub credentials: Vec<PullCredential>,
}

impl PartialEq for SharedSnapshot {
    /// Intents taken from one pool are equal exactly when they are the same: each
    /// recompute compares the new snapshot with the last one, and comparing the intents'
    /// contents (every kernel's target) was a twentieth of a busy hub's CPU.
    fn eq(&self, other: &Self) -> bool {
        self.revision == other.revision
            && self.credentials == other.credentials
            && self.modules.len() == other.modules.len()
            && self
                .modules
                .iter()
                .zip(&other.modules)
                .all(|(a, b)| Arc::ptr_eq(a, b) || a == b)
    }
}

impl SharedSnapshot {
    /// The complete message.
    pub fn to_wire(&self) -> IntentSnapshot {
        IntentSnapshot {
            revision: self.revision,
            modules: self
                .modules
                .iter()
                .map(|m| ModuleIntent::clone(m))
                .collect(),
            credentials: self.credentials.clone(),
            ..IntentSnapshot::default()
        }
    }

    /// The message for a stream that last carried `previous`: only what changed.
    pub fn delta_from(&self, previous: &SharedSnapshot) -> IntentSnapshot {
        kmm_proto::snapshot_delta(
            &previous.modules,
            &self.modules,
            self.revision,
            &self.credentials,
        )
    }
}

impl From<IntentSnapshot> for SharedSnapshot {
    /// A snapshot sharing nothing (each intent on its own).
    fn from(snapshot: IntentSnapshot) -> Self {
        Self {
            revision: snapshot.revision,
            modules: snapshot.modules.into_iter().map(Arc::new).collect(),
            credentials: snapshot.credentials,
        }
    }
}

/// Every intent some cluster's snapshot holds, by content: an intent equal to one held
/// already is that one. Holds no intent alive itself.
#[derive(Debug, Default)]
pub struct IntentPool {
    by_hash: HashMap<u64, Vec<Weak<ModuleIntent>>>,
    /// Entries after the last sweep: the next waits until they doubled.
    swept: usize,
    entries: usize,
}

impl IntentPool {
    /// The intent equal to `intent` held already, or `intent`, now held.
    pub fn intent(&mut self, intent: ModuleIntent) -> Arc<ModuleIntent> {
        let bucket = self.by_hash.entry(content_hash(&intent)).or_default();
        if let Some(held) = bucket
            .iter()
            .filter_map(Weak::upgrade)
            .find(|held| **held == intent)
        {
            return held;
        }
        let shared = Arc::new(intent);
        bucket.push(Arc::downgrade(&shared));
        self.entries += 1;
        shared
    }

    /// Forgets intents no snapshot holds any more, once the pool doubled since the last
    /// time, so that it stays as large as what is held.
    pub fn sweep(&mut self) {
        if self.entries <= 64 || self.entries <= 2 * self.swept {
            return;
        }
        self.by_hash.retain(|_, bucket| {
            bucket.retain(|weak| weak.strong_count() > 0);
            !bucket.is_empty()
        });
        self.entries = self.by_hash.values().map(Vec::len).sum();
        self.swept = self.entries;
    }

    /// How many distinct intents are held (by some snapshot or not yet swept).
    pub fn len(&self) -> usize {
        self.entries
    }

    pub fn is_empty(&self) -> bool {
        self.entries == 0
    }
}

/// A hash of an intent's content.
fn content_hash(intent: &ModuleIntent) -> u64 {
    let mut hasher = DefaultHasher::new();
    if let Some(key) = &intent.key {
        (&key.namespace, &key.name).hash(&mut hasher);
    }
    intent.generation.hash(&mut hasher);
    intent.unload.hash(&mut hasher);
    intent.node_selector.hash(&mut hasher);
    for toleration in &intent.tolerations {
        toleration.encode_to_vec().hash(&mut hasher);
    }
    for kernel in &intent.kernels {
        kernel.encode_to_vec().hash(&mut hasher);
    }
    hasher.finish()
}

#[cfg(test)]
mod tests {
    use kmm_proto::v1::{KernelTarget, ModuleKey};

    use super::*;

    fn intent(name: &str, kernels: &[&str]) -> ModuleIntent {
        ModuleIntent {
            key: Some(ModuleKey {
                namespace: "drivers".into(),
                name: name.into(),
            }),
            generation: 1,
            node_selector: [("a", "1"), ("b", "2"), ("c", "3")]
                .into_iter()
                .map(|(k, v)| (k.to_owned(), v.to_owned()))
                .collect(),
            kernels: kernels
                .iter()
                .map(|k| KernelTarget {
                    kernel: (*k).into(),
                    target: None,
                })
                .collect(),
            ..ModuleIntent::default()
        }
    }

    /// `snapshot` with its intents taken from `pool`, as the hub's snapshots hold them.
    fn share(pool: &mut IntentPool, snapshot: IntentSnapshot) -> SharedSnapshot {
        let shared = SharedSnapshot {
            revision: snapshot.revision,
            modules: snapshot
                .modules
                .into_iter()
                .map(|m| pool.intent(m))
                .collect(),
            credentials: snapshot.credentials,
        };
        pool.sweep();
        shared
    }

    fn snapshot(revision: u64, modules: Vec<ModuleIntent>) -> IntentSnapshot {
        IntentSnapshot {
            revision,
            modules,
            ..IntentSnapshot::default()
        }
    }

    #[test]
    fn equal_intents_of_different_clusters_are_held_once() {
        let mut pool = IntentPool::default();
        let one = share(
            &mut pool,
            snapshot(1, vec![intent("a", &["k1"]), intent("b", &["k1"])]),
        );
        let two = share(
            &mut pool,
            snapshot(7, vec![intent("a", &["k1"]), intent("b", &["k2"])]),
        );
        assert!(Arc::ptr_eq(&one.modules[0], &two.modules[0]), "same a");
        assert!(!Arc::ptr_eq(&one.modules[1], &two.modules[1]), "b differs");
        assert_eq!(pool.len(), 3);
        assert_eq!(two.revision, 7);
        assert_eq!(
            two.to_wire(),
            snapshot(7, vec![intent("a", &["k1"]), intent("b", &["k2"])]),
            "sharing changes no content"
        );
    }

    #[test]
    fn the_pool_forgets_what_no_snapshot_holds() {
        let mut pool = IntentPool::default();
        let kept = share(&mut pool, snapshot(1, vec![intent("kept", &["k"])]));
        for i in 0..200 {
            drop(share(
                &mut pool,
                snapshot(1, vec![intent(&format!("m{i}"), &["k"])]),
            ));
        }
        assert!(
            pool.len() < 150,
            "{} entries for one held intent",
            pool.len()
        );
        let again = share(&mut pool, snapshot(2, vec![intent("kept", &["k"])]));
        assert!(Arc::ptr_eq(&kept.modules[0], &again.modules[0]));
    }

    #[test]
    fn a_delta_is_what_changed_since_the_previous_snapshot() {
        let mut pool = IntentPool::default();
        let before = share(
            &mut pool,
            snapshot(1, vec![intent("a", &["k1"]), intent("b", &["k1"])]),
        );
        let after = share(
            &mut pool,
            snapshot(2, vec![intent("a", &["k1"]), intent("c", &["k1"])]),
        );
        let delta = after.delta_from(&before);
        assert!(delta.delta);
        assert_eq!(delta.revision, 2);
        assert_eq!(delta.modules, [intent("c", &["k1"])]);
        assert_eq!(delta.removed.len(), 1);
        assert_eq!(delta.removed[0].name, "b");
        assert_eq!(
            kmm_proto::apply_snapshot(Some(&before.to_wire()), delta),
            after.to_wire()
        );
    }

    #[test]
    fn snapshots_compare_by_content_whether_their_intents_are_shared_or_not() {
        let mut pool = IntentPool::default();
        let shared = share(&mut pool, snapshot(1, vec![intent("a", &["k1"])]));
        let again = share(&mut pool, snapshot(1, vec![intent("a", &["k1"])]));
        let unshared = SharedSnapshot::from(snapshot(1, vec![intent("a", &["k1"])]));
        let other = SharedSnapshot::from(snapshot(1, vec![intent("a", &["k2"])]));
        assert_eq!(shared, again);
        assert_eq!(shared, unshared);
        assert_ne!(shared, other);
        assert_ne!(
            shared,
            share(&mut pool, snapshot(2, vec![intent("a", &["k1"])]))
        );
        assert_ne!(shared, SharedSnapshot::from(snapshot(1, vec![])));
    }
}
