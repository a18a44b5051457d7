//! Manifests read with a cap. `oci-client` reads a manifest's body whole, so a registry
//! could make its reader hold any amount of memory before the digest check fails; here
//! the body is refused as soon as its declared length or the bytes read pass the cap.

use oci_client::errors::{OciDistributionError, OciEnvelope};
use oci_client::manifest::{
    IMAGE_MANIFEST_LIST_MEDIA_TYPE, IMAGE_MANIFEST_MEDIA_TYPE, OCI_IMAGE_INDEX_MEDIA_TYPE,
    OCI_IMAGE_MEDIA_TYPE, OciImageManifest, OciManifest, Versioned,
};
use oci_client::secrets::RegistryAuth;
use oci_client::{Client, Reference, RegistryOperation};
use sha2::{Digest as _, Sha256};

use crate::client::{CONNECT_TIMEOUT, READ_TIMEOUT};
use crate::{RegistryCas, RegistryError, RegistryTls};

/// The manifest media types asked for, as `oci-client` asks.
const ACCEPT: [&str; 4] = [
    IMAGE_MANIFEST_MEDIA_TYPE,
    IMAGE_MANIFEST_LIST_MEDIA_TYPE,
    OCI_IMAGE_MEDIA_TYPE,
    OCI_IMAGE_INDEX_MEDIA_TYPE,
];

/// The most of an error response's body kept for its error text.
const ERROR_BODY_BYTES: u64 = 64 << 10;

/// Why a manifest was not read.
#[derive(Debug, thiserror::Error)]
pub enum ManifestError {
    #[error(transparent)]
    Registry(#[from] RegistryError),
    /// The registry declared, or sent, more than `limit` bytes.
    #[error("{image}: the manifest is larger than the limit of {limit} bytes{}",
        declared.map(|d| format!(" (the registry declares {d})")).unwrap_or_default())]
    TooLarge {
        image: String,
        limit: u64,
        declared: Option<u64>,
    },
}

/// Reads image manifests over `registryTLS`, trusting `cas` besides the system's CAs,
/// with the connect and read timeouts of [`crate::client`], never holding more than
/// `max_bytes` of a body.
#[derive(Debug, Clone)]
pub struct ManifestReader {
    pub tls: RegistryTls,
    pub cas: RegistryCas,
    pub max_bytes: u64,
}

impl ManifestReader {
    /// The image manifest `reference` names and its digest. An image index is resolved
    /// to this platform's manifest as `oci-client` resolves it; `client` provides the
    /// registry's token for `auth`.
    pub async fn image_manifest(
        &self,
        client: &Client,
        image: &str,
        reference: &Reference,
        auth: &RegistryAuth,
    ) -> Result<(OciImageManifest, String), ManifestError> {
        let request_error =
            |e| RegistryError::from_client(image, OciDistributionError::RequestError(e));
        let mut http = reqwest::Client::builder()
            .connect_timeout(CONNECT_TIMEOUT)
            .read_timeout(READ_TIMEOUT)
            .danger_accept_invalid_certs(self.tls.insecure_skip_tls_verify);
        for der in self.cas.ders() {
            http = http
                .add_root_certificate(reqwest::Certificate::from_der(der).map_err(request_error)?);
        }
        let http = http.build().map_err(request_error)?;
        let token = client
            .auth(reference, auth, RegistryOperation::Pull)
            .await
            .map_err(|e| RegistryError::from_client(image, e))?;
        let credentials = Credentials { http, token, auth };
        match self.manifest(&credentials, image, reference).await? {
            (OciManifest::Image(manifest), digest) => Ok((manifest, digest)),
            (OciManifest::ImageIndex(index), _) => {
                let Some(digest) = oci_client::client::current_platform_resolver(&index.manifests)
                else {
                    return Err(registry(
                        image,
                        "the image index has no manifest for this platform",
                    )
                    .into());
                };
                match self
                    .manifest(
                        &credentials,
                        image,
                        &reference.clone_with_digest(digest.clone()),
                    )
                    .await?
                {
                    (OciManifest::Image(manifest), digest) => Ok((manifest, digest)),
                    (OciManifest::ImageIndex(_), _) => Err(registry(
                        image,
                        "the image index names another index for this platform",
                    )
                    .into()),
                }
            }
        }
    }

