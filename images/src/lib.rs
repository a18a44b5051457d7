//! Container images of kmm-fleet, built with buildah from the Dockerfiles beside each
//! component (`hub/Dockerfile`, `spoke-proxy/Dockerfile`, `node-agent/Dockerfile`, the
//! builder's `hub/builder/Dockerfile`, and the sample device plugin's
//! `samples/device-plugin/Dockerfile`) on bases assembled from Debian packages ([`base`]).
//!
//! [`build`] builds the release binaries, makes the bases current, builds the five
//! images and, given a registry, pushes bases and images there ([`builder`] does only
//! the builder's, which needs no binary). Every image carries a label hashing all it is
//! made of (binary or context files, Dockerfile, base, build arguments); an image
//! already carrying the hash is kept, so a call with nothing changed costs the
//! incremental cargo build and a few buildah inspections. Other images assembled the
//! same way (the local fleet's base for kmod builds, in kmm-e2e) use [`base`]'s steps,
//! [`buildah`](mod@buildah), [`push`] and [`sizes`].
//!
//! Its own crate, not the test lab's: what the product ships depends on no test code.

pub mod base;
pub mod buildah;

use std::io::{Read, Seek};
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use flate2::Compression;
use flate2::read::GzDecoder;
use flate2::write::GzEncoder;
use serde::Deserialize;
use sha2::{Digest, Sha256};

pub use buildah::{Inspected, command as buildah, inspect, run_in};

use base::{BASE, BASE_BUILDAH, BASE_KMOD, BASE_OPENSSL, Base};

/// Why an image or base could not be built, inspected or pushed.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },
    #[error("`{command}` failed ({status})")]
    Command { command: String, status: String },
    #[error("{0}")]
    Invalid(String),
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Attach a description to an I/O error.
trait IoContext<T> {
    fn context(self, context: impl FnOnce() -> String) -> Result<T>;
}

impl<T> IoContext<T> for std::io::Result<T> {
    fn context(self, context: impl FnOnce() -> String) -> Result<T> {
        self.map_err(|source| Error::Io {
            context: context(),
            source,
        })
    }
}

/// Root of everything kmm-fleet caches across runs (the images' downloads and sizes under
/// `images/`, and the local fleet's toolchain and state): `$KMM_FLEET_CACHE`, else
/// `~/.cache/kmm-fleet`.
pub fn cache_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("KMM_FLEET_CACHE") {
        return PathBuf::from(dir);
    }
    std::env::var_os("HOME")
        .map_or_else(|| PathBuf::from("/root"), PathBuf::from)
        .join(".cache")
        .join("kmm-fleet")
}

/// Where images and bases keep what they download and measure: `<cache>/images`.
pub fn images_cache_dir() -> PathBuf {
    cache_dir().join("images")
}

/// Namespace of every image and base: `<registry>/kmm-fleet/<name>`.
pub const NAMESPACE: &str = "kmm-fleet";
/// The workspace version: the images' `org.opencontainers.image.version` and default tag.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");
/// The images' `org.opencontainers.image.source`.
pub const SOURCE: &str = env!("CARGO_PKG_REPOSITORY");
/// Label holding the hash of everything an image or base is made of.
pub const KEY_LABEL: &str = "dev.kmm-fleet.content-key";
/// Label listing the Debian packages (`name=version`) of a base and the images on it.
pub const PACKAGES_LABEL: &str = "dev.kmm-fleet.packages";

/// One of kmm-fleet's images.
#[derive(Debug)]
pub struct Component {
    /// The image's name under `kmm-fleet/`; for a binary's image also the cargo package
    /// and its binary.
    pub name: &'static str,
    /// Relative to the workspace root.
    pub dockerfile: &'static str,
    pub base: &'static Base,
    pub context: Context,
}

/// What a component's Dockerfile copies from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Context {
    /// The release binary named like the component (the context is cargo's release
    /// directory).
    Binary,
    /// The files of this directory, relative to the workspace root.
    Directory(&'static str),
}

pub const COMPONENTS: &[Component] = &[
    Component {
        name: "kmm-hub",
        dockerfile: "hub/Dockerfile",
        base: &BASE_OPENSSL,
        context: Context::Binary,
    },
    Component {
        name: "kmm-spoke-proxy",
        dockerfile: "spoke-proxy/Dockerfile",
        base: &BASE,
        context: Context::Binary,
    },
    Component {
        name: "kmm-node-agent",
        dockerfile: "node-agent/Dockerfile",
        base: &BASE_KMOD,
        context: Context::Binary,
    },
    BUILDER,
    // Not part of the product: what the local fleet runs as a module's device plugin.
    Component {
        name: "kmm-sample-device-plugin",
        dockerfile: "samples/device-plugin/Dockerfile",
        base: &BASE,
        context: Context::Binary,
    },
];

