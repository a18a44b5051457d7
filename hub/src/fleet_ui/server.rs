//! The fleet UI's HTTP server: every replica serves it (a standby says what it is), on
//! the bounded accept loop the hub's other endpoints use. Pages are built and rendered
//! on the blocking pool: at 3,500 clusters a page takes milliseconds of CPU.

use std::convert::Infallible;
use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures::StreamExt;
use http::{HeaderValue, Method, Request, Response, StatusCode, header};
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::{Frame, Incoming};
use kmm_runtime::http_server::{self, ConnectionMetrics, Endpoint, Limits};
use tokio::net::TcpListener;

use crate::serve::fleet_view::FleetView;

use super::cluster_page::cluster_page;
use super::fleet_page::fleet_page;
use super::live::Live;
use super::module_page::module_page;
use super::node_page::node_page;
use super::render::{self, Chrome, StandbyPage};
use super::replica::{Replica, Role, holder_pod};
use super::routes::{Asset, Route, RouteError, route};

/// Prefix of the UI's connection metrics.
pub const METRICS_PREFIX: &str = "kmm_hub_ui";

/// A few people looking at a few pages each, every live page holding its event stream.
pub const LIMITS: Limits = Limits {
    max_connections: 64,
    handshake_timeout: Duration::from_secs(5),
    header_read_timeout: Duration::from_secs(10),
    request_timeout: Duration::from_secs(10),
};

/// How long one event stream lasts: the browser opens a new one at once (the `retry`
/// it is sent), so that no connection is held for ever.
pub const EVENTS_LIFETIME: Duration = Duration::from_secs(300);

/// Pages load only what the hub serves: no inline script, no other origin.
const CONTENT_SECURITY_POLICY: &str = "default-src 'none'; style-src 'self'; \
    script-src 'self'; connect-src 'self'; img-src 'self'; form-action 'self'; \
    frame-ancestors 'none'; base-uri 'none'";

pub type UiBody = UnsyncBoxBody<Bytes, Infallible>;

/// Serves the UI on `listener` until `shutdown` resolves.
pub async fn serve(
    listener: TcpListener,
    replica: Replica,
    metrics: ConnectionMetrics,
    shutdown: impl Future<Output = ()>,
) {
    let endpoint = Endpoint {
        name: "fleet-ui",
        tls: None,
        limits: LIMITS,
        metrics,
    };
    let port = listener.local_addr().map_or(0, |addr| addr.port());
    let replica = Arc::new(replica);
    let handler = move |request: Request<Incoming>| {
        let replica = replica.clone();
        async move { answer(&replica, port, &request).await }
    };
    http_server::serve(listener, endpoint, handler, shutdown).await;
}

/// What the server answers a request with, before it is a response.
#[derive(Debug, PartialEq, Eq)]
pub enum Answer {
    /// An HTML page, with its status.
    Page(StatusCode, String),
    Asset(Asset),
    /// The event stream of live pages.
    Events,
}

async fn answer(replica: &Replica, port: u16, request: &Request<Incoming>) -> Response<UiBody> {
    if request.method() != Method::GET && request.method() != Method::HEAD {
        return plain(StatusCode::METHOD_NOT_ALLOWED, "GET only\n");
    }
    if !local_host(request.headers().get(header::HOST)) {
        return plain(
            StatusCode::MISDIRECTED_REQUEST,
            "the fleet view answers only to localhost or an IP address (kubectl port-forward)\n",
        );
    }
    let uri = request.uri();
    let route = route(uri.path(), uri.query());
    let role = replica.role.borrow().clone();
    let chrome = Chrome {
        instance: replica.instance.clone(),
        note: None,
    };
    let answer = match (route, role) {
        (Ok(Route::Events), _) => Answer::Events,
        (Ok(Route::Asset(asset)), _) => Answer::Asset(asset),
        (Err(error), _) => problem(&chrome, &error),
        (Ok(_), Role::Standby) => standby(replica, port, &chrome).await,
        (route, Role::Leading(view)) => {
            match tokio::task::spawn_blocking(move || leader_answer(&view, &chrome, route)).await {
                Ok(answer) => answer,
                Err(error) => {
                    tracing::error!(%error, "building a fleet UI page failed");
                    Answer::Page(StatusCode::INTERNAL_SERVER_ERROR, String::new())
                }
            }
        }
    };
    respond(answer, replica)
}

/// Whether the request names the UI by an address a DNS rebinding cannot forge: the UI
/// is reached through port-forward, and a page of another site must not read it.
fn local_host(host: Option<&HeaderValue>) -> bool {
    let Some(host) = host.and_then(|h| h.to_str().ok()) else {
        return false;
    };
    let name = match host.rsplit_once(':') {
        Some((name, port)) if port.bytes().all(|b| b.is_ascii_digit()) => name,
        _ => host,
    };
    let name = name.trim_start_matches('[').trim_end_matches(']');
    name.eq_ignore_ascii_case("localhost") || name.parse::<IpAddr>().is_ok()
}

