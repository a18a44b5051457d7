//! Extraction of kmod image layers that is safe against hostile images.
//!
//! - `layers.rs`: a layer's decoding (plain, gzip or zstd, named by its media type) and
//!   [`walk`], the one walk over its tar entries, which refuses absolute and `..`
//!   paths; the hub's signer (`kmm-signing`) reads layers through it too.
//! - `lib.rs`: extraction of the module and firmware directories ([`extract_image`]).
//!
//! Only entries under `<dirName>/lib/modules/<kernel>/` and under the firmware path
//! are written; everything else in the image is skipped without being written. The
//! whole image is refused, with an error that names the layer and the entry, when an
//! entry:
//! - has an absolute path or a `..` component;
//! - is a symbolic link whose target does not resolve inside the allowed directories
//!   (resolution follows the links extracted so far, like the kernel would inside the
//!   root, and never climbs above the root);
//! - is a hard link to anything but a regular file already extracted to an allowed
//!   directory;
//! - is larger than the per-file limit, or makes the image larger than the per-image
//!   limit, or exceeds the entry limit;
//! - is a device, a FIFO or another type a module directory never holds;
//! - or when a layer is not valid gzip / zstd / tar.
//!
//! One link may leave the root: upstream's in-tree dependency link (see
//! [`Selection::host_modules`]), written as an absolute link to the host's module tree
//! for the same kernel. Nothing resolves through it during extraction: an entry, link or
//! hard link that would is refused like any other escape.
//!
//! Whiteouts (`.wh.<name>` and the opaque marker `.wh..wh..opq`) remove what earlier
//! layers wrote. Links are written with relative targets computed from their resolved
//! location, so no link on disk points outside the root even when the image's target
//! was absolute. Files are created with `O_NOFOLLOW` and without set-id bits.
//!
//! The caller extracts into a fresh directory and discards it on error; see
//! [`extract_image`], which does exactly that.

mod layers;

use std::collections::BTreeMap;
use std::ffi::{OsStr, OsString};
use std::fs;
use std::io::{self, Read};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Component, Path, PathBuf};

use layers::archive_components;
pub use layers::{Compression, Entry, EntryPath, Layer, LayerError, walk};

/// Size limits applied while extracting.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Largest single file, in bytes.
    pub max_file_bytes: u64,
    /// Largest total of written file bytes over all layers.
    pub max_image_bytes: u64,
    /// Most entries (files, directories, links) written.
    pub max_entries: u64,
    /// Most bytes read from one decompressed layer, written or skipped (a bound on
    /// the work a decompression bomb can cause).
    pub max_layer_read_bytes: u64,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_file_bytes: 256 << 20,
            max_image_bytes: 1 << 30,
            max_entries: 100_000,
            max_layer_read_bytes: 8 << 30,
        }
    }
}

/// What to extract.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Selection {
    /// `modprobe -d` directory inside the image (upstream's `dirName`, `/opt` by default).
    pub dir_name: String,
    /// The kernel release whose `lib/modules/<kernel>` is extracted.
    pub kernel: String,
    /// Directory in the image whose files are firmware (upstream's `firmwarePath`).
    pub firmware_path: Option<String>,
    /// Where the host's module tree (`/lib/modules`) is mounted, read-only, for the
    /// extracting process. With it, upstream's in-tree dependency link is kept: a link
    /// directly in the kernel's module directory to `/lib/modules/<kernel>` or
    /// `/usr/lib/modules/<kernel>` (the same kernel) is written to point at
    /// `<host_modules>/<kernel>`, so `modprobe` finds the host's in-tree modules. Nothing
    /// is ever written or linked through it. `None` refuses such links as escapes.
    pub host_modules: Option<PathBuf>,
}

