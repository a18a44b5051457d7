//! Pulling: plain HTTP, TLS with htpasswd auth, moved tags, zstd, hostile images.

use std::time::SystemTime;

use kmm_node_agent::desired::{PullSecret, RegistryTls};
use kmm_node_agent::image::cache::Cache;
use kmm_node_agent::image::pull::{PullError, PullRequest};
use kmm_node_agent::image::{FetchRequest, ImageError, ImageStore, Limits};
use kmm_registry_fixture::{docker_config_json, internal_ca};

use crate::support::*;

fn selection(kernel: &str) -> kmm_extract::Selection {
    kmm_extract::Selection {
        dir_name: "/opt".into(),
        kernel: kernel.into(),
        firmware_path: Some("/firmware".into()),
        host_modules: None,
    }
}

fn request<'a>(
    image: &'a str,
    tls: RegistryTls,
    secret: Option<&'a PullSecret>,
) -> FetchRequest<'a> {
    FetchRequest {
        pull: PullRequest { image, tls, secret },
        digest: None,
        selection: selection(kernel()),
    }
}

const INSECURE: RegistryTls = RegistryTls {
    insecure: true,
    insecure_skip_tls_verify: false,
};
const SKIP_VERIFY: RegistryTls = RegistryTls {
    insecure: false,
    insecure_skip_tls_verify: true,
};

#[tokio::test]
async fn pulls_extracts_and_caches_over_plain_http() {
    let k = kernel();
    let registry = Registry::plain();
    let digest = registry
        .push_sample("samples/hello:v1", &Sample::good(k))
        .await;
    let image = registry.image("samples/hello:v1");
    let cache_dir = tempfile::tempdir().unwrap();
    let store = ImageStore::new(Cache::open(cache_dir.path()).unwrap(), Limits::default());

    let fetched = store.fetch(&request(&image, INSECURE, None)).await.unwrap();
    assert_eq!(fetched.digest, digest);
    assert!(fetched.fresh);
    let modules = fetched.root.join("opt/lib/modules").join(k);
    assert!(modules.join("extra/kmm_hello.ko").is_file());
    assert!(modules.join("modules.dep").is_file());
    assert_eq!(
        std::fs::read(fetched.root.join("firmware/kmm/hello.bin")).unwrap(),
        b"firmware v1"
    );
    assert!(
        !fetched.root.join("usr").exists(),
        "unrelated content was extracted"
    );

    // Cached: nothing downloaded or extracted again.
    let again = store.fetch(&request(&image, INSECURE, None)).await.unwrap();
    assert!(!again.fresh);
    assert_eq!(again.root, fetched.root);

    // Garbage collection keeps what is in use and removes the rest.
    let keep = [digest.clone()].into_iter().collect();
    assert_eq!(
        store.gc(&keep, SystemTime::now()).unwrap(),
        Default::default()
    );
    let report = store.gc(&Default::default(), SystemTime::now()).unwrap();
    assert_eq!(
        (report.manifests, report.blobs, report.extracted),
        (1, 1, 1)
    );
    assert!(!fetched.root.exists());
    assert!(
        tree(&cache_dir.path().join("blobs"))
            .iter()
            .all(|p| p.is_dir())
    );
}

/// Two agents sharing a node's cache (a DaemonSet update runs the old and the new one)
/// fetch the same image at once: both get the one extracted tree.
#[tokio::test]
async fn agents_sharing_a_cache_fetch_the_same_image_at_once() {
    let k = kernel();
    let registry = Registry::plain();
    registry
        .push_sample("samples/hello:shared", &Sample::good(k))
        .await;
    let image = registry.image("samples/hello:shared");
    let cache_dir = tempfile::tempdir().unwrap();
    for round in 0..5 {
        let stores: Vec<ImageStore> = (0..3)
            .map(|_| ImageStore::new(Cache::open(cache_dir.path()).unwrap(), Limits::default()))
            .collect();
        let wanted = request(&image, INSECURE, None);
        let (a, b, c) = tokio::join!(
            stores[0].fetch(&wanted),
            stores[1].fetch(&wanted),
            stores[2].fetch(&wanted)
        );
        let roots: Vec<_> = [a, b, c]
            .into_iter()
            .map(|f| f.unwrap_or_else(|e| panic!("round {round}: {e}")).root)
            .collect();
        assert!(roots.iter().all(|r| r == &roots[0]));
        assert!(
            roots[0]
                .join("opt/lib/modules")
                .join(k)
                .join("extra/kmm_hello.ko")
                .is_file()
        );
        assert!(
            std::fs::read_dir(cache_dir.path().join("tmp"))
                .unwrap()
                .next()
                .is_none(),
            "round {round}: nothing left in tmp"
        );
        stores[0]
            .gc(&Default::default(), SystemTime::now())
            .unwrap();
    }
}

