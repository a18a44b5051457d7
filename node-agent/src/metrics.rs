//! The agent's Prometheus metrics, served on `--metrics-addr` by `kmm-runtime`.

use kmm_runtime::timestamp::TimestampGauge;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

use crate::control::{AgentEvent, EventAction, LoadTiming, Outcome};
use crate::image::pull::PullLimit;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OutcomeLabels {
    /// `succeeded` or `failed`.
    outcome: &'static str,
}

const SUCCEEDED: OutcomeLabels = OutcomeLabels {
    outcome: "succeeded",
};
const FAILED: OutcomeLabels = OutcomeLabels { outcome: "failed" };

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct LimitLabels {
    /// [`PullLimit::name`].
    limit: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StepLabels {
    /// `pull`, `extract` or `modprobe`.
    step: &'static str,
}

const STEPS: [&str; 3] = ["pull", "extract", "modprobe"];

type StepHistograms = Family<StepLabels, Histogram, fn() -> Histogram>;

/// Handles to every metric; clones share them.
#[derive(Clone, Debug)]
pub struct Metrics {
    loads: Family<OutcomeLabels, Counter>,
    unloads: Family<OutcomeLabels, Counter>,
    load_duration: Histogram,
    connected: Gauge,
    modules_loaded: Gauge,
    pull_limits: Family<LimitLabels, Counter>,
    load_steps: StepHistograms,
    load_finished: TimestampGauge,
    desired_received: TimestampGauge,
}

/// A step of a load: from a millisecond (modprobe on the simulated kernel, a small
/// extraction) to minutes (a large pull).
const STEP_SECONDS_BUCKETS: [f64; 15] = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 120.0,
];

fn step_histogram() -> Histogram {
    Histogram::new(STEP_SECONDS_BUCKETS)
}

/// Load attempts take from milliseconds (cached image) to minutes (a large pull).
const LOAD_SECONDS_BUCKETS: [f64; 12] = [
    0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 120.0,
];

impl Metrics {
    /// Creates the metrics and registers them in `registry`.
    pub fn register(registry: &mut Registry) -> Self {
        let metrics = Self {
            loads: Family::default(),
            unloads: Family::default(),
            load_duration: Histogram::new(LOAD_SECONDS_BUCKETS),
            connected: Gauge::default(),
            modules_loaded: Gauge::default(),
            pull_limits: Family::default(),
            load_steps: Family::new_with_constructor(step_histogram),
            load_finished: TimestampGauge::default(),
            desired_received: TimestampGauge::default(),
        };
        registry.register(
            "kmm_agent_loads",
            "Module load attempts, by outcome",
            metrics.loads.clone(),
        );
        registry.register(
            "kmm_agent_unloads",
            "Module unload attempts, by outcome",
            metrics.unloads.clone(),
        );
        registry.register(
            "kmm_agent_load_duration_seconds",
            "Duration of load attempts: pull and extraction plus the kernel side",
            metrics.load_duration.clone(),
        );
        registry.register(
            "kmm_agent_proxy_connected",
            "Whether the stream to kmm-spoke-proxy is open (1) or not (0)",
            metrics.connected.clone(),
        );
        registry.register(
            "kmm_agent_modules_loaded",
            "Modules this agent has loaded in this boot",
            metrics.modules_loaded.clone(),
        );
        registry.register(
            "kmm_agent_pull_limits_exceeded",
            "Pulls refused or stopped by one of their limits, by limit",
            metrics.pull_limits.clone(),
        );
        registry.register(
            "kmm_agent_load_step_duration_seconds",
            "Duration of each step of a load attempt that ran: pull (the reference, manifest and layers), extract, modprobe (the kernel side: in-tree removals, firmware, modprobe); an image already extracted is neither pulled nor extracted",
            metrics.load_steps.clone(),
        );
        registry.register(
            "kmm_agent_load_last_finished_timestamp_seconds",
            "When a load attempt last ended (its state saved), in Unix seconds (0 until then)",
            metrics.load_finished.metric(),
        );
        registry.register(
            "kmm_agent_desired_last_received_timestamp_seconds",
            "When desired modules last arrived (from kmm-spoke-proxy, or a changed --desired-file), in Unix seconds (0 until then)",
            metrics.desired_received.metric(),
        );
        // Every series from the start, at 0: a counter first seen at 1 has no increase
        // to rate, and a dashboard panel on it would be empty until something failed.
        for labels in [SUCCEEDED, FAILED] {
            metrics.loads.get_or_create(&labels).inc_by(0);
            metrics.unloads.get_or_create(&labels).inc_by(0);
        }
        for step in STEPS {
            let _ = metrics.load_steps.get_or_create(&StepLabels { step });
        }
        for limit in PullLimit::ALL {
            metrics
                .pull_limits
                .get_or_create(&LimitLabels {
                    limit: limit.name(),
                })
                .inc_by(0);
        }
        metrics
    }

