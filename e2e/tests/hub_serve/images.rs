//! The hub's image checks and signing against real registries of the test's own
//! (`kmm_registry_fixture::RegistryServer`): what the registry answers becomes the image's state in
//! status and the reason nodes get instead of an image, a pin survives the tag moving
//! and a hub restart, and bad signing input is named in status with nothing pushed.

use std::collections::BTreeMap;

use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::Secret;
use kmm_api::ImageStatus;
use kmm_proto::v1::kernel_target::Target;
use kmm_registry_fixture::RegistryServer;
use kube::Api;
use kube::api::{ObjectMeta, Patch, PatchParams, PostParams};
use rcgen::{CertificateParams, KeyPair, PKCS_RSA_SHA256, RsaKeySize};
use serde_json::json;

use crate::support::*;

const USER: &str = "kmm";
const PASSWORD: &str = "right";

/// A module loading `image` for [`MAPPED_KERNEL`] from `registry_tls`, pulling with
/// the Secret `pull` when given.
fn module_of(
    image: &str,
    registry_tls: serde_json::Value,
    pull: Option<&str>,
) -> serde_json::Value {
    let mut spec = json!({
        "selector": {"kubernetes.io/os": "linux"},
        "moduleLoader": {"container": {
            "version": "1",
            "modprobe": {"moduleName": "kmm_hello"},
            "kernelMappings": [{
                "literal": MAPPED_KERNEL,
                "containerImage": image,
                "registryTLS": registry_tls,
            }],
        }},
    });
    if let Some(secret) = pull {
        spec["imageRepoSecret"] = json!({"name": secret});
    }
    spec
}

async fn create_secret(hub: &TestHub, name: &str, type_: &str, data: &[(&str, &[u8])]) {
    let secrets: Api<Secret> = Api::namespaced(hub.client.clone(), &hub.namespace);
    let data: BTreeMap<String, ByteString> = data
        .iter()
        .map(|(k, v)| (k.to_string(), ByteString(v.to_vec())))
        .collect();
    secrets
        .create(
            &PostParams::default(),
            &Secret {
                metadata: ObjectMeta {
                    name: Some(name.into()),
                    ..ObjectMeta::default()
                },
                type_: Some(type_.into()),
                data: Some(data),
                ..Secret::default()
            },
        )
        .await
        .unwrap_or_else(|e| panic!("creating Secret {name}: {e}"));
}

async fn pull_secret(hub: &TestHub, name: &str, registry: &RegistryServer, password: &str) {
    let config = registry.docker_config_json(USER, password);
    create_secret(
        hub,
        name,
        "kubernetes.io/dockerconfigjson",
        &[(".dockerconfigjson", config.as_bytes())],
    )
    .await;
}

/// Waits until the module's status reports its one image as `state` with `reason`.
async fn image_state(hub: &TestHub, module: &str, state: &str, reason: &str) -> ImageStatus {
    hub.wait_module(
        module,
        &format!("{module}'s image {state} ({reason})"),
        WAIT,
        |m| {
            let images = m
                .and_then(|m| m.status)
                .map(|s| s.images)
                .unwrap_or_default();
            match images.as_slice() {
                [image] if image.state == state && image.reason == reason => Ok(image.clone()),
                _ => Err(format!("images {images:?}")),
            }
        },
    )
    .await
}

/// Waits until the module's status pins its image to `digest`.
async fn pinned(hub: &TestHub, module: &str, digest: &str) {
    hub.wait_module(module, &format!("{module} pinned to {digest}"), WAIT, |m| {
        let images = m
            .and_then(|m| m.status)
            .map(|s| s.images)
            .unwrap_or_default();
        match images.as_slice() {
            [image] if image.state == "Exists" && image.digest.as_deref() == Some(digest) => Ok(()),
            _ => Err(format!("images {images:?}")),
        }
    })
    .await
}

/// What a snapshot tells nodes on [`MAPPED_KERNEL`] about `module`: the digest to load,
/// or the reason and message there is nothing to load.
fn target(
    snapshot: &kmm_proto::v1::IntentSnapshot,
    module: &str,
) -> Option<Result<String, (String, String)>> {
    let kernel = intent(snapshot, module)?
        .kernels
        .iter()
        .find(|k| k.kernel == MAPPED_KERNEL)?;
    match kernel.target.as_ref()? {
        Target::Load(load) => Some(Ok(load.digest.clone())),
        Target::Unresolved(why) => Some(Err((why.reason.clone(), why.message.clone()))),
        Target::Resolve(_) => Some(Err((
            "ResolveOnSpoke".into(),
            "the cluster is to resolve the image".into(),
        ))),
    }
}

