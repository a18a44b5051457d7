//! Pulling with `oci-client`: tags are resolved to a digest once; manifests and layers
//! are fetched by digest into the cache (layers verified against their digest by the
//! client before they are moved into place). Credentials stay in memory.

use std::collections::HashMap;
use std::sync::Mutex;

use oci_client::client::{ClientConfig, ClientProtocol};
use oci_client::errors::OciDistributionError;
use oci_client::manifest::OciImageManifest;
use oci_client::secrets::RegistryAuth;
use oci_client::{Client, Reference};

use super::cache::{Cache, CacheError, io};
use super::credentials::{self, CredentialsError};
use crate::desired::{PullSecret, RegistryTls};

#[derive(Debug, thiserror::Error)]
pub enum PullError {
    #[error("invalid image reference {image:?}: {reason}")]
    InvalidReference { image: String, reason: String },
    #[error(transparent)]
    Credentials(#[from] CredentialsError),
    #[error("registry refused the credentials for {image}: {detail}")]
    Unauthorized { image: String, detail: String },
    #[error("{image} not found in the registry: {detail}")]
    NotFound { image: String, detail: String },
    #[error("pulling {image}: {detail}")]
    Registry { image: String, detail: String },
    #[error("{image}: layer media type {media_type:?} is not a tar layer (gzip, zstd or plain)")]
    UnsupportedLayer { image: String, media_type: String },
    #[error(transparent)]
    Cache(#[from] CacheError),
}

impl PullError {
    fn from_client(image: &str, error: OciDistributionError) -> Self {
        let detail = error_chain(&error);
        let image = image.to_string();
        match error {
            OciDistributionError::AuthenticationFailure(_)
            | OciDistributionError::UnauthorizedError { .. } => {
                Self::Unauthorized { image, detail }
            }
            OciDistributionError::ImageManifestNotFoundError(_) => Self::NotFound { image, detail },
            OciDistributionError::RegistryError { ref envelope, .. }
                if envelope.errors.iter().any(|e| {
                    matches!(
                        e.code,
                        oci_client::errors::OciErrorCode::ManifestUnknown
                            | oci_client::errors::OciErrorCode::NameUnknown
                    )
                }) =>
            {
                Self::NotFound { image, detail }
            }
            OciDistributionError::RegistryError { ref envelope, .. }
                if envelope.errors.iter().any(|e| {
                    matches!(
                        e.code,
                        oci_client::errors::OciErrorCode::Unauthorized
                            | oci_client::errors::OciErrorCode::Denied
                    )
                }) =>
            {
                Self::Unauthorized { image, detail }
            }
            OciDistributionError::ServerError {
                code: 401 | 403, ..
            } => Self::Unauthorized { image, detail },
            OciDistributionError::ServerError { code: 404, .. } => Self::NotFound { image, detail },
            _ => Self::Registry { image, detail },
        }
    }
}

/// An error and its sources on one line.
pub(crate) fn error_chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(s) = source {
        let s_text = s.to_string();
        if !text.contains(&s_text) {
            text.push_str(": ");
            text.push_str(&s_text);
        }
        source = s.source();
    }
    text
}

/// Where to pull from and how.
#[derive(Clone, Copy, Debug)]
pub struct PullRequest<'a> {
    pub image: &'a str,
    pub tls: RegistryTls,
    pub secret: Option<&'a PullSecret>,
}

/// Pulls into the cache and remembers which digest each tag resolved to.
#[derive(Debug)]
pub struct Puller {
    cache: Cache,
    resolved: Mutex<HashMap<String, String>>,
}

fn parse_reference(image: &str) -> Result<Reference, PullError> {
    image
        .parse()
        .map_err(|e: oci_client::ParseError| PullError::InvalidReference {
            image: image.to_string(),
            reason: e.to_string(),
        })
}

impl Puller {
    pub fn new(cache: Cache) -> Self {
        Self {
            cache,
            resolved: Mutex::new(HashMap::new()),
        }
    }

    pub fn cache(&self) -> &Cache {
        &self.cache
    }

