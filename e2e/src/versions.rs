//! The pinned upstream versions (`e2e/versions.toml`).

use serde::Deserialize;

const VERSIONS_TOML: &str = include_str!("../versions.toml");

/// Every pinned upstream version the local fleet is built from.
#[derive(Debug, Clone, Deserialize)]
pub struct Versions {
    pub kubernetes: Kubernetes,
    pub etcd: Pinned,
    pub ocm: Ocm,
    pub clusteradm: Pinned,
    pub kwok: Pinned,
    pub prometheus: Pinned,
    pub helm: Pinned,
    pub kernels: Kernels,
}

#[derive(Debug, Clone, Deserialize)]
pub struct Kubernetes {
    pub version: String,
    pub staging_version: String,
}

#[derive(Debug, Clone, Deserialize)]
pub struct Pinned {
    pub version: String,
}

#[derive(Debug, Clone, Deserialize)]
pub struct Ocm {
    pub version: String,
    pub api_version: String,
}

#[derive(Debug, Clone, Deserialize)]
pub struct Kernels {
    pub with_image: Vec<String>,
    pub without_image: String,
    pub os_image: String,
}

impl Kernels {
    /// Every simulated kernel: those with a sample image, then the one without.
    pub fn all(&self) -> Vec<String> {
        let mut all = self.with_image.clone();
        all.push(self.without_image.clone());
        all
    }
}

impl Versions {
    /// The versions compiled into this crate from `e2e/versions.toml`.
    pub fn pinned() -> Self {
        toml::from_str(VERSIONS_TOML).expect("e2e/versions.toml is valid (checked by a unit test)")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_file_parses_and_kernels_are_distinct() {
        let v: Versions = toml::from_str(VERSIONS_TOML).unwrap();
        let all = v.kernels.all();
        let mut dedup = all.clone();
        dedup.sort();
        dedup.dedup();
        assert_eq!(all.len(), dedup.len());
        assert!(v.kubernetes.staging_version.starts_with("v0."));
    }
}
