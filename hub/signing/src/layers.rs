//! Signing the files an image lists (`filesToSign`) into one new layer.
//!
//! The layers are read once, in order, into an in-memory view of the flattened image:
//! every entry's path and kind (so that links and whiteouts resolve as a container
//! runtime would), and the content of the files that may be signed. Later layers win;
//! `.wh.<name>` and `.wh..wh..opq` remove what earlier layers wrote.
//!
//! A listed path is resolved through the image's symbolic links, inside the image (an
//! absolute target starts at the image's root and `..` never climbs above it), the way
//! `COPY --from` resolves a source path. Debian-based images, for one, have `/lib` as a
//! link to `usr/lib`, so `/lib/modules/...` is really `/usr/lib/modules/...`. The
//! signed file is written at the resolved path, so the new layer replaces the file
//! itself and leaves the links as they are. Hard links and other non-regular files are
//! refused.
//!
//! Since the layers stream by once, a file's content is kept when its name is the name
//! of a listed file (which covers every link to a directory on the way) or when a
//! listed path resolves to it when it is read. Only a link to the file itself that a
//! later entry adds, under another name, escapes both, and it is reported
//! ([`SignError::LinkedAfterWrite`]), naming the path to list instead.
//!
//! The layers are read through `kmm_extract::walk`, the node agent's own: it decodes
//! each layer and refuses entries with absolute or `..` paths.

use std::collections::{BTreeMap, BTreeSet};
use std::ffi::OsStr;
use std::io::{Read, Write};
use std::os::unix::ffi::OsStrExt;

use flate2::write::GzEncoder;
use kmm_extract::{Entry, Layer};

use crate::SigningKey;
use crate::module::{HashAlgorithm, SignError, sign_module};

/// The media type of the layer [`sign_files_in_layers`] produces.
pub const LAYER_MEDIA_TYPE: &str = "application/vnd.oci.image.layer.v1.tar+gzip";

/// Bounds on the work and memory a hostile or broken image can cause.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Largest file to sign, in bytes.
    pub max_file_bytes: u64,
    /// Largest total of file contents kept in memory while reading the layers (the
    /// files to sign, and files of the same names in other directories).
    pub max_read_bytes: u64,
    /// Most entries over all layers (each one's path is kept until the end).
    pub max_entries: u64,
    /// Most bytes read from one decompressed layer (a bound on a decompression bomb).
    pub max_layer_bytes: u64,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_file_bytes: 256 << 20,
            max_read_bytes: 1 << 30,
            max_entries: 1_000_000,
            max_layer_bytes: 8 << 30,
        }
    }
}

/// One file of the signed layer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SignedFile {
    /// The path as listed in `filesToSign`.
    pub path: String,
    /// Where the signed file is in the image: `path` with its links resolved.
    pub stored_at: String,
}

/// The layer that holds the signed files, to push on top of the unsigned image.
#[derive(Clone, PartialEq, Eq)]
pub struct SignedLayer {
    /// The gzip-compressed tar ([`LAYER_MEDIA_TYPE`]).
    pub blob: Vec<u8>,
    /// `sha256:<hex>` of `blob`: the layer's digest in the manifest.
    pub digest: String,
    /// `sha256:<hex>` of the uncompressed tar: the layer's `diff_id` in the config.
    pub diff_id: String,
    /// One per distinct listed path, in the order listed.
    pub files: Vec<SignedFile>,
}

impl std::fmt::Debug for SignedLayer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SignedLayer")
            .field("blob", &format_args!("<{} bytes>", self.blob.len()))
            .field("digest", &self.digest)
            .field("diff_id", &self.diff_id)
            .field("files", &self.files)
            .finish()
    }
}

