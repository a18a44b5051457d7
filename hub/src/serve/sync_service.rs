//! The `Hub.Sync` gRPC service: one stream per managed cluster, identified by the client
//! certificate's subject (never by a message field), the newest stream of a cluster
//! replacing any older one.

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::{Stream, StreamExt};
use kmm_proto::v1::{HubMessage, ProxyMessage, hub_message, hub_server::Hub, proxy_message};
use kmm_runtime::rate_limit::TokenBucket;
use kmm_runtime::timestamp::TimestampGauge;
use time::OffsetDateTime;
use tokio::sync::watch;
use tonic::{Code, Request, Response, Status, Streaming};
use x509_parser::prelude::{FromDer, X509Certificate};

use crate::fleet::cluster_identity::ClusterIdentity;
use crate::fleet::proxy_hello;
use crate::fleet::shared_snapshot::SharedSnapshot;

use super::fleet_view::ClusterStreams;
use super::metrics::Metrics;
use super::outbound::{Outbound, OutboundSender};

/// How long a new stream may take to say hello.
const HELLO_TIMEOUT: Duration = Duration::from_secs(30);

/// Stream opens one cluster may make at once, and then per minute: a proxy reconnecting
/// in a tight loop is refused rather than recomputing its snapshot over and over.
const OPEN_BURST: u32 = 10;
const OPENS_PER_MINUTE: u32 = 12;

/// The service, sharing the fleet view with the controller.
#[derive(Debug, Clone)]
pub struct SyncService {
    pub state: Arc<dyn ClusterStreams>,
    pub metrics: Metrics,
    /// The add-on whose agents' certificates name a cluster.
    pub addon_name: String,
    /// Per accepted cluster, its stream opens.
    pub opens: Arc<Mutex<HashMap<String, TokenBucket>>>,
}

type Outgoing = Pin<Box<dyn Stream<Item = Result<HubMessage, Status>> + Send>>;

#[tonic::async_trait]
impl Hub for SyncService {
    type SyncStream = Outgoing;

    async fn sync(
        &self,
        request: Request<Streaming<ProxyMessage>>,
    ) -> Result<Response<Self::SyncStream>, Status> {
        let (identity, expires) =
            peer_identity(&request, &self.addon_name).inspect_err(|status| {
                self.metrics.streams_refused.inc();
                tracing::warn!(error = status.message(), "refused a proxy stream");
            })?;
        let outbound = OutboundSender::default();
        let receiver = outbound.subscribe();
        tokio::spawn(serve_stream(
            self.state.clone(),
            self.metrics.clone(),
            self.opens.clone(),
            identity,
            expires,
            request.into_inner(),
            outbound,
        ));
        Ok(Response::new(outgoing(
            receiver,
            self.metrics.intents_sent.clone(),
        )))
    }
}

/// The cluster named by the verified client certificate's common name, and when that
/// certificate expires.
fn peer_identity<T>(
    request: &Request<T>,
    addon_name: &str,
) -> Result<(ClusterIdentity, OffsetDateTime), Status> {
    let certs = request
        .peer_certs()
        .ok_or_else(|| Status::unauthenticated("a client certificate is required"))?;
    let leaf = certs
        .first()
        .ok_or_else(|| Status::unauthenticated("a client certificate is required"))?;
    let (_, cert) = X509Certificate::from_der(leaf.as_ref())
        .map_err(|e| Status::unauthenticated(format!("unreadable client certificate: {e}")))?;
    let common_name = cert
        .subject()
        .iter_common_name()
        .next()
        .and_then(|cn| cn.as_str().ok())
        .ok_or_else(|| Status::unauthenticated("the client certificate has no common name"))?;
    let identity = ClusterIdentity::from_common_name(common_name, addon_name)
        .map_err(|e| Status::permission_denied(e.to_string()))?;
    Ok((identity, cert.validity().not_after.to_datetime()))
}