#[tokio::test]
async fn https_without_verification_is_refused_unless_asked_for() {
    let registry = Registry::tls_with_auth("vendor", "right");
    registry
        .push_sample("samples/hello:v1", &Sample::good(kernel()))
        .await;
    let image = registry.image("samples/hello:v1");
    let secret =
        PullSecret::DockerConfigJson(docker_config_json(&registry.addr, "vendor", "right"));
    let cache = tempfile::tempdir().unwrap();
    let store = ImageStore::new(Cache::open(cache.path()).unwrap(), Limits::default());
    let err = store
        .fetch(&request(&image, RegistryTls::default(), Some(&secret)))
        .await
        .unwrap_err();
    let text = kmm_error_text(&err);
    assert!(text.to_lowercase().contains("certificate"), "{text}");
    // Plain HTTP against a TLS port fails as well.
    assert!(
        store
            .fetch(&request(&image, INSECURE, Some(&secret)))
            .await
            .is_err()
    );
}

#[tokio::test]
async fn a_registry_behind_an_internal_ca_is_verified_with_the_ca_file_read_at_each_pull() {
    let (ca, ca_key) = internal_ca("kmm-agent-test internal CA");
    let (other, _) = internal_ca("another internal CA");
    let registry = Registry::tls_issued_by(&ca, &ca_key);
    let digest = registry
        .push_sample("private-ca/hello:v1", &Sample::good(kernel()))
        .await;
    let image = registry.image("private-ca/hello:v1");
    let verified = RegistryTls::default();
    let dir = tempfile::tempdir().unwrap();
    let ca_file = dir.path().join("ca.crt");
    let store = |cache: &std::path::Path| {
        ImageStore::new(Cache::open(cache).unwrap(), Limits::default())
            .with_registry_ca_file(Some(ca_file.clone()))
    };

    // Another CA, then the right one: the same store sees the file change.
    std::fs::write(&ca_file, &other).unwrap();
    let cache = tempfile::tempdir().unwrap();
    let trusting = store(cache.path());
    let refused = trusting
        .fetch(&request(&image, verified, None))
        .await
        .unwrap_err();
    assert!(
        kmm_error_text(&refused)
            .to_lowercase()
            .contains("certificate"),
        "{}",
        kmm_error_text(&refused)
    );
    std::fs::write(&ca_file, format!("{other}{ca}")).unwrap();
    let fetched = trusting
        .fetch(&request(&image, verified, None))
        .await
        .unwrap();
    assert_eq!(fetched.digest, digest, "no insecureSkipTLSVerify needed");

    // Without the file, the system's CAs alone do not know the registry's.
    let cache = tempfile::tempdir().unwrap();
    let plain = ImageStore::new(Cache::open(cache.path()).unwrap(), Limits::default());
    let text = kmm_error_text(
        &plain
            .fetch(&request(&image, verified, None))
            .await
            .unwrap_err(),
    );
    assert!(text.to_lowercase().contains("certificate"), "{text}");

    // A bundle that is not one fails the pull naming the file and the variables.
    std::fs::write(
        &ca_file,
        "-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n",
    )
    .unwrap();
    let cache = tempfile::tempdir().unwrap();
    let error = store(cache.path())
        .fetch(&request(&image, verified, None))
        .await
        .unwrap_err();
    assert!(
        matches!(error, ImageError::Pull(PullError::RegistryCa { .. })),
        "{error:?}"
    );
    let text = error.to_string();
    assert!(
        text.contains(&ca_file.display().to_string())
            && text.contains("REGISTRY_CA_BUNDLE_n")
            && text.contains("PEM block 1 is not an X.509 certificate"),
        "{text}"
    );
}

