//! How a change of a module's spec moves across the selected clusters, in the shape of
//! Open Cluster Management's `RolloutStrategy` (`cluster.open-cluster-management.io/
//! v1alpha1`): `All` at once, `Progressive` (a few clusters at a time) or
//! `ProgressivePerGroup` (one Placement decision group at a time), mandatory decision
//! groups first. The checking and the arithmetic live here so that admission and the hub
//! agree on them.

use std::time::Duration;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::KubeSchema;
use serde::{Deserialize, Serialize};
use serde_with::skip_serializing_none;

/// How a spec change reaches the selected clusters.
#[skip_serializing_none]
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct RolloutStrategy {
    /// `All` (the default): every selected cluster at once, as soon as the spec changes.
    /// `Progressive`: at most `progressive.maxConcurrency` clusters at a time, in the
    /// order of their decision groups (`spec.placementRefs`), then of their names.
    /// `ProgressivePerGroup`: one decision group of `spec.placementRefs` at a time.
    #[serde(rename = "type", default)]
    pub type_: RolloutType,
    /// Settings of `Progressive`.
    pub progressive: Option<RolloutProgressive>,
    /// Settings of `ProgressivePerGroup`.
    pub progressive_per_group: Option<RolloutProgressivePerGroup>,
}

/// How many clusters move at once.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema,
)]
pub enum RolloutType {
    #[default]
    All,
    Progressive,
    ProgressivePerGroup,
}

/// How clusters are judged while they move.
#[skip_serializing_none]
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct RolloutConfig {
    /// How long a cluster must stay succeeded before the next clusters start, e.g. `5m`
    /// (hours, minutes, seconds: `1h30m`). Default `0`.
    #[schemars(regex(pattern = r"^(0|[0-9]+h([0-9]+m)?([0-9]+s)?|[0-9]+m([0-9]+s)?|[0-9]+s)$"))]
    pub min_success_time: Option<String>,
    /// How long a cluster may take to succeed before it counts as failed (`TimeOut`),
    /// e.g. `10m`; `None` (the default) waits forever.
    #[schemars(regex(
        pattern = r"^(None|0|[0-9]+h([0-9]+m)?([0-9]+s)?|[0-9]+m([0-9]+s)?|[0-9]+s)$"
    ))]
    pub progress_deadline: Option<String>,
    /// How many failed or timed-out clusters the rollout tolerates before it halts: a
    /// number of clusters or a percentage of the selected ones (rounded down). Default 0:
    /// the first failure halts it.
    pub max_failures: Option<IntOrString>,
}

/// Settings of `Progressive`.
#[skip_serializing_none]
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct RolloutProgressive {
    #[serde(flatten)]
    pub config: RolloutConfig,
    /// Decision groups of `spec.placementRefs` that move first, one group at a time,
    /// whatever `maxConcurrency` says; a failure in one halts the rollout.
    pub mandatory_decision_groups: Option<Vec<MandatoryDecisionGroup>>,
    /// Most clusters moving at once: a number (at least 1) or a percentage of the
    /// selected clusters (rounded up). Default 1.
    pub max_concurrency: Option<IntOrString>,
}

/// Settings of `ProgressivePerGroup`.
#[skip_serializing_none]
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct RolloutProgressivePerGroup {
    #[serde(flatten)]
    pub config: RolloutConfig,
    /// Decision groups that move first, in this order; a failure in one halts the
    /// rollout.
    pub mandatory_decision_groups: Option<Vec<MandatoryDecisionGroup>>,
}

/// A decision group of a Placement, by the `cluster.open-cluster-management.io/
/// decision-group-name` or `-index` label of its PlacementDecisions. The name wins when
/// both are set.
#[skip_serializing_none]
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct MandatoryDecisionGroup {
    pub group_name: Option<String>,
    pub group_index: Option<i32>,
}

/// A strategy, checked: what the hub acts on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rollout {
    pub pace: Pace,
    /// Decision groups that move first, in order, tolerating no failure.
    pub mandatory: Vec<GroupRef>,
    pub max_failures: Share,
    pub min_success_time: Duration,
    /// `None`: no deadline.
    pub progress_deadline: Option<Duration>,
}

/// How many clusters move at once.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pace {
    /// Every selected cluster.
    All,
    /// At most this many.
    Clusters(Share),
    /// One decision group.
    Groups,
}

/// A decision group named by a strategy.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum GroupRef {
    Name(String),
    Index(i32),
}

impl GroupRef {
    /// Whether it names the decision group with this index and name.
    pub fn names(&self, index: i32, name: &str) -> bool {
        match self {
            Self::Name(wanted) => wanted == name,
            Self::Index(wanted) => *wanted == index,
        }
    }
}

/// A number of clusters, or a percentage of the selected ones.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Share {
    Clusters(u32),
    Percent(u32),
}

