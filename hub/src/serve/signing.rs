//! Signing on the hub, natively: the key and certificate are read from Secrets in the
//! hub's namespace into memory (never logged, written to disk or sent to a spoke), the
//! unsigned image is pulled, the listed files are signed with `kmm-signing`, and the
//! signed image is pushed as the unsigned one plus one layer. Every check comes before
//! the push: a failure pushes nothing.

use k8s_openapi::api::core::v1::Secret;
use kmm_registry::{PullSecret, RegistryError, error_chain, parse_reference};
use kmm_signing::{Compression, HashAlgorithm, LAYER_MEDIA_TYPE, Layer, Limits, SigningKey};
use kube::runtime::reflector::{ObjectRef, Store};
use oci_client::client::{Config, ImageLayer};
use oci_client::manifest::{
    IMAGE_DOCKER_LAYER_GZIP_MEDIA_TYPE, IMAGE_DOCKER_LAYER_TAR_MEDIA_TYPE,
    IMAGE_LAYER_GZIP_MEDIA_TYPE, IMAGE_LAYER_MEDIA_TYPE, OciImageManifest,
};
use serde_json::Value;
use thiserror::Error;

use crate::images::SignPlan;

/// Largest unsigned image (its layers, compressed, as its manifest declares them) the hub
/// signs by default. Signing holds those layers in memory, and one image is signed at a
/// time ([`SIGNING`]): 128 MiB keeps the working set well under the hub's 512 Mi limit
/// at any fleet size (kmod images are a few MiB). A larger image is refused before any
/// layer is pulled, and reported.
pub const MAX_IMAGE_BYTES: i64 = 128 << 20;

/// One signing at a time: each holds an image in memory.
static SIGNING: tokio::sync::Semaphore = tokio::sync::Semaphore::const_new(1);

