//! Projected ServiceAccount tokens, as the kubelet's token manager gets them: a
//! TokenRequest for the pod's ServiceAccount with the projection's audience and
//! lifetime, bound to the Pod by name and UID (the apiserver then adds the node's name
//! and UID to the token), renewed once 80% of its lifetime has passed or after a day.

use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::api::authentication::v1::{BoundObjectReference, TokenRequest, TokenRequestSpec};
use k8s_openapi::api::core::v1::{Pod, ServiceAccount};
use kube::api::PostParams;
use kube::{Api, Client, ResourceExt};
use tokio::time::Instant;

use crate::{Error, Result};

/// A `serviceAccountToken` projection.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct TokenSource {
    /// `None`: the apiserver's own audiences.
    pub audience: Option<String>,
    pub expiration_seconds: i64,
    /// The file inside the volume.
    pub path: String,
}

impl TokenSource {
    /// What the API defaults `expirationSeconds` to.
    pub const DEFAULT_EXPIRATION_SECONDS: i64 = 3600;
}

/// The kubelet renews no later than this after issue, whatever the lifetime.
const MAX_AGE: Duration = Duration::from_secs(24 * 3600);
/// Delay before asking again after a failed TokenRequest.
const RETRY: Duration = Duration::from_secs(5);

/// The TokenRequest the kubelet sends for `source` of `pod`.
fn token_request(pod: &Pod, source: &TokenSource) -> TokenRequest {
    TokenRequest {
        spec: TokenRequestSpec {
            audiences: source.audience.iter().cloned().collect(),
            expiration_seconds: Some(source.expiration_seconds),
            bound_object_ref: Some(BoundObjectReference {
                api_version: Some("v1".into()),
                kind: Some("Pod".into()),
                name: Some(pod.name_any()),
                uid: pod.uid(),
            }),
        },
        ..Default::default()
    }
}

/// How long after issue a token of `lifetime_seconds` (as granted) is renewed.
fn renew_after(lifetime_seconds: i64) -> Duration {
    let lifetime = Duration::from_secs(u64::try_from(lifetime_seconds).unwrap_or(0));
    (lifetime * 4 / 5).min(MAX_AGE)
}

/// `spec.serviceAccountName`, `default` when unset (as the API defaults it).
fn service_account(pod: &Pod) -> String {
    pod.spec
        .as_ref()
        .and_then(|s| s.service_account_name.clone())
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "default".into())
}

struct Issued {
    token: String,
    renew_at: Instant,
}

/// The current tokens of one pod, one per (audience, lifetime).
#[derive(Default)]
pub(super) struct Tokens {
    issued: BTreeMap<(Option<String>, i64), Issued>,
    retry_at: Option<Instant>,
}

impl std::fmt::Debug for Tokens {
    // Never the tokens themselves.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokens")
            .field("issued", &self.issued.len())
            .finish()
    }
}

impl Tokens {
    /// The token for `source`, if one was issued.
    pub(super) fn get(&self, source: &TokenSource) -> Option<String> {
        self.issued
            .get(&(source.audience.clone(), source.expiration_seconds))
            .map(|i| i.token.clone())
    }

    /// Requests the tokens of `sources` that are missing or due for renewal; whether
    /// any changed. After a failure, waits [`RETRY`] before asking again.
    pub(super) async fn refresh(
        &mut self,
        client: &Client,
        pod: &Pod,
        sources: &[&TokenSource],
    ) -> Result<bool> {
        let now = Instant::now();
        if self.retry_at.is_some_and(|at| now < at) {
            return Ok(false);
        }
        let mut changed = false;
        for source in sources {
            let key = (source.audience.clone(), source.expiration_seconds);
            if self.issued.get(&key).is_some_and(|i| now < i.renew_at) {
                continue;
            }
            match self.request(client, pod, source).await {
                Ok(issued) => {
                    self.issued.insert(key, issued);
                    changed = true;
                }
                Err(e) => {
                    self.retry_at = Some(now + RETRY);
                    return Err(e);
                }
            }
        }
        self.retry_at = None;
        Ok(changed)
    }

    async fn request(&self, client: &Client, pod: &Pod, source: &TokenSource) -> Result<Issued> {
        let account = service_account(pod);
        let api: Api<ServiceAccount> =
            Api::namespaced(client.clone(), &pod.namespace().unwrap_or_default());
        let issued_at = Instant::now();
        let response = api
            .create_token_request(
                &account,
                &PostParams::default(),
                &token_request(pod, source),
            )
            .await?;
        let granted = response
            .spec
            .expiration_seconds
            .unwrap_or(source.expiration_seconds);
        let token = response.status.map(|s| s.token).ok_or_else(|| {
            Error::Invalid(format!("the TokenRequest for {account} returned no token"))
        })?;
        Ok(Issued {
            token,
            renew_at: issued_at + renew_after(granted),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::super::fields::tests::agent_pod;
    use super::*;

    #[test]
    fn the_request_binds_the_token_to_the_pod() {
        let source = TokenSource {
            audience: Some("kmm-spoke-proxy".into()),
            expiration_seconds: 7200,
            path: "token".into(),
        };
        let request = token_request(&agent_pod(), &source);
        assert_eq!(request.spec.audiences, ["kmm-spoke-proxy"]);
        assert_eq!(request.spec.expiration_seconds, Some(7200));
        assert_eq!(
            request.spec.bound_object_ref,
            Some(BoundObjectReference {
                api_version: Some("v1".into()),
                kind: Some("Pod".into()),
                name: Some("kmm-node-agent-x7k2p".into()),
                uid: Some("6f1c9a54-0001".into()),
            })
        );
        let default_audience = TokenSource {
            audience: None,
            ..source
        };
        assert!(
            token_request(&agent_pod(), &default_audience)
                .spec
                .audiences
                .is_empty()
        );
    }

    #[test]
    fn renewal_at_four_fifths_of_the_lifetime_and_at_most_daily() {
        assert_eq!(renew_after(3600), Duration::from_secs(2880));
        assert_eq!(renew_after(600), Duration::from_secs(480));
        assert_eq!(renew_after(3607), Duration::from_millis(2_885_600));
        assert_eq!(renew_after(365 * 24 * 3600), MAX_AGE);
        assert_eq!(renew_after(0), Duration::ZERO);
        assert_eq!(renew_after(-5), Duration::ZERO);
    }

    #[test]
    fn the_service_account_defaults_to_default() {
        assert_eq!(service_account(&agent_pod()), "kmm-node-agent");
        let mut pod = agent_pod();
        pod.spec.as_mut().unwrap().service_account_name = None;
        assert_eq!(service_account(&pod), "default");
        pod.spec.as_mut().unwrap().service_account_name = Some(String::new());
        assert_eq!(service_account(&pod), "default");
    }
}