impl Share {
    /// How many of `total` clusters, percentages rounded up when `up`.
    pub fn of(self, total: usize, up: bool) -> usize {
        match self {
            Self::Clusters(n) => n as usize,
            Self::Percent(p) if up => (total * p as usize).div_ceil(100),
            Self::Percent(p) => total * p as usize / 100,
        }
    }

    /// Reads a count or a percentage; `least` is the smallest count allowed.
    fn parse(value: &IntOrString, least: u32) -> Result<Self, String> {
        let unit = if least == 0 { "0" } else { "1" };
        match value {
            IntOrString::Int(n) if i64::from(*n) >= i64::from(least) => {
                Ok(Self::Clusters(n.unsigned_abs()))
            }
            IntOrString::Int(_) => Err(format!("must be at least {unit}")),
            IntOrString::String(s) => {
                let percent = crate::percent::percent(s).ok_or_else(|| {
                    "must be a number of clusters or a percentage such as \"25%\"".to_owned()
                })?;
                if percent >= least && percent <= 100 {
                    Ok(Self::Percent(percent))
                } else {
                    Err(format!("a percentage must be between {unit}% and 100%"))
                }
            }
        }
    }
}

/// A field of the strategy that does not check out.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RolloutProblem {
    /// Path below `spec.rolloutStrategy`, e.g. `progressive.maxConcurrency`.
    pub field: String,
    pub value: String,
    pub message: String,
}

impl RolloutStrategy {
    /// The strategy, checked; every problem names its field and value.
    pub fn check(&self) -> Result<Rollout, Vec<RolloutProblem>> {
        let (prefix, config, mandatory, pace) = match self.type_ {
            RolloutType::All => {
                return Ok(Rollout {
                    pace: Pace::All,
                    mandatory: Vec::new(),
                    max_failures: Share::Clusters(0),
                    min_success_time: Duration::ZERO,
                    progress_deadline: None,
                });
            }
            RolloutType::Progressive => {
                let settings = self.progressive.clone().unwrap_or_default();
                (
                    "progressive",
                    settings.config,
                    settings.mandatory_decision_groups,
                    Some(settings.max_concurrency),
                )
            }
            RolloutType::ProgressivePerGroup => {
                let settings = self.progressive_per_group.clone().unwrap_or_default();
                (
                    "progressivePerGroup",
                    settings.config,
                    settings.mandatory_decision_groups,
                    None,
                )
            }
        };
        let mut problems = Vec::new();
        let mut share = |field: &str, value: Option<&IntOrString>, least: u32, default: u32| {
            value.map_or(Share::Clusters(default), |value| {
                Share::parse(value, least).unwrap_or_else(|message| {
                    problems.push(problem(&format!("{prefix}.{field}"), value, message));
                    Share::Clusters(default)
                })
            })
        };
        let pace = match pace {
            Some(concurrency) => {
                Pace::Clusters(share("maxConcurrency", concurrency.as_ref(), 1, 1))
            }
            None => Pace::Groups,
        };
        let max_failures = share("maxFailures", config.max_failures.as_ref(), 0, 0);
        let mut duration = |field: &str, value: Option<&str>, none: bool| match value {
            None => None,
            Some("None") if none => None,
            Some(text) => parse_duration(text).map(Some).unwrap_or_else(|message| {
                problems.push(RolloutProblem {
                    field: format!("{prefix}.{field}"),
                    value: text.to_owned(),
                    message,
                });
                None
            }),
        };
        let min_success_time =
            duration("minSuccessTime", config.min_success_time.as_deref(), false)
                .unwrap_or_default();
        let progress_deadline = duration(
            "progressDeadline",
            config.progress_deadline.as_deref(),
            true,
        );
        let mut groups = Vec::new();
        for (i, group) in mandatory.iter().flatten().enumerate() {
            let field = format!("{prefix}.mandatoryDecisionGroups[{i}]");
            match (&group.group_name, group.group_index) {
                (Some(name), _) if !name.is_empty() => groups.push(GroupRef::Name(name.clone())),
                (_, Some(index)) if index >= 0 => groups.push(GroupRef::Index(index)),
                (_, Some(index)) => problems.push(RolloutProblem {
                    field: format!("{field}.groupIndex"),
                    value: index.to_string(),
                    message: "must be at least 0".to_owned(),
                }),
                (_, None) => problems.push(RolloutProblem {
                    field,
                    value: String::new(),
                    message: "must name a group by groupName or groupIndex".to_owned(),
                }),
            }
        }
        if problems.is_empty() {
            Ok(Rollout {
                pace,
                mandatory: groups,
                max_failures,
                min_success_time,
                progress_deadline,
            })
        } else {
            Err(problems)
        }
    }

