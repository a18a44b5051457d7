//! Per module per node status, from the placement and what the node's agent has
//! proven, and the full/delta reports the hub receives. Pure.

use std::collections::BTreeMap;

use kmm_proto::REASON_KERNEL_MODULE_SHARED;
use kmm_proto::limits::{ERROR_TEXT, truncate};
use kmm_proto::v1::{
    Action, ModuleLoad, ModuleNodeKey, ModuleNodeStatus, ModuleState, NodeStatusReport,
};

use crate::agent_view::AgentView;
use crate::module_id::ModuleId;
use crate::node_upgrade::{REASON_DEVICE_PLUGIN_STOPPING, describe};
use crate::placement::Placement;

/// Reason for a load the agent reported failed.
pub const REASON_LOAD_FAILED: &str = "LoadFailed";
/// Reason for an unload the agent reported failed (the module stays loaded).
pub const REASON_UNLOAD_FAILED: &str = "UnloadFailed";
/// Reason for a node whose agent runs another kernel than its kubelet reports.
pub const REASON_KERNEL_MISMATCH: &str = "KernelMismatch";

/// One module's state on one node.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Assessment {
    pub state: ModuleState,
    pub loaded_version: String,
    pub reason: String,
    pub message: String,
}

impl Assessment {
    fn new(state: ModuleState, reason: &str, message: String) -> Self {
        Self {
            state,
            loaded_version: String::new(),
            reason: reason.to_owned(),
            message,
        }
    }
}

/// A loaded or unloaded module's state, with what it shares with other modules of the
/// node as its note: shown, but it is still loaded (or unloaded), not failed.
fn noting_shared(
    mut assessment: Assessment,
    view: Option<&AgentView>,
    id: &ModuleId,
) -> Assessment {
    let Some(view) = view else {
        return assessment;
    };
    let notes: Vec<String> = view
        .shared_by(id)
        .map(|shared| {
            if shared.unloaded == *id {
                format!(
                    "kernel module {} stays loaded: {} needs it",
                    shared.name, shared.kept_for
                )
            } else {
                format!(
                    "shares kernel module {} with {}, whose unload left it loaded for this module",
                    shared.name, shared.unloaded
                )
            }
        })
        .collect();
    if !notes.is_empty() {
        assessment.reason = REASON_KERNEL_MODULE_SHARED.to_owned();
        assessment.message = notes.join("; ");
        truncate(&mut assessment.message, ERROR_TEXT);
    }
    assessment
}

/// What an image reference loads: its pinned digest when it has one (the same bytes
/// under any name), else the reference itself.
pub fn image_bytes(image: &str) -> &str {
    image.split_once('@').map_or(image, |(_, pinned)| pinned)
}

/// What a load loads: the digest the hub pinned, else what its reference names. A tag
/// the hub followed to a new digest (`imagePullPolicy: Always`) is new bytes under the
/// same name.
pub fn load_bytes(load: &ModuleLoad) -> &str {
    if load.digest.is_empty() {
        image_bytes(&load.image)
    } else {
        &load.digest
    }
}

/// Whether a module loaded from an image with `digest` satisfies `image`: an image
/// pinned by digest must match it; a tag is resolved by the agent once, so any digest.
pub fn digest_matches(image: &str, digest: &str) -> bool {
    image
        .split_once('@')
        .is_none_or(|(_, pinned)| pinned == digest)
}

/// Whether a module loaded from an image with `digest` satisfies `load`: the hub's pinned
/// digest must match it, else as [`digest_matches`].
pub fn load_matches(load: &ModuleLoad, digest: &str) -> bool {
    if load.digest.is_empty() {
        digest_matches(&load.image, digest)
    } else {
        load.digest == digest
    }
}

