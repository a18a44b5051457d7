//! Image references: valid by the distribution grammar, and pinned by a tag or digest.

use thiserror::Error;

/// Why an image reference is not acceptable.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum ImageReferenceError {
    /// Not a valid reference at all.
    #[error("{reference:?} is not a valid image reference: {reason}")]
    Invalid {
        /// The reference as written.
        reference: String,
        /// The grammar rule it breaks.
        reason: String,
    },
    /// Valid, but it would silently mean `:latest`.
    #[error("{reference:?} has neither a tag nor a digest; set one explicitly")]
    Unpinned {
        /// The reference as written.
        reference: String,
    },
}

/// Checks that `reference` parses and names a tag or a digest explicitly.
pub fn check(reference: &str) -> Result<(), ImageReferenceError> {
    kmm_image_reference::parse(reference).map_err(|e| ImageReferenceError::Invalid {
        reference: reference.to_owned(),
        reason: e.to_string(),
    })?;
    // A `:` in the last path component can only be a tag separator: a registry port lives
    // in the first component, before a `/`.
    let last_component = reference.rsplit('/').next().unwrap_or(reference);
    if reference.contains('@') || last_component.contains(':') {
        Ok(())
    } else {
        Err(ImageReferenceError::Unpinned {
            reference: reference.to_owned(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pinned_references_pass() {
        for r in [
            "quay.io/vendor/kmod:v1",
            "localhost:5000/samples/kmm-hello:6.1.0-13-amd64",
            "registry.example.com:443/a/b/c:1.2.3",
            "busybox:1.36",
            "quay.io/x/y@sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef",
            "quay.io/x/y:tag@sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef",
        ] {
            assert_eq!(check(r), Ok(()), "{r}");
        }
    }

    #[test]
    fn unpinned_references_fail() {
        for r in ["quay.io/vendor/kmod", "localhost:5000/kmod", "busybox"] {
            assert!(
                matches!(check(r), Err(ImageReferenceError::Unpinned { .. })),
                "{r}"
            );
        }
    }

    #[test]
    fn invalid_references_fail() {
        for r in [
            "",
            "Quay.io/UPPER/case:v1",
            "quay.io/x:tag with space",
            "quay.io/x:5.14.0-570.el9_6.x86_64+rt",
            "quay.io/x@sha256:short",
            ":v1",
        ] {
            assert!(
                matches!(check(r), Err(ImageReferenceError::Invalid { .. })),
                "{r:?}"
            );
        }
    }
}
