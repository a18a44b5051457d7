//! Which node an agent speaks for, from the TokenReview of its projected ServiceAccount
//! token: the token must be valid for our audience, belong to the agent's
//! ServiceAccount, and be bound to a node. Pure.

use k8s_openapi::api::authentication::v1::TokenReviewStatus;
use thiserror::Error;

/// The extra field the apiserver fills for tokens bound to a pod on a node or to a Node.
pub const NODE_NAME_EXTRA: &str = "authentication.kubernetes.io/node-name";

/// Why an agent's token is refused.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum Refusal {
    #[error("the token is not valid for audience {audience:?}: {error}")]
    NotAuthenticated { audience: String, error: String },
    #[error(
        "the token belongs to {username:?}, not to the node agent's ServiceAccount {expected:?}"
    )]
    WrongServiceAccount { username: String, expected: String },
    #[error(
        "the token of {username:?} is bound to no node (it must be bound to a pod on a node or to a Node)"
    )]
    NoNode { username: String },
}

impl Refusal {
    /// Whether the caller is known but not allowed (rather than not authenticated).
    pub fn is_permission(&self) -> bool {
        !matches!(self, Self::NotAuthenticated { .. })
    }
}

/// The node the token is bound to. `service_account` is `<namespace>:<name>`.
pub fn bound_node(
    status: Option<&TokenReviewStatus>,
    audience: &str,
    service_account: &str,
) -> Result<String, Refusal> {
    let not_authenticated = |error: String| Refusal::NotAuthenticated {
        audience: audience.to_owned(),
        error,
    };
    let status = status.ok_or_else(|| not_authenticated("the review has no status".into()))?;
    if status.authenticated != Some(true) {
        return Err(not_authenticated(
            status
                .error
                .clone()
                .unwrap_or_else(|| "not authenticated".into()),
        ));
    }
    if let Some(audiences) = &status.audiences
        && !audiences.iter().any(|a| a == audience)
    {
        return Err(not_authenticated(format!(
            "the token's audiences {audiences:?} do not include it"
        )));
    }
    let user = status.user.as_ref();
    let username = user.and_then(|u| u.username.clone()).unwrap_or_default();
    let expected = format!("system:serviceaccount:{service_account}");
    if username != expected {
        return Err(Refusal::WrongServiceAccount { username, expected });
    }
    user.and_then(|u| u.extra.as_ref())
        .and_then(|extra| extra.get(NODE_NAME_EXTRA))
        .and_then(|names| names.first())
        .filter(|name| !name.is_empty())
        .cloned()
        .ok_or(Refusal::NoNode { username })
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::authentication::v1::UserInfo;

    const SA: &str = "kmm:kmm-node-agent";

    fn status(user: &str, node: Option<&str>) -> TokenReviewStatus {
        TokenReviewStatus {
            authenticated: Some(true),
            audiences: Some(vec!["kmm-spoke-proxy".into()]),
            error: None,
            user: Some(UserInfo {
                username: Some(user.into()),
                extra: node.map(|n| [(NODE_NAME_EXTRA.to_string(), vec![n.to_string()])].into()),
                ..Default::default()
            }),
        }
    }

    #[test]
    fn bound_agent_token_names_its_node() {
        let s = status("system:serviceaccount:kmm:kmm-node-agent", Some("node-1"));
        assert_eq!(
            bound_node(Some(&s), "kmm-spoke-proxy", SA),
            Ok("node-1".into())
        );
    }

    #[test]
    fn unauthenticated_token_is_refused_with_the_apiservers_error() {
        let mut s = status("", None);
        s.authenticated = Some(false);
        s.error = Some("token audiences do not match".into());
        let refusal = bound_node(Some(&s), "kmm-spoke-proxy", SA).unwrap_err();
        assert!(!refusal.is_permission());
        assert!(refusal.to_string().contains("token audiences do not match"));
        assert!(bound_node(None, "kmm-spoke-proxy", SA).is_err());
    }

    #[test]
    fn other_audience_is_refused() {
        let mut s = status("system:serviceaccount:kmm:kmm-node-agent", Some("n"));
        s.audiences = Some(vec!["other".into()]);
        let refusal = bound_node(Some(&s), "kmm-spoke-proxy", SA).unwrap_err();
        assert!(matches!(refusal, Refusal::NotAuthenticated { .. }));
    }

    #[test]
    fn other_service_account_is_refused() {
        let s = status("system:serviceaccount:default:default", Some("n"));
        let refusal = bound_node(Some(&s), "kmm-spoke-proxy", SA).unwrap_err();
        assert!(refusal.is_permission());
        assert!(
            refusal
                .to_string()
                .contains("system:serviceaccount:kmm:kmm-node-agent")
        );
    }

    #[test]
    fn token_without_node_is_refused() {
        let s = status("system:serviceaccount:kmm:kmm-node-agent", None);
        assert!(matches!(
            bound_node(Some(&s), "kmm-spoke-proxy", SA),
            Err(Refusal::NoNode { .. })
        ));
        let empty = status("system:serviceaccount:kmm:kmm-node-agent", Some(""));
        assert!(bound_node(Some(&empty), "kmm-spoke-proxy", SA).is_err());
    }
}
