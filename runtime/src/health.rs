//! `/metrics`, `/healthz` and `/readyz` on one small HTTP/1 listener.
//!
//! Liveness answers as long as the process serves requests; readiness is what the
//! component declares through [`Health::set_ready`] (e.g. "connected and synced").

use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, PoisonError, RwLock};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode, header};
use http_body_util::Full;
use hyper::body::Incoming;
use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use tokio::net::TcpListener;

use crate::http_server::{self, ConnectionMetrics, Endpoint, Limits};

const OPENMETRICS: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// The endpoint's bounds. Its clients are the kubelet's probes and a scraper or two,
/// each answered in milliseconds; plain HTTP, so there is no handshake to time.
pub const LIMITS: Limits = Limits {
    max_connections: 32,
    handshake_timeout: Duration::from_secs(5),
    header_read_timeout: Duration::from_secs(10),
    request_timeout: Duration::from_secs(10),
};

/// Prefix of the endpoint's own connection metrics (`kmm_metrics_endpoint_connections_*`).
const METRICS_PREFIX: &str = "kmm_metrics_endpoint";

/// Readiness shared between the component and its endpoint; clones share the flag.
#[derive(Clone, Debug, Default)]
pub struct Health {
    ready: Arc<AtomicBool>,
    /// Said by `/readyz` instead of "ok" (e.g. "standing by"), when set.
    note: Arc<RwLock<Option<String>>>,
}

impl Health {
    pub fn set_ready(&self, ready: bool) {
        self.ready.store(ready, Ordering::Relaxed);
    }

    /// What `/readyz` says besides its status; `None` for the plain "ok"/"not ready".
    pub fn set_note(&self, note: Option<String>) {
        *self.note.write().unwrap_or_else(PoisonError::into_inner) = note;
    }

    fn readiness_text(&self) -> (StatusCode, String) {
        let note = self.note.read().unwrap_or_else(PoisonError::into_inner);
        match (self.is_ready(), note.as_deref()) {
            (true, None) => (StatusCode::OK, "ok\n".to_owned()),
            (false, None) => (StatusCode::SERVICE_UNAVAILABLE, "not ready\n".to_owned()),
            (true, Some(note)) => (StatusCode::OK, format!("ok: {note}\n")),
            (false, Some(note)) => (
                StatusCode::SERVICE_UNAVAILABLE,
                format!("not ready: {note}\n"),
            ),
        }
    }

    pub fn is_ready(&self) -> bool {
        self.ready.load(Ordering::Relaxed)
    }
}

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("cannot listen on --metrics-addr {addr}: {source}")]
    Bind {
        addr: SocketAddr,
        source: std::io::Error,
    },
}

/// Binds `addr` and serves until `shutdown` resolves.
pub async fn serve(
    addr: SocketAddr,
    registry: Registry,
    health: Health,
    shutdown: impl Future<Output = ()>,
) -> Result<(), Error> {
    let listener = TcpListener::bind(addr)
        .await
        .map_err(|source| Error::Bind { addr, source })?;
    serve_on(listener, registry, health, shutdown).await;
    Ok(())
}

/// Serves on a bound listener until `shutdown` resolves (tests bind port 0), within
/// [`LIMITS`]; its connection metrics join `registry`.
pub async fn serve_on(
    listener: TcpListener,
    mut registry: Registry,
    health: Health,
    shutdown: impl Future<Output = ()>,
) {
    let metrics = ConnectionMetrics::default();
    metrics.register(registry.sub_registry_with_prefix(METRICS_PREFIX));
    registry.register(
        "process_start_time_seconds",
        "When this process started serving metrics, in Unix seconds: a change means it restarted",
        process_start_time(),
    );
    let registry = Arc::new(registry);
    let endpoint = Endpoint {
        name: "metrics",
        tls: None,
        limits: LIMITS,
        metrics,
    };
    let handler = move |request: Request<Incoming>| {
        let response = respond(&request, &registry, &health);
        async move { response }
    };
    http_server::serve(listener, endpoint, handler, shutdown).await;
}

