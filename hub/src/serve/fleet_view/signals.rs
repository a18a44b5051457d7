//! How the fleet view wakes the tasks that follow it: the controller (touched modules),
//! the image worker (needs changed, an image unchecked), the preflight writer, and
//! everything waiting for the watches to list.

use std::collections::BTreeSet;
use std::sync::Mutex;

use tokio::sync::{Notify, watch};

use super::lock;
use crate::images::ImageKey;

/// Modules whose status an event may have changed, waiting for their reconciliation.
#[derive(Debug)]
pub struct Touched {
    modules: WakingSet<String>,
    /// Bumped on every touch, even of a module already waiting: the controller takes
    /// touched modules, readers of the view (the fleet UI) only follow that they were.
    version: watch::Sender<u64>,
}

impl Default for Touched {
    fn default() -> Self {
        Self {
            modules: WakingSet::default(),
            version: watch::Sender::new(0),
        }
    }
}

impl Touched {
    pub fn add(&self, modules: impl IntoIterator<Item = String>) {
        let mut any = false;
        self.modules
            .add(modules.into_iter().inspect(|_| any = true));
        if any {
            self.version.send_modify(|n| *n = n.wrapping_add(1));
        }
    }

    /// Changes whenever a module is touched.
    pub fn versions(&self) -> watch::Receiver<u64> {
        self.version.subscribe()
    }

    /// Waits for touched modules and takes them all.
    pub async fn take(&self) -> BTreeSet<String> {
        loop {
            let taken = self.modules.take();
            if !taken.is_empty() {
                return taken;
            }
            self.modules.added().await;
        }
    }
}

/// A set that wakes whoever waits on it when it grows.
#[derive(Debug)]
pub struct WakingSet<T> {
    items: Mutex<BTreeSet<T>>,
    notify: Notify,
}

impl<T> Default for WakingSet<T> {
    fn default() -> Self {
        Self {
            items: Mutex::new(BTreeSet::new()),
            notify: Notify::new(),
        }
    }
}

impl<T: Ord> WakingSet<T> {
    pub fn add(&self, items: impl IntoIterator<Item = T>) {
        let mut set = lock(&self.items);
        let before = set.len();
        set.extend(items);
        if set.len() != before {
            self.notify.notify_one();
        }
    }

    /// Takes what was added, none waited for.
    pub fn take(&self) -> BTreeSet<T> {
        std::mem::take(&mut *lock(&self.items))
    }

    /// Returns once items were added since the last return.
    pub async fn added(&self) {
        self.notify.notified().await;
    }
}

/// Clusters whose snapshots a change of a module made stale, waiting for the recompute
/// task (`FleetView::recompute_stale`): changes that come together (modules created at
/// once, the image checks of a kernel upgrade) cost each cluster one recompute, not one
/// per change.
pub type StaleClusters = WakingSet<String>;

/// Images snapshots wait for because nobody checked them yet, for the image worker.
/// Every recompute that meets them reports them again: the worker looks anew only for
/// one it is not already checking (a kernel upgrade reports the same few images from
/// every cluster while their checks run, and each pass reads every cluster).
#[derive(Debug, Default)]
pub struct UncheckedImages(WakingSet<ImageKey>);

impl UncheckedImages {
    pub fn report(&self, keys: impl IntoIterator<Item = ImageKey>) {
        self.0.add(keys);
    }

    /// Returns once an image was reported that `covered` does not cover (not in flight,
    /// say); the covered ones are forgotten.
    pub async fn uncovered(&self, covered: impl Fn(&ImageKey) -> bool) {
        loop {
            if self.0.take().iter().any(|key| !covered(key)) {
                return;
            }
            self.0.added().await;
        }
    }
}

/// A registry check of the image worker, counted in [`Signals::checks`] from before it
/// asks until its outcome is recorded (dropped).
#[derive(Debug)]
pub struct CheckUnderWay<'a>(&'a watch::Sender<usize>);

impl<'a> CheckUnderWay<'a> {
    pub fn start(checks: &'a watch::Sender<usize>) -> Self {
        checks.send_modify(|n| *n += 1);
        Self(checks)
    }
}

impl Drop for CheckUnderWay<'_> {
    fn drop(&mut self) {
        self.0.send_modify(|n| *n = n.saturating_sub(1));
    }
}

/// The fleet view's wake-ups.
#[derive(Debug)]
pub struct Signals {
    /// True once every watch has listed.
    pub synced: watch::Sender<bool>,
    pub touched: Touched,
    pub stale: StaleClusters,
    /// Bumped when what the fleet's images are needed for may have changed (kernels,
    /// modules, selection): wakes the image worker.
    pub needs: watch::Sender<u64>,
    /// A snapshot waits for an image check: wakes the image worker.
    pub unchecked_images: UncheckedImages,
    /// Registry checks under way (see [`CheckUnderWay`]): the recompute task waits a
    /// moment for them.
    pub checks: watch::Sender<usize>,
    /// Bumped when a cluster starts waiting for image checks (`images::awaited_checks`):
    /// the recompute task sets its timer for it.
    pub waits: watch::Sender<u64>,
    /// An image record or a PreflightValidation changed: wakes the preflight writer.
    pub preflight_changed: Notify,
    /// Bumped when a module's clusters by state, counted anew, changed: readers showing
    /// them follow it (it lags the touch by the controller's reconciliation).
    pub counted: watch::Sender<u64>,
    /// Bumped when a module's recent Events changed.
    pub events: watch::Sender<u64>,
    /// Bumped when a cluster is sent a snapshot, or resumes the one its proxy holds: what
    /// each node is sent (the UI shows its versions) changed after the touch that led to
    /// it.
    pub sent: watch::Sender<u64>,
}

