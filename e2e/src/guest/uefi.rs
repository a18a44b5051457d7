//! UEFI for the guest, so that Debian's stock cloud kernel trusts a test key: the kernel
//! fills its `.platform` keyring from the UEFI `db` variable whenever it boots under
//! UEFI (Secure Boot or not), and Debian's kernel checks module signatures against that
//! keyring too. OVMF (Debian's `ovmf`) is the firmware; its variable store gets the
//! test certificate in `db` from `virt-fw-vars` (PyPI's `virt-firmware`), which
//! `cargo xtask env setup` installs into a venv under the cache directory.

use std::path::{Path, PathBuf};
use std::process::Command;

use sha2::{Digest, Sha256};

use crate::process::run;
use crate::{Error, IoContext, Result, cache_dir};

/// OVMF's code, mapped read-only (no Secure Boot, so no SMM needed).
pub const OVMF_CODE: &str = "/usr/share/OVMF/OVMF_CODE_4M.fd";
/// OVMF's empty variable store: the template each guest's store is made from.
pub const OVMF_VARS: &str = "/usr/share/OVMF/OVMF_VARS_4M.fd";
/// The owner recorded with the enrolled certificate (any GUID will do; this one is
/// kmm-fleet's test owner).
const DB_OWNER: &str = "3109c6de-ae11-47f5-9822-528cb81c0055";
/// Debian's Python (`python3-venv`), not whichever `python3` comes first on PATH.
const PYTHON: &str = "/usr/bin/python3";
/// The venv's packages: virt-firmware and everything it pulls in, pinned, so that a
/// fresh machine gets what the test was measured with.
const VIRT_FIRMWARE: &[&str] = &[
    "virt-firmware==26.10",
    "cryptography==50.0.2",
    "cffi==2.1.1",
    "pycparser==3.12",
    "pefile==2024.8.26",
    "PyYAML==6.0.3",
    "requests==2.34.2",
    "certifi==2026.10.18",
    "charset-normalizer==3.5.2",
    "idna==3.20",
    "urllib3==2.8.0",
];
/// Written into the venv once pip finished: a venv without it is a broken install.
const INSTALLED: &str = "kmm-installed";

/// The venv for the pins above: `<cache>/virt-firmware/<hash of the pins>`, so a
/// change of pins makes a new one.
fn venv() -> PathBuf {
    let digest = Sha256::digest(VIRT_FIRMWARE.join("\n").as_bytes());
    cache_dir()
        .join("virt-firmware")
        .join(&format!("{digest:x}")[..16])
}

/// `virt-fw-vars` as installed by [`install_virt_fw_vars`]; an error naming the command
/// that installs it when it is not.
pub fn virt_fw_vars() -> Result<PathBuf> {
    let venv = venv();
    let program = venv.join("bin/virt-fw-vars");
    if venv.join(INSTALLED).is_file() && program.is_file() {
        Ok(program)
    } else {
        Err(Error::Invalid(format!(
            "virt-fw-vars ({}) is not installed in {}: run `cargo xtask env setup`",
            VIRT_FIRMWARE[0],
            venv.display()
        )))
    }
}

/// Install `virt-fw-vars` into its venv from PyPI unless it is there already; its path.
/// Needs Debian's `python3-venv`.
pub fn install_virt_fw_vars() -> Result<PathBuf> {
    if let Ok(program) = virt_fw_vars() {
        return Ok(program);
    }
    let venv = venv();
    // A venv cannot be moved (its scripts name its own path), so an interrupted install
    // is removed and made again in place rather than built aside and renamed.
    if venv.exists() {
        std::fs::remove_dir_all(&venv).context(|| format!("removing {}", venv.display()))?;
    }
    run(Command::new(PYTHON).args(["-m", "venv"]).arg(&venv)).map_err(|e| {
        Error::Invalid(format!(
            "creating the venv for virt-fw-vars (needs Debian's python3-venv): {e}"
        ))
    })?;
    // Wheels only: building cryptography or cffi from source would need a compiler
    // and headers this project does not otherwise install.
    run(Command::new(venv.join("bin/pip"))
        .args([
            "install",
            "--no-input",
            "--disable-pip-version-check",
            "--quiet",
            "--only-binary=:all:",
        ])
        .args(VIRT_FIRMWARE))?;
    let marker = venv.join(INSTALLED);
    std::fs::write(&marker, VIRT_FIRMWARE.join("\n"))
        .context(|| format!("writing {}", marker.display()))?;
    virt_fw_vars()
}

