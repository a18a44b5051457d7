//! The images' bases, assembled from Debian 12 packages because no base image can be
//! pulled here: the packages' files unpacked with `dpkg-deb -x` (no maintainer scripts,
//! no shell, no package manager), documentation pruned to the copyright files, a
//! non-root user, and the package records vulnerability scanners read
//! (`/var/lib/dpkg/status.d/<package>`, as distroless images carry them).
//!
//! A base is rebuilt only when its packages' versions change: the versions apt would
//! install now are hashed into a label, and an image carrying the same hash is kept.
//! Its layer is reproducible (`--timestamp 0`), so a rebuild from the same packages
//! gives the same digest.

use std::path::{Path, PathBuf};
use std::process::Command;

use sha2::{Digest, Sha256};

use crate::buildah::{self, Inspected};
use crate::{Error, IoContext, KEY_LABEL, Result, output};

/// Every base's tag: the Debian release its packages come from.
pub const TAG: &str = "bookworm";

/// Bump when the assembly below changes, so existing bases are rebuilt.
const LAYOUT: &str = "kmm-fleet base layout 1";

/// The user the images run as: distroless's `nonroot`.
pub const NONROOT: &str = "65532:65532";
const PASSWD: &str = "root:x:0:0:root:/root:/sbin/nologin\n\
                      nobody:x:65534:65534:nobody:/nonexistent:/sbin/nologin\n\
                      nonroot:x:65532:65532:nonroot:/home/nonroot:/sbin/nologin\n";
const GROUP: &str = "root:x:0:\nnobody:x:65534:\nnonroot:x:65532:\n";
/// glibc's resolver reads it; without it, `hosts` would try DNS before /etc/hosts.
const NSSWITCH: &str = "passwd: files\ngroup: files\nhosts: files dns\n";
/// The root base's `PATH`, for images assembled on no base.
pub const PATH: &str = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// Under /usr/share, dropped whole: nothing in the images reads them.
const PRUNED: &[&str] = &[
    "usr/share/man",
    "usr/share/info",
    "usr/share/lintian",
    "usr/share/locale",
    "usr/share/bash-completion",
    // iconv(3)'s character set modules (8 MiB): neither the Rust binaries nor kmod call
    // iconv.
    "usr/lib/x86_64-linux-gnu/gconv",
];

/// A base image: Debian packages unpacked as one layer, on top of another base or of
/// nothing.
#[derive(Debug)]
pub struct Base {
    /// The repository under `kmm-fleet/`.
    pub name: &'static str,
    pub description: &'static str,
    /// Unpacked as they are: dependencies are listed explicitly (only those the
    /// programs load), not resolved.
    pub packages: &'static [&'static str],
}

/// glibc and libgcc (the Rust binaries' only shared libraries), the CA bundle, and
/// base-files for the skeleton (/tmp, /root, /home) and /etc/os-release.
pub const BASE: Base = Base {
    name: "base",
    description: "Debian 12 glibc, libgcc and CA certificates; non-root user 65532",
    packages: &["base-files", "libc6", "libgcc-s1", "ca-certificates"],
};

/// [`BASE`] plus Debian's kmod (modprobe, depmod, modinfo, ...) and what `/bin/kmod`
/// loads (`ldd`): libzstd and liblzma for compressed modules, libcrypto (libssl3) for
/// signatures. libkmod2 holds kmod's copyright file (kmod's doc directory links there).
pub const BASE_KMOD: Base = Base {
    name: "base-kmod",
    description: "kmm-fleet/base with Debian 12 kmod: modprobe, depmod, modinfo",
    packages: &["kmod", "libkmod2", "libzstd1", "liblzma5", "libssl3"],
};

/// [`BASE`] plus OpenSSL's libraries (libssl3: libssl and libcrypto), which kmm-hub's
/// module signer (`kmm-signing`) loads.
pub const BASE_OPENSSL: Base = Base {
    name: "base-openssl",
    description: "kmm-fleet/base with Debian 12 OpenSSL libraries",
    packages: &["libssl3"],
};

/// [`BASE`] plus Debian's buildah and what `/usr/bin/buildah` loads (`ldd`), the
/// configuration it reads from containers-common (the signature policy it refuses to pull
/// without, the default seccomp profile for `RUN` steps), and dash for the builder's
/// entrypoint script.
pub const BASE_BUILDAH: Base = Base {
    name: "base-buildah",
    description: "kmm-fleet/base with Debian 12 buildah and dash",
    packages: &[
        "buildah",
        "golang-github-containers-common",
        "libgpgme11",
        "libassuan0",
        "libgpg-error0",
        "libseccomp2",
        "libdevmapper1.02.1",
        "libselinux1",
        "libpcre2-8-0",
        "libudev1",
        "dash",
    ],
};

