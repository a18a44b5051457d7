//! The labels a node must carry for each module: upstream's ready labels and
//! `device-plugin-ready`, and kmm-fleet's own label that schedules a module's device
//! plugin there; and the JSON merge patch that gets the node there while touching only
//! the label keys of modules the proxy knows. Pure.

use std::collections::BTreeMap;

use kmm_api::labels::{
    device_plugin_ready_label, device_plugin_scheduling_label, ready_label, version_ready_label,
};
use kmm_proto::v1::ModuleState;
use serde_json::{Map, Value};

use crate::agent_view::AgentView;
use crate::module_id::ModuleId;
use crate::node_status::Assessment;
use crate::node_upgrade::Hold;
use crate::placement::Placement;

/// What one module's ready labels and device plugin scheduling label on one node must
/// become.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LabelIntent {
    /// The agent proved the current intent loaded: `ready`, and `version.ready` when the
    /// version is set; the device plugin scheduled when the module has one to run.
    Set {
        version: String,
        device_plugin: bool,
    },
    /// The module is about to be replaced or unloaded: its device plugin must stop first
    /// (unscheduled); the ready labels stay until proof.
    StopDevicePlugin,
    /// The agent proved the module is not loaded.
    Remove,
    /// A module that loads nothing: never a ready label; its device plugin scheduled on
    /// the node or not.
    DevicePluginOnly { scheduled: bool },
}

/// One module's labels on one node.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ModuleLabels {
    pub id: ModuleId,
    /// The ready labels and the scheduling label; `None`: they stay as they are.
    pub intent: Option<LabelIntent>,
    /// Whether the module's device plugin Pod on the node is Ready (`false` when there is
    /// none); `None` until the proxy has listed the plugins' Pods.
    pub plugin_ready: Option<bool>,
}

/// Labels change only on proof: set once the current intent is proven loaded, removed
/// once the agent proves the module is not loaded (confirmed unload, failed load, or a
/// hello without it). Without proof either way they stay as they are, but for the device
/// plugin's scheduling label, which goes as soon as the node is to change what it runs.
pub fn label_intent(
    placement: &Placement,
    assessment: Option<&Assessment>,
    view: Option<&AgentView>,
    id: &ModuleId,
    has_device_plugin: bool,
) -> Option<LabelIntent> {
    if let (Placement::Load(_), Some(a)) = (placement, assessment)
        && a.state == ModuleState::Loaded
    {
        return Some(LabelIntent::Set {
            version: a.loaded_version.clone(),
            device_plugin: has_device_plugin,
        });
    }
    let proof = view.and_then(|v| v.loaded.get(id));
    match (placement, view, proof) {
        // A held node still runs its version: its labels say which, and its device
        // plugin keeps running unless it is held for that plugin to stop.
        (Placement::Held(held), _, Some(p)) => Some(LabelIntent::Set {
            version: p.version.clone(),
            device_plugin: has_device_plugin
                && !matches!(held.hold, Hold::DevicePluginStopping { .. }),
        }),
        (_, Some(_), None) => Some(LabelIntent::Remove),
        // No image can be given to the node for now (not found, its pull Secret missing
        // while it rotates, no target for its kernel yet): nothing is sent, so what it runs
        // keeps running, labelled, its device plugin too; its status says why.
        (Placement::Unresolved(_) | Placement::AwaitingKernel, Some(_), Some(p)) => {
            Some(LabelIntent::Set {
                version: p.version.clone(),
                device_plugin: has_device_plugin,
            })
        }
        // Nothing is sent to a node whose agent runs another kernel: what it runs stays,
        // and so do its labels, device plugin's included.
        (Placement::KernelMismatch { .. }, _, Some(_)) => None,
        // The version it is to run, not proven for the current intent yet (an agent
        // reconnecting, say): nothing changes for the plugin either.
        (Placement::Load(load), Some(_), Some(p)) if p.version == load.version => None,
        (_, Some(_), Some(_)) => Some(LabelIntent::StopDevicePlugin),
        _ => None,
    }
}

/// The labels of a module that loads nothing (its intent's `device_plugin_only`): its
/// device plugin is scheduled on every node the module selects, and unscheduled as soon as
/// the node is to lose it (deselected, or the module unloaded).
pub fn device_plugin_only_intent(
    placement: &Placement,
    has_device_plugin: bool,
) -> Option<LabelIntent> {
    match placement {
        Placement::DevicePluginOnly => Some(LabelIntent::DevicePluginOnly {
            scheduled: has_device_plugin,
        }),
        Placement::Unload | Placement::Held(_) => {
            Some(LabelIntent::DevicePluginOnly { scheduled: false })
        }
        _ => None,
    }
}