    /// Counts a pull that hit `limit`.
    pub fn pull_limit_exceeded(&self, limit: PullLimit) {
        self.pull_limits
            .get_or_create(&LimitLabels {
                limit: limit.name(),
            })
            .inc();
    }

    /// Counts one load or unload attempt.
    pub fn observe(&self, event: &AgentEvent) {
        let labels = match event.outcome {
            Outcome::Success => SUCCEEDED,
            Outcome::Failure(_) => FAILED,
        };
        match event.action {
            EventAction::Load => {
                self.loads.get_or_create(&labels).inc();
                let millis = event.pull_ms.saturating_add(event.duration_ms);
                self.load_duration.observe(millis as f64 / 1000.0);
                self.observe_steps(&event.timing);
            }
            EventAction::Unload => {
                self.unloads.get_or_create(&labels).inc();
            }
        }
    }

    fn observe_steps(&self, timing: &LoadTiming) {
        for (step, took) in STEPS
            .into_iter()
            .zip([timing.pull, timing.extract, timing.modprobe])
        {
            if let Some(took) = took {
                self.load_steps
                    .get_or_create(&StepLabels { step })
                    .observe(took.as_secs_f64());
            }
        }
        if let Some(at) = timing.finished {
            self.load_finished.set(at);
        }
    }

    /// Desired modules arrived just now.
    pub fn desired_received(&self) {
        self.desired_received.set_now();
    }

    pub fn set_connected(&self, connected: bool) {
        self.connected.set(i64::from(connected));
    }

    pub fn set_modules_loaded(&self, count: usize) {
        self.modules_loaded
            .set(i64::try_from(count).unwrap_or(i64::MAX));
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, SystemTime, UNIX_EPOCH};

    use prometheus_client::encoding::text::encode;

    use super::*;

    fn event(action: EventAction, outcome: Outcome, pull_ms: u64, duration_ms: u64) -> AgentEvent {
        AgentEvent {
            key: "ns/a".into(),
            version: None,
            action,
            outcome,
            image: "r/a:1".into(),
            digest: None,
            pull_ms,
            duration_ms,
            at_unix_ms: 0,
            revision: 1,
            kept: vec![],
            timing: Default::default(),
        }
    }