impl Selection {
    /// The relative directories that may be written, each as normalised components.
    fn allowed(&self) -> Result<Vec<Vec<OsString>>, ExtractError> {
        let mut modules = spec_components(&self.dir_name, "dirName", true)?;
        let kernel = spec_components(&self.kernel, "kernel", false)?;
        if kernel.len() != 1 {
            return Err(ExtractError::InvalidSelection(format!(
                "kernel {:?} must be a single path component",
                self.kernel
            )));
        }
        modules.push("lib".into());
        modules.push("modules".into());
        modules.extend(kernel);
        let mut allowed = vec![modules];
        if let Some(firmware) = &self.firmware_path {
            let firmware = spec_components(firmware, "firmwarePath", false)?;
            allowed.push(firmware);
        }
        Ok(allowed)
    }
}

/// Normalises a path from the module spec; `allow_root` accepts `/` (empty).
fn spec_components(
    path: &str,
    what: &str,
    allow_root: bool,
) -> Result<Vec<OsString>, ExtractError> {
    let mut out = Vec::new();
    for component in Path::new(path).components() {
        match component {
            Component::RootDir | Component::CurDir => {}
            Component::Normal(name) => out.push(name.to_os_string()),
            Component::ParentDir | Component::Prefix(_) => {
                return Err(ExtractError::InvalidSelection(format!(
                    "{what} {path:?} must not contain `..`"
                )));
            }
        }
    }
    if out.is_empty() && !allow_root {
        return Err(ExtractError::InvalidSelection(format!(
            "{what} {path:?} must name a directory below /"
        )));
    }
    Ok(out)
}

/// Why an image was refused.
#[derive(Debug, thiserror::Error)]
pub enum ExtractError {
    #[error("layer {layer}: entry {path:?} has an absolute path; refused")]
    AbsolutePath { layer: usize, path: String },
    #[error("layer {layer}: entry {path:?} contains `..`; refused")]
    ParentTraversal { layer: usize, path: String },
    #[error(
        "layer {layer}: symbolic link {path:?} -> {target:?} resolves outside the extracted directories; refused"
    )]
    SymlinkEscape {
        layer: usize,
        path: String,
        target: String,
    },
    #[error(
        "layer {layer}: hard link {path:?} -> {target:?} does not name a file extracted inside the root; refused"
    )]
    HardLinkEscape {
        layer: usize,
        path: String,
        target: String,
    },
    #[error("layer {layer}: entry {path:?} resolves outside the extracted directories; refused")]
    PathEscape { layer: usize, path: String },
    #[error("layer {layer}: file {path:?} is {size} bytes, over the per-file limit of {limit}")]
    FileTooLarge {
        layer: usize,
        path: String,
        size: u64,
        limit: u64,
    },
    #[error(
        "layer {layer}: file {path:?} takes the image over the per-image limit of {limit} bytes"
    )]
    ImageTooLarge {
        layer: usize,
        path: String,
        limit: u64,
    },
    #[error("layer {layer} decompresses to more than {limit} bytes; refused")]
    LayerTooLarge { layer: usize, limit: u64 },
    #[error("layer {layer}: more than {limit} entries to extract")]
    TooManyEntries { layer: usize, limit: u64 },
    #[error(
        "layer {layer}: entry {path:?} is a {kind}, which a module directory never holds; refused"
    )]
    UnsupportedEntry {
        layer: usize,
        path: String,
        kind: String,
    },
    #[error("layer {layer}: {path:?} needs a directory where the image has a file")]
    NotADirectory { layer: usize, path: String },
    #[error("layer {layer}: too many levels of symbolic links resolving {path:?}")]
    LinkLoop { layer: usize, path: String },
    #[error("unsupported layer media type {0:?}")]
    UnsupportedMediaType(String),
    #[error("layer {layer} is corrupt: {source}")]
    Corrupt {
        layer: usize,
        #[source]
        source: io::Error,
    },
    #[error("invalid extraction settings: {0}")]
    InvalidSelection(String),
    #[error("{action} {path}: {source}")]
    Io {
        action: &'static str,
        path: PathBuf,
        #[source]
        source: io::Error,
    },
}

