//! Upstream Kernel Module Management's documented examples, one per feature, written anew
//! in the shapes upstream documents them (`fixtures/upstream-docs/`): each reads as a
//! ManagedClusterModule and serializes back unchanged. What each does once applied is
//! tested on the hub (`hub/tests/upstream_examples.rs`: admission, rendering, intents).

use kmm_api::ManagedClusterModule;
use serde_json::Value;

/// Every example, by file name.
const EXAMPLES: &[(&str, &str)] = &[
    (
        "kernel-mappings",
        include_str!("fixtures/upstream-docs/kernel-mappings.yaml"),
    ),
    ("build", include_str!("fixtures/upstream-docs/build.yaml")),
    (
        "sign-prebuilt",
        include_str!("fixtures/upstream-docs/sign-prebuilt.yaml"),
    ),
    (
        "build-and-sign",
        include_str!("fixtures/upstream-docs/build-and-sign.yaml"),
    ),
    (
        "in-tree-removal",
        include_str!("fixtures/upstream-docs/in-tree-removal.yaml"),
    ),
    (
        "modprobe",
        include_str!("fixtures/upstream-docs/modprobe.yaml"),
    ),
    (
        "modprobe-raw-args",
        include_str!("fixtures/upstream-docs/modprobe-raw-args.yaml"),
    ),
    (
        "firmware",
        include_str!("fixtures/upstream-docs/firmware.yaml"),
    ),
    (
        "device-plugin-only",
        include_str!("fixtures/upstream-docs/device-plugin-only.yaml"),
    ),
    (
        "image-repo-secret",
        include_str!("fixtures/upstream-docs/image-repo-secret.yaml"),
    ),
    (
        "ordered-upgrade",
        include_str!("fixtures/upstream-docs/ordered-upgrade.yaml"),
    ),
    (
        "tolerations-and-selector",
        include_str!("fixtures/upstream-docs/tolerations-and-selector.yaml"),
    ),
    (
        "image-pull-policy",
        include_str!("fixtures/upstream-docs/image-pull-policy.yaml"),
    ),
];

#[test]
fn every_documented_example_reads_and_round_trips_unchanged() {
    for (name, text) in EXAMPLES {
        let original: Value = serde_yaml_ng::from_str(text).expect(name);
        let mcm: ManagedClusterModule =
            serde_json::from_value(original.clone()).unwrap_or_else(|e| panic!("{name}: {e}"));
        let back = serde_json::to_value(&mcm).expect("serializes");
        assert_eq!(
            back, original,
            "{name}: the round trip changed the document"
        );
    }
}

#[test]
fn every_example_file_is_listed() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/upstream-docs");
    let mut files: Vec<String> = std::fs::read_dir(&dir)
        .expect("the examples' directory")
        .map(|entry| {
            let name = entry
                .expect("an entry")
                .file_name()
                .into_string()
                .expect("UTF-8");
            name.trim_end_matches(".yaml").to_owned()
        })
        .collect();
    files.sort();
    let mut listed: Vec<String> = EXAMPLES
        .iter()
        .map(|(name, _)| (*name).to_owned())
        .collect();
    listed.sort();
    assert_eq!(files, listed);
}
