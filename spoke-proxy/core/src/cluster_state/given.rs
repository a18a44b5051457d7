//! What the proxy gave each node, with the loads and credentials the nodes have in
//! common held once: a cluster's nodes mostly run the same few kernels, so thousands of
//! nodes share each module's few loads instead of holding a copy each (at 5,000 nodes x
//! 20 modules the copies alone took more than the proxy's memory limit).

use std::collections::BTreeMap;
use std::sync::Arc;

use kmm_proto::v1::{ModuleLoad, NodeModule, PullCredential};

use crate::module_id::ModuleId;

/// What a node must do for one module: a [`NodeModule`] whose parts are shared.
#[derive(Clone, Debug, PartialEq)]
pub(super) struct Given {
    pub id: ModuleId,
    pub load: Option<Arc<ModuleLoad>>,
    pub credential: Option<Arc<PullCredential>>,
    pub unload: bool,
}

impl Given {
    /// The message the node's agent receives.
    pub fn message(&self) -> NodeModule {
        NodeModule {
            key: Some(self.id.key()),
            load: self.load.as_deref().cloned(),
            credential: self.credential.as_deref().cloned(),
            unload: self.unload,
        }
    }
}

/// One copy of each distinct load (per module) and credential the nodes were given.
#[derive(Default)]
pub(super) struct SharedParts {
    loads: BTreeMap<ModuleId, Vec<Arc<ModuleLoad>>>,
    credentials: Vec<Arc<PullCredential>>,
}

impl SharedParts {
    /// The shared copy of `load`, which becomes it if there is none yet. A module has one
    /// load per kernel the cluster runs (and the versions nodes keep during an upgrade),
    /// so the search is short.
    pub fn load(&mut self, id: &ModuleId, load: &ModuleLoad) -> Arc<ModuleLoad> {
        share(self.loads.entry(id.clone()).or_default(), load)
    }

    pub fn credential(&mut self, credential: &PullCredential) -> Arc<PullCredential> {
        share(&mut self.credentials, credential)
    }

    /// How many loads are held, of every module.
    #[cfg(test)]
    pub fn loads_held(&self) -> usize {
        self.loads.values().map(Vec::len).sum()
    }

    /// Forgets the copies no node holds any more.
    pub fn prune(&mut self) {
        self.loads.retain(|_, loads| {
            loads.retain(in_use);
            !loads.is_empty()
        });
        self.credentials.retain(in_use);
    }
}

/// Whether anybody besides the pool holds `part`.
fn in_use<T>(part: &Arc<T>) -> bool {
    Arc::strong_count(part) > 1
}

/// The copy in `pool` equal to `part`; a new one, kept there, if there is none.
fn share<T: PartialEq + Clone>(pool: &mut Vec<Arc<T>>, part: &T) -> Arc<T> {
    match pool.iter().find(|shared| ***shared == *part) {
        Some(shared) => Arc::clone(shared),
        None => {
            let shared = Arc::new(part.clone());
            pool.push(Arc::clone(&shared));
            shared
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(name: &str) -> ModuleId {
        ModuleId {
            namespace: "ns".into(),
            name: name.into(),
        }
    }

    fn load(image: &str) -> ModuleLoad {
        ModuleLoad {
            image: image.into(),
            version: "v1".into(),
            ..Default::default()
        }
    }

    #[test]
    fn equal_loads_of_a_module_are_held_once_and_others_apart() {
        let mut parts = SharedParts::default();
        let first = parts.load(&id("m"), &load("reg/m:6.1"));
        let again = parts.load(&id("m"), &load("reg/m:6.1"));
        assert!(Arc::ptr_eq(&first, &again));
        let other_kernel = parts.load(&id("m"), &load("reg/m:6.2"));
        assert!(!Arc::ptr_eq(&first, &other_kernel));
        let other_module = parts.load(&id("n"), &load("reg/m:6.1"));
        assert!(!Arc::ptr_eq(&first, &other_module), "kept per module");
    }

    #[test]
    fn pruning_forgets_only_what_nobody_holds() {
        let mut parts = SharedParts::default();
        let kept = parts.load(&id("m"), &load("reg/m:6.1"));
        drop(parts.load(&id("m"), &load("reg/m:6.2")));
        let credential = PullCredential {
            id: "pull".into(),
            content: None,
        };
        drop(parts.credential(&credential));
        parts.prune();
        assert!(Arc::ptr_eq(
            &kept,
            &parts.load(&id("m"), &load("reg/m:6.1"))
        ));
        assert_eq!(parts.loads[&id("m")].len(), 1, "6.2 forgotten");
        assert!(parts.credentials.is_empty());
    }

    #[test]
    fn the_message_carries_the_shared_parts() {
        let given = Given {
            id: id("m"),
            load: Some(Arc::new(load("reg/m:6.1"))),
            credential: Some(Arc::new(PullCredential {
                id: "pull".into(),
                content: None,
            })),
            unload: false,
        };
        let message = given.message();
        assert_eq!(message.key, Some(id("m").key()));
        assert_eq!(message.load.unwrap().image, "reg/m:6.1");
        assert_eq!(message.credential.unwrap().id, "pull");
    }
}
