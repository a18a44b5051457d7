//! Serving certificates that change while the server runs. A listener's TLS
//! configuration resolves its certificate through [`ServingCertificate`] at every
//! handshake, so a renewed (or re-issued) certificate is served from the next
//! connection on, without a restart and without dropping open connections. [`incoming`]
//! turns a TCP listener into the TLS streams tonic's and hyper's servers take; tonic
//! still sees the client's certificates (`Request::peer_certs`).

use std::fmt;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use rustls::crypto::ring::default_provider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::{ClientHello, ResolvesServerCert, WebPkiClientVerifier};
use rustls::sign::CertifiedKey;
use rustls::{RootCertStore, ServerConfig};
use thiserror::Error;
use time::OffsetDateTime;
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::TlsAcceptor;
use tokio_rustls::server::TlsStream;
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;

/// How long a client gets to finish its handshake; a stalled one never holds up others.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// Handshaken connections waiting for the server to take them.
const ACCEPTED_BACKLOG: usize = 64;

#[derive(Debug, Error)]
pub enum ServingError {
    #[error("the serving certificate: {0}")]
    Certificate(String),
    #[error("the serving key: {0}")]
    Key(String),
    #[error("the client CA: {0}")]
    ClientCa(String),
    #[error(transparent)]
    Tls(#[from] rustls::Error),
}

/// The certificate a server presents now; [`ServingCertificate::replace`] swaps it.
pub struct ServingCertificate {
    current: RwLock<Arc<CertifiedKey>>,
}

impl fmt::Debug for ServingCertificate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ServingCertificate").finish_non_exhaustive()
    }
}

impl ServingCertificate {
    pub fn new(cert_pem: &str, key_pem: &str) -> Result<Arc<Self>, ServingError> {
        Ok(Arc::new(Self {
            current: RwLock::new(certified_key(cert_pem, key_pem)?),
        }))
    }

    /// Serves `cert_pem` from the next handshake on; a bad pair leaves the current one.
    pub fn replace(&self, cert_pem: &str, key_pem: &str) -> Result<(), ServingError> {
        let next = certified_key(cert_pem, key_pem)?;
        *self
            .current
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = next;
        Ok(())
    }

    /// The leaf certificate served now (DER).
    pub fn current_der(&self) -> Vec<u8> {
        self.current
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .cert
            .first()
            .map(|c| c.to_vec())
            .unwrap_or_default()
    }
}

impl ResolvesServerCert for ServingCertificate {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(
            self.current
                .read()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .clone(),
        )
    }
}

fn certified_key(cert_pem: &str, key_pem: &str) -> Result<Arc<CertifiedKey>, ServingError> {
    let chain = CertificateDer::pem_slice_iter(cert_pem.as_bytes())
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| ServingError::Certificate(e.to_string()))?;
    if chain.is_empty() {
        return Err(ServingError::Certificate("no PEM certificate".into()));
    }
    let key = PrivateKeyDer::from_pem_slice(key_pem.as_bytes())
        .map_err(|e| ServingError::Key(e.to_string()))?;
    let key = default_provider()
        .key_provider
        .load_private_key(key)
        .map_err(|e| ServingError::Key(e.to_string()))?;
    let certified = CertifiedKey::new(chain, key);
    certified
        .keys_match()
        .map_err(|e| ServingError::Key(format!("does not belong to the certificate: {e}")))?;
    Ok(Arc::new(certified))
}

/// A server configuration presenting `certificate`, offering `alpn` (e.g. `h2` for
/// gRPC), and, with `client_ca_pem`, requiring a client certificate that CA issued.
pub fn server_config(
    certificate: Arc<ServingCertificate>,
    client_ca_pem: Option<&str>,
    alpn: &[&[u8]],
) -> Result<Arc<ServerConfig>, ServingError> {
    let provider = Arc::new(default_provider());
    let builder = ServerConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()?;
    let builder = match client_ca_pem {
        Some(pem) => {
            let mut roots = RootCertStore::empty();
            for cert in CertificateDer::pem_slice_iter(pem.as_bytes()) {
                let cert = cert.map_err(|e| ServingError::ClientCa(e.to_string()))?;
                roots
                    .add(cert)
                    .map_err(|e| ServingError::ClientCa(e.to_string()))?;
            }
            let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider)
                .build()
                .map_err(|e| ServingError::ClientCa(e.to_string()))?;
            builder.with_client_cert_verifier(verifier)
        }
        None => builder.with_no_client_auth(),
    };
    let mut config = builder.with_cert_resolver(certificate);
    config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    Ok(Arc::new(config))
}

