//! Bounded pulls (issue 28, items 6 and 7): registries that trickle, declare absurd
//! sizes or serve huge manifests; a cache on a filesystem that really fills; cached
//! blobs that went bad; unloads while a pull is stuck. The registries are small
//! servers of the tests' own on 127.0.0.1 that count what they serve.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kmm_node_agent::agent::{self, LoopTiming};
use kmm_node_agent::control::{self, EventAction};
use kmm_node_agent::desired::{DesiredModule, DesiredSnapshot, Modprobe, RegistryTls};
use kmm_node_agent::image::cache::Cache;
use kmm_node_agent::image::pull::{PullLimits, PullRequest};
use kmm_node_agent::image::{FetchRequest, ImageError, ImageStore, Limits};
use kmm_node_agent::kernel::{Kernel, KernelError};
use kmm_node_agent::metrics::Metrics;
use kmm_node_agent::modprobe::ModprobeCommand;
use kmm_node_agent::reconcile::Reconciler;
use kmm_node_agent::shared_modules::Users;
use kmm_node_agent::state::{ModuleRecord, State, StateStore};
use sha2::Digest as _;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

use crate::support::{Raw, raw_tar, tree};

const KERNEL: &str = "6.1.0-kmm-bounds";
const TAR: &str = "application/vnd.oci.image.layer.v1.tar";
const INSECURE: RegistryTls = RegistryTls {
    insecure: true,
    insecure_skip_tls_verify: false,
};

fn sha256(bytes: &[u8]) -> String {
    format!("sha256:{:x}", sha2::Sha256::digest(bytes))
}

/// A plain tar layer holding one module file of `size` bytes for [`KERNEL`].
fn module_layer(size: usize) -> Vec<u8> {
    // Not all zeroes: a short copy must not pass for the whole.
    let data: Vec<u8> = (0..size).map(|i| (i % 251) as u8).collect();
    raw_tar(&[Raw::File(
        format!("opt/lib/modules/{KERNEL}/extra/kmm_bounds.ko"),
        data,
    )])
}

/// How a [`TestRegistry`] serves the manifest.
#[derive(Clone, Copy, Debug)]
enum ManifestBody {
    Whole,
    /// The tag names an image index whose linux/amd64 entry is the manifest.
    Index,
    /// `bytes` of junk, with or without a `Content-Length` saying so.
    Huge {
        bytes: u64,
        content_length: bool,
    },
}

/// How a [`TestRegistry`] serves the layer's body.
#[derive(Clone, Copy, Debug)]
enum LayerBody {
    Whole,
    /// A few bytes a second, for ever.
    Trickle,
}

/// What a [`TestRegistry`] has served.
#[derive(Debug, Default)]
struct Served {
    manifest_bytes: AtomicU64,
    layer_requests: AtomicU64,
    layer_bytes: AtomicU64,
}

/// An image's pieces as a registry serves them.
#[derive(Clone, Debug)]
struct TestImage {
    manifest: Vec<u8>,
    config: Vec<u8>,
    layer: Vec<u8>,
    layer_digest: String,
}

impl TestImage {
    /// One layer of media type `media_type`; the manifest declares `declared` bytes
    /// for it (its real size by default).
    fn new(layer: Vec<u8>, media_type: &str, declared: Option<u64>) -> Self {
        let config = serde_json::to_vec(&serde_json::json!({
            "architecture": "amd64", "os": "linux",
            "rootfs": {"type": "layers", "diff_ids": [sha256(&layer)]},
        }))
        .unwrap();
        let layer_digest = sha256(&layer);
        let manifest = serde_json::to_vec(&serde_json::json!({
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                       "digest": sha256(&config), "size": config.len()},
            "layers": [{"mediaType": media_type, "digest": layer_digest,
                        "size": declared.unwrap_or(layer.len() as u64)}],
        }))
        .unwrap();
        Self {
            manifest,
            config,
            layer,
            layer_digest,
        }
    }

    fn digest(&self) -> String {
        sha256(&self.manifest)
    }
}

/// A registry of one image on 127.0.0.1: plain HTTP/1.1, one request per connection,
/// each connection served by its own task (a trickle holds only its own).
struct TestRegistry {
    address: String,
    served: Arc<Served>,
    layer_requested: tokio::sync::watch::Receiver<u64>,
    server: tokio::task::JoinHandle<()>,
}