    fn client(tls: RegistryTls) -> Client {
        Client::new(ClientConfig {
            protocol: if tls.insecure {
                ClientProtocol::Http
            } else {
                ClientProtocol::Https
            },
            accept_invalid_certificates: tls.insecure_skip_tls_verify,
            ..Default::default()
        })
    }

    fn auth(request: &PullRequest<'_>, reference: &Reference) -> Result<RegistryAuth, PullError> {
        let Some(secret) = request.secret else {
            return Ok(RegistryAuth::Anonymous);
        };
        Ok(
            match credentials::for_registry(secret, reference.registry())? {
                Some(c) => RegistryAuth::Basic(c.username, c.password),
                None => RegistryAuth::Anonymous,
            },
        )
    }

    /// The digest `request.image` stands for: its own digest, the digest its tag
    /// resolved to earlier in this agent's life, or the registry's answer now.
    pub async fn resolve(&self, request: &PullRequest<'_>) -> Result<String, PullError> {
        let reference = parse_reference(request.image)?;
        if let Some(digest) = reference.digest() {
            return Ok(digest.to_string());
        }
        if let Some(digest) = self
            .resolved
            .lock()
            .expect("not poisoned")
            .get(request.image)
        {
            return Ok(digest.clone());
        }
        let auth = Self::auth(request, &reference)?;
        let client = Self::client(request.tls);
        let (manifest, digest) = client
            .pull_image_manifest(&reference, &auth)
            .await
            .map_err(|e| PullError::from_client(request.image, e))?;
        self.cache.store_manifest(&digest, &manifest)?;
        tracing::info!(image = request.image, %digest, "resolved tag");
        self.resolved
            .lock()
            .expect("not poisoned")
            .insert(request.image.to_string(), digest.clone());
        Ok(digest)
    }

    /// Makes sure the manifest `digest` and all its layers are in the cache; returns
    /// the manifest and whether anything was downloaded.
    pub async fn ensure(
        &self,
        request: &PullRequest<'_>,
        digest: &str,
    ) -> Result<(OciImageManifest, bool), PullError> {
        let tagged = parse_reference(request.image)?;
        let reference = Reference::with_digest(
            tagged.registry().to_string(),
            tagged.repository().to_string(),
            digest.to_string(),
        );
        let mut downloaded = false;
        let client = Self::client(request.tls);
        let auth = Self::auth(request, &reference)?;
        client
            .store_auth_if_needed(reference.resolve_registry(), &auth)
            .await;
        let manifest = match self.cache.manifest(digest)? {
            Some(manifest) => manifest,
            None => {
                let (manifest, got) = client
                    .pull_image_manifest(&reference, &auth)
                    .await
                    .map_err(|e| PullError::from_client(request.image, e))?;
                if got != digest {
                    return Err(PullError::Registry {
                        image: request.image.to_string(),
                        detail: format!("asked for manifest {digest}, the registry served {got}"),
                    });
                }
                self.cache.store_manifest(digest, &manifest)?;
                downloaded = true;
                manifest
            }
        };
        for layer in &manifest.layers {
            if kmm_extract::Compression::from_media_type(&layer.media_type).is_err() {
                return Err(PullError::UnsupportedLayer {
                    image: request.image.to_string(),
                    media_type: layer.media_type.clone(),
                });
            }
            let path = self.cache.blob_path(&layer.digest)?;
            if path.is_file() {
                continue;
            }
            let tmp = self.cache.tmp_path("blob");
            let file = tokio::fs::File::create(&tmp)
                .await
                .map_err(io("creating", &tmp))?;
            let result = client.pull_blob(&reference, layer, file).await;
            if let Err(e) = result {
                let _ = tokio::fs::remove_file(&tmp).await;
                return Err(PullError::from_client(request.image, e));
            }
            tokio::fs::rename(&tmp, &path)
                .await
                .map_err(io("renaming", &tmp))?;
            downloaded = true;
        }
        Ok((manifest, downloaded))
    }
}
