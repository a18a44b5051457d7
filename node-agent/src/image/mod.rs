//! kmod images: pull (with `oci-client`, through `kmm-registry`), cache, and safe extraction of the module and
//! firmware directories (see the `kmm-extract` crate).

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::time::{Duration, Instant};

pub mod cache;
pub mod pull;

use cache::{Cache, CacheError, io};
pub use kmm_extract::{ExtractError, Limits};
use pull::{PullError, PullLimit, PullLimits, PullRequest, Puller};
use tokio::sync::Semaphore;

use crate::metrics::Metrics;

#[derive(Debug, thiserror::Error)]
pub enum ImageError {
    #[error(transparent)]
    Pull(#[from] PullError),
    #[error("image {image} refused: {source}")]
    Refused {
        image: String,
        #[source]
        source: ExtractError,
    },
    #[error(transparent)]
    Cache(#[from] CacheError),
}

/// What to fetch: an image and the part of it to extract.
#[derive(Clone, Debug)]
pub struct FetchRequest<'a> {
    pub pull: PullRequest<'a>,
    /// The digest when already known (given by the control plane or recorded).
    pub digest: Option<&'a str>,
    pub selection: kmm_extract::Selection,
}

/// An image ready for modprobe.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Fetched {
    pub digest: String,
    /// The extraction root (the image's `/`).
    pub root: PathBuf,
    /// Whether anything was downloaded or extracted.
    pub fresh: bool,
    pub elapsed: Duration,
    /// What the steps that ran took; neither ran for an image already extracted.
    pub steps: FetchSteps,
}

/// How long a fresh fetch's steps took.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FetchSteps {
    /// Resolving the reference, the manifest and the layers (from when a pull could start).
    pub pull: Option<Duration>,
    pub extract: Option<Duration>,
}

/// How many pulls run at once by default.
pub const DEFAULT_CONCURRENT_PULLS: usize = 3;

/// Pulls and extracts images into the cache.
#[derive(Debug)]
pub struct ImageStore {
    puller: Puller,
    limits: Limits,
    /// One permit per pull talking to a registry; an image already extracted needs none.
    pulls: Semaphore,
    metrics: Option<Metrics>,
}

impl ImageStore {
    /// A store with the default [`PullLimits`] and [`DEFAULT_CONCURRENT_PULLS`].
    pub fn new(cache: Cache, limits: Limits) -> Self {
        Self {
            puller: Puller::new(cache, PullLimits::default()),
            limits,
            pulls: Semaphore::new(DEFAULT_CONCURRENT_PULLS),
            metrics: None,
        }
    }

    pub fn with_pull_limits(mut self, limits: PullLimits) -> Self {
        self.puller = self.puller.with_limits(limits);
        self
    }

    /// Trusts the PEM CAs in `file` (read at each pull) besides the system's.
    pub fn with_registry_ca_file(mut self, file: Option<std::path::PathBuf>) -> Self {
        self.puller = self.puller.with_registry_ca_file(file);
        self
    }

    /// At most `pulls` (at least one) images pulled at once.
    pub fn with_concurrent_pulls(mut self, pulls: usize) -> Self {
        self.pulls = Semaphore::new(pulls.max(1));
        self
    }

    /// Counts the pulls that hit a limit.
    pub fn with_metrics(mut self, metrics: Metrics) -> Self {
        self.metrics = Some(metrics);
        self
    }

    pub fn cache(&self) -> &Cache {
        self.puller.cache()
    }

    /// The digest the request stands for when known without asking the registry.
    pub fn known_digest(&self, request: &FetchRequest<'_>) -> Option<String> {
        match request.digest {
            Some(d) => Some(d.to_string()),
            None => self.puller.known(&request.pull),
        }
    }

    /// Pulls (if needed) and extracts (if needed) the image. The pull (resolving the
    /// tag, the manifest and the layers) waits for one of the concurrent pulls and then
    /// has [`PullLimits::deadline`] in all.
    pub async fn fetch(&self, request: &FetchRequest<'_>) -> Result<Fetched, ImageError> {
        let result = self.fetch_within_limits(request).await;
        if let (Err(ImageError::Pull(e)), Some(metrics)) = (&result, &self.metrics)
            && let Some(limit) = e.limit()
        {
            metrics.pull_limit_exceeded(limit);
        }
        result
    }

