//! The proxy's own CA and serving certificate for node agents, kept in the Secret
//! `kmm-spoke-proxy-tls`, and the CA published in the ConfigMap `kmm-agent-ca` that the
//! agent DaemonSet mounts. The CA is created once and kept; the serving certificate is
//! issued from it at every start and again while running ([`keep_current`]): with a
//! third of its lifetime left, and at once when the Secret's CA is replaced or the
//! Secret deleted. Proxies starting together agree on one CA: whoever writes second
//! reads the first one's and issues from it.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt as _;
use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::{ConfigMap, Secret};
use kmm_runtime::pki::{CertificateAuthority, Leaf};
use kmm_runtime::serving::{ServingCertificate, renew_at};
use kube::api::{ObjectMeta, PostParams};
use kube::runtime::WatchStreamExt as _;
use kube::runtime::watcher::{self, Event};
use kube::{Api, Client};
use thiserror::Error;
use time::OffsetDateTime;
use tokio_util::sync::CancellationToken;
use zeroize::Zeroizing;

pub const SECRET_NAME: &str = "kmm-spoke-proxy-tls";
pub const CONFIG_MAP_NAME: &str = "kmm-agent-ca";
const CA_VALIDITY: Duration = Duration::from_secs(10 * 365 * 24 * 3600);
/// The serving certificate's default lifetime.
pub const SERVING_VALIDITY: Duration = Duration::from_secs(365 * 24 * 3600);
/// How often [`ensure`] starts over when another writer got there first.
const WRITE_ATTEMPTS: usize = 5;
/// How long [`keep_current`] waits after a failed re-issue before the next try.
const REISSUE_RETRY: Duration = Duration::from_secs(10);

#[derive(Debug, Error)]
pub enum AgentTlsError {
    #[error("{verb} {kind} {namespace}/{name}: {source}")]
    Api {
        verb: &'static str,
        kind: &'static str,
        namespace: String,
        name: &'static str,
        source: kube::Error,
    },
    #[error(
        "Secret {namespace}/{SECRET_NAME} holds an unusable CA (delete it to get a new one): {source}"
    )]
    BadCa {
        namespace: String,
        source: kmm_runtime::pki::Error,
    },
    #[error("cannot issue the serving certificate: {0}")]
    Issue(#[source] kmm_runtime::pki::Error),
    #[error("cannot serve the issued certificate: {0}")]
    Serving(#[source] kmm_runtime::serving::ServingError),
}

/// The serving certificate and key for the agent-facing server.
pub struct ServingIdentity {
    pub ca_pem: String,
    pub cert_pem: String,
    pub key_pem: Zeroizing<String>,
    pub not_after: OffsetDateTime,
}

impl std::fmt::Debug for ServingIdentity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServingIdentity").finish_non_exhaustive()
    }
}

/// The default SANs: localhost, 127.0.0.1 and the proxy's Service name.
pub fn default_sans(namespace: &str) -> Vec<String> {
    vec![
        "localhost".into(),
        "127.0.0.1".into(),
        format!("kmm-spoke-proxy.{namespace}.svc"),
    ]
}

fn text(data: &BTreeMap<String, ByteString>, key: &str) -> Option<String> {
    data.get(key)
        .and_then(|b| String::from_utf8(b.0.clone()).ok())
}

/// Loads or creates the CA, issues a serving certificate for `sans` valid for
/// `validity`, stores both in the Secret and publishes the CA certificate in the
/// ConfigMap. A write that loses to another proxy's (409) starts over from a fresh read.
pub async fn ensure(
    client: &Client,
    namespace: &str,
    sans: &[String],
    validity: Duration,
) -> Result<ServingIdentity, AgentTlsError> {
    let mut attempt = 1;
    loop {
        match ensure_once(client, namespace, sans, validity).await {
            Err(AgentTlsError::Api {
                source: kube::Error::Api(response),
                verb,
                kind,
                ..
            }) if response.code == 409 && attempt < WRITE_ATTEMPTS => {
                tracing::info!(
                    verb,
                    kind,
                    attempt,
                    "another writer got there first; reading again"
                );
                attempt += 1;
            }
            other => return other,
        }
    }
}

