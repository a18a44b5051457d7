//! What a proxy's hello may say. Pure.

use kmm_proto::limits::MAX_INTENT_REVISION;
use kmm_proto::v1::ProxyHello;

/// Why a hello is refused: the field, its value and the limit.
pub fn check(hello: &ProxyHello) -> Result<(), String> {
    if hello.applied_intent_revision > MAX_INTENT_REVISION {
        return Err(format!(
            "ProxyHello.applied_intent_revision {} exceeds the highest revision a hub sends ({MAX_INTENT_REVISION})",
            hello.applied_intent_revision
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hello(revision: u64) -> ProxyHello {
        ProxyHello {
            applied_intent_revision: revision,
            ..ProxyHello::default()
        }
    }

    #[test]
    fn a_revision_no_hub_could_have_sent_is_refused_by_field_and_value() {
        assert_eq!(check(&hello(0)), Ok(()));
        assert_eq!(check(&hello(MAX_INTENT_REVISION)), Ok(()));
        let refused = check(&hello(u64::MAX)).unwrap_err();
        assert!(
            refused.contains("applied_intent_revision") && refused.contains(&u64::MAX.to_string()),
            "{refused}"
        );
    }
}