/// A Debian package at the version apt would install.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Package {
    pub name: String,
    pub version: String,
}

/// `localhost/kmm-fleet/<name>:bookworm`: where buildah keeps a base locally.
pub fn local_reference(base: &Base) -> String {
    format!("localhost/{}", repository(base))
}

/// `kmm-fleet/<name>:bookworm`, the path the Dockerfiles expect under a registry.
pub fn repository(base: &Base) -> String {
    format!("{}/{}:{TAG}", super::NAMESPACE, base.name)
}

/// A base built (or found current) in local storage.
#[derive(Debug, Clone)]
pub struct Ensured {
    /// `localhost/kmm-fleet/<name>:bookworm`
    pub reference: String,
    pub inspected: Inspected,
    /// Whether this call built it.
    pub rebuilt: bool,
    /// Its packages and its parent's.
    pub packages: Vec<Package>,
}

/// Make `base` current in local storage, as a layer on `parent` if given; `cache` holds
/// the downloaded packages.
pub fn ensure(base: &Base, parent: Option<&Ensured>, cache: &Path) -> Result<Ensured> {
    let own = candidates(base.packages)?;
    let mut hash = Sha256::new();
    hash.update(LAYOUT);
    if let Some(parent) = parent {
        hash.update(&parent.inspected.id);
    }
    for package in &own {
        hash.update(format!("\n{}={}", package.name, package.version));
    }
    let key = format!("{:x}", hash.finalize());
    let mut packages = parent.map(|p| p.packages.clone()).unwrap_or_default();
    packages.extend(own.iter().cloned());
    let reference = local_reference(base);
    if let Some(existing) = buildah::inspect(&reference)?
        && existing.labels.get(KEY_LABEL) == Some(&key)
    {
        return Ok(Ensured {
            reference,
            inspected: existing,
            rebuilt: false,
            packages,
        });
    }
    let debs = own
        .iter()
        .map(|p| download(p, &cache.join("debs")))
        .collect::<Result<Vec<_>>>()?;
    let work = cache.join("rootfs").join(base.name);
    if work.exists() {
        std::fs::remove_dir_all(&work).context(|| format!("removing {}", work.display()))?;
    }
    let rootfs = work.join("rootfs");
    std::fs::create_dir_all(&rootfs).context(|| format!("creating {}", rootfs.display()))?;
    for (package, deb) in own.iter().zip(&debs) {
        unpack(package, deb, &rootfs)?;
    }
    prune(&rootfs)?;
    certificate_bundle(&rootfs)?;
    if parent.is_none() {
        accounts(&rootfs)?;
    }
    let listed = packages
        .iter()
        .map(|p| format!("{}={}", p.name, p.version))
        .collect::<Vec<_>>()
        .join(" ");
    let from = parent.map_or("scratch", |p| p.reference.as_str());
    let container = buildah::run(["from", "--pull=never", "--quiet", from])?;
    let committed = commit(base, &container, &work, parent.is_none(), &key, &listed);
    if committed.is_err() {
        let _ = buildah::run(["rm", &container]);
    }
    committed?;
    std::fs::remove_dir_all(&work).context(|| format!("removing {}", work.display()))?;
    let built = buildah::inspect(&reference)?
        .ok_or_else(|| Error::Invalid(format!("{reference} is missing after its commit")))?;
    Ok(Ensured {
        reference,
        inspected: built,
        rebuilt: true,
        packages,
    })
}

/// Copy the unpacked root into `container`, configure it and commit it as the base.
fn commit(
    base: &Base,
    container: &str,
    work: &Path,
    root_base: bool,
    key: &str,
    packages: &str,
) -> Result<()> {
    let rootfs = work.join("rootfs");
    buildah::run([
        "copy".as_ref(),
        "--quiet".as_ref(),
        container.as_ref(),
        rootfs.as_os_str(),
        "/".as_ref(),
    ])?;
    if root_base {
        // buildah copy makes everything root's; the home directory is the user's.
        let home = work.join("home");
        let nonroot = home.join("nonroot");
        std::fs::create_dir_all(&nonroot).context(|| format!("creating {}", nonroot.display()))?;
        set_mode(&nonroot, 0o700)?;
        buildah::run([
            "copy".as_ref(),
            "--quiet".as_ref(),
            "--chown".as_ref(),
            NONROOT.as_ref(),
            container.as_ref(),
            home.as_os_str(),
            "/home".as_ref(),
        ])?;
    }
    let mut config = buildah::command();
    config.args(["config", "--user", NONROOT, "--workingdir", "/home/nonroot"]);
    if root_base {
        config.args(["--env", PATH]);
    }
    buildah::label_and_commit(
        config,
        container,
        buildah::BaseLabels {
            title: format!("{}/{}", super::NAMESPACE, base.name),
            description: base.description.into(),
            version: TAG,
            packages,
            key,
        },
        &local_reference(base),
    )
}