/// Why an image could not be signed; the text names the Secret, key, image or file.
#[derive(Debug, Error)]
pub enum SigningError {
    #[error("{field}: Secret {secret:?} not found in namespace {namespace}")]
    SecretNotFound {
        field: &'static str,
        secret: String,
        namespace: String,
    },
    #[error("{field}: Secret {secret:?} has no key {key:?}")]
    SecretKeyMissing {
        field: &'static str,
        secret: String,
        key: &'static str,
    },
    #[error(
        "the signing key pair in Secrets {key_secret:?} and {cert_secret:?} is unusable: {source}"
    )]
    Key {
        key_secret: String,
        cert_secret: String,
        #[source]
        source: kmm_signing::KeyError,
    },
    #[error("pulling the unsigned image: {0}")]
    Pull(#[source] RegistryError),
    #[error("the unsigned image {image} is {size} bytes, over the {limit}-byte limit")]
    TooLarge {
        image: String,
        size: i64,
        limit: i64,
    },
    #[error("the unsigned image {image} has layers of an unsupported media type: {media_type}")]
    UnsupportedLayer { image: String, media_type: String },
    #[error("the unsigned image {image}'s config is not an image config: {reason}")]
    Config { image: String, reason: String },
    #[error("signing the files of {image}: {source}")]
    Sign {
        image: String,
        #[source]
        source: kmm_signing::SignError,
    },
    #[error("pushing the signed image: {0}")]
    Push(#[source] RegistryError),
}

/// The key pair `plan` names, from the watched Secrets of the hub's namespace.
pub fn signing_key(
    secrets: &Store<Secret>,
    namespace: &str,
    plan: &SignPlan,
) -> Result<SigningKey, SigningError> {
    let read = |field: &'static str, secret: &str, key: &'static str| {
        let object = secrets
            .get(&ObjectRef::new(secret).within(namespace))
            .ok_or_else(|| SigningError::SecretNotFound {
                field,
                secret: secret.to_owned(),
                namespace: namespace.to_owned(),
            })?;
        object
            .data
            .as_ref()
            .and_then(|d| d.get(key))
            .map(|v| v.0.clone())
            .ok_or_else(|| SigningError::SecretKeyMissing {
                field,
                secret: secret.to_owned(),
                key,
            })
    };
    let key = read("sign.keySecret", &plan.key_secret, "key")?;
    let cert = read("sign.certSecret", &plan.cert_secret, "cert")?;
    SigningKey::from_pem(&key, &cert).map_err(|source| SigningError::Key {
        key_secret: plan.key_secret.clone(),
        cert_secret: plan.cert_secret.clone(),
        source,
    })
}

/// Pulls `plan.unsigned_image` (refused when its layers add up to more than
/// `max_image_bytes`), signs its listed files with `key`, pushes the result to `image` and
/// returns the pushed manifest's digest; both registries' certificates may chain to
/// `registry_cas` besides the system's CAs.
pub async fn sign_image(
    plan: &SignPlan,
    key: SigningKey,
    image: &str,
    target_tls: kmm_registry::RegistryTls,
    secret: Option<&PullSecret>,
    registry_cas: &kmm_registry::RegistryCas,
    max_image_bytes: i64,
) -> Result<String, SigningError> {
    let _one_at_a_time = SIGNING
        .acquire()
        .await
        .expect("the semaphore is never closed");
    let unsigned = plan.unsigned_image.as_str();
    let source = parse_reference(unsigned).map_err(SigningError::Pull)?;
    let pull_client = kmm_registry::client_trusting(plan.unsigned_tls, registry_cas);
    let auth = kmm_registry::auth(secret, &source).map_err(SigningError::Pull)?;
    let (manifest, _) = pull_client
        .pull_image_manifest(&source, &auth)
        .await
        .map_err(|e| SigningError::Pull(RegistryError::from_client(unsigned, e)))?;
    let size: i64 = manifest.layers.iter().map(|l| l.size).sum();
    if size > max_image_bytes {
        return Err(SigningError::TooLarge {
            image: unsigned.to_owned(),
            size,
            limit: max_image_bytes,
        });
    }
    let pulled = pull_client
        .pull(
            &source,
            &auth,
            vec![
                IMAGE_LAYER_MEDIA_TYPE,
                IMAGE_LAYER_GZIP_MEDIA_TYPE,
                IMAGE_DOCKER_LAYER_TAR_MEDIA_TYPE,
                IMAGE_DOCKER_LAYER_GZIP_MEDIA_TYPE,
                "application/vnd.oci.image.layer.v1.tar+zstd",
            ],
        )
        .await
        .map_err(|e| SigningError::Pull(RegistryError::from_client(unsigned, e)))?;

    // oci-client downloads layers concurrently and returns them as they finish: put them
    // back in the manifest's order, which the flattening and the pushed image rely on.
    let mut downloaded = pulled.layers;
    let mut ordered = Vec::with_capacity(downloaded.len());
    for descriptor in pulled.manifest.iter().flat_map(|m| &m.layers) {
        let index = downloaded
            .iter()
            .position(|layer| layer.sha256_digest() == descriptor.digest)
            .ok_or_else(|| {
                SigningError::Pull(RegistryError::Registry {
                    image: unsigned.to_owned(),
                    detail: format!("layer {} missing from the download", descriptor.digest),
                })
            })?;
        ordered.push(downloaded.swap_remove(index));
    }
    let files = plan.files.clone();
    let owned_image = unsigned.to_owned();
    // The layers go to the blocking task and come back with the signed layer: the image
    // is held once, not copied.
    let (signed, mut layers) = tokio::task::spawn_blocking(move || {
        let layers = ordered;
        let readers = layers
            .iter()
            .map(|layer| {
                Compression::from_media_type(&layer.media_type)
                    .map(|compression| Layer {
                        compression,
                        reader: layer.data.as_slice(),
                    })
                    .map_err(|_| SigningError::UnsupportedLayer {
                        image: owned_image.clone(),
                        media_type: layer.media_type.clone(),
                    })
            })
            .collect::<Result<Vec<_>, _>>()?;
        let signed = kmm_signing::sign_files_in_layers(
            readers,
            &files,
            &key,
            HashAlgorithm::Sha256,
            &Limits::default(),
        )
        .map_err(|source| SigningError::Sign {
            image: owned_image,
            source,
        })?;
        Ok::<_, SigningError>((signed, layers))
    })
    .await
    .expect("signing does not panic")?;

    let config = signed_config(unsigned, &pulled.config, &signed.diff_id, &signed.files)?;
    layers.push(ImageLayer::new(
        signed.blob,
        LAYER_MEDIA_TYPE.to_owned(),
        None,
    ));
    let manifest = OciImageManifest::build(&layers, &config, None);
    let target = parse_reference(image).map_err(SigningError::Push)?;
    let push_client = kmm_registry::client_trusting(target_tls, registry_cas);
    let push_auth = kmm_registry::auth(secret, &target).map_err(SigningError::Push)?;
    push_client
        .push(&target, &layers, config, &push_auth, Some(manifest))
        .await
        .map_err(|e| SigningError::Push(RegistryError::from_client(image, e)))?;
    kmm_registry::resolve_digest(&push_client, image, secret)
        .await
        .map_err(SigningError::Push)
}

/// The unsigned image's config with the signed layer appended to its root filesystem
/// and its history.
fn signed_config(
    image: &str,
    config: &Config,
    diff_id: &str,
    files: &[kmm_signing::SignedFile],
) -> Result<Config, SigningError> {
    let invalid = |reason: String| SigningError::Config {
        image: image.to_owned(),
        reason,
    };
    let mut json: Value =
        serde_json::from_slice(&config.data).map_err(|e| invalid(error_chain(&e)))?;
    json["rootfs"]["diff_ids"]
        .as_array_mut()
        .ok_or_else(|| invalid("no rootfs.diff_ids".to_owned()))?
        .push(Value::String(diff_id.to_owned()));
    let signed: Vec<&str> = files.iter().map(|f| f.path.as_str()).collect();
    let entry = serde_json::json!({
        "created_by": format!("kmm-hub: signed {}", signed.join(" ")),
        "comment": "kernel module signatures appended by kmm-hub",
    });
    match json["history"].as_array_mut() {
        Some(history) => history.push(entry),
        None => json["history"] = Value::Array(vec![entry]),
    }
    let data = serde_json::to_vec(&json).map_err(|e| invalid(error_chain(&e)))?;
    Ok(Config::new(
        data,
        config.media_type.clone(),
        config.annotations.clone(),
    ))
}