    #[test]
    fn counts_by_action_and_outcome() {
        let mut registry = Registry::default();
        let metrics = Metrics::register(&mut registry);
        metrics.observe(&event(EventAction::Load, Outcome::Success, 1500, 500));
        metrics.observe(&event(
            EventAction::Load,
            Outcome::Failure("x".into()),
            0,
            5,
        ));
        metrics.observe(&event(EventAction::Unload, Outcome::Success, 0, 5));
        metrics.set_connected(true);
        metrics.set_modules_loaded(3);
        metrics.pull_limit_exceeded(PullLimit::LayerBytes);
        let mut text = String::new();
        encode(&mut text, &registry).unwrap();
        for line in [
            r#"kmm_agent_loads_total{outcome="succeeded"} 1"#,
            r#"kmm_agent_loads_total{outcome="failed"} 1"#,
            r#"kmm_agent_unloads_total{outcome="succeeded"} 1"#,
            "kmm_agent_load_duration_seconds_sum 2.005",
            "kmm_agent_load_duration_seconds_count 2",
            r#"kmm_agent_load_duration_seconds_bucket{le="2.5"} 2"#,
            r#"kmm_agent_load_duration_seconds_bucket{le="1.0"} 1"#,
            "kmm_agent_proxy_connected 1",
            "kmm_agent_modules_loaded 3",
            r#"kmm_agent_pull_limits_exceeded_total{limit="layer_bytes"} 1"#,
            r#"kmm_agent_pull_limits_exceeded_total{limit="cache_bytes"} 0"#,
            r#"kmm_agent_unloads_total{outcome="failed"} 0"#,
        ] {
            assert!(
                text.lines().any(|l| l == line),
                "{line} missing in:\n{text}"
            );
        }
    }

    fn text(registry: &Registry) -> String {
        let mut text = String::new();
        encode(&mut text, registry).unwrap();
        text
    }

    #[test]
    fn a_loads_steps_are_timed_and_its_end_marked() {
        let mut registry = Registry::default();
        let metrics = Metrics::register(&mut registry);
        let idle = text(&registry);
        for line in [
            r#"kmm_agent_load_step_duration_seconds_count{step="pull"} 0"#,
            r#"kmm_agent_load_step_duration_seconds_count{step="modprobe"} 0"#,
            "kmm_agent_load_last_finished_timestamp_seconds 0.0",
            "kmm_agent_desired_last_received_timestamp_seconds 0.0",
        ] {
            assert!(
                idle.lines().any(|l| l == line),
                "{line} missing in:\n{idle}"
            );
        }

        let finished = UNIX_EPOCH + Duration::from_millis(1_733_000_000_750);
        let mut fresh = event(EventAction::Load, Outcome::Success, 120, 4);
        fresh.timing = LoadTiming {
            pull: Some(Duration::from_millis(100)),
            extract: Some(Duration::from_millis(20)),
            modprobe: Some(Duration::from_millis(4)),
            finished: Some(finished),
        };
        metrics.observe(&fresh);
        // An image already extracted: only the kernel side ran.
        let mut cached = event(EventAction::Load, Outcome::Success, 0, 3);
        cached.timing = LoadTiming {
            modprobe: Some(Duration::from_millis(2)),
            finished: Some(finished + Duration::from_millis(250)),
            ..LoadTiming::default()
        };
        metrics.observe(&cached);
        metrics.observe(&event(EventAction::Unload, Outcome::Success, 0, 5));
        let before = kmm_runtime::timestamp::unix_seconds(SystemTime::now());
        metrics.desired_received();

        let shown = text(&registry);
        for line in [
            r#"kmm_agent_load_step_duration_seconds_count{step="pull"} 1"#,
            r#"kmm_agent_load_step_duration_seconds_sum{step="pull"} 0.1"#,
            r#"kmm_agent_load_step_duration_seconds_count{step="extract"} 1"#,
            r#"kmm_agent_load_step_duration_seconds_bucket{le="0.025",step="extract"} 1"#,
            r#"kmm_agent_load_step_duration_seconds_count{step="modprobe"} 2"#,
            r#"kmm_agent_load_step_duration_seconds_sum{step="modprobe"} 0.006"#,
            r#"kmm_agent_load_step_duration_seconds_bucket{le="0.0025",step="modprobe"} 1"#,
            "kmm_agent_load_last_finished_timestamp_seconds 1733000001.0",
        ] {
            assert!(
                shown.lines().any(|l| l == line),
                "{line} missing in:\n{shown}"
            );
        }
        let received: f64 = shown
            .lines()
            .find_map(|l| l.strip_prefix("kmm_agent_desired_last_received_timestamp_seconds "))
            .unwrap()
            .parse()
            .unwrap();
        assert!(received >= before, "{received} < {before}");
    }
}
