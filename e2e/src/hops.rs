//! The hops of one load on the local fleet, from a ManagedClusterModule's create to the
//! bench's watch seeing the last node labelled, as differences of the moments each
//! component publishes (`*_last_*_timestamp_seconds`: every process of the fleet reads
//! the same clock). Pure: the convergence bench scrapes, this computes and prints.
//!
//! Each stage's moment is the latest across the replicas, clusters or nodes that report
//! it, so a hop is the time until the last of them was through. A stage whose latest
//! moment precedes the create did not move in the round (stale) and is reported as such;
//! so is one before the stage ahead of it (a component that acted again later in the
//! round, say a second snapshot): the next hop is then measured from the last stage
//! that was in order.

use std::collections::BTreeMap;
use std::fmt;

use crate::metrics_text::{self, MetricsTextError, SumCount};

/// A moment of a load's path, in order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Stage {
    /// The bench sent the create.
    Created,
    /// The hub's module watch delivered the change.
    HubReceived,
    /// The hub handed the intents to a proxy's stream.
    HubSent,
    /// The proxy got them.
    ProxyReceived,
    /// The proxy placed them and handed a node's desired modules to its agent's stream.
    ProxySent,
    /// The agent got them.
    AgentReceived,
    /// The agent pulled, extracted, ran modprobe and saved its state.
    AgentLoaded,
    /// The apiserver accepted the proxy's label patch.
    Labelled,
    /// The bench's Node watch saw the last label.
    Seen,
}

impl Stage {
    /// The stages components report, with the gauge each reports it by.
    pub const REPORTED: [(Stage, &'static str); 7] = [
        (
            Stage::HubReceived,
            "kmm_hub_module_change_last_received_timestamp_seconds",
        ),
        (
            Stage::HubSent,
            "kmm_hub_intents_last_sent_timestamp_seconds",
        ),
        (
            Stage::ProxyReceived,
            "kmm_spoke_proxy_intents_last_received_timestamp_seconds",
        ),
        (
            Stage::ProxySent,
            "kmm_spoke_proxy_work_last_sent_timestamp_seconds",
        ),
        (
            Stage::AgentReceived,
            "kmm_agent_desired_last_received_timestamp_seconds",
        ),
        (
            Stage::AgentLoaded,
            "kmm_agent_load_last_finished_timestamp_seconds",
        ),
        (
            Stage::Labelled,
            "kmm_spoke_proxy_label_last_patched_timestamp_seconds",
        ),
    ];

    pub fn name(self) -> &'static str {
        match self {
            Stage::Created => "create",
            Stage::HubReceived => "hub-received",
            Stage::HubSent => "hub-sent",
            Stage::ProxyReceived => "proxy-received",
            Stage::ProxySent => "proxy-sent",
            Stage::AgentReceived => "agent-received",
            Stage::AgentLoaded => "agent-loaded",
            Stage::Labelled => "labelled",
            Stage::Seen => "seen",
        }
    }
}

/// The agent's load steps, as `kmm_agent_load_step_duration_seconds{step}` names them.
pub const LOAD_STEPS: [&str; 3] = ["pull", "extract", "modprobe"];
const LOAD_STEP_HISTOGRAM: &str = "kmm_agent_load_step_duration_seconds";

/// The latest moment of every reported stage in `texts` (the `/metrics` of every process
/// that reports any); `None` for a stage no process reports or none has reached (0).
pub fn latest_moments(texts: &[String]) -> Result<BTreeMap<Stage, f64>, MetricsTextError> {
    let mut latest = BTreeMap::new();
    for text in texts {
        for (stage, gauge) in Stage::REPORTED {
            if let Some(at) = metrics_text::gauge(text, gauge)?.filter(|at| *at > 0.0) {
                let slot = latest.entry(stage).or_insert(at);
                *slot = slot.max(at);
            }
        }
    }
    Ok(latest)
}

/// Every agent's load step totals summed: `texts` are the agents' `/metrics`.
pub fn step_totals(texts: &[String]) -> Result<BTreeMap<&'static str, SumCount>, MetricsTextError> {
    let mut totals: BTreeMap<&'static str, SumCount> = BTreeMap::new();
    for text in texts {
        for step in LOAD_STEPS {
            if let Some(found) = metrics_text::histogram(text, LOAD_STEP_HISTOGRAM, ("step", step))?
            {
                let total = totals.entry(step).or_default();
                total.sum += found.sum;
                total.count += found.count;
            }
        }
    }
    Ok(totals)
}