/// Reads `files_to_sign` (absolute paths in the image, or glob patterns such as
/// `/opt/lib/modules/6.1.0-47-amd64/extra/*.ko`, each of which must match at least one
/// regular file) from `layers` (bottom first), signs each with `key`, and returns one
/// layer that holds the signed files at their
/// paths with their modes. The layer is deterministic: entries sorted by path, zero
/// mtime, uid and gid, no directory entries (the directories exist below it).
///
/// CPU-bound and blocking (decompression, hashing, RSA): async callers run it on a
/// blocking thread.
pub fn sign_files_in_layers<R: Read>(
    layers: impl IntoIterator<Item = Layer<R>>,
    files_to_sign: &[String],
    key: &SigningKey,
    hash: HashAlgorithm,
    limits: &Limits,
) -> Result<SignedLayer, SignError> {
    let (listed, patterns) = listed_paths(files_to_sign)?;
    let mut image = Image::new(&listed, &patterns, limits);
    kmm_extract::walk(layers, limits.max_layer_bytes, |entry| image.entry(entry))?;
    let matched = image.matches(&patterns)?;
    let all: Vec<&Listed> = listed
        .iter()
        .chain(
            matched
                .iter()
                .filter(|m| !listed.iter().any(|l| l.path == m.path)),
        )
        .collect();

    // Each real file once, whichever listed paths lead to it.
    let mut files = Vec::with_capacity(all.len());
    let mut to_sign: BTreeMap<Vec<u8>, (&str, u32, &[u8])> = BTreeMap::new();
    for Listed { path, components } in all {
        let real = image
            .resolve(components, true)
            .ok_or_else(|| SignError::LinkLoop { path: path.clone() })?;
        let stored_at = format!("/{}", String::from_utf8_lossy(&real));
        let (mode, data) = match image.nodes.get(&real).map(|n| &n.kind) {
            // Directories need no entry of their own: files below them imply them.
            None if image.has_below(&real) => {
                return Err(SignError::NotARegularFile {
                    path: path.clone(),
                    kind: Kind::Dir.name(),
                });
            }
            None => return Err(SignError::FileNotInImage { path: path.clone() }),
            Some(Kind::File {
                mode,
                data: Some(data),
            }) => (*mode, data.as_slice()),
            Some(Kind::File { data: None, .. }) => {
                return Err(SignError::LinkedAfterWrite {
                    path: path.clone(),
                    stored_at,
                });
            }
            Some(other) => {
                return Err(SignError::NotARegularFile {
                    path: path.clone(),
                    kind: other.name(),
                });
            }
        };
        to_sign.entry(real).or_insert((path.as_str(), mode, data));
        files.push(SignedFile {
            path: path.clone(),
            stored_at,
        });
    }

    let mut tar = tar::Builder::new(Vec::new());
    for (real, (path, mode, data)) in &to_sign {
        let signed = sign_module(path, data, key, hash)?;
        let mut header = tar::Header::new_gnu();
        header.set_entry_type(tar::EntryType::Regular);
        header.set_mode(*mode);
        header.set_uid(0);
        header.set_gid(0);
        header.set_mtime(0);
        header.set_size(signed.len() as u64);
        tar.append_data(&mut header, OsStr::from_bytes(real), signed.as_slice())
            .map_err(SignError::Write)?;
    }
    let tar = tar.into_inner().map_err(SignError::Write)?;
    // flate2 writes a zero mtime and no file name in the gzip header: the same files
    // always give the same blob, and so the same digest.
    let mut gzip = GzEncoder::new(Vec::new(), flate2::Compression::default());
    gzip.write_all(&tar).map_err(SignError::Write)?;
    let blob = gzip.finish().map_err(SignError::Write)?;
    Ok(SignedLayer {
        digest: sha256_digest(&blob),
        diff_id: sha256_digest(&tar),
        blob,
        files,
    })
}

fn sha256_digest(data: &[u8]) -> String {
    let hex: String = openssl::sha::sha256(data)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    format!("sha256:{hex}")
}

/// A `filesToSign` entry and its components.
struct Listed {
    path: String,
    components: Vec<Vec<u8>>,
}

/// A `filesToSign` glob.
struct Pattern {
    text: String,
    glob: glob::Pattern,
}

