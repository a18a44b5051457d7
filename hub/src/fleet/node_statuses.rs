//! What a cluster's spoke proxy last reported about every module on every node: a full
//! report replaces everything, a delta updates and removes entries. Pure.

use std::collections::BTreeMap;

use kmm_proto::v1::{ModuleKey, ModuleNodeStatus, ModuleState, NodeStatusReport};

/// `(spokeNamespace, module name, node)`.
type EntryKey = (String, String, String);

/// The per-module per-node status of one cluster.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct NodeStatuses {
    entries: BTreeMap<EntryKey, ModuleNodeStatus>,
}

impl NodeStatuses {
    /// Applies a report. Entries without a complete key are ignored: they cannot be
    /// attributed to a module and node.
    pub fn apply(&mut self, report: NodeStatusReport) {
        if report.full {
            self.entries.clear();
        }
        for removed in &report.removed {
            if let Some(key) = entry_key(removed.module.as_ref(), &removed.node) {
                self.entries.remove(&key);
            }
        }
        for status in report.statuses {
            let key = status
                .key
                .as_ref()
                .and_then(|k| entry_key(k.module.as_ref(), &k.node));
            if let Some(key) = key {
                self.entries.insert(key, status);
            }
        }
    }

    /// Every node's status for one module, ordered by node name.
    pub fn module(&self, namespace: &str, name: &str) -> Vec<ModuleNodeStatus> {
        self.entries
            .iter()
            .filter(|((ns, n, _), _)| ns == namespace && n == name)
            .map(|(_, status)| status.clone())
            .collect()
    }

    /// Nodes on which the module may still be loaded: any reported state but UNLOADED.
    pub fn not_unloaded(&self, namespace: &str, name: &str) -> Vec<String> {
        self.entries
            .iter()
            .filter(|((ns, n, _), status)| {
                ns == namespace && n == name && state(status) != ModuleState::Unloaded
            })
            .map(|((_, _, node), _)| node.clone())
            .collect()
    }
}

fn state(status: &ModuleNodeStatus) -> ModuleState {
    ModuleState::try_from(status.state).unwrap_or_default()
}

fn entry_key(module: Option<&ModuleKey>, node: &str) -> Option<EntryKey> {
    let module = module?;
    if module.name.is_empty() || node.is_empty() {
        return None;
    }
    Some((
        module.namespace.clone(),
        module.name.clone(),
        node.to_owned(),
    ))
}

#[cfg(test)]
mod tests {
    use kmm_proto::v1::ModuleNodeKey;

    use super::*;

    fn key(name: &str, node: &str) -> ModuleNodeKey {
        ModuleNodeKey {
            module: Some(ModuleKey {
                namespace: "drivers".into(),
                name: name.into(),
            }),
            node: node.into(),
        }
    }

    fn status(name: &str, node: &str, state: ModuleState) -> ModuleNodeStatus {
        ModuleNodeStatus {
            key: Some(key(name, node)),
            state: state.into(),
            ..ModuleNodeStatus::default()
        }
    }

    fn nodes(list: &[ModuleNodeStatus]) -> Vec<String> {
        list.iter()
            .map(|s| s.key.as_ref().unwrap().node.clone())
            .collect()
    }

    #[test]
    fn full_report_replaces_and_delta_updates_and_removes() {
        let mut statuses = NodeStatuses::default();
        statuses.apply(NodeStatusReport {
            full: true,
            statuses: vec![
                status("a", "n1", ModuleState::Loaded),
                status("a", "n2", ModuleState::Pending),
                status("b", "n1", ModuleState::Loaded),
            ],
            removed: vec![],
            ..NodeStatusReport::default()
        });
        assert_eq!(nodes(&statuses.module("drivers", "a")), ["n1", "n2"]);
        statuses.apply(NodeStatusReport {
            full: false,
            statuses: vec![status("a", "n2", ModuleState::Unloaded)],
            removed: vec![key("a", "n1")],
            ..NodeStatusReport::default()
        });
        let a = statuses.module("drivers", "a");
        assert_eq!(nodes(&a), ["n2"]);
        assert_eq!(a[0].state, i32::from(ModuleState::Unloaded));
        assert!(statuses.not_unloaded("drivers", "a").is_empty());
        assert_eq!(statuses.not_unloaded("drivers", "b"), ["n1"]);
        statuses.apply(NodeStatusReport {
            full: true,
            statuses: vec![status("c", "n9", ModuleState::Failed)],
            removed: vec![],
            ..NodeStatusReport::default()
        });
        assert!(statuses.module("drivers", "b").is_empty(), "full replaces");
        assert_eq!(statuses.not_unloaded("drivers", "c"), ["n9"]);
        assert!(
            statuses.module("other", "c").is_empty(),
            "namespace is part of the key"
        );
    }

    #[test]
    fn entries_without_a_complete_key_are_ignored() {
        let mut statuses = NodeStatuses::default();
        statuses.apply(NodeStatusReport {
            full: false,
            statuses: vec![
                ModuleNodeStatus::default(),
                status("", "n1", ModuleState::Loaded),
                status("a", "", ModuleState::Loaded),
            ],
            removed: vec![ModuleNodeKey::default()],
            ..NodeStatusReport::default()
        });
        assert_eq!(statuses, NodeStatuses::default());
    }
}
