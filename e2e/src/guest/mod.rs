//! A real Linux kernel for the host path of the node agent (issue 6): Debian's cloud
//! kernel under qemu-system-x86_64, an initramfs built here with busybox, Debian's kmod
//! and the workspace's `kmm-node-agent`, a disk that survives reboots, and a command
//! channel through which tests ask the guest's kernel what it did.
//!
//! * [`Rig::prepare`] checks the host packages, fetches the kernel, builds the agent
//!   and the initramfs, and formats the disk.
//! * [`Rig::boot`] starts one boot under SeaBIOS; [`Rig::boot_uefi`] one under UEFI
//!   whose `db` holds a test certificate ([`uefi`]), which the kernel then trusts for
//!   module signatures ([`module_signing`]); [`machine::Machine::run`] runs commands in
//!   a boot.
//! * [`agent_peer::AgentPeer`] is the proxy endpoint the agent in the guest attaches to.

pub mod agent_binary;
pub mod agent_peer;
pub mod channel;
mod cpio;
pub mod firmware_image;
pub mod host_packages;
pub mod in_tree_image;
pub mod initramfs;
pub mod kernel_package;
pub mod machine;
pub mod module_signing;
mod shared_libraries;
pub mod uefi;

use std::path::PathBuf;
use std::sync::Mutex;

use initramfs::GuestFile;
use kernel_package::KernelPackage;
use machine::{Accelerator, BootSpec, Firmware, Machine};
use module_signing::TestKey;

use crate::{IoContext, Result};

/// The guest's kernel: one of the fleet's sample kernels (`e2e/versions.toml`), so the
/// sample modules exist for it.
pub const KERNEL: &str = "6.1.0-56-cloud-amd64";
/// The registry, as the guest reaches the host's loopback through qemu's user network.
pub const HOST_FROM_GUEST: &str = "10.0.2.2";
const MEMORY_MIB: u32 = 512;
const DISK_MIB: u64 = 256;

/// Everything needed to boot the guest, under one work directory.
#[derive(Debug)]
pub struct Rig {
    pub kernel: KernelPackage,
    pub initramfs: PathBuf,
    pub disk: PathBuf,
    pub work: PathBuf,
    /// KVM until a boot shows it does not work here; then software emulation.
    accelerator: Mutex<Accelerator>,
}

impl Rig {
    /// Prepare a guest whose initramfs also holds `extra` files, in `work` (created).
    pub fn prepare(work: PathBuf, extra: &[GuestFile]) -> Result<Self> {
        // Both fail naming `cargo xtask env setup`, before the slow steps below.
        host_packages::check()?;
        uefi::virt_fw_vars()?;
        std::fs::create_dir_all(&work).context(|| format!("creating {}", work.display()))?;
        let kernel = KernelPackage::fetch(KERNEL)?;
        let agent = agent_binary::build()?;
        let initramfs = initramfs::build(&kernel, &agent, extra, &work)?;
        let disk = work.join("disk.img");
        machine::create_disk(&disk, DISK_MIB)?;
        Ok(Self {
            kernel,
            initramfs,
            disk,
            work,
            accelerator: Mutex::new(Accelerator::detect()),
        })
    }

    /// Boot the guest under SeaBIOS; `name` names this boot's logs, `kernel_args` are
    /// added to the kernel command line. A KVM boot that fails is retried once under
    /// software emulation, which later boots then use directly.
    pub async fn boot(&self, name: &str, kernel_args: &[&str]) -> Result<Machine> {
        self.boot_on(Firmware::Bios, name, kernel_args).await
    }

    /// Boot the guest as [`Self::boot`] does, but under UEFI with `trusted`'s certificate
    /// enrolled in `db` (a fresh variable store, `<name>.vars.fd`). Fails, quoting the
    /// kernel log, unless the kernel loaded the certificate into its `.platform` keyring.
    pub async fn boot_uefi(
        &self,
        name: &str,
        kernel_args: &[&str],
        trusted: &TestKey,
    ) -> Result<Machine> {
        let vars = self.work.join(format!("{name}.vars.fd"));
        uefi::enrol_db(&trusted.cert, &vars)?;
        let firmware = Firmware::Uefi {
            code: uefi::OVMF_CODE.into(),
            vars,
        };
        let mut machine = self.boot_on(firmware, name, kernel_args).await?;
        let dmesg = machine.check("dmesg").await?;
        if let Err(e) = uefi::check_platform_keyring(&dmesg, &trusted.description) {
            machine.poweroff().await.ok();
            return Err(e);
        }
        Ok(machine)
    }

    async fn boot_on(
        &self,
        firmware: Firmware,
        name: &str,
        kernel_args: &[&str],
    ) -> Result<Machine> {
        let spec = BootSpec {
            vmlinuz: self.kernel.vmlinuz(),
            initramfs: self.initramfs.clone(),
            disk: self.disk.clone(),
            kernel_args: kernel_args.iter().map(|a| a.to_string()).collect(),
            memory_mib: MEMORY_MIB,
            dir: self.work.clone(),
            name: name.to_string(),
            firmware,
        };
        let accelerator = *self.accelerator.lock().unwrap_or_else(|e| e.into_inner());
        match Machine::boot(&spec, accelerator).await {
            Err(e) if accelerator == Accelerator::Kvm => {
                eprintln!("guest: KVM does not boot here ({e}); using software emulation");
                *self.accelerator.lock().unwrap_or_else(|e| e.into_inner()) = Accelerator::Tcg;
                let spec = BootSpec {
                    name: format!("{name}-tcg"),
                    ..spec
                };
                Machine::boot(&spec, Accelerator::Tcg).await
            }
            booted => booted,
        }
    }
}
