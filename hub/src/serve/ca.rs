//! The hub's certificate authority: Secret `kmm-hub-ca` in the hub's namespace, created on
//! first start and never overwritten (OCM's CustomSigner registration signs the proxies'
//! client certificates with it), and the gRPC serving certificate issued from it in memory.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::time::Duration;

use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::Secret;
use kmm_runtime::pki::{CertificateAuthority, IssuedCertificate, Leaf};
use kube::api::{ObjectMeta, PostParams};
use kube::{Api, Client};
use thiserror::Error;

/// Name of the CA Secret in the hub's namespace.
pub const CA_SECRET: &str = "kmm-hub-ca";
const CA_VALIDITY: Duration = Duration::from_secs(10 * 365 * 24 * 3600);
const SERVING_VALIDITY: Duration = Duration::from_secs(365 * 24 * 3600);

#[derive(Debug, Error)]
pub enum CaError {
    #[error("reading or creating Secret {namespace}/{CA_SECRET}: {source}")]
    Api {
        namespace: String,
        source: kube::Error,
    },
    #[error("Secret {namespace}/{CA_SECRET} has no {key} (it must be a kubernetes.io/tls Secret)")]
    MissingKey {
        namespace: String,
        key: &'static str,
    },
    #[error("Secret {namespace}/{CA_SECRET} does not hold a usable CA: {source}")]
    Invalid {
        namespace: String,
        source: kmm_runtime::pki::Error,
    },
    #[error("cannot issue the hub's serving certificate: {0}")]
    Issue(kmm_runtime::pki::Error),
}

/// Reads the CA Secret, creating it when absent. When two hubs start at once, the create
/// of one fails with AlreadyExists and it reads the other's: neither overwrites.
pub async fn load_or_create(
    client: &Client,
    namespace: &str,
) -> Result<CertificateAuthority, CaError> {
    let api: Api<Secret> = Api::namespaced(client.clone(), namespace);
    let api_error = |source| CaError::Api {
        namespace: namespace.to_owned(),
        source,
    };
    if let Some(secret) = api.get_opt(CA_SECRET).await.map_err(api_error)? {
        return from_secret(&secret, namespace);
    }
    let ca = CertificateAuthority::generate("kmm-hub-ca", CA_VALIDITY).map_err(|source| {
        CaError::Invalid {
            namespace: namespace.to_owned(),
            source,
        }
    })?;
    let secret = Secret {
        metadata: ObjectMeta {
            name: Some(CA_SECRET.to_owned()),
            namespace: Some(namespace.to_owned()),
            labels: Some(BTreeMap::from([(
                "app.kubernetes.io/name".to_owned(),
                "kmm-hub".to_owned(),
            )])),
            ..ObjectMeta::default()
        },
        type_: Some("kubernetes.io/tls".to_owned()),
        data: Some(BTreeMap::from([
            (
                "tls.crt".to_owned(),
                ByteString(ca.cert_pem().as_bytes().to_vec()),
            ),
            (
                "tls.key".to_owned(),
                ByteString(ca.key_pem().as_bytes().to_vec()),
            ),
        ])),
        ..Secret::default()
    };
    match api.create(&PostParams::default(), &secret).await {
        Ok(_) => {
            tracing::info!(namespace, secret = CA_SECRET, "created the hub CA");
            Ok(ca)
        }
        Err(kube::Error::Api(status)) if status.code == 409 => {
            let secret = api.get(CA_SECRET).await.map_err(api_error)?;
            from_secret(&secret, namespace)
        }
        Err(e) => Err(api_error(e)),
    }
}

fn from_secret(secret: &Secret, namespace: &str) -> Result<CertificateAuthority, CaError> {
    let key = |key: &'static str| {
        secret
            .data
            .as_ref()
            .and_then(|d| d.get(key))
            .and_then(|v| std::str::from_utf8(&v.0).ok())
            .ok_or_else(|| CaError::MissingKey {
                namespace: namespace.to_owned(),
                key,
            })
    };
    CertificateAuthority::from_pem(key("tls.crt")?, key("tls.key")?).map_err(|source| {
        CaError::Invalid {
            namespace: namespace.to_owned(),
            source,
        }
    })
}

/// A serving certificate of the hub named `common_name` for `sans` (DNS names and IP
/// addresses alike): the gRPC endpoint's and the admission webhook's.
pub fn serving_certificate(
    ca: &CertificateAuthority,
    common_name: &str,
    sans: &[String],
) -> Result<IssuedCertificate, CaError> {
    let (ips, dns): (Vec<_>, Vec<_>) = sans.iter().partition(|s| s.parse::<IpAddr>().is_ok());
    let ips: Vec<IpAddr> = ips.iter().filter_map(|s| s.parse().ok()).collect();
    let dns: Vec<String> = dns.into_iter().cloned().collect();
    ca.issue(&Leaf::server(common_name, &dns, &ips, SERVING_VALIDITY))
        .map_err(CaError::Issue)
}