async fn ensure_once(
    client: &Client,
    namespace: &str,
    sans: &[String],
    validity: Duration,
) -> Result<ServingIdentity, AgentTlsError> {
    let api_error = |verb, kind, name, source| AgentTlsError::Api {
        verb,
        kind,
        namespace: namespace.to_owned(),
        name,
        source,
    };
    let secrets: Api<Secret> = Api::namespaced(client.clone(), namespace);
    let existing = secrets
        .get_opt(SECRET_NAME)
        .await
        .map_err(|e| api_error("get", "Secret", SECRET_NAME, e))?;
    let stored = existing
        .as_ref()
        .and_then(|s| s.data.as_ref())
        .and_then(|d| Some((text(d, "ca.crt")?, Zeroizing::new(text(d, "ca.key")?))));
    let ca = match &stored {
        Some((cert, key)) => {
            CertificateAuthority::from_pem(cert, key).map_err(|source| AgentTlsError::BadCa {
                namespace: namespace.to_owned(),
                source,
            })?
        }
        None => CertificateAuthority::generate("kmm-spoke-proxy-ca", CA_VALIDITY)
            .map_err(AgentTlsError::Issue)?,
    };
    let (ips, dns): (Vec<_>, Vec<_>) = sans.iter().partition(|s| s.parse::<IpAddr>().is_ok());
    let ips: Vec<IpAddr> = ips.iter().filter_map(|s| s.parse().ok()).collect();
    let dns: Vec<String> = dns.into_iter().cloned().collect();
    let leaf = Leaf::server("kmm-spoke-proxy", &dns, &ips, validity);
    let serving = ca.issue(&leaf).map_err(AgentTlsError::Issue)?;

    let data: BTreeMap<String, ByteString> = [
        ("ca.crt", ca.cert_pem().as_bytes().to_vec()),
        ("ca.key", ca.key_pem().as_bytes().to_vec()),
        ("tls.crt", serving.cert_pem.as_bytes().to_vec()),
        ("tls.key", serving.key_pem.as_bytes().to_vec()),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), ByteString(v)))
    .collect();
    match existing {
        Some(mut secret) => {
            secret.data = Some(data);
            secrets
                .replace(SECRET_NAME, &PostParams::default(), &secret)
                .await
                .map_err(|e| api_error("update", "Secret", SECRET_NAME, e))?;
        }
        None => {
            let secret = Secret {
                metadata: ObjectMeta {
                    name: Some(SECRET_NAME.into()),
                    namespace: Some(namespace.into()),
                    labels: Some(owned_labels()),
                    ..Default::default()
                },
                type_: Some("Opaque".into()),
                data: Some(data),
                ..Default::default()
            };
            secrets
                .create(&PostParams::default(), &secret)
                .await
                .map_err(|e| api_error("create", "Secret", SECRET_NAME, e))?;
        }
    }
    publish_ca(client, namespace, ca.cert_pem())
        .await
        .map_err(|(verb, e)| api_error(verb, "ConfigMap", CONFIG_MAP_NAME, e))?;
    Ok(ServingIdentity {
        ca_pem: ca.cert_pem().to_owned(),
        cert_pem: serving.cert_pem,
        key_pem: serving.key_pem,
        not_after: leaf.not_after,
    })
}

