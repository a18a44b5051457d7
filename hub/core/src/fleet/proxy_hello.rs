//! What a proxy's hello may say, and what it says the proxy holds. Pure.

use kmm_proto::limits::{INTENT_DIGEST, MAX_INTENT_REVISION};
use kmm_proto::v1::ProxyHello;

use super::outbox::Held;

/// What the hello says the proxy holds, or why it is refused: the field, its value and
/// the limit.
pub fn check(hello: &ProxyHello) -> Result<Held, String> {
    if hello.applied_intent_revision > MAX_INTENT_REVISION {
        return Err(format!(
            "ProxyHello.applied_intent_revision {} exceeds the highest revision a hub sends ({MAX_INTENT_REVISION})",
            hello.applied_intent_revision
        ));
    }
    let digest = match hello.applied_intent_digest.as_slice() {
        [] => None,
        bytes => Some(<[u8; INTENT_DIGEST]>::try_from(bytes).map_err(|_| {
            format!(
                "ProxyHello.applied_intent_digest has {} bytes; a SHA-256 has {INTENT_DIGEST}",
                bytes.len()
            )
        })?),
    };
    Ok(Held {
        revision: hello.applied_intent_revision,
        digest,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hello(revision: u64, digest: &[u8]) -> ProxyHello {
        ProxyHello {
            applied_intent_revision: revision,
            applied_intent_digest: digest.to_vec(),
            ..ProxyHello::default()
        }
    }

    #[test]
    fn a_revision_no_hub_could_have_sent_is_refused_by_field_and_value() {
        assert_eq!(check(&hello(0, &[])), Ok(Held::default()));
        assert!(check(&hello(MAX_INTENT_REVISION, &[])).is_ok());
        let refused = check(&hello(u64::MAX, &[])).unwrap_err();
        assert!(
            refused.contains("applied_intent_revision") && refused.contains(&u64::MAX.to_string()),
            "{refused}"
        );
    }

    #[test]
    fn a_digest_is_a_sha256_or_nothing() {
        assert_eq!(
            check(&hello(4, &[7; 32])),
            Ok(Held {
                revision: 4,
                digest: Some([7; 32]),
            })
        );
        let refused = check(&hello(4, &[7; 33])).unwrap_err();
        assert!(
            refused.contains("applied_intent_digest") && refused.contains("33 bytes"),
            "{refused}"
        );
    }
}