impl ExtractError {
    /// True when the image itself is at fault (hostile, corrupt or too large), as
    /// opposed to a local I/O failure.
    pub fn is_image_fault(&self) -> bool {
        !matches!(self, Self::Io { .. } | Self::InvalidSelection(_))
    }
}

impl From<LayerError> for ExtractError {
    fn from(error: LayerError) -> Self {
        match error {
            LayerError::Corrupt { layer, source } => Self::Corrupt { layer, source },
            LayerError::TooLarge { layer, limit } => Self::LayerTooLarge { layer, limit },
            LayerError::AbsolutePath { layer, path } => Self::AbsolutePath { layer, path },
            LayerError::ParentTraversal { layer, path } => Self::ParentTraversal { layer, path },
        }
    }
}

/// What was extracted.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Report {
    /// Regular files written (hard links included).
    pub files: u64,
    /// Bytes of regular files written.
    pub bytes: u64,
    /// Entries skipped because they lie outside the extracted directories.
    pub skipped: u64,
}

/// Extracts `layers` (bottom first) into `dest`, which must not exist; on error `dest`
/// is removed and nothing is left behind.
pub fn extract_image<R: Read>(
    layers: impl IntoIterator<Item = Layer<R>>,
    selection: &Selection,
    limits: &Limits,
    dest: &Path,
) -> Result<Report, ExtractError> {
    fs::create_dir(dest).map_err(|source| ExtractError::Io {
        action: "creating",
        path: dest.to_path_buf(),
        source,
    })?;
    let result = extract_into(layers, selection, limits, dest);
    if result.is_err() {
        let _ = fs::remove_dir_all(dest);
    }
    result
}

/// Extracts into the existing, empty directory `root`. On error, `root` holds a
/// partial extraction (inside it only) that the caller must discard.
pub fn extract_into<R: Read>(
    layers: impl IntoIterator<Item = Layer<R>>,
    selection: &Selection,
    limits: &Limits,
    root: &Path,
) -> Result<Report, ExtractError> {
    let allowed = selection.allowed()?;
    let host_link = selection.host_modules.as_ref().map(|host| HostLink {
        // The kernel's module directory: the first allowed directory.
        modules_dir: allowed[0].clone(),
        kernel: selection.kernel.clone().into(),
        on_disk: host.join(&selection.kernel),
    });
    let mut extractor = Extractor {
        root: root.to_path_buf(),
        allowed,
        host_link,
        limits: *limits,
        nodes: BTreeMap::new(),
        report: Report::default(),
        entries: 0,
    };
    layers::walk(layers, limits.max_layer_read_bytes, |entry| {
        extractor.entry(entry)
    })?;
    Ok(extractor.report)
}

type Rel = Vec<OsString>;

#[derive(Clone, Debug, PartialEq, Eq)]
enum Node {
    Dir,
    File,
    /// The link's target as found in the image: absolute flag and components.
    Symlink {
        absolute: bool,
        target: Rel,
    },
    /// The in-tree dependency link to the host's module tree: never resolved through.
    HostModules,
}

/// Where the in-tree dependency link may be, and what it is written as.
struct HostLink {
    modules_dir: Rel,
    kernel: OsString,
    on_disk: PathBuf,
}

impl HostLink {
    /// Whether a link at `real` to `target` is upstream's in-tree dependency link:
    /// directly in the kernel's module directory, to that kernel's host module tree.
    fn admits(&self, real: &[OsString], target: &Path) -> bool {
        let (_, parent) = real.split_last().expect("non-empty");
        let mut components = Vec::new();
        for component in target.components() {
            match component {
                Component::RootDir => {}
                Component::Normal(name) => components.push(name),
                // `..`, `.`: only the plain path upstream documents.
                _ => return false,
            }
        }
        let host_tree = |prefix: &[&str]| {
            components.len() == prefix.len() + 1
                && components
                    .iter()
                    .zip(prefix)
                    .all(|(c, p)| *c == OsStr::new(p))
                && components[prefix.len()] == self.kernel.as_os_str()
        };
        parent == self.modules_dir.as_slice()
            && target.has_root()
            && (host_tree(&["lib", "modules"]) || host_tree(&["usr", "lib", "modules"]))
    }
}

