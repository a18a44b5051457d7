//! The image worker's tasks in flight: at most one per image. A task that panics (a bug,
//! or a malformed image tripping a library) lets its image go with the panic's message,
//! so that the worker records a failure and retries after a backoff, instead of keeping
//! the image in flight for good or taking the hub down.

use std::collections::{BTreeSet, HashMap};
use std::future::Future;

use tokio::task::{Id, JoinSet};

use crate::images::{ImageKey, ImageNeed};

/// A task that ended, and how.
#[derive(Debug)]
pub struct Finished {
    pub key: ImageKey,
    pub need: ImageNeed,
    /// What it panicked with, if it did.
    pub panic: Option<String>,
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
}
