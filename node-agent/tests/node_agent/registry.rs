//! Pulling: plain HTTP, TLS with htpasswd auth, moved tags, zstd, hostile images.

use kmm_e2e::registry_server::docker_config_json;
use kmm_node_agent::desired::{PullSecret, RegistryTls};
use kmm_node_agent::image::cache::Cache;
use kmm_node_agent::image::pull::{PullError, PullRequest};
use kmm_node_agent::image::{FetchRequest, ImageError, ImageStore, Limits};

use crate::support::*;

fn selection(kernel: &str) -> kmm_extract::Selection {
    kmm_extract::Selection {
        dir_name: "/opt".into(),
        kernel: kernel.into(),
        firmware_path: Some("/firmware".into()),
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
    assert_eq!(store.gc(&keep).unwrap(), Default::default());
    let report = store.gc(&Default::default()).unwrap();
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
