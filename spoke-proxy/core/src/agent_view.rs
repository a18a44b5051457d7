//! What a node's agent has proven since it last said hello: which modules it has
//! loaded (and at which DesiredModules revision), and its last failures. Pure.
//!
//! An agent's events are bounded before they are kept: a load only of a module the
//! proxy sent the node, an unload also of one the agent holds loaded (its hello names at
//! most `AGENT_LOADED`), each error cut to [`ERROR_TEXT`] bytes and each version and
//! digest to [`MODULE_VERSION`], so a node's view holds at most one proof and one
//! failure per such module, and at most [`SHARED_KERNEL_MODULES`] kernel modules that
//! unloads left loaded for other modules.

use std::collections::BTreeMap;

use kmm_proto::limits::{ERROR_TEXT, MODULE_VERSION, truncated};
use kmm_proto::v1::{Action, AgentHello, KeptKernelModule, ModuleEvent, Outcome};

use crate::module_id::ModuleId;

/// Proof that a module is loaded.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LoadedProof {
    pub version: String,
    pub image_digest: String,
    /// The DesiredModules revision the load acted on; `None` when known from the
    /// agent's hello (loaded before this stream).
    pub revision: Option<u64>,
}

/// The most kernel modules left loaded for other modules a node's view keeps (the
/// newest): a node serves a handful of modules, which share fewer.
pub const SHARED_KERNEL_MODULES: usize = 64;
/// The bytes of a kernel module's name kept (the kernel allows 55).
const KERNEL_MODULE_NAME: usize = 64;

/// A kernel module that one module's unload left loaded because another module of the
/// node needs it: the two modules share it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SharedKernelModule {
    /// As the kernel names it.
    pub name: String,
    /// The module whose unload left it loaded.
    pub unloaded: ModuleId,
    /// The module that needs it.
    pub kept_for: ModuleId,
}

/// A failed attempt and the revision it acted on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Failure {
    pub action: Action,
    pub revision: u64,
    pub error: String,
}

/// An event refused: it names a module the proxy never sent the node.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
#[error(
    "ModuleEvent.key names module {module}, which the proxy did not send node {node:?} (and, for an unload, the agent does not hold loaded)"
)]
pub struct UnknownModule {
    pub node: String,
    pub module: ModuleId,
}

/// One node agent's proven state.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct AgentView {
    pub boot_id: String,
    pub kernel_release: String,
    pub loaded: BTreeMap<ModuleId, LoadedProof>,
    pub failures: BTreeMap<ModuleId, Failure>,
    /// What the latest unloads left loaded for other modules, oldest first: an event of
    /// either module replaces what it said.
    pub shared: Vec<SharedKernelModule>,
}

impl AgentView {
    /// The view after `hello`: exactly what the agent says it has loaded in this boot.
    pub fn from_hello(hello: &AgentHello) -> Self {
        Self {
            boot_id: hello.boot_id.clone(),
            kernel_release: hello.kernel_release.clone(),
            loaded: hello
                .loaded
                .iter()
                .map(|m| {
                    (
                        ModuleId::from_key(m.key.as_ref()),
                        LoadedProof {
                            version: truncated(&m.version, MODULE_VERSION).to_owned(),
                            image_digest: truncated(&m.image_digest, MODULE_VERSION).to_owned(),
                            revision: None,
                        },
                    )
                })
                .collect(),
            failures: BTreeMap::new(),
            shared: Vec::new(),
        }
    }

