//! `kmm-node-agent check-image` as a vendor runs it: exit codes and messages.

use kmm_registry_fixture::{docker_config_json, internal_ca};
use std::process::Command;

use crate::support::*;

fn check(
    registry: &Registry,
    image: &str,
    kernel: &str,
    module: &str,
    extra: &[&str],
) -> (i32, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_kmm-node-agent"))
        .args(["check-image", "--image"])
        .arg(registry.image(image))
        .args(["--kernel", kernel, "--module", module])
        .args(if registry.tls {
            &["--insecure-skip-tls-verify"][..]
        } else {
            &["--insecure"][..]
        })
        .args(extra)
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.code().expect("exited"), text)
}

#[tokio::test]
async fn check_image_outcomes() {
    let k = kernel();
    let registry = Registry::plain();
    let digest = registry
        .push_sample("samples/hello:v1", &Sample::good(k))
        .await;
    let mut filed_wrong = Sample::good(k);
    filed_wrong.kernel_dir = "6.1.0-99-amd64".into();
    registry
        .push_sample("samples/filed-wrong:v1", &filed_wrong)
        .await;
    let mut missing = Sample::good(k);
    missing.modules = vec![DEP_MODULE];
    registry
        .push_sample("samples/missing-dep:v1", &missing)
        .await;
    let mut listed = Sample::good(k);
    listed.removed_after_depmod = vec![MODULE];
    registry
        .push_sample("samples/listed-not-shipped:v1", &listed)
        .await;
    registry
        .push(
            "hostile/traversal:v1",
            vec![gzip_layer(&raw_tar(&[Raw::File(
                "../../escape".into(),
                b"x".to_vec(),
            )]))],
        )
        .await;

    let (code, text) = check(&registry, "samples/hello:v1", k, DEP_MODULE, &[]);
    assert_eq!(code, 0, "{text}");
    assert!(text.starts_with("OK") && text.contains(&digest), "{text}");
    assert!(text.contains(MODULE) && text.contains("unsigned"), "{text}");

    // Another kernel: no modules for it in the image.
    let (code, text) = check(
        &registry,
        "samples/hello:v1",
        "6.1.0-99-amd64",
        DEP_MODULE,
        &[],
    );
    assert_eq!(code, 6, "{text}");
    assert!(
        text.contains("wrong kernel") && text.contains("6.1.0-99-amd64"),
        "{text}"
    );
    // Filed under that kernel but built for another one: vermagic says so.
    let (code, text) = check(
        &registry,
        "samples/filed-wrong:v1",
        "6.1.0-99-amd64",
        DEP_MODULE,
        &[],
    );
    assert_eq!(code, 6, "{text}");
    assert!(text.contains(&format!("built for kernel {k}")), "{text}");

    let (code, text) = check(&registry, "samples/missing-dep:v1", k, DEP_MODULE, &[]);
    assert_eq!(code, 8, "{text}");
    assert!(
        text.contains("depends on kmm_hello, which is not in the image"),
        "{text}"
    );
    let (code, text) = check(
        &registry,
        "samples/listed-not-shipped:v1",
        k,
        DEP_MODULE,
        &[],
    );
    assert_eq!(code, 8, "{text}");
    assert!(
        text.contains("missing dependency") && text.contains("kmm_hello"),
        "{text}"
    );

    let (code, text) = check(&registry, "samples/hello:v1", k, "no_such_module", &[]);
    assert_eq!(code, 7, "{text}");
    assert!(text.contains("no_such_module"), "{text}");

    let (code, text) = check(
        &registry,
        "samples/hello:v1",
        k,
        DEP_MODULE,
        &["--require-signature"],
    );
    assert_eq!(code, 9, "{text}");

    let (code, text) = check(&registry, "hostile/traversal:v1", k, DEP_MODULE, &[]);
    assert_eq!(code, 5, "{text}");
    assert!(text.contains("`..`"), "{text}");

    let (code, text) = check(&registry, "samples/absent:v1", k, DEP_MODULE, &[]);
    assert_eq!(code, 3, "{text}");
}

#[tokio::test]
async fn check_image_with_credentials() {
    let k = kernel();
    let registry = Registry::tls_with_auth("vendor", "right");
    registry
        .push_sample("private/hello:v1", &Sample::good(k))
        .await;
    let dir = tempfile::tempdir().unwrap();
    let right = dir.path().join("right.json");
    std::fs::write(
        &right,
        docker_config_json(&registry.addr, "vendor", "right"),
    )
    .unwrap();
    let wrong = dir.path().join("wrong.json");
    std::fs::write(
        &wrong,
        docker_config_json(&registry.addr, "vendor", "wrong"),
    )
    .unwrap();
    let (code, text) = check(
        &registry,
        "private/hello:v1",
        k,
        DEP_MODULE,
        &["--registry-config", right.to_str().unwrap()],
    );
    assert_eq!(code, 0, "{text}");
    let (code, text) = check(
        &registry,
        "private/hello:v1",
        k,
        DEP_MODULE,
        &["--registry-config", wrong.to_str().unwrap()],
    );
    assert_eq!(code, 4, "{text}");
    assert!(
        !text.contains("wrong\"") && text.contains("credentials"),
        "{text}"
    );
}

#[tokio::test]
async fn check_image_trusts_a_registry_behind_an_internal_ca_with_its_ca_file() {
    let k = kernel();
    let (ca, ca_key) = internal_ca("kmm-check-image-test internal CA");
    let registry = Registry::tls_issued_by(&ca, &ca_key);
    registry
        .push_sample("samples/hello:v1", &Sample::good(k))
        .await;
    let dir = tempfile::tempdir().unwrap();
    let ca_file = dir.path().join("ca.pem");
    std::fs::write(&ca_file, &ca).unwrap();
    let check = |extra: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_kmm-node-agent"))
            .args(["check-image", "--image"])
            .arg(registry.image("samples/hello:v1"))
            .args(["--kernel", k, "--module", DEP_MODULE])
            .args(extra)
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        (out.status.code().expect("exited"), text)
    };
    let (code, text) = check(&[]);
    assert_ne!(code, 0, "the internal CA is not the system's: {text}");
    let (code, text) = check(&["--registry-ca-file", ca_file.to_str().unwrap()]);
    assert_eq!(code, 0, "{text}");
    assert!(text.starts_with("OK"), "{text}");
}

#[test]
fn check_image_help_lists_exit_codes() {
    let out = Command::new(env!("CARGO_BIN_EXE_kmm-node-agent"))
        .args(["check-image", "--help"])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .collect::<Vec<_>>()
        .join(" ");
    assert!(out.status.success());
    assert!(
        text.contains("Exit codes") && text.contains("8 a dependency is missing"),
        "{text}"
    );
}
