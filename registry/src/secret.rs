//! A pull secret's content, in memory only.

use std::fmt;

use serde::Deserialize;

/// The content of a pull Secret's key. Its `Debug` never shows the content.
#[derive(Clone, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum PullSecret {
    /// `kubernetes.io/dockerconfigjson`: the `.dockerconfigjson` value.
    DockerConfigJson(String),
    /// `kubernetes.io/dockercfg`: the legacy `.dockercfg` value.
    DockerCfg(String),
}

impl fmt::Debug for PullSecret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::DockerConfigJson(_) => f.write_str("DockerConfigJson(<redacted>)"),
            Self::DockerCfg(_) => f.write_str("DockerCfg(<redacted>)"),
        }
    }
}