/// Whether `device-plugin-ready` must be on the node (`None`: as it is). Upstream's
/// meaning: the plugin's Pod there is Ready. It goes at once when the plugin is no longer
/// scheduled there (`scheduled`: the scheduling label after the patch), before the Pod
/// stops, so that no workload is placed on a plugin about to go; until the Pods are
/// listed, nothing is known of their readiness.
pub fn device_plugin_ready(scheduled: bool, plugin_ready: Option<bool>) -> Option<bool> {
    if scheduled { plugin_ready } else { Some(false) }
}

/// The merge patch (`{"metadata":{"labels":{...}}}`) that gives a node with `current`
/// labels those of `modules`, or `None` when the node already carries them.
pub fn merge_patch(current: &BTreeMap<String, String>, modules: &[ModuleLabels]) -> Option<Value> {
    let mut changes = Map::new();
    let mut want = |key: String, value: Option<&str>| {
        if current.get(&key).map(String::as_str) != value {
            changes.insert(key, value.map_or(Value::Null, |v| Value::String(v.into())));
        }
    };
    for module in modules {
        let (namespace, name) = (&module.id.namespace, &module.id.name);
        let ready = ready_label(namespace, name);
        let version = version_ready_label(namespace, name);
        let scheduling = device_plugin_scheduling_label(namespace, name);
        let scheduled = match &module.intent {
            Some(LabelIntent::Set {
                version: v,
                device_plugin,
            }) => {
                want(ready, Some(""));
                want(version, (!v.is_empty()).then_some(v.as_str()));
                *device_plugin
            }
            Some(LabelIntent::StopDevicePlugin) => false,
            Some(LabelIntent::Remove) => {
                want(ready, None);
                want(version, None);
                false
            }
            Some(LabelIntent::DevicePluginOnly { scheduled }) => {
                want(ready, None);
                want(version, None);
                *scheduled
            }
            None => current.contains_key(&scheduling),
        };
        if module.intent.is_some() {
            want(scheduling, scheduled.then_some(""));
        }
        if let Some(on) = device_plugin_ready(scheduled, module.plugin_ready) {
            want(device_plugin_ready_label(namespace, name), on.then_some(""));
        }
    }
    (!changes.is_empty()).then(|| serde_json::json!({ "metadata": { "labels": changes } }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::agent_view::LoadedProof;
    use serde_json::json;
    use std::sync::Arc;

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

    /// `intent`'s labels, the plugin's Pods not listed yet.
    fn labels(intent: LabelIntent) -> ModuleLabels {
        ModuleLabels {
            id: id(),
            intent: Some(intent),
            plugin_ready: None,
        }
    }

    const SCHEDULING: &str = "device-plugin.kmm.sigs.x-k8s.io/ns.m";
    const DEVICE_PLUGIN_READY: &str = "kmm.node.kubernetes.io/ns.m.device-plugin-ready";

    fn node_labels(keys: &[&str]) -> BTreeMap<String, String> {
        keys.iter()
            .map(|k| ((*k).to_owned(), String::new()))
            .collect()
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
        let load = Placement::Load(Arc::default());
        let a = assessment(ModuleState::Loaded, "v1");
        assert_eq!(
            label_intent(&load, Some(&a), Some(&loaded_view()), &id(), false),
            Some(LabelIntent::Set {
                version: "v1".into(),
                device_plugin: false,
            })
        );
        let pending = assessment(ModuleState::Pending, "");
        assert_eq!(
            label_intent(&load, Some(&pending), Some(&loaded_view()), &id(), false),
            Some(LabelIntent::StopDevicePlugin),
            "moving to another load: only the device plugin label goes"
        );
        assert_eq!(
            label_intent(&load, Some(&pending), None, &id(), false),
            None
        );
    }

    #[test]
    fn a_loaded_node_whose_image_is_unavailable_for_now_keeps_its_labels_and_device_plugin() {
        let unresolved = Placement::Unresolved(kmm_proto::v1::Unresolved {
            reason: "PullSecretNotFound".into(),
            message: "Secret \"pull\" not found".into(),
        });
        for placement in [unresolved, Placement::AwaitingKernel] {
            assert_eq!(
                label_intent(&placement, None, Some(&loaded_view()), &id(), true),
                Some(LabelIntent::Set {
                    version: "v0".into(),
                    device_plugin: true,
                }),
                "{placement:?}"
            );
            assert_eq!(
                label_intent(&placement, None, Some(&AgentView::default()), &id(), true),
                Some(LabelIntent::Remove),
                "{placement:?}: a node proven without it loses its labels"
            );
        }
    }

    #[test]
    fn unload_requested_but_unconfirmed_keeps_labels_but_stops_the_device_plugin() {
        let a = assessment(ModuleState::Loaded, "v0");
        assert_eq!(
            label_intent(
                &Placement::Unload,
                Some(&a),
                Some(&loaded_view()),
                &id(),
                true
            ),
            Some(LabelIntent::StopDevicePlugin)
        );
        assert_eq!(
            merge_patch(&BTreeMap::new(), &[labels(LabelIntent::StopDevicePlugin)]),
            None,
            "the ready labels are not touched"
        );
        assert_eq!(
            label_intent(&Placement::Unload, None, None, &id(), false),
            None
        );
    }

    #[test]
    fn removed_on_proof_of_absence() {
        let empty = AgentView::default();
        let unloaded = assessment(ModuleState::Unloaded, "");
        assert_eq!(
            label_intent(
                &Placement::Unload,
                Some(&unloaded),
                Some(&empty),
                &id(),
                false
            ),
            Some(LabelIntent::Remove)
        );
        let failed = assessment(ModuleState::Failed, "");
        assert_eq!(
            label_intent(
                &Placement::Load(Arc::default()),
                Some(&failed),
                Some(&empty),
                &id(),
                false
            ),
            Some(LabelIntent::Remove)
        );
    }

    #[test]
    fn a_kernel_mismatch_sets_nothing_and_leaves_what_runs_labelled() {
        let mismatch = Placement::KernelMismatch {
            kubelet: "6.1".into(),
            agent: "6.2".into(),
        };
        let failed = assessment(ModuleState::Failed, "");
        assert_eq!(
            label_intent(&mismatch, Some(&failed), Some(&loaded_view()), &id(), true),
            None
        );
        assert_eq!(
            label_intent(
                &mismatch,
                Some(&failed),
                Some(&AgentView::default()),
                &id(),
                false
            ),
            Some(LabelIntent::Remove),
            "proven not loaded"
        );
    }

    #[test]
    fn patch_sets_and_removes_only_what_differs() {
        let set = [labels(LabelIntent::Set {
            version: "v1".into(),
            device_plugin: false,
        })];
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
            merge_patch(&current, &[labels(LabelIntent::Remove)]),
            Some(json!({"metadata": {"labels": {
                "kmm.node.kubernetes.io/ns.m.ready": null,
                "kmm.node.kubernetes.io/ns.m.version.ready": null,
            }}}))
        );
        assert_eq!(
            merge_patch(&BTreeMap::new(), &[labels(LabelIntent::Remove)]),
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
                &[labels(LabelIntent::Set {
                    version: String::new(),
                    device_plugin: false,
                })]
            ),
            Some(json!({"metadata": {"labels": {
                "kmm.node.kubernetes.io/ns.m.ready": "",
                "kmm.node.kubernetes.io/ns.m.version.ready": null,
            }}}))
        );
    }

    #[test]
    fn a_node_running_its_target_version_keeps_its_plugin_until_proven_otherwise() {
        let load = Placement::Load(Arc::new(kmm_proto::v1::ModuleLoad {
            version: "v0".into(),
            ..Default::default()
        }));
        let pending = assessment(ModuleState::Pending, "");
        assert_eq!(
            label_intent(&load, Some(&pending), Some(&loaded_view()), &id(), true),
            None
        );
    }

    #[test]
    fn the_device_plugin_is_scheduled_with_the_load_and_unscheduled_before_a_hold_for_it() {
        let load = Placement::Load(Arc::default());
        let a = assessment(ModuleState::Loaded, "v1");
        let set = label_intent(&load, Some(&a), Some(&loaded_view()), &id(), true).unwrap();
        assert_eq!(
            merge_patch(&BTreeMap::new(), &[labels(set)]),
            Some(json!({"metadata": {"labels": {
                "kmm.node.kubernetes.io/ns.m.ready": "",
                "kmm.node.kubernetes.io/ns.m.version.ready": "v1",
                SCHEDULING: "",
            }}})),
            "scheduled, not ready: no Pod runs yet"
        );
        let held = |hold| {
            Placement::Held(Box::new(crate::placement::Held {
                hold,
                running: Some("v0".into()),
                target: "v1".into(),
                keep: None,
            }))
        };
        let waiting = held(Hold::Waiting { max: 1 });
        assert_eq!(
            label_intent(&waiting, None, Some(&loaded_view()), &id(), true),
            Some(LabelIntent::Set {
                version: "v0".into(),
                device_plugin: true
            }),
            "a node waiting its turn keeps running its plugin"
        );
        let stopping = held(Hold::DevicePluginStopping { unload: false });
        assert_eq!(
            label_intent(&stopping, None, Some(&loaded_view()), &id(), true),
            Some(LabelIntent::Set {
                version: "v0".into(),
                device_plugin: false
            })
        );
    }

    /// Each step of a plugin's life on a loaded node, with the labels it leaves.
    #[test]
    fn device_plugin_ready_follows_the_plugin_pods_readiness() {
        let loaded = || {
            Some(LabelIntent::Set {
                version: "v1".into(),
                device_plugin: true,
            })
        };
        let patch = |current: &[&str], intent: Option<LabelIntent>, plugin_ready| {
            let module = ModuleLabels {
                id: id(),
                intent,
                plugin_ready,
            };
            let mut current = node_labels(current);
            current.insert("kmm.node.kubernetes.io/ns.m.ready".into(), String::new());
            current.insert(
                "kmm.node.kubernetes.io/ns.m.version.ready".into(),
                "v1".into(),
            );
            merge_patch(&current, &[module]).map(|p| p["metadata"]["labels"].clone())
        };
        assert_eq!(
            patch(&[], loaded(), Some(false)),
            Some(json!({SCHEDULING: ""})),
            "the Pod pending: scheduled, not ready"
        );
        assert_eq!(patch(&[SCHEDULING], loaded(), Some(false)), None);
        assert_eq!(
            patch(&[SCHEDULING], loaded(), Some(true)),
            Some(json!({DEVICE_PLUGIN_READY: ""})),
            "the Pod Ready"
        );
        let ready = [SCHEDULING, DEVICE_PLUGIN_READY];
        assert_eq!(patch(&ready, loaded(), Some(true)), None);
        assert_eq!(
            patch(&ready, None, Some(false)),
            Some(json!({DEVICE_PLUGIN_READY: null})),
            "the Pod not Ready again (or deleted), whatever else holds"
        );
        assert_eq!(
            patch(&ready, None, None),
            None,
            "the Pods not listed yet: nothing known, nothing changes"
        );
        assert_eq!(
            patch(&ready, Some(LabelIntent::StopDevicePlugin), Some(true)),
            Some(json!({SCHEDULING: null, DEVICE_PLUGIN_READY: null})),
            "an unload or a version change: both go at once, the Pod still Ready"
        );
        assert_eq!(
            patch(&ready, Some(LabelIntent::StopDevicePlugin), None),
            Some(json!({SCHEDULING: null, DEVICE_PLUGIN_READY: null}))
        );
        assert_eq!(
            patch(&ready, None, Some(true)),
            None,
            "a node whose labels stay keeps its ready plugin"
        );
    }

    #[test]
    fn a_module_without_a_device_plugin_never_keeps_its_labels() {
        let set = Some(LabelIntent::Set {
            version: "v1".into(),
            device_plugin: false,
        });
        let module = ModuleLabels {
            id: id(),
            intent: set,
            plugin_ready: Some(true),
        };
        let current = node_labels(&[SCHEDULING, DEVICE_PLUGIN_READY]);
        let patch = merge_patch(&current, &[module]).unwrap();
        let changes = &patch["metadata"]["labels"];
        assert!(changes[SCHEDULING].is_null() && changes[DEVICE_PLUGIN_READY].is_null());
    }

    #[test]
    fn a_module_that_loads_nothing_schedules_its_plugin_where_selected_and_gets_no_ready_label() {
        assert_eq!(
            device_plugin_only_intent(&Placement::DevicePluginOnly, true),
            Some(LabelIntent::DevicePluginOnly { scheduled: true })
        );
        assert_eq!(
            device_plugin_only_intent(&Placement::DevicePluginOnly, false),
            Some(LabelIntent::DevicePluginOnly { scheduled: false }),
            "nothing to run (its spec invalid): nothing scheduled"
        );
        let stopping = Placement::Held(Box::new(crate::placement::Held {
            hold: Hold::DevicePluginStopping { unload: true },
            running: None,
            target: String::new(),
            keep: None,
        }));
        for leaving in [Placement::Unload, stopping] {
            assert_eq!(
                device_plugin_only_intent(&leaving, true),
                Some(LabelIntent::DevicePluginOnly { scheduled: false }),
                "{leaving:?}"
            );
        }
        assert_eq!(
            device_plugin_only_intent(&Placement::NotApplicable, true),
            None
        );
        let module = |scheduled, plugin_ready| ModuleLabels {
            id: id(),
            intent: Some(LabelIntent::DevicePluginOnly { scheduled }),
            plugin_ready,
        };
        assert_eq!(
            merge_patch(&BTreeMap::new(), &[module(true, Some(true))]),
            Some(json!({"metadata": {"labels": {SCHEDULING: "", DEVICE_PLUGIN_READY: ""}}})),
            "no ready label: nothing is loaded"
        );
        assert_eq!(
            merge_patch(
                &node_labels(&[SCHEDULING, DEVICE_PLUGIN_READY]),
                &[module(false, Some(true))]
            ),
            Some(json!({"metadata": {"labels": {SCHEDULING: null, DEVICE_PLUGIN_READY: null}}}))
        );
    }
}
