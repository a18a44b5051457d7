//! The local fleet's base for kmod builds, `kmm-fleet/kmod-builder-base:<kernel>`: gcc,
//! make, libc6-dev, kmod and Debian's `linux-headers-<kernel>` (with its common headers
//! and kbuild), a shell and the usual tools, and the sample module's sources
//! (`e2e/kmod/`) at [`SAMPLE_SOURCES`]. A Dockerfile `FROM` it compiles the sample with
//! no network:
//!
//! ```dockerfile
//! FROM <registry>/kmm-fleet/kmod-builder-base:6.1.0-47-amd64
//! ARG KERNEL_FULL_VERSION
//! RUN make -C /usr/src/linux-headers-${KERNEL_FULL_VERSION} M=/usr/src/kmm-hello modules
//! ```
//!
//! Assembled with the steps of kmm-fleet's image bases ([`kmm_images::base`]: packages
//! unpacked with `dpkg-deb -x`, documentation pruned, reproducible), but the packages are
//! resolved with everything they depend on, as apt would install them on an empty
//! system: a compiler toolchain loads too much to list by hand. Root is its user, as
//! `RUN` steps that install into `/opt` need. Rebuilt only when apt's versions of its
//! packages or the sources change.

use std::path::Path;
use std::process::Command;

use sha2::{Digest, Sha256};

use kmm_images::base::{self, Package};
use kmm_images::{Image, KEY_LABEL, NAMESPACE, buildah, images_cache_dir, inspect, push, sizes};

use crate::{Error, IoContext, Result};

/// The repository under `kmm-fleet/`; the tag is the kernel.
pub const NAME: &str = "kmod-builder-base";
/// Where the sample module's sources are in the image.
pub const SAMPLE_SOURCES: &str = "/usr/src/kmm-hello";
/// Bump when the assembly below changes, so existing images are rebuilt.
const LAYOUT: &str = "kmm-fleet kmod builder base layout 1";

/// What a kmod build runs, besides the kernel's headers (`linux-headers-<kernel>`):
/// the compiler and make; kmod's depmod; dash as `/bin/sh` for `RUN` steps and make;
/// the tools kbuild's rules and Dockerfiles call (cp, mkdir, sed, grep, awk, find, cmp).
const PACKAGES: &[&str] = &[
    "base-files",
    "dash",
    "coreutils",
    "sed",
    "grep",
    "gawk",
    "findutils",
    "diffutils",
    "make",
    "gcc",
    "libc6-dev",
    "kmod",
];

/// Links that maintainer scripts (not run here) would make: `/bin/sh` and `awk`.
const LINKS: &[(&str, &str)] = &[("bin/sh", "dash"), ("usr/bin/awk", "gawk")];

const SOURCES: &[(&str, &str)] = &[
    ("Kbuild", include_str!("../kmod/Kbuild")),
    ("kmm_hello.c", include_str!("../kmod/kmm_hello.c")),
    ("kmm_hello_dep.c", include_str!("../kmod/kmm_hello_dep.c")),
];

/// `kmm-fleet/kmod-builder-base:<kernel>`, the path under a registry.
pub fn repository(kernel: &str) -> String {
    format!("{NAMESPACE}/{NAME}:{kernel}")
}

/// Make the base for `kernel` current in local storage and, given a registry, push it
/// there as `<registry>/`[`repository`]. Fails naming the kernel when apt has no
/// headers for it.
pub fn ensure(kernel: &str, registry: Option<&str>) -> Result<Image> {
    buildah::check()?;
    let headers = format!("linux-headers-{kernel}");
    let mut wanted: Vec<&str> = PACKAGES.to_vec();
    wanted.push(&headers);
    let packages = resolve(&wanted)?;
    let mut hash = Sha256::new();
    hash.update(LAYOUT);
    for package in &packages {
        hash.update(format!("\n{}={}", package.name, package.version));
    }
    for (name, text) in SOURCES {
        hash.update(format!("\n{name}\n{text}"));
    }
    let key = format!("{:x}", hash.finalize());
    let reference = format!("localhost/{}", repository(kernel));
    let cache = images_cache_dir();
    let existing = inspect(&reference)?.filter(|i| i.labels.get(KEY_LABEL) == Some(&key));
    let rebuilt = existing.is_none();
    let inspected = match existing {
        Some(inspected) => inspected,
        None => {
            assemble(kernel, &packages, &key, &reference, &cache)?;
            inspect(&reference)?
                .ok_or_else(|| Error::Invalid(format!("{reference} is missing after its commit")))?
        }
    };
    let pushed = match registry {
        Some(registry) => {
            let remote = format!("{registry}/{}", repository(kernel));
            push(&reference, &remote, registry)?;
            Some(remote)
        }
        None => None,
    };
    let (size, compressed_size) = sizes(&inspected.id, &cache)?;
    Ok(Image {
        name: NAME.to_owned(),
        reference,
        pushed,
        id: inspected.id,
        size,
        compressed_size,
        rebuilt,
    })
}