/// The image kmm-hub's build Jobs run: buildah and its entrypoint script.
pub const BUILDER: Component = Component {
    name: "kmm-builder",
    dockerfile: "hub/builder/Dockerfile",
    base: &BASE_BUILDAH,
    context: Context::Directory("hub/builder"),
};

/// What to build and where the images go.
#[derive(Debug, Clone)]
pub struct Options {
    /// `host:port` of the registry the images are named for and pushed to, with the
    /// bases under the names the Dockerfiles default to there
    /// (`<registry>/kmm-fleet/base:bookworm`); `None` names them `localhost/...` and
    /// keeps everything in buildah's local storage. A loopback registry is spoken to
    /// over plain HTTP, any other over verified TLS.
    pub registry: Option<String>,
    /// The images' tag.
    pub tag: String,
    /// Cargo's target directory for the release build.
    pub target_dir: PathBuf,
}

impl Options {
    /// Tagged with the workspace version, built in cargo's usual target directory
    /// (`$CARGO_TARGET_DIR`, else the workspace's `target/`).
    pub fn new(registry: Option<String>) -> Self {
        Self {
            registry,
            tag: VERSION.to_string(),
            target_dir: default_target_dir(),
        }
    }
}

/// An image or base in local storage (and in the registry, when pushed).
#[derive(Debug, Clone)]
pub struct Image {
    /// `kmm-hub`, ..., or a base's name (`base`, `base-kmod`, `base-openssl`, `base-buildah`).
    pub name: String,
    /// Its name in local storage, which is also its name in the registry for images.
    pub reference: String,
    /// In the registry, when pushed: `<registry>/kmm-fleet/<name>:<tag>`.
    pub pushed: Option<String>,
    /// The image ID (config digest, without `sha256:`).
    pub id: String,
    /// The layers' sizes uncompressed, as they are unpacked on a node.
    pub size: u64,
    /// The layers' sizes gzip-compressed, as a registry holds them and a pull fetches.
    pub compressed_size: u64,
    /// Whether this call built it; false when an image with the same content was there.
    pub rebuilt: bool,
}

/// What [`build`] made.
#[derive(Debug, Clone)]
pub struct Built {
    /// `base`, `base-kmod`, `base-openssl`, `base-buildah`.
    pub bases: Vec<Image>,
    /// One per [`COMPONENTS`], in that order.
    pub images: Vec<Image>,
    /// Where the release binaries the images hold were built.
    pub release_dir: PathBuf,
}

/// Build the release binaries, the bases and the five images; with a registry, push
/// bases and images to it. Fails naming buildah if it is missing.
pub fn build(options: &Options) -> Result<Built> {
    buildah::check()?;
    let workspace = workspace();
    let release = build_binaries(&workspace, &options.target_dir)?;
    let mut images = Images::new(options, workspace);
    let mut built = Built {
        bases: vec![],
        images: vec![],
        release_dir: release.clone(),
    };
    for component in COMPONENTS {
        built
            .images
            .push(images.component(component, Some(&release))?);
    }
    built.bases = images.bases;
    Ok(built)
}

/// Build the builder image ([`BUILDER`]) and its bases; with a registry, push them. The
/// image to test builds with, without the release build of the binaries [`build`] does.
pub fn builder(options: &Options) -> Result<Image> {
    buildah::check()?;
    Images::new(options, workspace()).component(&BUILDER, None)
}

/// Bases made current (and pushed) so far, and what images are built with.
struct Images<'a> {
    options: &'a Options,
    workspace: PathBuf,
    source: Source,
    cache: PathBuf,
    /// Each base at most once, parents first.
    ensured: Vec<(&'static Base, base::Ensured)>,
    bases: Vec<Image>,
}

impl<'a> Images<'a> {
    fn new(options: &'a Options, workspace: PathBuf) -> Self {
        Self {
            options,
            source: Source::of(&workspace),
            workspace,
            cache: images_cache_dir(),
            ensured: vec![],
            bases: vec![],
        }
    }

