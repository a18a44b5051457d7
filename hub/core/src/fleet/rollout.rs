//! A module's rollout across its selected clusters: which revision of `spec.moduleSpec`
//! each cluster runs, and which clusters move next. Pure.
//!
//! The record lives in the module's status (`status.rollout`), written before any cluster
//! is given a new revision, so that a hub restart or a new leader serves every cluster
//! exactly what it served before: a cluster not listed runs `baseRevision`, a listed one
//! the revision it was released to. `All` needs no record: every cluster runs the
//! current spec at once. Clusters move in waves: the decision groups of the module's
//! Placements, mandatory groups first (one at a time, tolerating no failure), then the
//! others in order; within a wave, by name. `Progressive` releases at most
//! `maxConcurrency` clusters at a time, `ProgressivePerGroup` one whole group once every
//! cluster before it settled. A released cluster succeeds when every matching node runs
//! the new revision, fails when a node fails, and times out after `progressDeadline`;
//! past `maxFailures` failed clusters the rollout halts, and the clusters not reached keep
//! their revision. A later spec change starts a new rollout from where each cluster is.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kmm_api::{Pace, Rollout, RolloutCluster, RolloutCounts, RolloutGroup, RolloutStatus};

pub const PROGRESSING: &str = "Progressing";
pub const SUCCEEDED: &str = "Succeeded";
pub const HALTED: &str = "Halted";
pub const FAILED: &str = "Failed";
pub const TIME_OUT: &str = "TimeOut";
const TO_APPLY: &str = "ToApply";

/// What a selected cluster shows for the module now.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Observation {
    /// Every matching node runs the revision the cluster was given (and the proxy has
    /// applied it).
    pub converged: bool,
    /// The first failing node and why, when one fails.
    pub failure: Option<String>,
    /// The decision group that placed it, when a Placement chose it.
    pub wave: Option<Wave>,
    /// Its proxy was connected when it was counted.
    pub connected: bool,
}

/// The decision group a Placement put a cluster in: the wave it moves with. Clusters
/// chosen by `selector` alone share one wave.
#[derive(Clone, Debug, Default, PartialEq, Eq, PartialOrd, Ord)]
pub struct Wave {
    /// Position of the Placement in `spec.placementRefs`.
    pub placement: usize,
    pub index: i32,
    pub name: String,
    /// How status shows it: `<namespace>/<placement>/<group name or index>`.
    pub label: String,
}

/// Which revision of the module a cluster is to run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Assigned<'a> {
    /// The current spec.
    Current,
    /// An earlier revision, by its name.
    Earlier(&'a str),
    /// Nothing yet: the cluster was never reached.
    Nothing,
}

/// The revision `cluster` runs under a `Progressive` strategy, by the record. Without a
/// record the module is new: no cluster was reached yet. (`All` needs no record: every
/// cluster runs the current spec.)
pub fn assigned<'a>(
    current: &str,
    record: Option<&'a RolloutStatus>,
    cluster: &str,
) -> Assigned<'a> {
    let revision = record.and_then(|record| {
        record
            .clusters
            .binary_search_by(|c| c.cluster.as_str().cmp(cluster))
            .ok()
            .map(|i| record.clusters[i].revision.as_str())
            .or(record.base_revision.as_deref())
    });
    match revision {
        Some(r) if r == current => Assigned::Current,
        Some(r) => Assigned::Earlier(r),
        None => Assigned::Nothing,
    }
}

