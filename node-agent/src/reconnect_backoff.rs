//! Delays between connection attempts: exponential with jitter, so that the agents of
//! a whole cluster do not reconnect in lockstep after the proxy restarts. Pure; the
//! randomness is passed in.

use std::time::Duration;

/// Exponential backoff; each delay is drawn from the upper half of the current step
/// ("equal jitter"), so it never collapses to zero and never exceeds `max`.
#[derive(Clone, Debug)]
pub struct ReconnectBackoff {
    initial: Duration,
    max: Duration,
    step: Duration,
}

impl ReconnectBackoff {
    pub fn new(initial: Duration, max: Duration) -> Self {
        let initial = initial.min(max);
        Self {
            initial,
            max,
            step: initial,
        }
    }

    /// The next delay; `random` is uniform in [0, 1).
    pub fn next_delay(&mut self, random: f64) -> Duration {
        let step = self.step;
        self.step = (self.step * 2).min(self.max);
        let half = step / 2;
        half + half.mul_f64(random.clamp(0.0, 1.0))
    }

    /// After a connection that worked: start over from the initial delay.
    pub fn reset(&mut self) {
        self.step = self.initial;
    }
}

/// A uniform number in [0, 1) from the standard library's randomly seeded hasher;
/// jitter needs no better randomness than that.
pub fn random_unit() -> f64 {
    use std::hash::{BuildHasher, Hasher};
    let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
    hasher.write_u64(0);
    (hasher.finish() >> 11) as f64 / (1u64 << 53) as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: Duration = Duration::from_secs(1);

    #[test]
    fn doubles_up_to_the_cap_within_the_upper_half() {
        let mut b = ReconnectBackoff::new(S, 30 * S);
        let lows: Vec<u64> = (0..8)
            .map(|_| b.next_delay(0.0).as_millis() as u64)
            .collect();
        assert_eq!(lows, [500, 1000, 2000, 4000, 8000, 15000, 15000, 15000]);
        let mut b = ReconnectBackoff::new(S, 30 * S);
        let highs: Vec<Duration> = (0..8).map(|_| b.next_delay(0.999_999)).collect();
        assert!(highs.iter().all(|d| *d <= 30 * S), "{highs:?}");
        assert!(highs[7] > 29 * S, "{highs:?}");
    }

    #[test]
    fn reset_starts_over_and_random_is_clamped() {
        let mut b = ReconnectBackoff::new(S, 30 * S);
        for _ in 0..10 {
            b.next_delay(0.5);
        }
        b.reset();
        assert_eq!(b.next_delay(0.0), S / 2);
        assert_eq!(b.next_delay(7.0), 2 * S);
        assert_eq!(b.next_delay(-1.0), 2 * S);
    }

    #[test]
    fn initial_above_the_cap_is_capped() {
        let mut b = ReconnectBackoff::new(60 * S, 30 * S);
        assert_eq!(b.next_delay(1.0), 30 * S);
    }

    #[test]
    fn random_unit_is_in_range_and_varies() {
        let draws: Vec<f64> = (0..64).map(|_| random_unit()).collect();
        assert!(draws.iter().all(|r| (0.0..1.0).contains(r)), "{draws:?}");
        assert!(draws.windows(2).any(|w| w[0] != w[1]), "{draws:?}");
    }
}
