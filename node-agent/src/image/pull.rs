//! Pulling with `oci-client`: tags are resolved to a digest once; manifests and layers
//! are fetched by digest into the cache, within the [`PullLimits`]: a manifest is read
//! no further than its cap, a layer's declared size is checked against the per-layer
//! and cache budgets before anything is downloaded, and the layer is written no further
//! than that size, verified against its digest by the client, flushed to disk, verified
//! again as it is on disk, and only then renamed into place: a cached blob is always
//! whole. Credentials stay in memory.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Mutex;
use std::task::{Context, Poll};
use std::time::Duration;

pub(crate) use kmm_registry::error_chain;
use kmm_registry::{ManifestError, ManifestReader, RegistryCas, RegistryError, parse_reference};
use oci_client::manifest::{OciDescriptor, OciImageManifest};
use oci_client::{Client, Reference};
use tokio::io::AsyncWriteExt as _;

use super::cache::{Cache, CacheError, io};
use crate::desired::{PullSecret, RegistryTls};

/// The bounds of one pull. Each is named after its flag in the README.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PullLimits {
    /// How long resolving, the manifest and all layers of one image may take in all:
    /// a registry that trickles bytes fails the pull.
    pub deadline: Duration,
    /// Largest manifest read.
    pub max_manifest_bytes: u64,
    /// Largest size a layer may declare.
    pub max_layer_bytes: u64,
    /// Largest total of the layers in the cache, downloading ones included.
    pub max_cache_bytes: u64,
}

impl PullLimits {
    pub const DEFAULT_DEADLINE: Duration = Duration::from_secs(600);
    /// As the registries' own cap on manifests they accept (4 MiB).
    pub const DEFAULT_MAX_MANIFEST_BYTES: u64 = 4 << 20;
    pub const DEFAULT_MAX_LAYER_BYTES: u64 = 2 << 30;
    pub const DEFAULT_MAX_CACHE_BYTES: u64 = 10 << 30;
}

impl Default for PullLimits {
    fn default() -> Self {
        Self {
            deadline: Self::DEFAULT_DEADLINE,
            max_manifest_bytes: Self::DEFAULT_MAX_MANIFEST_BYTES,
            max_layer_bytes: Self::DEFAULT_MAX_LAYER_BYTES,
            max_cache_bytes: Self::DEFAULT_MAX_CACHE_BYTES,
        }
    }
}

/// Which [`PullLimits`] bound a pull hit.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum PullLimit {
    Deadline,
    ManifestBytes,
    LayerBytes,
    CacheBytes,
}

impl PullLimit {
    pub const ALL: [Self; 4] = [
        Self::Deadline,
        Self::ManifestBytes,
        Self::LayerBytes,
        Self::CacheBytes,
    ];

    /// The metric label.
    pub fn name(self) -> &'static str {
        match self {
            Self::Deadline => "pull_deadline",
            Self::ManifestBytes => "manifest_bytes",
            Self::LayerBytes => "layer_bytes",
            Self::CacheBytes => "cache_bytes",
        }
    }

    /// The agent's flag that sets it.
    pub fn flag(self) -> &'static str {
        match self {
            Self::Deadline => "--pull-timeout-seconds",
            Self::ManifestBytes => "--max-manifest-bytes",
            Self::LayerBytes => "--max-layer-bytes",
            Self::CacheBytes => "--max-cache-bytes",
        }
    }
}

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
    #[error("{image}: {detail} (limit {}, set by {})", limit.name(), limit.flag())]
    Limit {
        image: String,
        limit: PullLimit,
        detail: String,
    },
    /// The extra CAs cannot be read: nothing is pulled over TLS that they might be for.
    #[error(
        "{image}: the registry CA bundle {} (--registry-ca-file; the add-on's variables \
         REGISTRY_CA_BUNDLE_n) cannot be used: {reason}",
        file.display()
    )]
    RegistryCa {
        image: String,
        file: PathBuf,
        reason: String,
    },
}

impl PullError {
    fn from_client(image: &str, error: oci_client::errors::OciDistributionError) -> Self {
        Self::Registry(RegistryError::from_client(image, error))
    }

    fn from_manifest(error: ManifestError) -> Self {
        match error {
            ManifestError::Registry(e) => Self::Registry(e),
            ManifestError::TooLarge {
                image,
                limit,
                declared,
            } => Self::Limit {
                image,
                limit: PullLimit::ManifestBytes,
                detail: match declared {
                    Some(declared) => format!(
                        "the manifest's declared length {declared} is over the limit of {limit} bytes"
                    ),
                    None => format!("the manifest is longer than the limit of {limit} bytes"),
                },
            },
        }
    }

