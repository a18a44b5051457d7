//! The kernel boundary: one trait, two backends. `host` drives the real kernel;
//! `simulated` keeps a per-node state directory for simulated nodes but still runs the
//! real `modprobe --dry-run` resolution and `modinfo` vermagic checks, so a broken
//! image fails exactly as it would on a node.

use std::collections::BTreeSet;
use std::fmt::Debug;
use std::path::{Path, PathBuf};

use crate::modprobe::{ModprobeCommand, ToolError};
use crate::shared_modules::Users;

pub mod host;
pub mod simulated;

pub use host::HostKernel;
pub use simulated::SimulatedKernel;

#[derive(Debug, thiserror::Error)]
pub enum KernelError {
    #[error(transparent)]
    Tool(#[from] ToolError),
    #[error("{action} {path}: {source}")]
    Io {
        action: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{0}")]
    Refused(String),
}

pub(crate) fn io_err(
    action: &'static str,
    path: &Path,
) -> impl FnOnce(std::io::Error) -> KernelError {
    let path = path.to_path_buf();
    move |source| KernelError::Io {
        action,
        path,
        source,
    }
}

/// What the agent needs from a kernel.
pub trait Kernel: Debug + Send + Sync {
    /// `host` or `simulated`.
    fn backend(&self) -> &'static str;
    /// Changes at every boot.
    fn boot_id(&self) -> Result<String, KernelError>;
    /// `uname -r`.
    fn release(&self) -> Result<String, KernelError>;
    /// Names of the loaded modules (with `_`, as the kernel reports them).
    fn loaded_modules(&self) -> Result<BTreeSet<String>, KernelError>;
    /// Runs modprobe (load or unload) with these arguments.
    fn modprobe(&self, command: &ModprobeCommand) -> Result<(), KernelError>;
    /// Removes an in-tree module (`modprobe -r <name>` against the node's own modules).
    fn remove_in_tree(&self, module: &str) -> Result<(), KernelError>;
    /// Every loaded module that an unload may remove, and the modules using each.
    fn module_users(&self) -> Result<Users, KernelError>;
    /// Removes one loaded module and none of its dependencies (`rmmod <name>`).
    fn remove_module(&self, module: &str) -> Result<(), KernelError>;
    /// The directory the kernel loads firmware from (besides its built-in defaults);
    /// written to `/sys/module/firmware_class/parameters/path`.
    fn set_firmware_class_path(&self, dir: &Path) -> Result<(), KernelError>;
}

/// Parses `/proc/modules`: the first word of each line.
pub fn parse_proc_modules(text: &str) -> BTreeSet<String> {
    text.lines()
        .filter_map(|l| l.split_whitespace().next())
        .map(str::to_string)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proc_modules() {
        let text = "kmm_hello 16384 1 kmm_hello_dep, Live 0x0000000000000000 (O)\n\
                    kmm_hello_dep 16384 0 - Live 0x0000000000000000 (O)\n";
        let parsed = parse_proc_modules(text);
        assert_eq!(parsed.len(), 2);
        assert!(parsed.contains("kmm_hello_dep"));
    }
}