#[derive(Debug)]
struct Tracked {
    node: Node,
    layer: usize,
}

struct Extractor {
    root: PathBuf,
    allowed: Vec<Rel>,
    host_link: Option<HostLink>,
    limits: Limits,
    /// Everything written so far, by real (symlink-free) relative path.
    nodes: BTreeMap<Rel, Tracked>,
    report: Report,
    entries: u64,
}

const MAX_LINK_HOPS: usize = 40;
const WHITEOUT_PREFIX: &str = ".wh.";
const OPAQUE_WHITEOUT: &str = ".wh..wh..opq";

fn display(rel: &[OsString]) -> String {
    let joined: PathBuf = rel.iter().collect();
    joined.display().to_string()
}

fn os_string(bytes: &[u8]) -> OsString {
    OsStr::from_bytes(bytes).to_os_string()
}

fn io_err(action: &'static str, path: PathBuf) -> impl FnOnce(io::Error) -> ExtractError {
    move |source| ExtractError::Io {
        action,
        path,
        source,
    }
}

impl Extractor {
    fn entry(&mut self, mut entry: Entry<'_, '_>) -> Result<(), ExtractError> {
        let layer = entry.layer();
        let path = entry.path()?;
        let shown = path.to_string();
        let rel: Rel = path.components().iter().map(|c| os_string(c)).collect();
        let Some(name) = rel.last().cloned() else {
            return Ok(()); // "./": the root itself
        };
        let parent = &rel[..rel.len() - 1];

        // Whiteouts remove what earlier layers wrote.
        if name == OsStr::new(OPAQUE_WHITEOUT) {
            if self.relevant(parent) {
                self.opaque(layer, parent)?;
            }
            return Ok(());
        }
        if let Some(hidden) = name.as_bytes().strip_prefix(WHITEOUT_PREFIX.as_bytes()) {
            let mut target = parent.to_vec();
            target.push(OsStr::from_bytes(hidden).to_os_string());
            if self.relevant(&target) {
                self.whiteout(layer, &target)?;
            }
            return Ok(());
        }

        let kind = entry.kind();
        if !self.within_allowed(&rel) {
            // Directories leading to the allowed ones are created on demand; anything
            // else outside them is not extracted at all.
            self.report.skipped += 1;
            return Ok(());
        }
        self.count_entry(layer)?;
        match kind {
            tar::EntryType::Directory => {
                let real = self.resolve_parent(layer, &rel, &shown)?;
                self.make_dir(layer, &real, &shown)
            }
            tar::EntryType::Regular | tar::EntryType::Continuous => {
                self.check_size(layer, &shown, entry.size())?;
                let real = self.resolve_parent(layer, &rel, &shown)?;
                let mode = entry.mode()?;
                self.write_file(layer, &real, &shown, &mut entry, mode)
            }
            tar::EntryType::Symlink => {
                let target = os_string(&entry.link_name());
                let real = self.resolve_parent(layer, &rel, &shown)?;
                self.symlink(layer, &real, &shown, Path::new(&target))
            }
            tar::EntryType::Link => {
                let target = os_string(&entry.link_name());
                let real = self.resolve_parent(layer, &rel, &shown)?;
                self.hard_link(layer, &real, &shown, Path::new(&target))
            }
            other => Err(ExtractError::UnsupportedEntry {
                layer,
                path: shown,
                kind: format!("{other:?}"),
            }),
        }
    }

    fn count_entry(&mut self, layer: usize) -> Result<(), ExtractError> {
        self.entries += 1;
        if self.entries > self.limits.max_entries {
            return Err(ExtractError::TooManyEntries {
                layer,
                limit: self.limits.max_entries,
            });
        }
        Ok(())
    }

