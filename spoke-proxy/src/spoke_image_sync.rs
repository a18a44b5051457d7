//! Resolves the images the hub cannot check (see [`spoke_images`]) against their
//! registries, as this cluster reaches them: with the module's credentials from the hub
//! or the cluster's own pull Secret, and the cluster's registry CAs
//! (`--registry-ca-file`, read at each resolution). The answers go into the shared
//! state, which the hub link reports.
//!
//! An answer names the image and what the registry said, never a credential.
//!
//! [`spoke_images`]: crate::spoke_images

use std::path::PathBuf;
use std::time::{Duration, Instant};

use kmm_proto::limits::{ERROR_TEXT, truncated};
use kmm_proto::v1::{PullCredential, Unresolved, pull_credential::Content};
use kmm_registry::{PullSecret, RegistryCas, RegistryError, RegistryTls, error_chain};
use tokio_util::sync::CancellationToken;

use crate::cluster_state::SpokeResolution;
use crate::shared_state::SharedState;

/// Longest a registry may take to answer one resolution.
const REGISTRY_TIMEOUT: Duration = Duration::from_secs(30);
/// How long to wait when nothing is due and nothing changes: a bound, not a poll.
const IDLE: Duration = Duration::from_secs(60);

/// Resolves what is due whenever the state changes or a retry comes due, until `cancel`.
pub async fn run(state: SharedState, registry_ca_file: Option<PathBuf>, cancel: CancellationToken) {
    let mut changes = state.subscribe();
    loop {
        let now = Instant::now();
        let (due, retry) = state.read(|s| (s.spoke_images_due(now), s.spoke_images_next_retry()));
        for resolution in due {
            let request = resolution.request.clone();
            let found = resolve(&resolution, registry_ca_file.as_deref()).await;
            match &found {
                Ok(digest) => tracing::info!(
                    module = request.module,
                    image = request.image,
                    digest,
                    "resolved an image for the hub"
                ),
                Err(why) => tracing::warn!(
                    module = request.module,
                    image = request.image,
                    reason = why.reason,
                    message = why.message,
                    "could not resolve an image for the hub"
                ),
            }
            state.update_if(|s| s.spoke_image_answered(request, found, Instant::now()));
        }
        let wait = retry.map_or(IDLE, |at| at.saturating_duration_since(Instant::now()));
        tokio::select! {
            () = cancel.cancelled() => return,
            changed = changes.changed() => if changed.is_err() { return },
            () = tokio::time::sleep(wait.min(IDLE)) => {}
        }
    }
}

/// The digest `resolution`'s image resolves to, or why not (its reason as the hub shows
/// it on the cluster's nodes).
async fn resolve(
    resolution: &SpokeResolution,
    registry_ca_file: Option<&std::path::Path>,
) -> Result<String, Unresolved> {
    let image = &resolution.request.image;
    let credential = resolution.credential.clone().map_err(|why| Unresolved {
        reason: why.reason,
        message: format!("resolving {image} for the hub: {}", why.message),
    })?;
    let cas = registry_cas(registry_ca_file).map_err(|message| Unresolved {
        reason: "RegistryCaUnusable".into(),
        message,
    })?;
    let secret = credential
        .map(pull_secret)
        .transpose()
        .map_err(|message| Unresolved {
            reason: "PullCredentialInvalid".into(),
            message: format!("{image}: {message}"),
        })?;
    let tls = resolution
        .tls
        .as_ref()
        .map_or_else(RegistryTls::default, |t| RegistryTls {
            insecure: t.insecure,
            insecure_skip_tls_verify: t.insecure_skip_tls_verify,
        });
    let client = kmm_registry::client_trusting(tls, &cas);
    let answer = tokio::time::timeout(
        REGISTRY_TIMEOUT,
        kmm_registry::resolve_digest(&client, image, secret.as_ref()),
    )
    .await
    .unwrap_or_else(|_| {
        Err(RegistryError::Registry {
            image: image.clone(),
            detail: format!("no answer within {}s", REGISTRY_TIMEOUT.as_secs()),
        })
    });
    answer.map_err(|e| Unresolved {
        reason: if e.is_not_found() {
            "ImageNotFound"
        } else if e.is_unauthorized() {
            "RegistryUnauthorized"
        } else {
            "ImageCheckFailed"
        }
        .into(),
        // The hub keeps no more of it.
        message: truncated(
            &format!(
                "the cluster could not resolve {image} for the hub, which cannot reach its \
                 registry: {}",
                error_chain(&e)
            ),
            ERROR_TEXT,
        )
        .to_owned(),
    })
}

/// The cluster's registry CAs; none while the file is absent or empty (no
/// `REGISTRY_CA_BUNDLE_n` set).
fn registry_cas(file: Option<&std::path::Path>) -> Result<RegistryCas, String> {
    let Some(file) = file else {
        return Ok(RegistryCas::default());
    };
    match std::fs::read(file) {
        Ok(pem) if pem.iter().all(u8::is_ascii_whitespace) => Ok(RegistryCas::default()),
        Ok(pem) => RegistryCas::from_pem(&pem).map_err(|e| {
            format!(
                "the cluster's registry CA bundle {} (REGISTRY_CA_BUNDLE_n) cannot be used: {e}",
                file.display()
            )
        }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(RegistryCas::default()),
        Err(e) => Err(format!("reading {}: {e}", file.display())),
    }
}

/// The credential's Docker configuration, as the agents read it.
fn pull_secret(credential: PullCredential) -> Result<PullSecret, String> {
    let text = |bytes: Vec<u8>| {
        String::from_utf8(bytes).map_err(|_| format!("credential {} is not UTF-8", credential.id))
    };
    match credential.content.clone() {
        Some(Content::DockerConfigJson(bytes)) => text(bytes).map(PullSecret::DockerConfigJson),
        Some(Content::DockerCfg(bytes)) => text(bytes).map(PullSecret::DockerCfg),
        None => Err(format!("credential {} has no content", credential.id)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_absent_or_empty_ca_file_adds_no_ca_and_a_broken_one_is_named() {
        let dir = tempfile::tempdir().unwrap();
        assert!(registry_cas(None).unwrap().is_empty());
        assert!(
            registry_cas(Some(&dir.path().join("none")))
                .unwrap()
                .is_empty()
        );
        let empty = dir.path().join("empty");
        std::fs::write(&empty, "\n").unwrap();
        assert!(registry_cas(Some(&empty)).unwrap().is_empty());
        let broken = dir.path().join("broken");
        std::fs::write(&broken, "not a certificate").unwrap();
        let error = registry_cas(Some(&broken)).unwrap_err();
        assert!(
            error.contains("REGISTRY_CA_BUNDLE_n") && error.contains("broken"),
            "{error}"
        );
    }

    #[test]
    fn a_credential_that_is_not_text_is_named_by_its_id_only() {
        let error = pull_secret(PullCredential {
            id: "cluster:kmm/pull".into(),
            content: Some(Content::DockerConfigJson(vec![0xff, 0xfe])),
        })
        .unwrap_err();
        assert_eq!(error, "credential cluster:kmm/pull is not UTF-8");
    }
}
