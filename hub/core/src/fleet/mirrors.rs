//! A cluster's image mirrors: OCM's AddOnDeploymentConfig `spec.registries`
//! (`{source, mirror}`), which OCM applies to the add-on's own images, applied here to
//! the kmod and device plugin images the cluster is sent too. Pure.
//!
//! The rewrite is OCM's (addon-framework's `OverrideImage`), so that one setting means
//! the same for every image of the cluster: each entry is tried against the image as the
//! module names it, and the last one that matches wins; a `source` matches when the image
//! starts with it (a plain prefix, trailing `/` ignored on both sides), and its prefix is
//! replaced by the `mirror`; an empty `source` replaces everything but the image's last
//! path segment. A kmod image keeps its pinned digest: the cluster pulls the bytes the
//! hub pinned, from its mirror.

use serde::Deserialize;

/// One entry of an ADC's `spec.registries`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(default)]
pub struct ImageMirror {
    pub source: String,
    pub mirror: String,
}

/// `image` as the cluster pulls it through `mirrors`.
pub fn mirrored(mirrors: &[ImageMirror], image: &str) -> String {
    mirrors
        .iter()
        .filter_map(|m| rewrite(&m.source, &m.mirror, image))
        .next_back()
        .unwrap_or_else(|| image.to_owned())
}

fn rewrite(source: &str, mirror: &str, image: &str) -> Option<String> {
    let source = source.trim_end_matches('/');
    let mirror = mirror.trim_end_matches('/');
    if source.is_empty() {
        let last = image.rsplit('/').next().unwrap_or(image);
        return Some(if mirror.is_empty() {
            last.to_owned()
        } else {
            format!("{mirror}/{last}")
        });
    }
    image
        .strip_prefix(source)
        .map(|rest| format!("{mirror}{rest}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mirror(source: &str, mirror: &str) -> ImageMirror {
        ImageMirror {
            source: source.into(),
            mirror: mirror.into(),
        }
    }

    #[test]
    fn a_matching_source_prefix_is_replaced_by_its_mirror() {
        let mirrors = [mirror("quay.io/kmm/", "mirror.internal:5000/kmm/")];
        assert_eq!(
            mirrored(&mirrors, "quay.io/kmm/hello:6.1"),
            "mirror.internal:5000/kmm/hello:6.1"
        );
        assert_eq!(
            mirrored(&mirrors, "quay.io/other/hello:6.1"),
            "quay.io/other/hello:6.1",
            "no match, no change"
        );
        assert_eq!(mirrored(&[], "r/x:1"), "r/x:1");
    }

    #[test]
    fn matching_is_a_plain_prefix_as_ocms() {
        // OCM compares strings, not path segments: a registry named like another's
        // prefix matches too.
        let mirrors = [mirror("registry.example", "mirror.example")];
        assert_eq!(
            mirrored(&mirrors, "registry.example.org/x:1"),
            "mirror.example.org/x:1"
        );
    }

    #[test]
    fn the_last_matching_entry_wins_and_each_applies_to_the_original_image() {
        let mirrors = [
            mirror("r.example/kmm", "first.example/kmm"),
            mirror("r.example", "second.example"),
            mirror("first.example", "never.example"),
        ];
        assert_eq!(
            mirrored(&mirrors, "r.example/kmm/x:1"),
            "second.example/kmm/x:1"
        );
    }

    #[test]
    fn an_empty_source_keeps_only_the_last_segment() {
        assert_eq!(
            mirrored(&[mirror("", "m.example/flat")], "r.example/a/b/x:1"),
            "m.example/flat/x:1"
        );
        assert_eq!(mirrored(&[mirror("", "")], "r.example/a/x:1"), "x:1");
    }

    #[test]
    fn a_digest_is_kept() {
        let mirrors = [mirror("r.example", "m.example")];
        assert_eq!(
            mirrored(&mirrors, "r.example/x@sha256:aa"),
            "m.example/x@sha256:aa"
        );
    }
}