/// The mean of each step over the loads between two readings of [`step_totals`]; a step
/// with no load in between (an image already extracted is neither pulled nor
/// extracted), or whose count went down (an agent restarted), has none.
pub fn step_means(
    before: &BTreeMap<&'static str, SumCount>,
    after: &BTreeMap<&'static str, SumCount>,
) -> BTreeMap<&'static str, StepMean> {
    LOAD_STEPS
        .into_iter()
        .filter_map(|step| {
            let then = before.get(step).copied().unwrap_or_default();
            let now = after.get(step)?;
            let loads = now.count - then.count;
            (loads >= 1.0).then(|| {
                let mean = (now.sum - then.sum) / loads;
                (step, StepMean { mean, loads })
            })
        })
        .collect()
}

/// A step's mean duration over a round's loads.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepMean {
    pub mean: f64,
    pub loads: f64,
}

/// One hop of a round.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Hop {
    /// From the last stage in order to this one.
    Took {
        from: Stage,
        to: Stage,
        seconds: f64,
    },
    /// No process reports the stage.
    Missing(Stage),
    /// Its latest moment precedes the create: it did not move in this round.
    Stale(Stage),
    /// It moved in the round, but its latest moment precedes that of `after`.
    OutOfOrder { stage: Stage, after: Stage },
}

/// The hops from `created` through the `reported` stages to `seen` (all Unix seconds).
pub fn hops(created: f64, reported: &BTreeMap<Stage, f64>, seen: f64) -> Vec<Hop> {
    let mut last = (Stage::Created, created);
    let stages = Stage::REPORTED
        .iter()
        .map(|(stage, _)| (*stage, reported.get(stage).copied()))
        .chain([(Stage::Seen, Some(seen))]);
    let mut hops = vec![];
    for (stage, at) in stages {
        let hop = match at {
            None => Hop::Missing(stage),
            Some(at) if at < created => Hop::Stale(stage),
            Some(at) if at < last.1 => Hop::OutOfOrder {
                stage,
                after: last.0,
            },
            Some(at) => {
                let hop = Hop::Took {
                    from: last.0,
                    to: stage,
                    seconds: at - last.1,
                };
                last = (stage, at);
                hop
            }
        };
        hops.push(hop);
    }
    hops
}

impl fmt::Display for Hop {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Hop::Took { from, to, seconds } => {
                write!(f, "{}->{} {}", from.name(), to.name(), millis(*seconds))
            }
            Hop::Missing(stage) => write!(f, "{}: not reported", stage.name()),
            Hop::Stale(stage) => write!(f, "{}: stale (did not move)", stage.name()),
            Hop::OutOfOrder { stage, after } => {
                write!(
                    f,
                    "{}: before {} (acted again later)",
                    stage.name(),
                    after.name()
                )
            }
        }
    }
}

fn millis(seconds: f64) -> String {
    format!("{:.1}ms", seconds * 1000.0)
}

/// One round's line: the hops, and after the agents' hop the mean of each step.
pub fn round_line(hops: &[Hop], steps: &BTreeMap<&'static str, StepMean>) -> String {
    hops.iter()
        .map(|hop| match hop {
            Hop::Took {
                to: Stage::AgentLoaded,
                ..
            } => format!("{hop} ({})", steps_text(steps)),
            _ => hop.to_string(),
        })
        .collect::<Vec<_>>()
        .join(" | ")
}

