//! How the fleet view wakes the tasks that follow it: the controller (touched modules),
//! the image worker (needs changed, an image unchecked), the preflight writer, and
//! everything waiting for the watches to list.

use std::collections::BTreeSet;
use std::sync::Mutex;

use tokio::sync::{Notify, watch};

use super::lock;

/// Modules whose status an event may have changed, waiting for their reconciliation.
#[derive(Debug, Default)]
pub struct Touched {
    modules: Mutex<BTreeSet<String>>,
    notify: Notify,
}

impl Touched {
    pub fn add(&self, modules: impl IntoIterator<Item = String>) {
        let mut touched = lock(&self.modules);
        let before = touched.len();
        touched.extend(modules);
        if touched.len() != before {
            self.notify.notify_one();
        }
    }

    /// Waits for touched modules and takes them all.
    pub async fn take(&self) -> BTreeSet<String> {
        loop {
            let taken = std::mem::take(&mut *lock(&self.modules));
            if !taken.is_empty() {
                return taken;
            }
            self.notify.notified().await;
        }
    }
}

/// The fleet view's wake-ups.
#[derive(Debug)]
pub struct Signals {
    /// True once every watch has listed.
    pub synced: watch::Sender<bool>,
    pub touched: Touched,
    /// Bumped when what the fleet's images are needed for may have changed (kernels,
    /// modules, selection): wakes the image worker.
    pub needs: watch::Sender<u64>,
    /// A snapshot waits for an image check: wakes the image worker.
    pub unchecked_images: Notify,
    /// An image record or a PreflightValidation changed: wakes the preflight writer.
    pub preflight_changed: Notify,
}

impl Default for Signals {
    fn default() -> Self {
        Self {
            synced: watch::Sender::new(false),
            touched: Touched::default(),
            needs: watch::Sender::new(0),
            unchecked_images: Notify::new(),
            preflight_changed: Notify::new(),
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
}
