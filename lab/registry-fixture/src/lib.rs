//! OCI registries for tests, all of them Debian's `docker-registry`.
//!
//! * `server`: a registry of a test's own ([`RegistryServer`]) and the pull secret
//!   that lets one in ([`docker_config_json`]).
//! * `program`: the `docker-registry` program ([`registry_binary`]) and the
//!   configuration of the local fleet's shared registry ([`registry_config`]).

mod ca;
mod program;
mod server;

use std::path::PathBuf;

pub use ca::internal_ca;
pub use program::{registry_binary, registry_config};
pub use server::{RegistryServer, docker_config_json, tls_with_auth_config};

/// Why a registry could not be set up, started or used.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{component} failed to start: {reason}; log: {}", log.display())]
    Component {
        component: String,
        reason: String,
        log: PathBuf,
    },
    #[error("timed out after {seconds}s waiting for {what}")]
    Timeout { what: String, seconds: u64 },
    #[error("certificates: {0}")]
    Pki(#[from] rcgen::Error),
    #[error("OCI registry: {0}")]
    Oci(#[from] oci_client::errors::OciDistributionError),
    #[error("{0}")]
    Invalid(String),
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Attach a description to an I/O error.
trait IoContext<T> {
    fn context(self, context: impl FnOnce() -> String) -> Result<T>;
}

impl<T> IoContext<T> for std::io::Result<T> {
    fn context(self, context: impl FnOnce() -> String) -> Result<T> {
        self.map_err(|source| Error::Io {
            context: context(),
            source,
        })
    }
}
