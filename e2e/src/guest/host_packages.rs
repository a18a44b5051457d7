//! The Debian packages the real-kernel test needs on the host. The test checks them
//! and fails naming what is missing rather than installing behind the user's back;
//! `cargo xtask env setup` installs them with the fleet's own packages.

use std::process::Command;

use crate::{Error, Result};

/// Package and the reason the test needs it.
pub const REQUIRED: &[(&str, &str)] = &[
    ("qemu-system-x86", "qemu-system-x86_64 boots the guest"),
    ("busybox-static", "the guest's shell, mount, ip and base64"),
    ("kmod", "the guest's modprobe, depmod and modinfo"),
    (
        "e2fsprogs",
        "mkfs.ext4 formats the disk that survives reboots",
    ),
    ("libc-bin", "ldd finds the shared libraries the guest needs"),
    ("ovmf", "the UEFI firmware whose db holds the test key"),
    (
        "python3-venv",
        "the venv virt-fw-vars (PyPI virt-firmware) runs from, which enrols the test key",
    ),
    ("openssl", "makes the test keys"),
];

/// Fail naming every missing package (as `dpkg-query` sees them).
pub fn check() -> Result<()> {
    let missing: Vec<&str> = REQUIRED
        .iter()
        .filter(|(package, _)| !installed(package))
        .map(|(package, _)| *package)
        .collect();
    if missing.is_empty() {
        return Ok(());
    }
    let why: Vec<String> = REQUIRED
        .iter()
        .filter(|(package, _)| missing.contains(package))
        .map(|(package, reason)| format!("{package} ({reason})"))
        .collect();
    Err(Error::Invalid(format!(
        "the real-kernel test needs Debian packages that are not installed: {}; \
         `cargo xtask env setup` installs them, or \
         `apt-get install --no-install-recommends {}`",
        why.join(", "),
        missing.join(" ")
    )))
}

fn installed(package: &str) -> bool {
    Command::new("dpkg-query")
        .args(["-W", "-f", "${db:Status-Status}", package])
        .output()
        .is_ok_and(|out| out.status.success() && out.stdout == b"installed")
}
