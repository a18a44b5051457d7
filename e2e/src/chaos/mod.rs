//! The chaos soak (issue #27): seeded random faults on the local fleet, a platform
//! team's changes between and during them, and an invariant checker watching the whole
//! time. `cargo bench -p kmm-e2e --bench chaos -- --minutes N --seed S` runs it.
//!
//! * [`schedule`] the seeded dice: a seed names one sequence of faults and changes.
//! * [`faults`] what breaks and how it is undone.
//! * [`changes`] the soak's model of what it asked for, and its writes.
//! * [`invariants`] the judge: wrong unloads, wrong labels, two leaders, orphans.
//!
//! One round: a fault is injected; 1-3 changes are made while it holds (seeded pauses
//! apart, each write retried while an apiserver is away); the fault is undone once its
//! hold passed and it took effect; 0-2 more changes; then the soak waits until the fleet
//! matches the model (agents' state files, labels, deletions done), which is the
//! round's settle time, and counts what was still wrong at the deadline.

pub mod changes;
pub mod faults;
pub mod invariants;
pub mod schedule;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use anyhow::{Result, bail};

use self::changes::{Change, Model};
use self::faults::Fault;
use self::invariants::{Checker, Counts, Observation, observe};
use self::schedule::Dice;
use crate::fixture::{Fleet, wait_until};
use crate::fleet::Settings;

/// How long the fleet gets to match the model after a round's last write.
const SETTLE: Duration = Duration::from_secs(180);

#[derive(Debug, Clone)]
pub struct Options {
    pub minutes: f64,
    pub seed: u64,
}

/// What a soak found.
#[derive(Debug, Default)]
pub struct Report {
    pub minutes: f64,
    pub seed: u64,
    pub faults: usize,
    pub changes: usize,
    pub counts: Counts,
    pub orphans: usize,
    /// Modules not loaded (or not labelled, or not deleted) when they should have been,
    /// at a settle deadline.
    pub unsettled: usize,
    pub settle_max_s: f64,
    pub restarts: u64,
    /// Faults that did not take effect within their deadline.
    pub ineffective: usize,
    /// Why the soak stopped early, if it did.
    pub aborted: Option<String>,
}

impl Report {
    /// The soak's one line.
    pub fn line(&self) -> String {
        format!(
            "chaos: minutes={} seed={} faults={} changes={} wrong_unloads={} wrong_labels={} \
             orphans={} two_leaders={} settle_max_s={:.1}",
            self.minutes,
            self.seed,
            self.faults,
            self.changes,
            self.counts.wrong_unloads,
            self.counts.wrong_labels,
            self.orphans,
            self.counts.two_leaders,
            self.settle_max_s,
        )
    }

    /// The figures besides the counts.
    pub fn figures(&self) -> String {
        let peaks: Vec<String> = self
            .counts
            .peak_kib
            .iter()
            .map(|(component, kib)| format!("{component}={}MiB", kib / 1024))
            .collect();
        format!(
            "chaos figures: unsettled={} ineffective_faults={} restarts={} samples={} \
             peak_rss: {}{}",
            self.unsettled,
            self.ineffective,
            self.restarts,
            self.counts.samples,
            peaks.join(" "),
            self.aborted
                .as_ref()
                .map(|a| format!(" aborted: {a}"))
                .unwrap_or_default()
        )
    }
}

/// The soak's clock, for the sequence it prints.
struct Clock(Instant);

impl Clock {
    fn say(&self, what: &str) {
        println!("chaos [{:>7.1}s] {what}", self.0.elapsed().as_secs_f64());
    }
}

/// Runs the soak on the running fleet, restores what it broke and removes what it
/// created, whatever happens in between.
pub async fn run(fleet: &Fleet, settings: &Settings, options: &Options) -> Result<Report> {
    let clock = Clock(Instant::now());
    // Only the names carry the run's moment (a soak cut short may leave its objects);
    // everything drawn comes from the seed.
    let run = format!(
        "chaos-{:x}",
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)?
            .as_secs()
            & 0x00ff_ffff
    );
    let mut model = Model::new(fleet, &run)?;
    for node in &model.nodes {
        clock.say(&format!(
            "node {}/{} in slot {}{}{}",
            node.cluster,
            node.node,
            node.slot,
            if node.image { "" } else { ", no image" },
            if node.narrow { ", narrow" } else { "" }
        ));
    }
    let mut report = Report {
        minutes: options.minutes,
        seed: options.seed,
        ..Report::default()
    };
    let restarts_before = invariants::restarts(fleet).await?;
    model.set_up(fleet).await?;
    let checker = Checker::start(fleet, &model)?;
    let mut soak = Soak {
        fleet,
        settings,
        model: &mut model,
        checker: &checker,
        clock: &clock,
        report: &mut report,
    };
    if let Err(e) = soak.rounds(options).await {
        clock.say(&format!("soak stopped: {e:#}"));
        soak.report.aborted = Some(format!("{e:#}"));
    }
    let cleanup = soak.finish().await;
    report.counts = checker.stop().await;
    report.restarts = invariants::restarts(fleet)
        .await?
        .saturating_sub(restarts_before);
    if let Err(e) = &cleanup {
        clock.say(&format!("cleanup failed: {e:#}"));
    }
    model.tear_down(fleet).await?;
    cleanup?;
    Ok(report)
}

