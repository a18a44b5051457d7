//! Which clusters Open Cluster Management's Placements decided, and in which decision
//! group: read from their PlacementDecisions, whose labels name the Placement and the
//! group. Pure.

use std::collections::{BTreeMap, HashMap};

use kmm_api::ocm::{DECISION_GROUP_INDEX_LABEL, DECISION_GROUP_NAME_LABEL, PLACEMENT_LABEL};
use kmm_api::{ManagedClusterModule, PlacementRef};
use kube::ResourceExt;
use kube::core::DynamicObject;

use super::rollout::Wave;

/// A decision group of one Placement.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DecisionGroup {
    pub index: i32,
    /// Empty when the group has no name (`clustersPerDecisionGroup` made it).
    pub name: String,
}

/// The Placements that decided one cluster, each with the group it put the cluster in.
pub type Placed = BTreeMap<PlacementRef, DecisionGroup>;

/// Per cluster, what the PlacementDecisions say. A decision without the placement label
/// is not a Placement's and is ignored; a cluster a Placement decided twice keeps the
/// lower group.
pub fn decided<'a>(
    decisions: impl IntoIterator<Item = &'a DynamicObject>,
) -> HashMap<String, Placed> {
    let mut placed: HashMap<String, Placed> = HashMap::new();
    for decision in decisions {
        let labels = decision.labels();
        let Some(placement) = labels.get(PLACEMENT_LABEL) else {
            continue;
        };
        let placement = PlacementRef {
            namespace: decision.namespace().unwrap_or_default(),
            name: placement.clone(),
        };
        let group = DecisionGroup {
            index: labels
                .get(DECISION_GROUP_INDEX_LABEL)
                .and_then(|i| i.parse().ok())
                .unwrap_or_default(),
            name: labels
                .get(DECISION_GROUP_NAME_LABEL)
                .cloned()
                .unwrap_or_default(),
        };
        let clusters = decision.data["status"]["decisions"].as_array();
        for cluster in clusters.into_iter().flatten() {
            let Some(name) = cluster["clusterName"].as_str().filter(|n| !n.is_empty()) else {
                continue;
            };
            let groups = placed.entry(name.to_owned()).or_default();
            match groups.get(&placement) {
                Some(kept) if kept.index <= group.index => {}
                _ => {
                    groups.insert(placement.clone(), group.clone());
                }
            }
        }
    }
    placed
}

/// Whether the module's Placements (if it names any) decided a cluster.
pub fn is_placed(module: &ManagedClusterModule, placed: &Placed) -> bool {
    module
        .spec
        .placement_refs
        .as_ref()
        .is_none_or(|refs| refs.iter().any(|r| placed.contains_key(r)))
}

/// The wave a cluster moves in for the module: the group of the first of its Placements
/// that decided the cluster. `None` for a module without Placements.
pub fn wave(module: &ManagedClusterModule, placed: &Placed) -> Option<Wave> {
    let refs = module.spec.placement_refs.as_ref()?;
    refs.iter().enumerate().find_map(|(position, placement)| {
        placed.get(placement).map(|group| Wave {
            placement: position,
            index: group.index,
            name: group.name.clone(),
            label: format!(
                "{placement}/{}",
                if group.name.is_empty() {
                    group.index.to_string()
                } else {
                    group.name.clone()
                }
            ),
        })
    })
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use kmm_api::testing::ModuleBuilder;

    use kmm_api::ocm;

    use super::*;

    fn decision(namespace: &str, labels: serde_json::Value, clusters: &[&str]) -> DynamicObject {
        serde_json::from_value(json!({
            "apiVersion": ocm::PLACEMENT_DECISION.api_version(),
            "kind": ocm::PLACEMENT_DECISION.kind,
            "metadata": {"name": "d", "namespace": namespace, "labels": labels},
            "status": {"decisions": clusters
                .iter()
                .map(|c| json!({"clusterName": c, "reason": ""}))
                .collect::<Vec<_>>()},
        }))
        .unwrap()
    }

    fn placement(namespace: &str, name: &str) -> PlacementRef {
        PlacementRef {
            namespace: namespace.into(),
            name: name.into(),
        }
    }

    fn module(refs: Option<Vec<PlacementRef>>) -> ManagedClusterModule {
        let mut module = ModuleBuilder::new("m").build();
        module.spec.placement_refs = refs;
        module
    }

    #[test]
    fn decisions_give_each_cluster_its_placements_and_groups() {
        let decisions = [
            decision(
                "fleet",
                json!({PLACEMENT_LABEL: "gpu", DECISION_GROUP_INDEX_LABEL: "0", DECISION_GROUP_NAME_LABEL: "canary"}),
                &["spoke1"],
            ),
            decision(
                "fleet",
                json!({PLACEMENT_LABEL: "gpu", DECISION_GROUP_INDEX_LABEL: "1"}),
                &["spoke2", "spoke3"],
            ),
            decision("fleet", json!({PLACEMENT_LABEL: "all"}), &["spoke2"]),
            decision("fleet", json!({"unrelated": "x"}), &["spoke9"]),
        ];
        let placed = decided(&decisions);
        assert_eq!(
            placed["spoke1"][&placement("fleet", "gpu")],
            DecisionGroup {
                index: 0,
                name: "canary".into()
            }
        );
        assert_eq!(placed["spoke2"].len(), 2);
        assert_eq!(placed["spoke3"][&placement("fleet", "gpu")].index, 1);
        assert!(!placed.contains_key("spoke9"));
    }

    #[test]
    fn a_module_without_placements_is_placed_everywhere_one_with_them_only_where_decided() {
        let placed = decided(&[decision(
            "fleet",
            json!({PLACEMENT_LABEL: "gpu", DECISION_GROUP_INDEX_LABEL: "2"}),
            &["spoke1"],
        )]);
        let nowhere = Placed::new();
        assert!(is_placed(&module(None), &nowhere));
        assert_eq!(wave(&module(None), &placed["spoke1"]), None);
        let gpu = module(Some(vec![
            placement("other", "x"),
            placement("fleet", "gpu"),
        ]));
        assert!(is_placed(&gpu, &placed["spoke1"]));
        assert!(!is_placed(&gpu, &nowhere));
        let wave = wave(&gpu, &placed["spoke1"]).unwrap();
        assert_eq!((wave.placement, wave.index), (1, 2));
        assert_eq!(wave.label, "fleet/gpu/2");
    }
}