#[tokio::test]
async fn registry_answers_become_image_states_and_a_pin_outlives_a_moved_tag() {
    let fleet = fleet().await;
    let registry = tokio::task::spawn_blocking(|| RegistryServer::tls_with_auth(USER, PASSWORD))
        .await
        .unwrap()
        .expect("a registry with TLS and credentials");
    let first = registry
        .push_files("drivers/hello:1", &[("opt/first", b"first")])
        .await
        .unwrap();
    let (hub, namespace) = TestHub::start(&fleet, WAIT).await;
    pull_secret(&hub, "right", &registry, PASSWORD).await;
    pull_secret(&hub, "wrong", &registry, "wrong").await;
    let image = registry.image("drivers/hello:1");
    let skip_verify = json!({"insecureSkipTLSVerify": true});
    hub.label_cluster("spoke1", true).await;
    hub.create_module(
        "pinned",
        module_of(&image, skip_verify.clone(), Some("right")),
    )
    .await;
    hub.create_module("verified", module_of(&image, json!({}), Some("right")))
        .await;
    hub.create_module(
        "unauthorized",
        module_of(&image, skip_verify.clone(), Some("wrong")),
    )
    .await;
    let missing = registry.image("drivers/hello:absent");
    hub.create_module(
        "missing",
        module_of(&missing, skip_verify.clone(), Some("right")),
    )
    .await;
    let mut proxy = hub.proxy("spoke1", &[MAPPED_KERNEL]).await;

    // insecureSkipTLSVerify with the right credentials: found, pinned, sent by digest.
    pinned(&hub, "pinned", &first).await;
    // Verification on (the default): the self-signed certificate is refused.
    let verified = image_state(&hub, "verified", "Failed", "ImageCheckFailed").await;
    assert!(
        verified.message.to_lowercase().contains("certificate"),
        "the message names the certificate: {}",
        verified.message
    );
    let unauthorized = image_state(&hub, "unauthorized", "Failed", "RegistryUnauthorized").await;
    assert!(
        unauthorized.message.contains(&image),
        "{}",
        unauthorized.message
    );
    let not_found = image_state(&hub, "missing", "NotFound", "ImageNotFound").await;
    assert!(
        not_found.message.contains("absent"),
        "{}",
        not_found.message
    );
    assert_eq!(not_found.kernels, [MAPPED_KERNEL]);

    // Nodes get the pinned digest, or the hub's reason instead of an image.
    let snapshot = proxy
        .snapshot_where("every module's image decided", |s| {
            [
                ("pinned", true),
                ("verified", false),
                ("unauthorized", false),
                ("missing", false),
            ]
            .iter()
            .all(|(m, loads)| target(s, m).is_some_and(|t| t.is_ok() == *loads))
        })
        .await;
    assert_eq!(target(&snapshot, "pinned"), Some(Ok(first.clone())));
    for (module, reason) in [
        ("verified", "ImageCheckFailed"),
        ("unauthorized", "RegistryUnauthorized"),
        ("missing", "ImageNotFound"),
    ] {
        let Some(Err((why, message))) = target(&snapshot, module) else {
            unreachable!("checked above")
        };
        assert_eq!(why, reason, "{module}: {message}");
        assert!(
            message.contains("drivers/hello"),
            "{module}'s reason names the image: {message}"
        );
    }

    // The tag moves. A new hub (the pin comes from status) keeps serving the bytes it
    // pinned; only a new rebuild generation resolves the tag again.
    let moved = registry
        .push_files("drivers/hello:1", &[("opt/second", b"second")])
        .await
        .unwrap();
    assert_ne!(moved, first);
    drop(proxy);
    hub.stop().await;
    let hub = TestHub::start_in(&fleet, &namespace.name, WAIT).await;
    let mut proxy = hub.proxy("spoke1", &[MAPPED_KERNEL]).await;
    let snapshot = proxy
        .snapshot_where("the pinned module is sent", |s| {
            target(s, "pinned").is_some()
        })
        .await;
    assert_eq!(target(&snapshot, "pinned"), Some(Ok(first.clone())));
    pinned(&hub, "pinned", &first).await;
    let bump = json!({"spec": {"moduleSpec": {"imageRebuildTriggerGeneration": 1}}});
    hub.modules()
        .patch("pinned", &PatchParams::default(), &Patch::Merge(&bump))
        .await
        .unwrap();
    pinned(&hub, "pinned", &moved).await;
    proxy
        .snapshot_where("nodes get the newly resolved digest", |s| {
            target(s, "pinned") == Some(Ok(moved.clone()))
        })
        .await;

    hub.clean_up(
        namespace,
        &["pinned", "verified", "unauthorized", "missing"],
        &["spoke1"],
    )
    .await;
}