    /// `definition` current in local storage (and pushed), on [`BASE`] unless it is it.
    fn base(&mut self, definition: &'static Base) -> Result<base::Ensured> {
        if let Some((_, ensured)) = self.ensured.iter().find(|(d, _)| d.name == definition.name) {
            return Ok(ensured.clone());
        }
        let parent = match definition.name == BASE.name {
            true => None,
            false => Some(self.base(&BASE)?),
        };
        let ensured = base::ensure(definition, parent.as_ref(), &self.cache)?;
        let pushed = match &self.options.registry {
            Some(registry) => {
                let remote = format!("{registry}/{}", base::repository(definition));
                push(&ensured.reference, &remote, registry)?;
                Some(remote)
            }
            None => None,
        };
        let (size, compressed_size) = sizes(&ensured.inspected.id, &self.cache)?;
        self.bases.push(Image {
            name: definition.name.to_string(),
            reference: ensured.reference.clone(),
            pushed,
            id: ensured.inspected.id.clone(),
            size,
            compressed_size,
            rebuilt: ensured.rebuilt,
        });
        self.ensured.push((definition, ensured.clone()));
        Ok(ensured)
    }

    /// `component`'s image on its base; `release` holds the binaries.
    fn component(&mut self, component: &Component, release: Option<&Path>) -> Result<Image> {
        let base = self.base(component.base)?;
        let context = match (component.context, release) {
            (Context::Binary, Some(release)) => release.to_path_buf(),
            (Context::Binary, None) => {
                return Err(Error::Invalid(format!(
                    "{} is built from its release binary, which was not built",
                    component.name
                )));
            }
            (Context::Directory(dir), _) => self.workspace.join(dir),
        };
        build_image(
            component,
            &base,
            &context,
            &self.workspace,
            &self.source,
            self.options,
            &self.cache,
        )
    }
}

/// `$CARGO_TARGET_DIR`, else the workspace's `target/`.
pub fn default_target_dir() -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR").map_or_else(|| workspace().join("target"), PathBuf::from)
}

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_default()
}

/// The release binaries the images carry, built into `target_dir` exactly as [`build`]
/// builds them (one invocation, one feature set): a caller needing one of them (the
/// real-kernel test's guest agent) shares that build instead of making another. The
/// directory holding them.
pub fn release_binaries(target_dir: &Path) -> Result<PathBuf> {
    build_binaries(&workspace(), target_dir)
}

/// `cargo build --release` of the binaries; the directory holding them.
fn build_binaries(workspace: &Path, target_dir: &Path) -> Result<PathBuf> {
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let mut cmd = Command::new(cargo);
    cmd.args(["build", "--release", "--target-dir"])
        .arg(target_dir)
        .current_dir(workspace);
    for component in COMPONENTS.iter().filter(|c| c.context == Context::Binary) {
        cmd.args(["-p", component.name]);
    }
    // Cargo sets these for the program it runs (xtask, a test). Inherited, they reach
    // build scripts that track them (ring's tracks CARGO_MANIFEST_DIR), which would then
    // rebuild everything after them whenever a plain `cargo build --release` and this
    // one take turns.
    for (name, _) in std::env::vars_os() {
        let name = name.to_string_lossy();
        if ["CARGO_PKG_", "CARGO_MANIFEST_", "CARGO_BIN_"]
            .iter()
            .any(|prefix| name.starts_with(prefix))
            || [
                "CARGO_CRATE_NAME",
                "CARGO_PRIMARY_PACKAGE",
                "CARGO_TARGET_TMPDIR",
                "CARGO_RUSTC_CURRENT_DIR",
                "OUT_DIR",
            ]
            .contains(&name.as_ref())
        {
            cmd.env_remove(name.as_ref());
        }
    }
    output(&mut cmd)?;
    Ok(target_dir.join("release"))
}

/// The commit the images are built from, for their labels and reproducible timestamps.
#[derive(Debug)]
struct Source {
    /// The commit, with `-dirty` when tracked files differ from it; `unknown` outside git.
    revision: String,
    /// The commit's time in seconds since the epoch: the images' creation time.
    timestamp: Option<String>,
}

impl Source {
    fn of(workspace: &Path) -> Self {
        let git = |args: &[&str]| {
            Command::new("git")
                .arg("-C")
                .arg(workspace)
                .args(args)
                .output()
                .ok()
        };
        let Some(head) = git(&["log", "-1", "--format=%H %ct"])
            .filter(|out| out.status.success())
            .map(|out| String::from_utf8_lossy(&out.stdout).trim().to_string())
        else {
            return Self {
                revision: "unknown".into(),
                timestamp: None,
            };
        };
        let (commit, time) = head.split_once(' ').unwrap_or((&head, ""));
        let clean = git(&["diff", "--quiet", "HEAD", "--"]).is_some_and(|out| out.status.success());
        Self {
            revision: if clean {
                commit.to_string()
            } else {
                format!("{commit}-dirty")
            },
            timestamp: (!time.is_empty()).then(|| time.to_string()),
        }
    }
}

