//! A real Debian kernel for the guest: `linux-image-<release>` from the archive,
//! extracted once into `<cache>/guest/kernel/<release>/` with its `modules.dep`.

use crate::process::run;
use std::path::{Path, PathBuf};
use std::process::Command;

use crate::{Error, IoContext, Result, cache_dir, cache_entry};

/// An extracted Debian kernel package.
#[derive(Debug, Clone)]
pub struct KernelPackage {
    pub release: String,
    /// The package's root: `boot/vmlinuz-<release>`, `lib/modules/<release>/`.
    pub root: PathBuf,
}

impl KernelPackage {
    /// The package for `release`, downloaded with `apt-get download` on first use.
    pub fn fetch(release: &str) -> Result<Self> {
        let dir = cache_dir().join("guest").join("kernel").join(release);
        let package = Self {
            release: release.to_string(),
            root: dir.join("root"),
        };
        let ready =
            || package.modules_dir().join("modules.dep").is_file() && package.vmlinuz().is_file();
        cache_entry::once(&dir, ready, || download(release, &dir))?;
        Ok(package)
    }

    pub fn vmlinuz(&self) -> PathBuf {
        self.root
            .join("boot")
            .join(format!("vmlinuz-{}", self.release))
    }

    pub fn modules_dir(&self) -> PathBuf {
        self.root.join("lib/modules").join(&self.release)
    }

    /// `modules` and everything they depend on, as paths relative to
    /// [`Self::modules_dir`], dependencies first (modprobe's own resolution).
    pub fn with_dependencies(&self, modules: &[&str]) -> Result<Vec<String>> {
        let mut all: Vec<String> = vec![];
        for module in modules {
            let out = run(Command::new("modprobe").arg("-d").arg(&self.root).args([
                "-S",
                &self.release,
                "--show-depends",
                module,
            ]))?;
            for path in insmod_paths(&out) {
                let relative = Path::new(path)
                    .strip_prefix(self.modules_dir())
                    .map_err(|_| {
                        Error::Invalid(format!("{module} resolves outside the package: {path}"))
                    })?
                    .to_string_lossy()
                    .into_owned();
                if !all.contains(&relative) {
                    all.push(relative);
                }
            }
        }
        Ok(all)
    }
}

/// Downloads and extracts `linux-image-<release>` into `dir`, indexed by depmod.
fn download(release: &str, dir: &Path) -> Result<()> {
    let partial = cache_entry::beside(dir, "partial");
    if partial.exists() {
        std::fs::remove_dir_all(&partial).context(|| format!("removing {}", partial.display()))?;
    }
    std::fs::create_dir_all(&partial).context(|| format!("creating {}", partial.display()))?;
    let name = format!("linux-image-{release}");
    run(Command::new("apt-get")
        .args(["download", &name])
        .current_dir(&partial))
    .map_err(|e| {
        Error::Invalid(format!(
            "downloading the guest kernel package {name} (is it in the apt sources? \
             `apt-get update` may be needed): {e}"
        ))
    })?;
    let deb = kmm_images::base::only_deb(&partial)?;
    run(Command::new("dpkg-deb")
        .arg("-x")
        .arg(&deb)
        .arg(partial.join("root")))?;
    std::fs::remove_file(&deb).context(|| format!("removing {}", deb.display()))?;
    // The package ships no modules.dep: its postinst runs depmod on the target.
    run(Command::new("depmod")
        .arg("-b")
        .arg(partial.join("root"))
        .arg(release))?;
    if dir.exists() {
        std::fs::remove_dir_all(dir).context(|| format!("removing {}", dir.display()))?;
    }
    std::fs::rename(&partial, dir).context(|| format!("renaming to {}", dir.display()))
}

/// The module files of `modprobe --show-depends` output (built-ins have no file).
fn insmod_paths(show_depends: &str) -> Vec<&str> {
    show_depends
        .lines()
        .filter_map(|line| line.strip_prefix("insmod "))
        .filter_map(|rest| rest.split_whitespace().next())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn show_depends_yields_module_files_in_load_order() {
        let out = "builtin virtio\n\
                   insmod /r/lib/modules/6.1/kernel/drivers/virtio/virtio_ring.ko \n\
                   insmod /r/lib/modules/6.1/kernel/drivers/net/virtio_net.ko napi_tx=1\n";
        assert_eq!(
            insmod_paths(out),
            [
                "/r/lib/modules/6.1/kernel/drivers/virtio/virtio_ring.ko",
                "/r/lib/modules/6.1/kernel/drivers/net/virtio_net.ko"
            ]
        );
        assert!(insmod_paths("builtin ext4\n").is_empty());
    }
}
