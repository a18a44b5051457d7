//! The workspace's `kmm-node-agent`, built for the guest. It is built into its own
//! target directory: the `cargo test` running this code holds the lock of the shared
//! one until it ends.

use std::path::PathBuf;
use std::process::Command;

use crate::Result;
use crate::process::run;

/// Build (incrementally) the release agent; its path.
pub fn build() -> Result<PathBuf> {
    let workspace = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map(PathBuf::from)
        .unwrap_or_default();
    let target = workspace.join("target").join("real-kernel");
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    run(Command::new(cargo)
        .args(["build", "--release", "-p", "kmm-node-agent"])
        .arg("--target-dir")
        .arg(&target)
        .current_dir(&workspace))?;
    Ok(target.join("release").join("kmm-node-agent"))
}
