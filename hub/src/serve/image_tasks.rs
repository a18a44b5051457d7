//! The image worker's tasks in flight: at most one per image. A task that panics (a bug,
//! or a malformed image tripping a library) lets its image go with the panic's message,
//! so that the worker records a failure and retries after a backoff, instead of keeping
//! the image in flight for good or taking the hub down. [`ImageTasks::wake`] is what the
//! worker waits on between its passes.

use std::collections::{BTreeSet, HashMap};
use std::future::Future;

use tokio::sync::watch;
use tokio::task::{Id, JoinSet};
use tokio::time::Instant;

use crate::images::{ImageKey, ImageNeed};

/// A task that ended, and how.
#[derive(Debug)]
pub struct Finished {
    pub key: ImageKey,
    pub need: ImageNeed,
    /// What it panicked with, if it did.
    pub panic: Option<String>,
}

/// What wakes the image worker next.
#[derive(Debug)]
pub enum Wake {
    /// A task ended: its place is free.
    Finished(Box<Finished>),
    /// The fleet is to be read again.
    Fleet,
    /// What the fleet needs is no longer followed: the hub is stopping.
    Stopped,
}

#[derive(Debug, Default)]
pub struct ImageTasks {
    set: JoinSet<()>,
    running: HashMap<Id, (ImageKey, ImageNeed)>,
    keys: BTreeSet<ImageKey>,
}

impl ImageTasks {
    pub fn contains(&self, key: &ImageKey) -> bool {
        self.keys.contains(key)
    }

    pub fn len(&self) -> usize {
        self.keys.len()
    }

    /// The images in flight.
    pub fn keys(&self) -> &BTreeSet<ImageKey> {
        &self.keys
    }

    /// Runs `work` for `key`, which must not be in flight already.
    pub fn spawn(
        &mut self,
        key: ImageKey,
        need: ImageNeed,
        work: impl Future<Output = ()> + Send + 'static,
    ) {
        let id = self.set.spawn(work).id();
        self.keys.insert(key.clone());
        self.running.insert(id, (key, need));
    }

    /// The next task to end; never resolves while none runs.
    pub async fn next(&mut self) -> Finished {
        loop {
            let Some(done) = self.set.join_next_with_id().await else {
                std::future::pending::<()>().await;
                continue;
            };
            let (id, panic) = match done {
                Ok((id, ())) => (id, None),
                Err(error) => {
                    let id = error.id();
                    let panic = error.is_panic().then(|| panic_message(error.into_panic()));
                    (id, panic)
                }
            };
            if let Some((key, need)) = self.running.remove(&id) {
                self.keys.remove(&key);
                return Finished { key, need, panic };
            }
        }
    }

    /// Waits for what wakes the worker: a task ending, at once whatever else is awaited
    /// (waiting for the next read of the fleet held every place idle for up to its
    /// spacing, seconds at thousands of clusters, so a kernel upgrade's checks went
    /// sixteen at a time, a second apart); a change of what the fleet needs, noted in
    /// `needs_pending` and read no earlier than `next_read`; or `other`.
    pub async fn wake(
        &mut self,
        needs_changed: &mut watch::Receiver<u64>,
        needs_pending: &mut bool,
        next_read: Instant,
        other: impl Future<Output = ()>,
    ) -> Wake {
        tokio::pin!(other);
        loop {
            return tokio::select! {
                finished = self.next() => Wake::Finished(Box::new(finished)),
                changed = needs_changed.changed(), if !*needs_pending => {
                    if changed.is_err() {
                        return Wake::Stopped;
                    }
                    *needs_pending = true;
                    continue;
                }
                () = tokio::time::sleep_until(next_read), if *needs_pending => Wake::Fleet,
                () = &mut other => Wake::Fleet,
            };
        }
    }
}

fn panic_message(payload: Box<dyn std::any::Any + Send>) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic without a message".to_owned())
}

#[cfg(test)]
mod tests {
    use std::future::pending;
    use std::time::Duration;

    use super::*;

    fn need() -> ImageNeed {
        ImageNeed::for_kernels([])
    }

    fn key(image: &str) -> ImageKey {
        ImageKey {
            module: "m".into(),
            image: image.into(),
        }
    }

    #[tokio::test]
    async fn a_panicking_task_lets_its_image_go_with_the_message() {
        let mut tasks = ImageTasks::default();
        tasks.spawn(key("r/a:1"), need(), async {
            panic!("malformed layer");
        });
        assert!(tasks.contains(&key("r/a:1")));
        let finished = tasks.next().await;
        assert_eq!(finished.key, key("r/a:1"));
        assert_eq!(finished.panic.as_deref(), Some("malformed layer"));
        assert!(!tasks.contains(&key("r/a:1")));
        assert_eq!(tasks.len(), 0);

        tasks.spawn(key("r/b:1"), need(), async {});
        let finished = tasks.next().await;
        assert_eq!((finished.key, finished.panic), (key("r/b:1"), None));
    }

    #[tokio::test(start_paused = true)]
    async fn a_task_ending_wakes_the_worker_while_it_waits_to_read_the_fleet_again() {
        let mut tasks = ImageTasks::default();
        let (changes, mut needs_changed) = watch::channel(0);
        let mut needs_pending = false;
        let start = Instant::now();
        let next_read = start + Duration::from_secs(5);
        tasks.spawn(key("r/a:1"), need(), async {
            tokio::time::sleep(Duration::from_millis(10)).await;
        });
        changes.send_replace(1);
        let wake = tasks
            .wake(&mut needs_changed, &mut needs_pending, next_read, pending())
            .await;
        assert!(
            matches!(&wake, Wake::Finished(f) if f.key == key("r/a:1")),
            "{wake:?}"
        );
        assert_eq!(
            start.elapsed(),
            Duration::from_millis(10),
            "not at the read"
        );
        assert!(needs_pending, "the change is kept for the read");
        // Nothing runs now: the change is read at its time, and only then.
        let wake = tasks
            .wake(&mut needs_changed, &mut needs_pending, next_read, pending())
            .await;
        assert!(matches!(wake, Wake::Fleet), "{wake:?}");
        assert_eq!(start.elapsed(), Duration::from_secs(5));
    }

    #[tokio::test(start_paused = true)]
    async fn without_a_change_the_worker_waits_for_its_other_wakes_or_stops() {
        let mut tasks = ImageTasks::default();
        let (changes, mut needs_changed) = watch::channel(0);
        let mut needs_pending = false;
        let start = Instant::now();
        let far = start + Duration::from_secs(1);
        let other = tokio::time::sleep(Duration::from_secs(3));
        let wake = tasks
            .wake(&mut needs_changed, &mut needs_pending, far, other)
            .await;
        assert!(matches!(wake, Wake::Fleet), "{wake:?}");
        assert_eq!(
            start.elapsed(),
            Duration::from_secs(3),
            "no change, no read at 1 s"
        );
        drop(changes);
        let wake = tasks
            .wake(&mut needs_changed, &mut needs_pending, far, pending())
            .await;
        assert!(matches!(wake, Wake::Stopped), "{wake:?}");
    }
}
