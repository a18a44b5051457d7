//! A layer's tar stream and the walk over its entries: the one place that decodes a
//! layer and checks its entries' paths, for the extraction in this crate and for the
//! hub's signer (`kmm-signing`).
//!
//! An entry's path is only reachable through [`Entry::path`], which refuses absolute
//! paths and `..`: a caller cannot write or look up an entry under an unchecked name.
//! The check runs when the path is asked for, so that a caller may first count or skip
//! entries by their kind.

use std::borrow::Cow;
use std::fmt;
use std::io::{self, Read, Write};

use crate::ExtractError;

/// How a layer blob is compressed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Compression {
    None,
    Gzip,
    Zstd,
}

impl Compression {
    /// The compression of an OCI or Docker layer media type.
    pub fn from_media_type(media_type: &str) -> Result<Self, ExtractError> {
        match media_type {
            "application/vnd.oci.image.layer.v1.tar"
            | "application/vnd.docker.image.rootfs.diff.tar" => Ok(Self::None),
            "application/vnd.oci.image.layer.v1.tar+gzip"
            | "application/vnd.docker.image.rootfs.diff.tar.gzip" => Ok(Self::Gzip),
            "application/vnd.oci.image.layer.v1.tar+zstd"
            | "application/vnd.docker.image.rootfs.diff.tar.zstd" => Ok(Self::Zstd),
            other => Err(ExtractError::UnsupportedMediaType(other.to_string())),
        }
    }

    /// `reader` decompressed: the layer's tar stream.
    pub fn decoder<'a, R: Read + 'a>(self, reader: R) -> io::Result<Box<dyn Read + 'a>> {
        Ok(match self {
            Self::None => Box::new(reader),
            Self::Gzip => Box::new(flate2::read::GzDecoder::new(reader)),
            Self::Zstd => Box::new(zstd::stream::read::Decoder::new(reader)?),
        })
    }
}

/// One layer: its compression and its bytes.
#[derive(Debug)]
pub struct Layer<R> {
    pub compression: Compression,
    pub reader: R,
}

/// Why a layer could not be read. Extraction and signing turn it into their own
/// errors, which name the same faults.
#[derive(Debug, thiserror::Error)]
pub enum LayerError {
    #[error("layer {layer} is corrupt: {source}")]
    Corrupt {
        layer: usize,
        #[source]
        source: io::Error,
    },
    #[error("layer {layer} decompresses to more than {limit} bytes; refused")]
    TooLarge { layer: usize, limit: u64 },
    #[error("layer {layer}: entry {path:?} has an absolute path; refused")]
    AbsolutePath { layer: usize, path: String },
    #[error("layer {layer}: entry {path:?} contains `..`; refused")]
    ParentTraversal { layer: usize, path: String },
}

/// Hands every entry of `layers` (bottom first, each in archive order) to `visit`,
/// stopping at the first error. A layer is refused as corrupt when it is not valid
/// for its compression or not a valid tar, and as too large when it decompresses to
/// more than `read_limit` bytes, read or skipped (a bound on the work a decompression
/// bomb can cause); that refusal wins over whatever `visit` returned.
pub fn walk<R: Read, E: From<LayerError>>(
    layers: impl IntoIterator<Item = Layer<R>>,
    read_limit: u64,
    mut visit: impl FnMut(Entry<'_, '_>) -> Result<(), E>,
) -> Result<(), E> {
    for (layer, source) in layers.into_iter().enumerate() {
        let corrupt = |source| LayerError::Corrupt { layer, source };
        let decoded = source.compression.decoder(source.reader).map_err(corrupt)?;
        let mut archive = tar::Archive::new(Bounded::new(decoded, read_limit));
        let result = visit_entries(layer, &mut archive, &mut visit);
        if archive.into_inner().exceeded {
            return Err(LayerError::TooLarge {
                layer,
                limit: read_limit,
            }
            .into());
        }
        result?;
    }
    Ok(())
}

fn visit_entries<'r, E: From<LayerError>>(
    layer: usize,
    archive: &mut tar::Archive<Bounded<Box<dyn Read + 'r>>>,
    visit: &mut impl FnMut(Entry<'_, 'r>) -> Result<(), E>,
) -> Result<(), E> {
    let corrupt = |source| LayerError::Corrupt { layer, source };
    for entry in archive.entries().map_err(corrupt)? {
        let inner = entry.map_err(corrupt)?;
        visit(Entry { layer, inner })?;
    }
    Ok(())
}

/// One entry of a layer, as [`walk`] hands it over.
pub struct Entry<'a, 'r> {
    layer: usize,
    inner: tar::Entry<'a, Bounded<Box<dyn Read + 'r>>>,
}