impl Drop for TestRegistry {
    fn drop(&mut self) {
        self.server.abort();
    }
}

impl TestRegistry {
    async fn start(image: TestImage, manifest: ManifestBody, layer: LayerBody) -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap().to_string();
        let served = Arc::new(Served::default());
        let (requested_tx, layer_requested) = tokio::sync::watch::channel(0u64);
        let requested_tx = Arc::new(requested_tx);
        let image = Arc::new(image);
        let counts = served.clone();
        let server = tokio::spawn(async move {
            let mut connections = tokio::task::JoinSet::new();
            while let Ok((stream, _)) = listener.accept().await {
                connections.spawn(serve(
                    stream,
                    image.clone(),
                    manifest,
                    layer,
                    counts.clone(),
                    requested_tx.clone(),
                ));
            }
        });
        Self {
            address,
            served,
            layer_requested,
            server,
        }
    }

    fn image(&self, name: &str) -> String {
        format!("{}/{name}", self.address)
    }

    fn layer_bytes(&self) -> u64 {
        self.served.layer_bytes.load(Ordering::SeqCst)
    }

    fn layer_requests(&self) -> u64 {
        self.served.layer_requests.load(Ordering::SeqCst)
    }

    fn manifest_bytes(&self) -> u64 {
        self.served.manifest_bytes.load(Ordering::SeqCst)
    }
}

fn head(status: &str, kind: &str, length: Option<u64>, digest: Option<&str>) -> Vec<u8> {
    let mut head = format!("HTTP/1.1 {status}\r\nContent-Type: {kind}\r\nConnection: close\r\n");
    if let Some(length) = length {
        head.push_str(&format!("Content-Length: {length}\r\n"));
    }
    if let Some(digest) = digest {
        head.push_str(&format!("Docker-Content-Digest: {digest}\r\n"));
    }
    head.push_str("\r\n");
    head.into_bytes()
}

async fn serve(
    mut stream: tokio::net::TcpStream,
    image: Arc<TestImage>,
    manifest: ManifestBody,
    layer: LayerBody,
    served: Arc<Served>,
    layer_requested: Arc<tokio::sync::watch::Sender<u64>>,
) {
    let mut request = Vec::new();
    let mut byte = [0u8; 1];
    while !request.ends_with(b"\r\n\r\n") {
        if stream.read_exact(&mut byte).await.is_err() {
            return;
        }
        request.push(byte[0]);
    }
    let request = String::from_utf8_lossy(&request).into_owned();
    let mut words = request.split_whitespace();
    let (method, path) = (words.next().unwrap_or(""), words.next().unwrap_or(""));
    let octets = "application/octet-stream";
    if path.contains("/manifests/") {
        let kind = "application/vnd.oci.image.manifest.v1+json";
        match manifest {
            ManifestBody::Index if !path.ends_with(&image.digest()) => {
                let entry = |arch: &str, digest: &str| {
                    serde_json::json!({"mediaType": kind, "digest": digest,
                        "size": image.manifest.len(),
                        "platform": {"architecture": arch, "os": "linux"}})
                };
                let index = serde_json::to_vec(&serde_json::json!({
                    "schemaVersion": 2,
                    "mediaType": "application/vnd.oci.image.index.v1+json",
                    "manifests": [entry("arm64", &sha256(b"another platform")),
                                  entry("amd64", &image.digest())],
                }))
                .unwrap();
                let mut response = head(
                    "200 OK",
                    "application/vnd.oci.image.index.v1+json",
                    Some(index.len() as u64),
                    Some(&sha256(&index)),
                );
                response.extend_from_slice(&index);
                let _ = stream.write_all(&response).await;
            }
            ManifestBody::Whole | ManifestBody::Index => {
                let digest = image.digest();
                let mut response = head(
                    "200 OK",
                    kind,
                    Some(image.manifest.len() as u64),
                    Some(&digest),
                );
                if method != "HEAD" {
                    response.extend_from_slice(&image.manifest);
                }
                let _ = stream.write_all(&response).await;
            }
            ManifestBody::Huge {
                bytes,
                content_length,
            } => {
                let length = content_length.then_some(bytes);
                if stream
                    .write_all(&head("200 OK", kind, length, None))
                    .await
                    .is_err()
                    || method == "HEAD"
                {
                    return;
                }
                let chunk = vec![b' '; 64 << 10];
                let mut left = bytes;
                while left > 0 {
                    let n = left.min(chunk.len() as u64) as usize;
                    if stream.write_all(&chunk[..n]).await.is_err() {
                        return;
                    }
                    served.manifest_bytes.fetch_add(n as u64, Ordering::SeqCst);
                    left -= n as u64;
                }
            }
        }
    } else if path.ends_with(&image.layer_digest) {
        served.layer_requests.fetch_add(1, Ordering::SeqCst);
        layer_requested.send_modify(|n| *n += 1);
        let length = image.layer.len() as u64;
        if stream
            .write_all(&head("200 OK", octets, Some(length), None))
            .await
            .is_err()
        {
            return;
        }
        match layer {
            LayerBody::Whole => {
                if stream.write_all(&image.layer).await.is_ok() {
                    served.layer_bytes.fetch_add(length, Ordering::SeqCst);
                }
            }
            LayerBody::Trickle => {
                for byte in &image.layer {
                    if stream.write_all(std::slice::from_ref(byte)).await.is_err() {
                        return;
                    }
                    served.layer_bytes.fetch_add(1, Ordering::SeqCst);
                    // The behaviour under test: a registry that sends 4 bytes a second.
                    tokio::time::sleep(Duration::from_millis(250)).await;
                }
            }
        }
    } else if path.contains("/blobs/") {
        let mut response = head("200 OK", octets, Some(image.config.len() as u64), None);
        response.extend_from_slice(&image.config);
        let _ = stream.write_all(&response).await;
    } else {
        // `/v2/`: no authentication asked for.
        let mut response = head("200 OK", "application/json", Some(2), None);
        response.extend_from_slice(b"{}");
        let _ = stream.write_all(&response).await;
    }
}

