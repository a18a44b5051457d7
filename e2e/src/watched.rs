//! A kind's objects as the apiserver has them, kept current by a watch, and waits on
//! them that return the moment a condition holds: the figures the benches print are
//! then the fleet's, not a polling interval's.

use std::collections::BTreeMap;
use std::time::Duration;

use kube::runtime::WatchStreamExt;
use kube::runtime::watcher::{self, Event};
use kube::{Api, Resource, ResourceExt};
use serde::de::DeserializeOwned;
use tokio::sync::watch;
use tokio::task::JoinHandle;

/// Why a wait on a [`Watched`] failed.
#[derive(Debug, thiserror::Error)]
pub enum WaitError {
    #[error("the watch behind the wait for {0} ended")]
    Ended(String),
    #[error("timed out after {seconds}s waiting for {what}; last observed: {observed}")]
    Timeout {
        what: String,
        seconds: u64,
        observed: String,
    },
}

/// The objects of one `Api` (and watcher config), by name; `None` until first listed,
/// so that no wait takes "nothing yet" for "none".
#[derive(Debug)]
pub struct Watched<K> {
    objects: watch::Receiver<Option<BTreeMap<String, K>>>,
    task: JoinHandle<()>,
}

impl<K> Watched<K>
where
    K: Resource + Clone + DeserializeOwned + std::fmt::Debug + Send + Sync + 'static,
{
    pub fn start(api: Api<K>, config: watcher::Config) -> Self {
        let (tx, objects) = watch::channel::<Option<BTreeMap<String, K>>>(None);
        let task = tokio::spawn(async move {
            let mut events = std::pin::pin!(watcher::watcher(api, config).default_backoff());
            let mut listing = BTreeMap::new();
            while let Some(event) = tokio_stream::StreamExt::next(&mut events).await {
                // A failed watch is retried with backoff; the waits' deadlines bound it.
                let Ok(event) = event else { continue };
                match event {
                    Event::Apply(o) => {
                        tx.send_modify(|all| {
                            all.get_or_insert_default().insert(o.name_any(), o);
                        });
                    }
                    Event::Delete(o) => {
                        tx.send_modify(|all| {
                            all.get_or_insert_default().remove(&o.name_any());
                        });
                    }
                    Event::Init => listing.clear(),
                    Event::InitApply(o) => {
                        listing.insert(o.name_any(), o);
                    }
                    Event::InitDone => {
                        tx.send_replace(Some(std::mem::take(&mut listing)));
                    }
                }
            }
        });
        Self { objects, task }
    }

    /// Waits until `check` holds on the objects, failing after `timeout` with what
    /// `check` last said.
    pub async fn wait_for(
        &mut self,
        what: &str,
        timeout: Duration,
        check: impl Fn(&BTreeMap<String, K>) -> Result<(), String>,
    ) -> Result<(), WaitError> {
        let mut last = String::from("nothing yet");
        let waited = tokio::time::timeout(
            timeout,
            self.objects
                .wait_for(|objects| match objects.as_ref().map(&check) {
                    Some(Ok(())) => true,
                    Some(Err(why)) => {
                        last = why;
                        false
                    }
                    None => false,
                }),
        )
        .await;
        match waited {
            Ok(Ok(_)) => Ok(()),
            Ok(Err(_)) => Err(WaitError::Ended(what.to_owned())),
            Err(_) => Err(WaitError::Timeout {
                what: what.to_owned(),
                seconds: timeout.as_secs(),
                observed: last,
            }),
        }
    }
}

impl<K> Drop for Watched<K> {
    fn drop(&mut self) {
        self.task.abort();
    }
}