/// `*` and `?` stay within one path component, as a shell's (and upstream's) globs do.
const GLOB_OPTIONS: glob::MatchOptions = glob::MatchOptions {
    case_sensitive: true,
    require_literal_separator: true,
    require_literal_leading_dot: false,
};

fn is_glob(path: &str) -> bool {
    path.contains(['*', '?', '['])
}

/// Each distinct listed path (absolute, no `..`, not the root), and the globs.
fn listed_paths(files_to_sign: &[String]) -> Result<(Vec<Listed>, Vec<Pattern>), SignError> {
    if files_to_sign.is_empty() {
        return Err(SignError::NothingToSign);
    }
    let mut seen = BTreeSet::new();
    let mut out = Vec::new();
    let mut patterns = Vec::new();
    for path in files_to_sign {
        let invalid = |reason| SignError::InvalidPath {
            path: path.clone(),
            reason,
        };
        let Some(rest) = path.strip_prefix('/') else {
            return Err(invalid("is not absolute"));
        };
        let mut components = Vec::new();
        for component in rest.split('/') {
            match component {
                "" | "." => {}
                ".." => return Err(invalid("contains `..`")),
                name => components.push(name.as_bytes().to_vec()),
            }
        }
        if components.is_empty() {
            return Err(invalid("names no file"));
        }
        if !seen.insert(path.as_str()) {
            continue;
        }
        if is_glob(path) {
            let glob = glob::Pattern::new(path).map_err(|_| invalid("is not a valid glob"))?;
            patterns.push(Pattern {
                text: path.clone(),
                glob,
            });
        } else {
            out.push(Listed {
                path: path.clone(),
                components,
            });
        }
    }
    Ok((out, patterns))
}

fn matches_any(patterns: &[Pattern], path: &[u8]) -> bool {
    let path = format!("/{}", String::from_utf8_lossy(path));
    patterns
        .iter()
        .any(|p| p.glob.matches_with(&path, GLOB_OPTIONS))
}

const WHITEOUT_PREFIX: &[u8] = b".wh.";
const OPAQUE_WHITEOUT: &[u8] = b".wh..wh..opq";
const MAX_LINK_HOPS: usize = 40;

#[derive(Debug)]
enum Kind {
    Dir,
    /// A regular file; `data` when its content was kept.
    File {
        mode: u32,
        data: Option<Vec<u8>>,
    },
    /// The target as the image has it (absolute or relative).
    Symlink(Vec<u8>),
    HardLink,
    Other,
}

impl Kind {
    fn name(&self) -> &'static str {
        match self {
            Self::Dir => "directory",
            Self::File { .. } => "regular file",
            Self::Symlink(_) => "symbolic link",
            Self::HardLink => "hard link",
            Self::Other => "device, FIFO or other special file",
        }
    }
}

#[derive(Debug)]
struct Node {
    kind: Kind,
    layer: usize,
}

/// The flattened image seen so far. Paths are relative to the root, components joined
/// by `/` (the root itself is empty).
struct Image<'a> {
    listed: &'a [Listed],
    /// A file whose path one of these matches is kept too.
    patterns: &'a [Pattern],
    /// The names of the listed files: a file of one of these names is kept.
    names: BTreeSet<&'a [u8]>,
    limits: &'a Limits,
    nodes: BTreeMap<Vec<u8>, Node>,
    /// Where the listed paths resolve to with the links as they are now; `None` after
    /// a link changed, until the next file asks.
    resolved: Option<BTreeSet<Vec<u8>>>,
    entries: u64,
    read_bytes: u64,
}

impl<'a> Image<'a> {
    fn new(listed: &'a [Listed], patterns: &'a [Pattern], limits: &'a Limits) -> Self {
        let names = listed
            .iter()
            .filter_map(|l| l.components.last().map(Vec::as_slice))
            .collect();
        Self {
            listed,
            patterns,
            names,
            limits,
            nodes: BTreeMap::new(),
            resolved: None,
            entries: 0,
            read_bytes: 0,
        }
    }