fn steps_text(steps: &BTreeMap<&'static str, StepMean>) -> String {
    LOAD_STEPS
        .into_iter()
        .map(|step| match steps.get(step) {
            Some(m) => format!("{step} {} over {} loads", millis(m.mean), m.loads),
            None => format!("{step}: none"),
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// The median of each hop over the rounds that measured it, in stage order, and in how
/// many rounds it was measured.
pub fn median_hops(rounds: &[Vec<Hop>]) -> Vec<(Stage, Stage, f64, usize)> {
    let mut took: BTreeMap<(Stage, Stage), Vec<f64>> = BTreeMap::new();
    for hop in rounds.iter().flatten() {
        if let Hop::Took { from, to, seconds } = hop {
            took.entry((*to, *from)).or_default().push(*seconds);
        }
    }
    took.into_iter()
        .map(|((to, from), mut seconds)| {
            seconds.sort_by(f64::total_cmp);
            (from, to, seconds[seconds.len() / 2], seconds.len())
        })
        .collect()
}

/// The medians as one line, saying where a hop was measured in fewer than `rounds`.
pub fn medians_line(medians: &[(Stage, Stage, f64, usize)], rounds: usize) -> String {
    medians
        .iter()
        .map(|(from, to, median, measured)| {
            let hop = format!("{}->{} {}", from.name(), to.name(), millis(*median));
            if *measured < rounds {
                format!("{hop} ({measured} of {rounds} rounds)")
            } else {
                hop
            }
        })
        .collect::<Vec<_>>()
        .join(" | ")
}

#[cfg(test)]
mod tests {
    use super::*;

    const CREATED: f64 = 1_000.0;

    fn moments(pairs: &[(Stage, f64)]) -> BTreeMap<Stage, f64> {
        pairs.iter().copied().collect()
    }

    fn all_in_order() -> BTreeMap<Stage, f64> {
        moments(&[
            (Stage::HubReceived, 1_000.010),
            (Stage::HubSent, 1_000.040),
            (Stage::ProxyReceived, 1_000.042),
            (Stage::ProxySent, 1_000.043),
            (Stage::AgentReceived, 1_000.044),
            (Stage::AgentLoaded, 1_000.094),
            (Stage::Labelled, 1_000.110),
        ])
    }

    fn took(hops: &[Hop]) -> Vec<(Stage, Stage, i64)> {
        hops.iter()
            .filter_map(|h| match h {
                Hop::Took { from, to, seconds } => {
                    Some((*from, *to, (seconds * 1_000_000.0).round() as i64))
                }
                _ => None,
            })
            .collect()
    }

    #[test]
    fn hops_in_order_are_the_differences_of_consecutive_stages() {
        let hops = hops(CREATED, &all_in_order(), 1_000.115);
        assert_eq!(
            took(&hops),
            [
                (Stage::Created, Stage::HubReceived, 10_000),
                (Stage::HubReceived, Stage::HubSent, 30_000),
                (Stage::HubSent, Stage::ProxyReceived, 2_000),
                (Stage::ProxyReceived, Stage::ProxySent, 1_000),
                (Stage::ProxySent, Stage::AgentReceived, 1_000),
                (Stage::AgentReceived, Stage::AgentLoaded, 50_000),
                (Stage::AgentLoaded, Stage::Labelled, 16_000),
                (Stage::Labelled, Stage::Seen, 5_000),
            ]
        );
    }

    #[test]
    fn a_stage_that_did_not_move_is_stale_and_the_next_hop_spans_it() {
        let mut reported = all_in_order();
        // The proxy's moment is from an earlier round.
        reported.insert(Stage::ProxyReceived, 990.0);
        let hops = hops(CREATED, &reported, 1_000.115);
        assert!(hops.contains(&Hop::Stale(Stage::ProxyReceived)), "{hops:?}");
        assert!(
            took(&hops).contains(&(Stage::HubSent, Stage::ProxySent, 3_000)),
            "{hops:?}"
        );
        assert!(
            !hops
                .iter()
                .any(|h| matches!(h, Hop::Took { seconds, .. } if *seconds < 0.0)),
            "no negative figure: {hops:?}"
        );
    }

    #[test]
    fn a_stage_earlier_than_the_one_before_is_out_of_order() {
        let mut reported = all_in_order();
        // The hub sent again after the proxy's placement.
        reported.insert(Stage::HubSent, 1_000.100);
        let hops = hops(CREATED, &reported, 1_000.115);
        for stage in [Stage::ProxyReceived, Stage::ProxySent, Stage::AgentReceived] {
            assert!(
                hops.contains(&Hop::OutOfOrder {
                    stage,
                    after: Stage::HubSent
                }),
                "{stage:?}: {hops:?}"
            );
        }
        assert_eq!(
            took(&hops),
            [
                (Stage::Created, Stage::HubReceived, 10_000),
                (Stage::HubReceived, Stage::HubSent, 90_000),
                (Stage::HubSent, Stage::Labelled, 10_000),
                (Stage::Labelled, Stage::Seen, 5_000),
            ],
            "AgentLoaded (1000.094) is before HubSent too: {hops:?}"
        );
    }

    #[test]
    fn a_series_no_process_reports_is_missing() {
        let mut reported = all_in_order();
        reported.remove(&Stage::AgentReceived);
        let hops = hops(CREATED, &reported, 1_000.115);
        assert!(
            hops.contains(&Hop::Missing(Stage::AgentReceived)),
            "{hops:?}"
        );
        assert!(took(&hops).contains(&(Stage::ProxySent, Stage::AgentLoaded, 51_000)));
        assert!(
            round_line(&hops, &BTreeMap::new()).contains("agent-received: not reported"),
            "{hops:?}"
        );
    }

    #[test]
    fn the_latest_moment_of_a_stage_wins_and_zero_is_never() {
        let proxy = |received: &str, sent: &str| {
            format!(
                "kmm_spoke_proxy_intents_last_received_timestamp_seconds {received}\n\
                 kmm_spoke_proxy_work_last_sent_timestamp_seconds {sent}\n"
            )
        };
        let texts = [proxy("1000.5", "0.0"), proxy("1000.25", "0.0")];
        let latest = latest_moments(&texts).unwrap();
        assert_eq!(latest.get(&Stage::ProxyReceived), Some(&1_000.5));
        assert_eq!(latest.get(&Stage::ProxySent), None, "never sent");
        assert_eq!(latest.get(&Stage::HubSent), None, "not in these texts");
        assert!(latest_moments(&["kmm_hub_leader x".to_owned()]).is_err());
    }

    #[test]
    fn step_means_are_of_the_loads_between_two_readings() {
        let agent = |pull: (f64, u32), modprobe: (f64, u32)| {
            format!(
                "kmm_agent_load_step_duration_seconds_sum{{step=\"pull\"}} {}\n\
                 kmm_agent_load_step_duration_seconds_count{{step=\"pull\"}} {}\n\
                 kmm_agent_load_step_duration_seconds_sum{{step=\"extract\"}} 0\n\
                 kmm_agent_load_step_duration_seconds_count{{step=\"extract\"}} 0\n\
                 kmm_agent_load_step_duration_seconds_sum{{step=\"modprobe\"}} {}\n\
                 kmm_agent_load_step_duration_seconds_count{{step=\"modprobe\"}} {}\n",
                pull.0, pull.1, modprobe.0, modprobe.1
            )
        };
        let before = step_totals(&[agent((0.5, 2), (0.01, 2)), agent((0.0, 0), (0.0, 0))]).unwrap();
        let after =
            step_totals(&[agent((0.5, 2), (0.014, 3)), agent((0.0, 0), (0.006, 1))]).unwrap();
        let means = step_means(&before, &after);
        assert_eq!(means.get("pull"), None, "no pull in the round: cached");
        assert_eq!(means.get("extract"), None);
        let modprobe = means["modprobe"];
        assert_eq!(modprobe.loads, 2.0);
        assert!((modprobe.mean - 0.005).abs() < 1e-12, "{modprobe:?}");

        let hops = hops(CREATED, &all_in_order(), 1_000.115);
        let line = round_line(&hops, &means);
        assert!(
            line.contains("agent-received->agent-loaded 50.0ms (pull: none, extract: none, modprobe 5.0ms over 2 loads)"),
            "{line}"
        );
    }

    #[test]
    fn medians_are_per_hop_and_say_when_a_round_did_not_measure_one() {
        let round = |hub_sent: f64| {
            let mut reported = all_in_order();
            reported.insert(Stage::HubSent, hub_sent);
            hops(CREATED, &reported, 1_000.115)
        };
        // The third round's hub moment is stale: that round measures hub-received ->
        // proxy-received instead.
        let rounds = [round(1_000.020), round(1_000.040), round(999.0)];
        let medians = median_hops(&rounds);
        let hub = medians
            .iter()
            .find(|(from, to, ..)| (*from, *to) == (Stage::HubReceived, Stage::HubSent))
            .unwrap();
        assert_eq!(hub.3, 2);
        assert!((hub.2 - 0.030).abs() < 1e-9, "the upper of two: {hub:?}");
        let line = medians_line(&medians, rounds.len());
        assert!(
            line.contains("hub-received->hub-sent 30.0ms (2 of 3 rounds)"),
            "{line}"
        );
        assert!(
            line.contains("hub-received->proxy-received 32.0ms (1 of 3 rounds)"),
            "{line}"
        );
        assert!(
            line.contains("labelled->seen 5.0ms |") || line.ends_with("labelled->seen 5.0ms"),
            "{line}"
        );
        let position = |hop: &str| line.find(hop).unwrap();
        assert!(
            position("create->hub-received") < position("agent-loaded->labelled"),
            "{line}"
        );
    }
}
