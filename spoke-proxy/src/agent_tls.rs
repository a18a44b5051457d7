//! The proxy's own CA and serving certificate for node agents, kept in the Secret
//! `kmm-spoke-proxy-tls`, and the CA published in the ConfigMap `kmm-agent-ca` that the
//! agent DaemonSet mounts. The CA is created once and kept; the serving certificate is
//! issued afresh from it at every start, so SAN changes and expiry are handled by a
//! restart.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::time::Duration;

use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::{ConfigMap, Secret};
use kmm_runtime::pki::{CertificateAuthority, Leaf};
use kube::api::{ObjectMeta, PostParams};
use kube::{Api, Client};
use thiserror::Error;
use zeroize::Zeroizing;

pub const SECRET_NAME: &str = "kmm-spoke-proxy-tls";
pub const CONFIG_MAP_NAME: &str = "kmm-agent-ca";
const CA_VALIDITY: Duration = Duration::from_secs(10 * 365 * 24 * 3600);
const SERVING_VALIDITY: Duration = Duration::from_secs(365 * 24 * 3600);

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
}

/// The serving certificate and key for the agent-facing server.
pub struct ServingIdentity {
    pub ca_pem: String,
    pub cert_pem: String,
    pub key_pem: Zeroizing<String>,
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

/// Loads or creates the CA, issues a serving certificate for `sans`, stores both in the
/// Secret and publishes the CA certificate in the ConfigMap.
pub async fn ensure(
    client: &Client,
    namespace: &str,
    sans: &[String],
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
    let serving = ca
        .issue(&Leaf::server(
            "kmm-spoke-proxy",
            &dns,
            &ips,
            SERVING_VALIDITY,
        ))
        .map_err(AgentTlsError::Issue)?;

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
    })
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
