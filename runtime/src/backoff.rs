//! Jittered exponential backoff between reconnects (proxies to the hub, agents to their
//! proxy), so that a whole fleet does not knock on a restarted server at the same
//! instant. Pure: the caller passes the random fraction.

use std::time::Duration;

/// Delays grow from `initial` doubling up to `max`; each delay is drawn in
/// `[cap / 2, cap]` ("equal jitter"), which keeps a floor while spreading the herd.
#[derive(Clone, Debug)]
pub struct Backoff {
    initial: Duration,
    max: Duration,
    attempt: u32,
}

impl Backoff {
    pub fn new(initial: Duration, max: Duration) -> Self {
        Self {
            initial,
            max: max.max(initial),
            attempt: 0,
        }
    }

    /// The delay before the next attempt; `random` is uniform in `[0, 1)`.
    pub fn next_delay(&mut self, random: f64) -> Duration {
        let factor = 2u32.saturating_pow(self.attempt.min(31));
        let cap = self.initial.saturating_mul(factor).min(self.max);
        self.attempt = self.attempt.saturating_add(1);
        let half = cap / 2;
        half + half.mul_f64(random.clamp(0.0, 1.0))
    }

    /// After a connection that worked: start again from `initial`.
    pub fn reset(&mut self) {
        self.attempt = 0;
    }
}

/// A uniform fraction in `[0, 1)` from the standard library's per-process random keys.
pub fn random_fraction() -> f64 {
    use std::hash::{BuildHasher, Hasher};
    let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
    hasher.write_u64(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64),
    );
    (hasher.finish() >> 11) as f64 / (1u64 << 53) as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: Duration = Duration::from_secs(1);

    #[test]
    fn doubles_up_to_the_cap_within_the_jitter_band() {
        let mut b = Backoff::new(S, 8 * S);
        let caps = [1, 2, 4, 8, 8, 8];
        for cap in caps {
            let cap = cap * S;
            let low = b.clone().next_delay(0.0);
            let high = b.clone().next_delay(0.999_999);
            assert_eq!(low, cap / 2);
            assert!(
                high <= cap && high > cap.mul_f64(0.99),
                "{high:?} vs {cap:?}"
            );
            b.next_delay(0.5);
        }
    }

    #[test]
    fn reset_starts_over() {
        let mut b = Backoff::new(S, 60 * S);
        for _ in 0..5 {
            b.next_delay(1.0);
        }
        b.reset();
        assert_eq!(b.next_delay(1.0), S);
    }

    #[test]
    fn many_attempts_never_overflow() {
        let mut b = Backoff::new(S, 30 * S);
        for _ in 0..200 {
            assert!(b.next_delay(1.0) <= 30 * S);
        }
        assert!(Backoff::new(10 * S, S).next_delay(1.0) <= 10 * S);
    }

    #[test]
    fn random_fraction_is_in_range_and_varies() {
        let draws: Vec<f64> = (0..64).map(|_| random_fraction()).collect();
        assert!(draws.iter().all(|d| (0.0..1.0).contains(d)));
        assert!(draws.iter().any(|d| *d != draws[0]));
    }
}