impl Entry<'_, '_> {
    /// The index of the entry's layer, bottom first.
    pub fn layer(&self) -> usize {
        self.layer
    }

    /// The entry's type, as its header has it.
    pub fn kind(&self) -> tar::EntryType {
        self.inner.header().entry_type()
    }

    /// The size of a regular file's content, as the archive declares it.
    pub fn size(&self) -> u64 {
        self.inner.size()
    }

    /// The mode, as its header has it; an unreadable field is a corrupt layer.
    pub fn mode(&self) -> Result<u32, LayerError> {
        self.inner
            .header()
            .mode()
            .map_err(|source| LayerError::Corrupt {
                layer: self.layer,
                source,
            })
    }

    /// The entry's path: relative, without `..`; absolute paths and `..` refuse it.
    pub fn path(&self) -> Result<EntryPath, LayerError> {
        let raw = self.inner.path_bytes().into_owned();
        match archive_components(&raw) {
            Ok(components) => Ok(EntryPath { raw, components }),
            Err(fault) => Err(fault.error(self.layer, String::from_utf8_lossy(&raw).into())),
        }
    }

    /// A link's target as the archive has it (empty when it has none): where it may
    /// point is the caller's to decide.
    pub fn link_name(&self) -> Vec<u8> {
        self.inner
            .link_name_bytes()
            .map(Cow::into_owned)
            .unwrap_or_default()
    }

    /// Copies a regular file's content to `out`. Fewer bytes than declared, or a
    /// failing copy, is a corrupt layer; `name` names the file in that error.
    pub fn copy_to(&mut self, name: &str, out: &mut impl Write) -> Result<(), LayerError> {
        let layer = self.layer;
        let size = self.size();
        let written = io::copy(&mut (&mut self.inner).take(size), out)
            .map_err(|source| LayerError::Corrupt { layer, source })?;
        if written != size {
            return Err(LayerError::Corrupt {
                layer,
                source: io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    format!("{name}: {written} of {size} bytes"),
                ),
            });
        }
        Ok(())
    }
}

impl fmt::Debug for Entry<'_, '_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Entry")
            .field("layer", &self.layer)
            .field("kind", &self.kind())
            .field("path", &String::from_utf8_lossy(&self.inner.path_bytes()))
            .finish()
    }
}

/// An entry's checked path.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EntryPath {
    raw: Vec<u8>,
    components: Vec<Vec<u8>>,
}

impl EntryPath {
    /// The components, without the empty ones and `.`; none for the root itself.
    pub fn components(&self) -> &[Vec<u8>] {
        &self.components
    }
}

/// The path as the archive has it (invalid UTF-8 replaced).
impl fmt::Display for EntryPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&String::from_utf8_lossy(&self.raw))
    }
}

/// Why an archive path is refused.
#[derive(Debug)]
pub(crate) enum PathFault {
    Absolute,
    Parent,
}

impl PathFault {
    fn error(self, layer: usize, path: String) -> LayerError {
        match self {
            Self::Absolute => LayerError::AbsolutePath { layer, path },
            Self::Parent => LayerError::ParentTraversal { layer, path },
        }
    }
}

/// An archive path as relative components; absolute paths and `..` are faults.
pub(crate) fn archive_components(path: &[u8]) -> Result<Vec<Vec<u8>>, PathFault> {
    if path.starts_with(b"/") {
        return Err(PathFault::Absolute);
    }
    let mut out = Vec::new();
    for component in path.split(|&b| b == b'/') {
        match component {
            b"" | b"." => {}
            b".." => return Err(PathFault::Parent),
            name => out.push(name.to_vec()),
        }
    }
    Ok(out)
}

/// Fails reads past a limit, and says so in `exceeded`: a bound on the work a
/// decompression bomb can cause, told apart from a corrupt stream.
struct Bounded<R> {
    inner: R,
    remaining: u64,
    exceeded: bool,
}

impl<R> Bounded<R> {
    fn new(inner: R, limit: u64) -> Self {
        Self {
            inner,
            remaining: limit,
            exceeded: false,
        }
    }
}

impl<R: Read> Read for Bounded<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if self.remaining == 0 {
            // One more byte would exceed the limit: look without consuming meaningfully.
            let mut probe = [0u8; 1];
            return match self.inner.read(&mut probe)? {
                0 => Ok(0),
                _ => {
                    self.exceeded = true;
                    Err(io::Error::other("layer read limit exceeded"))
                }
            };
        }
        let max = usize::try_from(self.remaining)
            .unwrap_or(usize::MAX)
            .min(buf.len());
        let n = self.inner.read(&mut buf[..max])?;
        self.remaining -= n as u64;
        Ok(n)
    }
}

#[cfg(test)]
mod tests;