fn request(image: &str) -> FetchRequest<'_> {
    FetchRequest {
        pull: PullRequest {
            image,
            tls: INSECURE,
            secret: None,
        },
        digest: None,
        selection: kmm_extract::Selection {
            dir_name: "/opt".into(),
            kernel: KERNEL.into(),
            firmware_path: None,
            host_modules: None,
        },
    }
}

fn error_text(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    text
}

fn blobs(cache: &Path) -> Vec<PathBuf> {
    tree(&cache.join("blobs/sha256"))
}

/// The pull deadline the tests give the agent.
const DEADLINE: Duration = Duration::from_secs(2);

/// A store over `cache` with a short pull deadline and the other limits as shipped,
/// counting in `metrics`.
fn store_with_metrics(cache: &Path, metrics: &Metrics) -> ImageStore {
    ImageStore::new(Cache::open(cache).unwrap(), Limits::default())
        .with_pull_limits(PullLimits {
            deadline: DEADLINE,
            ..PullLimits::default()
        })
        .with_metrics(metrics.clone())
}

fn store(cache: &Path) -> ImageStore {
    store_with_metrics(cache, &Metrics::register(&mut Default::default()))
}

/// `kmm_agent_pull_limits_exceeded_total` for `limit`.
fn limit_count(registry: &prometheus_client::registry::Registry, limit: &str) -> String {
    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, registry).unwrap();
    let prefix = format!("kmm_agent_pull_limits_exceeded_total{{limit=\"{limit}\"}} ");
    text.lines()
        .find_map(|l| l.strip_prefix(&prefix))
        .unwrap_or("0")
        .to_string()
}

/// The longest a test waits for a pull that must give up by itself.
const GIVE_UP: Duration = Duration::from_secs(20);