fn kmm_error_text(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    text
}

#[tokio::test]
async fn htpasswd_auth_with_right_and_wrong_credentials() {
    let registry = Registry::tls_with_auth("vendor", "right");
    let digest = registry
        .push_sample("private/hello:v1", &Sample::good(kernel()))
        .await;
    let image = registry.image("private/hello:v1");
    let cache = tempfile::tempdir().unwrap();
    let store = ImageStore::new(Cache::open(cache.path()).unwrap(), Limits::default());

    let right = PullSecret::DockerConfigJson(docker_config_json(&registry.addr, "vendor", "right"));
    let fetched = store
        .fetch(&request(&image, SKIP_VERIFY, Some(&right)))
        .await
        .unwrap();
    assert_eq!(fetched.digest, digest);

    // Legacy .dockercfg content works too.
    use base64::Engine;
    let auth = base64::engine::general_purpose::STANDARD.encode("vendor:right");
    let legacy = PullSecret::DockerCfg(
        serde_json::json!({ registry.addr.clone(): { "auth": auth } }).to_string(),
    );
    let cache2 = tempfile::tempdir().unwrap();
    let store2 = ImageStore::new(Cache::open(cache2.path()).unwrap(), Limits::default());
    store2
        .fetch(&request(&image, SKIP_VERIFY, Some(&legacy)))
        .await
        .unwrap();

    for secret in [
        Some(PullSecret::DockerConfigJson(docker_config_json(
            &registry.addr,
            "vendor",
            "wrong",
        ))),
        Some(PullSecret::DockerConfigJson(docker_config_json(
            "other.example",
            "vendor",
            "right",
        ))),
        None,
    ] {
        let cache = tempfile::tempdir().unwrap();
        let store = ImageStore::new(Cache::open(cache.path()).unwrap(), Limits::default());
        let err = store
            .fetch(&request(&image, SKIP_VERIFY, secret.as_ref()))
            .await
            .unwrap_err();
        assert!(
            matches!(&err, ImageError::Pull(PullError::Registry(e)) if e.is_unauthorized()),
            "{secret:?}: {err:?}"
        );
        let text = kmm_error_text(&err);
        assert!(text.contains("refused the credentials"), "{text}");
        assert!(
            !text.contains("wrong") && !text.contains("right"),
            "secret in error: {text}"
        );
        assert!(tree(&cache.path().join("extracted")).is_empty());
    }
}

#[tokio::test]
async fn a_moved_tag_does_not_change_what_was_resolved() {
    let k = kernel();
    let registry = Registry::plain();
    let first = registry
        .push_sample("samples/hello:stable", &Sample::good(k))
        .await;
    let image = registry.image("samples/hello:stable");
    let cache = tempfile::tempdir().unwrap();
    let store = ImageStore::new(Cache::open(cache.path()).unwrap(), Limits::default());
    let fetched = store.fetch(&request(&image, INSECURE, None)).await.unwrap();
    assert_eq!(fetched.digest, first);

    let mut moved = Sample::good(k);
    moved.firmware = vec![("kmm/hello.bin".into(), b"firmware v2".to_vec())];
    let second = registry.push_sample("samples/hello:stable", &moved).await;
    assert_ne!(first, second, "the tag did not move");

    // The same agent keeps the digest it resolved...
    let again = store.fetch(&request(&image, INSECURE, None)).await.unwrap();
    assert_eq!(again.digest, first);
    assert_eq!(
        std::fs::read(again.root.join("firmware/kmm/hello.bin")).unwrap(),
        b"firmware v1"
    );
    // ...and an explicit digest still pulls exactly that image.
    let mut pinned = request(&image, INSECURE, None);
    pinned.digest = Some(&second);
    let fetched = store.fetch(&pinned).await.unwrap();
    assert_eq!(
        std::fs::read(fetched.root.join("firmware/kmm/hello.bin")).unwrap(),
        b"firmware v2"
    );
}