    /// Records one event of `node`'s agent. A failed load leaves nothing loaded (the
    /// agent rolls back what the attempt loaded, and replaces an old version only after
    /// unloading it); a failed unload leaves the module loaded. A load of a module `sent`
    /// denies (not in the node's DesiredModules), or an unload of one neither sent nor
    /// held loaded, is refused; failures of modules neither sent nor loaded are
    /// forgotten.
    pub fn record(
        &mut self,
        node: &str,
        event: &ModuleEvent,
        sent: impl Fn(&ModuleId) -> bool,
    ) -> Result<(), UnknownModule> {
        let id = ModuleId::from_key(event.key.as_ref());
        let action = Action::try_from(event.action).unwrap_or(Action::Unspecified);
        let unload_of_loaded = action == Action::Unload && self.loaded.contains_key(&id);
        if !sent(&id) && !unload_of_loaded {
            return Err(UnknownModule {
                node: node.to_owned(),
                module: id,
            });
        }
        self.failures
            .retain(|module, _| sent(module) || self.loaded.contains_key(module));
        let error = || truncated(&event.error, ERROR_TEXT).to_owned();
        let outcome = Outcome::try_from(event.outcome).unwrap_or(Outcome::Unspecified);
        // The agent confirms an unload again with every snapshot still asking for it: that
        // says nothing new about what the unload kept.
        let unload_again = action == Action::Unload && !self.loaded.contains_key(&id);
        if action != Action::Unspecified && outcome != Outcome::Unspecified && !unload_again {
            self.shared
                .retain(|shared| shared.unloaded != id && shared.kept_for != id);
        }
        match (action, outcome) {
            (Action::Load, Outcome::Succeeded) => {
                self.failures.remove(&id);
                self.loaded.insert(
                    id,
                    LoadedProof {
                        version: truncated(&event.version, MODULE_VERSION).to_owned(),
                        image_digest: truncated(&event.image_digest, MODULE_VERSION).to_owned(),
                        revision: Some(event.desired_revision),
                    },
                );
            }
            (Action::Unload, Outcome::Succeeded) => {
                self.failures.remove(&id);
                self.loaded.remove(&id);
                self.keep_shared(&id, &event.kept);
            }
            (Action::Load, Outcome::Failed) => {
                self.loaded.remove(&id);
                self.failures.insert(
                    id,
                    Failure {
                        action,
                        revision: event.desired_revision,
                        error: error(),
                    },
                );
            }
            (Action::Unload, Outcome::Failed) => {
                self.failures.insert(
                    id,
                    Failure {
                        action,
                        revision: event.desired_revision,
                        error: error(),
                    },
                );
            }
            // Nothing can be concluded from an event that does not say what happened.
            _ => {}
        }
        Ok(())
    }

    /// Notes what `unloaded`'s unload left loaded, for the modules still loaded on the
    /// node (another one was unloaded too, or is none of the proxy's business).
    fn keep_shared(&mut self, unloaded: &ModuleId, kept: &[KeptKernelModule]) {
        for kernel_module in kept {
            let name = truncated(&kernel_module.name, KERNEL_MODULE_NAME);
            for kept_for in kernel_module.needed_by.iter() {
                let kept_for = ModuleId::from_key(Some(kept_for));
                if kept_for != *unloaded && self.loaded.contains_key(&kept_for) {
                    self.shared.push(SharedKernelModule {
                        name: name.to_owned(),
                        unloaded: unloaded.clone(),
                        kept_for,
                    });
                }
            }
        }
        let excess = self.shared.len().saturating_sub(SHARED_KERNEL_MODULES);
        self.shared.drain(..excess);
    }

    /// The kernel modules `id` shares with other modules of the node: those its unload
    /// left loaded for them, and those their unloads left loaded for it.
    pub fn shared_by(&self, id: &ModuleId) -> impl Iterator<Item = &SharedKernelModule> {
        self.shared
            .iter()
            .filter(move |shared| shared.unloaded == *id || shared.kept_for == *id)
    }