    async fn fetch_within_limits(&self, request: &FetchRequest<'_>) -> Result<Fetched, ImageError> {
        let started = Instant::now();
        let cache = self.cache();
        if let Some(digest) = self.known_digest(request) {
            let root = cache.extracted_dir(&digest, &request.selection)?;
            if root.is_dir() {
                return Ok(Fetched {
                    digest,
                    root,
                    fresh: false,
                    elapsed: started.elapsed(),
                    steps: FetchSteps::default(),
                });
            }
        }
        let _pull = self.pulls.acquire().await.expect("never closed");
        let started = Instant::now();
        let deadline = self.puller.limits().deadline;
        let pulled = tokio::time::timeout(deadline, async {
            let digest = match request.digest {
                Some(d) => d.to_string(),
                None => self.puller.resolve(&request.pull).await?,
            };
            let root = cache.extracted_dir(&digest, &request.selection)?;
            if root.is_dir() {
                return Ok::<_, ImageError>((digest, root, None));
            }
            let (manifest, _) = self.puller.ensure(&request.pull, &digest).await?;
            Ok((digest, root, Some(manifest)))
        })
        .await
        .map_err(|_| PullError::Limit {
            image: request.pull.image.to_string(),
            limit: PullLimit::Deadline,
            detail: format!("the pull did not finish within its deadline of {deadline:?}"),
        })??;
        let (digest, root, manifest) = pulled;
        let pulled_in = started.elapsed();
        let Some(manifest) = manifest else {
            return Ok(Fetched {
                digest,
                root,
                fresh: false,
                elapsed: started.elapsed(),
                steps: FetchSteps::default(),
            });
        };
        let mut layers = vec![];
        for layer in &manifest.layers {
            let compression = kmm_extract::Compression::from_media_type(&layer.media_type)
                .map_err(|source| ImageError::Refused {
                    image: request.pull.image.to_string(),
                    source,
                })?;
            layers.push((compression, cache.blob_path(&layer.digest)?));
        }
        let tmp = cache.tmp_path("extract");
        let selection = request.selection.clone();
        let limits = self.limits;
        let image = request.pull.image.to_string();
        let target = root.clone();
        let extracting = Instant::now();
        // Extraction and the rename into the cache run to the end even when the fetch
        // is cancelled (the agent drops a pull no longer wanted): no half state.
        tokio::task::spawn_blocking(move || {
            extract(layers, &selection, &limits, &tmp, &target, image)
        })
        .await
        .expect("extraction does not panic")?;
        Ok(Fetched {
            digest,
            root,
            fresh: true,
            elapsed: started.elapsed(),
            steps: FetchSteps {
                pull: Some(pulled_in),
                extract: Some(extracting.elapsed()),
            },
        })
    }

    /// Garbage-collects everything but the images `keep` and those last used at or
    /// after `unused_since`.
    pub fn gc(
        &self,
        keep: &BTreeSet<String>,
        unused_since: std::time::SystemTime,
    ) -> Result<cache::GcReport, CacheError> {
        self.cache().gc(keep, unused_since)
    }
}

/// Extracts the layers into `tmp` and renames it to `root`. When extraction fails the
/// layers' blobs are removed: one that is corrupt in a way its digest did not show (or
/// that a bug wrote wrong) is downloaded again on the next try instead of failing the
/// node for good.
fn extract(
    layers: Vec<(kmm_extract::Compression, PathBuf)>,
    selection: &kmm_extract::Selection,
    limits: &Limits,
    tmp: &std::path::Path,
    root: &std::path::Path,
    image: String,
) -> Result<(), ImageError> {
    let extracted = (|| {
        let mut readers = vec![];
        for (compression, path) in &layers {
            let file = std::fs::File::open(path).map_err(io("opening", path))?;
            readers.push(kmm_extract::Layer {
                compression: *compression,
                reader: std::io::BufReader::new(file),
            });
        }
        kmm_extract::extract_image(readers, selection, limits, tmp)
            .map(|_| ())
            .map_err(|source| ImageError::Refused { image, source })
    })();
    if let Err(e) = extracted {
        for (_, path) in &layers {
            if let Err(error) = std::fs::remove_file(path)
                && error.kind() != std::io::ErrorKind::NotFound
            {
                tracing::warn!(path = %path.display(), %error, "cannot remove a layer whose extraction failed");
            }
        }
        return Err(e);
    }
    if let Err(error) = std::fs::rename(tmp, root) {
        // Another process sharing the cache extracted the same image for the same
        // selection meanwhile: its tree is this one.
        if !root.is_dir() {
            return Err(io("renaming", tmp)(error).into());
        }
        std::fs::remove_dir_all(tmp).map_err(io("removing", tmp))?;
    }
    Ok(())
}
