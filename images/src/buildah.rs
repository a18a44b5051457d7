//! The `buildah` command line, always on the same storage, and what the image code
//! reads back from it.

use std::collections::BTreeMap;
use std::process::{Command, Output};

use serde::Deserialize;

use crate::{Error, IoContext, Result, output};

/// Storage driver unless `$STORAGE_DRIVER` (buildah's own variable) names another. vfs
/// works on any filesystem, also inside containers where overlay cannot mount; it copies
/// layers in full, which costs little for images of a few tens of MiB.
const STORAGE_DRIVER: &str = "vfs";

/// `buildah` with the storage options every call must share: the store the images are in.
pub fn command() -> Command {
    let mut cmd = Command::new("buildah");
    if std::env::var_os("STORAGE_DRIVER").is_none() {
        cmd.args(["--storage-driver", STORAGE_DRIVER]);
    }
    cmd
}

/// Fail with what to install when buildah is missing.
pub fn check() -> Result<()> {
    match command().arg("--version").output() {
        Ok(out) if out.status.success() => Ok(()),
        Ok(out) => Err(Error::Command {
            command: "buildah --version".into(),
            status: format!(
                "{}: {}",
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            ),
        }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Err(Error::Invalid(
            "buildah is missing: `cargo xtask env setup` installs it \
             (apt-get install --no-install-recommends buildah)"
                .into(),
        )),
        Err(e) => Err(Error::Io {
            context: "running buildah --version".into(),
            source: e,
        }),
    }
}

/// Run buildah with `args`; its standard output, trimmed.
pub fn run<I, S>(args: I) -> Result<String>
where
    I: IntoIterator<Item = S>,
    S: AsRef<std::ffi::OsStr>,
{
    let mut cmd = command();
    cmd.args(args);
    let out = output(&mut cmd)?;
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
}

/// The labels of a base image: OCI's title, description, source and version, the
/// packages it holds and the key of its content.
#[derive(Debug)]
pub struct BaseLabels<'a> {
    pub title: String,
    pub description: String,
    pub version: &'a str,
    pub packages: &'a str,
    pub key: &'a str,
}

/// Applies `config` (a `buildah config` with the image's other settings) with `labels`
/// to `container`, then commits it as `reference` with timestamps zeroed, so the same
/// content makes the same image.
pub fn label_and_commit(
    mut config: Command,
    container: &str,
    labels: BaseLabels<'_>,
    reference: &str,
) -> Result<()> {
    for (label, value) in [
        ("org.opencontainers.image.title", labels.title.as_str()),
        ("org.opencontainers.image.description", &labels.description),
        ("org.opencontainers.image.source", super::SOURCE),
        ("org.opencontainers.image.version", labels.version),
        (super::PACKAGES_LABEL, labels.packages),
        (super::KEY_LABEL, labels.key),
    ] {
        config.arg("--label").arg(format!("{label}={value}"));
    }
    output(config.arg(container))?;
    run([
        "commit",
        "--quiet",
        "--rm",
        "--timestamp",
        "0",
        container,
        reference,
    ])?;
    Ok(())
}

/// What `buildah inspect --type image` tells about a local image.
#[derive(Debug, Clone)]
pub struct Inspected {
    /// The image ID (its config's digest, without `sha256:`).
    pub id: String,
    pub labels: BTreeMap<String, String>,
    /// `uid:gid` the image's processes run as.
    pub user: String,
    pub entrypoint: Vec<String>,
    pub env: Vec<String>,
    /// The layers' uncompressed digests (`rootfs.diff_ids`), base first: the same layer
    /// has the same one in every image.
    pub layers: Vec<String>,
}

#[derive(Deserialize)]
struct Inspect {
    #[serde(rename = "FromImageID")]
    id: String,
    #[serde(rename = "OCIv1")]
    oci: OciImage,
}

#[derive(Deserialize)]
struct OciImage {
    #[serde(default)]
    config: OciConfig,
    rootfs: RootFs,
}

#[derive(Deserialize)]
struct RootFs {
    diff_ids: Vec<String>,
}

#[derive(Default, Deserialize)]
struct OciConfig {
    #[serde(rename = "User", default)]
    user: String,
    #[serde(rename = "Labels", default)]
    labels: Option<BTreeMap<String, String>>,
    #[serde(rename = "Entrypoint", default)]
    entrypoint: Option<Vec<String>>,
    #[serde(rename = "Env", default)]
    env: Option<Vec<String>>,
}

/// An OCI image manifest, as much as the images code reads of it.
#[derive(Deserialize)]
pub(crate) struct Manifest {
    pub(crate) layers: Vec<Descriptor>,
}

#[derive(Deserialize)]
pub(crate) struct Descriptor {
    pub(crate) digest: String,
}

/// The local image `reference`; `None` when the store has no such image.
pub fn inspect(reference: &str) -> Result<Option<Inspected>> {
    let out = command()
        .args(["inspect", "--type", "image", reference])
        .output()
        .context(|| format!("running buildah inspect {reference}"))?;
    if !out.status.success() {
        let stderr = String::from_utf8_lossy(&out.stderr);
        // buildah says "image not known" (or "...: not found") for an absent image.
        if stderr.contains("not known") || stderr.contains("not found") {
            return Ok(None);
        }
        return Err(Error::Command {
            command: format!("buildah inspect --type image {reference}"),
            status: format!("{}: {}", out.status, stderr.trim()),
        });
    }
    let inspect: Inspect = serde_json::from_slice(&out.stdout)
        .map_err(|e| Error::Invalid(format!("buildah inspect {reference}: {e}")))?;
    let OciImage { config, rootfs } = inspect.oci;
    Ok(Some(Inspected {
        id: inspect.id,
        labels: config.labels.unwrap_or_default(),
        user: config.user,
        entrypoint: config.entrypoint.unwrap_or_default(),
        env: config.env.unwrap_or_default(),
        layers: rootfs.diff_ids,
    }))
}

/// Run `command` in a new container of the local image `reference`: in its root
/// filesystem (the container mounted, `chroot`), as the image's user, with the image's
/// environment; the container is removed afterwards. Its output, whatever its exit
/// status. Not `buildah run --isolation chroot`: Debian 12's buildah 1.28 there loses a
/// quick process's output now and then (a `--help` printed nothing 3 times in 15).
pub fn run_in(reference: &str, command: &[&str]) -> Result<Output> {
    let image =
        inspect(reference)?.ok_or_else(|| Error::Invalid(format!("no local image {reference}")))?;
    let container = run(["from", "--pull=never", "--quiet", reference])?;
    let out = run(["mount", &container]).and_then(|root| {
        let mut chroot = Command::new("chroot");
        if !image.user.is_empty() {
            chroot.arg(format!("--userspec={}", image.user));
        }
        chroot.arg(&root).args(command).env_clear();
        for variable in &image.env {
            if let Some((name, value)) = variable.split_once('=') {
                chroot.env(name, value);
            }
        }
        chroot
            .output()
            .context(|| format!("running {} in {reference}", command.join(" ")))
    });
    // buildah rm unmounts the container first.
    let removed = run(["rm", &container]);
    let out = out?;
    removed?;
    Ok(out)
}