/// Build `component`'s image on `base` from `context` unless one with the same content
/// key exists.
fn build_image(
    component: &Component,
    base: &base::Ensured,
    context: &Path,
    workspace: &Path,
    source: &Source,
    options: &Options,
    cache: &Path,
) -> Result<Image> {
    let registry = options.registry.as_deref().unwrap_or("localhost");
    let reference = format!("{registry}/{NAMESPACE}/{}:{}", component.name, options.tag);
    let dockerfile = workspace.join(component.dockerfile);
    let build_args = [
        ("BASE_IMAGE", base.reference.as_str()),
        ("VERSION", VERSION),
        ("REVISION", source.revision.as_str()),
        ("SOURCE", SOURCE),
    ];
    let mut hash = Sha256::new();
    let files = match component.context {
        Context::Binary => vec![context.join(component.name)],
        Context::Directory(_) => {
            let files = context_files(context)?;
            // Names count too: a file renamed changes what the Dockerfile copies.
            for file in &files {
                hash.update(
                    file.strip_prefix(context)
                        .unwrap_or(file)
                        .as_os_str()
                        .as_encoded_bytes(),
                );
            }
            files
        }
    };
    for file in files.iter().chain([&dockerfile]) {
        hash.update(std::fs::read(file).context(|| format!("reading {}", file.display()))?);
    }
    hash.update(&base.inspected.id);
    for (arg, value) in &build_args {
        hash.update(format!("\n{arg}={value}"));
    }
    hash.update(source.timestamp.as_deref().unwrap_or_default());
    let key = format!("{:x}", hash.finalize());
    let existing = inspect(&reference)?.filter(|i| i.labels.get(KEY_LABEL) == Some(&key));
    let rebuilt = existing.is_none();
    let inspected = match existing {
        Some(inspected) => inspected,
        None => {
            let mut bud = buildah::command();
            // Chroot isolation: the Dockerfiles run nothing, and no OCI runtime or
            // container network (netavark's firewall rules) is involved.
            bud.args(["bud", "--quiet", "--isolation", "chroot", "--pull=never"]);
            if let Some(timestamp) = &source.timestamp {
                bud.args(["--timestamp", timestamp]);
            }
            bud.arg("--file").arg(&dockerfile);
            for (arg, value) in &build_args {
                bud.arg("--build-arg").arg(format!("{arg}={value}"));
            }
            bud.arg("--label").arg(format!("{KEY_LABEL}={key}"));
            bud.args(["--tag", &reference]).arg(context);
            output(&mut bud)?;
            inspect(&reference)?.ok_or_else(|| {
                Error::Invalid(format!("{reference} is missing after buildah bud"))
            })?
        }
    };
    let pushed = match &options.registry {
        Some(registry) => {
            push(&reference, &reference, registry)?;
            Some(reference.clone())
        }
        None => None,
    };
    let (size, compressed_size) = sizes(&inspected.id, cache)?;
    Ok(Image {
        name: component.name.to_string(),
        reference,
        pushed,
        id: inspected.id,
        size,
        compressed_size,
        rebuilt,
    })
}

/// Run `cmd` to completion; its output, or an error carrying its standard error.
fn output(cmd: &mut Command) -> Result<Output> {
    let describe = format!("{cmd:?}");
    let out = cmd.output().context(|| format!("running {describe}"))?;
    if !out.status.success() {
        return Err(Error::Command {
            command: describe,
            status: format!(
                "{}: {}",
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            ),
        });
    }
    Ok(out)
}

/// The files of a context directory, in name order (it has no subdirectories).
fn context_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let mut files = vec![];
    for entry in std::fs::read_dir(dir).context(|| format!("reading {}", dir.display()))? {
        let path = entry
            .context(|| format!("reading {}", dir.display()))?
            .path();
        if !path.is_file() {
            return Err(Error::Invalid(format!(
                "{} is not a file: image contexts are flat",
                path.display()
            )));
        }
        files.push(path);
    }
    files.sort();
    Ok(files)
}

/// Push the local image `local` as `remote` to `registry`.
pub fn push(local: &str, remote: &str, registry: &str) -> Result<()> {
    let tls_verify = format!("--tls-verify={}", !loopback(registry));
    buildah::run([
        "push",
        "--quiet",
        &tls_verify,
        local,
        &format!("docker://{remote}"),
    ])?;
    Ok(())
}

