//! Every release in the corpus yields exactly the variables it is documented to have.

use std::collections::BTreeMap;

use kmm_resolver::KernelRelease;
use serde::Deserialize;

#[derive(Deserialize)]
struct Entry {
    release: String,
    normalized: String,
    xyz: Option<[String; 3]>,
    rhel: Option<Rhel>,
    debian: Option<Flavored>,
    ubuntu: Option<Flavored>,
}

#[derive(Deserialize)]
struct Rhel {
    release: String,
    version: String,
    arch: String,
}

#[derive(Deserialize)]
struct Flavored {
    release: String,
    flavor: String,
}

fn corpus() -> Vec<Entry> {
    serde_yaml_ng::from_str(include_str!("corpus/kernels.yaml")).expect("corpus parses")
}

fn expected(entry: &Entry) -> BTreeMap<&'static str, String> {
    let mut v = BTreeMap::from([
        ("KERNEL_FULL_VERSION", entry.normalized.clone()),
        ("KERNEL_VERSION", entry.normalized.clone()),
    ]);
    if let Some([x, y, z]) = &entry.xyz {
        v.insert("KERNEL_XYZ", format!("{x}.{y}.{z}"));
        v.insert("KERNEL_X", x.clone());
        v.insert("KERNEL_Y", y.clone());
        v.insert("KERNEL_Z", z.clone());
    }
    if let Some(r) = &entry.rhel {
        v.insert("KERNEL_RHEL_RELEASE", r.release.clone());
        v.insert("KERNEL_RHEL_VERSION", r.version.clone());
        v.insert("KERNEL_RHEL_ARCH", r.arch.clone());
    }
    if let Some(d) = &entry.debian {
        v.insert("KERNEL_DEBIAN_RELEASE", d.release.clone());
        v.insert("KERNEL_DEBIAN_FLAVOR", d.flavor.clone());
    }
    if let Some(u) = &entry.ubuntu {
        v.insert("KERNEL_UBUNTU_RELEASE", u.release.clone());
        v.insert("KERNEL_UBUNTU_FLAVOR", u.flavor.clone());
    }
    v
}

#[test]
fn corpus_is_large_and_covers_every_family() {
    let corpus = corpus();
    assert!(corpus.len() >= 40, "only {} releases", corpus.len());
    for (family, count) in [
        ("rhel", corpus.iter().filter(|e| e.rhel.is_some()).count()),
        (
            "debian",
            corpus.iter().filter(|e| e.debian.is_some()).count(),
        ),
        (
            "ubuntu",
            corpus.iter().filter(|e| e.ubuntu.is_some()).count(),
        ),
        (
            "other",
            corpus
                .iter()
                .filter(|e| e.rhel.is_none() && e.debian.is_none() && e.ubuntu.is_none())
                .count(),
        ),
    ] {
        assert!(count >= 5, "{family} has only {count} releases");
    }
}

#[test]
fn every_release_defines_exactly_its_variables() {
    let mut failures = Vec::new();
    for entry in corpus() {
        let kernel = KernelRelease::parse(&entry.release);
        let want = expected(&entry);
        if kernel.variables() != &want {
            failures.push(format!(
                "{}:\n  want {want:?}\n   got {:?}",
                entry.release,
                kernel.variables()
            ));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
