//! Signing one module: the appended signature `sign-file` writes.

use std::fmt;
use std::str::FromStr;

use openssl::hash::MessageDigest;

use crate::SigningKey;
use crate::cms;
pub use crate::error::SignError;

/// The marker that ends every signed module.
const MAGIC: &[u8] = b"~Module signature appended~\n";
/// `struct module_signature`'s size.
const INFO_LEN: usize = 12;
/// `id_type` of a PKCS#7/CMS signature (`PKEY_ID_PKCS7`).
const PKEY_ID_PKCS7: u8 = 2;
const ELF_MAGIC: &[u8] = b"\x7fELF";

/// The digest a signature is made over (sign-file's `<hash algo>`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum HashAlgorithm {
    #[default]
    Sha256,
    Sha384,
    Sha512,
}

impl HashAlgorithm {
    pub const ALL: [Self; 3] = [Self::Sha256, Self::Sha384, Self::Sha512];

    /// The name sign-file and the kernel use.
    pub fn name(self) -> &'static str {
        match self {
            Self::Sha256 => "sha256",
            Self::Sha384 => "sha384",
            Self::Sha512 => "sha512",
        }
    }

    pub(crate) fn digest(self) -> MessageDigest {
        match self {
            Self::Sha256 => MessageDigest::sha256(),
            Self::Sha384 => MessageDigest::sha384(),
            Self::Sha512 => MessageDigest::sha512(),
        }
    }

    /// The OID, DER-encoded (2.16.840.1.101.3.4.2.1, .2, .3).
    pub(crate) fn oid(self) -> &'static [u8] {
        match self {
            Self::Sha256 => &[
                0x06, 0x09, 0x60, 0x86, 0x48, 0x01, 0x65, 0x03, 0x04, 0x02, 0x01,
            ],
            Self::Sha384 => &[
                0x06, 0x09, 0x60, 0x86, 0x48, 0x01, 0x65, 0x03, 0x04, 0x02, 0x02,
            ],
            Self::Sha512 => &[
                0x06, 0x09, 0x60, 0x86, 0x48, 0x01, 0x65, 0x03, 0x04, 0x02, 0x03,
            ],
        }
    }
}

impl fmt::Display for HashAlgorithm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A hash algorithm name that is not supported.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("unsupported signing hash algorithm {0:?}: use sha256, sha384 or sha512")]
pub struct UnknownHashAlgorithm(pub String);

impl FromStr for HashAlgorithm {
    type Err = UnknownHashAlgorithm;

    /// `sha256`, `sha384`, `sha512`, in any case (as sign-file accepts them).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::ALL
            .into_iter()
            .find(|h| h.name().eq_ignore_ascii_case(s))
            .ok_or_else(|| UnknownHashAlgorithm(s.to_string()))
    }
}

/// Returns `module` with a signature by `key` appended, exactly as `sign-file <hash>
/// key cert` writes it. `name` names the module in errors.
///
/// Signatures the module already ends with are removed first, and the bare module is
/// signed. `sign-file` would append after them, and the kernel checks only the last
/// signature over everything before it, so a stacked module still loads; but re-signing
/// after a key change would then grow the module by one signature each time and keep
/// the old, perhaps revoked, signer's signature in the file.
pub fn sign_module(
    name: &str,
    module: &[u8],
    key: &SigningKey,
    hash: HashAlgorithm,
) -> Result<Vec<u8>, SignError> {
    let bare = strip_signatures(name, module)?;
    if bare.is_empty() {
        return Err(SignError::Empty { name: name.into() });
    }
    if !bare.starts_with(ELF_MAGIC) {
        return Err(SignError::NotElf { name: name.into() });
    }
    let signature = key
        .sign(hash.digest(), bare)
        .map_err(|e| SignError::Crypto {
            name: name.into(),
            reasons: crate::key::reasons(&e),
        })?;
    let cms = cms::signed_data(hash, key.signer(), &signature);
    let cms_len = u32::try_from(cms.len()).expect("a CMS of one signature is small");
    let mut out = Vec::with_capacity(bare.len() + cms.len() + INFO_LEN + MAGIC.len());
    out.extend_from_slice(bare);
    out.extend_from_slice(&cms);
    // struct module_signature: algo, hash, id_type, signer_len, key_id_len, 3 pad bytes
    // (all zero for PKCS#7 but id_type), then sig_len big-endian.
    out.extend_from_slice(&[0, 0, PKEY_ID_PKCS7, 0, 0, 0, 0, 0]);
    out.extend_from_slice(&cms_len.to_be_bytes());
    out.extend_from_slice(MAGIC);
    Ok(out)
}