#[tokio::test]
async fn zstd_layers_and_multiple_layers() {
    let k = kernel();
    let registry = Registry::plain();
    let base = Sample::good(k).tar();
    let top = raw_tar(&[
        Raw::File(
            format!("opt/lib/modules/{k}/extra/.wh.kmm_hello_dep.ko"),
            vec![],
        ),
        Raw::File("firmware/kmm/extra.bin".into(), b"zstd layer".to_vec()),
    ]);
    registry
        .push(
            "samples/layers:v1",
            vec![gzip_layer(&base), zstd_layer(&top)],
        )
        .await;
    let image = registry.image("samples/layers:v1");
    let cache = tempfile::tempdir().unwrap();
    let store = ImageStore::new(Cache::open(cache.path()).unwrap(), Limits::default());
    let fetched = store.fetch(&request(&image, INSECURE, None)).await.unwrap();
    let extra = fetched.root.join("opt/lib/modules").join(k).join("extra");
    assert!(extra.join("kmm_hello.ko").is_file());
    assert!(
        !extra.join("kmm_hello_dep.ko").exists(),
        "whiteout not honoured"
    );
    assert_eq!(
        std::fs::read(fetched.root.join("firmware/kmm/extra.bin")).unwrap(),
        b"zstd layer"
    );
}

#[tokio::test]
async fn hostile_images_from_the_registry_are_refused_and_leave_nothing() {
    let k = kernel();
    let registry = Registry::plain();
    let m = |rest: &str| format!("opt/lib/modules/{k}/{rest}");
    let cases: Vec<(&str, Vec<PushLayer>, &str)> = vec![
        (
            "traversal",
            vec![gzip_layer(&raw_tar(&[Raw::File(
                m("../../../../../../escaped"),
                b"x".to_vec(),
            )]))],
            "contains `..`",
        ),
        (
            "absolute",
            vec![gzip_layer(&raw_tar(&[Raw::File(
                "/tmp/kmm-escaped".into(),
                b"x".to_vec(),
            )]))],
            "absolute path",
        ),
        (
            "symlink",
            vec![gzip_layer(&raw_tar(&[
                Raw::Symlink(m("evil"), "/etc".into()),
                Raw::File(m("evil/escaped"), b"x".to_vec()),
            ]))],
            "symbolic link",
        ),
        (
            "hardlink",
            vec![gzip_layer(&raw_tar(&[Raw::HardLink(
                m("passwd"),
                "etc/passwd".into(),
            )]))],
            "hard link",
        ),
        (
            "oversized",
            vec![gzip_layer(&raw_tar(&[Raw::File(
                m("big.ko"),
                vec![0; 4096],
            )]))],
            "per-file limit",
        ),
        (
            "corrupt",
            vec![PushLayer {
                media_type: GZIP,
                blob: b"\x1f\x8b\x08\x00 this is not deflate data at all".to_vec(),
                diff_id: "sha256:0000000000000000000000000000000000000000000000000000000000000000"
                    .into(),
            }],
            "corrupt",
        ),
    ];
    for (name, layers, expected) in cases {
        registry.push(&format!("hostile/{name}:v1"), layers).await;
        let image = registry.image(&format!("hostile/{name}:v1"));
        let sandbox = tempfile::tempdir().unwrap();
        let cache_dir = sandbox.path().join("cache");
        let store = ImageStore::new(
            Cache::open(&cache_dir).unwrap(),
            Limits {
                max_file_bytes: 1024,
                ..Limits::default()
            },
        );
        let err = store
            .fetch(&request(&image, INSECURE, None))
            .await
            .unwrap_err();
        assert!(matches!(err, ImageError::Refused { .. }), "{name}: {err:?}");
        let text = kmm_error_text(&err);
        assert!(text.contains(expected), "{name}: {text}");
        assert!(
            text.contains(&image),
            "{name}: the error does not name the image: {text}"
        );
        // Nothing extracted, nothing left in progress, nothing outside the cache.
        assert!(tree(&cache_dir.join("extracted")).is_empty(), "{name}");
        assert!(tree(&cache_dir.join("tmp")).is_empty(), "{name}");
        let outside: Vec<_> = tree(sandbox.path())
            .into_iter()
            .filter(|p| !p.starts_with(&cache_dir))
            .collect();
        assert!(outside.is_empty(), "{name}: {outside:?}");
        assert!(!std::path::Path::new("/tmp/kmm-escaped").exists());
        assert!(!std::path::Path::new("/escaped").exists());
    }
}