/// The rollout's next record, and when to look again at the latest (a cluster's
/// `minSuccessTime` ending or `progressDeadline` passing).
pub fn advance(
    strategy: &Rollout,
    current: &str,
    record: Option<&RolloutStatus>,
    selected: &BTreeMap<String, Observation>,
    now: Timestamp,
) -> (RolloutStatus, Option<Duration>) {
    let concurrency = match strategy.pace {
        Pace::All => return (everywhere(current, selected), None),
        Pace::Clusters(share) => Some(share),
        Pace::Groups => None,
    };
    let base = match record {
        Some(record) => record.base_revision.clone(),
        // A module that never ran anywhere: clusters get it as they are reached.
        None => None,
    };
    let listed: BTreeMap<&str, &RolloutCluster> = record
        .map(|r| r.clusters.iter().map(|c| (c.cluster.as_str(), c)).collect())
        .unwrap_or_default();
    if base.as_deref() == Some(current) && listed.values().all(|c| c.revision == current) {
        // Rolled out: every cluster runs the current revision, whatever its nodes do now.
        let mut status = everywhere(current, selected);
        status.state = SUCCEEDED.to_owned();
        status.summary = format!("{SUCCEEDED}, revision {current}");
        return (status, None);
    }
    let mandatory = |observed: &Observation| {
        observed.wave.as_ref().and_then(|wave| {
            strategy
                .mandatory
                .iter()
                .position(|group| group.names(wave.index, &wave.name))
        })
    };
    let total = selected.len();
    let mut clusters: Vec<RolloutCluster> = Vec::new();
    // Clusters not on the current revision, with the wave they move in: mandatory groups
    // in their order, then every group in its order.
    let mut to_apply: Vec<(&str, (usize, Option<&Wave>))> = Vec::new();
    let mut next_check: Option<Duration> = None;
    let mut check_in = |at: Timestamp| {
        let wait = Duration::try_from(now.duration_until(at)).unwrap_or_default();
        next_check = Some(next_check.map_or(wait, |w| w.min(wait)));
    };
    let (mut failed, mut active) = (0, 0);
    let (mut mandatory_active, mut mandatory_failed) = (0, 0);
    // Each cluster's state: the counts, overall and per wave.
    let mut states: BTreeMap<&str, (Option<&Wave>, &str)> = BTreeMap::new();
    for (name, observed) in selected {
        let entry = listed.get(name.as_str()).copied();
        let revision = entry.map(|c| c.revision.as_str()).or(base.as_deref());
        let position = mandatory(observed);
        if revision != Some(current) {
            states.insert(name, (observed.wave.as_ref(), TO_APPLY));
            to_apply.push((
                name,
                (position.unwrap_or(usize::MAX), observed.wave.as_ref()),
            ));
            if let Some(entry) = entry {
                clusters.push(entry.clone());
            }
            continue;
        }
        // On the current revision: listed since its release, or by the base.
        let since = entry.map_or(Time(now), |c| c.since.clone());
        let mut next = RolloutCluster {
            cluster: name.clone(),
            revision: current.to_owned(),
            state: PROGRESSING.to_owned(),
            since,
            succeeded_at: entry.and_then(|c| c.succeeded_at.clone()),
            reason: None,
            group: observed.wave.as_ref().map(|w| w.label.clone()),
        };
        let (was_active, was_failed) = (active, failed);
        if observed.converged || next.succeeded_at.is_some() {
            let at = next.succeeded_at.get_or_insert(Time(now)).0;
            next.state = SUCCEEDED.to_owned();
            let settled = at + strategy.min_success_time;
            if settled > now {
                active += 1;
                check_in(settled);
            }
        } else if let Some(failure) = &observed.failure {
            next.state = FAILED.to_owned();
            next.reason = Some(failure.clone());
            failed += 1;
        } else if let Some(failed_before) =
            entry.filter(|c| c.state == FAILED || c.state == TIME_OUT)
        {
            // A failure ends with success only: a cluster whose nodes say nothing yet (its
            // proxy reconnecting to a new leader, say) has not recovered.
            next.state.clone_from(&failed_before.state);
            next.reason.clone_from(&failed_before.reason);
            failed += 1;
        } else if let Some(deadline) = strategy.progress_deadline
            && next.since.0 + deadline <= now
        {
            next.state = TIME_OUT.to_owned();
            next.reason = Some(format!(
                "not every matching node ran the revision within {}s",
                deadline.as_secs()
            ));
            failed += 1;
        } else {
            active += 1;
            if let Some(deadline) = strategy.progress_deadline {
                check_in(next.since.0 + deadline);
            }
        }
        if position.is_some() {
            mandatory_active += active - was_active;
            mandatory_failed += failed - was_failed;
        }
        let state = if failed > was_failed {
            FAILED
        } else if next.state == SUCCEEDED {
            SUCCEEDED
        } else {
            PROGRESSING
        };
        states.insert(name, (observed.wave.as_ref(), state));
        if entry.is_some() || base.as_deref() != Some(current) {
            clusters.push(next);
        }
    }
    // A mandatory group tolerates no failure.
    let halted = failed > strategy.max_failures.of(total, false) || mandatory_failed > 0;
    if !halted {
        to_apply.sort_by(|(a, a_wave), (b, b_wave)| a_wave.cmp(b_wave).then(a.cmp(b)));
        let first_wave = to_apply.first().map(|(_, wave)| *wave);
        let mandatory_left = first_wave.is_some_and(|(position, _)| position != usize::MAX);
        let release = match concurrency {
            // The rest move at their pace once the mandatory groups settled.
            Some(share) if !mandatory_left && mandatory_active == 0 => {
                share.of(total, true).saturating_sub(active)
            }
            // One whole wave, once every cluster before it settled.
            _ if active == 0 => to_apply
                .iter()
                .take_while(|(_, wave)| Some(*wave) == first_wave)
                .count(),
            _ => 0,
        };
        for (name, (_, wave)) in to_apply.drain(..release.min(to_apply.len())) {
            states.insert(name, (wave, PROGRESSING));
            clusters.retain(|c| c.cluster != name);
            clusters.push(RolloutCluster {
                cluster: name.to_owned(),
                revision: current.to_owned(),
                state: PROGRESSING.to_owned(),
                since: Time(now),
                succeeded_at: None,
                reason: None,
                group: wave.map(|w| w.label.clone()),
            });
            if let Some(deadline) = strategy.progress_deadline {
                check_in(now + deadline);
            }
        }
    }
    clusters.sort_by(|a, b| a.cluster.cmp(&b.cluster));
    let counts = tally(states.values().map(|(_, state)| *state));
    let groups = per_wave(&states);
    let succeeded = counts.succeeded;
    if counts.succeeded == counts.total {
        // Every cluster runs the current revision: it becomes the base.
        return (
            RolloutStatus {
                revision: current.to_owned(),
                base_revision: Some(current.to_owned()),
                state: SUCCEEDED.to_owned(),
                summary: format!("{SUCCEEDED}, revision {current}"),
                counts,
                groups,
                clusters: Vec::new(),
            },
            next_check,
        );
    }
    let (state, summary) = if halted {
        let first = clusters
            .iter()
            .find(|c| c.revision == current && (c.state == FAILED || c.state == TIME_OUT));
        let why = first.map_or_else(String::new, |c| {
            format!(
                ": {} {} ({})",
                c.cluster,
                c.state,
                c.reason.as_deref().unwrap_or_default()
            )
        });
        (
            HALTED,
            format!("{HALTED} {succeeded}/{total} clusters, {failed} failed{why}"),
        )
    } else {
        (
            PROGRESSING,
            format!("{PROGRESSING} {succeeded}/{total} clusters"),
        )
    };
    (
        RolloutStatus {
            revision: current.to_owned(),
            base_revision: base,
            state: state.to_owned(),
            summary,
            counts,
            groups,
            clusters,
        },
        next_check,
    )
}