/// The versions apt would install of `names`, from its package lists.
fn candidates(names: &[&str]) -> Result<Vec<Package>> {
    let out = Command::new("apt-cache")
        .args(["show", "--no-all-versions"])
        .args(names)
        .output()
        .context(|| "running apt-cache show".into())?;
    let text = String::from_utf8_lossy(&out.stdout);
    let found = parse_records(&text);
    names
        .iter()
        .map(|name| {
            found
                .iter()
                .find(|p| p.name == *name)
                .cloned()
                .ok_or_else(|| {
                    Error::Invalid(format!(
                        "apt knows no version of {name} for the image bases \
                         (`apt-get update` first?): {}",
                        String::from_utf8_lossy(&out.stderr).trim()
                    ))
                })
        })
        .collect()
}

/// `Package:` and `Version:` of each record of `apt-cache show`.
fn parse_records(text: &str) -> Vec<Package> {
    text.split("\n\n")
        .filter_map(|record| {
            let field = |name: &str| {
                record
                    .lines()
                    .find_map(|l| l.strip_prefix(name))
                    .map(|v| v.trim().to_string())
            };
            Some(Package {
                name: field("Package:")?,
                version: field("Version:")?,
            })
        })
        .collect()
}

/// Where the package's .deb is kept, `<debs>/<name>_<version>/`, and where it is
/// downloaded to first: the whole name and `.partial` (a version's dots are not an
/// extension to replace, or two versions would share one directory).
fn download_dirs(package: &Package, debs: &Path) -> (PathBuf, PathBuf) {
    let name = format!("{}_{}", package.name, package.version);
    (debs.join(&name), debs.join(format!("{name}.partial")))
}

/// The package's .deb, downloaded once into `<debs>/<name>_<version>/`.
pub fn download(package: &Package, debs: &Path) -> Result<PathBuf> {
    let (dir, partial) = download_dirs(package, debs);
    if let Ok(deb) = only_deb(&dir) {
        return Ok(deb);
    }
    if partial.exists() {
        std::fs::remove_dir_all(&partial).context(|| format!("removing {}", partial.display()))?;
    }
    std::fs::create_dir_all(&partial).context(|| format!("creating {}", partial.display()))?;
    let spec = format!("{}={}", package.name, package.version);
    // As root apt would hand the download to its unprivileged `_apt` user, who cannot
    // write into root's cache; downloading as the caller avoids that detour.
    output(
        Command::new("apt-get")
            .args(["download", "-qq", "-o", "APT::Sandbox::User=root", &spec])
            .current_dir(&partial),
    )?;
    let deb = only_deb(&partial)?;
    if dir.exists() {
        std::fs::remove_dir_all(&dir).context(|| format!("removing {}", dir.display()))?;
    }
    std::fs::rename(&partial, &dir).context(|| format!("renaming to {}", dir.display()))?;
    only_deb(&dir)
        .map_err(|_| Error::Invalid(format!("{} vanished from {}", deb.display(), dir.display())))
}

/// The one `.deb` in `dir` (where `apt-get download` left it).
pub fn only_deb(dir: &Path) -> Result<PathBuf> {
    let mut debs = vec![];
    for entry in std::fs::read_dir(dir).context(|| format!("reading {}", dir.display()))? {
        let path = entry
            .context(|| format!("reading {}", dir.display()))?
            .path();
        if path.extension().is_some_and(|e| e == "deb") {
            debs.push(path);
        }
    }
    match debs.as_slice() {
        [deb] => Ok(deb.clone()),
        _ => Err(Error::Invalid(format!(
            "expected one .deb in {}, found {debs:?}",
            dir.display()
        ))),
    }
}

/// Unpack the package's files into `rootfs` and record it for scanners.
pub fn unpack(package: &Package, deb: &Path, rootfs: &Path) -> Result<()> {
    output(Command::new("dpkg-deb").arg("-x").arg(deb).arg(rootfs))?;
    let control = output(Command::new("dpkg-deb").arg("-f").arg(deb))?.stdout;
    let status = rootfs.join("var/lib/dpkg/status.d");
    std::fs::create_dir_all(&status).context(|| format!("creating {}", status.display()))?;
    let path = status.join(&package.name);
    std::fs::write(&path, control).context(|| format!("writing {}", path.display()))
}