#[tokio::test]
async fn a_trickling_layer_gives_up_at_the_pull_deadline() {
    let registry = TestRegistry::start(
        TestImage::new(module_layer(4096), TAR, None),
        ManifestBody::Whole,
        LayerBody::Trickle,
    )
    .await;
    let image = registry.image("bounds/trickle:v1");
    let cache = tempfile::tempdir().unwrap();
    let mut metrics_registry = prometheus_client::registry::Registry::default();
    let store = store_with_metrics(cache.path(), &Metrics::register(&mut metrics_registry));
    let started = Instant::now();
    let err = tokio::time::timeout(GIVE_UP, store.fetch(&request(&image)))
        .await
        .unwrap_or_else(|_| {
            panic!(
                "still pulling after {GIVE_UP:?} ({} bytes of the layer served)",
                registry.layer_bytes()
            )
        })
        .unwrap_err();
    let took = started.elapsed();
    assert!(
        took < DEADLINE + Duration::from_secs(2),
        "gave up after {took:?}, its deadline is {DEADLINE:?}"
    );
    let text = error_text(&err);
    assert!(text.contains(&image), "{text}");
    assert!(text.contains("deadline of 2s"), "{text}");
    assert!(text.contains("--pull-timeout-seconds"), "{text}");
    assert_eq!(limit_count(&metrics_registry, "pull_deadline"), "1");
    assert!(registry.layer_bytes() > 0, "the layer was trickling");
    assert!(blobs(cache.path()).is_empty(), "{:?}", blobs(cache.path()));
    assert!(tree(&cache.path().join("tmp")).is_empty());
    eprintln!("gave up after {took:?}");
}

#[tokio::test]
async fn a_layer_declaring_ten_tebibytes_is_refused_before_any_byte_is_read() {
    let registry = TestRegistry::start(
        TestImage::new(module_layer(4096), TAR, Some(10 << 40)),
        ManifestBody::Whole,
        LayerBody::Trickle,
    )
    .await;
    let image = registry.image("bounds/huge-layer:v1");
    let cache = tempfile::tempdir().unwrap();
    let mut metrics_registry = prometheus_client::registry::Registry::default();
    let store = store_with_metrics(cache.path(), &Metrics::register(&mut metrics_registry));
    let result = tokio::time::timeout(GIVE_UP, store.fetch(&request(&image))).await;
    assert_eq!(
        (registry.layer_requests(), registry.layer_bytes()),
        (0, 0),
        "the layer was asked for"
    );
    let text = error_text(&result.expect("refused at once").unwrap_err());
    assert!(text.contains(&image), "{text}");
    assert!(text.contains("10995116277760"), "{text}");
    assert!(text.contains("--max-layer-bytes"), "{text}");
    assert_eq!(limit_count(&metrics_registry, "layer_bytes"), "1");
    assert!(blobs(cache.path()).is_empty());
}

#[tokio::test]
async fn layers_that_would_overfill_the_cache_are_refused_before_any_byte_is_read() {
    let registry = TestRegistry::start(
        TestImage::new(module_layer(64 << 10), TAR, None),
        ManifestBody::Whole,
        LayerBody::Whole,
    )
    .await;
    let image = registry.image("bounds/cache:v1");
    let cache = tempfile::tempdir().unwrap();
    let mut metrics_registry = prometheus_client::registry::Registry::default();
    let store = ImageStore::new(Cache::open(cache.path()).unwrap(), Limits::default())
        .with_pull_limits(PullLimits {
            max_cache_bytes: 32 << 10,
            ..PullLimits::default()
        })
        .with_metrics(Metrics::register(&mut metrics_registry));
    let text = error_text(&store.fetch(&request(&image)).await.unwrap_err());
    assert_eq!(registry.layer_requests(), 0, "the layer was asked for");
    assert!(text.contains(&image), "{text}");
    assert!(text.contains("--max-cache-bytes"), "{text}");
    assert_eq!(limit_count(&metrics_registry, "cache_bytes"), "1");
    assert!(blobs(cache.path()).is_empty());
}

#[tokio::test]
async fn a_huge_manifest_is_refused_at_the_cap_without_being_read_whole() {
    const HUGE: u64 = 256 << 20;
    for content_length in [true, false] {
        let registry = TestRegistry::start(
            TestImage::new(module_layer(4096), TAR, None),
            ManifestBody::Huge {
                bytes: HUGE,
                content_length,
            },
            LayerBody::Whole,
        )
        .await;
        let image = registry.image("bounds/huge-manifest:v1");
        let cache = tempfile::tempdir().unwrap();
        let store = store(cache.path());
        let err = tokio::time::timeout(GIVE_UP, store.fetch(&request(&image)))
            .await
            .expect("refused in time")
            .unwrap_err();
        let text = error_text(&err);
        assert!(text.contains(&image), "{text}");
        assert!(text.contains("--max-manifest-bytes"), "{text}");
        // What the kernel's socket buffers took is all that left the server.
        let served = registry.manifest_bytes();
        assert!(
            served < 32 << 20,
            "content length {content_length}: {served} bytes of the manifest were read"
        );
    }
}

