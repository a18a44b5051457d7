use std::io;

use kmm_extract::LayerError;

/// Why a module or an image's files could not be signed. Paths are the image paths as
/// listed in `filesToSign` (or, for a layer's own entries, as the layer names them).
#[derive(Debug, thiserror::Error)]
pub enum SignError {
    #[error("{name} is empty: there is no module to sign")]
    Empty { name: String },
    #[error("{name} is not an ELF file, so not a kernel module; refusing to sign it")]
    NotElf { name: String },
    #[error("{name} ends with a module signature marker whose signature does not fit in the file")]
    MalformedSignature { name: String },
    #[error("signing {name} failed in OpenSSL: {reasons}")]
    Crypto { name: String, reasons: String },

    #[error("filesToSign is empty: nothing to sign")]
    NothingToSign,
    #[error("filesToSign entry {path:?} {reason}")]
    InvalidPath { path: String, reason: &'static str },
    #[error("{path} is not in the image")]
    FileNotInImage { path: String },
    #[error("filesToSign pattern {pattern:?} matches no regular file in the image")]
    NoFileMatches { pattern: String },
    #[error("{path} is a {kind} in the image, not a regular file")]
    NotARegularFile { path: String, kind: &'static str },
    #[error(
        "{path} resolves to {stored_at} only through a link the image adds after that file; list {stored_at} in filesToSign instead"
    )]
    LinkedAfterWrite { path: String, stored_at: String },
    #[error("{path}: too many levels of symbolic links in the image")]
    LinkLoop { path: String },

    #[error("layer {layer}: entry {entry:?} {reason}; refused")]
    UnsafeEntry {
        layer: usize,
        entry: String,
        reason: &'static str,
    },
    #[error("layer {layer} is corrupt: {source}")]
    CorruptLayer {
        layer: usize,
        #[source]
        source: io::Error,
    },
    #[error("layer {layer} decompresses to more than {limit} bytes; refused")]
    LayerTooLarge { layer: usize, limit: u64 },
    #[error("the image has more than {limit} entries; refused")]
    TooManyEntries { limit: u64 },
    #[error("{path} is {size} bytes, over the limit of {limit} for a file to sign")]
    FileTooLarge { path: String, size: u64, limit: u64 },
    #[error("the files to sign add up to more than {limit} bytes; refused")]
    TooMuchToRead { limit: u64 },
    #[error("writing the signed layer: {0}")]
    Write(#[source] io::Error),
}

impl SignError {
    /// True when the module or the image is at fault (the user's to fix), as opposed
    /// to OpenSSL or a local failure.
    pub fn is_input_fault(&self) -> bool {
        !matches!(self, Self::Crypto { .. } | Self::Write(_))
    }
}

impl From<LayerError> for SignError {
    fn from(error: LayerError) -> Self {
        match error {
            LayerError::Corrupt { layer, source } => Self::CorruptLayer { layer, source },
            LayerError::TooLarge { layer, limit } => Self::LayerTooLarge { layer, limit },
            LayerError::AbsolutePath { layer, path } => Self::UnsafeEntry {
                layer,
                entry: path,
                reason: "has an absolute path",
            },
            LayerError::ParentTraversal { layer, path } => Self::UnsafeEntry {
                layer,
                entry: path,
                reason: "contains `..`",
            },
        }
    }
}