    /// Whether the strategy needs decision groups, which only `spec.placementRefs` give.
    pub fn needs_decision_groups(&self) -> Option<&'static str> {
        match self.type_ {
            RolloutType::All => None,
            RolloutType::ProgressivePerGroup => Some("type"),
            RolloutType::Progressive => self
                .progressive
                .as_ref()
                .and_then(|p| p.mandatory_decision_groups.as_ref())
                .is_some_and(|groups| !groups.is_empty())
                .then_some("progressive.mandatoryDecisionGroups"),
        }
    }
}

fn problem(field: &str, value: &IntOrString, message: String) -> RolloutProblem {
    RolloutProblem {
        field: field.to_owned(),
        value: match value {
            IntOrString::Int(n) => n.to_string(),
            IntOrString::String(s) => s.clone(),
        },
        message,
    }
}

/// `0`, or hours, minutes and seconds in that order: `90s`, `5m`, `1h30m`.
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    const SHAPE: &str = "must be a duration such as \"90s\", \"5m\" or \"1h30m\"";
    const UNITS: [(char, u64); 3] = [('h', 3600), ('m', 60), ('s', 1)];
    if text == "0" {
        return Ok(Duration::ZERO);
    }
    if text.is_empty() {
        return Err(SHAPE.to_owned());
    }
    let (mut seconds, mut next, mut rest) = (0_u64, 0, text);
    while !rest.is_empty() {
        let digits = rest.bytes().take_while(u8::is_ascii_digit).count();
        let unit = rest[digits..].chars().next().ok_or(SHAPE)?;
        let value: u64 = rest[..digits].parse().map_err(|_| SHAPE)?;
        let position = next
            + UNITS[next..]
                .iter()
                .position(|(u, _)| *u == unit)
                .ok_or(SHAPE)?;
        next = position + 1;
        seconds = value
            .checked_mul(UNITS[position].1)
            .and_then(|s| s.checked_add(seconds))
            .ok_or("is too long")?;
        rest = &rest[digits + unit.len_utf8()..];
    }
    Ok(Duration::from_secs(seconds))
}

/// Where a module's rollout stands: the durable record of which clusters run which
/// revision of `spec.moduleSpec`, and counts a person can read.
#[skip_serializing_none]
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct RolloutStatus {
    /// The revision of `spec.moduleSpec` the rollout moves clusters to.
    pub revision: String,
    /// The revision every selected cluster not listed in `clusters` runs; absent: those
    /// clusters get nothing yet.
    pub base_revision: Option<String>,
    /// `Progressing`, `Succeeded` or `Halted`.
    pub state: String,
    /// E.g. `Progressing 2/5 clusters`, or why the rollout halted.
    pub summary: String,
    /// Selected clusters, by their state in this rollout.
    #[serde(default)]
    pub counts: RolloutCounts,
    /// The same counts per decision group (`spec.placementRefs`), in rollout order.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub groups: Vec<RolloutGroup>,
    /// The clusters that run another revision than `baseRevision`, sorted by name.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub clusters: Vec<RolloutCluster>,
}

/// Selected clusters by rollout state.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct RolloutCounts {
    pub total: i32,
    pub succeeded: i32,
    pub progressing: i32,
    /// Failed or timed out.
    pub failed: i32,
    /// Not reached yet.
    pub to_apply: i32,
}

/// The counts of one decision group.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct RolloutGroup {
    /// `<placement namespace>/<name>/<group name or index>`.
    pub group: String,
    pub counts: RolloutCounts,
}

