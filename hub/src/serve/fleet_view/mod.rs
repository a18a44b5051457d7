//! The hub's live view of the fleet, fed by watches (ManagedClusterModules,
//! ManagedClusters, PlacementDecisions, pull Secrets, revisions, preflights) and by the
//! proxies' streams (inventory, node status, device plugins).
//!
//! Its parts have one owner each: the watch-fed [`index`], the clusters' [`sessions`],
//! the [`image_book`] the image worker keeps, the [`caches`] of what is computed once,
//! and the [`signals`] that wake the tasks following the view. This module connects
//! them: an event lands in one part and recomputes only what it can change (a
//! ManagedCluster's own snapshot, a module's clusters', none for a status report unless
//! an unload was confirmed); what each snapshot and status holds is computed by the pure
//! functions of `crate::fleet`.

pub mod caches;
pub mod image_book;
pub mod index;
mod on_stream;
mod on_watch;
mod reads;
pub mod sessions;
pub mod signals;
mod snapshots;

use std::sync::{Mutex, MutexGuard};

use tokio::sync::{Notify, watch};

pub use self::index::Stores;
pub use self::sessions::{Connections, SessionId};

use self::caches::Caches;
use self::image_book::ImageBook;
use self::index::FleetIndex;
use self::sessions::Sessions;
use self::signals::{Signals, Touched};
use super::metrics::Metrics;

/// The shared fleet view.
#[derive(Debug)]
pub struct FleetView {
    index: FleetIndex,
    sessions: Sessions,
    images: ImageBook,
    caches: Caches,
    signals: Signals,
    metrics: Metrics,
}

/// Takes a lock. A panic while holding it leaves plain data behind, still consistent
/// enough to serve: every recompute starts from the watched objects again.
fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl FleetView {
    pub fn new(stores: Stores, metrics: Metrics) -> Self {
        Self {
            index: FleetIndex::new(stores),
            sessions: Sessions::default(),
            images: ImageBook::default(),
            caches: Caches::default(),
            signals: Signals::default(),
            metrics,
        }
    }

    /// Follows the clusters' sessions as they open and close.
    pub fn connections(&self) -> watch::Receiver<Connections> {
        self.sessions.connections()
    }

    /// Resolves when a snapshot waits for images that were never checked.
    pub async fn images_unchecked(&self) {
        self.signals.unchecked_images.notified().await;
    }

    /// Changes whenever the images the fleet needs may have changed.
    pub fn needs_changed(&self) -> watch::Receiver<u64> {
        self.signals.needs.subscribe()
    }

    /// The modules whose status may have changed, for the controller.
    pub fn touched(&self) -> &Touched {
        &self.signals.touched
    }

    /// Wakes when an image record or a PreflightValidation changed.
    pub fn preflight_events(&self) -> &Notify {
        &self.signals.preflight_changed
    }

    pub fn is_synced(&self) -> bool {
        self.signals.is_synced()
    }

    /// Every watch has listed once: snapshots may now go out.
    pub fn set_synced(&self) {
        self.signals.synced.send_replace(true);
        self.recompute_all();
    }
}

fn gauge(n: usize) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

#[cfg(test)]
mod tests {
    use kube::core::DynamicObject;
    use kube::runtime::reflector::store::{Writer, store};

    use super::*;
    use crate::serve::outbound::{Outbound, OutboundSender};
    use crate::serve::sync_service::ClusterStreams;
    use kmm_api::ocm;

    fn view() -> FleetView {
        let stores = Stores {
            modules: store().0,
            clusters: Writer::<DynamicObject>::new(ocm::MANAGED_CLUSTER.api_resource()).as_reader(),
            secrets: store().0,
            revisions: store().0,
            preflights: store().0,
            decisions: Writer::<DynamicObject>::new(ocm::PLACEMENT_DECISION.api_resource())
                .as_reader(),
        };
        FleetView::new(stores, Metrics::default())
    }

    #[test]
    fn connections_follow_the_current_stream_of_each_cluster() {
        let view = view();
        let mut connections = view.connections();
        let first = view.open_session("spoke1", 0, OutboundSender::default());
        assert!(connections.has_changed().unwrap());
        assert!(connections.borrow_and_update().open.contains("spoke1"));
        let second = view.open_session("spoke1", 0, OutboundSender::default());
        // The replaced stream's end leaves the cluster connected.
        view.close_session("spoke1", first);
        assert!(!connections.has_changed().unwrap());
        view.close_session("spoke1", second);
        let now = connections.borrow_and_update().clone();
        assert!(now.open.is_empty());
        assert!(now.closed_at.contains_key("spoke1"));
        view.open_session("spoke1", 0, OutboundSender::default());
        let again = connections.borrow_and_update().clone();
        assert!(again.open.contains("spoke1"));
        assert!(again.closed_at.is_empty(), "open again: no longer closed");
    }

    #[test]
    fn streams_end_when_the_hub_stops_even_those_opened_after() {
        let view = view();
        let before = OutboundSender::default();
        let ended_before = before.subscribe();
        view.open_session("spoke1", 0, before);
        view.end_streams("the hub is shutting down");
        let after = OutboundSender::default();
        let ended_after = after.subscribe();
        view.open_session("spoke2", 0, after);
        let shutdown = Outbound::End(tonic::Code::Unavailable, "the hub is shutting down".into());
        assert_eq!(*ended_before.borrow(), shutdown);
        assert_eq!(*ended_after.borrow(), shutdown);
        assert_eq!(
            *ClusterStreams::ending(&view).borrow(),
            Some("the hub is shutting down".to_owned())
        );
    }
}
