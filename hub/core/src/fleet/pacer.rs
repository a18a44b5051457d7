//! Paces work per key: the first request after a quiet period goes at once (no added
//! latency on a quiet fleet), later ones within the interval are coalesced into one at its
//! end (a busy fleet's thousands of reports cost one reconciliation per interval), and no
//! request is postponed beyond the interval, however many follow it. Pure: the caller
//! passes the time.

use std::collections::{BTreeMap, HashMap};
use std::hash::Hash;
use std::time::{Duration, Instant};

#[derive(Debug)]
pub struct Pacer<K> {
    interval: Duration,
    /// When each key last went.
    last: HashMap<K, Instant>,
    /// Keys held back, with when they may go.
    waiting: BTreeMap<K, Instant>,
}

impl<K: Clone + Eq + Hash + Ord> Pacer<K> {
    pub fn new(interval: Duration) -> Self {
        Self {
            interval,
            last: HashMap::new(),
            waiting: BTreeMap::new(),
        }
    }

    /// Asks for `key` to go; true when it goes now (and is recorded as gone).
    pub fn request(&mut self, key: K, now: Instant) -> bool {
        if self.waiting.contains_key(&key) {
            return false;
        }
        match self.last.get(&key) {
            Some(&last) if now < last + self.interval => {
                self.waiting.insert(key, last + self.interval);
                false
            }
            _ => {
                self.last.insert(key, now);
                true
            }
        }
    }

    /// The held-back keys whose time has come, recorded as gone now.
    pub fn due(&mut self, now: Instant) -> Vec<K> {
        let due: Vec<K> = self
            .waiting
            .iter()
            .filter(|(_, at)| **at <= now)
            .map(|(key, _)| key.clone())
            .collect();
        for key in &due {
            self.waiting.remove(key);
            self.last.insert(key.clone(), now);
        }
        // Keys quiet for a whole interval need no memory.
        let interval = self.interval;
        self.last.retain(|_, last| now < *last + interval);
        due
    }

    /// When the next held-back key may go.
    pub fn next_due(&self) -> Option<Instant> {
        self.waiting.values().min().copied()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const INTERVAL: Duration = Duration::from_millis(100);

    #[test]
    fn the_first_request_goes_at_once_and_a_burst_goes_once_at_the_interval_end() {
        let t0 = Instant::now();
        let mut pacer = Pacer::new(INTERVAL);
        assert!(pacer.request("a", t0));
        assert!(pacer.request("b", t0), "keys are paced apart");
        for ms in [1, 10, 50, 99] {
            assert!(!pacer.request("a", t0 + Duration::from_millis(ms)));
        }
        assert_eq!(pacer.next_due(), Some(t0 + INTERVAL));
        assert!(pacer.due(t0 + Duration::from_millis(99)).is_empty());
        assert_eq!(pacer.due(t0 + INTERVAL), ["a"], "the burst goes once");
        assert!(pacer.due(t0 + INTERVAL * 5).is_empty());
        assert_eq!(pacer.next_due(), None);
    }

    #[test]
    fn a_steady_stream_is_never_postponed_beyond_one_interval() {
        let t0 = Instant::now();
        let mut pacer = Pacer::new(INTERVAL);
        let mut went = vec![];
        for ms in (0..1000).step_by(5) {
            let now = t0 + Duration::from_millis(ms);
            went.extend(pacer.due(now).into_iter().map(|_| ms));
            if pacer.request("a", now) {
                went.push(ms);
            }
        }
        assert_eq!(went, [0, 100, 200, 300, 400, 500, 600, 700, 800, 900]);
    }

    #[test]
    fn a_key_quiet_for_an_interval_goes_at_once_again() {
        let t0 = Instant::now();
        let mut pacer = Pacer::new(INTERVAL);
        assert!(pacer.request("a", t0));
        assert!(pacer.due(t0 + INTERVAL).is_empty());
        assert!(pacer.request("a", t0 + INTERVAL));
        assert!(!pacer.request("a", t0 + INTERVAL + Duration::from_millis(1)));
    }
}