    async fn manifest(
        &self,
        credentials: &Credentials<'_>,
        image: &str,
        reference: &Reference,
    ) -> Result<(OciManifest, String), ManifestError> {
        let registry_host = reference.resolve_registry();
        let url = format!(
            "{}://{registry_host}/v2/{}/manifests/{}{}",
            if self.tls.insecure { "http" } else { "https" },
            reference.repository(),
            reference
                .digest()
                .unwrap_or_else(|| reference.tag().unwrap_or("latest")),
            reference
                .namespace()
                .map(|ns| format!("?ns={ns}"))
                .unwrap_or_default(),
        );
        let mut request = credentials
            .http
            .get(&url)
            .header("Accept", ACCEPT.join(", "));
        request = match (&credentials.token, credentials.auth) {
            (Some(token), _) => request.bearer_auth(token),
            (None, RegistryAuth::Basic(user, password)) => request.basic_auth(user, Some(password)),
            (None, _) => request,
        };
        let client_error = |e: reqwest::Error| {
            RegistryError::from_client(image, OciDistributionError::RequestError(e))
        };
        let mut response = request.send().await.map_err(client_error)?;
        let status = response.status();
        if status != reqwest::StatusCode::OK {
            let body = read_capped(&mut response, ERROR_BODY_BYTES)
                .await
                .map_err(client_error)?
                .unwrap_or_default();
            return Err(RegistryError::from_client(image, status_error(status, &body, url)).into());
        }
        let header_digest = response
            .headers()
            .get("Docker-Content-Digest")
            .and_then(|v| v.to_str().ok())
            .map(str::to_string);
        let too_large = |declared| ManifestError::TooLarge {
            image: image.to_string(),
            limit: self.max_bytes,
            declared,
        };
        if let Some(declared) = response.content_length().filter(|l| *l > self.max_bytes) {
            return Err(too_large(Some(declared)));
        }
        let body = read_capped(&mut response, self.max_bytes)
            .await
            .map_err(client_error)?
            .ok_or_else(|| too_large(None))?;
        let digest = format!("sha256:{:x}", Sha256::digest(&body));
        for expected in [header_digest.as_deref(), reference.digest()]
            .into_iter()
            .flatten()
            .filter(|d| d.starts_with("sha256:"))
        {
            if expected != digest {
                return Err(registry(
                    image,
                    &format!("asked for manifest {expected}, the registry served {digest}"),
                )
                .into());
            }
        }
        let versioned: Versioned = serde_json::from_slice(&body)
            .map_err(|e| registry(image, &format!("the manifest is not valid JSON: {e}")))?;
        if versioned.schema_version != 2 {
            return Err(registry(
                image,
                &format!(
                    "manifest schema version {} is not supported",
                    versioned.schema_version
                ),
            )
            .into());
        }
        let manifest = serde_json::from_slice(&body)
            .map_err(|e| registry(image, &format!("the manifest cannot be read: {e}")))?;
        Ok((manifest, digest))
    }
}

/// A client, and a bearer token from the registry or else the pull secret's user and
/// password.
struct Credentials<'a> {
    http: reqwest::Client,
    token: Option<String>,
    auth: &'a RegistryAuth,
}

fn registry(image: &str, detail: &str) -> RegistryError {
    RegistryError::Registry {
        image: image.to_string(),
        detail: detail.to_string(),
    }
}

/// The body, or `None` once it passes `limit` bytes (what was read is dropped).
async fn read_capped(
    response: &mut reqwest::Response,
    limit: u64,
) -> Result<Option<Vec<u8>>, reqwest::Error> {
    let mut body = Vec::new();
    while let Some(chunk) = response.chunk().await? {
        if (body.len() + chunk.len()) as u64 > limit {
            return Ok(None);
        }
        body.extend_from_slice(&chunk);
    }
    Ok(Some(body))
}

/// A registry's answer other than 200 as `oci-client` reports it, so that
/// [`RegistryError::from_client`] classifies it the same way.
fn status_error(status: reqwest::StatusCode, body: &[u8], url: String) -> OciDistributionError {
    if status == reqwest::StatusCode::UNAUTHORIZED {
        return OciDistributionError::UnauthorizedError { url };
    }
    if status.is_client_error()
        && let Ok(envelope) = serde_json::from_slice::<OciEnvelope>(body)
    {
        return OciDistributionError::RegistryError { envelope, url };
    }
    OciDistributionError::ServerError {
        code: status.as_u16(),
        url,
        message: String::from_utf8_lossy(body).into_owned(),
    }
}
