//! Access to OCI registries, shared by the hub (which checks, resolves and pushes images)
//! and the node agent (which pulls them), so that both honour `registryTLS` and the
//! module's pull secret the same way and read the registry's answers the same way, and
//! trust the same extra CAs (`RegistryCas`) when given them.
//! Credentials are held in memory only; nothing here logs or stores them.

pub mod client;
pub mod credentials;
mod error;
mod manifest;
mod secret;
mod tls;
mod trust;

pub use client::{auth, client, client_trusting, parse_reference, resolve_digest};
pub use error::{RegistryError, error_chain};
pub use manifest::{ManifestError, ManifestReader};
pub use secret::PullSecret;
pub use tls::RegistryTls;
pub use trust::{CaBundleError, RegistryCas};
