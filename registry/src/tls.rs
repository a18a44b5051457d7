//! How to reach a registry.

use serde::{Deserialize, Serialize};

/// Upstream's `registryTLS`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct RegistryTls {
    /// Plain HTTP.
    #[serde(default)]
    pub insecure: bool,
    /// HTTPS without verifying the registry's certificate.
    #[serde(default, rename = "insecureSkipTLSVerify")]
    pub insecure_skip_tls_verify: bool,
}
