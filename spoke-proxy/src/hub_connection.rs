//! The one long-lived stream to kmm-hub (`Hub.Sync`), over TLS with the client
//! certificate from OCM's add-on registration. Sends hello, the full inventory and the
//! full status after every (re)connect, then changes as they happen; applies the hub's
//! intent snapshots. Losing the hub changes nothing on the nodes: the last snapshot
//! stays in force, and the status is resent in full when the hub is back.
//!
//! The proxy is ready exactly while this stream is open: OCM's health check of a
//! template add-on is its workloads' readiness, so the add-on is Available only while
//! its cluster is connected to kmm-hub.

use std::time::{Duration, Instant};

use kmm_proto::limits::REPORT_PART;
use kmm_proto::report_parts;
use kmm_proto::v1::hub_client::HubClient;
use kmm_proto::v1::{HubMessage, ProxyHello, ProxyMessage, hub_message, proxy_message};
use thiserror::Error;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;
use tonic::transport::{Certificate, ClientTlsConfig, Endpoint, Identity, Uri};

use crate::hub_credentials::{HubCredentialFiles, HubCredentials, ReadError};
use crate::metrics::Metrics;
use crate::node_status::StatusReporter;
use crate::shared_state::SharedState;
use kmm_runtime::backoff::{Backoff, random_fraction};
use kmm_runtime::health::Health;

/// How the proxy reaches the hub.
#[derive(Clone, Debug)]
pub struct HubLink {
    /// `https://HOST:PORT`.
    pub address: Uri,
    pub files: HubCredentialFiles,
    /// How often the credential files are checked for a renewal.
    pub poll: Duration,
    pub backoff_initial: Duration,
    pub backoff_max: Duration,
}

#[derive(Debug, Error)]
pub enum HubAddressError {
    #[error(
        "--hub-address is empty: it is the variable HUB_ADDRESS of the add-on's \
         AddOnDeploymentConfig, which OCM renders as an empty string while it is unset"
    )]
    Empty,
    #[error("--hub-address {0:?} is not a URL: {1}")]
    NotAUrl(String, String),
    #[error("--hub-address {0:?} must be https://HOST:PORT")]
    NotHttps(String),
}

/// Parses `--hub-address`.
pub fn parse_address(address: &str) -> Result<Uri, HubAddressError> {
    if address.trim().is_empty() {
        return Err(HubAddressError::Empty);
    }
    let uri: Uri = address
        .parse()
        .map_err(|e: tonic::codegen::http::uri::InvalidUri| {
            HubAddressError::NotAUrl(address.to_owned(), e.to_string())
        })?;
    if uri.scheme_str() != Some("https") || uri.host().is_none_or(str::is_empty) {
        return Err(HubAddressError::NotHttps(address.to_owned()));
    }
    Ok(uri)
}