    /// The limit this error is about, if any.
    pub fn limit(&self) -> Option<PullLimit> {
        match self {
            Self::Limit { limit, .. } => Some(*limit),
            _ => None,
        }
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
    limits: PullLimits,
    resolved: Mutex<HashMap<String, String>>,
    /// PEM CAs trusted besides the system's, read at each pull: a mounted ConfigMap's
    /// update reaches the next pull without a restart.
    ca_file: Option<PathBuf>,
}

impl Puller {
    pub fn new(cache: Cache, limits: PullLimits) -> Self {
        Self {
            cache,
            limits,
            resolved: Mutex::new(HashMap::new()),
            ca_file: None,
        }
    }

    pub fn with_registry_ca_file(mut self, file: Option<PathBuf>) -> Self {
        self.ca_file = file;
        self
    }

    pub fn with_limits(mut self, limits: PullLimits) -> Self {
        self.limits = limits;
        self
    }

    pub fn cache(&self) -> &Cache {
        &self.cache
    }

    pub fn limits(&self) -> PullLimits {
        self.limits
    }

    /// A client for the request, and the extra CAs it trusts (the manifest reader's
    /// own connection trusts them too).
    fn client(&self, request: &PullRequest<'_>) -> Result<(Client, RegistryCas), PullError> {
        let cas = match &self.ca_file {
            None => RegistryCas::default(),
            Some(file) => {
                let unusable = |reason: String| PullError::RegistryCa {
                    image: request.image.to_owned(),
                    file: file.clone(),
                    reason,
                };
                let bundle = std::fs::read(file).map_err(|e| unusable(e.to_string()))?;
                RegistryCas::from_pem(&bundle).map_err(|e| unusable(e.to_string()))?
            }
        };
        Ok((kmm_registry::client_trusting(request.tls, &cas), cas))
    }

    fn auth(
        request: &PullRequest<'_>,
        reference: &Reference,
    ) -> Result<oci_client::secrets::RegistryAuth, PullError> {
        Ok(kmm_registry::auth(request.secret, reference)?)
    }

    async fn manifest(
        &self,
        (client, cas): (&Client, &RegistryCas),
        request: &PullRequest<'_>,
        reference: &Reference,
    ) -> Result<(OciImageManifest, String), PullError> {
        let auth = Self::auth(request, reference)?;
        ManifestReader {
            tls: request.tls,
            cas: cas.clone(),
            max_bytes: self.limits.max_manifest_bytes,
        }
        .image_manifest(client, request.image, reference, &auth)
        .await
        .map_err(PullError::from_manifest)
    }

    /// The digest `request.image` stands for without asking the registry: its own
    /// digest, or the digest its tag resolved to earlier in this agent's life.
    pub fn known(&self, request: &PullRequest<'_>) -> Option<String> {
        if let Some(digest) = parse_reference(request.image).ok()?.digest() {
            return Some(digest.to_string());
        }
        self.resolved
            .lock()
            .expect("not poisoned")
            .get(request.image)
            .cloned()
    }

    /// The digest `request.image` stands for: [`Self::known`], or the registry's
    /// answer now.
    pub async fn resolve(&self, request: &PullRequest<'_>) -> Result<String, PullError> {
        if let Some(digest) = self.known(request) {
            return Ok(digest);
        }
        let reference = parse_reference(request.image)?;
        let (client, cas) = self.client(request)?;
        let (manifest, digest) = self.manifest((&client, &cas), request, &reference).await?;
        self.cache.store_manifest(&digest, &manifest)?;
        tracing::info!(image = request.image, %digest, "resolved tag");
        self.resolved
            .lock()
            .expect("not poisoned")
            .insert(request.image.to_string(), digest.clone());
        Ok(digest)
    }