/// Whether `registry` (`host[:port]`) is on this machine: the fleet's registries are
/// plain HTTP there, as Docker also assumes for 127.0.0.0/8.
fn loopback(registry: &str) -> bool {
    let host = match registry.rsplit_once(':') {
        Some((host, port)) if port.chars().all(|c| c.is_ascii_digit()) => host,
        _ => registry,
    };
    let host = host.trim_start_matches('[').trim_end_matches(']');
    host == "localhost" || host.parse::<IpAddr>().is_ok_and(|ip| ip.is_loopback())
}

#[derive(Deserialize)]
struct OciIndex {
    manifests: Vec<buildah::Descriptor>,
}

/// The image's layers uncompressed and gzip-compressed (default level, as `buildah
/// push` compresses them): measured once per image ID from an OCI layout export, and
/// remembered in `<cache>/sizes/<id>`. Local storage's manifest cannot tell: a pull
/// replaces it with the registry's, which lists compressed layers.
pub fn sizes(id: &str, cache: &Path) -> Result<(u64, u64)> {
    let dir = cache.join("sizes");
    let remembered = dir.join(id);
    if let Some((size, compressed)) = std::fs::read_to_string(&remembered)
        .ok()
        .and_then(|s| {
            s.trim()
                .split_once(' ')
                .map(|(a, b)| (a.parse(), b.parse()))
        })
        .and_then(|(a, b)| Some((a.ok()?, b.ok()?)))
    {
        return Ok((size, compressed));
    }
    let layout = dir.join(format!("{id}.oci"));
    if layout.exists() {
        std::fs::remove_dir_all(&layout).context(|| format!("removing {}", layout.display()))?;
    }
    std::fs::create_dir_all(&dir).context(|| format!("creating {}", dir.display()))?;
    buildah::run([
        "push".to_string(),
        "--quiet".to_string(),
        "--disable-compression".to_string(),
        id.to_string(),
        format!("oci:{}", layout.display()),
    ])?;
    let blob = |digest: &str| {
        layout
            .join("blobs/sha256")
            .join(digest.trim_start_matches("sha256:"))
    };
    let read =
        |path: PathBuf| std::fs::read(&path).context(|| format!("reading {}", path.display()));
    let index: OciIndex = serde_json::from_slice(&read(layout.join("index.json"))?)
        .map_err(|e| Error::Invalid(format!("{}/index.json: {e}", layout.display())))?;
    let manifest = index
        .manifests
        .first()
        .ok_or_else(|| Error::Invalid(format!("{} holds no manifest", layout.display())))?;
    let manifest: buildah::Manifest = serde_json::from_slice(&read(blob(&manifest.digest))?)
        .map_err(|e| Error::Invalid(format!("the manifest in {}: {e}", layout.display())))?;
    let (mut size, mut compressed) = (0, 0);
    for layer in &manifest.layers {
        let path = blob(&layer.digest);
        let (uncompressed, gzipped) =
            layer_sizes(&path).context(|| format!("measuring {}", path.display()))?;
        size += uncompressed;
        compressed += gzipped;
    }
    std::fs::remove_dir_all(&layout).context(|| format!("removing {}", layout.display()))?;
    std::fs::write(&remembered, format!("{size} {compressed}"))
        .context(|| format!("writing {}", remembered.display()))?;
    Ok((size, compressed))
}

/// A layer blob's size uncompressed and gzip-compressed. Layers built here are stored
/// uncompressed, but one pulled from a registry keeps its gzip form, which the export
/// then hands out as it is.
fn layer_sizes(path: &Path) -> std::io::Result<(u64, u64)> {
    let mut blob = std::fs::File::open(path)?;
    let length = blob.metadata()?.len();
    let mut magic = [0u8; 2];
    let gzipped = blob.read_exact(&mut magic).is_ok() && magic == [0x1f, 0x8b];
    blob.rewind()?;
    if gzipped {
        let size = std::io::copy(&mut GzDecoder::new(blob), &mut std::io::sink())?;
        Ok((size, length))
    } else {
        let mut gzip = GzEncoder::new(Counter(0), Compression::default());
        std::io::copy(&mut blob, &mut gzip)?;
        Ok((length, gzip.finish()?.0))
    }
}

/// A writer that only counts what it is given.
struct Counter(u64);

impl std::io::Write for Counter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0 += buf.len() as u64;
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback_registries_are_the_plain_http_ones() {
        for registry in [
            "127.0.0.1:16005",
            "localhost:5000",
            "localhost",
            "[::1]:5000",
            "[::1]",
        ] {
            assert!(loopback(registry), "{registry}");
        }
        for registry in ["registry.example.com", "10.0.0.5:5000", "quay.io:443"] {
            assert!(!loopback(registry), "{registry}");
        }
    }
}
