//! The hub's native kernel-module signer.
//!
//! Upstream KMM signs modules in a Pod that runs the kernel's `sign-file` inside a
//! build. The hub does it in-process instead: it reads the listed files out of the
//! unsigned image's layers ([`sign_files_in_layers`]), signs each one
//! ([`sign_module`]) and produces one new layer to push on top of the unsigned image.
//!
//! # The format
//! A signed module is `module || CMS || struct module_signature || "~Module signature
//! appended~\n"` (Linux `scripts/sign-file.c`, `include/linux/module_signature.h`).
//! `struct module_signature` is 12 bytes, all zero except `id_type = 2` (PKCS#7) and a
//! big-endian `u32` length of the CMS. The CMS is a detached `SignedData` with no
//! certificates and no signed attributes, one signer named by issuer and serial number,
//! and `rsaEncryption` (PKCS#1 v1.5) as the signature algorithm: the kernel refuses
//! signed attributes ("has authattrs") and `sha256WithRSAEncryption` as the algorithm
//! identifier. The output is byte-for-byte what `sign-file <hash> key cert module` writes
//! (the tests compare the two), so a node cannot tell which of them signed a module.
//!
//! # Why OpenSSL
//! The private-key operation is OpenSSL's, the same code `sign-file` runs, and it is
//! constant-time, which RustCrypto's `rsa` is not (RUSTSEC-2023-0071). RustCrypto's `cms`
//! builder always adds signed attributes, so the kernel would refuse its output.
//! OpenSSL's own CMS builder (`CmsContentInfo::sign`) does produce `sign-file`'s bytes,
//! but the `openssl` crate's safe API cannot choose its digest (it has no
//! `CMS_add1_signer`; `CMS_sign` always picks the key's default, SHA-256), and this
//! workspace forbids `unsafe`. The `SignedData` without attributes is a fixed shape of
//! a few hundred bytes, so the `cms` module encodes it around OpenSSL's RSA signature;
//! the tests check it against `sign-file` and against OpenSSL's own CMS builder and
//! verifier.
//!
//! Private keys are held in memory only: nothing here writes them anywhere, logs them,
//! or puts them in an error or in `Debug` output.

mod cms;
mod error;
mod key;
mod layers;
mod module;

pub use key::{KeyError, SigningKey};
pub use kmm_extract::{Compression, Layer};
pub use layers::{LAYER_MEDIA_TYPE, Limits, SignedFile, SignedLayer, sign_files_in_layers};
pub use module::{HashAlgorithm, SignError, UnknownHashAlgorithm, sign_module};

#[cfg(test)]
mod tests;