impl Default for Signals {
    fn default() -> Self {
        Self {
            synced: watch::Sender::new(false),
            touched: Touched::default(),
            stale: StaleClusters::default(),
            needs: watch::Sender::new(0),
            unchecked_images: UncheckedImages::default(),
            checks: watch::Sender::new(0),
            waits: watch::Sender::new(0),
            preflight_changed: Notify::new(),
            counted: watch::Sender::new(0),
            events: watch::Sender::new(0),
            sent: watch::Sender::new(0),
        }
    }
}

impl Signals {
    pub fn bump_needs(&self) {
        self.needs.send_modify(|n| *n = n.wrapping_add(1));
    }

    pub fn is_synced(&self) -> bool {
        *self.synced.borrow()
    }

    pub fn bump_counted(&self) {
        self.counted.send_modify(|n| *n = n.wrapping_add(1));
    }

    pub fn bump_events(&self) {
        self.events.send_modify(|n| *n = n.wrapping_add(1));
    }

    pub fn bump_waits(&self) {
        self.waits.send_modify(|n| *n = n.wrapping_add(1));
    }

    pub fn bump_sent(&self) {
        self.sent.send_modify(|n| *n = n.wrapping_add(1));
    }
}

/// Everything a reader of the view follows to know that what it shows may be stale: a
/// module touched (statuses, images, selection) or counted anew, a session opened or
/// closed, the fleet's kernels changed, a module's recent Events changed, a cluster sent
/// a snapshot. Each wait returns once any of them changed since the last.
#[derive(Debug)]
pub struct Changes {
    pub(super) touched: watch::Receiver<u64>,
    pub(super) counted: watch::Receiver<u64>,
    pub(super) connections: watch::Receiver<super::Connections>,
    pub(super) needs: watch::Receiver<u64>,
    pub(super) events: watch::Receiver<u64>,
    pub(super) sent: watch::Receiver<u64>,
}

impl Changes {
    /// Waits for the next change; `false` once the view is gone (no change can come).
    pub async fn changed(&mut self) -> bool {
        let changed = tokio::select! {
            changed = self.touched.changed() => changed,
            changed = self.counted.changed() => changed,
            changed = self.connections.changed() => changed,
            changed = self.needs.changed() => changed,
            changed = self.events.changed() => changed,
            changed = self.sent.changed() => changed,
        };
        // What changed at once with it is taken too: one wake-up for a burst.
        self.mark_seen();
        changed.is_ok()
    }

    /// Takes every change so far as seen: the next wait is for a later one.
    pub fn mark_seen(&mut self) {
        self.touched.mark_unchanged();
        self.counted.mark_unchanged();
        self.connections.mark_unchanged();
        self.needs.mark_unchanged();
        self.events.mark_unchanged();
        self.sent.mark_unchanged();
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use super::*;

    #[tokio::test]
    async fn a_waiting_taker_is_woken_and_gets_every_module_touched() {
        let touched = Arc::new(Touched::default());
        let taker = tokio::spawn({
            let touched = touched.clone();
            async move { touched.take().await }
        });
        // On the test's single thread the taker runs up to its wait, finding nothing.
        tokio::task::yield_now().await;
        assert!(!taker.is_finished());
        touched.add(["b".to_owned(), "a".to_owned()]);
        touched.add(["a".to_owned()]);
        let taken = tokio::time::timeout(Duration::from_secs(5), taker)
            .await
            .expect("the taker wakes")
            .unwrap();
        assert_eq!(taken, BTreeSet::from(["a".to_owned(), "b".to_owned()]));
    }

    #[tokio::test]
    async fn images_already_in_flight_wake_nobody_and_a_new_one_does() {
        let unchecked = Arc::new(UncheckedImages::default());
        let key = |image: &str| ImageKey {
            module: "m".into(),
            image: image.into(),
        };
        let waiter = tokio::spawn({
            let unchecked = unchecked.clone();
            async move { unchecked.uncovered(|k| k.image == "in-flight").await }
        });
        tokio::task::yield_now().await;
        // Every cluster reports the image whose check runs: the worker sleeps on.
        for _ in 0..3 {
            unchecked.report([key("in-flight")]);
            tokio::task::yield_now().await;
            assert!(!waiter.is_finished());
        }
        unchecked.report([key("in-flight"), key("new")]);
        tokio::time::timeout(Duration::from_secs(5), waiter)
            .await
            .expect("an image nobody checks wakes the worker")
            .unwrap();
    }
}
