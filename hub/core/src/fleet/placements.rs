//! Which clusters Open Cluster Management's Placements decided, and in which decision
//! group: read from their PlacementDecisions, whose labels name the Placement and the
//! group. Pure.
//!
//! A cluster that drops out of a Placement's decisions is not always deselected: OCM also
//! drops a cluster whose agent's lease lapsed (it taints it unreachable), empties the
//! decisions of a deleted Placement, and briefly loses a cluster while it re-splits a large
//! Placement's decisions. Those are OCM losing sight of a cluster, not a request, so a
//! module already there is held ([`held`]) rather than unloaded.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};

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

/// How long a cluster that left a Placement's decisions without an excuse OCM shows keeps
/// its modules: longer than OCM takes to move a cluster between the decisions of one
/// Placement, short enough that a Placement narrowed on purpose unloads soon after.
pub const DECISIONS_SETTLE: Duration = Duration::from_secs(15);

/// Why a cluster a module's Placements no longer decide still runs the module.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HoldReason {
    /// OCM tainted the cluster unreachable or unavailable: its agent's lease lapsed, which
    /// says nothing about the nodes or kmm's own stream.
    ClusterUnreachable,
    /// The Placement decides no cluster at all: it was deleted, or its decisions emptied.
    PlacementWithoutDecisions,
    /// The cluster left the Placement's decisions less than [`DECISIONS_SETTLE`] ago.
    DecisionsChanging,
}

impl HoldReason {
    /// The reason as status spells it.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::ClusterUnreachable => "ClusterUnreachable",
            Self::PlacementWithoutDecisions => "PlacementWithoutDecisions",
            Self::DecisionsChanging => "DecisionsChanging",
        }
    }

    /// What happened, and what would unload the module.
    pub fn message(self, placement: &PlacementRef) -> String {
        let why = match self {
            Self::ClusterUnreachable => {
                "OCM tainted the cluster unreachable or unavailable (its agent's lease lapsed)"
                    .to_owned()
            }
            Self::PlacementWithoutDecisions => {
                format!(
                    "Placement {placement} decides no cluster (deleted, or its decisions emptied)"
                )
            }
            Self::DecisionsChanging => format!(
                "the cluster left Placement {placement}'s decisions less than {}s ago",
                DECISIONS_SETTLE.as_secs()
            ),
        };
        format!(
            "{why}; the module stays loaded. Narrow or delete the ManagedClusterModule, or \
             change the cluster's labels, to unload it"
        )
    }
}

/// What makes a Placement's silence about one cluster OCM's rather than a request.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Excuses {
    /// OCM tainted the cluster unreachable or unavailable.
    pub unreachable: bool,
    /// Placements that decided the cluster until less than [`DECISIONS_SETTLE`] ago.
    pub recently_left: BTreeSet<PlacementRef>,
    /// Every Placement that decides at least one cluster.
    pub deciding: Arc<BTreeSet<PlacementRef>>,
}

/// When a module with Placements, none of which decides the cluster, still holds it: the
/// first of its Placements with an excuse, and the excuse. `None` for a module without
/// Placements or one they decide.
pub fn held(
    module: &ManagedClusterModule,
    placed: &Placed,
    excuses: &Excuses,
) -> Option<(PlacementRef, HoldReason)> {
    let refs = module.spec.placement_refs.as_ref()?;
    if refs.iter().any(|r| placed.contains_key(r)) {
        return None;
    }
    refs.iter().find_map(|placement| {
        let reason = if excuses.unreachable {
            HoldReason::ClusterUnreachable
        } else if !excuses.deciding.contains(placement) {
            HoldReason::PlacementWithoutDecisions
        } else if excuses.recently_left.contains(placement) {
            HoldReason::DecisionsChanging
        } else {
            return None;
        };
        Some((placement.clone(), reason))
    })
}

/// When clusters left Placements' decisions, kept for [`DECISIONS_SETTLE`]. Only what the
/// hub saw since it started: after a restart, a cluster that is not decided has no
/// departure to excuse it.
#[derive(Debug, Default)]
pub struct Departures {
    left: HashMap<String, BTreeMap<PlacementRef, Instant>>,
}