    fn entry(&mut self, mut entry: Entry<'_, '_>) -> Result<(), SignError> {
        let kind = entry.kind();
        if kind == tar::EntryType::XGlobalHeader {
            return Ok(());
        }
        self.entries += 1;
        if self.entries > self.limits.max_entries {
            return Err(SignError::TooManyEntries {
                limit: self.limits.max_entries,
            });
        }
        let layer = entry.layer();
        let entry_path = entry.path()?;
        let Some((name, parent)) = entry_path.components().split_last() else {
            return Ok(()); // "./": the root itself
        };
        let parent = self
            .resolve(parent, true)
            .ok_or_else(|| SignError::UnsafeEntry {
                layer,
                entry: entry_path.to_string(),
                reason: "lies under a link loop",
            })?;

        if name == OPAQUE_WHITEOUT {
            // Hides everything earlier layers put below the directory.
            self.remove_tree(&parent, false, layer);
            return Ok(());
        }
        if let Some(hidden) = name.strip_prefix(WHITEOUT_PREFIX) {
            self.remove_tree(&join(&parent, hidden), true, layer);
            return Ok(());
        }

        let path = join(&parent, name);
        let kind = match kind {
            tar::EntryType::Directory => {
                if let Some(
                    node @ Node {
                        kind: Kind::Dir, ..
                    },
                ) = self.nodes.get_mut(&path)
                {
                    // This layer declares the directory too: an opaque whiteout above
                    // it in this layer hides what lower layers put there, not it.
                    node.layer = layer;
                    return Ok(());
                }
                Kind::Dir
            }
            tar::EntryType::Regular | tar::EntryType::Continuous => Kind::File {
                mode: entry.mode()?,
                data: None,
            },
            tar::EntryType::Symlink => Kind::Symlink(entry.link_name()),
            tar::EntryType::Link => Kind::HardLink,
            _ => Kind::Other,
        };
        if matches!(kind, Kind::Dir) {
            // Replaces a file or link, but keeps what is below it: entries may come
            // before their directory's, or without one.
            if self.nodes.remove(&path).is_some() {
                self.resolved = None;
            }
        } else {
            self.remove_tree(&path, true, usize::MAX);
        }
        let is_file = matches!(kind, Kind::File { .. });
        if matches!(kind, Kind::Symlink(_)) {
            self.resolved = None;
        }
        self.nodes.insert(path.clone(), Node { kind, layer });
        if is_file && self.keep(&path, name) {
            let data = self.read(&path, &mut entry)?;
            if let Some(Node {
                kind: Kind::File { data: slot, .. },
                ..
            }) = self.nodes.get_mut(&path)
            {
                *slot = Some(data);
            }
        }
        Ok(())
    }

    /// Whether the file just written at `path` may be one to sign.
    fn keep(&mut self, path: &[u8], name: &[u8]) -> bool {
        if self.names.contains(name) || matches_any(self.patterns, path) {
            return true;
        }
        if self.resolved.is_none() {
            let resolved = self
                .listed
                .iter()
                .filter_map(|l| self.resolve(&l.components, true))
                .collect();
            self.resolved = Some(resolved);
        }
        self.resolved.as_ref().is_some_and(|r| r.contains(path))
    }

    /// The regular files of the finished image each pattern matches, in path order;
    /// a pattern that matches none is refused.
    fn matches(&self, patterns: &[Pattern]) -> Result<Vec<Listed>, SignError> {
        let mut out = Vec::new();
        for pattern in patterns {
            let found: Vec<Listed> = self
                .nodes
                .iter()
                .filter(|(path, node)| {
                    matches!(node.kind, Kind::File { data: Some(_), .. })
                        && pattern.glob.matches_with(
                            &format!("/{}", String::from_utf8_lossy(path)),
                            GLOB_OPTIONS,
                        )
                })
                .map(|(path, _)| Listed {
                    path: format!("/{}", String::from_utf8_lossy(path)),
                    components: path.split(|b| *b == b'/').map(<[u8]>::to_vec).collect(),
                })
                .collect();
            if found.is_empty() {
                return Err(SignError::NoFileMatches {
                    pattern: pattern.text.clone(),
                });
            }
            out.extend(found);
        }
        Ok(out)
    }

