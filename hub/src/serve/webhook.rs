//! The validating admission webhook's HTTPS endpoint. Every replica serves it, leader or
//! not: admission is stateless, and a create must not wait for a failover. It reads the
//! API only to look up the Placements a module newly names.

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode, header};
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use kmm_api::PlacementRef;
use kmm_api::ocm;
use kmm_runtime::http_server::{self, Endpoint, Limits};
use kmm_runtime::serving::{self, ServingCertificate};
use kube::core::DynamicObject;
use kube::core::admission::{AdmissionRequest, AdmissionResponse, AdmissionReview};
use kube::{Api, Client};
use rustls::ServerConfig;
use thiserror::Error;
use tokio::net::TcpListener;

use super::metrics::Metrics;
use crate::admission::{Lookup, VALIDATE_PATH, placements_to_check, review};

/// The apiserver sends at most 3 MiB objects; a review wraps one or two of them.
const MAX_BODY: usize = 8 * 1024 * 1024;

#[derive(Debug, Error)]
pub enum WebhookError {
    #[error("the webhook's TLS settings are invalid: {0}")]
    Tls(#[from] serving::ServingError),
}

/// The webhook's bounds. Its one real client is the API server, which gives up on a
/// review after the configuration's `timeoutSeconds` (10 s), so nothing may take longer;
/// `max_connections` × [`MAX_BODY`] bounds the bodies held at once (256 MiB, half the
/// hub's memory limit).
pub const LIMITS: Limits = Limits {
    max_connections: 32,
    handshake_timeout: Duration::from_secs(5),
    header_read_timeout: Duration::from_secs(5),
    request_timeout: Duration::from_secs(10),
};

/// Prefix of the webhook's connection metrics (`kmm_hub_webhook_connections_*`).
pub const METRICS_PREFIX: &str = "kmm_hub_webhook";

/// The TLS side of the webhook: HTTP/1.1 only, presenting `certificate` (renewed while the
/// hub runs) from each handshake on.
pub fn tls_config(certificate: Arc<ServingCertificate>) -> Result<Arc<ServerConfig>, WebhookError> {
    Ok(serving::server_config(certificate, None, &[b"http/1.1"])?)
}

/// Serves admission reviews on `listener` within `limits` until `shutdown` resolves; then
/// open connections end too, so a stopped hub never answers from a kept-alive connection.
pub async fn serve(
    listener: TcpListener,
    tls: Arc<ServerConfig>,
    limits: Limits,
    client: Client,
    metrics: Metrics,
    shutdown: impl Future<Output = ()>,
) {
    let endpoint = Endpoint {
        name: "webhook",
        tls: Some(tls),
        limits,
        metrics: metrics.webhook_connections.clone(),
    };
    let handler = move |request: Request<Incoming>| {
        let (client, metrics) = (client.clone(), metrics.clone());
        async move { handle(request, &client, &metrics).await }
    };
    http_server::serve(listener, endpoint, handler, shutdown).await;
}

async fn handle(
    request: Request<Incoming>,
    client: &Client,
    metrics: &Metrics,
) -> Response<Full<Bytes>> {
    if request.uri().path() != VALIDATE_PATH {
        return plain(StatusCode::NOT_FOUND, "not found\n");
    }
    if request.method() != Method::POST {
        return plain(StatusCode::METHOD_NOT_ALLOWED, "only POST\n");
    }
    let started = Instant::now();
    let body = match Limited::new(request.into_body(), MAX_BODY).collect().await {
        Ok(body) => body.to_bytes(),
        Err(error) => {
            return plain(
                StatusCode::BAD_REQUEST,
                &format!("cannot read the body: {error}\n"),
            );
        }
    };
    let admission: AdmissionRequest<DynamicObject> =
        match serde_json::from_slice::<AdmissionReview<DynamicObject>>(&body)
            .map_err(|e| e.to_string())
            .and_then(|r| {
                r.try_into()
                    .map_err(|e: kube::core::admission::ConvertAdmissionReviewError| e.to_string())
            }) {
            Ok(admission) => admission,
            Err(error) => {
                return plain(
                    StatusCode::BAD_REQUEST,
                    &format!("not an admission.k8s.io/v1 AdmissionReview: {error}\n"),
                );
            }
        };
    let placements = look_up(client, placements_to_check(&admission)).await;
    let response: AdmissionResponse = review(&admission, &placements);
    metrics.observe_admission(response.allowed, started.elapsed());
    if !response.allowed {
        tracing::info!(
            module = admission.name,
            user = admission.user_info.username.as_deref().unwrap_or_default(),
            operation = ?admission.operation,
            reason = response.result.message,
            "refused a ManagedClusterModule"
        );
    }
    match serde_json::to_vec(&response.into_review()) {
        Ok(json) => Response::builder()
            .header(header::CONTENT_TYPE, "application/json")
            .body(Full::new(Bytes::from(json)))
            .unwrap_or_else(|_| plain(StatusCode::INTERNAL_SERVER_ERROR, "encoding\n")),
        Err(error) => plain(
            StatusCode::INTERNAL_SERVER_ERROR,
            &format!("cannot encode the review: {error}\n"),
        ),
    }
}

async fn look_up(client: &Client, wanted: Vec<PlacementRef>) -> BTreeMap<PlacementRef, Lookup> {
    let resource = ocm::PLACEMENT.api_resource();
    let mut found = BTreeMap::new();
    for placement in wanted {
        let api: Api<DynamicObject> =
            Api::namespaced_with(client.clone(), &placement.namespace, &resource);
        let lookup = match api.get_opt(&placement.name).await {
            Ok(Some(_)) => Lookup::Exists,
            Ok(None) => Lookup::Missing,
            Err(error) => Lookup::Failed(error.to_string()),
        };
        found.insert(placement, lookup);
    }
    found
}

fn plain(status: StatusCode, text: &str) -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(Bytes::from(text.to_owned())));
    *response.status_mut() = status;
    response
}

