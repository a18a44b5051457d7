//! Kernel release strings, as a node reports them, and the variables they define.
//!
//! Generic variables (`KERNEL_X`, ...) exist when the release starts with `X.Y.Z`; the
//! distribution variables exist exactly when the release has that distribution's shape, so
//! a template that needs `KERNEL_RHEL_ARCH` fails loudly on an Ubuntu kernel instead of
//! producing an image name with a hole in it.

use std::{collections::BTreeMap, sync::LazyLock};

use regex::Regex;

/// Every variable a kernel release can define, in documentation order.
pub const KERNEL_VARIABLES: &[&str] = &[
    "KERNEL_FULL_VERSION",
    "KERNEL_VERSION",
    "KERNEL_XYZ",
    "KERNEL_X",
    "KERNEL_Y",
    "KERNEL_Z",
    "KERNEL_RHEL_VERSION",
    "KERNEL_RHEL_RELEASE",
    "KERNEL_RHEL_ARCH",
    "KERNEL_DEBIAN_RELEASE",
    "KERNEL_DEBIAN_FLAVOR",
    "KERNEL_UBUNTU_RELEASE",
    "KERNEL_UBUNTU_FLAVOR",
];

static XYZ: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r"^([0-9]+)\.([0-9]+)\.([0-9]+)(?:[^0-9]|$)").expect("valid"));

// `4.18.0-348.23.1.el8_5.x86_64`, `5.14.0-284.11.1.rt14.296.el9_2.x86_64`,
// `5.14.0-570.12.1.el9_6.x86_64+rt`, `5.14.0-427.13.1.el9_4.aarch64+64k`.
static RHEL: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(
        r"^[0-9]+\.[0-9]+\.[0-9]+-([0-9][0-9A-Za-z_.]*?\.(el[0-9]+(?:_[0-9]+)?))\.(x86_64|aarch64|ppc64le|s390x)(?:\+[0-9A-Za-z-]+)?$",
    )
    .expect("valid")
});

// `6.1.0-13-amd64`, `6.1.0-18-cloud-amd64`, `6.1.0-18-rt-amd64` (bookworm and older),
// `6.12.38+deb13-amd64` (trixie), `6.12.12+bpo-amd64` (backports). Debian's flavours are
// named after an architecture, which is what tells them from Ubuntu's.
static DEBIAN: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(
        r"^[0-9]+\.[0-9]+\.[0-9]+(?:-([0-9]+(?:\.deb[0-9]+\.[0-9]+)?)|\+(deb[0-9]+|bpo))-((?:cloud-|rt-)?(?:amd64|arm64|armmp|armmp-lpae|686|686-pae|armel|i386|loong64|marvell|mips32r2el|mips64r2el|octeon|powerpc64le|ppc64el|riscv64|rpi|s390x|4kc-malta|5kc-malta|loongson-3))$",
    )
    .expect("valid")
});

// `5.4.0-104-generic`, `5.15.0-1051-aws`, `6.8.0-48-generic-64k`.
static UBUNTU: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(r"^[0-9]+\.[0-9]+\.[0-9]+-([0-9]+)-([a-z][a-z0-9]*(?:-[a-z0-9]+)*)$").expect("valid")
});

/// A kernel release and the variables it defines.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KernelRelease {
    reported: String,
    normalized: String,
    variables: BTreeMap<&'static str, String>,
}

