//! The parser reads every reference as oci-spec's `Reference::from_str` does: the same
//! reference, or the same error. Inputs are ASCII (the one documented difference is
//! Unicode letters in tags) and built from the grammar's pieces, valid and broken, so
//! that both acceptance and every error are reached often.

use std::str::FromStr;

use kmm_image_reference::parse;
use oci_spec::distribution::Reference;
use proptest::prelude::*;

fn label() -> impl Strategy<Value = String> {
    prop_oneof![
        "[a-z0-9]{1,4}",
        "[a-zA-Z0-9-]{1,6}",
        Just("localhost".to_owned()),
        Just("index.docker.io".to_owned()),
        Just("docker.io".to_owned()),
    ]
}

fn domain() -> impl Strategy<Value = String> {
    (
        prop::collection::vec(label(), 1..3),
        prop::option::of("[0-9]{0,5}|[a-z]{1,2}"),
    )
        .prop_map(|(labels, port)| {
            let host = labels.join(".");
            match port {
                Some(port) => format!("{host}:{port}"),
                None => host,
            }
        })
}

fn component() -> impl Strategy<Value = String> {
    prop_oneof![
        4 => "[a-z0-9]{1,3}([._]|__|-{1,2})?[a-z0-9]{1,3}",
        1 => "[a-zA-Z0-9._-]{0,5}",
    ]
}

fn tag() -> impl Strategy<Value = String> {
    prop_oneof![
        4 => "[A-Za-z0-9_][A-Za-z0-9_.-]{0,8}",
        1 => "[A-Za-z0-9_.:-]{0,4}",
        1 => "[a-z]{126,130}",
    ]
}

fn digest() -> impl Strategy<Value = String> {
    let algorithm = prop_oneof![
        Just("sha256".to_owned()),
        Just("sha384".to_owned()),
        Just("sha512".to_owned()),
        "[a-zA-Z][a-zA-Z0-9]{0,3}([-_+.][a-zA-Z0-9]{1,3})?",
    ];
    let hex = prop_oneof![Just(64usize), Just(96), Just(128), 0usize..140,]
        .prop_flat_map(|len| prop::collection::vec("[0-9a-fA-F]", len).prop_map(|h| h.concat()));
    (algorithm, hex, any::<bool>()).prop_map(|(algorithm, hex, colon)| {
        if colon {
            format!("{algorithm}:{hex}")
        } else {
            format!("{algorithm}{hex}")
        }
    })
}

fn reference() -> impl Strategy<Value = String> {
    (
        prop::option::of(domain()),
        prop::collection::vec(component(), 1..4),
        prop::option::of(tag()),
        prop::option::of(digest()),
    )
        .prop_map(|(domain, path, tag, digest)| {
            let mut s = domain.map(|d| format!("{d}/")).unwrap_or_default();
            s.push_str(&path.join("/"));
            if let Some(tag) = tag {
                s.push(':');
                s.push_str(&tag);
            }
            if let Some(digest) = digest {
                s.push('@');
                s.push_str(&digest);
            }
            s
        })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(4_000))]

    #[test]
    fn reads_references_as_oci_spec_does(s in reference()) {
        prop_assert_eq!(parse(&s), Reference::from_str(&s), "{}", s);
    }

    #[test]
    fn reads_any_ascii_as_oci_spec_does(s in "[a-zA-Z0-9._:/@-]{0,40}") {
        prop_assert_eq!(parse(&s), Reference::from_str(&s), "{}", s);
    }
}

#[test]
fn long_repositories_fail_alike() {
    for s in [
        format!("host.example/{}", "a".repeat(255)),
        format!("host.example/{}", "a".repeat(256)),
        format!("{}:1", "a".repeat(248)),
        format!("{}:1", "a".repeat(247)),
    ] {
        assert_eq!(parse(&s), Reference::from_str(&s), "{s}");
    }
}