/// The standard name Prometheus' own clients use, so that restart alerts and dashboards
/// written for them (`changes(process_start_time_seconds[1h])`) work unchanged. Every
/// binary serves its metrics from its first moments, so this is close to the start.
fn process_start_time() -> Gauge {
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default();
    let gauge = Gauge::default();
    gauge.set(i64::try_from(now.as_secs()).unwrap_or(i64::MAX));
    gauge
}

fn respond<B>(request: &Request<B>, registry: &Registry, health: &Health) -> Response<Full<Bytes>> {
    if request.method() != Method::GET {
        return text(StatusCode::METHOD_NOT_ALLOWED, "only GET\n");
    }
    match request.uri().path() {
        "/healthz" => text(StatusCode::OK, "ok\n"),
        "/readyz" => {
            let (status, body) = health.readiness_text();
            text(status, &body)
        }
        "/metrics" => {
            let mut body = String::new();
            match encode(&mut body, registry) {
                Ok(()) => Response::builder()
                    .header(header::CONTENT_TYPE, OPENMETRICS)
                    .body(Full::new(Bytes::from(body)))
                    .unwrap_or_else(|_| text(StatusCode::INTERNAL_SERVER_ERROR, "encoding\n")),
                Err(_) => text(StatusCode::INTERNAL_SERVER_ERROR, "cannot encode metrics\n"),
            }
        }
        _ => text(StatusCode::NOT_FOUND, "not found\n"),
    }
}

fn text(status: StatusCode, body: &str) -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(Bytes::from(body.to_owned())));
    *response.status_mut() = status;
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static("text/plain"),
    );
    response
}

#[cfg(test)]
mod tests {
    use prometheus_client::metrics::counter::Counter;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::sync::oneshot;

    use super::*;

    async fn get(addr: SocketAddr, path: &str) -> String {
        let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
        let request = format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
        stream.write_all(request.as_bytes()).await.unwrap();
        let mut response = String::new();
        stream.read_to_string(&mut response).await.unwrap();
        response
    }

    #[tokio::test]
    async fn answers_health_readiness_and_metrics() {
        let mut registry = Registry::default();
        let counter = Counter::<u64>::default();
        registry.register("kmm_test_events", "Events seen", counter.clone());
        counter.inc_by(3);
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let health = Health::default();
        let (stop, stopped) = oneshot::channel::<()>();
        let server = tokio::spawn(serve_on(listener, registry, health.clone(), async {
            let _ = stopped.await;
        }));

        assert!(get(addr, "/healthz").await.starts_with("HTTP/1.1 200"));
        assert!(get(addr, "/readyz").await.starts_with("HTTP/1.1 503"));
        health.set_ready(true);
        assert!(get(addr, "/readyz").await.starts_with("HTTP/1.1 200"));
        health.set_note(Some("standing by".into()));
        let standing_by = get(addr, "/readyz").await;
        assert!(standing_by.starts_with("HTTP/1.1 200"), "{standing_by}");
        assert!(standing_by.ends_with("ok: standing by\n"), "{standing_by}");
        let metrics = get(addr, "/metrics").await;
        assert!(metrics.contains("kmm_test_events_total 3"), "{metrics}");
        let started: i64 = metrics
            .lines()
            .find_map(|l| l.strip_prefix("process_start_time_seconds "))
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("no process_start_time_seconds in {metrics}"));
        assert!(started > 1_700_000_000, "{started}");
        assert!(get(addr, "/nothing").await.starts_with("HTTP/1.1 404"));

        stop.send(()).unwrap();
        server.await.unwrap();
    }

    #[tokio::test]
    async fn a_taken_address_is_named_in_the_error() {
        let taken = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = taken.local_addr().unwrap();
        let error = serve(addr, Registry::default(), Health::default(), async {})
            .await
            .unwrap_err();
        assert!(error.to_string().contains(&addr.to_string()), "{error}");
    }
}