/// One cluster released to a revision other than the base.
#[skip_serializing_none]
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct RolloutCluster {
    pub cluster: String,
    /// The revision the cluster was given.
    pub revision: String,
    /// `Progressing`, `Succeeded`, `Failed` or `TimeOut`.
    pub state: String,
    /// When the cluster was given `revision`.
    pub since: Time,
    /// When every matching node first ran `revision`.
    pub succeeded_at: Option<Time>,
    /// Why it failed: the first failing node and its reason.
    pub reason: Option<String>,
    /// The decision group it moves with, `<placement namespace>/<name>/<group>` (the
    /// group's name, or its index when it has none); absent without `spec.placementRefs`.
    pub group: Option<String>,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn int(n: i32) -> IntOrString {
        IntOrString::Int(n)
    }

    fn text(s: &str) -> IntOrString {
        IntOrString::String(s.to_owned())
    }

    /// Each problem's field and value.
    fn fields(problems: &[RolloutProblem]) -> Vec<(&str, &str)> {
        problems
            .iter()
            .map(|p| (p.field.as_str(), p.value.as_str()))
            .collect()
    }

    #[test]
    fn durations_are_hours_minutes_seconds_in_order() {
        assert_eq!(parse_duration("0"), Ok(Duration::ZERO));
        assert_eq!(parse_duration("90s"), Ok(Duration::from_secs(90)));
        assert_eq!(parse_duration("5m"), Ok(Duration::from_secs(300)));
        assert_eq!(parse_duration("1h30m"), Ok(Duration::from_secs(5400)));
        assert_eq!(parse_duration("2h0m5s"), Ok(Duration::from_secs(7205)));
        for bad in ["", "5", "m", "5x", "30s5m", "1h1h", "-5s", "5 m", "1.5h"] {
            assert!(parse_duration(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn all_is_the_default_and_moves_everything() {
        let checked = RolloutStrategy::default().check().unwrap();
        assert_eq!(checked.pace, Pace::All);
        assert_eq!(checked.max_failures, Share::Clusters(0));
        assert_eq!(checked.progress_deadline, None);
    }

    #[test]
    fn progressive_defaults_to_one_cluster_at_a_time() {
        let strategy = RolloutStrategy {
            type_: RolloutType::Progressive,
            ..RolloutStrategy::default()
        };
        let checked = strategy.check().unwrap();
        assert_eq!(checked.pace, Pace::Clusters(Share::Clusters(1)));
        assert_eq!(strategy.needs_decision_groups(), None);
    }

    #[test]
    fn per_group_moves_groups_and_mandatory_ones_go_first_by_name_or_index() {
        let strategy = RolloutStrategy {
            type_: RolloutType::ProgressivePerGroup,
            progressive_per_group: Some(RolloutProgressivePerGroup {
                config: RolloutConfig::default(),
                mandatory_decision_groups: Some(vec![
                    MandatoryDecisionGroup {
                        group_name: Some("canary".into()),
                        group_index: Some(3),
                    },
                    MandatoryDecisionGroup {
                        group_name: None,
                        group_index: Some(1),
                    },
                ]),
            }),
            ..RolloutStrategy::default()
        };
        let checked = strategy.check().unwrap();
        assert_eq!(checked.pace, Pace::Groups);
        assert_eq!(
            checked.mandatory,
            [GroupRef::Name("canary".into()), GroupRef::Index(1)]
        );
        assert!(checked.mandatory[0].names(0, "canary"));
        assert!(!checked.mandatory[0].names(3, ""));
        assert!(checked.mandatory[1].names(1, ""));
        assert_eq!(strategy.needs_decision_groups(), Some("type"));
    }

    #[test]
    fn a_mandatory_group_must_be_named_and_makes_progressive_need_groups() {
        let strategy = RolloutStrategy {
            type_: RolloutType::Progressive,
            progressive: Some(RolloutProgressive {
                mandatory_decision_groups: Some(vec![
                    MandatoryDecisionGroup::default(),
                    MandatoryDecisionGroup {
                        group_name: None,
                        group_index: Some(-2),
                    },
                ]),
                ..RolloutProgressive::default()
            }),
            ..RolloutStrategy::default()
        };
        let problems = strategy.check().unwrap_err();
        assert_eq!(
            fields(&problems),
            [
                ("progressive.mandatoryDecisionGroups[0]", ""),
                ("progressive.mandatoryDecisionGroups[1].groupIndex", "-2"),
            ]
        );
        assert_eq!(
            strategy.needs_decision_groups(),
            Some("progressive.mandatoryDecisionGroups")
        );
    }

    #[test]
    fn every_bad_field_is_named_with_its_value() {
        let strategy = RolloutStrategy {
            type_: RolloutType::Progressive,
            progressive: Some(RolloutProgressive {
                config: RolloutConfig {
                    min_success_time: Some("soon".into()),
                    progress_deadline: Some("None".into()),
                    max_failures: Some(text("150%")),
                },
                max_concurrency: Some(int(0)),
                ..RolloutProgressive::default()
            }),
            ..RolloutStrategy::default()
        };
        let problems = strategy.check().unwrap_err();
        assert_eq!(
            fields(&problems),
            [
                ("progressive.maxConcurrency", "0"),
                ("progressive.maxFailures", "150%"),
                ("progressive.minSuccessTime", "soon"),
            ]
        );
    }

    #[test]
    fn shares_round_concurrency_up_and_failures_down() {
        assert_eq!(Share::parse(&text("34%"), 1), Ok(Share::Percent(34)));
        assert_eq!(Share::Percent(34).of(5, true), 2);
        assert_eq!(Share::Percent(34).of(5, false), 1);
        assert_eq!(Share::Clusters(3).of(2, true), 3);
        assert_eq!(Share::parse(&int(0), 0), Ok(Share::Clusters(0)));
        assert!(Share::parse(&int(-1), 0).is_err());
        assert!(Share::parse(&text("0%"), 1).is_err());
        assert!(Share::parse(&text("%"), 0).is_err());
        assert!(Share::parse(&text("ten"), 0).is_err());
        assert!(Share::parse(&text("05%"), 0).is_err());
    }
}
