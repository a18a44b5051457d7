//! The hub's live view of the fleet, fed by watches (ManagedClusterModules,
//! ManagedClusters, PlacementDecisions, pull Secrets, revisions, preflights) and by the
//! proxies' streams (inventory, node status, device plugins).
//!
//! Its parts have one owner each: the watch-fed [`index`], the clusters' [`sessions`],
//! the [`image_book`] the image worker keeps, the [`caches`] of what is computed once,
//! and the [`signals`] that wake the tasks following the view; the gRPC service reaches
//! it only through [`ClusterStreams`]. This module connects them: an event lands in one
//! part and recomputes only what it can change (a ManagedCluster's own snapshot, a
//! module's clusters', none for a status report unless an unload was confirmed); what
//! each snapshot and status holds is computed by the pure functions of `crate::fleet`.

pub mod caches;
mod cluster_streams;
pub mod image_book;
pub mod index;
mod on_stream;
mod on_watch;
mod readouts;
mod reads;
mod selections;
pub mod signals;
mod snapshots;

pub use kmm_hub_core::sessions;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Mutex;

use tokio::sync::{Notify, watch};

pub use self::cluster_streams::ClusterStreams;
pub use self::index::Stores;
pub use self::readouts::ClusterReadout;
pub use self::sessions::{Connections, SessionId};
pub use self::signals::Changes;

use self::caches::Caches;
use self::image_book::ImageBook;
use self::index::FleetIndex;
use self::sessions::{Sessions, lock};
use self::signals::{Signals, Touched};
use super::metrics::Metrics;
use crate::fleet::mirrors::ImageMirror;
use crate::fleet::module_events::{RecentEvent, RecentEvents};
use crate::images::ImageKey;

/// The shared fleet view.
#[derive(Debug)]
pub struct FleetView {
    index: FleetIndex,
    sessions: Sessions,
    images: ImageBook,
    caches: Caches,
    signals: Signals,
    /// Fed by its own watch, read by the fleet view's module page only.
    recent_events: Mutex<RecentEvents>,
    /// Each cluster's image mirrors (its AddOnDeploymentConfig's `registries`), as the
    /// add-on controller last read them; none for a cluster not listed.
    mirrors: Mutex<BTreeMap<String, Vec<ImageMirror>>>,
    metrics: Metrics,
}

impl FleetView {
    pub fn new(stores: Stores, metrics: Metrics) -> Self {
        Self {
            index: FleetIndex::new(stores),
            sessions: Sessions::default(),
            images: ImageBook::default(),
            caches: Caches::default(),
            signals: Signals::default(),
            recent_events: Mutex::default(),
            mirrors: Mutex::default(),
            metrics,
        }
    }

    /// Takes every cluster's image mirrors; the clusters whose mirrors changed get a
    /// new snapshot.
    pub fn set_mirrors(&self, mirrors: BTreeMap<String, Vec<ImageMirror>>) {
        let changed: BTreeSet<String> = {
            let mut known = lock(&self.mirrors);
            let changed = known
                .keys()
                .chain(mirrors.keys())
                .filter(|cluster| known.get(*cluster) != mirrors.get(*cluster))
                .cloned()
                .collect();
            *known = mirrors;
            changed
        };
        for cluster in changed {
            if let Some(session) = self.sessions.get(&cluster) {
                self.recompute(&cluster, &mut lock(&session));
            }
        }
    }

    /// The cluster's image mirrors.
    fn mirrors_of(&self, cluster: &str) -> Vec<ImageMirror> {
        lock(&self.mirrors)
            .get(cluster)
            .cloned()
            .unwrap_or_default()
    }

    /// Keeps an Event of `module` among its recent ones.
    pub fn note_event(&self, module: &str, event: RecentEvent) {
        if lock(&self.recent_events).note(module, event) {
            self.signals.bump_events();
        }
    }

    /// Forgets an Event of `module` that expired or was deleted.
    pub fn forget_event(&self, module: &str, uid: &str) {
        if lock(&self.recent_events).forget(module, uid) {
            self.signals.bump_events();
        }
    }

    /// Forgets every Event: the watch lists them anew.
    pub fn clear_events(&self) {
        lock(&self.recent_events).clear();
        self.signals.bump_events();
    }

    /// The module's recent Events, newest first.
    pub fn recent_events(&self, module: &str) -> Vec<RecentEvent> {
        lock(&self.recent_events).of(module).to_vec()
    }

    /// Follows the clusters' sessions as they open and close.
    pub fn connections(&self) -> watch::Receiver<Connections> {
        self.sessions.connections()
    }

    /// Resolves when a snapshot waits for an image that was never checked and that is
    /// neither `in_flight` nor recorded meanwhile.
    pub async fn images_unchecked(&self, in_flight: impl Fn(&ImageKey) -> bool) {
        self.signals
            .unchecked_images
            .uncovered(|key| in_flight(key) || self.image(key).is_some())
            .await;
    }

    /// Changes whenever the images the fleet needs may have changed.
    pub fn needs_changed(&self) -> watch::Receiver<u64> {
        self.signals.needs.subscribe()
    }

    /// Follows what may change what the view shows (see [`Changes`]).
    pub fn changes(&self) -> Changes {
        Changes {
            touched: self.signals.touched.versions(),
            counted: self.signals.counted.subscribe(),
            connections: self.sessions.connections(),
            needs: self.signals.needs.subscribe(),
            events: self.signals.events.subscribe(),
            sent: self.signals.sent.subscribe(),
        }
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
mod tests;