/// Reads one stream: hello first, then inventories and status reports, until the proxy
/// ends it or a newer stream of the same cluster replaces it.
#[tracing::instrument(name = "stream", skip_all, fields(cluster = %identity.cluster))]
async fn serve_stream(
    state: Arc<dyn ClusterStreams>,
    metrics: Metrics,
    opens: Arc<Mutex<HashMap<String, TokenBucket>>>,
    identity: ClusterIdentity,
    expires: OffsetDateTime,
    mut inbound: Streaming<ProxyMessage>,
    outbound: OutboundSender,
) {
    let cluster = identity.cluster.as_str();
    let refuse = |code, message: String| {
        metrics.streams_refused.inc();
        tracing::warn!(%message, "refused a proxy stream");
        outbound.end(code, message);
    };
    // A hub that is stopping opens no more streams; returning ends both halves.
    let mut ending = state.ending();
    let first = tokio::select! {
        first = tokio::time::timeout(HELLO_TIMEOUT, inbound.message()) => first,
        _ = ending.wait_for(Option::is_some) => return,
    };
    let hello = match first {
        Ok(Ok(Some(ProxyMessage {
            message: Some(proxy_message::Message::Hello(hello)),
        }))) => hello,
        Ok(Ok(Some(_))) => {
            return refuse(
                Code::InvalidArgument,
                "the first message of a stream must be ProxyHello".into(),
            );
        }
        Ok(Ok(None)) => return,
        Ok(Err(status)) => {
            tracing::debug!(%status, "stream ended before hello");
            return;
        }
        Err(_) => {
            return refuse(
                Code::DeadlineExceeded,
                format!("no ProxyHello within {}s", HELLO_TIMEOUT.as_secs()),
            );
        }
    };
    let held = match proxy_hello::check(&hello) {
        Ok(held) => held,
        Err(why) => return refuse(Code::InvalidArgument, why),
    };
    let mut synced = state.synced();
    tokio::select! {
        synced = synced.wait_for(|synced| *synced) => if synced.is_err() {
            return;
        },
        _ = ending.wait_for(Option::is_some) => return,
    }
    let Some(accepted) = state.accepts_cluster(cluster) else {
        return;
    };
    if !accepted {
        return refuse(
            Code::PermissionDenied,
            format!("cluster {cluster} is not a ManagedCluster this hub accepts"),
        );
    }
    let may_open = {
        let mut opens = opens
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let now = std::time::Instant::now();
        opens
            .entry(cluster.to_owned())
            .or_insert_with(|| TokenBucket::per_minute(OPEN_BURST, OPENS_PER_MINUTE, now))
            .try_take(now)
    };
    if !may_open {
        return refuse(
            Code::ResourceExhausted,
            format!("cluster {cluster} reconnects too often; retry in a few seconds"),
        );
    }
    let mut ended = outbound.subscribe();
    let failure = outbound.clone();
    // The handshake checked the certificate once; a stream outliving it ends with it, and
    // the proxy reconnects with its renewed one.
    let until_expiry = Duration::try_from(expires - OffsetDateTime::now_utc()).unwrap_or_default();
    let expiry = tokio::time::sleep(until_expiry);
    tokio::pin!(expiry);
    let id = state.open_session(cluster, held, outbound);
    tracing::info!(
        agent = identity.agent,
        proxy_version = hello.proxy_version,
        applied_revision = hello.applied_intent_revision,
        "proxy connected"
    );
    loop {
        let message = tokio::select! {
            message = inbound.message() => message,
            _ = ended.wait_for(|o| matches!(o, Outbound::End(..))) => break,
            () = &mut expiry => {
                failure.end(
                    Code::Unauthenticated,
                    format!("the client certificate expired at {expires}; reconnect with a renewed one"),
                );
                break;
            }
        };
        match message {
            Ok(Some(ProxyMessage {
                message: Some(message),
            })) => match message {
                proxy_message::Message::Hello(_) => {
                    tracing::warn!("ignored a second ProxyHello on the same stream");
                }
                proxy_message::Message::Inventory(inventory) => {
                    tracing::debug!(
                        revision = inventory.revision,
                        kernels = inventory.kernels.len(),
                        "inventory"
                    );
                    state.inventory(cluster, id, inventory);
                }
                proxy_message::Message::Status(report) => {
                    tracing::debug!(
                        full = report.full,
                        statuses = report.statuses.len(),
                        removed = report.removed.len(),
                        "node status"
                    );
                    state.status(cluster, id, report);
                }
                proxy_message::Message::DevicePlugins(report) => {
                    tracing::debug!(plugins = report.plugins.len(), "device plugins");
                    state.device_plugins(cluster, id, report);
                }
                proxy_message::Message::SpokeImages(report) => {
                    tracing::debug!(images = report.images.len(), "spoke images");
                    state.spoke_images(cluster, id, report);
                }
            },
            Ok(Some(ProxyMessage { message: None })) => {}
            Ok(None) => break,
            Err(status) => {
                tracing::info!(%status, "proxy stream failed");
                // Tell the proxy why (an oversized message, say), not just end.
                failure.end(
                    status.code(),
                    format!("the stream from the proxy failed: {}", status.message()),
                );
                break;
            }
        }
    }
    state.close_session(cluster, id);
    tracing::info!("proxy stream ended");
}

