//! The workspace's `kmm-node-agent` for the guest: the release binary the node agent's
//! image carries, from the same build (`kmm_images::release_binaries`), so that a fleet
//! whose images are built already costs no build here. Cargo locks each profile's
//! directory on its own: the release build runs while `cargo test` holds the dev one.

use std::path::PathBuf;

use crate::Result;

/// Build (incrementally) the release binaries; the agent's path.
pub fn build() -> Result<PathBuf> {
    let release = kmm_images::release_binaries(&kmm_images::default_target_dir())?;
    Ok(release.join("kmm-node-agent"))
}