/// Write to `vars` a copy of OVMF's empty variable store with `cert` (PEM) enrolled in
/// `db`.
pub fn enrol_db(cert: &Path, vars: &Path) -> Result<()> {
    run(Command::new(virt_fw_vars()?)
        .arg("--input")
        .arg(OVMF_VARS)
        .arg("--output")
        .arg(vars)
        .args(["--add-db", DB_OWNER])
        .arg(cert))?;
    Ok(())
}

/// Whether the kernel log shows the key named `description` (see
/// [`super::module_signing::TestKey::description`]) loaded from UEFI `db`; the kernel's
/// integrity code logs the source, then each certificate it adds to `.platform`:
///
/// ```text
/// integrity: Loading X.509 certificate: UEFI:db
/// integrity: Loaded X.509 cert 'kmm-fleet real-kernel test key: 395268f0...'
/// ```
///
/// When not, the error quotes the log's EFI and X.509 lines.
pub fn check_platform_keyring(dmesg: &str, description: &str) -> Result<()> {
    let loaded = format!("integrity: Loaded X.509 cert '{description}'");
    let mut source = None;
    for line in dmesg.lines() {
        if let Some((_, from)) = line.split_once("integrity: Loading X.509 certificate: ") {
            source = Some(from.trim());
        } else if line.contains(&loaded) && source == Some("UEFI:db") {
            return Ok(());
        }
    }
    let relevant: Vec<&str> = dmesg
        .lines()
        .filter(|l| l.contains("X.509") || l.contains("integrity") || l.contains("efi"))
        .collect();
    Err(Error::Invalid(format!(
        "the guest's kernel did not load the test certificate `{description}` from UEFI db \
         into its .platform keyring; its EFI and X.509 log lines:\n{}",
        if relevant.is_empty() {
            "(none: the guest did not boot under UEFI)".to_string()
        } else {
            relevant.join("\n")
        }
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    const KEY: &str = "kmm-fleet real-kernel test key: 395268f0";

    #[test]
    fn the_key_must_come_from_db_into_the_platform_keyring() {
        let dmesg = "[    0.9] Loading compiled-in X.509 certificates\n\
                     [    0.9] Loaded X.509 cert 'Build time autogenerated kernel key: 11aa'\n\
                     [    1.2] integrity: Loading X.509 certificate: UEFI:db\n\
                     [    1.2] integrity: Loaded X.509 cert 'kmm-fleet real-kernel test key: 395268f0'\n";
        check_platform_keyring(dmesg, KEY).unwrap();

        // Another key from db, or this key from elsewhere (MOK), is not it.
        let other = dmesg.replace("395268f0", "00ff");
        let error = check_platform_keyring(&other, KEY).unwrap_err().to_string();
        assert!(
            error.contains("integrity: Loading X.509 certificate: UEFI:db"),
            "{error}"
        );
        let mok = dmesg.replace("UEFI:db", "UEFI:MokListRT");
        assert!(check_platform_keyring(&mok, KEY).is_err());

        let bios = "[    0.9] Loading compiled-in X.509 certificates\n";
        let error = check_platform_keyring(bios, KEY).unwrap_err().to_string();
        assert!(error.contains("Loading compiled-in X.509"), "{error}");
        let error = check_platform_keyring("", KEY).unwrap_err().to_string();
        assert!(error.contains("did not boot under UEFI"), "{error}");
    }
}
