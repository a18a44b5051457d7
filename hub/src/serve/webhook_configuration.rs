//! Keeps the hub's CA in the caBundle of every webhook of its
//! ValidatingWebhookConfiguration, so the apiserver trusts the serving certificate the
//! hub issues itself. Watched, not set once: re-applying the install manifests (which
//! carry no caBundle) must not leave admission failing closed.

use futures::TryStreamExt;
use k8s_openapi::ByteString;
use k8s_openapi::api::admissionregistration::v1::ValidatingWebhookConfiguration;
use kube::api::{Patch, PatchParams};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client, ResourceExt};
use serde_json::{Value, json};

/// JSON patch operations that set `ca` on every webhook lacking it; empty when all have it.
pub fn ca_bundle_patch(configuration: &ValidatingWebhookConfiguration, ca: &[u8]) -> Vec<Value> {
    let webhooks = configuration.webhooks.as_deref().unwrap_or_default();
    webhooks
        .iter()
        .enumerate()
        .filter(|(_, w)| w.client_config.ca_bundle.as_ref().map(|b| b.0.as_slice()) != Some(ca))
        .flat_map(|(i, w)| {
            [
                // The index must still name the same webhook when the patch applies.
                json!({"op": "test", "path": format!("/webhooks/{i}/name"), "value": w.name}),
                json!({
                    "op": "add",
                    "path": format!("/webhooks/{i}/clientConfig/caBundle"),
                    "value": ByteString(ca.to_vec()),
                }),
            ]
        })
        .collect()
}

/// Watches the configuration `name` and injects `ca_pem` whenever a webhook lacks it.
/// Runs until dropped; a missing configuration is waited for.
pub async fn keep_ca_bundle(client: Client, name: String, ca_pem: String) {
    let api: Api<ValidatingWebhookConfiguration> = Api::all(client);
    let config = watcher::Config::default().fields(&format!("metadata.name={name}"));
    let mut objects = std::pin::pin!(
        watcher(api.clone(), config)
            .default_backoff()
            .applied_objects()
    );
    loop {
        match objects.try_next().await {
            Ok(Some(configuration)) => {
                let operations = ca_bundle_patch(&configuration, ca_pem.as_bytes());
                if operations.is_empty() {
                    continue;
                }
                let patch: json_patch::Patch = serde_json::from_value(Value::Array(operations))
                    .expect("a well-formed JSON patch");
                match api
                    .patch(
                        &configuration.name_any(),
                        &PatchParams::default(),
                        &Patch::<()>::Json(patch),
                    )
                    .await
                {
                    Ok(_) => tracing::info!(
                        configuration = name,
                        "injected the hub CA into the webhook configuration"
                    ),
                    // A concurrent change: the watch brings the new version.
                    Err(kube::Error::Api(s)) if s.code == 422 || s.code == 409 => {}
                    Err(error) => {
                        tracing::warn!(configuration = name, %error, "cannot inject the hub CA into the webhook configuration")
                    }
                }
            }
            Ok(None) => return,
            Err(error) => {
                tracing::warn!(configuration = name, %error, "watching the webhook configuration failed; retrying")
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use k8s_openapi::api::admissionregistration::v1::{ValidatingWebhook, WebhookClientConfig};

    use super::*;

    fn configuration(bundles: &[Option<&[u8]>]) -> ValidatingWebhookConfiguration {
        ValidatingWebhookConfiguration {
            webhooks: Some(
                bundles
                    .iter()
                    .enumerate()
                    .map(|(i, bundle)| ValidatingWebhook {
                        name: format!("w{i}.hub.kmm.sigs.x-k8s.io"),
                        client_config: WebhookClientConfig {
                            ca_bundle: bundle.map(|b| ByteString(b.to_vec())),
                            ..WebhookClientConfig::default()
                        },
                        ..ValidatingWebhook::default()
                    })
                    .collect(),
            ),
            ..ValidatingWebhookConfiguration::default()
        }
    }

    #[test]
    fn only_webhooks_without_the_ca_are_patched() {
        let ops = ca_bundle_patch(&configuration(&[Some(b"CA"), None, Some(b"old")]), b"CA");
        let paths: Vec<&str> = ops.iter().map(|op| op["path"].as_str().unwrap()).collect();
        assert_eq!(
            paths,
            [
                "/webhooks/1/name",
                "/webhooks/1/clientConfig/caBundle",
                "/webhooks/2/name",
                "/webhooks/2/clientConfig/caBundle"
            ]
        );
        // caBundle is base64 on the wire.
        assert_eq!(ops[1]["value"], "Q0E=");
    }

    #[test]
    fn a_configuration_holding_the_ca_needs_nothing() {
        assert!(ca_bundle_patch(&configuration(&[Some(b"CA")]), b"CA").is_empty());
        assert!(ca_bundle_patch(&ValidatingWebhookConfiguration::default(), b"CA").is_empty());
    }
}