/// The state of `id` on a node where it is placed as `placement`. `since` is the
/// DesiredModules revision at which the node's entry for the module last changed: only
/// the agent's reports acting on that revision or later speak for the current intent.
/// `None` when the module is not the node's business.
pub fn assess(
    placement: &Placement,
    view: Option<&AgentView>,
    id: &ModuleId,
    kernel: &str,
    since: u64,
) -> Option<Assessment> {
    let proof = view.and_then(|v| v.loaded.get(id));
    let failure = view
        .and_then(|v| v.failures.get(id))
        .filter(|f| f.revision >= since);
    Some(match placement {
        // A module that loads nothing is assessed by `assess_device_plugin_only`.
        Placement::NotApplicable | Placement::DevicePluginOnly => return None,
        Placement::Unresolved(unresolved) => Assessment::new(
            ModuleState::Failed,
            &unresolved.reason,
            unresolved.message.clone(),
        ),
        Placement::Skipped(unresolved) => Assessment::new(
            ModuleState::Skipped,
            &unresolved.reason,
            unresolved.message.clone(),
        ),
        Placement::AwaitingKernel => Assessment::new(
            ModuleState::Pending,
            "",
            format!("no image resolved yet for kernel {kernel:?}"),
        ),
        // Not loaded, and it will not be until someone looks at the node: a failure.
        Placement::KernelMismatch { kubelet, agent } => Assessment::new(
            ModuleState::Failed,
            REASON_KERNEL_MISMATCH,
            format!(
                "the kubelet reports kernel {kubelet:?} but the node agent runs {agent:?}: \
                 nothing is loaded until they agree"
            ),
        ),
        Placement::Load(load) => {
            let current = proof.filter(|p| {
                p.version == load.version
                    && p.revision
                        .map_or_else(|| load_matches(load, &p.image_digest), |r| r >= since)
            });
            match (current, failure) {
                (Some(p), _) => noting_shared(
                    Assessment {
                        state: ModuleState::Loaded,
                        loaded_version: p.version.clone(),
                        reason: String::new(),
                        message: String::new(),
                    },
                    view,
                    id,
                ),
                (None, Some(f)) => Assessment::new(
                    ModuleState::Failed,
                    if f.action == Action::Unload {
                        REASON_UNLOAD_FAILED
                    } else {
                        REASON_LOAD_FAILED
                    },
                    f.error.clone(),
                ),
                (None, None) if view.is_none() => Assessment::new(
                    ModuleState::Pending,
                    "",
                    "waiting for the node agent to connect".into(),
                ),
                (None, None) => Assessment::new(
                    ModuleState::Pending,
                    "",
                    format!("waiting for the node agent to load {}", load.image),
                ),
            }
        }
        Placement::Held(held) => {
            let (reason, message) = describe(&held.hold, held.running.as_deref(), &held.target);
            Assessment {
                state: ModuleState::Pending,
                loaded_version: held.running.clone().unwrap_or_default(),
                reason: reason.to_owned(),
                message,
            }
        }
        Placement::Unload => match (view, proof, failure) {
            (Some(_), None, _) => noting_shared(
                Assessment::new(ModuleState::Unloaded, "", String::new()),
                view,
                id,
            ),
            (_, _, Some(f)) if f.action == Action::Unload => {
                Assessment::new(ModuleState::Failed, REASON_UNLOAD_FAILED, f.error.clone())
            }
            (_, Some(p), _) => Assessment {
                state: ModuleState::Loaded,
                loaded_version: p.version.clone(),
                reason: String::new(),
                message: "unload requested".into(),
            },
            (None, None, _) => Assessment::new(
                ModuleState::Pending,
                "",
                "waiting for the node agent to confirm the unload".into(),
            ),
        },
    })
}

/// The state of a module that loads nothing (only runs a device plugin) on a node where
/// it is placed as `placement`; `labelled`: the node still carries the plugin's
/// scheduling or `device-plugin-ready` label. No status while the node runs the plugin:
/// nothing is loaded there, and the plugin's counts say how it runs. PENDING while the
/// plugin stops on a node the module leaves; UNLOADED once its Pod and its labels are
/// gone, which is what the hub waits for before it forgets the module or completes a
/// deletion.
pub fn assess_device_plugin_only(placement: &Placement, labelled: bool) -> Option<Assessment> {
    match placement {
        Placement::Held(_) => Some(Assessment::new(
            ModuleState::Pending,
            REASON_DEVICE_PLUGIN_STOPPING,
            "the module's device plugin Pod is stopping on the node".into(),
        )),
        Placement::Unload if labelled => Some(Assessment::new(
            ModuleState::Pending,
            REASON_DEVICE_PLUGIN_STOPPING,
            "the module's device plugin labels are being removed from the node".into(),
        )),
        Placement::Unload => Some(Assessment::new(ModuleState::Unloaded, "", String::new())),
        _ => None,
    }
}

