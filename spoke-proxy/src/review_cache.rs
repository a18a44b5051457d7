//! What TokenReviews answered, kept so that an agent reconnecting (or one hammering the
//! proxy) does not make it ask the API server every time. Keyed by the token's SHA-256,
//! never the token; bounded in size; an answer lasts until the token expires, and at most
//! [`MAX_AGE`] (a token revoked by deleting its Pod is refused again within that). Pure.

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use base64::Engine as _;
use sha2::{Digest, Sha256};

/// How long an answer is trusted at most.
pub const MAX_AGE: Duration = Duration::from_secs(60);
/// How long a refusal is remembered: a bad token retried in a loop costs one review.
pub const REFUSAL_AGE: Duration = Duration::from_secs(10);

/// What a review said.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Answer {
    /// The node the token is bound to.
    Node(String),
    /// Why it was refused (the message returned to the agent).
    Refused { permission: bool, message: String },
}

#[derive(Debug)]
pub struct ReviewCache {
    capacity: usize,
    entries: HashMap<[u8; 32], (Answer, Instant)>,
    /// Keys in insertion order, for evicting the oldest when full.
    order: VecDeque<[u8; 32]>,
}

impl ReviewCache {
    pub fn new(capacity: usize) -> Self {
        Self {
            capacity: capacity.max(1),
            entries: HashMap::new(),
            order: VecDeque::new(),
        }
    }

    pub fn get(&self, token: &str, now: Instant) -> Option<&Answer> {
        self.entries
            .get(&key(token))
            .filter(|(_, until)| now < *until)
            .map(|(answer, _)| answer)
    }

    /// Remembers `answer` until `until` (the caller bounds it by the token's expiry).
    pub fn insert(&mut self, token: &str, answer: Answer, until: Instant) {
        let key = key(token);
        if self.entries.insert(key, (answer, until)).is_none() {
            self.order.push_back(key);
        }
        while self.entries.len() > self.capacity {
            let Some(oldest) = self.order.pop_front() else {
                break;
            };
            self.entries.remove(&oldest);
        }
        if self.order.len() > 2 * self.capacity {
            self.order.retain(|k| self.entries.contains_key(k));
        }
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

fn key(token: &str) -> [u8; 32] {
    Sha256::digest(token.as_bytes()).into()
}

/// When a ServiceAccount token (a JWT) expires, from its `exp` claim; `None` when it has
/// none or is no JWT. Read only after the API server accepted the token.
pub fn token_expiry(token: &str) -> Option<SystemTime> {
    let payload = token.split('.').nth(1)?;
    let bytes = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(payload.trim_end_matches('='))
        .ok()?;
    let claims: serde_json::Value = serde_json::from_slice(&bytes).ok()?;
    let exp = claims.get("exp")?.as_u64()?;
    Some(UNIX_EPOCH + Duration::from_secs(exp))
}

/// `at` on the monotonic clock (`now` if it has passed).
pub fn instant_of(at: SystemTime, now: Instant) -> Instant {
    now + at.duration_since(SystemTime::now()).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(name: &str) -> Answer {
        Answer::Node(name.into())
    }

    #[test]
    fn answers_last_until_their_time_and_are_keyed_by_the_token() {
        let now = Instant::now();
        let mut cache = ReviewCache::new(10);
        cache.insert("t1", node("a"), now + Duration::from_secs(5));
        assert_eq!(cache.get("t1", now), Some(&node("a")));
        assert_eq!(cache.get("t2", now), None);
        assert_eq!(
            cache.get("t1", now + Duration::from_secs(5)),
            None,
            "expired"
        );
    }

    #[test]
    fn the_oldest_go_when_full() {
        let now = Instant::now();
        let later = now + Duration::from_secs(60);
        let mut cache = ReviewCache::new(3);
        for i in 0..10 {
            cache.insert(&format!("t{i}"), node("n"), later);
            cache.insert(&format!("t{i}"), node("n"), later);
        }
        assert_eq!(cache.len(), 3);
        assert!(cache.get("t9", now).is_some() && cache.get("t7", now).is_some());
        assert!(cache.get("t6", now).is_none());
        assert!(cache.order.len() <= 6);
    }

    #[test]
    fn expiry_comes_from_the_jwt() {
        let b64 = |s: &str| base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(s);
        let token = format!(
            "{}.{}.sig",
            b64(r#"{"alg":"RS256"}"#),
            b64(r#"{"exp":1800000000,"sub":"x"}"#)
        );
        assert_eq!(
            token_expiry(&token),
            Some(UNIX_EPOCH + Duration::from_secs(1_800_000_000))
        );
        assert_eq!(token_expiry("not a jwt"), None);
        let no_exp = format!("h.{}.s", b64(r#"{"sub":"x"}"#));
        assert_eq!(token_expiry(&no_exp), None);
    }
}
