//! Moments as Prometheus gauges (the `*_timestamp_seconds` convention): when a component
//! last did a step, in seconds since the Unix epoch with the clock's sub-millisecond
//! precision. An operator sees when a cluster or a node last got work; the local
//! fleet's convergence bench, whose processes share one clock, subtracts them into the
//! time each hop of a load took.

use std::sync::atomic::AtomicU64;
use std::time::{SystemTime, UNIX_EPOCH};

use prometheus_client::metrics::gauge::Gauge;

/// One moment; 0 until it is first set. Clones share the value.
#[derive(Clone, Debug, Default)]
pub struct TimestampGauge(Gauge<f64, AtomicU64>);

impl TimestampGauge {
    /// The step was done just now.
    pub fn set_now(&self) {
        self.set(SystemTime::now());
    }

    pub fn set(&self, at: SystemTime) {
        self.0.set(unix_seconds(at));
    }

    /// Seconds since the Unix epoch; 0 until set.
    pub fn get(&self) -> f64 {
        self.0.get()
    }

    /// The gauge to register.
    pub fn metric(&self) -> Gauge<f64, AtomicU64> {
        self.0.clone()
    }
}

/// `at` in seconds since the Unix epoch; 0 for a moment before it (a clock set wrong),
/// which reads as "never" rather than as a negative time.
pub fn unix_seconds(at: SystemTime) -> f64 {
    at.duration_since(UNIX_EPOCH)
        .map(|since| since.as_secs_f64())
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use prometheus_client::encoding::text::encode;
    use prometheus_client::registry::Registry;

    use super::*;

    #[test]
    fn a_moment_is_exposed_in_seconds_with_its_fraction() {
        let moment = TimestampGauge::default();
        let mut registry = Registry::default();
        registry.register("step_last_done_timestamp_seconds", "When", moment.metric());
        assert_eq!(moment.get(), 0.0);

        moment.set(UNIX_EPOCH + Duration::from_micros(1_733_000_000_123_456));
        let mut text = String::new();
        encode(&mut text, &registry).unwrap();
        let value: f64 = text
            .lines()
            .find_map(|l| l.strip_prefix("step_last_done_timestamp_seconds "))
            .unwrap_or_else(|| panic!("no sample in:\n{text}"))
            .parse()
            .unwrap();
        assert!((value - 1_733_000_000.123_456).abs() < 1e-6, "{value}");
        assert!(
            text.contains("# TYPE step_last_done_timestamp_seconds gauge"),
            "{text}"
        );
    }

    #[test]
    fn now_is_between_the_moments_around_it() {
        let moment = TimestampGauge::default();
        let before = unix_seconds(SystemTime::now());
        moment.set_now();
        let after = unix_seconds(SystemTime::now());
        assert!(
            (before..=after).contains(&moment.get()),
            "{before} {} {after}",
            moment.get()
        );
    }

    #[test]
    fn a_moment_before_the_epoch_reads_as_never() {
        assert_eq!(unix_seconds(UNIX_EPOCH - Duration::from_secs(1)), 0.0);
    }
}
