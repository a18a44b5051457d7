//! The hub's certificate authority: Secret `kmm-hub-ca` in the hub's namespace, created on
//! first start and never overwritten (OCM's CustomSigner registration signs the proxies'
//! client certificates with it), and the serving certificates (gRPC, admission webhook)
//! issued from it in memory and re-issued while the hub runs, with a third of their
//! lifetime left. OCM's addon-manager signs only with an RSA key, so a CA with another key
//! is refused.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::Secret;
use kmm_runtime::pki::{CertificateAuthority, Leaf};
use kmm_runtime::serving::{ServingCertificate, ServingError, renew_at};
use kube::api::{ObjectMeta, PostParams};
use kube::{Api, Client};
use prometheus_client::metrics::gauge::Gauge;
use thiserror::Error;
use time::OffsetDateTime;
use tokio_util::sync::CancellationToken;
use x509_parser::pem::parse_x509_pem;

/// Name of the CA Secret in the hub's namespace.
pub const CA_SECRET: &str = "kmm-hub-ca";
const CA_VALIDITY: Duration = Duration::from_secs(10 * 365 * 24 * 3600);
/// The serving certificates' default lifetime.
pub const SERVING_VALIDITY: Duration = Duration::from_secs(365 * 24 * 3600);
/// How long a failed renewal waits before the next try.
const RENEWAL_RETRY: Duration = Duration::from_secs(30);

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
    #[error(
        "Secret {namespace}/{CA_SECRET} holds a CA whose key is not RSA, and OCM's \
         addon-manager can sign the proxies' certificates only with an RSA key: delete the \
         Secret (kubectl -n {namespace} delete secret {CA_SECRET}) and restart the hub, which \
         then creates a new RSA CA"
    )]
    NotRsa { namespace: String },
    #[error("cannot issue the hub's serving certificate: {0}")]
    Issue(kmm_runtime::pki::Error),
    #[error("cannot serve the hub's certificate: {0}")]
    Serving(#[from] ServingError),
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
    let secret = ca_secret(&ca, namespace);
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

/// NotAfter of the CA's certificate, in Unix seconds; `None` for a PEM that does not parse
/// (the CA was read from it, so this does not happen).
pub fn ca_not_after(ca: &CertificateAuthority) -> Option<i64> {
    let (_, pem) = parse_x509_pem(ca.cert_pem().as_bytes()).ok()?;
    let cert = pem.parse_x509().ok()?;
    Some(cert.validity().not_after.timestamp())
}

/// The `kubernetes.io/tls` Secret holding `ca`, as OCM's CustomSigner reads it.
fn ca_secret(ca: &CertificateAuthority, namespace: &str) -> Secret {
    Secret {
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
    let ca =
        CertificateAuthority::from_pem(key("tls.crt")?, key("tls.key")?).map_err(|source| {
            CaError::Invalid {
                namespace: namespace.to_owned(),
                source,
            }
        })?;
    if !ca.is_rsa() {
        return Err(CaError::NotRsa {
            namespace: namespace.to_owned(),
        });
    }
    Ok(ca)
}

/// A serving certificate of the hub named `common_name` for `sans` (DNS names and IP
/// addresses alike): the gRPC endpoint's or the admission webhook's. Its
/// [`RenewingCertificate::certificate`] goes into the listener's TLS configuration;
/// [`RenewingCertificate::keep_renewed`] keeps it valid.
pub struct RenewingCertificate {
    pub certificate: Arc<ServingCertificate>,
    common_name: &'static str,
    sans: Vec<String>,
    validity: Duration,
    not_after: OffsetDateTime,
    /// Follows `not_after`, for the expiry alert.
    expiry: Gauge,
}

impl std::fmt::Debug for RenewingCertificate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RenewingCertificate")
            .field("common_name", &self.common_name)
            .field("not_after", &self.not_after)
            .finish_non_exhaustive()
    }
}

impl RenewingCertificate {
    pub fn issue(
        ca: &CertificateAuthority,
        common_name: &'static str,
        sans: &[String],
        validity: Duration,
        expiry: Gauge,
    ) -> Result<Self, CaError> {
        let leaf = serving_leaf(common_name, sans, validity);
        let issued = ca.issue(&leaf).map_err(CaError::Issue)?;
        expiry.set(leaf.not_after.unix_timestamp());
        Ok(Self {
            certificate: ServingCertificate::new(&issued.cert_pem, &issued.key_pem)?,
            common_name,
            sans: sans.to_vec(),
            validity,
            not_after: leaf.not_after,
            expiry,
        })
    }