#[derive(Debug, Error)]
enum SessionError {
    #[error(transparent)]
    Credentials(#[from] ReadError),
    #[error("cannot connect to the hub: {}", chain(.0))]
    Connect(#[source] tonic::transport::Error),
    #[error("the hub refused the stream: {code:?}: {message}", code = .0.code(), message = .0.message())]
    Refused(tonic::Status),
    #[error("the hub ended the stream: {code:?}: {message}", code = .0.code(), message = .0.message())]
    Broken(tonic::Status),
    #[error("the hub closed the stream")]
    Closed,
    #[error("the hub did not {0} within {HANDSHAKE:?}")]
    Unanswered(&'static str),
}

/// How long the TLS handshake, and then the hub's answer to the stream, may take. The
/// connect timeout covers TCP only: a peer that accepts and never reads (a hub replica
/// that bound its port but does not serve) would otherwise hold the proxy forever.
const HANDSHAKE: Duration = Duration::from_secs(30);

/// `error` and its sources: tonic's transport errors say only "transport error" at the
/// top, the reason (refused, TLS, bad PEM) is further down.
fn chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}

/// Why a session that worked ended.
enum SessionEnd {
    Shutdown,
    CredentialsChanged,
}

/// Runs until `cancel` fires, reconnecting with jittered exponential backoff; `health`
/// is ready while a stream is open, and otherwise says why not.
pub async fn run(
    link: HubLink,
    state: SharedState,
    metrics: Metrics,
    health: Health,
    cancel: CancellationToken,
) {
    health.set_note(Some("waiting for the first list of the Nodes".to_owned()));
    let mut changes = state.subscribe();
    while !state.read(|s| s.nodes_listed()) {
        tokio::select! {
            () = cancel.cancelled() => return,
            _ = changes.changed() => {}
        }
    }
    health.set_note(Some("connecting to kmm-hub".to_owned()));
    let mut backoff = Backoff::new(link.backoff_initial, link.backoff_max);
    loop {
        let started = Instant::now();
        let outcome = session(&link, &state, &metrics, &health, &cancel, &mut backoff).await;
        metrics.hub_connected.set(0);
        health.set_ready(false);
        match outcome {
            Ok(SessionEnd::Shutdown) => return,
            Ok(SessionEnd::CredentialsChanged) => {
                metrics.hub_disconnects.inc();
                health.set_note(Some(
                    "reconnecting to kmm-hub with renewed credentials".to_owned(),
                ));
                tracing::info!("hub credential files changed; reconnecting with them");
                continue;
            }
            Err(error) => {
                metrics.hub_disconnects.inc();
                health.set_note(Some(format!("no stream to kmm-hub: {error}")));
                let delay = backoff.next_delay(random_fraction());
                tracing::warn!(
                    %error,
                    after_seconds = started.elapsed().as_secs(),
                    retry_in_ms = delay.as_millis() as u64,
                    "hub stream down; the last intents stay in force"
                );
                tokio::select! {
                    () = cancel.cancelled() => return,
                    () = tokio::time::sleep(delay) => {}
                }
            }
        }
    }
}

fn endpoint(link: &HubLink, credentials: &HubCredentials) -> Result<Endpoint, SessionError> {
    let host = link
        .address
        .host()
        .unwrap_or_default()
        .trim_start_matches('[')
        .trim_end_matches(']');
    let tls = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(&credentials.ca_pem))
        .identity(Identity::from_pem(
            &credentials.cert_pem,
            &credentials.key_pem,
        ))
        .domain_name(host);
    Ok(Endpoint::from(link.address.clone())
        .tls_config(tls)
        .map_err(SessionError::Connect)?
        .connect_timeout(Duration::from_secs(10))
        .http2_keep_alive_interval(Duration::from_secs(30))
        .keep_alive_timeout(Duration::from_secs(20))
        .keep_alive_while_idle(true))
}

#[tracing::instrument(name = "hub_link", skip_all, fields(address = %link.address))]
async fn session(
    link: &HubLink,
    state: &SharedState,
    metrics: &Metrics,
    health: &Health,
    cancel: &CancellationToken,
    backoff: &mut Backoff,
) -> Result<SessionEnd, SessionError> {
    let credentials = link.files.read()?;
    metrics
        .hub_client_certificate_expiry
        .set(credentials.cert_not_after);
    let endpoint = endpoint(link, &credentials)?;
    let channel = tokio::select! {
        () = cancel.cancelled() => return Ok(SessionEnd::Shutdown),
        connected = tokio::time::timeout(HANDSHAKE, endpoint.connect()) => connected
            .map_err(|_| SessionError::Unanswered("complete the TLS handshake"))?
            .map_err(SessionError::Connect)?,
    };

    let mut changes = state.subscribe();
    let mut reporter = StatusReporter::default();
    changes.borrow_and_update();
    let (hello, inventory, statuses, plugins, spoke_images) = state.update_quietly(|s| {
        s.take_status_dirty();
        (
            ProxyHello {
                proxy_version: env!("CARGO_PKG_VERSION").to_owned(),
                applied_intent_revision: s.applied_intent_revision(),
                applied_intent_digest: s.applied_intent_digest(),
            },
            s.inventory(),
            s.all_statuses(),
            s.device_plugin_report(),
            s.spoke_image_report(),
        )
    });
    let mut inventory_revision = inventory.revision;
    let mut plugins_sent = plugins.clone();
    let mut spoke_images_sent = spoke_images.clone();
    let applied = hello.applied_intent_revision;
    // The plugin counts before the statuses made from the same state: the hub reads a
    // module that loads nothing as converged from the counts once a status report
    // acknowledges its intent, so the counts must never be older than that report.
    let mut first = vec![
        proxy_message::Message::Hello(hello),
        proxy_message::Message::Inventory(inventory),
        proxy_message::Message::DevicePlugins(plugins),
        proxy_message::Message::SpokeImages(spoke_images),
    ];
    first.extend(
        report_parts(reporter.full(statuses, applied), REPORT_PART)
            .into_iter()
            .map(proxy_message::Message::Status),
    );
    let (tx, rx) = mpsc::channel::<ProxyMessage>(first.len() + 64);
    for message in first {
        // The channel is fresh and larger than these messages: this cannot block.
        tx.send(ProxyMessage {
            message: Some(message),
        })
        .await
        .map_err(|_| SessionError::Closed)?;
    }

    let mut client = HubClient::new(channel)
        .max_encoding_message_size(kmm_proto::limits::PROXY_MESSAGE)
        .max_decoding_message_size(kmm_proto::limits::HUB_MESSAGE);
    let response = tokio::select! {
        () = cancel.cancelled() => return Ok(SessionEnd::Shutdown),
        response = tokio::time::timeout(HANDSHAKE, client.sync(ReceiverStream::new(rx))) => response
            .map_err(|_| SessionError::Unanswered("answer the stream"))?
            .map_err(SessionError::Refused)?,
    };
    let mut inbound = response.into_inner();
    metrics.hub_connected.set(1);
    metrics.hub_connects.inc();
    health.set_note(None);
    health.set_ready(true);
    backoff.reset();
    tracing::info!("hub stream open");

    let mut poll = tokio::time::interval(link.poll);
    poll.tick().await;
    loop {
        tokio::select! {
            () = cancel.cancelled() => return Ok(SessionEnd::Shutdown),
            message = inbound.message() => match message {
                Ok(Some(HubMessage { message: Some(hub_message::Message::Intents(snapshot)) })) => {
                    // As it arrived: applying it is the placement, the next hop.
                    metrics.intents_received.set_now();
                    let revision = snapshot.revision;
                    let modules = snapshot.modules.len();
                    state.update(|s| s.set_intents(snapshot));
                    metrics.intent_revision.set(revision as i64);
                    tracing::info!(revision, modules, "intent snapshot applied");
                }
                Ok(Some(HubMessage { message: None })) => {
                    tracing::debug!("empty message from the hub ignored");
                }
                Ok(None) => return Err(SessionError::Closed),
                Err(status) => return Err(SessionError::Broken(status)),
            },
            _ = changes.changed() => {
                let (inventory, statuses, applied, plugins, spoke_images) = state.update_quietly(|s| {
                    let dirty = s.take_status_dirty();
                    (
                        s.inventory(),
                        s.statuses_of(&dirty),
                        s.applied_intent_revision(),
                        s.device_plugin_report(),
                        s.spoke_image_report(),
                    )
                });
                if inventory.revision != inventory_revision {
                    inventory_revision = inventory.revision;
                    send(&tx, proxy_message::Message::Inventory(inventory)).await?;
                }
                if plugins != plugins_sent {
                    plugins_sent = plugins.clone();
                    send(&tx, proxy_message::Message::DevicePlugins(plugins)).await?;
                }
                if spoke_images != spoke_images_sent {
                    spoke_images_sent = spoke_images.clone();
                    send(&tx, proxy_message::Message::SpokeImages(spoke_images)).await?;
                }
                if let Some(delta) = reporter.delta(statuses, applied) {
                    for part in report_parts(delta, REPORT_PART) {
                        send(&tx, proxy_message::Message::Status(part)).await?;
                    }
                }
            }
            _ = poll.tick() => {
                match link.files.read() {
                    Ok(current) if current.fingerprint() != credentials.fingerprint() => {
                        return Ok(SessionEnd::CredentialsChanged);
                    }
                    Ok(_) => {}
                    // Mid-rotation files may be briefly absent: keep the working stream.
                    Err(error) => tracing::debug!(%error, "credential files unreadable for now"),
                }
            }
        }
    }
}

async fn send(
    tx: &mpsc::Sender<ProxyMessage>,
    message: proxy_message::Message,
) -> Result<(), SessionError> {
    tx.send(ProxyMessage {
        message: Some(message),
    })
    .await
    .map_err(|_| SessionError::Closed)
}

#[cfg(test)]
mod tests {
    use std::net::SocketAddr;