/// Drop documentation and unused data; of /usr/share/doc only the copyright files stay
/// (the licences of what the image distributes).
pub fn prune(rootfs: &Path) -> Result<()> {
    for dir in PRUNED {
        let path = rootfs.join(dir);
        if path.exists() {
            std::fs::remove_dir_all(&path).context(|| format!("removing {}", path.display()))?;
        }
    }
    let doc = rootfs.join("usr/share/doc");
    let Ok(entries) = std::fs::read_dir(&doc) else {
        return Ok(());
    };
    for entry in entries {
        let package = entry.context(|| format!("reading {}", doc.display()))?;
        // A symlinked directory (kmod -> libkmod2) points at another package's files.
        if !package
            .file_type()
            .context(|| format!("reading {}", doc.display()))?
            .is_dir()
        {
            continue;
        }
        let dir = package.path();
        for file in std::fs::read_dir(&dir).context(|| format!("reading {}", dir.display()))? {
            let path = file
                .context(|| format!("reading {}", dir.display()))?
                .path();
            if path.file_name().is_some_and(|n| n == "copyright") {
                continue;
            }
            if path.is_dir() && !path.is_symlink() {
                std::fs::remove_dir_all(&path)
            } else {
                std::fs::remove_file(&path)
            }
            .context(|| format!("removing {}", path.display()))?;
        }
    }
    Ok(())
}

/// `/etc/ssl/certs/ca-certificates.crt`, as ca-certificates' postinst
/// (`update-ca-certificates`) would make it: every certificate the package ships, in
/// name order. rustls-native-certs and OpenSSL look for that file.
fn certificate_bundle(rootfs: &Path) -> Result<()> {
    let mozilla = rootfs.join("usr/share/ca-certificates/mozilla");
    let Ok(entries) = std::fs::read_dir(&mozilla) else {
        return Ok(());
    };
    let mut certificates = entries
        .map(|e| e.map(|e| e.path()))
        .collect::<std::io::Result<Vec<_>>>()
        .context(|| format!("reading {}", mozilla.display()))?;
    certificates.retain(|p| p.extension().is_some_and(|e| e == "crt"));
    certificates.sort();
    let mut bundle = String::new();
    for path in &certificates {
        let pem =
            std::fs::read_to_string(path).context(|| format!("reading {}", path.display()))?;
        bundle.push_str(&pem);
        if !pem.ends_with('\n') {
            bundle.push('\n');
        }
    }
    let dir = rootfs.join("etc/ssl/certs");
    std::fs::create_dir_all(&dir).context(|| format!("creating {}", dir.display()))?;
    let path = dir.join("ca-certificates.crt");
    std::fs::write(&path, bundle).context(|| format!("writing {}", path.display()))
}

/// The users and groups, and name service configuration, of the root base.
pub fn accounts(rootfs: &Path) -> Result<()> {
    for (file, contents) in [
        ("etc/passwd", PASSWD),
        ("etc/group", GROUP),
        ("etc/nsswitch.conf", NSSWITCH),
    ] {
        let path = rootfs.join(file);
        std::fs::write(&path, contents).context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}

fn set_mode(path: &Path, mode: u32) -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
        .context(|| format!("setting the mode of {}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn apt_cache_records_give_each_package_its_version() {
        let text = "Package: libc6\nSource: glibc\nVersion: 2.36-9+deb12u14\n\
                    Description: GNU C Library\n continued line\n\n\
                    Package: kmod\nVersion: 30+20221128-1\nArchitecture: amd64\n";
        assert_eq!(
            parse_records(text),
            [
                Package {
                    name: "libc6".into(),
                    version: "2.36-9+deb12u14".into()
                },
                Package {
                    name: "kmod".into(),
                    version: "30+20221128-1".into()
                },
            ]
        );
    }

    #[test]
    fn two_versions_of_a_package_download_into_their_own_directories() {
        let debs = Path::new("/debs");
        let package = |version: &str| Package {
            name: "libc6".into(),
            version: version.into(),
        };
        let (kept, partial) = download_dirs(&package("2.36-9+deb12u4"), debs);
        let (_, other) = download_dirs(&package("2.36-9+deb12u13"), debs);
        assert_eq!(kept, Path::new("/debs/libc6_2.36-9+deb12u4"));
        assert_eq!(partial, Path::new("/debs/libc6_2.36-9+deb12u4.partial"));
        assert_ne!(partial, other);
    }
}