#[cfg(test)]
mod tests {
    use std::net::SocketAddr;

    use kmm_api::testing::ModuleBuilder;
    use kmm_runtime::pki::{CertificateAuthority, Leaf};
    use rustls::RootCertStore;
    use rustls::crypto::ring::default_provider;
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, ServerName};
    use serde_json::json;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpStream;
    use tokio_rustls::TlsConnector;
    use tokio_util::sync::CancellationToken;

    use super::*;

    const DAY: Duration = Duration::from_secs(24 * 3600);
    const TEST_LIMITS: Limits = Limits {
        max_connections: 2,
        handshake_timeout: Duration::from_secs(2),
        header_read_timeout: Duration::from_secs(2),
        request_timeout: Duration::from_secs(5),
    };
    /// What a deadline may be overrun by on a busy machine.
    const SLACK: Duration = Duration::from_secs(2);

    /// A deletion's review: it needs no Placement looked up, so the API is never asked.
    fn deletion_review() -> String {
        let module = ModuleBuilder::new("kmm-hello").json();
        json!({
            "apiVersion": "admission.k8s.io/v1",
            "kind": "AdmissionReview",
            "request": {
                "uid": "3f0c1d2e-5b6a-4c7d-8e9f-0a1b2c3d4e5f",
                "kind": {"group": "hub.kmm.sigs.x-k8s.io", "version": "v1beta1", "kind": "ManagedClusterModule"},
                "resource": {"group": "hub.kmm.sigs.x-k8s.io", "version": "v1beta1", "resource": "managedclustermodules"},
                "name": "kmm-hello",
                "operation": "DELETE",
                "userInfo": {"username": "admin"},
                "oldObject": module,
            },
        })
        .to_string()
    }

    /// Posts `body` to the webhook over TLS; the whole response, or `None` when the
    /// connection is refused.
    async fn post(addr: SocketAddr, connector: &TlsConnector, body: &str) -> Option<String> {
        let tcp = TcpStream::connect(addr).await.ok()?;
        let name = ServerName::try_from("kmm-hub-webhook").unwrap();
        let mut tls = connector.connect(name, tcp).await.ok()?;
        let request = format!(
            "POST {VALIDATE_PATH} HTTP/1.1\r\nHost: kmm-hub-webhook\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        );
        tls.write_all(request.as_bytes()).await.ok()?;
        let mut response = Vec::new();
        let mut buffer = [0; 4096];
        while let Ok(n @ 1..) = tls.read(&mut buffer).await {
            response.extend_from_slice(&buffer[..n]);
        }
        (!response.is_empty()).then(|| String::from_utf8_lossy(&response).into_owned())
    }

    /// Whether `addr` closes a fresh connection that sends nothing within `within`.
    async fn closed_within(stream: &mut TcpStream, within: Duration) -> bool {
        let mut rest = Vec::new();
        tokio::time::timeout(within, stream.read_to_end(&mut rest))
            .await
            .is_ok()
    }

    #[tokio::test]
    async fn a_flood_of_idle_connections_holds_off_reviews_no_longer_than_the_handshake_timeout() {
        let ca = CertificateAuthority::generate("ca", DAY).unwrap();
        let leaf = ca
            .issue(&Leaf::server(
                "kmm-hub-webhook",
                &["kmm-hub-webhook".into()],
                &[],
                DAY,
            ))
            .unwrap();
        let certificate = ServingCertificate::new(&leaf.cert_pem, &leaf.key_pem).unwrap();
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (service, _api) = tower_test::mock::pair::<
            http::Request<kube::client::Body>,
            http::Response<kube::client::Body>,
        >();
        let metrics = Metrics::default();
        let connections = metrics.webhook_connections.clone();
        let stop = CancellationToken::new();
        tokio::spawn(serve(
            listener,
            tls_config(certificate).unwrap(),
            TEST_LIMITS,
            Client::new(service, "default"),
            metrics,
            stop.clone().cancelled_owned(),
        ));
        let mut roots = RootCertStore::empty();
        roots
            .add(CertificateDer::from_pem_slice(ca.cert_pem().as_bytes()).unwrap())
            .unwrap();
        let connector = TlsConnector::from(Arc::new(
            rustls::ClientConfig::builder_with_provider(Arc::new(default_provider()))
                .with_safe_default_protocol_versions()
                .unwrap()
                .with_root_certificates(roots)
                .with_no_client_auth(),
        ));

        // Any in-cluster client: connections that never say hello, as many as allowed.
        let flood_started = Instant::now();
        let mut flood = Vec::new();
        for _ in 0..TEST_LIMITS.max_connections {
            flood.push(TcpStream::connect(addr).await.unwrap());
        }
        let answered_by = TEST_LIMITS.handshake_timeout + SLACK;
        let full = async {
            while connections.open.get() < 2 {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        };
        tokio::time::timeout(SLACK, full)
            .await
            .expect("the flood holds every slot");

        // One more is closed at once, while the flood still holds every slot.
        let mut over = TcpStream::connect(addr).await.unwrap();
        assert!(closed_within(&mut over, TEST_LIMITS.handshake_timeout).await);
        assert_eq!(connections.refused.get(), 1);
        assert_eq!(connections.open.get(), 2);

        // The API server's review is answered once the flood's handshakes time out.
        let review = deletion_review();
        let answer = loop {
            assert!(flood_started.elapsed() < answered_by, "no answer in time");
            if let Some(answer) = post(addr, &connector, &review).await {
                break answer;
            }
            let freed = async {
                while connections.open.get() >= 2 {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            };
            let _ = tokio::time::timeout(answered_by, freed).await;
        };
        assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
        assert!(answer.contains(r#""allowed":true"#), "{answer}");
        assert!(
            answer.contains("3f0c1d2e-5b6a-4c7d-8e9f-0a1b2c3d4e5f"),
            "{answer}"
        );
        assert!(flood_started.elapsed() < answered_by);
        drop(flood);
        stop.cancel();
    }
}