/// The leader's answer to a routed request. Rendering fails only on a template's own
/// error.
pub fn leader_answer(
    view: &FleetView,
    chrome: &Chrome,
    route: Result<Route, RouteError>,
) -> Answer {
    let route = match route {
        Ok(route) => route,
        Err(error) => return problem(chrome, &error),
    };
    let mut chrome = chrome.clone();
    if !view.is_synced() {
        chrome.note =
            Some("The hub is still listing its watches: what follows may be incomplete.".into());
    }
    let rendered = match route {
        Route::Fleet => Some(render::fleet(&chrome, &fleet_page(view))),
        Route::Module { name, filter } => view
            .known_module(&name)
            .map(|module| render::module(&chrome, &module_page(view, &module, filter))),
        Route::Cluster { name, filter } => {
            cluster_page(view, &name, filter).map(|page| render::cluster(&chrome, &page))
        }
        Route::Node { cluster, node } => {
            node_page(view, &cluster, &node).map(|page| render::node(&chrome, &page))
        }
        Route::Events => return Answer::Events,
        Route::Asset(asset) => return Answer::Asset(asset),
    };
    match rendered {
        Some(Ok(html)) => Answer::Page(StatusCode::OK, html),
        Some(Err(error)) => {
            tracing::error!(%error, "rendering a fleet UI page failed");
            Answer::Page(StatusCode::INTERNAL_SERVER_ERROR, String::new())
        }
        None => problem(&chrome, &RouteError::NotFound),
    }
}

fn problem(chrome: &Chrome, error: &RouteError) -> Answer {
    let (status, title) = match error {
        RouteError::NotFound => (StatusCode::NOT_FOUND, "Not found"),
        RouteError::BadName(_) | RouteError::BadQuery(_) => {
            (StatusCode::BAD_REQUEST, "Bad request")
        }
    };
    let detail = match error {
        RouteError::NotFound => "This hub knows no such page, module, cluster or node.".to_owned(),
        other => other.to_string(),
    };
    Answer::Page(
        status,
        render::problem(chrome, title, &detail).unwrap_or_default(),
    )
}

async fn standby(replica: &Replica, port: u16, chrome: &Chrome) -> Answer {
    let Some(lease) = &replica.lease else {
        // Without an election this replica leads as soon as it has started.
        return Answer::Page(
            StatusCode::SERVICE_UNAVAILABLE,
            render::problem(
                chrome,
                "Starting",
                "The hub is starting; try again in a moment.",
            )
            .unwrap_or_default(),
        );
    };
    let (leader, lookup_error) = match lease.holder().await {
        Ok(holder) => (holder.map(|h| holder_pod(&h).to_owned()), None),
        Err(error) => (None, Some(error.to_string())),
    };
    let page = StandbyPage {
        lease: format!("{}/{}", lease.namespace, lease.name),
        namespace: lease.namespace.clone(),
        leader,
        port,
        lookup_error,
    };
    match render::standby(chrome, &page) {
        Ok(html) => Answer::Page(StatusCode::OK, html),
        Err(error) => {
            tracing::error!(%error, "rendering the standby page failed");
            Answer::Page(StatusCode::INTERNAL_SERVER_ERROR, String::new())
        }
    }
}

fn respond(answer: Answer, replica: &Replica) -> Response<UiBody> {
    match answer {
        Answer::Page(status, html) => {
            let mut response = Response::new(full(html));
            *response.status_mut() = status;
            let headers = response.headers_mut();
            headers.insert(
                header::CONTENT_TYPE,
                HeaderValue::from_static("text/html; charset=utf-8"),
            );
            headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
            headers.insert(
                header::CONTENT_SECURITY_POLICY,
                HeaderValue::from_static(CONTENT_SECURITY_POLICY),
            );
            headers.insert(
                header::X_CONTENT_TYPE_OPTIONS,
                HeaderValue::from_static("nosniff"),
            );
            headers.insert(
                header::REFERRER_POLICY,
                HeaderValue::from_static("no-referrer"),
            );
            response
        }
        Answer::Asset(asset) => {
            let mut response = Response::new(full(asset.body()));
            let headers = response.headers_mut();
            headers.insert(
                header::CONTENT_TYPE,
                HeaderValue::from_static(asset.content_type()),
            );
            headers.insert(
                header::X_CONTENT_TYPE_OPTIONS,
                HeaderValue::from_static("nosniff"),
            );
            response
        }
        Answer::Events => {
            let mut response = Response::new(events(Live::new(replica.role.clone())));
            let headers = response.headers_mut();
            headers.insert(
                header::CONTENT_TYPE,
                HeaderValue::from_static("text/event-stream"),
            );
            headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
            response
        }
    }
}

