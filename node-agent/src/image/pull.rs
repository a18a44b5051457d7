//! Pulling with `oci-client`: tags are resolved to a digest once; manifests and layers
//! are fetched by digest into the cache. A layer is written no further than the size its
//! manifest declares, verified against its digest by the client, flushed to disk, and
//! only then renamed into place: a cached blob is always whole. Credentials stay in
//! memory.

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::Mutex;
use std::task::{Context, Poll};

pub(crate) use kmm_registry::error_chain;
use kmm_registry::{RegistryError, parse_reference};
use oci_client::manifest::OciImageManifest;
use oci_client::{Client, Reference};

use super::cache::{Cache, CacheError, io};
use crate::desired::{PullSecret, RegistryTls};

#[derive(Debug, thiserror::Error)]
pub enum PullError {
    #[error(transparent)]
    Registry(#[from] RegistryError),
    #[error("{image}: layer media type {media_type:?} is not a tar layer (gzip, zstd or plain)")]
    UnsupportedLayer { image: String, media_type: String },
    #[error(transparent)]
    Cache(#[from] CacheError),
    #[error("{image}: layer {digest} is larger than the {declared} bytes its manifest declares")]
    Oversized {
        image: String,
        digest: String,
        declared: u64,
    },
}

impl PullError {
    fn from_client(image: &str, error: oci_client::errors::OciDistributionError) -> Self {
        Self::Registry(RegistryError::from_client(image, error))
    }
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
        kmm_registry::client(tls)
    }

    fn auth(
        request: &PullRequest<'_>,
        reference: &Reference,
    ) -> Result<oci_client::secrets::RegistryAuth, PullError> {
        Ok(kmm_registry::auth(request.secret, reference)?)
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
                    return Err(PullError::Registry(RegistryError::Registry {
                        image: request.image.to_string(),
                        detail: format!("asked for manifest {digest}, the registry served {got}"),
                    }));
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
            let declared = u64::try_from(layer.size).unwrap_or(0);
            let mut bounded = Bounded::new(file, declared);
            let result = client.pull_blob(&reference, layer, &mut bounded).await;
            if let Err(e) = result {
                let _ = tokio::fs::remove_file(&tmp).await;
                return Err(if bounded.exceeded {
                    PullError::Oversized {
                        image: request.image.to_string(),
                        digest: layer.digest.clone(),
                        declared,
                    }
                } else {
                    PullError::from_client(request.image, e)
                });
            }
            bounded
                .inner
                .sync_all()
                .await
                .map_err(io("flushing", &tmp))?;
            tokio::fs::rename(&tmp, &path)
                .await
                .map_err(io("renaming", &tmp))?;
            downloaded = true;
        }
        Ok((manifest, downloaded))
    }
}

/// A writer that refuses to go past `limit` bytes: a registry cannot fill the disk with
/// more than the manifest declared (the digest check would only come at the end).
struct Bounded<W> {
    inner: W,
    remaining: u64,
    exceeded: bool,
}

impl<W> Bounded<W> {
    fn new(inner: W, limit: u64) -> Self {
        Self {
            inner,
            remaining: limit,
            exceeded: false,
        }
    }
}

impl<W: tokio::io::AsyncWrite + Unpin> tokio::io::AsyncWrite for Bounded<W> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        if buf.len() as u64 > self.remaining {
            self.exceeded = true;
            return Poll::Ready(Err(std::io::Error::other(
                "more bytes than the manifest declares",
            )));
        }
        let written = std::task::ready!(Pin::new(&mut self.inner).poll_write(cx, buf))?;
        self.remaining -= written as u64;
        Poll::Ready(Ok(written))
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use tokio::io::AsyncWriteExt as _;

    use super::Bounded;

    #[tokio::test]
    async fn a_writer_bounded_by_the_declared_size_refuses_one_byte_more() {
        let mut exact = Bounded::new(Vec::new(), 4);
        exact.write_all(b"abcd").await.unwrap();
        assert_eq!(exact.inner, b"abcd");
        assert!(!exact.exceeded);
        let mut over = Bounded::new(Vec::new(), 4);
        over.write_all(b"abc").await.unwrap();
        assert!(over.write_all(b"de").await.is_err());
        assert!(over.exceeded);
        assert_eq!(over.inner, b"abc", "nothing past the limit is written");
    }
}
