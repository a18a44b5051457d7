//! Paces work per key: the first request after a quiet period goes at once (no added
//! latency on a quiet fleet), later ones within the interval are coalesced into one at its
//! end (a busy fleet's thousands of reports cost one reconciliation per interval), and no
//! request is postponed beyond the interval, however many follow it. A request may ask
//! for a longer spacing than the interval (work that grows with the fleet). Pure: the
//! caller passes the time.

use std::collections::{BTreeMap, HashMap};
use std::hash::Hash;
use std::time::{Duration, Instant};

/// The share of one core the controller's counting of touched modules may take while
/// reports stream in: a count reads every selected cluster's session, so at OCM's full
/// size counting each module ten times a second would take more than both cores.
pub const COUNTING_SHARE: u32 = 4;

/// How long a module waits after its last count before the next, from what that count
/// took, so that counting the `busy` modules (those counted within their spacing, see
/// [`Pacer::busy_with`]) keeps to `1 / COUNTING_SHARE` of a core. A small fleet counts in
/// microseconds, and one module alone at OCM's full size in a few milliseconds: the
/// pacer's interval is the floor.
pub fn count_spacing(cost: Duration, busy: usize) -> Duration {
    cost.saturating_mul(u32::try_from(busy.max(1)).unwrap_or(u32::MAX))
        .saturating_mul(COUNTING_SHARE)
}

#[derive(Debug)]
pub struct Pacer<K> {
    interval: Duration,
    /// When each key that went may go again.
    free: HashMap<K, Instant>,
    /// Keys held back, with when they may go and the spacing to keep after.
    waiting: BTreeMap<K, (Instant, Duration)>,
}

impl<K: Clone + Eq + Hash + Ord> Pacer<K> {
    pub fn new(interval: Duration) -> Self {
        Self {
            interval,
            free: HashMap::new(),
            waiting: BTreeMap::new(),
        }
    }

    /// Asks for `key` to go; true when it goes now (and is recorded as gone).
    pub fn request(&mut self, key: K, now: Instant) -> bool {
        self.request_spaced(key, now, Duration::ZERO)
    }

    /// Asks for `key` to go, its next turn no sooner than `spacing` (at least the
    /// interval) after this one; true when it goes now.
    pub fn request_spaced(&mut self, key: K, now: Instant, spacing: Duration) -> bool {
        let spacing = spacing.max(self.interval);
        if let Some((_, kept)) = self.waiting.get_mut(&key) {
            *kept = spacing;
            return false;
        }
        match self.free.get(&key) {
            Some(&free) if now < free => {
                self.waiting.insert(key, (free, spacing));
                false
            }
            _ => {
                self.free.insert(key, now + spacing);
                true
            }
        }
    }

    /// The held-back keys whose time has come, recorded as gone now.
    pub fn due(&mut self, now: Instant) -> Vec<K> {
        let due: Vec<(K, Duration)> = self
            .waiting
            .iter()
            .filter(|(_, (at, _))| *at <= now)
            .map(|(key, (_, spacing))| (key.clone(), *spacing))
            .collect();
        // Keys free again need no memory.
        self.free.retain(|_, free| now < *free);
        due.into_iter()
            .map(|(key, spacing)| {
                self.waiting.remove(&key);
                self.free.insert(key.clone(), now + spacing);
                key
            })
            .collect()
    }

    /// The keys that went within their spacing, and `key`: the work going on now with
    /// `key`'s, as of the last [`Pacer::due`].
    pub fn busy_with(&self, key: &K) -> usize {
        self.free.len() + usize::from(!self.free.contains_key(key))
    }

    /// When the next held-back key may go.
    pub fn next_due(&self) -> Option<Instant> {
        self.waiting.values().map(|(at, _)| *at).min()
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

    #[test]
    fn a_longer_spacing_holds_the_next_turn_and_a_quiet_key_forgets_it() {
        let t0 = Instant::now();
        let mut pacer = Pacer::new(INTERVAL);
        let spacing = INTERVAL * 4;
        assert!(pacer.request_spaced("a", t0, spacing));
        // Past the interval, within the spacing: held to the spacing's end.
        assert!(!pacer.request_spaced("a", t0 + INTERVAL * 2, spacing));
        assert_eq!(pacer.next_due(), Some(t0 + spacing));
        assert!(pacer.due(t0 + INTERVAL * 3).is_empty());
        // The spacing asked last is the one kept after the turn.
        assert!(!pacer.request_spaced("a", t0 + INTERVAL * 3, INTERVAL));
        assert_eq!(pacer.due(t0 + spacing), ["a"]);
        assert!(pacer.request("a", t0 + spacing + INTERVAL));
        // A spacing below the interval is the interval.
        assert!(pacer.request_spaced("b", t0, Duration::ZERO));
        assert!(!pacer.request_spaced("b", t0 + INTERVAL / 2, Duration::ZERO));
        assert_eq!(pacer.due(t0 + INTERVAL), ["b"]);
    }

    #[test]
    fn counting_every_module_keeps_to_its_share_of_a_core() {
        // OCM's full size: 13.7 ms a count, 20 modules.
        let spacing = count_spacing(Duration::from_micros(13_700), 20);
        assert_eq!(spacing, Duration::from_micros(1_096_000));
        let share = Duration::from_micros(13_700).as_secs_f64() * 20.0 / spacing.as_secs_f64();
        assert!((share - 1.0 / f64::from(COUNTING_SHARE)).abs() < 1e-9);
        // A small fleet stays on the pacer's interval.
        let mut pacer = Pacer::new(INTERVAL);
        let t0 = Instant::now();
        assert!(pacer.request_spaced("a", t0, count_spacing(Duration::from_micros(20), 3)));
        assert!(!pacer.request("a", t0 + INTERVAL / 2));
        assert_eq!(pacer.due(t0 + INTERVAL), ["a"]);
        assert_eq!(count_spacing(Duration::MAX, usize::MAX), Duration::MAX);
        // One module counted alone at OCM's full size keeps the interval too.
        assert!(count_spacing(Duration::from_micros(13_700), 1) < INTERVAL);
        assert_eq!(
            count_spacing(Duration::from_millis(1), 0),
            count_spacing(Duration::from_millis(1), 1)
        );
    }

    #[test]
    fn busy_keys_are_those_within_their_spacing() {
        let t0 = Instant::now();
        let mut pacer = Pacer::new(INTERVAL);
        assert_eq!(pacer.busy_with(&"a"), 1);
        assert!(pacer.request_spaced("a", t0, INTERVAL * 3));
        assert!(pacer.request("b", t0));
        assert_eq!(pacer.busy_with(&"a"), 2, "a is counted once");
        assert_eq!(pacer.busy_with(&"c"), 3);
        assert!(pacer.due(t0 + INTERVAL).is_empty());
        assert_eq!(pacer.busy_with(&"a"), 1, "b's interval is over");
        assert!(pacer.due(t0 + INTERVAL * 3).is_empty());
        assert_eq!(pacer.busy_with(&"b"), 1);
    }
}