/// A registry that lies about one layer: it serves `served` for the layer the manifest
/// declares as `declared` (its digest and size). Plain HTTP/1.1, one request per
/// connection, on loopback.
struct LyingRegistry {
    address: String,
    _server: tokio::task::JoinHandle<()>,
}

impl LyingRegistry {
    async fn start(declared: &PushLayer, served: Vec<u8>) -> Self {
        use sha2::Digest as _;
        use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

        let digest = |bytes: &[u8]| format!("sha256:{:x}", sha2::Sha256::digest(bytes));
        let config = serde_json::to_vec(&serde_json::json!({
            "architecture": "amd64", "os": "linux",
            "rootfs": {"type": "layers", "diff_ids": [declared.diff_id]},
        }))
        .unwrap();
        let layer_digest = digest(&declared.blob);
        let manifest = serde_json::to_vec(&serde_json::json!({
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                       "digest": digest(&config), "size": config.len()},
            "layers": [{"mediaType": declared.media_type,
                        "digest": layer_digest, "size": declared.blob.len()}],
        }))
        .unwrap();
        let manifest_digest = digest(&manifest);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap().to_string();
        let server = tokio::spawn(async move {
            loop {
                let Ok((mut stream, _)) = listener.accept().await else {
                    return;
                };
                let mut head = Vec::new();
                let mut byte = [0u8; 1];
                while !head.ends_with(b"\r\n\r\n") {
                    if stream.read_exact(&mut byte).await.is_err() {
                        break;
                    }
                    head.push(byte[0]);
                }
                let head = String::from_utf8_lossy(&head).into_owned();
                let mut words = head.split_whitespace();
                let (method, path) = (words.next().unwrap_or(""), words.next().unwrap_or(""));
                let (body, kind): (&[u8], &str) = if path.contains("/manifests/") {
                    (&manifest, "application/vnd.oci.image.manifest.v1+json")
                } else if path.ends_with(&layer_digest) {
                    (&served, "application/octet-stream")
                } else if path.contains("/blobs/") {
                    (&config, "application/octet-stream")
                } else {
                    (b"{}", "application/json")
                };
                let mut response = format!(
                    "HTTP/1.1 200 OK\r\nContent-Type: {kind}\r\nContent-Length: {}\r\n\
                     Docker-Content-Digest: {manifest_digest}\r\nConnection: close\r\n\r\n",
                    body.len()
                )
                .into_bytes();
                if method != "HEAD" {
                    response.extend_from_slice(body);
                }
                let _ = stream.write_all(&response).await;
            }
        });
        Self {
            address,
            _server: server,
        }
    }
}

/// A layer bigger than its manifest says, or with other bytes than its digest says, is
/// refused and never reaches the cache, not even half-written.
#[tokio::test]
async fn a_layer_unlike_its_manifest_is_refused_and_never_cached() {
    let layer = gzip_layer(&Sample::good(kernel()).tar());
    let mut oversized = layer.blob.clone();
    oversized.extend(std::iter::repeat_n(0u8, 1 << 20));
    let mut corrupt = layer.blob.clone();
    let middle = corrupt.len() / 2;
    corrupt[middle] ^= 0xff;
    for (name, served, expected) in [
        ("oversized", oversized, "larger than the"),
        ("corrupt", corrupt, "digest"),
    ] {
        let registry = LyingRegistry::start(&layer, served).await;
        let image = format!("{}/lie:v1", registry.address);
        let cache_dir = tempfile::tempdir().unwrap();
        let store = ImageStore::new(Cache::open(cache_dir.path()).unwrap(), Limits::default());
        let err = store
            .fetch(&request(&image, INSECURE, None))
            .await
            .unwrap_err();
        let text = kmm_error_text(&err);
        assert!(text.contains(expected), "{name}: {text}");
        let blobs = tree(&cache_dir.path().join("blobs"));
        assert!(
            blobs.iter().all(|p| p.is_dir()),
            "{name}: a blob reached the cache: {blobs:?}"
        );
        assert!(tree(&cache_dir.path().join("tmp")).is_empty(), "{name}");
    }
}
