//! OCI image references (`[host[:port]/]path[:tag][@digest]`), read by the distribution
//! grammar into oci-spec's [`Reference`], exactly as `Reference::from_str` reads them
//! (`tests/as_oci_spec.rs` compares both on generated references) but without its regex.
//! That regex spells a tag as `[\w][\w.-]{0,127}` with Unicode `\w`; compiled, it took a
//! process 17 MiB at its peak and kept 8 MiB for good: most of an idle node agent's heap.
//!
//! One deliberate difference: a tag is ASCII here (`[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}`),
//! as the distribution specification defines it, where oci-spec's regex also admits
//! Unicode letters that no registry accepts.

use oci_spec::distribution::{ParseError, Reference};

/// The longest repository path (after `docker.io`'s `library/` is added).
const NAME_TOTAL_LENGTH_MAX: usize = 255;
const DOCKER_HUB: &str = "docker.io";
const DOCKER_HUB_LEGACY: &str = "index.docker.io";
const DOCKER_HUB_OFFICIAL: &str = "library";
const DEFAULT_TAG: &str = "latest";
const TAG_MAX: usize = 128;

/// Reads `s` as `Reference::from_str` does; the same errors for the same faults.
pub fn parse(s: &str) -> Result<Reference, ParseError> {
    if s.is_empty() {
        return Err(ParseError::NameEmpty);
    }
    let (rest, digest) = match s.split_once('@') {
        Some((rest, digest)) if is_digest(digest) => (rest, Some(digest)),
        Some(_) => return Err(ParseError::ReferenceInvalidFormat),
        None => (s, None),
    };
    // A `:` after the last `/` starts the tag; one before it is the registry's port.
    let (name, tag) = match rest.rfind(':') {
        Some(colon) if !rest[colon..].contains('/') => (&rest[..colon], Some(&rest[colon + 1..])),
        _ => (rest, None),
    };
    if tag.is_some_and(|tag| !is_tag(tag)) || !is_name(name) {
        return Err(ParseError::ReferenceInvalidFormat);
    }
    let (registry, repository) = split_domain(name);
    if repository.len() > NAME_TOTAL_LENGTH_MAX {
        return Err(ParseError::NameTooLong);
    }
    if let Some(digest) = digest {
        check_digest_length(digest)?;
    }
    let tag = tag.map(str::to_owned);
    Ok(match (tag, digest.map(str::to_owned)) {
        (Some(tag), Some(digest)) => {
            Reference::with_tag_and_digest(registry, repository, tag, digest)
        }
        (Some(tag), None) => Reference::with_tag(registry, repository, tag),
        (None, Some(digest)) => Reference::with_digest(registry, repository, digest),
        (None, None) => Reference::with_tag(registry, repository, DEFAULT_TAG.to_owned()),
    })
}

/// `[domain "/"] path`: the domain is tried first, as the grammar's optional prefix.
fn is_name(name: &str) -> bool {
    is_path(name)
        || name
            .split_once('/')
            .is_some_and(|(domain, path)| is_domain(domain) && is_path(path))
}

/// `host [":" port]`, the host's labels alphanumeric with inner `-`, joined by `.`.
fn is_domain(domain: &str) -> bool {
    let (host, port) = match domain.split_once(':') {
        Some((host, port)) => (host, Some(port)),
        None => (domain, None),
    };
    let label = |label: &str| {
        let bytes = label.as_bytes();
        !bytes.is_empty()
            && bytes
                .iter()
                .all(|b| b.is_ascii_alphanumeric() || *b == b'-')
            && bytes[0] != b'-'
            && bytes[bytes.len() - 1] != b'-'
    };
    host.split('.').all(label)
        && port.is_none_or(|port| !port.is_empty() && port.bytes().all(|b| b.is_ascii_digit()))
}

/// Path components joined by `/`.
fn is_path(path: &str) -> bool {
    path.split('/').all(is_path_component)
}

/// Runs of `[a-z0-9]` joined by one separator: `.`, `_`, `__` or any number of `-`.
fn is_path_component(component: &str) -> bool {
    let bytes = component.as_bytes();
    let alnum = |b: &u8| b.is_ascii_lowercase() || b.is_ascii_digit();
    if bytes.is_empty() || !alnum(&bytes[0]) || !alnum(&bytes[bytes.len() - 1]) {
        return false;
    }
    let mut separator = String::new();
    for b in bytes {
        if alnum(b) {
            if !matches!(separator.as_str(), "" | "." | "_" | "__") && !is_dashes(&separator) {
                return false;
            }
            separator.clear();
        } else {
            separator.push(char::from(*b));
        }
    }
    true
}

fn is_dashes(separator: &str) -> bool {
    separator.bytes().all(|b| b == b'-')
}

/// `[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}`.
fn is_tag(tag: &str) -> bool {
    let word = |b: &u8| b.is_ascii_alphanumeric() || *b == b'_';
    let bytes = tag.as_bytes();
    !bytes.is_empty()
        && bytes.len() <= TAG_MAX
        && word(&bytes[0])
        && bytes.iter().all(|b| word(b) || *b == b'.' || *b == b'-')
}