/// The TLS connections of `listener`, handshaken concurrently (each within
/// [`HANDSHAKE_TIMEOUT`]; failed handshakes are logged and dropped), until `cancel`.
pub fn incoming(
    listener: TcpListener,
    config: Arc<ServerConfig>,
    cancel: CancellationToken,
) -> ReceiverStream<Result<TlsStream<TcpStream>, std::io::Error>> {
    let (tx, rx) = tokio::sync::mpsc::channel(ACCEPTED_BACKLOG);
    let acceptor = TlsAcceptor::from(config);
    tokio::spawn(async move {
        loop {
            let (tcp, peer) = tokio::select! {
                () = cancel.cancelled() => return,
                accepted = listener.accept() => match accepted {
                    Ok(accepted) => accepted,
                    Err(error) => {
                        tracing::warn!(%error, "accepting a connection failed");
                        continue;
                    }
                },
            };
            let (acceptor, tx) = (acceptor.clone(), tx.clone());
            tokio::spawn(async move {
                match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await {
                    Ok(Ok(stream)) => {
                        let _ = tx.send(Ok(stream)).await;
                    }
                    Ok(Err(error)) => tracing::debug!(%peer, %error, "TLS handshake failed"),
                    Err(_) => tracing::debug!(%peer, "TLS handshake timed out"),
                }
            });
        }
    });
    ReceiverStream::new(rx)
}

/// When a certificate issued for `validity`, until `not_after`, is renewed: with a third
/// of its lifetime left, as cert-manager does by default, so a renewal that fails has
/// time to be retried. (From the validity asked for, not from `notBefore`, which is
/// backdated for clock skew.)
pub fn renew_at(not_after: OffsetDateTime, validity: Duration) -> OffsetDateTime {
    not_after - validity / 3
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pki::{CertificateAuthority, Leaf};

    const DAY: Duration = Duration::from_secs(24 * 3600);

    #[test]
    fn renewal_comes_with_a_third_of_the_lifetime_left() {
        let end = OffsetDateTime::UNIX_EPOCH + time::Duration::days(90);
        assert_eq!(
            renew_at(end, Duration::from_secs(90 * 24 * 3600)),
            OffsetDateTime::UNIX_EPOCH + time::Duration::days(60)
        );
        // A backdated notBefore does not move it: issued now for 30 s, renewed in 20 s.
        let leaf = Leaf::server("s", &[], &[], Duration::from_secs(30));
        let wait = renew_at(leaf.not_after, Duration::from_secs(30)) - OffsetDateTime::now_utc();
        assert!(wait > time::Duration::seconds(18) && wait <= time::Duration::seconds(20));
    }

    #[test]
    fn a_replaced_certificate_is_served_and_a_bad_pair_is_refused() {
        let ca = CertificateAuthority::generate("ca", DAY).unwrap();
        let issue = || {
            ca.issue(&Leaf::server("s", &["s".into()], &[], DAY))
                .unwrap()
        };
        let (first, second) = (issue(), issue());
        let serving = ServingCertificate::new(&first.cert_pem, &first.key_pem).unwrap();
        let der = |pem: &str| {
            CertificateDer::from_pem_slice(pem.as_bytes())
                .unwrap()
                .to_vec()
        };
        assert_eq!(serving.current_der(), der(&first.cert_pem));
        serving.replace(&second.cert_pem, &second.key_pem).unwrap();
        assert_eq!(serving.current_der(), der(&second.cert_pem));
        let error = serving
            .replace(&first.cert_pem, &second.key_pem)
            .unwrap_err();
        assert!(error.to_string().contains("does not belong"), "{error}");
        assert_eq!(serving.current_der(), der(&second.cert_pem));
    }

    /// The certificate a TLS client is served by `addr` now.
    async fn served(addr: std::net::SocketAddr, ca_pem: &str) -> Vec<u8> {
        let mut roots = RootCertStore::empty();
        roots
            .add(CertificateDer::from_pem_slice(ca_pem.as_bytes()).unwrap())
            .unwrap();
        let config = rustls::ClientConfig::builder_with_provider(Arc::new(default_provider()))
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_root_certificates(roots)
            .with_no_client_auth();
        let tcp = TcpStream::connect(addr).await.unwrap();
        let name = rustls::pki_types::ServerName::try_from("s").unwrap();
        let tls = tokio_rustls::TlsConnector::from(Arc::new(config))
            .connect(name, tcp)
            .await
            .unwrap();
        tls.get_ref().1.peer_certificates().unwrap()[0].to_vec()
    }

    #[tokio::test]
    async fn the_next_connection_gets_the_replaced_certificate() {
        use tokio_stream::StreamExt as _;

        let ca = CertificateAuthority::generate("ca", DAY).unwrap();
        let issue = || {
            ca.issue(&Leaf::server("s", &["s".into()], &[], DAY))
                .unwrap()
        };
        let (first, second) = (issue(), issue());
        let serving = ServingCertificate::new(&first.cert_pem, &first.key_pem).unwrap();
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let config = server_config(serving.clone(), None, &[b"h2"]).unwrap();
        let cancel = CancellationToken::new();
        let mut connections = incoming(listener, config, cancel.clone());
        let der = |pem: &str| {
            CertificateDer::from_pem_slice(pem.as_bytes())
                .unwrap()
                .to_vec()
        };

        let (before, accepted) = tokio::join!(served(addr, ca.cert_pem()), connections.next());
        assert_eq!(before, der(&first.cert_pem));
        assert!(accepted.is_some_and(|c| c.is_ok()));
        serving.replace(&second.cert_pem, &second.key_pem).unwrap();
        let (after, _) = tokio::join!(served(addr, ca.cert_pem()), connections.next());
        assert_eq!(after, der(&second.cert_pem));
        cancel.cancel();
    }
}
