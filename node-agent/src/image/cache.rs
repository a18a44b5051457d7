//! The content-addressed image cache on the node: layer blobs and manifests by
//! digest, and extracted module trees by manifest digest and selection. Garbage
//! collection removes everything not reachable from the digests in use or from the
//! images that stopped being used recently (a manifest's modification time is when its
//! image was last used).

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::SystemTime;

use oci_client::manifest::OciImageManifest;
use sha2::{Digest, Sha256};

#[derive(Debug, thiserror::Error)]
pub enum CacheError {
    #[error("{0:?} is not a sha256 digest")]
    BadDigest(String),
    #[error("{action} {path}: {source}")]
    Io {
        action: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: {detail}")]
    Corrupt { path: PathBuf, detail: String },
}

pub(crate) fn io(action: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> CacheError {
    let path = path.to_path_buf();
    move |source| CacheError::Io {
        action,
        path,
        source,
    }
}

/// The hex part of a `sha256:` digest, validated (it becomes a file name).
pub fn digest_hex(digest: &str) -> Result<&str, CacheError> {
    match digest.strip_prefix("sha256:") {
        Some(hex)
            if hex.len() == 64 && hex.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')) =>
        {
            Ok(hex)
        }
        _ => Err(CacheError::BadDigest(digest.to_string())),
    }
}

/// What a garbage collection removed.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct GcReport {
    pub manifests: usize,
    pub blobs: usize,
    pub extracted: usize,
}

/// Checks a blob on disk against the size and digest its manifest gives (reading it
/// whole).
pub fn verify_blob(path: &Path, digest: &str, size: u64) -> Result<(), CacheError> {
    let expected = digest_hex(digest)?;
    let corrupt = |detail: String| CacheError::Corrupt {
        path: path.to_path_buf(),
        detail,
    };
    let mut file = std::fs::File::open(path).map_err(io("opening", path))?;
    let len = file.metadata().map_err(io("reading", path))?.len();
    if len != size {
        return Err(corrupt(format!(
            "holds {len} bytes, not the {size} its manifest declares"
        )));
    }
    let mut hash = Sha256::new();
    std::io::copy(&mut file, &mut hash).map_err(io("reading", path))?;
    let actual = format!("{:x}", hash.finalize());
    if actual != expected {
        return Err(corrupt(format!(
            "its digest is sha256:{actual}, not {digest}"
        )));
    }
    Ok(())
}

/// Room taken in a cache's budget by downloads under way; given back on drop.
#[derive(Debug)]
pub struct Reservation {
    reserved: Arc<Mutex<u64>>,
    bytes: u64,
}

impl Drop for Reservation {
    fn drop(&mut self) {
        *self.reserved.lock().expect("not poisoned") -= self.bytes;
    }
}

#[derive(Clone, Debug)]
pub struct Cache {
    dir: PathBuf,
    /// Bytes of layers this process is downloading into the cache.
    reserved: Arc<Mutex<u64>>,
}

impl Cache {
    pub fn open(dir: impl Into<PathBuf>) -> Result<Self, CacheError> {
        let cache = Self {
            dir: dir.into(),
            reserved: Arc::default(),
        };
        for sub in ["blobs/sha256", "manifests/sha256", "extracted", "tmp"] {
            let path = cache.dir.join(sub);
            std::fs::create_dir_all(&path).map_err(io("creating", &path))?;
        }
        // Leftovers of interrupted downloads and extractions.
        let tmp = cache.dir.join("tmp");
        for entry in std::fs::read_dir(&tmp)
            .map_err(io("reading", &tmp))?
            .flatten()
        {
            let path = entry.path();
            let _ = std::fs::remove_dir_all(&path).or_else(|_| std::fs::remove_file(&path));
        }
        Ok(cache)
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn blob_path(&self, digest: &str) -> Result<PathBuf, CacheError> {
        Ok(self.dir.join("blobs/sha256").join(digest_hex(digest)?))
    }

    /// Room for `bytes` more of layers within `limit` bytes for the layers cached and
    /// downloading; `Err` with what they hold now when there is not.
    pub fn reserve(&self, bytes: u64, limit: u64) -> Result<Result<Reservation, u64>, CacheError> {
        let mut reserved = self.reserved.lock().expect("not poisoned");
        let blobs = self.dir.join("blobs/sha256");
        let mut held = *reserved;
        for entry in std::fs::read_dir(&blobs)
            .map_err(io("reading", &blobs))?
            .flatten()
        {
            held = held.saturating_add(entry.metadata().map_or(0, |m| m.len()));
        }
        if held.saturating_add(bytes) > limit {
            return Ok(Err(held));
        }
        *reserved += bytes;
        Ok(Ok(Reservation {
            reserved: self.reserved.clone(),
            bytes,
        }))
    }

    fn manifest_path(&self, digest: &str) -> Result<PathBuf, CacheError> {
        Ok(self
            .dir
            .join("manifests/sha256")
            .join(format!("{}.json", digest_hex(digest)?)))
    }

    /// A fresh path for a download or extraction in progress, unique also among
    /// processes sharing the cache (two agents of a node during a DaemonSet update; agents
    /// in containers, where every one may be pid 1).
    pub fn tmp_path(&self, what: &str) -> PathBuf {
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        static PROCESS: std::sync::LazyLock<u64> = std::sync::LazyLock::new(|| {
            getrandom::u64().unwrap_or_else(|_| u64::from(std::process::id()))
        });
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.dir
            .join("tmp")
            .join(format!("{what}-{:016x}-{n}", *PROCESS))
    }

    pub fn manifest(&self, digest: &str) -> Result<Option<OciImageManifest>, CacheError> {
        let path = self.manifest_path(digest)?;
        match std::fs::read(&path) {
            Ok(bytes) => Ok(serde_json::from_slice(&bytes).ok()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(io("reading", &path)(e)),
        }
    }

    pub fn store_manifest(
        &self,
        digest: &str,
        manifest: &OciImageManifest,
    ) -> Result<(), CacheError> {
        let path = self.manifest_path(digest)?;
        let tmp = self.tmp_path("manifest");
        let bytes = serde_json::to_vec(manifest).expect("manifest serialises");
        std::fs::write(&tmp, bytes).map_err(io("writing", &tmp))?;
        std::fs::rename(&tmp, &path).map_err(io("renaming", &tmp))
    }

    /// Where the image `digest` is extracted for one kernel and selection.
    pub fn extracted_dir(
        &self,
        digest: &str,
        selection: &kmm_extract::Selection,
    ) -> Result<PathBuf, CacheError> {
        let hex = digest_hex(digest)?;
        let mut hash = Sha256::new();
        for part in [
            selection.kernel.as_str(),
            selection.dir_name.as_str(),
            selection.firmware_path.as_deref().unwrap_or(""),
        ] {
            hash.update(part.as_bytes());
            hash.update([0]);
        }
        let key = format!("{:x}", hash.finalize());
        Ok(self
            .dir
            .join("extracted")
            .join(format!("{hex}-{}", &key[..16])))
    }

    /// Records that the image `digest` was in use until now: a collection keeps it
    /// while its last use is recent. An image not in the cache is left alone.
    pub fn touch(&self, digest: &str) -> Result<(), CacheError> {
        let path = self.manifest_path(digest)?;
        match std::fs::File::open(&path) {
            Ok(file) => file
                .set_modified(SystemTime::now())
                .map_err(io("touching", &path)),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(io("opening", &path)(e)),
        }
    }

    /// Removes manifests, blobs and extracted trees reachable neither from `keep`
    /// (manifest digests in use or about to be used) nor from an image last used at or
    /// after `unused_since`.
    pub fn gc(
        &self,
        keep: &BTreeSet<String>,
        unused_since: SystemTime,
    ) -> Result<GcReport, CacheError> {
        let mut keep_hex: BTreeSet<String> = keep
            .iter()
            .filter_map(|d| digest_hex(d).ok())
            .map(str::to_string)
            .collect();
        let mut report = GcReport::default();
        let mut blobs_in_use = BTreeSet::new();
        let manifests = self.dir.join("manifests/sha256");
        for entry in std::fs::read_dir(&manifests)
            .map_err(io("reading", &manifests))?
            .flatten()
        {
            let name = entry.file_name().to_string_lossy().into_owned();
            let hex = name.trim_end_matches(".json");
            let recently_used = || {
                entry
                    .metadata()
                    .and_then(|m| m.modified())
                    .is_ok_and(|used| used >= unused_since)
            };
            // Only an image not in use is asked when it was last used; once kept, its
            // extracted trees are kept below too.
            if !keep_hex.contains(hex) && recently_used() {
                keep_hex.insert(hex.to_string());
            }
            if keep_hex.contains(hex) {
                if let Some(manifest) = self.manifest(&format!("sha256:{hex}"))? {
                    blobs_in_use.insert(manifest.config.digest.clone());
                    blobs_in_use.extend(manifest.layers.iter().map(|l| l.digest.clone()));
                }
            } else {
                std::fs::remove_file(entry.path()).map_err(io("removing", &entry.path()))?;
                report.manifests += 1;
            }
        }
        let blobs_in_use: BTreeSet<&str> = blobs_in_use
            .iter()
            .filter_map(|d| digest_hex(d).ok())
            .collect();
        let blobs = self.dir.join("blobs/sha256");
        for entry in std::fs::read_dir(&blobs)
            .map_err(io("reading", &blobs))?
            .flatten()
        {
            if !blobs_in_use.contains(entry.file_name().to_string_lossy().as_ref()) {
                std::fs::remove_file(entry.path()).map_err(io("removing", &entry.path()))?;
                report.blobs += 1;
            }
        }
        let extracted = self.dir.join("extracted");
        for entry in std::fs::read_dir(&extracted)
            .map_err(io("reading", &extracted))?
            .flatten()
        {
            let name = entry.file_name().to_string_lossy().into_owned();
            let hex = name.split('-').next().unwrap_or_default();
            if !keep_hex.contains(hex) {
                std::fs::remove_dir_all(entry.path()).map_err(io("removing", &entry.path()))?;
                report.extracted += 1;
            }
        }
        Ok(report)
    }
}