impl KernelRelease {
    /// Parses a release string as reported by a node (`status.nodeInfo.kernelVersion`).
    /// Every string is a release: unknown shapes simply define fewer variables.
    pub fn parse(reported: &str) -> Self {
        // Some kernels (e.g. Container-Optimized OS) report a trailing `+` that upstream KMM
        // trims before matching and templating.
        let normalized = reported.strip_suffix('+').unwrap_or(reported).to_owned();
        let mut variables = BTreeMap::new();
        variables.insert("KERNEL_FULL_VERSION", normalized.clone());
        variables.insert("KERNEL_VERSION", normalized.clone());
        if let Some(c) = XYZ.captures(&normalized) {
            variables.insert("KERNEL_XYZ", format!("{}.{}.{}", &c[1], &c[2], &c[3]));
            variables.insert("KERNEL_X", c[1].to_owned());
            variables.insert("KERNEL_Y", c[2].to_owned());
            variables.insert("KERNEL_Z", c[3].to_owned());
        }
        if let Some(c) = RHEL.captures(&normalized) {
            variables.insert("KERNEL_RHEL_RELEASE", c[1].to_owned());
            variables.insert("KERNEL_RHEL_VERSION", c[2].to_owned());
            variables.insert("KERNEL_RHEL_ARCH", c[3].to_owned());
        } else if let Some(c) = DEBIAN.captures(&normalized) {
            let release = c.get(1).or_else(|| c.get(2)).expect("one branch matched");
            variables.insert("KERNEL_DEBIAN_RELEASE", release.as_str().to_owned());
            variables.insert("KERNEL_DEBIAN_FLAVOR", c[3].to_owned());
        } else if let Some(c) = UBUNTU.captures(&normalized) {
            variables.insert("KERNEL_UBUNTU_RELEASE", c[1].to_owned());
            variables.insert("KERNEL_UBUNTU_FLAVOR", c[2].to_owned());
        }
        Self {
            reported: reported.to_owned(),
            normalized,
            variables,
        }
    }

    /// The release exactly as the node reported it.
    pub fn reported(&self) -> &str {
        &self.reported
    }

    /// The release with a trailing `+` trimmed: what mappings are matched against.
    pub fn normalized(&self) -> &str {
        &self.normalized
    }

    /// The variables this release defines, by name.
    pub fn variables(&self) -> &BTreeMap<&'static str, String> {
        &self.variables
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vars(release: &str) -> BTreeMap<&'static str, String> {
        KernelRelease::parse(release).variables().clone()
    }

    #[test]
    fn trailing_plus_is_trimmed_but_reported_kept() {
        let k = KernelRelease::parse("5.15.133+");
        assert_eq!(k.reported(), "5.15.133+");
        assert_eq!(k.normalized(), "5.15.133");
        assert_eq!(k.variables()["KERNEL_FULL_VERSION"], "5.15.133");
        assert_eq!(k.variables()["KERNEL_Z"], "133");
    }

    #[test]
    fn only_one_trailing_plus_is_trimmed() {
        assert_eq!(KernelRelease::parse("6.1.0++").normalized(), "6.1.0+");
    }

    #[test]
    fn xyz_needs_three_numeric_components() {
        assert!(!vars("6.1").contains_key("KERNEL_X"));
        assert!(!vars("6.1.x").contains_key("KERNEL_XYZ"));
        assert_eq!(vars("6.12.10")["KERNEL_Y"], "12");
        assert_eq!(vars("6.1.0-rc1")["KERNEL_XYZ"], "6.1.0");
    }

    #[test]
    fn families_are_exclusive() {
        for release in [
            "4.18.0-348.23.1.el8_5.x86_64",
            "6.1.0-13-amd64",
            "5.4.0-104-generic",
            "6.1.75",
        ] {
            let v = vars(release);
            let families = [
                "KERNEL_RHEL_ARCH",
                "KERNEL_DEBIAN_FLAVOR",
                "KERNEL_UBUNTU_FLAVOR",
            ]
            .iter()
            .filter(|name| v.contains_key(*name))
            .count();
            assert!(families <= 1, "{release} matched {families} families");
        }
    }

    #[test]
    fn rhel_variants_keep_the_arch() {
        let v = vars("5.14.0-427.13.1.el9_4.aarch64+64k");
        assert_eq!(v["KERNEL_RHEL_ARCH"], "aarch64");
        assert_eq!(v["KERNEL_RHEL_VERSION"], "el9_4");
        assert_eq!(v["KERNEL_RHEL_RELEASE"], "427.13.1.el9_4");
    }

    #[test]
    fn debian_backports_and_trixie_abi() {
        assert_eq!(
            vars("6.12.38+deb13-cloud-amd64")["KERNEL_DEBIAN_RELEASE"],
            "deb13"
        );
        assert_eq!(vars("6.12.12+bpo-amd64")["KERNEL_DEBIAN_RELEASE"], "bpo");
        assert_eq!(
            vars("6.1.0-0.deb11.17-amd64")["KERNEL_DEBIAN_RELEASE"],
            "0.deb11.17"
        );
    }
}