struct Soak<'a> {
    fleet: &'a Fleet,
    settings: &'a Settings,
    model: &'a mut Model,
    checker: &'a Checker,
    clock: &'a Clock,
    report: &'a mut Report,
}

impl Soak<'_> {
    async fn rounds(&mut self, options: &Options) -> Result<()> {
        let mut dice = Dice::new(options.seed);
        let end = Instant::now() + Duration::from_secs_f64(options.minutes * 60.0);
        for slot in 0..changes::SLOTS {
            self.change(Change::Create(slot)).await?;
        }
        self.settle("start").await?;
        let spokes = self.model.spokes.clone();
        let nodes: Vec<String> = self.model.nodes.iter().map(|n| n.node.clone()).collect();
        while Instant::now() < end {
            let fault = Fault::draw(&mut dice, &spokes, &nodes);
            let hold = dice.pause(Duration::from_secs(3), Duration::from_secs(15));
            let during: Vec<Duration> = (0..1 + dice.below(3))
                .map(|_| dice.pause(Duration::from_millis(500), Duration::from_secs(4)))
                .collect();
            let after: Vec<Duration> = (0..dice.below(3))
                .map(|_| dice.pause(Duration::from_millis(500), Duration::from_secs(3)))
                .collect();
            let rest = dice.pause(Duration::from_secs(1), Duration::from_secs(5));
            self.report.faults += 1;
            self.clock.say(&format!(
                "fault {}: {fault} (held {hold:?})",
                self.report.faults
            ));
            let active = fault.inject(self.fleet, self.settings).await?;
            let fleet = self.fleet;
            let clock = self.clock;
            let undone = async {
                tokio::time::sleep(hold).await;
                let effect = active.took_effect(fleet).await;
                if let Err(e) = &effect {
                    clock.say(&format!("fault had no effect: {e:#}"));
                }
                clock.say(&format!("restore: {}", active.fault));
                let restored = active.restore(fleet).await;
                clock.say(&format!("restored: {}", fault));
                (effect.is_ok(), restored)
            };
            let changed = async {
                for pause in &during {
                    // A seeded pause of the schedule, not a wait for anything.
                    tokio::time::sleep(*pause).await;
                    let change = self.model.draw(&mut dice);
                    self.change(change).await?;
                }
                anyhow::Ok(())
            };
            let ((effective, restored), changed) = tokio::join!(undone, changed);
            if !effective {
                self.report.ineffective += 1;
            }
            restored?;
            changed?;
            for pause in &after {
                tokio::time::sleep(*pause).await;
                let change = self.model.draw(&mut dice);
                self.change(change).await?;
            }
            self.settle(&format!("fault {}", self.report.faults))
                .await?;
            tokio::time::sleep(rest).await;
        }
        Ok(())
    }

    /// Applies one change to the model and writes it, telling the checker before and
    /// after.
    async fn change(&mut self, change: Change) -> Result<()> {
        let nodes = self.model.affected(&change);
        self.checker.begin(&nodes);
        let what = self.model.apply(&change);
        self.report.changes += 1;
        self.clock
            .say(&format!("change {}: {what}", self.report.changes));
        let written = self.model.write(self.fleet, &change).await;
        self.checker.written(&nodes, self.model);
        written
    }

    /// Waits until the fleet matches the model; records how long it took, or what was
    /// still wrong at the deadline (and then stops the soak: the model no longer says
    /// what the fleet holds).
    async fn settle(&mut self, after: &str) -> Result<()> {
        let started = Instant::now();
        let last = std::sync::Mutex::new(Observation::default());
        let settled = wait_until(
            &format!("the fleet to settle after {after}"),
            SETTLE,
            || async {
                let seen = observe(self.fleet, self.model)
                    .await
                    .map_err(|e| format!("{e:#}"))?;
                let done = seen.settled();
                let summary = format!("{seen:?}");
                *last.lock().unwrap_or_else(|e| e.into_inner()) = seen;
                done.then_some(()).ok_or(summary)
            },
        )
        .await;
        let took = started.elapsed().as_secs_f64();
        match settled {
            Ok(()) => {
                self.clock
                    .say(&format!("settled after {after} in {took:.1}s"));
                self.report.settle_max_s = self.report.settle_max_s.max(took);
                self.model.settled();
                Ok(())
            }
            Err(e) => {
                let seen = last.into_inner().unwrap_or_else(|e| e.into_inner());
                self.report.orphans += seen.orphans.len();
                self.report.unsettled +=
                    seen.missing.len() + seen.labels.len() + seen.undeleted.len();
                self.clock
                    .say(&format!("NOT settled after {after}: {seen:#?}"));
                bail!("{e}")
            }
        }
    }

    /// Deletes every module and waits until nothing of them is left anywhere.
    async fn finish(&mut self) -> Result<()> {
        for change in self.model.clear() {
            self.change(change).await?;
        }
        self.settle("the end").await
    }
}

impl Report {
    /// Which counts are not zero (the soak failed if any is, or if it stopped early).
    pub fn failures(&self) -> BTreeMap<&'static str, usize> {
        let report = self;
        [
            ("wrong_unloads", report.counts.wrong_unloads),
            ("wrong_labels", report.counts.wrong_labels),
            ("orphans", report.orphans),
            ("two_leaders", report.counts.two_leaders),
            ("unsettled", report.unsettled),
        ]
        .into_iter()
        .filter(|(_, n)| *n > 0)
        .collect()
    }
}