/// An RSA key and a self-signed certificate for it, both PEM.
fn signing_pair(name: &str) -> (String, String) {
    let key = KeyPair::generate_rsa_for(&PKCS_RSA_SHA256, RsaKeySize::_2048).unwrap();
    let cert = CertificateParams::new(Vec::<String>::new())
        .unwrap()
        .self_signed(&key)
        .unwrap_or_else(|e| panic!("certificate {name}: {e}"));
    (key.serialize_pem(), cert.pem())
}

#[tokio::test]
async fn bad_signing_input_is_named_in_status_and_nothing_is_pushed() {
    let fleet = fleet().await;
    let registry = tokio::task::spawn_blocking(RegistryServer::plain)
        .await
        .unwrap()
        .expect("a plain registry");
    let module_file = format!("opt/lib/modules/{MAPPED_KERNEL}/extra/kmm_hello.ko");
    // Signing needs an ELF file, nothing more.
    registry
        .push_files(
            "drivers/unsigned:1",
            &[(&module_file, b"\x7fELF not really a module")],
        )
        .await
        .unwrap();
    let (hub, namespace) = TestHub::start(&fleet, WAIT).await;
    let (key, cert) = signing_pair("trusted");
    let (_, other_cert) = signing_pair("other");
    create_secret(&hub, "key", "Opaque", &[("key", key.as_bytes())]).await;
    create_secret(&hub, "cert", "Opaque", &[("cert", cert.as_bytes())]).await;
    create_secret(
        &hub,
        "other-cert",
        "Opaque",
        &[("cert", other_cert.as_bytes())],
    )
    .await;
    hub.label_cluster("spoke1", true).await;

    let plain = json!({"insecure": true});
    let signed = |case: &str, key: &str, cert: &str, unsigned: &str, file: &str| {
        let mut spec = module_of(
            &registry.image(&format!("drivers/{case}:1")),
            plain.clone(),
            None,
        );
        spec["moduleLoader"]["container"]["kernelMappings"][0]["sign"] = json!({
            "unsignedImage": registry.image(unsigned),
            "unsignedImageRegistryTLS": plain,
            "keySecret": {"name": key},
            "certSecret": {"name": cert},
            "filesToSign": [format!("/{file}")],
        });
        spec
    };
    let cases = [
        (
            "good",
            signed("good", "key", "cert", "drivers/unsigned:1", &module_file),
        ),
        (
            "no-key",
            signed(
                "no-key",
                "absent",
                "cert",
                "drivers/unsigned:1",
                &module_file,
            ),
        ),
        (
            "mismatch",
            signed(
                "mismatch",
                "key",
                "other-cert",
                "drivers/unsigned:1",
                &module_file,
            ),
        ),
        (
            "no-file",
            signed(
                "no-file",
                "key",
                "cert",
                "drivers/unsigned:1",
                "opt/lib/modules/absent.ko",
            ),
        ),
        (
            "no-unsigned",
            signed(
                "no-unsigned",
                "key",
                "cert",
                "drivers/unsigned:absent",
                &module_file,
            ),
        ),
    ];
    for (name, spec) in &cases {
        hub.create_module(name, spec.clone()).await;
    }
    let _proxy = hub.proxy("spoke1", &[MAPPED_KERNEL]).await;

    // The control: the same input with the right key is signed and pushed.
    let good = image_state(&hub, "good", "Exists", "ImageExists").await;
    assert!(good.digest.is_some_and(|d| d.starts_with("sha256:")));
    assert!(registry.has("drivers/good:1").await.unwrap());

    let no_key = image_state(&hub, "no-key", "Failed", "SignFailed").await;
    assert!(
        no_key.message.contains("sign.keySecret") && no_key.message.contains("\"absent\""),
        "{}",
        no_key.message
    );
    let mismatch = image_state(&hub, "mismatch", "Failed", "SignFailed").await;
    assert!(
        mismatch.message.contains("\"other-cert\"")
            && mismatch
                .message
                .contains("does not belong to the certificate"),
        "{}",
        mismatch.message
    );
    let no_file = image_state(&hub, "no-file", "Failed", "SignFailed").await;
    assert!(no_file.message.contains("absent.ko"), "{}", no_file.message);
    let no_unsigned = image_state(&hub, "no-unsigned", "NotFound", "UnsignedImageNotFound").await;
    assert!(
        no_unsigned.message.contains("absent"),
        "{}",
        no_unsigned.message
    );
    for case in ["no-key", "mismatch", "no-file", "no-unsigned"] {
        assert!(
            !registry.has(&format!("drivers/{case}:1")).await.unwrap(),
            "{case}: an image was pushed"
        );
    }

    hub.clean_up(
        namespace,
        &cases.iter().map(|(name, _)| *name).collect::<Vec<_>>(),
        &["spoke1"],
    )
    .await;
}
