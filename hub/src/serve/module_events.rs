//! Follows the Events about ManagedClusterModules (cluster-scoped, so recorded in
//! `default`) into the fleet view's recent Events, for the module page: whoever recorded
//! them (this hub, an earlier leader, another controller), as `kubectl describe` shows
//! them. Leader only, like the rest of the view.

use std::sync::Arc;

use futures::TryStreamExt;
use k8s_openapi::api::core::v1::Event;
use k8s_openapi::jiff::Timestamp;
use kube::Api;
use kube::runtime::{WatchStreamExt, watcher};

use super::fleet_view::FleetView;
use crate::fleet::module_events::RecentEvent;

/// Where the API records Events of cluster-scoped objects.
pub const NAMESPACE: &str = "default";

/// Only Events about ManagedClusterModules are listed and watched.
pub const FIELD_SELECTOR: &str = "involvedObject.kind=ManagedClusterModule";

/// Keeps the view's recent Events current until dropped.
#[tracing::instrument(name = "module_events", skip_all)]
pub async fn follow(api: Api<Event>, state: Arc<FleetView>) {
    let config = watcher::Config::default().fields(FIELD_SELECTOR);
    let events = watcher(api, config).default_backoff();
    let mut events = std::pin::pin!(events);
    loop {
        match events.try_next().await {
            // A (re-)list: what follows replaces what was kept.
            Ok(Some(watcher::Event::Init)) => state.clear_events(),
            Ok(Some(watcher::Event::InitApply(event) | watcher::Event::Apply(event))) => {
                if let Some((module, recent)) = recent_event(&event) {
                    state.note_event(&module, recent);
                }
            }
            Ok(Some(watcher::Event::Delete(event))) => {
                if let Some((module, recent)) = recent_event(&event) {
                    state.forget_event(&module, &recent.uid);
                }
            }
            Ok(Some(watcher::Event::InitDone)) => {}
            Ok(None) => return,
            Err(error) => tracing::warn!(%error, "watch of Events failed; retrying"),
        }
    }
}

/// The module an Event is about, and the Event as the page shows it; `None` for one about
/// another kind or without a name or uid. Events recorded through `events.k8s.io/v1`
/// read here with their series' count and last observation.
pub fn recent_event(event: &Event) -> Option<(String, RecentEvent)> {
    let about = &event.involved_object;
    if about.kind.as_deref() != Some("ManagedClusterModule") {
        return None;
    }
    let module = about.name.clone().filter(|n| !n.is_empty())?;
    let uid = event.metadata.uid.clone().filter(|u| !u.is_empty())?;
    let series = event.series.as_ref();
    let last = series
        .and_then(|s| s.last_observed_time.as_ref())
        .map(|t| t.0)
        .or(event.event_time.as_ref().map(|t| t.0))
        .or(event.last_timestamp.as_ref().map(|t| t.0))
        .or(event.metadata.creation_timestamp.as_ref().map(|t| t.0))
        .unwrap_or(Timestamp::UNIX_EPOCH);
    let count = series
        .and_then(|s| s.count)
        .or(event.count)
        .unwrap_or(1)
        .max(1);
    let reporter = event
        .reporting_component
        .clone()
        .filter(|c| !c.is_empty())
        .or_else(|| event.source.as_ref().and_then(|s| s.component.clone()))
        .unwrap_or_default();
    Some((
        module,
        RecentEvent {
            uid,
            type_: event.type_.clone().unwrap_or_else(|| "Normal".into()),
            reason: event.reason.clone().unwrap_or_default(),
            note: event.message.clone().unwrap_or_default(),
            count,
            last,
            reporter,
        },
    ))
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn event(value: serde_json::Value) -> Event {
        serde_json::from_value(value).expect("an Event")
    }

    #[test]
    fn an_event_recorded_as_a_series_reads_with_its_count_and_last_observation() {
        let series = event(json!({
            "metadata": {"name": "hello.1", "namespace": "default", "uid": "u1",
                         "creationTimestamp": "2026-11-27T10:00:00Z"},
            "involvedObject": {"kind": "ManagedClusterModule", "name": "hello",
                               "apiVersion": "hub.kmm.sigs.x-k8s.io/v1beta1"},
            "reason": "ImageExists", "message": "found at sha256:01", "type": "Normal",
            "eventTime": "2026-11-27T10:00:00.000000Z",
            "series": {"count": 3, "lastObservedTime": "2026-11-27T10:05:00.000000Z"},
            "reportingComponent": "kmm-hub", "reportingInstance": "kmm-hub-0",
            "action": "Check"
        }));
        let (module, recent) = recent_event(&series).unwrap();
        assert_eq!(module, "hello");
        assert_eq!(
            (recent.uid.as_str(), recent.reason.as_str(), recent.count),
            ("u1", "ImageExists", 3)
        );
        assert_eq!(recent.last.to_string(), "2026-11-27T10:05:00Z");
        assert_eq!(recent.reporter, "kmm-hub");
        assert_eq!(recent.note, "found at sha256:01");
    }

    #[test]
    fn a_core_event_reads_with_its_count_and_last_timestamp() {
        let core = event(json!({
            "metadata": {"name": "hello.2", "namespace": "default", "uid": "u2"},
            "involvedObject": {"kind": "ManagedClusterModule", "name": "hello"},
            "reason": "BuildFailed", "message": "boom", "type": "Warning",
            "count": 2, "lastTimestamp": "2026-11-27T11:00:00Z",
            "source": {"component": "someone-else"}
        }));
        let (_, recent) = recent_event(&core).unwrap();
        assert_eq!((recent.type_.as_str(), recent.count), ("Warning", 2));
        assert_eq!(recent.last.to_string(), "2026-11-27T11:00:00Z");
        assert_eq!(recent.reporter, "someone-else");
    }

    #[test]
    fn events_about_other_kinds_or_without_a_name_or_uid_are_not_kept() {
        let of = |kind: &str, name: &str, uid: &str| {
            event(json!({
                "metadata": {"name": "x", "namespace": "default", "uid": uid},
                "involvedObject": {"kind": kind, "name": name}
            }))
        };
        assert!(recent_event(&of("Node", "hello", "u")).is_none());
        assert!(recent_event(&of("ManagedClusterModule", "", "u")).is_none());
        assert!(recent_event(&of("ManagedClusterModule", "hello", "")).is_none());
        assert!(recent_event(&of("ManagedClusterModule", "hello", "u")).is_some());
    }
}