/// `All`: every selected cluster runs the current revision; only the counts move.
fn everywhere(current: &str, selected: &BTreeMap<String, Observation>) -> RolloutStatus {
    let succeeded = selected.values().filter(|o| o.converged).count();
    let failed = selected
        .values()
        .filter(|o| !o.converged && o.failure.is_some())
        .count();
    let total = selected.len();
    let state = if succeeded == total {
        SUCCEEDED
    } else {
        PROGRESSING
    };
    RolloutStatus {
        revision: current.to_owned(),
        base_revision: Some(current.to_owned()),
        state: state.to_owned(),
        summary: format!("{state} {succeeded}/{total} clusters"),
        counts: RolloutCounts {
            total: count(total),
            succeeded: count(succeeded),
            progressing: count(total - succeeded - failed),
            failed: count(failed),
            to_apply: 0,
        },
        groups: Vec::new(),
        clusters: Vec::new(),
    }
}

/// Counts per wave, in the waves' order; none when no Placement made the waves.
fn per_wave(states: &BTreeMap<&str, (Option<&Wave>, &str)>) -> Vec<RolloutGroup> {
    let mut waves: BTreeMap<&Wave, Vec<&str>> = BTreeMap::new();
    for (wave, state) in states.values() {
        if let Some(wave) = wave {
            waves.entry(wave).or_default().push(state);
        }
    }
    waves
        .into_iter()
        .map(|(wave, states)| RolloutGroup {
            group: wave.label.clone(),
            counts: tally(states),
        })
        .collect()
}

/// Clusters by their state in the rollout.
fn tally<'a>(states: impl IntoIterator<Item = &'a str>) -> RolloutCounts {
    let mut counts = RolloutCounts::default();
    for state in states {
        counts.total += 1;
        match state {
            SUCCEEDED => counts.succeeded += 1,
            FAILED => counts.failed += 1,
            TO_APPLY => counts.to_apply += 1,
            _ => counts.progressing += 1,
        }
    }
    counts
}

fn count(n: usize) -> i32 {
    i32::try_from(n).unwrap_or(i32::MAX)
}