    use kmm_proto::v1::hub_server::{Hub, HubServer};
    use kmm_runtime::pki::{CertificateAuthority, Leaf};
    use prometheus_client::registry::Registry;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpListener;
    use tokio::sync::oneshot;
    use tokio_stream::wrappers::TcpListenerStream;
    use tonic::transport::{Server, ServerTlsConfig};
    use tonic::{Request, Response, Status, Streaming};

    use super::*;
    use crate::cluster_state::ClusterState;

    const WAIT: Duration = Duration::from_secs(20);

    /// An open Sync stream as the test hub holds it: dropping it ends the stream.
    type Open = (
        Streaming<ProxyMessage>,
        mpsc::Sender<Result<HubMessage, Status>>,
    );

    /// A hub that accepts every stream and keeps it open for the test.
    struct Peer(mpsc::UnboundedSender<Open>);

    #[tonic::async_trait]
    impl Hub for Peer {
        type SyncStream = ReceiverStream<Result<HubMessage, Status>>;

        async fn sync(
            &self,
            request: Request<Streaming<ProxyMessage>>,
        ) -> Result<Response<Self::SyncStream>, Status> {
            let (tx, rx) = mpsc::channel(1);
            let _ = self.0.send((request.into_inner(), tx));
            Ok(Response::new(ReceiverStream::new(rx)))
        }
    }