/// `module` without the signatures it ends with (none, one, or several stacked).
fn strip_signatures<'a>(name: &str, mut module: &'a [u8]) -> Result<&'a [u8], SignError> {
    while let Some(rest) = module.strip_suffix(MAGIC) {
        let malformed = || SignError::MalformedSignature { name: name.into() };
        let info_at = rest.len().checked_sub(INFO_LEN).ok_or_else(malformed)?;
        let info = &rest[info_at..];
        if info[2] != PKEY_ID_PKCS7 {
            return Err(malformed());
        }
        let sig_len = u32::from_be_bytes(info[8..].try_into().expect("4 bytes")) as usize;
        module = &rest[..info_at.checked_sub(sig_len).ok_or_else(malformed)?];
    }
    Ok(module)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn trailer(sig_len: u32, id_type: u8) -> Vec<u8> {
        let mut out = vec![0, 0, id_type, 0, 0, 0, 0, 0];
        out.extend_from_slice(&sig_len.to_be_bytes());
        out.extend_from_slice(MAGIC);
        out
    }

    #[test]
    fn strips_every_stacked_signature() {
        let mut module = b"\x7fELF bare".to_vec();
        for sig in [&b"first"[..], b"second signature"] {
            module.extend_from_slice(sig);
            module.extend(trailer(sig.len() as u32, PKEY_ID_PKCS7));
        }
        assert_eq!(strip_signatures("m", &module).unwrap(), b"\x7fELF bare");
        assert_eq!(strip_signatures("m", b"\x7fELF").unwrap(), b"\x7fELF");
    }

    #[test]
    fn refuses_a_marker_with_an_impossible_signature() {
        let mut too_long = b"\x7fELF".to_vec();
        too_long.extend(trailer(100, PKEY_ID_PKCS7));
        let mut wrong_type = b"\x7fELFsig".to_vec();
        wrong_type.extend(trailer(3, 0));
        for (input, what) in [
            (too_long, "length"),
            (wrong_type, "id_type"),
            (MAGIC.to_vec(), "no room for the info"),
        ] {
            let err = strip_signatures("mod.ko", &input).unwrap_err();
            assert!(
                matches!(&err, SignError::MalformedSignature { name } if name == "mod.ko"),
                "{what}: {err:?}"
            );
        }
    }

    #[test]
    fn hash_algorithms_parse_by_name_and_name_a_bad_value() {
        for hash in HashAlgorithm::ALL {
            assert_eq!(hash.name().parse::<HashAlgorithm>(), Ok(hash));
            assert_eq!(hash.to_string(), hash.name());
        }
        assert_eq!("SHA512".parse::<HashAlgorithm>(), Ok(HashAlgorithm::Sha512));
        assert_eq!(HashAlgorithm::default(), HashAlgorithm::Sha256);
        let err = "md5".parse::<HashAlgorithm>().unwrap_err();
        assert!(err.to_string().contains("\"md5\""), "{err}");
    }

    #[test]
    fn oids_match_openssl() {
        for hash in HashAlgorithm::ALL {
            let nid = hash.digest().type_();
            let obj = openssl::asn1::Asn1Object::from_str(nid.short_name().unwrap()).unwrap();
            // Asn1Object's DER content (without tag and length) is the OID's value.
            assert_eq!(&hash.oid()[2..], obj.as_slice(), "{hash}");
        }
    }
}