/// A status entry's identity: module and node.
pub type StatusKey = (ModuleId, String);

/// Builds the wire status of `key`.
pub fn to_status(key: &StatusKey, kernel: &str, assessment: Assessment) -> ModuleNodeStatus {
    ModuleNodeStatus {
        key: Some(wire_key(key)),
        kernel: kernel.to_owned(),
        state: assessment.state.into(),
        loaded_version: assessment.loaded_version,
        message: assessment.message,
        reason: assessment.reason,
    }
}

fn wire_key((module, node): &StatusKey) -> ModuleNodeKey {
    ModuleNodeKey {
        module: Some(module.key()),
        node: node.clone(),
    }
}

/// One node's statuses, by module.
pub type NodeStatuses = BTreeMap<ModuleId, ModuleNodeStatus>;

/// What the hub was last told, per node, so later reports carry only changes, and the
/// intent revision the last report reflected.
#[derive(Clone, Debug, Default)]
pub struct StatusReporter {
    sent: BTreeMap<String, NodeStatuses>,
    revision: u64,
}

impl StatusReporter {
    /// The complete state, made with the intents of `revision` applied, for the first
    /// report of a stream.
    pub fn full(
        &mut self,
        current: BTreeMap<String, NodeStatuses>,
        revision: u64,
    ) -> NodeStatusReport {
        self.sent = current;
        self.sent.retain(|_, statuses| !statuses.is_empty());
        self.revision = revision;
        NodeStatusReport {
            full: true,
            statuses: self
                .sent
                .values()
                .flat_map(|statuses| statuses.values().cloned())
                .collect(),
            removed: Vec::new(),
            intent_revision: revision,
            continued: false,
        }
    }