    fn read(&mut self, path: &[u8], entry: &mut Entry<'_, '_>) -> Result<Vec<u8>, SignError> {
        let size = entry.size();
        if size > self.limits.max_file_bytes {
            return Err(SignError::FileTooLarge {
                path: format!("/{}", String::from_utf8_lossy(path)),
                size,
                limit: self.limits.max_file_bytes,
            });
        }
        self.read_bytes += size;
        if self.read_bytes > self.limits.max_read_bytes {
            return Err(SignError::TooMuchToRead {
                limit: self.limits.max_read_bytes,
            });
        }
        let mut data = Vec::with_capacity(size as usize);
        entry.copy_to(&String::from_utf8_lossy(path), &mut data)?;
        Ok(data)
    }

    /// `path` with the image's links resolved; `follow_last` follows a link in the last
    /// component. `None` on a loop.
    fn resolve<C: AsRef<[u8]>>(&self, path: &[C], follow_last: bool) -> Option<Vec<u8>> {
        let mut pending: Vec<Vec<u8>> = path.iter().rev().map(|c| c.as_ref().to_vec()).collect();
        let mut real: Vec<u8> = Vec::new();
        let mut hops = 0;
        while let Some(component) = pending.pop() {
            match component.as_slice() {
                b"" | b"." => continue,
                // Inside the image: `..` at the root stays at the root.
                b".." => {
                    let parent = real.iter().rposition(|&b| b == b'/').unwrap_or(0);
                    real.truncate(parent);
                    continue;
                }
                _ => {}
            }
            let before = real.len();
            real = join(&real, &component);
            let is_last = pending.is_empty();
            if let Some(Node {
                kind: Kind::Symlink(target),
                ..
            }) = self.nodes.get(&real)
                && (follow_last || !is_last)
            {
                hops += 1;
                if hops > MAX_LINK_HOPS {
                    return None;
                }
                real.truncate(if target.starts_with(b"/") { 0 } else { before });
                pending.extend(target.split(|&b| b == b'/').rev().map(<[u8]>::to_vec));
            }
        }
        Some(real)
    }

    /// Every node strictly below `dir`, with its layer.
    fn below(&self, dir: &[u8]) -> Vec<(Vec<u8>, usize)> {
        let prefix = if dir.is_empty() {
            Vec::new()
        } else {
            join(dir, b"")
        };
        self.nodes
            .range(prefix.clone()..)
            .take_while(|(path, _)| path.starts_with(&prefix))
            .filter(|(path, _)| !path.is_empty())
            .map(|(path, node)| (path.clone(), node.layer))
            .collect()
    }

    fn has_below(&self, dir: &[u8]) -> bool {
        let prefix = join(dir, b"");
        self.nodes
            .range(prefix.clone()..)
            .next()
            .is_some_and(|(path, _)| path.starts_with(&prefix))
    }

    /// Removes what layers before `before` put below `path` and, with `itself`, at it.
    fn remove_tree(&mut self, path: &[u8], itself: bool, before: usize) {
        let mut doomed = self.below(path);
        if itself && let Some(node) = self.nodes.get(path) {
            doomed.push((path.to_vec(), node.layer));
        }
        let mut removed = false;
        for (path, layer) in doomed {
            if layer < before {
                self.nodes.remove(&path);
                removed = true;
            }
        }
        if removed {
            // Whatever was removed may have been a link a listed path went through.
            self.resolved = None;
        }
    }
}

/// `parent/name` (`name` alone at the root).
fn join(parent: &[u8], name: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(parent.len() + 1 + name.len());
    out.extend_from_slice(parent);
    if !parent.is_empty() {
        out.push(b'/');
    }
    out.extend_from_slice(name);
    out
}