    /// The bytes the view holds beyond its fixed size (strings, map entries; approximate,
    /// on the high side): what the bounds above keep small.
    pub fn bytes(&self) -> usize {
        const ENTRY: usize = 64;
        let id = |id: &ModuleId| id.namespace.len() + id.name.len() + ENTRY;
        self.boot_id.len()
            + self.kernel_release.len()
            + self
                .loaded
                .iter()
                .map(|(m, p)| id(m) + p.version.len() + p.image_digest.len())
                .sum::<usize>()
            + self
                .failures
                .iter()
                .map(|(m, f)| id(m) + f.error.len())
                .sum::<usize>()
            + self
                .shared
                .iter()
                .map(|s| s.name.len() + id(&s.unloaded) + id(&s.kept_for))
                .sum::<usize>()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kmm_proto::v1::{LoadedModule, ModuleKey};

    fn key(name: &str) -> ModuleKey {
        ModuleKey {
            namespace: "ns".into(),
            name: name.into(),
        }
    }

    fn id(name: &str) -> ModuleId {
        ModuleId::from_key(Some(&key(name)))
    }

    fn event(name: &str, action: Action, outcome: Outcome, revision: u64) -> ModuleEvent {
        ModuleEvent {
            key: Some(key(name)),
            action: action.into(),
            outcome: outcome.into(),
            version: "v1".into(),
            image_digest: "sha256:aa".into(),
            error: if outcome == Outcome::Failed {
                "modprobe: ERROR: could not insert 'm': Invalid argument".into()
            } else {
                String::new()
            },
            duration_ms: 5,
            desired_revision: revision,
            kept: Vec::new(),
        }
    }

    #[test]
    fn hello_replaces_everything_known() {
        let mut view = AgentView::default();
        view.record(
            "n",
            &event("old", Action::Load, Outcome::Succeeded, 1),
            |_| true,
        )
        .unwrap();
        let hello = AgentHello {
            node_name: "n".into(),
            boot_id: "b2".into(),
            kernel_release: "6.1".into(),
            agent_version: "0.1.0".into(),
            loaded: vec![LoadedModule {
                key: Some(key("m")),
                version: "v2".into(),
                image_digest: "sha256:bb".into(),
            }],
        };
        let view = AgentView::from_hello(&hello);
        assert_eq!(view.boot_id, "b2");
        assert_eq!(view.loaded.len(), 1);
        assert_eq!(
            view.loaded[&id("m")],
            LoadedProof {
                version: "v2".into(),
                image_digest: "sha256:bb".into(),
                revision: None
            }
        );
    }

    #[test]
    fn load_success_then_unload_success() {
        let mut view = AgentView::default();
        view.record(
            "n",
            &event("m", Action::Load, Outcome::Succeeded, 7),
            |_| true,
        )
        .unwrap();
        assert_eq!(view.loaded[&id("m")].revision, Some(7));
        view.record(
            "n",
            &event("m", Action::Unload, Outcome::Succeeded, 8),
            |_| true,
        )
        .unwrap();
        assert!(view.loaded.is_empty());
        assert!(view.failures.is_empty());
    }

    #[test]
    fn failed_load_means_not_loaded_and_keeps_the_error() {
        let mut view = AgentView::default();
        view.record(
            "n",
            &event("m", Action::Load, Outcome::Succeeded, 1),
            |_| true,
        )
        .unwrap();
        view.record("n", &event("m", Action::Load, Outcome::Failed, 2), |_| true)
            .unwrap();
        assert!(!view.loaded.contains_key(&id("m")));
        let failure = &view.failures[&id("m")];
        assert_eq!(failure.revision, 2);
        assert!(failure.error.contains("Invalid argument"));
        view.record(
            "n",
            &event("m", Action::Load, Outcome::Succeeded, 3),
            |_| true,
        )
        .unwrap();
        assert!(view.failures.is_empty());
    }

    #[test]
    fn failed_unload_keeps_the_module_loaded() {
        let mut view = AgentView::default();
        view.record(
            "n",
            &event("m", Action::Load, Outcome::Succeeded, 1),
            |_| true,
        )
        .unwrap();
        view.record("n", &event("m", Action::Unload, Outcome::Failed, 2), |_| {
            true
        })
        .unwrap();
        assert!(view.loaded.contains_key(&id("m")));
        assert_eq!(view.failures[&id("m")].action, Action::Unload);
    }

    #[test]
    fn events_of_modules_never_sent_are_refused_and_kept_nowhere() {
        let mut view = AgentView::default();
        let sent = |m: &ModuleId| &*m.name == "m";
        for i in 0..1_000 {
            let stranger = event(&format!("x{i}"), Action::Load, Outcome::Failed, 1);
            let refused = view.record("n", &stranger, sent).unwrap_err();
            assert_eq!(refused.module, id(&format!("x{i}")));
        }
        assert_eq!(view, AgentView::default());
        view.record("n", &event("m", Action::Load, Outcome::Succeeded, 1), sent)
            .unwrap();
        // No longer sent (the node was deselected, say), but loaded: its unload counts.
        let unloaded = event("m", Action::Unload, Outcome::Succeeded, 2);
        view.record("n", &unloaded, |_| false).unwrap();
        assert!(view.loaded.is_empty());
    }

    #[test]
    fn an_error_is_kept_cut_to_the_limit() {
        let mut view = AgentView::default();
        let huge = ModuleEvent {
            error: "é".repeat(1 << 20),
            ..event("m", Action::Load, Outcome::Failed, 1)
        };
        view.record("n", &huge, |_| true).unwrap();
        let kept = &view.failures[&id("m")].error;
        assert!(kept.len() <= ERROR_TEXT && kept.len() > ERROR_TEXT - 2);
        assert!(view.bytes() < 2 * ERROR_TEXT, "{}", view.bytes());
        let huge = ModuleEvent {
            version: "v".repeat(1 << 20),
            image_digest: "d".repeat(1 << 20),
            ..event("m", Action::Load, Outcome::Succeeded, 2)
        };
        view.record("n", &huge, |_| true).unwrap();
        let proof = &view.loaded[&id("m")];
        assert_eq!(proof.version.len(), MODULE_VERSION);
        assert_eq!(proof.image_digest.len(), MODULE_VERSION);
    }

    #[test]
    fn failures_of_modules_no_longer_sent_are_forgotten() {
        let mut view = AgentView::default();
        let failed = |name: &str| event(name, Action::Load, Outcome::Failed, 1);
        view.record("n", &failed("a"), |_| true).unwrap();
        view.record("n", &failed("b"), |m| &*m.name == "b").unwrap();
        assert_eq!(view.failures.keys().collect::<Vec<_>>(), [&id("b")]);
    }

    #[test]
    fn events_without_action_or_outcome_change_nothing() {
        let mut view = AgentView::default();
        view.record(
            "n",
            &event("m", Action::Unspecified, Outcome::Succeeded, 1),
            |_| true,
        )
        .unwrap();
        view.record(
            "n",
            &event("m", Action::Load, Outcome::Unspecified, 1),
            |_| true,
        )
        .unwrap();
        assert_eq!(view, AgentView::default());
    }

    fn kept(name: &str, needed_by: &[&str]) -> KeptKernelModule {
        KeptKernelModule {
            name: name.into(),
            needed_by: needed_by.iter().map(|m| key(m)).collect(),
        }
    }

    #[test]
    fn an_unload_that_kept_a_kernel_module_notes_it_on_both_modules_until_either_acts() {
        let mut view = AgentView::default();
        for m in ["first", "second"] {
            view.record("n", &event(m, Action::Load, Outcome::Succeeded, 1), |_| {
                true
            })
            .unwrap();
        }
        let unloaded = ModuleEvent {
            // "gone" is not loaded: nothing is kept for it.
            kept: vec![kept("kmm_hello", &["first", "gone"])],
            ..event("second", Action::Unload, Outcome::Succeeded, 2)
        };
        view.record("n", &unloaded, |_| true).unwrap();
        let shared = SharedKernelModule {
            name: "kmm_hello".into(),
            unloaded: id("second"),
            kept_for: id("first"),
        };
        assert_eq!(view.shared, std::slice::from_ref(&shared));
        assert_eq!(view.shared_by(&id("first")).collect::<Vec<_>>(), [&shared]);
        assert_eq!(view.shared_by(&id("second")).collect::<Vec<_>>(), [&shared]);
        // The unload confirmed again (the agent does with every snapshot asking for it).
        view.record(
            "n",
            &event("second", Action::Unload, Outcome::Succeeded, 3),
            |_| true,
        )
        .unwrap();
        assert_eq!(view.shared, std::slice::from_ref(&shared));
        // The module that kept it unloads too: the kernel module is gone, and so is the note.
        view.record(
            "n",
            &event("first", Action::Unload, Outcome::Succeeded, 3),
            |_| true,
        )
        .unwrap();
        assert!(view.shared.is_empty());
    }

    #[test]
    fn kept_kernel_modules_are_held_to_the_limit() {
        let mut view = AgentView::default();
        view.record(
            "n",
            &event("first", Action::Load, Outcome::Succeeded, 1),
            |_| true,
        )
        .unwrap();
        let name = "k".repeat(1 << 10);
        let unloaded = ModuleEvent {
            kept: (0..1_000).map(|_| kept(&name, &["first"])).collect(),
            ..event("second", Action::Unload, Outcome::Succeeded, 2)
        };
        view.record("n", &unloaded, |_| true).unwrap();
        assert_eq!(view.shared.len(), SHARED_KERNEL_MODULES);
        assert!(
            view.shared
                .iter()
                .all(|s| s.name.len() == KERNEL_MODULE_NAME)
        );
    }
}