    /// Makes sure the manifest `digest` and all its layers are in the cache, whole;
    /// returns the manifest and whether anything was downloaded.
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
        let (client, cas) = self.client(request)?;
        let auth = Self::auth(request, &reference)?;
        client
            .store_auth_if_needed(reference.resolve_registry(), &auth)
            .await;
        let manifest = match self.cache.manifest(digest)? {
            Some(manifest) => manifest,
            None => {
                let (manifest, got) = self.manifest((&client, &cas), request, &reference).await?;
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
        // Every declared size is checked before any byte of a layer is asked for.
        let mut layers = vec![];
        for layer in &manifest.layers {
            if kmm_extract::Compression::from_media_type(&layer.media_type).is_err() {
                return Err(PullError::UnsupportedLayer {
                    image: request.image.to_string(),
                    media_type: layer.media_type.clone(),
                });
            }
            layers.push((layer, self.declared_size(request.image, layer)?));
        }
        let mut missing = vec![];
        let mut needed = 0u64;
        let mut seen = std::collections::BTreeSet::new();
        for (layer, size) in layers {
            if !seen.insert(&layer.digest) {
                continue;
            }
            let path = self.cache.blob_path(&layer.digest)?;
            if path.is_file() {
                match verify(&path, &layer.digest, size).await {
                    Ok(()) => continue,
                    Err(e) => {
                        tracing::warn!(error = %error_chain(&e), "downloading a corrupt cached layer again");
                        std::fs::remove_file(&path).map_err(io("removing", &path))?;
                    }
                }
            }
            needed = needed.saturating_add(size);
            missing.push((layer, size));
        }
        let _reservation = self
            .cache
            .reserve(needed, self.limits.max_cache_bytes)?
            .map_err(|held| PullError::Limit {
                image: request.image.to_string(),
                limit: PullLimit::CacheBytes,
                detail: format!(
                    "its layers need {needed} bytes, the cache holds {held} of its limit of {} bytes",
                    self.limits.max_cache_bytes
                ),
            })?;
        for (layer, size) in missing {
            self.download(&client, request.image, &reference, layer, size)
                .await?;
            downloaded = true;
        }
        Ok((manifest, downloaded))
    }

    /// `layer`'s declared size, refused when negative or over the per-layer limit.
    fn declared_size(&self, image: &str, layer: &OciDescriptor) -> Result<u64, PullError> {
        let refused = |detail| PullError::Limit {
            image: image.to_string(),
            limit: PullLimit::LayerBytes,
            detail,
        };
        match u64::try_from(layer.size) {
            Ok(size) if size <= self.limits.max_layer_bytes => Ok(size),
            Ok(size) => Err(refused(format!(
                "layer {} declares a size of {size} bytes, over the limit of {} bytes",
                layer.digest, self.limits.max_layer_bytes
            ))),
            Err(_) => Err(refused(format!(
                "layer {} declares a negative size ({})",
                layer.digest, layer.size
            ))),
        }
    }

    async fn download(
        &self,
        client: &Client,
        image: &str,
        reference: &Reference,
        layer: &OciDescriptor,
        declared: u64,
    ) -> Result<(), PullError> {
        let path = self.cache.blob_path(&layer.digest)?;
        let tmp = TmpFile(Some(self.cache.tmp_path("blob")));
        let file = tokio::fs::File::create(tmp.path())
            .await
            .map_err(io("creating", tmp.path()))?;
        let mut bounded = Bounded::new(file, declared);
        if let Err(e) = client.pull_blob(reference, layer, &mut bounded).await {
            return Err(if bounded.exceeded {
                PullError::Oversized {
                    image: image.to_string(),
                    digest: layer.digest.clone(),
                    declared,
                }
            } else if let Some(local) = bounded.failed.take() {
                io("writing", tmp.path())(local).into()
            } else {
                PullError::from_client(image, e)
            });
        }
        // tokio's `sync_all` does not report the error of the last buffered write (a
        // full disk): only a flush does.
        bounded
            .inner
            .flush()
            .await
            .map_err(io("writing", tmp.path()))?;
        bounded
            .inner
            .sync_all()
            .await
            .map_err(io("syncing", tmp.path()))?;
        drop(bounded);
        // What is on disk, not what went by, enters the cache.
        verify(tmp.path(), &layer.digest, declared).await?;
        tokio::fs::rename(tmp.path(), &path)
            .await
            .map_err(io("renaming", tmp.path()))?;
        tmp.keep();
        Ok(())
    }
}

/// Checks a blob on disk against its size and digest (off the async threads: it reads
/// the whole blob).
async fn verify(path: &Path, digest: &str, size: u64) -> Result<(), CacheError> {
    let (path, digest) = (path.to_path_buf(), digest.to_string());
    tokio::task::spawn_blocking(move || super::cache::verify_blob(&path, &digest, size))
        .await
        .expect("verifying does not panic")
}

/// A download in progress, removed unless kept: a failed, timed-out or cancelled pull
/// leaves nothing behind.
struct TmpFile(Option<PathBuf>);

impl TmpFile {
    fn path(&self) -> &Path {
        self.0.as_deref().expect("not kept yet")
    }

    fn keep(mut self) {
        self.0 = None;
    }
}

impl Drop for TmpFile {
    fn drop(&mut self) {
        if let Some(path) = &self.0 {
            let _ = std::fs::remove_file(path);
        }
    }
}

/// A writer that refuses to go past `limit` bytes: a registry cannot fill the disk with
/// more than the manifest declared (the digest check would only come at the end). A
/// failure of the file itself is kept apart from the client's own errors.
struct Bounded<W> {
    inner: W,
    remaining: u64,
    exceeded: bool,
    failed: Option<std::io::Error>,
}

impl<W> Bounded<W> {
    fn new(inner: W, limit: u64) -> Self {
        Self {
            inner,
            remaining: limit,
            exceeded: false,
            failed: None,
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
        match std::task::ready!(Pin::new(&mut self.inner).poll_write(cx, buf)) {
            Ok(written) => {
                self.remaining -= written as u64;
                Poll::Ready(Ok(written))
            }
            Err(e) => {
                self.failed = Some(std::io::Error::new(e.kind(), e.to_string()));
                Poll::Ready(Err(e))
            }
        }
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