fn full(body: impl Into<Bytes>) -> UiBody {
    Full::new(body.into()).boxed_unsync()
}

fn plain(status: StatusCode, text: &'static str) -> Response<UiBody> {
    let mut response = Response::new(full(text));
    *response.status_mut() = status;
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    response
}

/// The event stream: the reconnection delay, an event at once (what changed while the
/// page had no stream is then fetched), then one per coalesced change, for
/// [`EVENTS_LIFETIME`].
fn events(live: Live) -> UiBody {
    const CHANGED: &[u8] = b"event: changed\ndata:\n\n";
    let first = futures::stream::iter([
        Bytes::from_static(b"retry: 1000\n\n"),
        Bytes::from_static(CHANGED),
    ]);
    let changes = futures::stream::unfold(live, |mut live| async move {
        live.next()
            .await
            .then(|| (Bytes::from_static(CHANGED), live))
    });
    let until = tokio::time::sleep(EVENTS_LIFETIME);
    let stream = first
        .chain(changes)
        .take_until(until)
        .map(|bytes| Ok::<_, Infallible>(Frame::data(bytes)));
    BodyExt::boxed_unsync(StreamBody::new(stream))
}

#[cfg(test)]
mod tests {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpStream;
    use tokio::sync::watch;
    use tokio_util::sync::CancellationToken;

    use super::*;

    /// Sends `request` to `addr` and reads until the answer holds `until` (or ends).
    async fn exchange(addr: std::net::SocketAddr, request: &str, until: &str) -> String {
        let mut stream = TcpStream::connect(addr).await.unwrap();
        stream.write_all(request.as_bytes()).await.unwrap();
        let mut answer = Vec::new();
        let mut buffer = [0; 4096];
        while !String::from_utf8_lossy(&answer).contains(until) {
            let n = tokio::time::timeout(Duration::from_secs(10), stream.read(&mut buffer))
                .await
                .expect("the server answers")
                .unwrap();
            if n == 0 {
                break;
            }
            answer.extend_from_slice(&buffer[..n]);
        }
        String::from_utf8_lossy(&answer).into_owned()
    }

    #[tokio::test]
    async fn a_standby_without_election_says_it_starts_and_live_pages_get_events() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (_role, role) = watch::channel(Role::Standby);
        let replica = Replica {
            instance: "kmm-hub-0".into(),
            role,
            lease: None,
        };
        let stop = CancellationToken::new();
        let server = tokio::spawn(serve(
            listener,
            replica,
            ConnectionMetrics::default(),
            stop.clone().cancelled_owned(),
        ));

        let page = exchange(
            addr,
            "GET / HTTP/1.1\r\nHost: localhost:8090\r\nConnection: close\r\n\r\n",
            "</html>",
        )
        .await;
        assert!(page.starts_with("HTTP/1.1 503"), "{page}");
        assert!(
            page.contains("content-security-policy: default-src 'none'"),
            "{page}"
        );
        assert!(page.contains("The hub is starting"), "{page}");

        let css = exchange(
            addr,
            "GET /assets/fleet.css HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n",
            "form.filter",
        )
        .await;
        assert!(css.starts_with("HTTP/1.1 200"), "{css}");
        assert!(css.contains("content-type: text/css"), "{css}");

        let events = exchange(
            addr,
            "GET /events HTTP/1.1\r\nHost: localhost\r\n\r\n",
            "event: changed",
        )
        .await;
        assert!(
            events.contains("content-type: text/event-stream"),
            "{events}"
        );
        assert!(events.contains("retry: 1000"), "{events}");

        let rebound = exchange(
            addr,
            "GET / HTTP/1.1\r\nHost: evil.example\r\nConnection: close\r\n\r\n",
            "port-forward",
        )
        .await;
        assert!(rebound.starts_with("HTTP/1.1 421"), "{rebound}");

        let posted = exchange(
            addr,
            "POST / HTTP/1.1\r\nHost: localhost\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
            "GET only",
        )
        .await;
        assert!(posted.starts_with("HTTP/1.1 405"), "{posted}");
        stop.cancel();
        server.await.unwrap();
    }

    #[test]
    fn only_localhost_and_addresses_are_answered() {
        let host = |h: &'static str| Some(HeaderValue::from_static(h));
        assert!(local_host(host("localhost:8090").as_ref()));
        assert!(local_host(host("127.0.0.1:8090").as_ref()));
        assert!(local_host(host("[::1]:8090").as_ref()));
        assert!(local_host(host("10.0.0.7").as_ref()));
        assert!(!local_host(host("evil.example:8090").as_ref()));
        assert!(!local_host(host("localhost.evil.example").as_ref()));
        assert!(!local_host(None));
    }
}