/// `algorithm ":" hex{32,}`, the algorithm's parts alphanumeric (letter first), joined
/// by one of `-_+.`.
fn is_digest(digest: &str) -> bool {
    let Some((algorithm, hex)) = digest.split_once(':') else {
        return false;
    };
    let part = |part: &str| {
        let bytes = part.as_bytes();
        !bytes.is_empty()
            && bytes[0].is_ascii_alphabetic()
            && bytes.iter().all(u8::is_ascii_alphanumeric)
    };
    algorithm.split(['-', '_', '+', '.']).all(part)
        && hex.len() >= 32
        && hex.bytes().all(|b| b.is_ascii_hexdigit())
}

/// Known algorithms have a fixed length; others are refused.
fn check_digest_length(digest: &str) -> Result<(), ParseError> {
    let (algorithm, hex) = digest
        .split_once(':')
        .ok_or(ParseError::DigestInvalidFormat)?;
    let length = match algorithm {
        "sha256" => 64,
        "sha384" => 96,
        "sha512" => 128,
        _ => return Err(ParseError::DigestUnsupported),
    };
    if hex.len() == length {
        Ok(())
    } else {
        Err(ParseError::DigestInvalidLength)
    }
}

/// A first component that looks like a host (a `.` or `:`, or `localhost`) is the
/// registry; otherwise the registry is Docker Hub, whose one-component names live under
/// `library/`.
fn split_domain(name: &str) -> (String, String) {
    let (mut domain, mut path) = match name.split_once('/') {
        Some((first, rest))
            if first.contains('.') || first.contains(':') || first == "localhost" =>
        {
            (first.to_owned(), rest.to_owned())
        }
        _ => (DOCKER_HUB.to_owned(), name.to_owned()),
    };
    if domain == DOCKER_HUB_LEGACY {
        domain = DOCKER_HUB.to_owned();
    }
    if domain == DOCKER_HUB && !path.contains('/') {
        path = format!("{DOCKER_HUB_OFFICIAL}/{path}");
    }
    (domain, path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_each_part() {
        let digest = format!("sha256:{}", "a".repeat(64));
        let r = parse(&format!("registry.example:5000/team/kmod:v1.2@{digest}")).unwrap();
        assert_eq!(
            (r.registry(), r.repository(), r.tag(), r.digest()),
            (
                "registry.example:5000",
                "team/kmod",
                Some("v1.2"),
                Some(digest.as_str())
            )
        );
    }

    #[test]
    fn docker_hub_names_get_their_registry_and_library() {
        let r = parse("busybox").unwrap();
        assert_eq!(
            (r.registry(), r.repository(), r.tag()),
            ("docker.io", "library/busybox", Some("latest"))
        );
        let r = parse("index.docker.io/vendor/kmod:1").unwrap();
        assert_eq!((r.registry(), r.repository()), ("docker.io", "vendor/kmod"));
        let r = parse("localhost/kmod:1").unwrap();
        assert_eq!((r.registry(), r.repository()), ("localhost", "kmod"));
    }

    #[test]
    fn a_colon_before_a_slash_is_a_port_after_it_a_tag() {
        let r = parse("host:5000/kmod").unwrap();
        assert_eq!((r.registry(), r.tag()), ("host:5000", Some("latest")));
        let r = parse("host.example:5000").unwrap();
        assert_eq!(
            (r.registry(), r.repository(), r.tag()),
            ("docker.io", "library/host.example", Some("5000"))
        );
    }

    #[test]
    fn refuses_what_the_grammar_refuses() {
        for bad in [
            ":tag",
            "kmod:",
            "team/Kmod:1",
            "team/kmod:-1",
            "team//kmod",
            "team/kmod/",
            "a.-b/kmod",
            "host:port/kmod",
            "-host.example/kmod",
            "team/a___b",
            "team/a._b",
            "kmod@sha256:abc",
            "kmod@@sha256:0123456789abcdef0123456789abcdef",
        ] {
            assert_eq!(parse(bad), Err(ParseError::ReferenceInvalidFormat), "{bad}");
        }
        assert_eq!(parse(""), Err(ParseError::NameEmpty));
        assert_eq!(
            parse(&format!("kmod:{}", "t".repeat(129))),
            Err(ParseError::ReferenceInvalidFormat)
        );
        assert_eq!(
            parse(&format!("kmod@sha256:{}", "f".repeat(40))),
            Err(ParseError::DigestInvalidLength)
        );
        assert_eq!(
            parse(&format!("kmod@md5:{}", "f".repeat(32))),
            Err(ParseError::DigestUnsupported)
        );
        assert_eq!(
            parse(&format!("host.example/{}", "a".repeat(256))),
            Err(ParseError::NameTooLong)
        );
    }

    #[test]
    fn separators_inside_path_components() {
        for good in ["a.b", "a_b", "a__b", "a-b", "a---b", "a1.b2_c3__d4-e5"] {
            assert!(is_path_component(good), "{good}");
        }
        for bad in ["a.", ".a", "a..b", "a-.b", "a___b", "A", "a_-b"] {
            assert!(!is_path_component(bad), "{bad}");
        }
    }
}