/// The outbound half: the latest snapshot whenever it changes, then the end. `sent_at`
/// marks when intents were last handed to the stream.
fn outgoing(receiver: watch::Receiver<Outbound>, sent_at: TimestampGauge) -> Outgoing {
    futures::stream::unfold(
        Some((receiver, None::<Arc<SharedSnapshot>>, sent_at)),
        |state| async move {
            let (mut receiver, mut sent, sent_at) = state?;
            loop {
                receiver.changed().await.ok()?;
                let next = receiver.borrow_and_update().clone();
                match next {
                    Outbound::Idle => {}
                    Outbound::Held(snapshot) => sent = Some(snapshot),
                    Outbound::Snapshot(snapshot) => {
                        // The stream's first snapshot is complete, later ones only what
                        // changed since the one before.
                        let intents = match &sent {
                            None => snapshot.to_wire(),
                            Some(previous) => snapshot.delta_from(previous),
                        };
                        sent = Some(snapshot);
                        let message = HubMessage {
                            message: Some(hub_message::Message::Intents(intents)),
                        };
                        // Computed and in the wire's types: tonic encodes and writes it
                        // as soon as it takes it.
                        sent_at.set_now();
                        return Some((Ok(message), Some((receiver, sent, sent_at))));
                    }
                    Outbound::End(code, message) => {
                        return Some((Err(Status::new(code, message)), None));
                    }
                }
            }
        },
    )
    .boxed()
}

#[cfg(test)]
mod tests {
    use std::time::SystemTime;

    use kmm_runtime::timestamp::unix_seconds;

    use super::*;

    #[tokio::test]
    async fn handing_intents_to_the_stream_marks_when() {
        let outbound = OutboundSender::default();
        let sent_at = TimestampGauge::default();
        let mut stream = outgoing(outbound.subscribe(), sent_at.clone());
        outbound.snapshot(Arc::new(SharedSnapshot {
            revision: 3,
            ..SharedSnapshot::default()
        }));
        assert_eq!(sent_at.get(), 0.0, "nothing was handed to the stream yet");

        let before = unix_seconds(SystemTime::now());
        let message = stream.next().await.expect("a message").expect("intents");
        let after = unix_seconds(SystemTime::now());
        assert!(
            matches!(message.message, Some(hub_message::Message::Intents(ref i)) if i.revision == 3),
            "{message:?}"
        );
        assert!(
            (before..=after).contains(&sent_at.get()),
            "{before} <= {} <= {after}",
            sent_at.get()
        );

        let marked = sent_at.get();
        outbound.end(Code::Unavailable, "the hub is shutting down");
        assert!(stream.next().await.expect("the end").is_err());
        assert_eq!(sent_at.get(), marked, "an end is no intents");
    }

    #[tokio::test]
    async fn after_what_the_proxy_holds_the_stream_sends_only_what_changed() {
        use kmm_proto::v1::{ModuleIntent, ModuleKey};
        let intent = |name: &str| {
            Arc::new(ModuleIntent {
                key: Some(ModuleKey {
                    namespace: "drivers".into(),
                    name: name.into(),
                }),
                ..ModuleIntent::default()
            })
        };
        let outbound = OutboundSender::default();
        let mut stream = outgoing(outbound.subscribe(), TimestampGauge::default());
        let held = SharedSnapshot {
            revision: 7,
            modules: vec![intent("a"), intent("b")],
            ..SharedSnapshot::default()
        };
        outbound.held(Arc::new(held.clone()));
        assert!(
            futures::poll!(stream.next()).is_pending(),
            "nothing is sent for what the proxy holds"
        );
        let mut next = held;
        next.revision = 8;
        next.modules.push(intent("c"));
        outbound.snapshot(Arc::new(next));
        let message = stream.next().await.expect("a message").expect("intents");
        let Some(hub_message::Message::Intents(intents)) = message.message else {
            panic!("{message:?}");
        };
        assert!(intents.delta, "a delta from what the proxy holds");
        assert_eq!(intents.revision, 8);
        assert_eq!(intents.modules.len(), 1, "only c: {intents:?}");
    }
}
