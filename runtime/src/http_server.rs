//! The accept loop of the HTTP/1 endpoints: the hub's admission webhook (TLS) and every
//! binary's `/metrics` `/healthz` `/readyz` (plain). Any in-cluster client can reach
//! them, so no client may hold them: every phase of a connection has a deadline, and at
//! most [`Limits::max_connections`] are served at once.
//!
//! A connection over the cap is closed at once (and counted) rather than queued: a queue
//! would let a flood delay real requests by as long as the flood lasts, where a refusal
//! lets the client retry, and a slot taken by a client that sends nothing is free again
//! within [`Limits::handshake_timeout`] (or [`Limits::header_read_timeout`] once it has
//! finished TLS).

use std::convert::Infallible;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, StatusCode, header};
use http_body_util::{Either, Full};
use hyper::body::{Body, Incoming};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::{TokioIo, TokioTimer};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use rustls::ServerConfig;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio::task::JoinSet;
use tokio_rustls::TlsAcceptor;

/// How much of an endpoint one client can hold, and for how long.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Connections served at once; one more is closed as soon as it is accepted and
    /// counted in `connections_refused`.
    pub max_connections: usize,
    /// From accept to the end of the TLS handshake (TLS endpoints only).
    pub handshake_timeout: Duration,
    /// For a request's headers: from the end of the handshake, and on a kept-alive
    /// connection from the previous response, so it is the idle bound too.
    pub header_read_timeout: Duration,
    /// From a request's headers to its response, reading the body included; a request
    /// over it is answered 503 and its connection closed.
    pub request_timeout: Duration,
}

/// Which deadline ended a connection.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PhaseLabels {
    /// `handshake`, `headers` or `request`.
    pub phase: &'static str,
}

/// An endpoint's connections; clones share the values.
#[derive(Clone, Debug, Default)]
pub struct ConnectionMetrics {
    pub open: Gauge,
    pub refused: Counter,
    pub timed_out: Family<PhaseLabels, Counter>,
}

impl ConnectionMetrics {
    /// Registers the metrics in `registry`, which names the endpoint by its prefix.
    pub fn register(&self, registry: &mut Registry) {
        registry.register(
            "connections_open",
            "Connections being served",
            self.open.clone(),
        );
        registry.register(
            "connections_refused",
            "Connections closed as soon as accepted because max_connections were open",
            self.refused.clone(),
        );
        registry.register(
            "connections_timed_out",
            "Connections closed by a deadline, by the phase that overran it",
            self.timed_out.clone(),
        );
    }

    fn timed_out(&self, phase: &'static str) {
        self.timed_out.get_or_create(&PhaseLabels { phase }).inc();
    }
}

/// One open connection in `open`, for as long as it lives.
struct Open(Gauge);

impl Open {
    fn new(gauge: &Gauge) -> Self {
        gauge.inc();
        Self(gauge.clone())
    }
}

impl Drop for Open {
    fn drop(&mut self) {
        self.0.dec();
    }
}

/// An endpoint: its name in logs, TLS (`None`: plain HTTP), limits and metrics.
#[derive(Clone, Debug)]
pub struct Endpoint {
    pub name: &'static str,
    pub tls: Option<Arc<ServerConfig>>,
    pub limits: Limits,
    pub metrics: ConnectionMetrics,
}

/// Serves `handler` on `listener` until `shutdown` resolves; then the open connections
/// end too, so a stopped server never answers from a kept-alive connection.
/// [`Limits::request_timeout`] bounds the handler's answer up to its response head: a
/// streamed body (the fleet UI's events) runs on, bounded by the handler itself.
pub async fn serve<H, F, B>(
    listener: TcpListener,
    endpoint: Endpoint,
    handler: H,
    shutdown: impl Future<Output = ()>,
) where
    H: Fn(Request<Incoming>) -> F + Clone + Send + Sync + 'static,
    F: Future<Output = Response<B>> + Send + 'static,
    B: Body<Data = Bytes> + Send + 'static,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let slots = Arc::new(Semaphore::new(endpoint.limits.max_connections));
    let acceptor = endpoint.tls.clone().map(TlsAcceptor::from);
    let mut connections = JoinSet::new();
    tokio::pin!(shutdown);
    loop {
        let (stream, peer) = tokio::select! {
            () = &mut shutdown => return,
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(error) => {
                    tracing::warn!(endpoint = endpoint.name, %error, "accept failed");
                    continue;
                }
            },
        };
        // Reap finished connections so the set stays small.
        while connections.try_join_next().is_some() {}
        let Ok(slot) = Arc::clone(&slots).try_acquire_owned() else {
            endpoint.metrics.refused.inc();
            tracing::debug!(endpoint = endpoint.name, %peer, "max_connections open; closed");
            drop(stream);
            continue;
        };
        let open = Open::new(&endpoint.metrics.open);
        let (endpoint, handler, acceptor) = (endpoint.clone(), handler.clone(), acceptor.clone());
        connections.spawn(async move {
            let _held = (slot, open);
            let Some(acceptor) = acceptor else {
                return serve_connection(stream, &endpoint, handler).await;
            };
            let handshake = acceptor.accept(stream);
            match tokio::time::timeout(endpoint.limits.handshake_timeout, handshake).await {
                Ok(Ok(stream)) => serve_connection(stream, &endpoint, handler).await,
                Ok(Err(error)) => {
                    tracing::debug!(endpoint = endpoint.name, %peer, %error, "TLS handshake failed");
                }
                Err(_) => {
                    endpoint.metrics.timed_out("handshake");
                    tracing::debug!(endpoint = endpoint.name, %peer, "TLS handshake timed out");
                }
            }
        });
    }
}