/// Manifests are read by the agent's own capped reader now: an image index still
/// resolves to this platform's manifest, as `oci-client` resolved it.
#[cfg(target_arch = "x86_64")]
#[tokio::test]
async fn an_image_index_resolves_to_this_platforms_manifest() {
    let test_image = TestImage::new(module_layer(4096), TAR, None);
    let digest = test_image.digest();
    let registry = TestRegistry::start(test_image, ManifestBody::Index, LayerBody::Whole).await;
    let image = registry.image("bounds/index:v1");
    let cache = tempfile::tempdir().unwrap();
    let fetched = store(cache.path()).fetch(&request(&image)).await.unwrap();
    assert_eq!(fetched.digest, digest);
    assert!(
        fetched
            .root
            .join(format!("opt/lib/modules/{KERNEL}/extra/kmm_bounds.ko"))
            .is_file()
    );
}

/// A tmpfs mounted on a temporary directory, unmounted on drop (also when the test
/// fails).
struct Tmpfs {
    dir: tempfile::TempDir,
}

impl Tmpfs {
    fn mount(bytes: u64) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let out = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={bytes}"), "kmm-bounds"])
            .arg(dir.path())
            .output()
            .expect("running mount");
        assert!(
            out.status.success(),
            "this test needs a small filesystem that really fills: mounting a tmpfs on {} \
             failed ({}; it needs root and the mount syscall): {}",
            dir.path().display(),
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
        Self { dir }
    }

