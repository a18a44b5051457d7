//! The hub's serving certificates (the proxies' gRPC endpoint, the admission webhook) are
//! re-issued while the hub runs, well before they expire, and served from the next
//! connection on.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kmm_e2e::fixture::{TempNamespace, wait_until};
use kmm_runtime::pki::IssuedCertificate;
use rustls::pki_types::pem::PemObject as _;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};

use crate::support::*;

/// What a TLS client verifying with `ca_pem` (presenting `client`, if any) is served.
async fn served(
    addr: SocketAddr,
    ca_pem: &str,
    client: Option<&IssuedCertificate>,
) -> Result<Vec<u8>, String> {
    let mut roots = rustls::RootCertStore::empty();
    roots
        .add(CertificateDer::from_pem_slice(ca_pem.as_bytes()).map_err(|e| e.to_string())?)
        .map_err(|e| e.to_string())?;
    let builder = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .map_err(|e| e.to_string())?
    .with_root_certificates(roots);
    let config = match client {
        Some(client) => builder
            .with_client_auth_cert(
                vec![
                    CertificateDer::from_pem_slice(client.cert_pem.as_bytes())
                        .map_err(|e| e.to_string())?,
                ],
                PrivateKeyDer::from_pem_slice(client.key_pem.as_bytes())
                    .map_err(|e| e.to_string())?,
            )
            .map_err(|e| e.to_string())?,
        None => builder.with_no_client_auth(),
    };
    let tcp = tokio::net::TcpStream::connect(addr)
        .await
        .map_err(|e| e.to_string())?;
    let tls = tokio_rustls::TlsConnector::from(Arc::new(config))
        .connect(
            ServerName::try_from("127.0.0.1").map_err(|e| e.to_string())?,
            tcp,
        )
        .await
        .map_err(|e| e.to_string())?;
    let certificates = tls
        .get_ref()
        .1
        .peer_certificates()
        .ok_or("no certificate")?;
    Ok(certificates[0].to_vec())
}

#[tokio::test]
async fn serving_certificates_are_renewed_before_they_expire() {
    let fleet = fleet().await;
    let namespace = TempNamespace::create(&fleet.hub, "kmm-hub-renewal")
        .await
        .expect("a test namespace");
    // Renewed with a third (10 s) of their 30 s left.
    let hub = TestHub::start_with(
        &fleet,
        &namespace.name,
        Duration::from_secs(30),
        HubOptions {
            webhook_configuration: Some(format!("{}-absent", namespace.name)),
            serving_validity: Some(Duration::from_secs(30)),
            ..HubOptions::default()
        },
    )
    .await;
    let ca = hub.ca().await;
    let client = hub.proxy_certificate("spoke-renewal").await;
    let webhook = hub.webhook_addr.expect("a webhook listener");
    let (grpc_first, webhook_first) = wait_until("both servers answer", WAIT, || async {
        Ok::<_, String>((
            served(hub.addr, ca.cert_pem(), Some(&client)).await?,
            served(webhook, ca.cert_pem(), None).await?,
        ))
    })
    .await
    .expect("both servers answer");
    let issued = Instant::now();
    wait_until("both certificates renewed", WAIT, || async {
        let grpc = served(hub.addr, ca.cert_pem(), Some(&client)).await?;
        let webhook = served(webhook, ca.cert_pem(), None).await?;
        (grpc != grpc_first && webhook != webhook_first)
            .then_some(())
            .ok_or_else(|| "a first certificate is still served".to_owned())
    })
    .await
    .expect("the certificates are renewed");
    // Due 20 s after issue: not at once (a renewal loop), not after expiry.
    assert!(
        (Duration::from_secs(10)..Duration::from_secs(30)).contains(&issued.elapsed()),
        "renewed {:?} after the first certificates were served, for a 30 s lifetime",
        issued.elapsed()
    );
    hub.stop().await;
    namespace.delete().await.expect("the namespace goes");
}