    /// Re-issues the certificate with a third of its lifetime left, from the CA as its
    /// Secret holds it then, until `stop`. A failed renewal is logged and retried; the
    /// current certificate stays served meanwhile.
    pub async fn keep_renewed(
        mut self,
        client: Client,
        namespace: String,
        stop: CancellationToken,
    ) {
        let secrets: Api<Secret> = Api::namespaced(client, &namespace);
        let mut at = renew_at(self.not_after, self.validity);
        loop {
            let wait = Duration::try_from(at - OffsetDateTime::now_utc()).unwrap_or_default();
            tokio::select! {
                () = stop.cancelled() => return,
                () = tokio::time::sleep(wait) => {}
            }
            match self.renew(&secrets, &namespace).await {
                Ok(()) => {
                    tracing::info!(
                        certificate = self.common_name,
                        not_after = %self.not_after,
                        "serving certificate renewed"
                    );
                    at = renew_at(self.not_after, self.validity);
                }
                Err(error) => {
                    tracing::warn!(certificate = self.common_name, %error, "renewing the serving certificate failed; will retry");
                    at = OffsetDateTime::now_utc() + RENEWAL_RETRY;
                }
            }
        }
    }

    async fn renew(&mut self, secrets: &Api<Secret>, namespace: &str) -> Result<(), CaError> {
        let secret = secrets
            .get(CA_SECRET)
            .await
            .map_err(|source| CaError::Api {
                namespace: namespace.to_owned(),
                source,
            })?;
        let ca = from_secret(&secret, namespace)?;
        let leaf = serving_leaf(self.common_name, &self.sans, self.validity);
        let issued = ca.issue(&leaf).map_err(CaError::Issue)?;
        self.certificate
            .replace(&issued.cert_pem, &issued.key_pem)?;
        self.not_after = leaf.not_after;
        self.expiry.set(self.not_after.unix_timestamp());
        Ok(())
    }
}

fn serving_leaf(common_name: &str, sans: &[String], validity: Duration) -> Leaf {
    let (ips, dns): (Vec<_>, Vec<_>) = sans.iter().partition(|s| s.parse::<IpAddr>().is_ok());
    let ips: Vec<IpAddr> = ips.iter().filter_map(|s| s.parse().ok()).collect();
    let dns: Vec<String> = dns.into_iter().cloned().collect();
    Leaf::server(common_name, &dns, &ips, validity)
}

#[cfg(test)]
mod tests {
    use rcgen::{BasicConstraints, CertificateParams, IsCa, KeyPair};

    use super::*;

    const DAY: Duration = Duration::from_secs(24 * 3600);

    #[test]
    fn a_secret_written_by_the_hub_reads_back_as_an_rsa_ca() {
        let ca = CertificateAuthority::generate("kmm-hub-ca", DAY).unwrap();
        let secret = ca_secret(&ca, "kmm-hub");
        assert_eq!(secret.type_.as_deref(), Some("kubernetes.io/tls"));
        let read = from_secret(&secret, "kmm-hub").unwrap();
        assert!(read.is_rsa());
        assert_eq!(read.cert_pem(), ca.cert_pem());
        let now = OffsetDateTime::now_utc().unix_timestamp();
        let ca_expiry = ca_not_after(&read).unwrap();
        assert!((ca_expiry - now - 86_400).abs() < 120, "{ca_expiry}");
        let expiry = Gauge::default();
        RenewingCertificate::issue(
            &read,
            "kmm-hub",
            &["localhost".into(), "127.0.0.1".into()],
            SERVING_VALIDITY,
            expiry.clone(),
        )
        .unwrap();
        let serving = i64::try_from(SERVING_VALIDITY.as_secs()).unwrap();
        assert!(
            (expiry.get() - now - serving).abs() < 120,
            "{}",
            expiry.get()
        );
    }

    #[test]
    fn an_ec_ca_secret_is_refused_telling_to_delete_it() {
        // A CA as hubs before the RSA requirement created it.
        let key = KeyPair::generate().unwrap();
        let mut params = CertificateParams::default();
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        let cert = params.self_signed(&key).unwrap();
        let ec = CertificateAuthority::from_pem(&cert.pem(), &key.serialize_pem()).unwrap();
        let error = from_secret(&ca_secret(&ec, "hub-ns"), "hub-ns").unwrap_err();
        assert!(matches!(error, CaError::NotRsa { .. }), "{error:?}");
        let message = error.to_string();
        assert!(message.contains("Secret hub-ns/kmm-hub-ca"), "{message}");
        assert!(message.contains("not RSA"), "{message}");
        assert!(
            message.contains("kubectl -n hub-ns delete secret kmm-hub-ca"),
            "{message}"
        );
    }

    #[test]
    fn a_secret_without_the_key_names_it() {
        let ca = CertificateAuthority::generate("kmm-hub-ca", DAY).unwrap();
        let mut secret = ca_secret(&ca, "kmm-hub");
        secret.data.as_mut().unwrap().remove("tls.key");
        let error = from_secret(&secret, "kmm-hub").unwrap_err();
        assert!(error.to_string().contains("has no tls.key"), "{error}");
    }
}
