//! Authenticates a node agent: a TokenReview of its projected ServiceAccount token for
//! our audience, then [`bound_node`] decides which node the stream speaks for. Answers
//! are cached ([`ReviewCache`]) and reviews rate-limited ([`TokenBucket`]), so no
//! in-cluster client can make the proxy hammer the API server.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use k8s_openapi::api::authentication::v1::{TokenReview, TokenReviewSpec};
use kube::api::PostParams;
use kube::{Api, Client};
use thiserror::Error;

use crate::agent_identity::{Refusal, bound_node};
use crate::metrics::Metrics;
use crate::review_cache::{Answer, MAX_AGE, REFUSAL_AGE, ReviewCache, instant_of, token_expiry};
use kmm_runtime::rate_limit::TokenBucket;

/// Tokens whose answers are kept (a node has one agent; this is many clusters' worth).
const CACHE_CAPACITY: usize = 10_000;
/// TokenReviews the proxy makes at most: a burst, then a steady rate.
const REVIEW_BURST: u32 = 50;
const REVIEWS_PER_SECOND: u32 = 10;

#[derive(Debug, Error)]
pub enum AuthError {
    #[error("the agent is refused: {0}")]
    Refused(#[from] Refusal),
    #[error("the agent is refused: {message}")]
    RefusedBefore { permission: bool, message: String },
    #[error("cannot review the agent's token: {0}")]
    Review(#[source] kube::Error),
    #[error("too many agents are attaching; retry in {}ms", .retry_in.as_millis())]
    Throttled { retry_in: Duration },
}

/// Who a token speaks for, and until when.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Authenticated {
    pub node: String,
    /// When the token expires (its `exp`), if it says.
    pub expires: Option<SystemTime>,
}

/// See the module documentation.
#[derive(Clone)]
pub struct TokenAuthenticator {
    api: Api<TokenReview>,
    audience: String,
    service_account: String,
    cache: Arc<Mutex<ReviewCache>>,
    reviews: Arc<Mutex<TokenBucket>>,
    metrics: Metrics,
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
    pub fn new(
        client: Client,
        audience: String,
        service_account: String,
        metrics: Metrics,
    ) -> Self {
        Self {
            api: Api::all(client),
            audience,
            service_account,
            cache: Arc::new(Mutex::new(ReviewCache::new(CACHE_CAPACITY))),
            reviews: Arc::new(Mutex::new(TokenBucket::new(
                REVIEW_BURST,
                REVIEWS_PER_SECOND,
                Instant::now(),
            ))),
            metrics,
        }
    }

    /// The node `token` is bound to, from the cache or a TokenReview.
    pub async fn authenticate(&self, token: &str) -> Result<Authenticated, AuthError> {
        let now = Instant::now();
        let cached = lock(&self.cache).get(token, now).cloned();
        let expires = token_expiry(token);
        if let Some(answer) = cached {
            self.metrics.token_review_cache_hits.inc();
            return match answer {
                Answer::Node(node) => Ok(Authenticated { node, expires }),
                Answer::Refused {
                    permission,
                    message,
                } => Err(AuthError::RefusedBefore {
                    permission,
                    message,
                }),
            };
        }
        {
            let mut reviews = lock(&self.reviews);
            if !reviews.try_take(now) {
                return Err(AuthError::Throttled {
                    retry_in: reviews.wait(),
                });
            }
        }
        self.metrics.token_reviews.inc();
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
        let decided = bound_node(
            reviewed.status.as_ref(),
            &self.audience,
            &self.service_account,
        );
        let mut cache = lock(&self.cache);
        match decided {
            Ok(node) => {
                let until =
                    expires.map_or(now + MAX_AGE, |at| instant_of(at, now).min(now + MAX_AGE));
                cache.insert(token, Answer::Node(node.clone()), until);
                Ok(Authenticated { node, expires })
            }
            Err(refusal) => {
                let answer = Answer::Refused {
                    permission: refusal.is_permission(),
                    message: refusal.to_string(),
                };
                cache.insert(token, answer, now + REFUSAL_AGE);
                Err(refusal.into())
            }
        }
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}