    /// Changed and removed entries of the nodes in `current` (the nodes that may have
    /// changed; an empty map means the node has no status left), made with the intents
    /// of `revision` applied. Other nodes are as last sent. `None` when nothing changed
    /// and the revision is the one last reported: a newly applied revision is always
    /// reported, so the hub learns that statuses reflect it.
    pub fn delta(
        &mut self,
        current: BTreeMap<String, NodeStatuses>,
        revision: u64,
    ) -> Option<NodeStatusReport> {
        let mut statuses = Vec::new();
        let mut removed = Vec::new();
        for (node, now) in current {
            let before = self.sent.remove(&node).unwrap_or_default();
            statuses.extend(
                now.iter()
                    .filter(|(id, status)| before.get(*id) != Some(*status))
                    .map(|(_, status)| status.clone()),
            );
            removed.extend(
                before
                    .keys()
                    .filter(|id| !now.contains_key(*id))
                    .map(|id| wire_key(&(id.clone(), node.clone()))),
            );
            if !now.is_empty() {
                self.sent.insert(node, now);
            }
        }
        let advanced = revision != self.revision;
        self.revision = revision;
        (advanced || !statuses.is_empty() || !removed.is_empty()).then_some(NodeStatusReport {
            full: false,
            statuses,
            removed,
            intent_revision: revision,
            continued: false,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::agent_view::{Failure, LoadedProof, SharedKernelModule};
    use kmm_proto::v1::{ModuleLoad, Unresolved};
    use std::sync::Arc;

    fn id() -> ModuleId {
        ModuleId {
            namespace: "ns".into(),
            name: "m".into(),
        }
    }

    fn load(version: &str, image: &str) -> Placement {
        Placement::Load(Arc::new(ModuleLoad {
            image: image.into(),
            version: version.into(),
            ..Default::default()
        }))
    }

    fn view_with(version: &str, revision: Option<u64>) -> AgentView {
        let mut view = AgentView::default();
        view.loaded.insert(
            id(),
            LoadedProof {
                version: version.into(),
                image_digest: "sha256:aa".into(),
                revision,
            },
        );
        view
    }

    fn failed(action: Action, revision: u64) -> AgentView {
        let mut view = AgentView::default();
        view.failures.insert(
            id(),
            Failure {
                action,
                revision,
                error: "modprobe: FATAL: Module m not found".into(),
            },
        );
        view
    }

    fn state(placement: &Placement, view: Option<&AgentView>, since: u64) -> ModuleState {
        assess(placement, view, &id(), "6.1", since).unwrap().state
    }

    /// `ns/m` loaded, and `ns/second`'s unload left `kmm_hello` loaded for it.
    fn sharing_kmm_hello() -> AgentView {
        let mut view = view_with("v1", Some(5));
        view.shared.push(SharedKernelModule {
            name: "kmm_hello".into(),
            unloaded: ModuleId {
                namespace: "ns".into(),
                name: "second".into(),
            },
            kept_for: id(),
        });
        view
    }

    #[test]
    fn a_shared_kernel_module_is_noted_on_both_modules_and_fails_neither() {
        let view = sharing_kmm_hello();
        let keeper = assess(&load("v1", "reg/m:v1"), Some(&view), &id(), "6.1", 5).unwrap();
        assert_eq!(keeper.state, ModuleState::Loaded);
        assert_eq!(keeper.reason, REASON_KERNEL_MODULE_SHARED);
        assert_eq!(
            keeper.message,
            "shares kernel module kmm_hello with ns/second, whose unload left it loaded for this module"
        );
        let second = ModuleId {
            namespace: "ns".into(),
            name: "second".into(),
        };
        let unloaded = assess(&Placement::Unload, Some(&view), &second, "6.1", 5).unwrap();
        assert_eq!(unloaded.state, ModuleState::Unloaded);
        assert_eq!(unloaded.reason, REASON_KERNEL_MODULE_SHARED);
        assert_eq!(
            unloaded.message,
            "kernel module kmm_hello stays loaded: ns/m needs it"
        );
    }

    #[test]
    fn pending_until_the_agent_proves_the_current_intent() {
        let p = load("v1", "reg/m:v1");
        assert_eq!(state(&p, None, 5), ModuleState::Pending);
        assert_eq!(
            state(&p, Some(&AgentView::default()), 5),
            ModuleState::Pending
        );
        // A success acting on an older revision says nothing about the current intent.
        assert_eq!(
            state(&p, Some(&view_with("v1", Some(4))), 5),
            ModuleState::Pending
        );
        let loaded = assess(&p, Some(&view_with("v1", Some(5))), &id(), "6.1", 5).unwrap();
        assert_eq!(loaded.state, ModuleState::Loaded);
        assert_eq!(loaded.loaded_version, "v1");
        assert_eq!(
            state(&p, Some(&view_with("v0", Some(9))), 5),
            ModuleState::Pending
        );
    }

    #[test]
    fn hello_proof_counts_when_version_and_pinned_digest_match() {
        assert_eq!(
            state(&load("v1", "reg/m:v1"), Some(&view_with("v1", None)), 5),
            ModuleState::Loaded
        );
        assert_eq!(
            state(
                &load("v1", "reg/m@sha256:aa"),
                Some(&view_with("v1", None)),
                5
            ),
            ModuleState::Loaded
        );
        assert_eq!(
            state(
                &load("v1", "reg/m@sha256:bb"),
                Some(&view_with("v1", None)),
                5
            ),
            ModuleState::Pending
        );
        assert_eq!(
            state(&load("v2", "reg/m:v2"), Some(&view_with("v1", None)), 5),
            ModuleState::Pending
        );
    }

    #[test]
    fn failure_for_the_current_intent_carries_the_agents_error() {
        let p = load("v1", "reg/m:v1");
        let a = assess(&p, Some(&failed(Action::Load, 5)), &id(), "6.1", 5).unwrap();
        assert_eq!(a.state, ModuleState::Failed);
        assert_eq!(a.reason, REASON_LOAD_FAILED);
        assert_eq!(a.message, "modprobe: FATAL: Module m not found");
        assert_eq!(
            state(&p, Some(&failed(Action::Load, 4)), 5),
            ModuleState::Pending
        );
        let u = assess(&p, Some(&failed(Action::Unload, 6)), &id(), "6.1", 5).unwrap();
        assert_eq!(u.reason, REASON_UNLOAD_FAILED);
    }

    #[test]
    fn unresolved_kernel_is_failed_with_the_hubs_reason() {
        let p = Placement::Unresolved(Unresolved {
            reason: "NoKernelMapping".into(),
            message: "no kernel mapping matches 5.14".into(),
        });
        let a = assess(&p, Some(&view_with("v1", Some(9))), &id(), "5.14", 1).unwrap();
        assert_eq!(a.state, ModuleState::Failed);
        assert_eq!(a.reason, "NoKernelMapping");
        assert_eq!(a.message, "no kernel mapping matches 5.14");
    }

    #[test]
    fn awaiting_kernel_is_pending_and_names_it() {
        let a = assess(&Placement::AwaitingKernel, None, &id(), "6.9", 1).unwrap();
        assert_eq!(a.state, ModuleState::Pending);
        assert!(a.message.contains("6.9"));
    }

    #[test]
    fn kernel_mismatch_is_failed_and_names_both_kernels() {
        let p = Placement::KernelMismatch {
            kubelet: "6.1".into(),
            agent: "6.2".into(),
        };
        let a = assess(&p, Some(&AgentView::default()), &id(), "6.1", 1).unwrap();
        assert_eq!(a.state, ModuleState::Failed);
        assert_eq!(a.reason, REASON_KERNEL_MISMATCH);
        assert!(
            a.message.contains("\"6.1\"") && a.message.contains("\"6.2\""),
            "{}",
            a.message
        );
    }

    #[test]
    fn unload_is_confirmed_only_by_the_agent() {
        let p = Placement::Unload;
        assert_eq!(state(&p, None, 1), ModuleState::Pending);
        let still = assess(&p, Some(&view_with("v1", Some(1))), &id(), "6.1", 2).unwrap();
        assert_eq!(still.state, ModuleState::Loaded);
        assert_eq!(still.message, "unload requested");
        assert_eq!(
            state(&p, Some(&AgentView::default()), 2),
            ModuleState::Unloaded
        );
        let mut stuck = view_with("v1", Some(1));
        stuck.failures = failed(Action::Unload, 2).failures;
        let a = assess(&p, Some(&stuck), &id(), "6.1", 2).unwrap();
        assert_eq!(a.state, ModuleState::Failed);
        assert_eq!(a.reason, REASON_UNLOAD_FAILED);
    }

    #[test]
    fn not_applicable_has_no_status() {
        assert_eq!(
            assess(&Placement::NotApplicable, None, &id(), "6.1", 1),
            None
        );
    }

    #[test]
    fn the_hubs_pinned_digest_decides_which_proof_counts() {
        let pinned = |digest: &str| {
            Placement::Load(Arc::new(ModuleLoad {
                image: "reg/m:v1".into(),
                version: "v1".into(),
                digest: digest.into(),
                ..Default::default()
            }))
        };
        assert_eq!(
            state(&pinned("sha256:aa"), Some(&view_with("v1", None)), 5),
            ModuleState::Loaded
        );
        assert_eq!(
            state(&pinned("sha256:bb"), Some(&view_with("v1", None)), 5),
            ModuleState::Pending,
            "the tag moved: the old bytes are no proof"
        );
        let Placement::Load(load) = pinned("sha256:bb") else {
            unreachable!()
        };
        assert_eq!(load_bytes(&load), "sha256:bb");
        let unpinned = ModuleLoad {
            image: "reg/m@sha256:cc".into(),
            ..ModuleLoad::default()
        };
        assert_eq!(load_bytes(&unpinned), "sha256:cc");
    }

    #[test]
    fn digest_matching() {
        assert!(digest_matches("reg/m:tag", "sha256:x"));
        assert!(digest_matches("reg/m@sha256:x", "sha256:x"));
        assert!(!digest_matches("reg/m@sha256:x", "sha256:y"));
    }

    fn node(name: &str, state: Option<ModuleState>) -> (String, NodeStatuses) {
        let statuses = state
            .map(|state| {
                let key = (id(), name.to_string());
                let status = to_status(&key, "6.1", Assessment::new(state, "", String::new()));
                (id(), status)
            })
            .into_iter()
            .collect();
        (name.to_string(), statuses)
    }

    #[test]
    fn reporter_sends_full_then_only_changes_and_removals() {
        let mut reporter = StatusReporter::default();
        let first: BTreeMap<_, _> = [
            node("a", Some(ModuleState::Pending)),
            node("b", Some(ModuleState::Pending)),
            node("c", None),
        ]
        .into();
        let full = reporter.full(first.clone(), 1);
        assert!(full.full);
        assert_eq!(full.statuses.len(), 2);
        assert_eq!(full.intent_revision, 1);
        assert_eq!(reporter.delta(first, 1), None);

        // Only a changed: b is not mentioned, so it stays as sent.
        let only_a: BTreeMap<_, _> = [node("a", Some(ModuleState::Loaded))].into();
        let delta = reporter.delta(only_a, 1).unwrap();
        assert!(!delta.full);
        assert_eq!(delta.statuses.len(), 1);
        assert_eq!(delta.statuses[0].state, ModuleState::Loaded as i32);
        assert!(delta.removed.is_empty());

        // b has nothing left: its entry is removed.
        let b_gone: BTreeMap<_, _> = [node("b", None)].into();
        let delta = reporter.delta(b_gone.clone(), 1).unwrap();
        assert!(delta.statuses.is_empty());
        assert_eq!(delta.removed.len(), 1);
        assert_eq!(delta.removed[0].node, "b");
        assert_eq!(reporter.delta(b_gone, 1), None);

        // After a reconnect the full report replaces everything again.
        let again = reporter.full([node("a", Some(ModuleState::Loaded))].into(), 1);
        assert!(again.full);
        assert_eq!(again.statuses.len(), 1);
    }

    #[test]
    fn every_newly_applied_revision_is_reported_even_without_changes() {
        let mut reporter = StatusReporter::default();
        let nodes: BTreeMap<_, _> = [node("a", Some(ModuleState::Loaded))].into();
        reporter.full(nodes.clone(), 3);
        let ack = reporter.delta(BTreeMap::new(), 4).unwrap();
        assert_eq!(ack.intent_revision, 4);
        assert!(ack.statuses.is_empty() && ack.removed.is_empty());
        assert_eq!(reporter.delta(BTreeMap::new(), 4), None);
        let changed = reporter
            .delta([node("a", Some(ModuleState::Pending))].into(), 4)
            .unwrap();
        assert_eq!(changed.intent_revision, 4);
        assert_eq!(changed.statuses.len(), 1);
    }

    #[test]
    fn a_module_that_loads_nothing_reports_only_where_its_plugin_stops() {
        assert_eq!(
            assess_device_plugin_only(&Placement::DevicePluginOnly, true),
            None,
            "running its plugin: nothing is loaded, nothing to report"
        );
        assert_eq!(
            assess_device_plugin_only(&Placement::NotApplicable, false),
            None
        );
        let stopping = Placement::Held(Box::new(crate::placement::Held {
            hold: crate::node_upgrade::Hold::DevicePluginStopping { unload: true },
            running: None,
            target: String::new(),
            keep: None,
        }));
        for (placement, labelled) in [
            (&stopping, true),
            (&stopping, false),
            (&Placement::Unload, true),
        ] {
            let a = assess_device_plugin_only(placement, labelled).unwrap();
            assert_eq!(
                (a.state, a.reason.as_str()),
                (ModuleState::Pending, REASON_DEVICE_PLUGIN_STOPPING),
                "{placement:?}, labelled: {labelled}"
            );
        }
        let gone = assess_device_plugin_only(&Placement::Unload, false).unwrap();
        assert_eq!(gone.state, ModuleState::Unloaded);
    }
}
