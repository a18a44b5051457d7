//! One `oci-client` per `registryTLS`, the pull secret's credentials for the image's
//! registry, and the digest an image reference stands for.

use std::time::Duration;

use oci_client::client::{ClientConfig, ClientProtocol};
use oci_client::secrets::RegistryAuth;
use oci_client::{Client, Reference};

use crate::{PullSecret, RegistryCas, RegistryError, RegistryTls, credentials};

/// Parses `image`, naming it when it is not a valid reference (`kmm_image_reference`:
/// oci-client's own parsing compiles a regex that costs every process megabytes).
pub fn parse_reference(image: &str) -> Result<Reference, RegistryError> {
    kmm_image_reference::parse(image).map_err(|e| RegistryError::InvalidReference {
        image: image.to_string(),
        reason: e.to_string(),
    })
}

/// How long connecting to a registry may take.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a registry may leave a response (or a blob's next bytes) waiting: a registry
/// that stalls mid-download fails the pull instead of holding it forever.
pub const READ_TIMEOUT: Duration = Duration::from_secs(60);

/// A client speaking plain HTTP, HTTPS, or HTTPS without verifying the certificate, with
/// [`CONNECT_TIMEOUT`] and [`READ_TIMEOUT`].
pub fn client(tls: RegistryTls) -> Client {
    client_trusting(tls, &RegistryCas::default())
}

/// [`client`], trusting `cas` besides the system's CAs when it verifies certificates.
pub fn client_trusting(tls: RegistryTls, cas: &RegistryCas) -> Client {
    Client::new(ClientConfig {
        protocol: if tls.insecure {
            ClientProtocol::Http
        } else {
            ClientProtocol::Https
        },
        accept_invalid_certificates: tls.insecure_skip_tls_verify,
        extra_root_certificates: cas.certificates(),
        connect_timeout: Some(CONNECT_TIMEOUT),
        read_timeout: Some(READ_TIMEOUT),
        ..Default::default()
    })
}

/// The credentials `secret` holds for `reference`'s registry; anonymous without a secret
/// or without an entry for that registry.
pub fn auth(
    secret: Option<&PullSecret>,
    reference: &Reference,
) -> Result<RegistryAuth, RegistryError> {
    let Some(secret) = secret else {
        return Ok(RegistryAuth::Anonymous);
    };
    Ok(
        match credentials::for_registry(secret, reference.registry())? {
            Some(c) => RegistryAuth::Basic(c.username, c.password),
            None => RegistryAuth::Anonymous,
        },
    )
}

/// The manifest digest `image` stands for now, asked of the registry (a HEAD request
/// where the registry answers it with the digest). For a reference that carries a
/// digest, this checks that the registry still has it.
pub async fn resolve_digest(
    client: &Client,
    image: &str,
    secret: Option<&PullSecret>,
) -> Result<String, RegistryError> {
    let reference = parse_reference(image)?;
    let auth = auth(secret, &reference)?;
    client
        .fetch_manifest_digest(&reference, &auth)
        .await
        .map_err(|e| RegistryError::from_client(image, e))
}