    async fn get(addr: SocketAddr, path: &str) -> String {
        let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
        let request = format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
        stream.write_all(request.as_bytes()).await.unwrap();
        let mut response = String::new();
        stream.read_to_string(&mut response).await.unwrap();
        response
    }

    /// Polls `path` until its response satisfies `done`, and returns that response.
    async fn wait_for(addr: SocketAddr, path: &str, done: impl Fn(&str) -> bool) -> String {
        let deadline = Instant::now() + WAIT;
        loop {
            let response = get(addr, path).await;
            if done(&response) {
                return response;
            }
            assert!(Instant::now() < deadline, "{path} still answers {response}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// A test hub (TLS, client certificates of its CA required) and the hub link of a
    /// proxy reading its credential files from a temporary directory, with /metrics,
    /// /healthz and /readyz served on `endpoint`.
    struct Fixture {
        ca: CertificateAuthority,
        files: HubCredentialFiles,
        _dir: tempfile::TempDir,
        streams: mpsc::UnboundedReceiver<Open>,
        stop_hub: oneshot::Sender<()>,
        hub: tokio::task::JoinHandle<Result<(), tonic::transport::Error>>,
        endpoint: SocketAddr,
        state: SharedState,
        cancel: CancellationToken,
        link: tokio::task::JoinHandle<()>,
    }

    impl Fixture {
        /// `hub_ca`: whether HUB_CA_BUNDLE is published yet; `poll`: how often the
        /// credential files are checked for a renewal.
        async fn start(hub_ca: bool, poll: Duration) -> Self {
            let hour = Duration::from_secs(3600);
            let ca = CertificateAuthority::generate("test-hub-ca", hour).unwrap();
            let serving = ca
                .issue(&Leaf::server(
                    "kmm-hub",
                    &[],
                    &["127.0.0.1".parse().unwrap()],
                    hour,
                ))
                .unwrap();
            let dir = tempfile::tempdir().unwrap();
            let files = HubCredentialFiles {
                ca: dir.path().join("ca.crt"),
                cert: dir.path().join("tls.crt"),
                key: dir.path().join("tls.key"),
            };
            let published = if hub_ca { ca.cert_pem() } else { "" };
            std::fs::write(&files.ca, published).unwrap();

            let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
            let hub_addr = listener.local_addr().unwrap();
            let (streams_tx, streams) = mpsc::unbounded_channel();
            let (stop_hub, hub_stopped) = oneshot::channel::<()>();
            let tls = ServerTlsConfig::new()
                .identity(Identity::from_pem(
                    &serving.cert_pem,
                    serving.key_pem.as_bytes(),
                ))
                .client_ca_root(Certificate::from_pem(ca.cert_pem()));
            let hub = tokio::spawn(
                Server::builder()
                    .tls_config(tls)
                    .unwrap()
                    .add_service(HubServer::new(Peer(streams_tx)))
                    .serve_with_incoming_shutdown(TcpListenerStream::new(listener), async {
                        let _ = hub_stopped.await;
                    }),
            );

            let health = Health::default();
            let metrics = Metrics::default();
            let mut registry = Registry::default();
            metrics.register(&mut registry);
            let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
            let endpoint = listener.local_addr().unwrap();
            let cancel = CancellationToken::new();
            tokio::spawn(kmm_runtime::health::serve_on(
                listener,
                registry,
                health.clone(),
                cancel.clone().cancelled_owned(),
            ));
            let state = SharedState::new(ClusterState::new(1));
            let link = HubLink {
                address: parse_address(&format!("https://{hub_addr}")).unwrap(),
                files: files.clone(),
                poll,
                backoff_initial: Duration::from_millis(20),
                backoff_max: Duration::from_millis(100),
            };
            let link = tokio::spawn(run(link, state.clone(), metrics, health, cancel.clone()));
            let fixture = Self {
                ca,
                files,
                _dir: dir,
                streams,
                stop_hub,
                hub,
                endpoint,
                state,
                cancel,
                link,
            };
            fixture.issue_client(hour);
            fixture
        }

        /// Writes a client certificate as a renewal does; returns its NotAfter.
        fn issue_client(&self, validity: Duration) -> i64 {
            let leaf = Leaf::client("agent", &[], validity);
            let client = self.ca.issue(&leaf).unwrap();
            std::fs::write(&self.files.key, client.key_pem.as_bytes()).unwrap();
            std::fs::write(&self.files.cert, &client.cert_pem).unwrap();
            leaf.not_after.unix_timestamp()
        }

        fn nodes_listed(&self) {
            self.state.update(|s| s.replace_nodes(Vec::new()));
        }

        async fn next_stream(&mut self) -> Open {
            tokio::time::timeout(WAIT, self.streams.recv())
                .await
                .expect("a stream in time")
                .expect("the hub runs")
        }

        async fn wait_for(&self, path: &str, done: impl Fn(&str) -> bool) -> String {
            wait_for(self.endpoint, path, done).await
        }

        async fn stop(self) {
            self.cancel.cancel();
            self.link.await.unwrap();
            let _ = self.stop_hub.send(());
            drop(self.streams);
            self.hub.await.unwrap().unwrap();
        }
    }

    /// The value of `name` in a `/metrics` response, if it has the series.
    fn sample(response: &str, name: &str) -> Option<f64> {
        response
            .lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
    }

    #[tokio::test]
    async fn intents_from_the_hub_mark_when_they_arrived() {
        const RECEIVED: &str = "kmm_spoke_proxy_intents_last_received_timestamp_seconds";
        let mut fixture = Fixture::start(true, Duration::from_secs(3600)).await;
        fixture.nodes_listed();
        let (_inbound, hub) = fixture.next_stream().await;
        let idle = fixture
            .wait_for("/metrics", |r| {
                r.contains("kmm_spoke_proxy_hub_connected 1")
            })
            .await;
        assert_eq!(sample(&idle, RECEIVED), Some(0.0), "{idle}");

        let before = kmm_runtime::timestamp::unix_seconds(std::time::SystemTime::now());
        let intents = kmm_proto::v1::IntentSnapshot {
            revision: 1,
            ..Default::default()
        };
        hub.send(Ok(HubMessage {
            message: Some(hub_message::Message::Intents(intents)),
        }))
        .await
        .unwrap();
        let applied = fixture
            .wait_for("/metrics", |r| {
                r.contains("kmm_spoke_proxy_intent_revision 1")
            })
            .await;
        let after = kmm_runtime::timestamp::unix_seconds(std::time::SystemTime::now());
        let received = sample(&applied, RECEIVED).expect("the series");
        assert!(
            (before..=after).contains(&received),
            "{before} <= {received} <= {after}"
        );
        fixture.stop().await;
    }

    /// OCM's health check of the add-on is the proxy's readiness: /readyz says ok while
    /// the hub stream is open and only then; /healthz does not care about the hub.
    #[tokio::test]
    async fn ready_exactly_while_the_hub_stream_is_open() {
        // HUB_CA_BUNDLE not published yet.
        let mut fixture = Fixture::start(false, Duration::from_secs(3600)).await;
        let waiting = fixture.wait_for("/readyz", |r| r.contains("Nodes")).await;
        assert!(waiting.starts_with("HTTP/1.1 503"), "{waiting}");
        fixture.nodes_listed();
        let no_ca = fixture
            .wait_for("/readyz", |r| r.contains("HUB_CA_BUNDLE"))
            .await;
        assert!(no_ca.starts_with("HTTP/1.1 503"), "{no_ca}");
        let alive = get(fixture.endpoint, "/healthz").await;
        assert!(alive.starts_with("HTTP/1.1 200"), "{alive}");

        std::fs::write(&fixture.files.ca, fixture.ca.cert_pem()).unwrap();
        let open = fixture.next_stream().await;
        let ready = fixture
            .wait_for("/readyz", |r| r.starts_with("HTTP/1.1 200"))
            .await;
        assert!(ready.ends_with("\r\n\r\nok\n"), "{ready}");
        let exposed = get(fixture.endpoint, "/metrics").await;
        assert!(
            exposed.contains("kmm_spoke_proxy_hub_connected 1"),
            "{exposed}"
        );

        // The hub goes away: not ready (saying why), still alive.
        let Fixture {
            stop_hub,
            hub,
            endpoint,
            cancel,
            link,
            ..
        } = fixture;
        let _ = stop_hub.send(());
        drop(open);
        hub.await.unwrap().unwrap();
        let lost = wait_for(endpoint, "/readyz", |r| r.starts_with("HTTP/1.1 503")).await;
        assert!(lost.contains("no stream to kmm-hub"), "{lost}");
        let alive = get(endpoint, "/healthz").await;
        assert!(alive.starts_with("HTTP/1.1 200"), "{alive}");
        cancel.cancel();
        link.await.unwrap();
    }

    /// Production alerts on the expiry; OCM renews the files under the mount.
    #[tokio::test]
    async fn the_certificate_expiry_follows_renewals() {
        const EXPIRY: &str = "kmm_spoke_proxy_hub_client_certificate_expiry_timestamp_seconds";
        let mut fixture = Fixture::start(true, Duration::from_millis(50)).await;
        let before = get(fixture.endpoint, "/metrics").await;
        assert!(before.contains(&format!("{EXPIRY} 0\n")), "{before}");
        let first_until = fixture.issue_client(Duration::from_secs(3600));
        fixture.nodes_listed();
        let first = fixture.next_stream().await;
        let shown = |until: i64| move |r: &str| r.contains(&format!("{EXPIRY} {until}\n"));
        fixture.wait_for("/metrics", shown(first_until)).await;

        let renewed_until = fixture.issue_client(Duration::from_secs(7200));
        assert!(renewed_until > first_until);
        let _second = fixture.next_stream().await;
        fixture.wait_for("/metrics", shown(renewed_until)).await;
        drop(first);
        fixture.stop().await;
    }

    #[test]
    fn errors_show_their_causes() {
        let inner = std::io::Error::new(std::io::ErrorKind::ConnectionRefused, "refused");
        let outer = ReadErrorLike(inner);
        assert_eq!(chain(&outer), "outer: refused");
    }

    #[derive(Debug)]
    struct ReadErrorLike(std::io::Error);
    impl std::fmt::Display for ReadErrorLike {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("outer")
        }
    }
    impl std::error::Error for ReadErrorLike {
        fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
            Some(&self.0)
        }
    }

    #[test]
    fn address_must_be_https_with_a_host() {
        assert!(parse_address("https://hub.example:7443").is_ok());
        assert!(parse_address("https://127.0.0.1:7443").is_ok());
        let plain = parse_address("http://hub:7443").unwrap_err().to_string();
        assert!(plain.contains("--hub-address") && plain.contains("http://hub:7443"));
        assert!(parse_address("hub:7443").is_err());
        assert!(parse_address("not a url").is_err());
        let empty = parse_address("").unwrap_err().to_string();
        assert!(
            empty.starts_with("--hub-address is empty") && empty.contains("HUB_ADDRESS"),
            "{empty}"
        );
    }
}
