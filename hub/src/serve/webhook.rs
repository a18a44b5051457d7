//! The validating admission webhook's HTTPS endpoint. Every replica serves it, leader or
//! not: admission is stateless, and a create must not wait for a failover. It reads the
//! API only to look up the Placements a module newly names.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::future::Future;
use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode, header};
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use kmm_api::PlacementRef;
use kmm_api::ocm;
use kmm_runtime::serving::{self, ServingCertificate};
use kube::core::DynamicObject;
use kube::core::admission::{AdmissionRequest, AdmissionResponse, AdmissionReview};
use kube::{Api, Client};
use thiserror::Error;
use tokio::net::TcpListener;
use tokio_rustls::TlsAcceptor;

use super::metrics::Metrics;
use crate::admission::{Lookup, VALIDATE_PATH, placements_to_check, review};

/// The apiserver sends at most 3 MiB objects; a review wraps one or two of them.
const MAX_BODY: usize = 8 * 1024 * 1024;

#[derive(Debug, Error)]
pub enum WebhookError {
    #[error("the webhook's TLS settings are invalid: {0}")]
    Tls(#[from] serving::ServingError),
}

/// The TLS side of the webhook: HTTP/1.1 only, presenting `certificate` (renewed while the
/// hub runs) from each handshake on.
pub fn acceptor(certificate: Arc<ServingCertificate>) -> Result<TlsAcceptor, WebhookError> {
    let config = serving::server_config(certificate, None, &[b"http/1.1"])?;
    Ok(TlsAcceptor::from(config))
}

/// Serves admission reviews on `listener` until `shutdown` resolves; then open
/// connections end too, so a stopped hub never answers from a kept-alive connection.
pub async fn serve(
    listener: TcpListener,
    acceptor: TlsAcceptor,
    client: Client,
    metrics: Metrics,
    shutdown: impl Future<Output = ()>,
) {
    tokio::pin!(shutdown);
    let mut connections = tokio::task::JoinSet::new();
    loop {
        let stream = tokio::select! {
            () = &mut shutdown => return,
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(error) => {
                    tracing::warn!(%error, "webhook: accept failed");
                    continue;
                }
            },
        };
        // Reap finished connections so the set stays small.
        while connections.try_join_next().is_some() {}
        let acceptor = acceptor.clone();
        let metrics = metrics.clone();
        let client = client.clone();
        connections.spawn(async move {
            let stream = match acceptor.accept(stream).await {
                Ok(stream) => stream,
                Err(error) => {
                    tracing::debug!(%error, "webhook: TLS handshake failed");
                    return;
                }
            };
            let service = service_fn(move |request: Request<Incoming>| {
                let metrics = metrics.clone();
                let client = client.clone();
                async move { Ok::<_, Infallible>(handle(request, &client, &metrics).await) }
            });
            if let Err(error) = http1::Builder::new()
                .serve_connection(TokioIo::new(stream), service)
                .await
            {
                tracing::debug!(%error, "webhook: connection ended");
            }
        });
    }
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
