//! What a node's agent has proven since it last said hello: which modules it has
//! loaded (and at which DesiredModules revision), and its last failures. Pure.

use std::collections::BTreeMap;

use kmm_proto::v1::{Action, AgentHello, ModuleEvent, Outcome};

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

/// A failed attempt and the revision it acted on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Failure {
    pub action: Action,
    pub revision: u64,
    pub error: String,
}

/// One node agent's proven state.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct AgentView {
    pub boot_id: String,
    pub kernel_release: String,
    pub loaded: BTreeMap<ModuleId, LoadedProof>,
    pub failures: BTreeMap<ModuleId, Failure>,
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
                            version: m.version.clone(),
                            image_digest: m.image_digest.clone(),
                            revision: None,
                        },
                    )
                })
                .collect(),
            failures: BTreeMap::new(),
        }
    }

    /// Records one event. A failed load leaves nothing loaded (the agent rolls back what
    /// the attempt loaded, and replaces an old version only after unloading it); a failed
    /// unload leaves the module loaded.
    pub fn record(&mut self, event: &ModuleEvent) {
        let id = ModuleId::from_key(event.key.as_ref());
        let action = Action::try_from(event.action).unwrap_or(Action::Unspecified);
        let outcome = Outcome::try_from(event.outcome).unwrap_or(Outcome::Unspecified);
        match (action, outcome) {
            (Action::Load, Outcome::Succeeded) => {
                self.failures.remove(&id);
                self.loaded.insert(
                    id,
                    LoadedProof {
                        version: event.version.clone(),
                        image_digest: event.image_digest.clone(),
                        revision: Some(event.desired_revision),
                    },
                );
            }
            (Action::Unload, Outcome::Succeeded) => {
                self.failures.remove(&id);
                self.loaded.remove(&id);
            }
            (Action::Load, Outcome::Failed) => {
                self.loaded.remove(&id);
                self.failures.insert(
                    id,
                    Failure {
                        action,
                        revision: event.desired_revision,
                        error: event.error.clone(),
                    },
                );
            }
            (Action::Unload, Outcome::Failed) => {
                self.failures.insert(
                    id,
                    Failure {
                        action,
                        revision: event.desired_revision,
                        error: event.error.clone(),
                    },
                );
            }
            // Nothing can be concluded from an event that does not say what happened.
            _ => {}
        }
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
        }
    }

    #[test]
    fn hello_replaces_everything_known() {
        let mut view = AgentView::default();
        view.record(&event("old", Action::Load, Outcome::Succeeded, 1));
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
        view.record(&event("m", Action::Load, Outcome::Succeeded, 7));
        assert_eq!(view.loaded[&id("m")].revision, Some(7));
        view.record(&event("m", Action::Unload, Outcome::Succeeded, 8));
        assert!(view.loaded.is_empty());
        assert!(view.failures.is_empty());
    }

    #[test]
    fn failed_load_means_not_loaded_and_keeps_the_error() {
        let mut view = AgentView::default();
        view.record(&event("m", Action::Load, Outcome::Succeeded, 1));
        view.record(&event("m", Action::Load, Outcome::Failed, 2));
        assert!(!view.loaded.contains_key(&id("m")));
        let failure = &view.failures[&id("m")];
        assert_eq!(failure.revision, 2);
        assert!(failure.error.contains("Invalid argument"));
        view.record(&event("m", Action::Load, Outcome::Succeeded, 3));
        assert!(view.failures.is_empty());
    }

    #[test]
    fn failed_unload_keeps_the_module_loaded() {
        let mut view = AgentView::default();
        view.record(&event("m", Action::Load, Outcome::Succeeded, 1));
        view.record(&event("m", Action::Unload, Outcome::Failed, 2));
        assert!(view.loaded.contains_key(&id("m")));
        assert_eq!(view.failures[&id("m")].action, Action::Unload);
    }

    #[test]
    fn events_without_action_or_outcome_change_nothing() {
        let mut view = AgentView::default();
        view.record(&event("m", Action::Unspecified, Outcome::Succeeded, 1));
        view.record(&event("m", Action::Load, Outcome::Unspecified, 1));
        assert_eq!(view, AgentView::default());
    }
}