/// `names` and everything they depend on, at the versions apt would install on an
/// empty system (its resolver, simulated against an empty package status).
fn resolve(names: &[&str]) -> Result<Vec<Package>> {
    let out = Command::new("apt-get")
        .args([
            "--simulate",
            "--no-install-recommends",
            "-o",
            "Dir::State::status=/dev/null",
            "install",
        ])
        .args(names)
        .output()
        .context(|| "running apt-get --simulate install".into())?;
    let packages = parse_simulation(&String::from_utf8_lossy(&out.stdout));
    if !out.status.success() || packages.is_empty() {
        return Err(Error::Invalid(format!(
            "apt cannot resolve {} (`apt-get update` first? `linux-headers-<kernel>` must \
             exist for the kernel): {}",
            names.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    Ok(packages)
}

/// The `Inst <name> (<version> <release> [<arch>])` lines of a simulated install.
fn parse_simulation(text: &str) -> Vec<Package> {
    text.lines()
        .filter_map(|line| {
            let rest = line.strip_prefix("Inst ")?;
            let (name, rest) = rest.split_once(' ')?;
            let version = rest.strip_prefix('(')?.split_whitespace().next()?;
            Some(Package {
                name: name.split(':').next().unwrap_or(name).to_owned(),
                version: version.to_owned(),
            })
        })
        .collect()
}

/// Unpack the packages and the sources into a root and commit it as `reference`.
fn assemble(
    kernel: &str,
    packages: &[Package],
    key: &str,
    reference: &str,
    cache: &Path,
) -> Result<()> {
    let debs = packages
        .iter()
        .map(|p| base::download(p, &cache.join("debs")))
        .collect::<kmm_images::Result<Vec<_>>>()?;
    let work = cache.join("rootfs").join(format!("{NAME}-{kernel}"));
    if work.exists() {
        std::fs::remove_dir_all(&work).context(|| format!("removing {}", work.display()))?;
    }
    let rootfs = work.join("rootfs");
    std::fs::create_dir_all(&rootfs).context(|| format!("creating {}", rootfs.display()))?;
    for (package, deb) in packages.iter().zip(&debs) {
        base::unpack(package, deb, &rootfs)?;
    }
    base::prune(&rootfs)?;
    base::accounts(&rootfs)?;
    for (link, target) in LINKS {
        let path = rootfs.join(link);
        if !path.exists() {
            std::os::unix::fs::symlink(target, &path)
                .context(|| format!("linking {}", path.display()))?;
        }
    }
    let sources = rootfs.join(SAMPLE_SOURCES.trim_start_matches('/'));
    std::fs::create_dir_all(&sources).context(|| format!("creating {}", sources.display()))?;
    for (name, text) in SOURCES {
        let path = sources.join(name);
        std::fs::write(&path, text).context(|| format!("writing {}", path.display()))?;
    }
    let listed = packages
        .iter()
        .map(|p| format!("{}={}", p.name, p.version))
        .collect::<Vec<_>>()
        .join(" ");
    let container = buildah::run(["from", "--pull=never", "--quiet", "scratch"])?;
    let committed = commit(&container, &rootfs, kernel, key, &listed, reference);
    if committed.is_err() {
        let _ = buildah::run(["rm", &container]);
    }
    committed?;
    std::fs::remove_dir_all(&work).context(|| format!("removing {}", work.display()))
}

fn commit(
    container: &str,
    rootfs: &Path,
    kernel: &str,
    key: &str,
    packages: &str,
    reference: &str,
) -> kmm_images::Result<()> {
    buildah::run([
        "copy".as_ref(),
        "--quiet".as_ref(),
        container.as_ref(),
        rootfs.as_os_str(),
        "/".as_ref(),
    ])?;
    let mut config = buildah::command();
    config.args([
        "config",
        "--user",
        "0:0",
        "--workingdir",
        "/",
        "--env",
        base::PATH,
    ]);
    buildah::label_and_commit(
        config,
        container,
        buildah::BaseLabels {
            title: format!("{NAMESPACE}/{NAME}"),
            description: format!(
                "Debian 12 gcc, make, kmod and linux-headers-{kernel}, with the kmm-hello \
                 sample's sources in {SAMPLE_SOURCES}"
            ),
            version: kernel,
            packages,
            key,
        },
        reference,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_simulated_install_lists_every_package_with_its_version() {
        let text = "NOTE: This is only a simulation!\n\
                    Inst gcc-12-base (12.2.0-14+deb12u1 Debian:12.13/stable [amd64])\n\
                    Inst libc6:amd64 (2.36-9+deb12u14 Debian:12.13/stable [amd64])\n\
                    Conf gcc-12-base (12.2.0-14+deb12u1 Debian:12.13/stable [amd64])\n";
        assert_eq!(
            parse_simulation(text),
            [
                Package {
                    name: "gcc-12-base".into(),
                    version: "12.2.0-14+deb12u1".into()
                },
                Package {
                    name: "libc6".into(),
                    version: "2.36-9+deb12u14".into()
                },
            ]
        );
    }
}