    fn resize(&self, bytes: u64) {
        let out = Command::new("mount")
            .args(["-o", &format!("remount,size={bytes}")])
            .arg(self.dir.path())
            .output()
            .expect("running mount");
        assert!(
            out.status.success(),
            "remounting: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// Bytes free for files, in whole pages.
    fn free(&self) -> u64 {
        let out = Command::new("stat")
            .args(["-f", "-c", "%a %S"])
            .arg(self.dir.path())
            .output()
            .expect("running stat");
        let text = String::from_utf8(out.stdout).unwrap();
        let mut words = text.split_whitespace().map(|w| w.parse::<u64>().unwrap());
        words.next().unwrap() * words.next().unwrap()
    }

    fn path(&self) -> &Path {
        self.dir.path()
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(self.dir.path()).status();
    }
}

/// The filesystem fills while the layer is written: the write that fails is the last
/// one (the layer is one tar block larger than the room left after the manifest), whose
/// error only a flush reports. The blob must not enter the cache, and once there is
/// room the next try succeeds.
#[tokio::test]
async fn a_blob_that_does_not_fit_is_never_cached_and_the_next_try_succeeds() {
    const PAGE: u64 = 4096;
    let fs = Tmpfs::mount(1 << 20);
    let cache_dir = fs.path().join("cache");
    let cache = Cache::open(&cache_dir).unwrap();
    // The manifest takes one page; the layer then misses the room by one tar block.
    let room = fs.free() - PAGE;
    let layer_size = room + 512;
    // A tar of one file: a header block, the data, two end blocks.
    let layer = module_layer((layer_size - 3 * 512) as usize);
    assert_eq!(layer.len() as u64, layer_size);
    let registry = TestRegistry::start(
        TestImage::new(layer, TAR, None),
        ManifestBody::Whole,
        LayerBody::Whole,
    )
    .await;
    let image = registry.image("bounds/full:v1");
    let store = ImageStore::new(cache, Limits::default());
    let result = store.fetch(&request(&image)).await;
    assert!(
        blobs(&cache_dir).is_empty(),
        "a blob that did not fit entered the cache: {:?} (the pull: {result:?})",
        blobs(&cache_dir)
    );
    let text = error_text(&result.unwrap_err());
    assert!(text.contains("No space left on device"), "{text}");
    assert!(tree(&cache_dir.join("tmp")).is_empty());

    // Room for the blob and its extracted copy.
    fs.resize(4 << 20);
    let fetched = store.fetch(&request(&image)).await.unwrap();
    let module = fetched
        .root
        .join(format!("opt/lib/modules/{KERNEL}/extra/kmm_bounds.ko"));
    assert_eq!(
        std::fs::metadata(&module).unwrap().len(),
        layer_size - 3 * 512
    );
    assert_eq!(registry.layer_requests(), 2, "downloaded again");
}

#[tokio::test]
async fn a_failed_extraction_removes_the_cached_blob() {
    // A file larger than the extraction allows: the blob is fine, the image is refused.
    let registry = TestRegistry::start(
        TestImage::new(module_layer(4096), TAR, None),
        ManifestBody::Whole,
        LayerBody::Whole,
    )
    .await;
    let image = registry.image("bounds/refused:v1");
    let cache = tempfile::tempdir().unwrap();
    let store = ImageStore::new(
        Cache::open(cache.path()).unwrap(),
        Limits {
            max_file_bytes: 1024,
            ..Limits::default()
        },
    );
    let err = store.fetch(&request(&image)).await.unwrap_err();
    assert!(matches!(err, ImageError::Refused { .. }), "{err:?}");
    assert!(
        blobs(cache.path()).is_empty(),
        "the blob stays after its extraction failed: {:?}",
        blobs(cache.path())
    );
    // The next try downloads it again.
    let _ = store.fetch(&request(&image)).await.unwrap_err();
    assert_eq!(registry.layer_requests(), 2);
}

#[tokio::test]
async fn a_corrupt_cached_blob_is_detected_on_reuse_and_downloaded_again() {
    let registry = TestRegistry::start(
        TestImage::new(module_layer(64 << 10), TAR, None),
        ManifestBody::Whole,
        LayerBody::Whole,
    )
    .await;
    let image = registry.image("bounds/reuse:v1");
    let cache = tempfile::tempdir().unwrap();
    let store = store(cache.path());
    store.fetch(&request(&image)).await.unwrap();
    let cached = blobs(cache.path());
    assert_eq!(cached.len(), 1, "{cached:?}");
    let whole = std::fs::read(&cached[0]).unwrap();
    for (name, bad) in [
        ("truncated", whole[..whole.len() / 2].to_vec()),
        ("flipped", {
            let mut bad = whole.clone();
            bad[1000] ^= 0xff;
            bad
        }),
    ] {
        std::fs::write(&cached[0], &bad).unwrap();
        // Another selection of the same image: extracted again from the cached blob.
        let mut other = request(&image);
        other.selection.firmware_path = Some(format!("/{name}"));
        let fetched = store.fetch(&other).await.unwrap_or_else(|e| {
            panic!(
                "{name}: the corrupt cached blob was used: {}",
                error_text(&e)
            )
        });
        assert!(
            fetched
                .root
                .join(format!("opt/lib/modules/{KERNEL}/extra/kmm_bounds.ko"))
                .is_file(),
            "{name}"
        );
        assert_eq!(std::fs::read(&cached[0]).unwrap(), whole, "{name}");
    }
    assert_eq!(registry.layer_requests(), 3, "downloaded again each time");
}

/// A kernel that only keeps names: enough for unloads.
#[derive(Debug, Default)]
struct NamesKernel {
    loaded: Mutex<BTreeSet<String>>,
}

impl Kernel for NamesKernel {
    fn backend(&self) -> &'static str {
        "names"
    }
    fn boot_id(&self) -> Result<String, KernelError> {
        Ok("boot-1".into())
    }
    fn release(&self) -> Result<String, KernelError> {
        Ok(KERNEL.into())
    }
    fn loaded_modules(&self) -> Result<BTreeSet<String>, KernelError> {
        Ok(self.loaded.lock().unwrap().clone())
    }
    fn modprobe(&self, command: &ModprobeCommand) -> Result<(), KernelError> {
        let module = command.args.last().cloned().unwrap_or_default();
        let mut loaded = self.loaded.lock().unwrap();
        if command.args.first().map(String::as_str) == Some("-r") {
            loaded.remove(&module);
        } else {
            loaded.insert(module);
        }
        Ok(())
    }
    fn remove_in_tree(&self, _module: &str) -> Result<(), KernelError> {
        Ok(())
    }
    fn module_users(&self) -> Result<Users, KernelError> {
        let loaded = self.loaded.lock().unwrap();
        Ok(loaded
            .iter()
            .map(|m| (m.clone(), BTreeSet::new()))
            .collect())
    }
    fn remove_module(&self, module: &str) -> Result<(), KernelError> {
        self.loaded.lock().unwrap().remove(module);
        Ok(())
    }
    fn set_firmware_class_path(&self, _dir: &Path) -> Result<(), KernelError> {
        Ok(())
    }
}

/// The agent loop pulls `a` from a registry that trickles; meanwhile the control plane
/// asks to unload `b`: the unload happens at once, not after the pull.
#[tokio::test]
async fn an_unload_does_not_wait_behind_a_stuck_pull() {
    let registry = TestRegistry::start(
        TestImage::new(module_layer(4096), TAR, None),
        ManifestBody::Whole,
        LayerBody::Trickle,
    )
    .await;
    let node = tempfile::tempdir().unwrap();
    let kernel = Arc::new(NamesKernel::default());
    kernel.loaded.lock().unwrap().insert("kmm_b".into());
    let store = StateStore::new(node.path().join("run-kmm"));
    let b = ModuleRecord {
        key: "ns/b".into(),
        version: None,
        image: "example.invalid/b:v1".into(),
        digest: sha256(b"b"),
        kernel: KERNEL.into(),
        module_dir: node.path().join("cache/extracted/b/opt"),
        modprobe: Modprobe {
            module_name: Some("kmm_b".into()),
            ..Modprobe::default()
        },
        in_tree_modules_to_remove: vec![],
        loaded: vec!["kmm_b".into()],
        firmware_files: vec![],
        loaded_at_unix_ms: 0,
    };
    store
        .save(&State {
            boot_id: "boot-1".into(),
            modules: [(b.key.clone(), b)].into(),
        })
        .unwrap();
    let reconciler = Reconciler::new(
        kernel.clone(),
        ImageStore::new(
            Cache::open(node.path().join("cache")).unwrap(),
            Limits::default(),
        ),
        store,
        node.path().join("firmware"),
    )
    .unwrap();
    let a = DesiredModule {
        key: "ns/a".into(),
        version: None,
        image: registry.image("bounds/stuck:v1"),
        digest: None,
        modprobe: Modprobe {
            module_name: Some("kmm_bounds".into()),
            ..Modprobe::default()
        },
        in_tree_modules_to_remove: vec![],
        registry_tls: INSECURE,
        pull_secret: None,
    };
    let ((intents, intent_rx), (event_tx, mut events)) = control::channels();
    intents
        .send(Some(DesiredSnapshot {
            revision: 1,
            modules: vec![a.clone()],
            unload: vec![],
        }))
        .unwrap();
    let agent = tokio::spawn(agent::run(
        reconciler,
        intent_rx,
        event_tx,
        LoopTiming::default(),
    ));
    // The pull of `a` is under way (and trickles).
    let mut requested = registry.layer_requested.clone();
    tokio::time::timeout(Duration::from_secs(10), requested.wait_for(|n| *n > 0))
        .await
        .expect("the agent asks for a's layer")
        .unwrap();
    let asked = Instant::now();
    intents
        .send(Some(DesiredSnapshot {
            revision: 2,
            modules: vec![a],
            unload: vec!["ns/b".into()],
        }))
        .unwrap();
    let unloaded = tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            let event = events.recv().await.expect("the agent runs");
            if event.key == "ns/b" && event.action == EventAction::Unload {
                return event;
            }
        }
    })
    .await
    .unwrap_or_else(|_| {
        panic!(
            "no unload of b 10 s after asking, while a's pull trickles ({} bytes served)",
            registry.layer_bytes()
        )
    });
    assert!(unloaded.is_success(), "{unloaded:?}");
    assert!(!kernel.loaded.lock().unwrap().contains("kmm_b"));
    eprintln!("b unloaded {:?} after asking", asked.elapsed());
    agent.abort();
}
