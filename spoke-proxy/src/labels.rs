//! The ready labels a node must carry, and the JSON merge patch that gets it there while
//! touching only the label keys of modules the proxy knows. Pure.

use std::collections::BTreeMap;

use kmm_api::labels::{ready_label, version_ready_label};
use kmm_proto::v1::ModuleState;
use serde_json::{Map, Value};

use crate::agent_view::AgentView;
use crate::module_id::ModuleId;
use crate::node_status::Assessment;
use crate::placement::Placement;

/// What one module's labels on one node must become.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LabelIntent {
    /// The agent proved the current intent loaded: `ready`, and `version.ready` when the
    /// version is set.
    Set { version: String },
    /// The agent proved the module is not loaded.
    Remove,
}

/// Labels change only on proof: set once the current intent is proven loaded, removed
/// once the agent proves the module is not loaded (confirmed unload, failed load, or a
/// hello without it). Without proof either way they stay as they are.
pub fn label_intent(
    placement: &Placement,
    assessment: Option<&Assessment>,
    view: Option<&AgentView>,
    id: &ModuleId,
) -> Option<LabelIntent> {
    if let (Placement::Load(_), Some(a)) = (placement, assessment)
        && a.state == ModuleState::Loaded
    {
        return Some(LabelIntent::Set {
            version: a.loaded_version.clone(),
        });
    }
    let proof = view.and_then(|v| v.loaded.get(id));
    match (placement, view, proof) {
        // A held node still runs its version: its labels say which.
        (Placement::Held(_), _, Some(p)) => Some(LabelIntent::Set {
            version: p.version.clone(),
        }),
        (_, Some(_), None) => Some(LabelIntent::Remove),
        _ => None,
    }
}

/// The merge patch (`{"metadata":{"labels":{...}}}`) that applies `intents` to a node
/// with `current` labels, or `None` when the node already carries them.
pub fn merge_patch(
    current: &BTreeMap<String, String>,
    intents: &[(ModuleId, LabelIntent)],
) -> Option<Value> {
    let mut changes = Map::new();
    let mut want = |key: String, value: Option<&str>| {
        if current.get(&key).map(String::as_str) != value {
            changes.insert(key, value.map_or(Value::Null, |v| Value::String(v.into())));
        }
    };
    for (id, intent) in intents {
        let ready = ready_label(&id.namespace, &id.name);
        let version = version_ready_label(&id.namespace, &id.name);
        match intent {
            LabelIntent::Set { version: v } => {
                want(ready, Some(""));
                want(version, (!v.is_empty()).then_some(v.as_str()));
            }
            LabelIntent::Remove => {
                want(ready, None);
                want(version, None);
            }
        }
    }
    (!changes.is_empty()).then(|| serde_json::json!({ "metadata": { "labels": changes } }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::agent_view::LoadedProof;
    use serde_json::json;

    fn id() -> ModuleId {
        ModuleId {
            namespace: "ns".into(),
            name: "m".into(),
        }
    }

    fn assessment(state: ModuleState, version: &str) -> Assessment {
        Assessment {
            state,
            loaded_version: version.into(),
            reason: String::new(),
            message: String::new(),
        }
    }

    fn loaded_view() -> AgentView {
        let mut view = AgentView::default();
        view.loaded.insert(
            id(),
            LoadedProof {
                version: "v0".into(),
                image_digest: String::new(),
                revision: Some(1),
            },
        );
        view
    }

    #[test]
    fn set_only_when_loaded_for_the_current_load() {
        let load = Placement::Load(Box::default());
        let a = assessment(ModuleState::Loaded, "v1");
        assert_eq!(
            label_intent(&load, Some(&a), Some(&loaded_view()), &id()),
            Some(LabelIntent::Set {
                version: "v1".into()
            })
        );
        let pending = assessment(ModuleState::Pending, "");
        assert_eq!(
            label_intent(&load, Some(&pending), Some(&loaded_view()), &id()),
            None
        );
        assert_eq!(label_intent(&load, Some(&pending), None, &id()), None);
    }

    #[test]
    fn unload_requested_but_unconfirmed_keeps_labels() {
        let a = assessment(ModuleState::Loaded, "v0");
        assert_eq!(
            label_intent(&Placement::Unload, Some(&a), Some(&loaded_view()), &id()),
            None
        );
        assert_eq!(label_intent(&Placement::Unload, None, None, &id()), None);
    }

    #[test]
    fn removed_on_proof_of_absence() {
        let empty = AgentView::default();
        let unloaded = assessment(ModuleState::Unloaded, "");
        assert_eq!(
            label_intent(&Placement::Unload, Some(&unloaded), Some(&empty), &id()),
            Some(LabelIntent::Remove)
        );
        let failed = assessment(ModuleState::Failed, "");
        assert_eq!(
            label_intent(
                &Placement::Load(Box::default()),
                Some(&failed),
                Some(&empty),
                &id()
            ),
            Some(LabelIntent::Remove)
        );
    }

    #[test]
    fn patch_sets_and_removes_only_what_differs() {
        let set = [(
            id(),
            LabelIntent::Set {
                version: "v1".into(),
            },
        )];
        assert_eq!(
            merge_patch(&BTreeMap::new(), &set),
            Some(json!({"metadata": {"labels": {
                "kmm.node.kubernetes.io/ns.m.ready": "",
                "kmm.node.kubernetes.io/ns.m.version.ready": "v1",
            }}}))
        );
        let current: BTreeMap<String, String> = [
            (
                "kmm.node.kubernetes.io/ns.m.ready".to_string(),
                String::new(),
            ),
            (
                "kmm.node.kubernetes.io/ns.m.version.ready".to_string(),
                "v1".to_string(),
            ),
            ("other".to_string(), "kept".to_string()),
        ]
        .into();
        assert_eq!(merge_patch(&current, &set), None);
        assert_eq!(
            merge_patch(&current, &[(id(), LabelIntent::Remove)]),
            Some(json!({"metadata": {"labels": {
                "kmm.node.kubernetes.io/ns.m.ready": null,
                "kmm.node.kubernetes.io/ns.m.version.ready": null,
            }}}))
        );
        assert_eq!(
            merge_patch(&BTreeMap::new(), &[(id(), LabelIntent::Remove)]),
            None
        );
    }

    #[test]
    fn no_version_means_no_version_label() {
        let current: BTreeMap<String, String> = [(
            "kmm.node.kubernetes.io/ns.m.version.ready".to_string(),
            "old".to_string(),
        )]
        .into();
        assert_eq!(
            merge_patch(
                &current,
                &[(
                    id(),
                    LabelIntent::Set {
                        version: String::new()
                    }
                )]
            ),
            Some(json!({"metadata": {"labels": {
                "kmm.node.kubernetes.io/ns.m.ready": "",
                "kmm.node.kubernetes.io/ns.m.version.ready": null,
            }}}))
        );
    }
}
