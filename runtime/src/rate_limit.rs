//! A token bucket: at most `burst` at once, refilled at `per_second`. Pure: the caller
//! passes the clock. Bounds what one peer can make a component do (the proxy's
//! TokenReviews and one agent's events, one cluster's stream opens on the hub).

use std::time::{Duration, Instant};

#[derive(Clone, Debug)]
pub struct TokenBucket {
    burst: f64,
    per_second: f64,
    tokens: f64,
    last: Instant,
}

impl TokenBucket {
    /// A full bucket.
    pub fn new(burst: u32, per_second: u32, now: Instant) -> Self {
        Self {
            burst: f64::from(burst),
            per_second: f64::from(per_second),
            tokens: f64::from(burst),
            last: now,
        }
    }

    /// A full bucket refilled at `per_minute`.
    pub fn per_minute(burst: u32, per_minute: u32, now: Instant) -> Self {
        Self {
            burst: f64::from(burst),
            per_second: f64::from(per_minute) / 60.0,
            tokens: f64::from(burst),
            last: now,
        }
    }

    /// Takes one token if there is one.
    pub fn try_take(&mut self, now: Instant) -> bool {
        let elapsed = now.saturating_duration_since(self.last);
        self.last = self.last.max(now);
        self.tokens = (self.tokens + elapsed.as_secs_f64() * self.per_second).min(self.burst);
        if self.tokens >= 1.0 {
            self.tokens -= 1.0;
            true
        } else {
            false
        }
    }

    /// How long until a token is there again.
    pub fn wait(&self) -> Duration {
        Duration::from_secs_f64(((1.0 - self.tokens) / self.per_second).max(0.0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_burst_then_the_rate() {
        let start = Instant::now();
        let mut bucket = TokenBucket::new(3, 2, start);
        assert!((0..3).all(|_| bucket.try_take(start)));
        assert!(!bucket.try_take(start), "the burst is spent");
        assert!(bucket.wait() > Duration::ZERO);
        let half = start + Duration::from_millis(500);
        assert!(bucket.try_take(half), "one token per 500 ms");
        assert!(!bucket.try_take(half));
        let later = start + Duration::from_secs(60);
        assert!(
            (0..3).all(|_| bucket.try_take(later)),
            "refilled, to the burst"
        );
        assert!(!bucket.try_take(later), "never past the burst");
    }

    #[test]
    fn a_clock_going_back_adds_nothing() {
        let start = Instant::now() + Duration::from_secs(10);
        let mut bucket = TokenBucket::new(1, 1, start);
        assert!(bucket.try_take(start));
        assert!(!bucket.try_take(start - Duration::from_secs(5)));
        assert!(!bucket.try_take(start));
    }

    #[test]
    fn per_minute_refills_slowly() {
        let start = Instant::now();
        let mut bucket = TokenBucket::per_minute(2, 12, start);
        assert!(bucket.try_take(start) && bucket.try_take(start));
        assert!(!bucket.try_take(start + Duration::from_secs(4)));
        assert!(
            bucket.try_take(start + Duration::from_secs(5)),
            "one every 5 s"
        );
    }
}
