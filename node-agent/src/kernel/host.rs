//! The real kernel: `/proc/modules`, `/proc/sys/kernel/random/boot_id`, modprobe.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use super::{Kernel, KernelError, io_err, parse_proc_modules};
use crate::modprobe::{ModprobeCommand, run_tool};
use crate::shared_modules::{Users, parse_users};

/// The node's own kernel. `proc` and `sys` are normally `/proc` and `/sys` (the agent
/// runs with the host's mounted there).
#[derive(Debug, Clone)]
pub struct HostKernel {
    proc: PathBuf,
    sys: PathBuf,
}

impl Default for HostKernel {
    fn default() -> Self {
        Self {
            proc: "/proc".into(),
            sys: "/sys".into(),
        }
    }
}

impl HostKernel {
    fn read(&self, path: &Path) -> Result<String, KernelError> {
        std::fs::read_to_string(path)
            .map(|s| s.trim().to_string())
            .map_err(io_err("reading", path))
    }
}

impl Kernel for HostKernel {
    fn backend(&self) -> &'static str {
        "host"
    }

    fn boot_id(&self) -> Result<String, KernelError> {
        self.read(&self.proc.join("sys/kernel/random/boot_id"))
    }

    fn release(&self) -> Result<String, KernelError> {
        self.read(&self.proc.join("sys/kernel/osrelease"))
    }

    fn loaded_modules(&self) -> Result<BTreeSet<String>, KernelError> {
        Ok(parse_proc_modules(&self.read(&self.proc.join("modules"))?))
    }

    fn modprobe(&self, command: &ModprobeCommand) -> Result<(), KernelError> {
        run_tool("modprobe", &command.args)?;
        Ok(())
    }

    fn remove_in_tree(&self, module: &str) -> Result<(), KernelError> {
        run_tool("modprobe", &["-r".into(), module.into()])?;
        Ok(())
    }

    fn module_users(&self) -> Result<Users, KernelError> {
        Ok(parse_users(&self.read(&self.proc.join("modules"))?))
    }

    fn remove_module(&self, module: &str) -> Result<(), KernelError> {
        run_tool("rmmod", &[module.into()])?;
        Ok(())
    }

    fn set_firmware_class_path(&self, dir: &Path) -> Result<(), KernelError> {
        let path = self.sys.join("module/firmware_class/parameters/path");
        std::fs::write(&path, dir.as_os_str().as_encoded_bytes()).map_err(io_err("writing", &path))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Read-only facts of the machine the tests run on.
    #[test]
    fn reads_the_real_kernel() {
        let kernel = HostKernel::default();
        let boot = kernel.boot_id().unwrap();
        assert_eq!(boot.len(), 36, "{boot}");
        assert!(!kernel.release().unwrap().is_empty());
        // /proc/modules exists on every modular kernel; it may be empty.
        if Path::new("/proc/modules").exists() {
            kernel.loaded_modules().unwrap();
        }
    }
}