/// The revisions a cluster may run while `previous` or `next` is the record (the old one
/// is served until the new one is written), and the current one: a kept revision outside
/// them may go.
pub fn revisions_in_use<'a>(
    current: &'a str,
    previous: Option<&'a RolloutStatus>,
    next: &'a RolloutStatus,
) -> BTreeSet<&'a str> {
    [previous, Some(next)]
        .into_iter()
        .flatten()
        .flat_map(|r| {
            r.clusters
                .iter()
                .map(|c| c.revision.as_str())
                .chain(r.base_revision.as_deref())
                .chain([r.revision.as_str()])
        })
        .chain([current])
        .collect()
}

/// Something a person should see in the module's Events.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Milestone {
    pub warning: bool,
    pub reason: &'static str,
    pub note: String,
}

/// What changed between two records of a `Progressive` rollout worth an Event: clusters
/// released (a wave starts), the rollout halting, the rollout completing (the current
/// revision becoming the base).
pub fn milestones(previous: Option<&RolloutStatus>, next: &RolloutStatus) -> Vec<Milestone> {
    let mut found = Vec::new();
    let released: Vec<&str> = next
        .clusters
        .iter()
        .filter(|c| c.revision == next.revision)
        .filter(|c| {
            previous.is_none_or(|p| {
                p.clusters
                    .iter()
                    .all(|old| old.cluster != c.cluster || old.revision != c.revision)
            })
        })
        .map(|c| c.cluster.as_str())
        .collect();
    if !released.is_empty() {
        found.push(Milestone {
            warning: false,
            reason: "RolloutReleased",
            note: format!(
                "{} now get{} revision {}; {}",
                released.join(", "),
                if released.len() == 1 { "s" } else { "" },
                next.revision,
                next.summary
            ),
        });
    }
    let before = previous.map(|p| (p.state.as_str(), p.revision.as_str()));
    if next.state == HALTED && before != Some((HALTED, next.revision.as_str())) {
        found.push(Milestone {
            warning: true,
            reason: "RolloutHalted",
            note: next.summary.clone(),
        });
    }
    let folded = |r: &RolloutStatus| r.base_revision.as_deref() == Some(next.revision.as_str());
    if folded(next) && !previous.is_some_and(folded) {
        found.push(Milestone {
            warning: false,
            reason: "RolloutSucceeded",
            note: format!("every selected cluster runs revision {}", next.revision),
        });
    }
    found
}

/// Whether two records assign any cluster a different revision.
pub fn assignment_changed(previous: Option<&RolloutStatus>, next: &RolloutStatus) -> bool {
    let assignment = |r: &RolloutStatus| {
        (
            r.base_revision.clone(),
            r.clusters
                .iter()
                .map(|c| (c.cluster.clone(), c.revision.clone()))
                .collect::<Vec<_>>(),
        )
    };
    previous.is_none_or(|p| assignment(p) != assignment(next))
}

#[cfg(test)]
mod tests {
    use kmm_api::{GroupRef, Share};

    use super::*;

    fn progressive(concurrency: u32, failures: u32) -> Rollout {
        Rollout {
            pace: Pace::Clusters(Share::Clusters(concurrency)),
            mandatory: Vec::new(),
            max_failures: Share::Clusters(failures),
            min_success_time: Duration::ZERO,
            progress_deadline: None,
        }
    }

    fn at(seconds: i64) -> Timestamp {
        Timestamp::from_second(1_800_000_000 + seconds).unwrap()
    }

    fn fleet(clusters: &[(&str, Observation)]) -> BTreeMap<String, Observation> {
        clusters
            .iter()
            .map(|(name, o)| ((*name).to_owned(), o.clone()))
            .collect()
    }

    /// The record after one step from `record`.
    fn step(
        strategy: &Rollout,
        current: &str,
        record: &RolloutStatus,
        clusters: &[(&str, Observation)],
        seconds: i64,
    ) -> RolloutStatus {
        advance(
            strategy,
            current,
            Some(record),
            &fleet(clusters),
            at(seconds),
        )
        .0
    }

    fn waiting() -> Observation {
        Observation::default()
    }

    fn converged() -> Observation {
        Observation {
            converged: true,
            ..Observation::default()
        }
    }

    fn failing(why: &str) -> Observation {
        Observation {
            failure: Some(why.to_owned()),
            ..Observation::default()
        }
    }

