//! Module signature refusals: when the kernel enforces module signing, modprobe only
//! relays the errno text ("Key was rejected by service", "Required key not available"),
//! which does not tell an operator that the signature is the problem. Pure, no I/O.

/// errno texts of a signature refusal, and what each means.
const REFUSALS: &[(&str, &str)] = &[
    (
        // EKEYREJECTED: also what Linux 6.1 returns for an unsigned module under
        // module.sig_enforce=1 (seen in the qemu test).
        "Key was rejected by service",
        "the module is unsigned, or its signature is invalid or made with a key the kernel \
         does not trust, and the kernel enforces module signatures",
    ),
    (
        // ENOKEY
        "Required key not available",
        "the module is unsigned, or signed with a key missing from the kernel's keyrings, \
         and the kernel enforces module signatures",
    ),
];

/// A load error as reported: when the kernel refused the module's signature, a clear
/// statement of that comes first, followed by the original text in full; any other
/// error is returned unchanged.
pub fn explain(error: &str) -> String {
    match REFUSALS.iter().find(|(marker, _)| error.contains(marker)) {
        Some((marker, meaning)) => {
            format!("the kernel refused the module's signature ({marker}: {meaning}); {error}")
        }
        None => error.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rejected_key_is_named_and_the_full_text_kept() {
        let modprobe = "modprobe -d /c/opt kmm_hello failed (exit status: 1): \
                        modprobe: ERROR: could not insert 'kmm_hello': Key was rejected by service";
        let explained = explain(modprobe);
        assert!(
            explained.starts_with(
                "the kernel refused the module's signature (Key was rejected by service: "
            ),
            "{explained}"
        );
        assert!(explained.ends_with(modprobe), "{explained}");
    }

    #[test]
    fn missing_key_is_named_and_the_full_text_kept() {
        let modprobe = "modprobe: ERROR: could not insert 'kmm_hello': Required key not available";
        let explained = explain(modprobe);
        assert!(
            explained.starts_with("the kernel refused the module's signature (Required key not available: the module is unsigned"),
            "{explained}"
        );
        assert!(explained.ends_with(modprobe), "{explained}");
    }

    #[test]
    fn other_errors_are_unchanged() {
        for error in [
            "",
            "modprobe: ERROR: could not insert 'kmm_hello': Exec format error",
            "modprobe: ERROR: could not insert 'kmm_hello': Unknown symbol in module",
            "key was rejected", // not the errno text
        ] {
            assert_eq!(explain(error), error);
        }
    }
}
