//! The guest's whole root filesystem, as an initramfs: busybox for the shell and the
//! network, Debian's kmod (`modprobe`, `depmod`, `modinfo`) with its libraries, the
//! kernel's own modules the guest needs (virtio, `dummy` as the in-tree module to
//! remove, `crc_itu_t` as one an image depends on) with a `modules.dep` made by depmod,
//! the agent, and `e2e/guest/init`.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;

use super::cpio::Archive;
use super::kernel_package::KernelPackage;
use super::shared_libraries;
use crate::process::run;
use crate::{Error, IoContext, Result};

const INIT: &str = include_str!("../../guest/init");
/// Where the agent is in the guest.
pub const AGENT: &str = "/usr/bin/kmm-node-agent";
/// The in-tree modules the guest carries: drivers for qemu's devices; `dummy`, which
/// tests load and then list for removal; and `crc_itu_t`, which a kmod image reaches
/// through upstream's in-tree dependency link (`in_tree_image`).
pub const KERNEL_MODULES: &[&str] = &[
    "virtio_pci",
    "virtio_net",
    "virtio_blk",
    "dummy",
    "crc_itu_t",
];
/// kmod's tools: these names must be kmod, never busybox's look-alike applets.
const KMOD_TOOLS: &[&str] = &["modprobe", "depmod", "modinfo", "insmod", "rmmod", "lsmod"];
const BUSYBOX: &str = "/usr/bin/busybox";
const KMOD: &str = "/usr/bin/kmod";

/// A file placed into the guest besides the fixed content.
#[derive(Debug, Clone)]
pub struct GuestFile {
    pub path: String,
    pub mode: u32,
    pub contents: Vec<u8>,
}

/// Build the initramfs for `kernel` with the agent binary `agent` and `extra` files,
/// using `work` as scratch space; returns the archive's path (`work/initramfs.cpio`).
pub fn build(
    kernel: &KernelPackage,
    agent: &Path,
    extra: &[GuestFile],
    work: &Path,
) -> Result<PathBuf> {
    let mut archive = Archive::default();
    archive.char_device("dev/console", 0o600, 5, 1);
    for dir in ["proc", "sys", "dev", "run", "tmp", "persist", "etc"] {
        archive.dir(dir);
    }
    archive.file("init", 0o755, INIT.as_bytes());

    let mut libraries = BTreeSet::new();
    add_program(&mut archive, Path::new(BUSYBOX), BUSYBOX, &mut libraries)?;
    let applets = run(Command::new(BUSYBOX).arg("--list"))?;
    for applet in applets.lines().filter(|a| !KMOD_TOOLS.contains(a)) {
        archive.symlink(&format!("bin/{applet}"), BUSYBOX);
    }
    add_program(&mut archive, Path::new(KMOD), KMOD, &mut libraries)?;
    for tool in KMOD_TOOLS {
        archive.symlink(&format!("usr/sbin/{tool}"), KMOD);
    }
    add_program(&mut archive, agent, AGENT, &mut libraries)?;
    for library in &libraries {
        let contents =
            std::fs::read(library).context(|| format!("reading {}", library.display()))?;
        archive.file(&library.to_string_lossy(), 0o755, &contents);
    }

    add_kernel_modules(&mut archive, kernel, &work.join("modules"))?;
    for file in extra {
        archive.file(&file.path, file.mode, &file.contents);
    }

    let path = work.join("initramfs.cpio");
    std::fs::write(&path, archive.finish()).context(|| format!("writing {}", path.display()))?;
    Ok(path)
}

/// `program` at `guest_path`; the shared libraries it loads join `libraries`, to be
/// placed at the same paths as on this machine (host and guest are both Debian 12).
fn add_program(
    archive: &mut Archive,
    program: &Path,
    guest_path: &str,
    libraries: &mut BTreeSet<PathBuf>,
) -> Result<()> {
    let contents = std::fs::read(program).context(|| format!("reading {}", program.display()))?;
    archive.file(guest_path, 0o755, &contents);
    libraries.extend(shared_libraries::of(program)?);
    Ok(())
}

/// [`KERNEL_MODULES`] with their dependencies, and their own `modules.dep` from depmod
/// (the package's index names thousands of modules the guest does not carry).
fn add_kernel_modules(archive: &mut Archive, kernel: &KernelPackage, staging: &Path) -> Result<()> {
    if staging.exists() {
        std::fs::remove_dir_all(staging).context(|| format!("removing {}", staging.display()))?;
    }
    let relative_dir = format!("lib/modules/{}", kernel.release);
    let target = staging.join(&relative_dir);
    let modules = kernel.with_dependencies(KERNEL_MODULES)?;
    for module in &modules {
        let to = target.join(module);
        if let Some(parent) = to.parent() {
            std::fs::create_dir_all(parent).context(|| format!("creating {}", parent.display()))?;
        }
        std::fs::copy(kernel.modules_dir().join(module), &to)
            .context(|| format!("copying {module}"))?;
    }
    for index in [
        "modules.order",
        "modules.builtin",
        "modules.builtin.modinfo",
    ] {
        std::fs::copy(kernel.modules_dir().join(index), target.join(index))
            .context(|| format!("copying {index}"))?;
    }
    run(Command::new("depmod")
        .arg("-b")
        .arg(staging)
        .arg(&kernel.release))?;
    add_tree(archive, staging, staging)
}

fn add_tree(archive: &mut Archive, root: &Path, dir: &Path) -> Result<()> {
    let mut entries: Vec<_> = std::fs::read_dir(dir)
        .context(|| format!("reading {}", dir.display()))?
        .collect::<std::io::Result<_>>()
        .context(|| format!("reading {}", dir.display()))?;
    entries.sort_by_key(std::fs::DirEntry::file_name);
    for entry in entries {
        let path = entry.path();
        let guest = path
            .strip_prefix(root)
            .map_err(|_| {
                Error::Invalid(format!("{} is outside {}", path.display(), root.display()))
            })?
            .to_string_lossy()
            .into_owned();
        if path.is_dir() {
            archive.dir(&guest);
            add_tree(archive, root, &path)?;
        } else {
            let contents =
                std::fs::read(&path).context(|| format!("reading {}", path.display()))?;
            archive.file(&guest, 0o644, &contents);
        }
    }
    Ok(())
}