async fn serve_connection<I, H, F, B>(io: I, endpoint: &Endpoint, handler: H)
where
    I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    H: Fn(Request<Incoming>) -> F + Send + Sync + 'static,
    F: Future<Output = Response<B>> + Send + 'static,
    B: Body<Data = Bytes> + Send + 'static,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let (limit, metrics) = (endpoint.limits.request_timeout, endpoint.metrics.clone());
    let service = service_fn(move |request: Request<Incoming>| {
        let answer = tokio::time::timeout(limit, handler(request));
        let metrics = metrics.clone();
        async move {
            Ok::<_, Infallible>(match answer.await {
                Ok(response) => response.map(Either::Left),
                Err(_) => {
                    metrics.timed_out("request");
                    timed_out().map(Either::Right)
                }
            })
        }
    });
    let served = http1::Builder::new()
        .timer(TokioTimer::new())
        .header_read_timeout(endpoint.limits.header_read_timeout)
        .serve_connection(TokioIo::new(io), service)
        .await;
    if let Err(error) = served {
        if error.is_timeout() {
            endpoint.metrics.timed_out("headers");
        }
        tracing::debug!(endpoint = endpoint.name, %error, "connection ended");
    }
}

fn timed_out() -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(Bytes::from_static(b"request timed out\n")));
    *response.status_mut() = StatusCode::SERVICE_UNAVAILABLE;
    response.headers_mut().insert(
        header::CONNECTION,
        header::HeaderValue::from_static("close"),
    );
    response
}

#[cfg(test)]
mod tests {
    use std::net::SocketAddr;
    use std::time::Instant;

