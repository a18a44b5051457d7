//! Authenticates a node agent: a TokenReview of its projected ServiceAccount token for
//! our audience, then [`bound_node`] decides which node the stream speaks for.

use k8s_openapi::api::authentication::v1::{TokenReview, TokenReviewSpec};
use kube::api::PostParams;
use kube::{Api, Client};
use thiserror::Error;

use crate::agent_identity::{Refusal, bound_node};

#[derive(Debug, Error)]
pub enum AuthError {
    #[error("the agent is refused: {0}")]
    Refused(#[from] Refusal),
    #[error("cannot review the agent's token: {0}")]
    Review(#[source] kube::Error),
}

/// See the module documentation.
#[derive(Clone)]
pub struct TokenAuthenticator {
    api: Api<TokenReview>,
    audience: String,
    service_account: String,
}

impl std::fmt::Debug for TokenAuthenticator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TokenAuthenticator")
            .field("audience", &self.audience)
            .field("service_account", &self.service_account)
            .finish_non_exhaustive()
    }
}

impl TokenAuthenticator {
    /// `service_account` is `<namespace>:<name>`.
    pub fn new(client: Client, audience: String, service_account: String) -> Self {
        Self {
            api: Api::all(client),
            audience,
            service_account,
        }
    }

    /// The node `token` is bound to.
    pub async fn node_of(&self, token: &str) -> Result<String, AuthError> {
        let review = TokenReview {
            spec: TokenReviewSpec {
                token: Some(token.to_owned()),
                audiences: Some(vec![self.audience.clone()]),
            },
            ..Default::default()
        };
        let reviewed = self
            .api
            .create(&PostParams::default(), &review)
            .await
            .map_err(AuthError::Review)?;
        Ok(bound_node(
            reviewed.status.as_ref(),
            &self.audience,
            &self.service_account,
        )?)
    }
}
