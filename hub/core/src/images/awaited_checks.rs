//! The image checks a cluster's last snapshot waits for. A module whose image has no
//! record yet keeps the intent the cluster was last sent (see
//! `fleet::intents::while_unchecked`); each record that lands would otherwise recompute
//! the cluster and send it one more module's change: a kernel upgrade's 120 checks, 16 at
//! a time, made ten snapshots per cluster. The cluster is recomputed once the last of its
//! checks is recorded instead, or once it waited [`AWAIT_BOUND`], whichever comes first.

use std::collections::BTreeSet;
use std::hash::{BuildHasher, BuildHasherDefault, DefaultHasher};
use std::time::{Duration, Instant};

use super::need::ImageKey;

/// Longest a cluster's snapshot waits for the rest of its checks once one is recorded:
/// a check is a registry round trip, bounded by the worker's timeouts; this bounds what
/// a slow one holds up.
pub const AWAIT_BOUND: Duration = Duration::from_secs(2);

/// The checks one cluster waits for, kept as hashes: 3,500 clusters each waiting for
/// dozens of images would otherwise hold a copy of every name. Two images sharing a hash
/// can only end a wait sooner (a recompute more) or leave an abandoned one to the bound.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct AwaitedChecks {
    images: BTreeSet<u64>,
    since: Option<Instant>,
}

/// Whether a recorded image's cluster is to be recomputed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AfterRecord {
    /// Now: the image was its last awaited check, or it waited long enough, or it waited
    /// for none (the record may change what it runs).
    Recompute,
    /// Once the rest of its checks are recorded.
    Wait,
}

fn hash(key: &ImageKey) -> u64 {
    BuildHasherDefault::<DefaultHasher>::default().hash_one(key)
}

impl AwaitedChecks {
    /// What the cluster's latest recompute left unchecked, at `now`.
    pub fn set<'a>(&mut self, unchecked: impl IntoIterator<Item = &'a ImageKey>, now: Instant) {
        self.images = unchecked.into_iter().map(hash).collect();
        self.since = (!self.images.is_empty()).then_some(now);
    }

    /// The image's record changed at `now`.
    pub fn recorded(&mut self, key: &ImageKey, now: Instant) -> AfterRecord {
        self.images.remove(&hash(key));
        if self.due().is_none_or(|due| now >= due) {
            AfterRecord::Recompute
        } else {
            AfterRecord::Wait
        }
    }

    /// Whether it waits for an image no longer `needed`: that check will never be
    /// recorded (its module or kernel went, say).
    pub fn abandoned(&self, needed: &BTreeSet<u64>) -> bool {
        self.images.iter().any(|image| !needed.contains(image))
    }

    /// When it is to be recomputed at the latest, while it waits: [`AWAIT_BOUND`] after
    /// the recompute that left the checks it waits for.
    pub fn due(&self) -> Option<Instant> {
        self.since
            .filter(|_| !self.images.is_empty())
            .map(|since| since + AWAIT_BOUND)
    }

    /// The hashes [`AwaitedChecks::abandoned`] compares with, of the images needed now.
    pub fn needed<'a>(keys: impl IntoIterator<Item = &'a ImageKey>) -> BTreeSet<u64> {
        keys.into_iter().map(hash).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(module: &str, kernel: &str) -> ImageKey {
        ImageKey {
            module: module.into(),
            image: format!("registry/{module}:{kernel}"),
        }
    }

    #[test]
    fn a_cluster_waiting_for_several_checks_is_recomputed_at_the_last() {
        let start = Instant::now();
        let (a, b, c) = (key("a", "6.1"), key("b", "6.1"), key("c", "6.1"));
        let mut awaited = AwaitedChecks::default();
        awaited.set([&a, &b], start);
        assert!(awaited.due().is_some());
        assert_eq!(awaited.recorded(&a, start), AfterRecord::Wait);
        // An image it does not wait for changes nothing of the wait.
        assert_eq!(awaited.recorded(&c, start), AfterRecord::Wait);
        assert_eq!(awaited.recorded(&b, start), AfterRecord::Recompute);
        assert_eq!(awaited.due(), None);
        // Waiting for nothing, any record may change what the cluster runs.
        assert_eq!(awaited.recorded(&c, start), AfterRecord::Recompute);
    }

    #[test]
    fn a_slow_check_holds_the_others_up_for_the_bound_and_no_longer() {
        let start = Instant::now();
        let (a, b) = (key("a", "6.1"), key("a", "6.2"));
        let mut awaited = AwaitedChecks::default();
        awaited.set([&a, &b], start);
        assert_eq!(awaited.due(), Some(start + AWAIT_BOUND));
        let almost = start + AWAIT_BOUND - Duration::from_millis(1);
        assert_eq!(awaited.recorded(&a, almost), AfterRecord::Wait);
        assert_eq!(
            awaited.due(),
            Some(start + AWAIT_BOUND),
            "b is still awaited"
        );
        assert_eq!(
            awaited.recorded(&a, start + AWAIT_BOUND),
            AfterRecord::Recompute
        );
    }

    #[test]
    fn a_wait_for_an_image_no_longer_needed_is_abandoned() {
        let start = Instant::now();
        let (a, b) = (key("a", "6.1"), key("b", "6.1"));
        let mut awaited = AwaitedChecks::default();
        awaited.set([&a, &b], start);
        assert!(!awaited.abandoned(&AwaitedChecks::needed([&a, &b])));
        assert!(awaited.abandoned(&AwaitedChecks::needed([&a])));
        // Nothing awaited is never abandoned nor due, whatever is needed.
        awaited.set([], start);
        assert!(!awaited.abandoned(&BTreeSet::new()));
        assert_eq!(awaited.due(), None);
    }
}