    fn check_size(&self, layer: usize, shown: &str, size: u64) -> Result<(), ExtractError> {
        if size > self.limits.max_file_bytes {
            return Err(ExtractError::FileTooLarge {
                layer,
                path: shown.to_string(),
                size,
                limit: self.limits.max_file_bytes,
            });
        }
        if self.report.bytes.saturating_add(size) > self.limits.max_image_bytes {
            return Err(ExtractError::ImageTooLarge {
                layer,
                path: shown.to_string(),
                limit: self.limits.max_image_bytes,
            });
        }
        Ok(())
    }

    /// Inside (or equal to) one of the allowed directories.
    fn within_allowed(&self, rel: &[OsString]) -> bool {
        self.allowed.iter().any(|prefix| rel.starts_with(prefix))
    }

    /// Inside an allowed directory or on the way to one (whiteouts there matter).
    fn relevant(&self, rel: &[OsString]) -> bool {
        self.allowed
            .iter()
            .any(|prefix| rel.starts_with(prefix) || prefix.starts_with(rel))
    }

    /// Resolves `path` (relative to the root, possibly through extracted links) to a
    /// real relative path; `follow_last` follows a link in the last component.
    fn resolve(
        &self,
        layer: usize,
        path: &[OsString],
        follow_last: bool,
        shown: &str,
    ) -> Result<Option<Rel>, ExtractError> {
        let mut pending: Vec<OsString> = path.iter().rev().cloned().collect();
        let mut real: Rel = Vec::new();
        let mut hops = 0;
        while let Some(component) = pending.pop() {
            if component == OsStr::new("..") {
                if real.pop().is_none() {
                    return Ok(None);
                }
                continue;
            }
            if component == OsStr::new(".") || component.is_empty() {
                continue;
            }
            real.push(component);
            let is_last = pending.is_empty();
            if let Some(Tracked {
                node: Node::HostModules,
                ..
            }) = self.nodes.get(&real)
                && (!is_last || follow_last)
            {
                // The host's module tree is outside the root: nothing goes through it.
                return Ok(None);
            }
            if let Some(Tracked {
                node: Node::Symlink { absolute, target },
                ..
            }) = self.nodes.get(&real)
                && (!is_last || follow_last)
            {
                hops += 1;
                if hops > MAX_LINK_HOPS {
                    return Err(ExtractError::LinkLoop {
                        layer,
                        path: shown.to_string(),
                    });
                }
                real.pop();
                if *absolute {
                    real.clear();
                }
                pending.extend(target.iter().rev().cloned());
            }
        }
        Ok(Some(real))
    }

    /// Resolves the parent directory of `rel` and appends its name; the result must
    /// still lie inside an allowed directory.
    fn resolve_parent(
        &self,
        layer: usize,
        rel: &[OsString],
        shown: &str,
    ) -> Result<Rel, ExtractError> {
        let (name, parent) = rel.split_last().expect("non-empty");
        let escape = || ExtractError::PathEscape {
            layer,
            path: shown.to_string(),
        };
        let mut real = self
            .resolve(layer, parent, true, shown)?
            .ok_or_else(escape)?;
        real.push(name.clone());
        if !self.within_allowed(&real) {
            return Err(escape());
        }
        Ok(real)
    }

    fn path_of(&self, rel: &[OsString]) -> PathBuf {
        let mut path = self.root.clone();
        path.extend(rel);
        path
    }

    /// Creates the real directories leading to `real` (exclusive).
    fn make_parents(
        &mut self,
        layer: usize,
        real: &[OsString],
        shown: &str,
    ) -> Result<(), ExtractError> {
        for depth in 1..real.len() {
            let prefix = &real[..depth];
            match self.nodes.get(prefix).map(|t| &t.node) {
                Some(Node::Dir) => {}
                Some(_) => {
                    return Err(ExtractError::NotADirectory {
                        layer,
                        path: shown.to_string(),
                    });
                }
                None => {
                    let path = self.path_of(prefix);
                    fs::create_dir(&path).map_err(io_err("creating", path))?;
                    self.nodes.insert(
                        prefix.to_vec(),
                        Tracked {
                            node: Node::Dir,
                            layer,
                        },
                    );
                }
            }
        }
        Ok(())
    }