    use rustls::RootCertStore;
    use rustls::crypto::ring::default_provider;
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, ServerName};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpStream;
    use tokio_rustls::TlsConnector;
    use tokio_rustls::client::TlsStream;
    use tokio_util::sync::CancellationToken;

    use super::*;
    use crate::pki::{CertificateAuthority, Leaf};
    use crate::serving::{ServingCertificate, server_config};

    const DAY: Duration = Duration::from_secs(24 * 3600);
    /// Short bounds, long enough for a loaded test machine's real handshakes.
    const LIMITS: Limits = Limits {
        max_connections: 2,
        handshake_timeout: Duration::from_secs(2),
        header_read_timeout: Duration::from_secs(2),
        request_timeout: Duration::from_secs(2),
    };
    /// What a deadline may be overrun by on a busy machine.
    const SLACK: Duration = Duration::from_secs(2);

    struct Server {
        addr: SocketAddr,
        metrics: ConnectionMetrics,
        connector: TlsConnector,
        stop: CancellationToken,
    }

    impl Drop for Server {
        fn drop(&mut self) {
            self.stop.cancel();
        }
    }

    /// A TLS endpoint answering "ok", or never for `/stall`.
    async fn start() -> Server {
        let ca = CertificateAuthority::generate("ca", DAY).unwrap();
        let leaf = ca
            .issue(&Leaf::server("s", &["s".into()], &[], DAY))
            .unwrap();
        let certificate = ServingCertificate::new(&leaf.cert_pem, &leaf.key_pem).unwrap();
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let metrics = ConnectionMetrics::default();
        let endpoint = Endpoint {
            name: "test",
            tls: Some(server_config(certificate, None, &[b"http/1.1"]).unwrap()),
            limits: LIMITS,
            metrics: metrics.clone(),
        };
        let handler = |request: Request<Incoming>| async move {
            if request.uri().path() == "/stall" {
                std::future::pending::<()>().await;
            }
            Response::new(Full::new(Bytes::from_static(b"ok")))
        };
        let stop = CancellationToken::new();
        tokio::spawn(serve(
            listener,
            endpoint,
            handler,
            stop.clone().cancelled_owned(),
        ));
        let mut roots = RootCertStore::empty();
        roots
            .add(CertificateDer::from_pem_slice(ca.cert_pem().as_bytes()).unwrap())
            .unwrap();
        let client = rustls::ClientConfig::builder_with_provider(Arc::new(default_provider()))
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_root_certificates(roots)
            .with_no_client_auth();
        Server {
            addr,
            metrics,
            connector: TlsConnector::from(Arc::new(client)),
            stop,
        }
    }

    impl Server {
        async fn tls(&self) -> std::io::Result<TlsStream<TcpStream>> {
            let tcp = TcpStream::connect(self.addr).await?;
            let name = ServerName::try_from("s").unwrap();
            self.connector.connect(name, tcp).await
        }

        fn timed_out(&self, phase: &'static str) -> u64 {
            self.metrics
                .timed_out
                .get_or_create(&PhaseLabels { phase })
                .get()
        }
    }

    /// Sends a request for `path` and reads the response's head and its body "ok" (or
    /// everything until the server closes).
    async fn request<S>(stream: &mut S, path: &str) -> String
    where
        S: AsyncRead + AsyncWrite + Unpin,
    {
        let head = format!("GET {path} HTTP/1.1\r\nHost: s\r\n\r\n");
        stream.write_all(head.as_bytes()).await.unwrap();
        let mut response = Vec::new();
        let mut buffer = [0; 1024];
        while !response.ends_with(b"\r\n\r\nok") {
            match stream.read(&mut buffer).await {
                Ok(0) | Err(_) => break,
                Ok(n) => response.extend_from_slice(&buffer[..n]),
            }
        }
        String::from_utf8_lossy(&response).into_owned()
    }

    /// Whether the server closes `stream` within `within` (whatever it says before).
    async fn closed_within<S: AsyncRead + Unpin>(stream: &mut S, within: Duration) -> bool {
        let mut rest = Vec::new();
        tokio::time::timeout(within, stream.read_to_end(&mut rest))
            .await
            .is_ok()
    }

    /// Waits for `condition`, failing the test with `what` after `within`.
    async fn eventually(what: &str, within: Duration, condition: impl Fn() -> bool) {
        let deadline = Instant::now() + within;
        while !condition() {
            assert!(Instant::now() < deadline, "not within {within:?}: {what}");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    #[tokio::test]
    async fn a_client_that_never_says_hello_is_dropped_after_the_handshake_timeout() {
        let server = start().await;
        let mut silent = TcpStream::connect(server.addr).await.unwrap();
        let within = LIMITS.handshake_timeout + SLACK;
        assert!(closed_within(&mut silent, within).await, "still open");
        assert_eq!(server.timed_out("handshake"), 1);
    }

    #[tokio::test]
    async fn a_client_that_sends_no_headers_is_dropped_after_the_header_timeout() {
        let server = start().await;
        let mut silent = server.tls().await.unwrap();
        let within = LIMITS.header_read_timeout + SLACK;
        assert!(closed_within(&mut silent, within).await, "still open");
        assert_eq!(server.timed_out("headers"), 1);

        // A kept-alive connection idle after its response is dropped by the same bound.
        let mut idle = server.tls().await.unwrap();
        let answer = request(&mut idle, "/").await;
        assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
        assert!(closed_within(&mut idle, within).await, "still open");
        assert_eq!(server.timed_out("headers"), 2);
    }

    #[tokio::test]
    async fn a_request_not_answered_in_time_gets_503() {
        let server = start().await;
        let mut stream = server.tls().await.unwrap();
        let answer = tokio::time::timeout(
            LIMITS.request_timeout + SLACK,
            request(&mut stream, "/stall"),
        )
        .await
        .expect("an answer within the request timeout");
        assert!(answer.starts_with("HTTP/1.1 503"), "{answer}");
        assert_eq!(server.timed_out("request"), 1);
    }

    #[tokio::test]
    async fn idle_connections_over_the_cap_are_refused_at_once_and_real_requests_soon_served() {
        let server = start().await;
        let flood_started = Instant::now();
        let mut flood = Vec::new();
        for _ in 0..LIMITS.max_connections {
            flood.push(TcpStream::connect(server.addr).await.unwrap());
        }
        eventually("the flood holds every slot", SLACK, || {
            server.metrics.open.get() == 2
        })
        .await;

        // Refused while the flood still holds every slot: at once, not after a timeout.
        let mut over = TcpStream::connect(server.addr).await.unwrap();
        assert!(closed_within(&mut over, LIMITS.handshake_timeout).await);
        assert_eq!(server.metrics.refused.get(), 1);
        assert_eq!(server.metrics.open.get(), 2);
        assert_eq!(server.timed_out("handshake"), 0);

        // A real request is answered once the flood's handshakes time out.
        let answered_by = LIMITS.handshake_timeout + SLACK;
        let answer = loop {
            assert!(flood_started.elapsed() < answered_by, "no answer");
            eventually("a free slot", answered_by, || server.metrics.open.get() < 2).await;
            if let Ok(mut stream) = server.tls().await {
                let answer = request(&mut stream, "/").await;
                if !answer.is_empty() {
                    break answer;
                }
            }
        };
        assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
        assert!(flood_started.elapsed() < answered_by);
        assert_eq!(server.timed_out("handshake"), 2);
        drop(flood);
    }
}