impl Departures {
    /// Notes the decisions changing from `before` to `now` at `at`; returns the clusters
    /// whose recent departures changed.
    pub fn note(
        &mut self,
        before: &HashMap<String, Placed>,
        now: &HashMap<String, Placed>,
        at: Instant,
    ) -> Vec<String> {
        let nowhere = Placed::new();
        let mut changed = Vec::new();
        for (cluster, was) in before {
            let is = now.get(cluster).unwrap_or(&nowhere);
            let gone: Vec<_> = was.keys().filter(|p| !is.contains_key(*p)).collect();
            if gone.is_empty() {
                continue;
            }
            let left = self.left.entry(cluster.clone()).or_default();
            for placement in gone {
                left.insert(placement.clone(), at);
            }
            changed.push(cluster.clone());
        }
        for (cluster, is) in now {
            let Some(left) = self.left.get_mut(cluster) else {
                continue;
            };
            let before = left.len();
            left.retain(|placement, _| !is.contains_key(placement));
            if left.len() != before && !changed.contains(cluster) {
                changed.push(cluster.clone());
            }
            if left.is_empty() {
                self.left.remove(cluster);
            }
        }
        changed
    }

    /// Forgets the departures [`DECISIONS_SETTLE`] old at `at`; returns the clusters that
    /// lost one.
    pub fn expire(&mut self, at: Instant) -> Vec<String> {
        let mut changed = Vec::new();
        self.left.retain(|cluster, left| {
            let before = left.len();
            left.retain(|_, since| at.saturating_duration_since(*since) < DECISIONS_SETTLE);
            if left.len() != before {
                changed.push(cluster.clone());
            }
            !left.is_empty()
        });
        changed
    }

    /// The Placements the cluster left less than [`DECISIONS_SETTLE`] ago.
    pub fn recently_left(&self, cluster: &str) -> BTreeSet<PlacementRef> {
        self.left
            .get(cluster)
            .map(|left| left.keys().cloned().collect())
            .unwrap_or_default()
    }
}

/// The Placements that decide at least one cluster.
pub fn deciding(placed: &HashMap<String, Placed>) -> BTreeSet<PlacementRef> {
    placed.values().flat_map(|p| p.keys().cloned()).collect()
}

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

    #[test]
    fn a_departure_is_remembered_until_it_settles_and_forgotten_on_return() {
        let gpu = placement("fleet", "gpu");
        let both = HashMap::from([
            (
                "spoke1".to_owned(),
                Placed::from([(gpu.clone(), DecisionGroup::default())]),
            ),
            (
                "spoke2".to_owned(),
                Placed::from([(gpu.clone(), DecisionGroup::default())]),
            ),
        ]);
        let one = HashMap::from([("spoke2".to_owned(), both["spoke2"].clone())]);
        let start = Instant::now();
        let mut departures = Departures::default();
        assert!(departures.note(&HashMap::new(), &both, start).is_empty());
        assert_eq!(departures.note(&both, &one, start), ["spoke1"]);
        assert_eq!(departures.recently_left("spoke1"), [gpu.clone()].into());
        assert!(departures.recently_left("spoke2").is_empty());
        assert!(departures.expire(start + DECISIONS_SETTLE / 2).is_empty());
        assert_eq!(departures.expire(start + DECISIONS_SETTLE), ["spoke1"]);
        assert!(departures.recently_left("spoke1").is_empty());

        departures.note(&both, &one, start);
        assert_eq!(
            departures.note(&one, &both, start),
            ["spoke1"],
            "back again"
        );
        assert!(departures.recently_left("spoke1").is_empty());
        assert!(departures.expire(start + DECISIONS_SETTLE).is_empty());
    }

    #[test]
    fn a_hold_needs_an_excuse_and_names_the_first_placement_with_one() {
        let gpu = placement("fleet", "gpu");
        let other = placement("fleet", "other");
        let module = module(Some(vec![other.clone(), gpu.clone()]));
        let deciding = Arc::new(BTreeSet::from([gpu.clone(), other.clone()]));
        let none = Excuses {
            deciding: deciding.clone(),
            ..Excuses::default()
        };
        assert_eq!(held(&module, &Placed::new(), &none), None);
        let moving = Excuses {
            recently_left: [gpu.clone()].into(),
            deciding: deciding.clone(),
            ..Excuses::default()
        };
        assert_eq!(
            held(&module, &Placed::new(), &moving),
            Some((gpu.clone(), HoldReason::DecisionsChanging))
        );
        let decided = Placed::from([(other.clone(), DecisionGroup::default())]);
        assert_eq!(held(&module, &decided, &moving), None, "placed, not held");
        let unreachable = Excuses {
            unreachable: true,
            ..none
        };
        assert_eq!(
            held(&module, &Placed::new(), &unreachable),
            Some((other, HoldReason::ClusterUnreachable))
        );
        assert_eq!(
            held(&super::tests::module(None), &Placed::new(), &unreachable),
            None
        );
        assert!(
            HoldReason::DecisionsChanging
                .message(&gpu)
                .contains("fleet/gpu")
        );
    }
}
