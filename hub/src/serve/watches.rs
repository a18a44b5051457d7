//! The watches that feed the fleet view: each keeps a reflector store current and hands
//! every change to the view; readiness waits for every store to list once.

use std::sync::Arc;
use std::time::Duration;

use futures::TryStreamExt;
use kmm_runtime::health::Health;
use kube::runtime::{WatchStreamExt, reflector, watcher};

use super::fleet_view::{FleetView, Stores};

/// Whether a watched object was created or changed, or deleted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Seen {
    Applied,
    Deleted,
}

/// A watch keeping `writer`'s store current.
pub fn reflected<K>(
    writer: reflector::store::Writer<K>,
    stream: impl futures::Stream<Item = Result<watcher::Event<K>, watcher::Error>> + Send,
) -> impl futures::Stream<Item = Result<watcher::Event<K>, watcher::Error>> + Send
where
    K: kube::Resource + Clone + std::fmt::Debug + Send + Sync + 'static,
    K::DynamicType: Clone + Eq + std::hash::Hash,
{
    reflector::reflector(writer, stream).default_backoff()
}

/// Hands every created, changed or deleted object of a reflected watch to `changed`;
/// after a (re-)list, when changes may have been missed, everything is recomputed.
pub async fn watch_into<K>(
    state: Arc<FleetView>,
    events: impl futures::Stream<Item = Result<watcher::Event<K>, watcher::Error>> + Send,
    what: &'static str,
    changed: impl Fn(&FleetView, &K, Seen),
) where
    K: kube::Resource + Clone + std::fmt::Debug + Send + Sync + 'static,
    K::DynamicType: Clone + Eq + std::hash::Hash,
{
    let mut events = std::pin::pin!(events);
    loop {
        match events.try_next().await {
            Ok(Some(watcher::Event::InitApply(_) | watcher::Event::Init)) => {}
            Ok(Some(watcher::Event::InitDone)) => state.recompute_all(),
            Ok(Some(watcher::Event::Apply(object))) => changed(&state, &object, Seen::Applied),
            Ok(Some(watcher::Event::Delete(object))) => changed(&state, &object, Seen::Deleted),
            Ok(None) => return,
            Err(error) => tracing::warn!(what, %error, "watch failed; retrying"),
        }
    }
}

pub async fn wait_synced(stores: Stores, state: Arc<FleetView>, health: Health) {
    let ready = async {
        ready(&stores.modules).await?;
        ready(&stores.clusters).await?;
        ready(&stores.secrets).await?;
        ready(&stores.revisions).await?;
        ready(&stores.decisions).await
    };
    if ready.await.is_ok() {
        tracing::info!("caches synced; intents may go out");
        state.set_synced();
        health.set_note(None);
        health.set_ready(true);
    }
}

/// Waits until a store has listed once. A store's readiness wakes only its latest waiter
/// (the controller also waits on the modules' store), so the wait is re-polled.
async fn ready<K>(store: &reflector::Store<K>) -> Result<(), reflector::store::WriterDropped>
where
    K: kube::Resource + Clone + 'static,
    K::DynamicType: Clone + Eq + std::hash::Hash,
{
    loop {
        if let Ok(result) =
            tokio::time::timeout(Duration::from_millis(200), store.wait_until_ready()).await
        {
            return result;
        }
    }
}
