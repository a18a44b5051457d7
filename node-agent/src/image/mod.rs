//! kmod images: pull (with `oci-client`, through `kmm-registry`), cache, and safe extraction of the module and
//! firmware directories (see the `kmm-extract` crate).

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::time::{Duration, Instant};

pub mod cache;
pub mod pull;

use cache::{Cache, CacheError, io};
pub use kmm_extract::{ExtractError, Limits};
use pull::{PullError, PullRequest, Puller};

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
}

/// Pulls and extracts images into the cache.
#[derive(Debug)]
pub struct ImageStore {
    puller: Puller,
    limits: Limits,
}

impl ImageStore {
    pub fn new(cache: Cache, limits: Limits) -> Self {
        Self {
            puller: Puller::new(cache),
            limits,
        }
    }

    pub fn cache(&self) -> &Cache {
        self.puller.cache()
    }

    /// The digest the request stands for (resolving a tag at most once).
    pub async fn resolve(&self, request: &FetchRequest<'_>) -> Result<String, ImageError> {
        match request.digest {
            Some(d) => Ok(d.to_string()),
            None => Ok(self.puller.resolve(&request.pull).await?),
        }
    }

    /// Pulls (if needed) and extracts (if needed) the image.
    pub async fn fetch(&self, request: &FetchRequest<'_>) -> Result<Fetched, ImageError> {
        let started = Instant::now();
        let digest = self.resolve(request).await?;
        let cache = self.cache();
        let root = cache.extracted_dir(&digest, &request.selection)?;
        if root.is_dir() {
            return Ok(Fetched {
                digest,
                root,
                fresh: false,
                elapsed: started.elapsed(),
            });
        }
        let (manifest, _) = self.puller.ensure(&request.pull, &digest).await?;
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
        let tmp_for_task = tmp.clone();
        let result = tokio::task::spawn_blocking(move || -> Result<(), ImageError> {
            let mut readers = vec![];
            for (compression, path) in layers {
                let file = std::fs::File::open(&path).map_err(io("opening", &path))?;
                readers.push(kmm_extract::Layer {
                    compression,
                    reader: std::io::BufReader::new(file),
                });
            }
            kmm_extract::extract_image(readers, &selection, &limits, &tmp_for_task)
                .map(|_| ())
                .map_err(|source| ImageError::Refused {
                    image: String::new(),
                    source,
                })
        })
        .await
        .expect("extraction does not panic");
        match result {
            Ok(()) => {}
            Err(ImageError::Refused { source, .. }) => {
                return Err(ImageError::Refused {
                    image: request.pull.image.to_string(),
                    source,
                });
            }
            Err(other) => return Err(other),
        }
        if let Err(error) = std::fs::rename(&tmp, &root) {
            // Another process sharing the cache extracted the same image for the same
            // selection meanwhile: its tree is this one.
            if !root.is_dir() {
                return Err(io("renaming", &tmp)(error).into());
            }
            std::fs::remove_dir_all(&tmp).map_err(io("removing", &tmp))?;
        }
        Ok(Fetched {
            digest,
            root,
            fresh: true,
            elapsed: started.elapsed(),
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