    /// Removes whatever exists at `real` (never following a link).
    fn remove(&mut self, real: &[OsString]) -> Result<(), ExtractError> {
        let Some(tracked) = self.nodes.remove(real) else {
            return Ok(());
        };
        let path = self.path_of(real);
        if tracked.node == Node::Dir {
            let below: Vec<Rel> = self
                .nodes
                .range(real.to_vec()..)
                .take_while(|(k, _)| k.starts_with(real))
                .map(|(k, _)| k.clone())
                .collect();
            for key in below {
                self.nodes.remove(&key);
            }
            fs::remove_dir_all(&path).map_err(io_err("removing", path))
        } else {
            fs::remove_file(&path).map_err(io_err("removing", path))
        }
    }

    fn make_dir(
        &mut self,
        layer: usize,
        real: &[OsString],
        shown: &str,
    ) -> Result<(), ExtractError> {
        self.make_parents(layer, real, shown)?;
        match self.nodes.get(real).map(|t| &t.node) {
            Some(Node::Dir) => return Ok(()),
            Some(_) => self.remove(real)?,
            None => {}
        }
        let path = self.path_of(real);
        fs::create_dir(&path).map_err(io_err("creating", path))?;
        self.nodes.insert(
            real.to_vec(),
            Tracked {
                node: Node::Dir,
                layer,
            },
        );
        Ok(())
    }

    fn write_file(
        &mut self,
        layer: usize,
        real: &[OsString],
        shown: &str,
        entry: &mut Entry<'_, '_>,
        mode: u32,
    ) -> Result<(), ExtractError> {
        self.make_parents(layer, real, shown)?;
        self.remove(real)?;
        let path = self.path_of(real);
        let mut file = fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .custom_flags(libc::O_NOFOLLOW)
            .mode(0o600)
            .open(&path)
            .map_err(io_err("creating", path.clone()))?;
        entry.copy_to(shown, &mut file)?;
        // Keep the permission bits only: never set-user-ID, set-group-ID or sticky.
        let mode = (mode & 0o755) | 0o400;
        fs::set_permissions(&path, fs::Permissions::from_mode(mode))
            .map_err(io_err("setting permissions of", path))?;
        self.record_file(layer, real, entry.size());
        Ok(())
    }

    /// Tracks a regular file written at `real` (by content or as a hard link) and counts it.
    fn record_file(&mut self, layer: usize, real: &[OsString], size: u64) {
        self.nodes.insert(
            real.to_vec(),
            Tracked {
                node: Node::File,
                layer,
            },
        );
        self.report.files += 1;
        self.report.bytes += size;
    }

    fn symlink(
        &mut self,
        layer: usize,
        real: &[OsString],
        shown: &str,
        target: &Path,
    ) -> Result<(), ExtractError> {
        let escape = || ExtractError::SymlinkEscape {
            layer,
            path: shown.to_string(),
            target: target.display().to_string(),
        };
        let absolute = target.has_root();
        let target_components: Rel = target
            .components()
            .filter_map(|c| match c {
                Component::Normal(n) => Some(n.to_os_string()),
                Component::ParentDir => Some("..".into()),
                _ => None,
            })
            .collect();
        if target_components.is_empty() {
            return Err(escape());
        }
        if let Some(host) = &self.host_link
            && host.admits(real, target)
        {
            let on_disk = host.on_disk.clone();
            return self.host_modules_link(layer, real, shown, &on_disk);
        }
        // Where the link points to, resolved like the kernel would inside the root.
        let (_, parent) = real.split_last().expect("non-empty");
        let mut from: Rel = if absolute {
            Vec::new()
        } else {
            parent.to_vec()
        };
        from.extend(target_components.iter().cloned());
        let resolved = self
            .resolve(layer, &from, true, shown)?
            .ok_or_else(escape)?;
        if !self.within_allowed(&resolved) || resolved == real {
            return Err(escape());
        }
        self.make_parents(layer, real, shown)?;
        self.remove(real)?;
        // On disk the link climbs to the root and descends to the resolved target,
        // so the kernel never resolves it against the host's root.
        let mut on_disk = PathBuf::new();
        for _ in 0..parent.len() {
            on_disk.push("..");
        }
        on_disk.extend(&resolved);
        let path = self.path_of(real);
        std::os::unix::fs::symlink(&on_disk, &path).map_err(io_err("creating link", path))?;
        self.nodes.insert(
            real.to_vec(),
            Tracked {
                node: Node::Symlink {
                    absolute: true,
                    target: resolved,
                },
                layer,
            },
        );
        Ok(())
    }