    /// The revision each cluster runs by the record.
    fn revisions<'a>(
        record: &'a RolloutStatus,
        current: &str,
        names: &[&str],
    ) -> Vec<Assigned<'a>> {
        names
            .iter()
            .map(|n| assigned(current, Some(record), n))
            .collect()
    }

    /// A record where every cluster runs `revision`.
    fn settled(revision: &str) -> RolloutStatus {
        RolloutStatus {
            revision: revision.to_owned(),
            base_revision: Some(revision.to_owned()),
            state: SUCCEEDED.to_owned(),
            ..RolloutStatus::default()
        }
    }

    #[test]
    fn all_makes_the_current_revision_the_base_at_once() {
        let record = settled("r1");
        let all = Rollout {
            pace: Pace::All,
            ..progressive(1, 0)
        };
        let (status, next) = advance(
            &all,
            "r2",
            Some(&record),
            &fleet(&[("a", converged()), ("b", failing("n1: LoadFailed"))]),
            at(0),
        );
        assert_eq!(status.base_revision.as_deref(), Some("r2"));
        assert_eq!(status.summary, "Progressing 1/2 clusters");
        assert_eq!((status.counts.failed, status.counts.to_apply), (1, 0));
        assert_eq!(next, None);
    }

    #[test]
    fn one_cluster_at_a_time_then_the_new_revision_becomes_the_base() {
        let strategy = progressive(1, 0);
        let names = ["a", "b", "c"];
        let before = settled("r1");
        let first = step(
            &strategy,
            "r2",
            &before,
            &[("a", waiting()), ("b", waiting()), ("c", waiting())],
            0,
        );
        assert_eq!(
            revisions(&first, "r2", &names),
            [
                Assigned::Current,
                Assigned::Earlier("r1"),
                Assigned::Earlier("r1")
            ]
        );
        assert_eq!(first.summary, "Progressing 0/3 clusters");
        // Until a converges, nothing else moves.
        let again = step(
            &strategy,
            "r2",
            &first,
            &[("a", waiting()), ("b", converged()), ("c", waiting())],
            5,
        );
        assert_eq!(again.clusters, first.clusters);
        let second = step(
            &strategy,
            "r2",
            &again,
            &[("a", converged()), ("b", converged()), ("c", waiting())],
            10,
        );
        assert_eq!(
            revisions(&second, "r2", &names),
            [
                Assigned::Current,
                Assigned::Current,
                Assigned::Earlier("r1")
            ]
        );
        assert_eq!(second.counts.succeeded, 1);
        let third = step(
            &strategy,
            "r2",
            &second,
            &[("a", converged()), ("b", converged()), ("c", waiting())],
            11,
        );
        let done = step(
            &strategy,
            "r2",
            &third,
            &[("a", converged()), ("b", converged()), ("c", converged())],
            20,
        );
        assert_eq!(done.state, SUCCEEDED);
        assert_eq!(done.base_revision.as_deref(), Some("r2"));
        assert!(done.clusters.is_empty(), "{:?}", done.clusters);
        assert_eq!(done.summary, "Succeeded, revision r2");
        // Rolled out: a node failing later halts nothing, and nothing is recorded.
        let (later, next) = advance(
            &strategy,
            "r2",
            Some(&done),
            &fleet(&[
                ("a", failing("a-n1: LoadFailed")),
                ("b", converged()),
                ("c", converged()),
            ]),
            at(30),
        );
        assert_eq!((later.state.as_str(), next), (SUCCEEDED, None));
        assert_eq!(later.counts.failed, 1);
        assert!(later.clusters.is_empty());
    }

    #[test]
    fn a_new_module_reaches_clusters_only_as_they_are_released() {
        assert_eq!(assigned("r1", None, "a"), Assigned::Nothing);
        let (first, _) = advance(
            &progressive(2, 0),
            "r1",
            None,
            &fleet(&[("a", waiting()), ("b", waiting()), ("c", waiting())]),
            at(0),
        );
        assert_eq!(
            revisions(&first, "r1", &["a", "b", "c"]),
            [Assigned::Current, Assigned::Current, Assigned::Nothing]
        );
    }

    #[test]
    fn a_failure_past_max_failures_halts_and_the_rest_keep_their_revision() {
        let strategy = progressive(1, 0);
        let first = step(
            &strategy,
            "r2",
            &settled("r1"),
            &[("a", waiting()), ("b", waiting())],
            0,
        );
        let halted = step(
            &strategy,
            "r2",
            &first,
            &[("a", failing("a-node1: ImageNotFound")), ("b", waiting())],
            10,
        );
        assert_eq!(halted.state, HALTED);
        assert_eq!(
            halted.summary,
            "Halted 0/2 clusters, 1 failed: a Failed (a-node1: ImageNotFound)"
        );
        assert_eq!(
            revisions(&halted, "r2", &["a", "b"]),
            [Assigned::Current, Assigned::Earlier("r1")]
        );
        // The image appears: a converges, the rollout resumes with b.
        let resumed = step(
            &strategy,
            "r2",
            &halted,
            &[("a", converged()), ("b", waiting())],
            20,
        );
        assert_eq!(resumed.state, PROGRESSING);
        assert_eq!(
            revisions(&resumed, "r2", &["a", "b"]),
            [Assigned::Current, Assigned::Current]
        );
    }

    #[test]
    fn tolerated_failures_do_not_block_the_rollout() {
        let strategy = progressive(1, 1);
        let first = step(
            &strategy,
            "r2",
            &settled("r1"),
            &[("a", waiting()), ("b", waiting())],
            0,
        );
        let next = step(
            &strategy,
            "r2",
            &first,
            &[("a", failing("a-node1: LoadFailed")), ("b", waiting())],
            10,
        );
        assert_eq!(next.state, PROGRESSING);
        assert_eq!(next.counts.failed, 1);
        assert_eq!(
            assigned("r2", Some(&next), "b"),
            Assigned::Current,
            "one failure is tolerated: b moves"
        );
    }

    #[test]
    fn min_success_time_holds_the_next_cluster_and_says_when_to_look_again() {
        let strategy = Rollout {
            min_success_time: Duration::from_secs(60),
            ..progressive(1, 0)
        };
        let first = step(
            &strategy,
            "r2",
            &settled("r1"),
            &[("a", waiting()), ("b", waiting())],
            0,
        );
        let (held, next) = advance(
            &strategy,
            "r2",
            Some(&first),
            &fleet(&[("a", converged()), ("b", waiting())]),
            at(10),
        );
        assert_eq!(assigned("r2", Some(&held), "b"), Assigned::Earlier("r1"));
        assert_eq!(next, Some(Duration::from_secs(60)));
        let moved = step(
            &strategy,
            "r2",
            &held,
            &[("a", converged()), ("b", waiting())],
            70,
        );
        assert_eq!(assigned("r2", Some(&moved), "b"), Assigned::Current);
    }

    #[test]
    fn a_cluster_past_its_progress_deadline_times_out() {
        let strategy = Rollout {
            progress_deadline: Some(Duration::from_secs(30)),
            ..progressive(1, 0)
        };
        let (first, next) = advance(
            &strategy,
            "r2",
            Some(&settled("r1")),
            &fleet(&[("a", waiting()), ("b", waiting())]),
            at(0),
        );
        assert_eq!(next, Some(Duration::from_secs(30)));
        let timed_out = step(
            &strategy,
            "r2",
            &first,
            &[("a", waiting()), ("b", waiting())],
            30,
        );
        assert_eq!(timed_out.state, HALTED);
        assert_eq!(timed_out.clusters[0].state, TIME_OUT);
        assert_eq!(
            assigned("r2", Some(&timed_out), "b"),
            Assigned::Earlier("r1")
        );
    }

    #[test]
    fn a_new_spec_mid_rollout_starts_from_where_each_cluster_is() {
        let strategy = progressive(1, 0);
        let first = step(
            &strategy,
            "r2",
            &settled("r1"),
            &[("a", failing("a-node1: ImageNotFound")), ("b", waiting())],
            0,
        );
        let halted = step(
            &strategy,
            "r2",
            &first,
            &[("a", failing("a-node1: ImageNotFound")), ("b", waiting())],
            1,
        );
        assert_eq!(halted.state, HALTED);
        // r3 fixes the image: a (on r2) and b (on r1) are both to apply; a goes first.
        let replaced = step(
            &strategy,
            "r3",
            &halted,
            &[("a", waiting()), ("b", waiting())],
            2,
        );
        assert_eq!(replaced.state, PROGRESSING);
        assert_eq!(
            revisions(&replaced, "r3", &["a", "b"]),
            [Assigned::Current, Assigned::Earlier("r1")]
        );
    }

    #[test]
    fn clusters_no_longer_selected_leave_the_record() {
        let strategy = progressive(2, 0);
        let first = step(
            &strategy,
            "r2",
            &settled("r1"),
            &[("a", waiting()), ("b", waiting()), ("c", waiting())],
            0,
        );
        assert_eq!(first.clusters.len(), 2);
        let next = step(
            &strategy,
            "r2",
            &first,
            &[("b", waiting()), ("c", waiting())],
            1,
        );
        let listed: Vec<&str> = next.clusters.iter().map(|c| c.cluster.as_str()).collect();
        assert_eq!(listed, ["b", "c"]);
    }

    #[test]
    fn waves_halts_and_completion_are_milestones() {
        let strategy = progressive(1, 0);
        let before = settled("r1");
        let first = step(
            &strategy,
            "r2",
            &before,
            &[("a", waiting()), ("b", waiting())],
            0,
        );
        assert!(assignment_changed(Some(&before), &first));
        let started = milestones(Some(&before), &first);
        assert_eq!(started.len(), 1, "{started:?}");
        assert_eq!(started[0].reason, "RolloutReleased");
        assert_eq!(
            started[0].note,
            "a now gets revision r2; Progressing 0/2 clusters"
        );
        let halted = step(
            &strategy,
            "r2",
            &first,
            &[
                ("a", failing("a-n1: LoadFailed: no such file")),
                ("b", waiting()),
            ],
            1,
        );
        assert!(!assignment_changed(Some(&first), &halted));
        let events = milestones(Some(&first), &halted);
        assert_eq!(events.len(), 1);
        assert!(events[0].warning);
        assert_eq!(events[0].reason, "RolloutHalted");
        assert!(milestones(Some(&halted), &halted).is_empty());
        let resumed = step(
            &strategy,
            "r2",
            &halted,
            &[("a", converged()), ("b", waiting())],
            2,
        );
        let done = step(
            &strategy,
            "r2",
            &resumed,
            &[("a", converged()), ("b", converged())],
            3,
        );
        let events = milestones(Some(&resumed), &done);
        assert_eq!(events.len(), 1, "{events:?}");
        assert_eq!(events[0].reason, "RolloutSucceeded");
    }

    #[test]
    fn a_failed_cluster_stays_failed_until_it_succeeds() {
        let strategy = progressive(1, 0);
        let first = step(
            &strategy,
            "r2",
            &settled("r1"),
            &[("a", waiting()), ("b", waiting())],
            0,
        );
        let halted = step(
            &strategy,
            "r2",
            &first,
            &[("a", failing("a-n1: ImageNotFound")), ("b", waiting())],
            1,
        );
        // A new leader, before the cluster's proxy reported again.
        let restarted = step(
            &strategy,
            "r2",
            &halted,
            &[("a", waiting()), ("b", waiting())],
            2,
        );
        assert_eq!(restarted, halted);
    }

    #[test]
    fn reverting_to_the_base_mid_rollout_moves_the_released_clusters_back() {
        let strategy = progressive(1, 0);
        let first = step(
            &strategy,
            "r2",
            &settled("r1"),
            &[("a", waiting()), ("b", waiting())],
            0,
        );
        assert_eq!(assigned("r1", Some(&first), "a"), Assigned::Earlier("r2"));
        let reverted = step(
            &strategy,
            "r1",
            &first,
            &[("a", waiting()), ("b", converged())],
            1,
        );
        assert_eq!(reverted.state, PROGRESSING);
        assert_eq!(
            revisions(&reverted, "r1", &["a", "b"]),
            [Assigned::Current, Assigned::Current]
        );
    }

    #[test]
    fn a_module_selecting_no_cluster_has_nothing_to_roll_out() {
        // Why the hub reconciles only once it knows every cluster: an empty selection
        // makes the current revision the base at once.
        let (status, _) = advance(
            &progressive(1, 0),
            "r2",
            Some(&settled("r1")),
            &BTreeMap::new(),
            at(0),
        );
        assert_eq!(status.base_revision.as_deref(), Some("r2"));
        assert_eq!(status.state, SUCCEEDED);
    }

    #[test]
    fn a_revision_stays_kept_while_either_record_assigns_it() {
        let strategy = progressive(1, 0);
        let (first, _) = advance(
            &strategy,
            "r2",
            Some(&settled("r1")),
            &fleet(&[("a", waiting()), ("b", waiting())]),
            at(0),
        );
        // r3 arrives: a ran r2 by the old record and is released to r3 by the new one;
        // b runs the base r1 by both.
        let replaced = step(
            &strategy,
            "r3",
            &first,
            &[("a", waiting()), ("b", waiting())],
            1,
        );
        let kept = revisions_in_use("r3", Some(&first), &replaced);
        assert_eq!(kept, BTreeSet::from(["r1", "r2", "r3"]));
        // Once every cluster runs r3 and the old record is gone, only r3 stays.
        let done = settled("r3");
        assert_eq!(
            revisions_in_use("r3", Some(&done), &done),
            BTreeSet::from(["r3"])
        );
    }

    /// `observed`, in the decision group `index` (named `name`) of the first Placement.
    fn in_group(index: i32, name: &str, observed: Observation) -> Observation {
        Observation {
            wave: Some(Wave {
                placement: 0,
                index,
                name: name.to_owned(),
                label: format!("ns/p/{index}"),
            }),
            ..observed
        }
    }

    fn per_group(mandatory: Vec<GroupRef>) -> Rollout {
        Rollout {
            pace: Pace::Groups,
            mandatory,
            ..progressive(1, 0)
        }
    }

    /// The clusters the record gives `current`.
    fn released<'a>(record: &'a RolloutStatus, current: &str) -> Vec<&'a str> {
        record
            .clusters
            .iter()
            .filter(|c| c.revision == current)
            .map(|c| c.cluster.as_str())
            .collect()
    }

    #[test]
    fn per_group_releases_a_whole_group_once_the_one_before_settled() {
        let strategy = per_group(Vec::new());
        let fleet_of = |a: Observation, b: Observation, c: Observation| {
            vec![
                ("a", in_group(1, "", a)),
                ("b", in_group(0, "", b)),
                ("c", in_group(0, "", c)),
            ]
        };
        let first = step(
            &strategy,
            "r2",
            &settled("r1"),
            &fleet_of(waiting(), waiting(), waiting()),
            0,
        );
        assert_eq!(released(&first, "r2"), ["b", "c"], "group 0 moves whole");
        assert_eq!(first.clusters[0].group.as_deref(), Some("ns/p/0"));
        let per_group: Vec<(&str, i32, i32)> = first
            .groups
            .iter()
            .map(|g| (g.group.as_str(), g.counts.progressing, g.counts.to_apply))
            .collect();
        assert_eq!(per_group, [("ns/p/0", 2, 0), ("ns/p/1", 0, 1)]);
        let one_done = step(
            &strategy,
            "r2",
            &first,
            &fleet_of(waiting(), converged(), waiting()),
            1,
        );
        assert_eq!(released(&one_done, "r2"), ["b", "c"], "c still progresses");
        let both = step(
            &strategy,
            "r2",
            &one_done,
            &fleet_of(waiting(), converged(), converged()),
            2,
        );
        assert_eq!(released(&both, "r2"), ["a", "b", "c"]);
    }

    #[test]
    fn mandatory_groups_go_first_one_at_a_time_whatever_the_concurrency() {
        let strategy = Rollout {
            mandatory: vec![GroupRef::Name("canary".into()), GroupRef::Index(2)],
            ..progressive(5, 5)
        };
        let fleet_of = |observed: [Observation; 4]| {
            let [a, b, c, d] = observed;
            vec![
                ("a", in_group(0, "", a)),
                ("b", in_group(2, "", b)),
                ("c", in_group(1, "canary", c)),
                ("d", in_group(1, "canary", d)),
            ]
        };
        let first = step(
            &strategy,
            "r2",
            &settled("r1"),
            &fleet_of([waiting(), waiting(), waiting(), waiting()]),
            0,
        );
        assert_eq!(released(&first, "r2"), ["c", "d"], "the canary group alone");
        let second = step(
            &strategy,
            "r2",
            &first,
            &fleet_of([waiting(), waiting(), converged(), converged()]),
            1,
        );
        assert_eq!(released(&second, "r2"), ["b", "c", "d"], "then group 2");
        let rest = step(
            &strategy,
            "r2",
            &second,
            &fleet_of([waiting(), converged(), converged(), converged()]),
            2,
        );
        assert_eq!(released(&rest, "r2"), ["a", "b", "c", "d"]);
    }

    #[test]
    fn a_failure_in_a_mandatory_group_halts_whatever_max_failures_allows() {
        let strategy = Rollout {
            mandatory: vec![GroupRef::Index(0)],
            ..progressive(5, 5)
        };
        let first = step(
            &strategy,
            "r2",
            &settled("r1"),
            &[
                ("a", in_group(0, "", waiting())),
                ("b", in_group(1, "", waiting())),
            ],
            0,
        );
        assert_eq!(released(&first, "r2"), ["a"]);
        let failed = step(
            &strategy,
            "r2",
            &first,
            &[
                ("a", in_group(0, "", failing("n1: LoadFailed"))),
                ("b", in_group(1, "", waiting())),
            ],
            1,
        );
        assert_eq!(failed.state, HALTED);
        assert_eq!(released(&failed, "r2"), ["a"], "b keeps r1");
    }

    #[test]
    fn progressive_follows_the_groups_order_before_names() {
        let strategy = progressive(1, 0);
        let first = step(
            &strategy,
            "r2",
            &settled("r1"),
            &[
                ("a", in_group(3, "", waiting())),
                ("z", in_group(0, "", waiting())),
            ],
            0,
        );
        assert_eq!(released(&first, "r2"), ["z"]);
    }
}