/// Keeps `serving` (the agent server's certificate, issued as `identity`) current until
/// `cancel`: re-issued with a third of its lifetime left, and at once when the Secret's
/// CA changes or the Secret goes (a new CA is then made and published), so agents that
/// trust the published CA keep connecting without a proxy restart.
pub async fn keep_current(
    client: Client,
    namespace: String,
    sans: Vec<String>,
    validity: Duration,
    serving: Arc<ServingCertificate>,
    mut identity: ServingIdentity,
    cancel: CancellationToken,
) {
    let secrets: Api<Secret> = Api::namespaced(client.clone(), &namespace);
    let config = watcher::Config::default().fields(&format!("metadata.name={SECRET_NAME}"));
    let mut events = watcher::watcher(secrets, config).default_backoff().boxed();
    let mut retry_at: Option<tokio::time::Instant> = None;
    loop {
        let renew = retry_at.unwrap_or_else(|| instant_of(renew_at(identity.not_after, validity)));
        let why = tokio::select! {
            () = cancel.cancelled() => return,
            () = tokio::time::sleep_until(renew) => Some("renewal"),
            event = events.next() => match event {
                Some(Ok(Event::Apply(secret) | Event::InitApply(secret))) => {
                    let stored = secret.data.as_ref().and_then(|d| text(d, "ca.crt"));
                    (stored.as_deref() != Some(identity.ca_pem.as_str())).then_some("the Secret's CA changed")
                }
                Some(Ok(Event::Delete(_))) => Some("the Secret was deleted"),
                Some(Ok(Event::Init | Event::InitDone)) => None,
                Some(Err(error)) => {
                    tracing::warn!(%error, "watching the serving Secret failed; retrying");
                    None
                }
                None => return,
            },
        };
        let Some(why) = why else { continue };
        let issued = match ensure(&client, &namespace, &sans, validity).await {
            Ok(next) => match serving.replace(&next.cert_pem, &next.key_pem) {
                Ok(()) => Ok(next),
                Err(error) => Err(AgentTlsError::Serving(error)),
            },
            Err(error) => Err(error),
        };
        match issued {
            Ok(next) => {
                tracing::info!(why, not_after = %next.not_after, "agent serving certificate re-issued");
                identity = next;
                retry_at = None;
            }
            Err(error) => {
                tracing::warn!(why, %error, "re-issuing the agent serving certificate failed; will retry");
                retry_at = Some(tokio::time::Instant::now() + REISSUE_RETRY);
            }
        }
    }
}

/// The monotonic instant of a wall-clock time (now, if it has passed).
fn instant_of(at: OffsetDateTime) -> tokio::time::Instant {
    let ahead = Duration::try_from(at - OffsetDateTime::now_utc()).unwrap_or_default();
    tokio::time::Instant::now() + ahead
}

fn owned_labels() -> BTreeMap<String, String> {
    [(
        "app.kubernetes.io/managed-by".to_string(),
        "kmm-spoke-proxy".to_string(),
    )]
    .into()
}

async fn publish_ca(
    client: &Client,
    namespace: &str,
    ca_pem: &str,
) -> Result<(), (&'static str, kube::Error)> {
    let maps: Api<ConfigMap> = Api::namespaced(client.clone(), namespace);
    let data: BTreeMap<String, String> = [("ca.crt".to_string(), ca_pem.to_string())].into();
    match maps
        .get_opt(CONFIG_MAP_NAME)
        .await
        .map_err(|e| ("get", e))?
    {
        Some(map)
            if map
                .data
                .as_ref()
                .and_then(|d| d.get("ca.crt"))
                .map(String::as_str)
                == Some(ca_pem) =>
        {
            Ok(())
        }
        // Only our key changes: whatever else someone keeps in the ConfigMap stays.
        Some(mut map) => {
            map.data
                .get_or_insert_default()
                .insert("ca.crt".into(), ca_pem.into());
            maps.replace(CONFIG_MAP_NAME, &PostParams::default(), &map)
                .await
                .map(drop)
                .map_err(|e| ("update", e))
        }
        None => {
            let map = ConfigMap {
                metadata: ObjectMeta {
                    name: Some(CONFIG_MAP_NAME.into()),
                    namespace: Some(namespace.into()),
                    labels: Some(owned_labels()),
                    ..Default::default()
                },
                data: Some(data),
                ..Default::default()
            };
            maps.create(&PostParams::default(), &map)
                .await
                .map(drop)
                .map_err(|e| ("create", e))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_sans_name_the_service() {
        assert_eq!(
            default_sans("kmm"),
            vec!["localhost", "127.0.0.1", "kmm-spoke-proxy.kmm.svc"]
        );
    }
}