    /// Writes the in-tree dependency link, absolute, to the host's module tree.
    fn host_modules_link(
        &mut self,
        layer: usize,
        real: &[OsString],
        shown: &str,
        on_disk: &Path,
    ) -> Result<(), ExtractError> {
        self.make_parents(layer, real, shown)?;
        self.remove(real)?;
        let path = self.path_of(real);
        std::os::unix::fs::symlink(on_disk, &path).map_err(io_err("creating link", path))?;
        self.nodes.insert(
            real.to_vec(),
            Tracked {
                node: Node::HostModules,
                layer,
            },
        );
        Ok(())
    }

    fn hard_link(
        &mut self,
        layer: usize,
        real: &[OsString],
        shown: &str,
        target: &Path,
    ) -> Result<(), ExtractError> {
        let escape = || ExtractError::HardLinkEscape {
            layer,
            path: shown.to_string(),
            target: target.display().to_string(),
        };
        // Hard-link names are archive paths: relative to the root, never absolute.
        let target_rel: Rel = archive_components(target.as_os_str().as_bytes())
            .map_err(|_| escape())?
            .iter()
            .map(|c| os_string(c))
            .collect();
        let resolved = self
            .resolve(layer, &target_rel, true, shown)?
            .ok_or_else(escape)?;
        if !self.within_allowed(&resolved)
            || self.nodes.get(&resolved).map(|t| &t.node) != Some(&Node::File)
            || resolved == real
        {
            return Err(escape());
        }
        let size = fs::symlink_metadata(self.path_of(&resolved))
            .map_err(io_err("inspecting", self.path_of(&resolved)))?
            .len();
        self.check_size(layer, shown, size)?;
        self.make_parents(layer, real, shown)?;
        self.remove(real)?;
        let path = self.path_of(real);
        fs::hard_link(self.path_of(&resolved), &path).map_err(io_err("linking", path))?;
        self.record_file(layer, real, size);
        Ok(())
    }

    /// `.wh.<name>`: removes `<name>` as written by earlier layers.
    fn whiteout(&mut self, layer: usize, rel: &[OsString]) -> Result<(), ExtractError> {
        let shown = display(rel);
        let (name, parent) = rel.split_last().expect("non-empty");
        let Some(mut real) = self.resolve(layer, parent, true, &shown)? else {
            return Err(ExtractError::PathEscape { layer, path: shown });
        };
        real.push(name.clone());
        if self.nodes.get(&real).is_some_and(|t| t.layer < layer) {
            self.remove(&real)?;
        }
        Ok(())
    }

    /// `.wh..wh..opq`: empties a directory of what earlier layers wrote in it.
    fn opaque(&mut self, layer: usize, dir: &[OsString]) -> Result<(), ExtractError> {
        let shown = display(dir);
        let Some(real) = self.resolve(layer, dir, true, &shown)? else {
            return Err(ExtractError::PathEscape { layer, path: shown });
        };
        let children: Vec<Rel> = self
            .nodes
            .range(real.clone()..)
            .take_while(|(k, _)| k.starts_with(&real))
            .filter(|(k, t)| k.len() == real.len() + 1 && t.layer < layer)
            .map(|(k, _)| k.clone())
            .collect();
        for child in children {
            self.remove(&child)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;
