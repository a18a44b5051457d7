//! kmm-fleet's own debug binaries, for the tests and the fleet that run them as
//! processes. Not `CARGO_BIN_EXE_*`: cargo sets those only in the binary's own package,
//! and the tests that run kmm-hub or kmm-spoke-proxy live here so that no product crate
//! dev-depends on the test lab. `cargo build --bins` builds them (`cargo xtask test` does;
//! `cargo xtask env up` builds only the KWOK runner); `cargo test -p kmm-e2e` does not.

use std::path::{Path, PathBuf};

use crate::{Error, Result};

/// `$KMM_BIN_DIR` when set, else cargo's debug directory: `$CARGO_TARGET_DIR/debug`, or
/// the workspace's `target/debug`.
pub fn dir() -> PathBuf {
    std::env::var_os("KMM_BIN_DIR").map_or_else(
        || {
            std::env::var_os("CARGO_TARGET_DIR")
                .map_or_else(
                    || Path::new(env!("CARGO_MANIFEST_DIR")).join("../target"),
                    PathBuf::from,
                )
                .join("debug")
        },
        PathBuf::from,
    )
}

/// The binary `name` of cargo package `package` in [`dir`]; fails naming the command
/// that builds it.
pub fn debug(package: &str, name: &str) -> Result<PathBuf> {
    let path = dir().join(name);
    if path.is_file() {
        Ok(path)
    } else {
        Err(Error::Invalid(format!(
            "{} is missing; `cargo build --bins -p {package}` builds it \
             (`cargo xtask test` does)",
            path.display()
        )))
    }
}
