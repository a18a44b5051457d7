//! The signing key and certificate, as a Module's `keySecret` and `certSecret` hold them.

use std::fmt;

use openssl::error::ErrorStack;
use openssl::hash::MessageDigest;
use openssl::pkey::{Id, PKey, Private};
use openssl::sign::Signer;
use openssl::x509::{X509, X509NameRef};

use crate::cms;

/// Why a key or certificate was refused. The text names the Secret key at fault and
/// never holds key material: OpenSSL's part is its static reason strings only.
#[derive(Debug, thiserror::Error)]
pub enum KeyError {
    #[error(
        "keySecret key `key` is not a PEM private key (PKCS#1 or PKCS#8, unencrypted): {reasons}"
    )]
    Key { reasons: String },
    #[error("keySecret key `key` is not a consistent RSA private key (damaged?): {reasons}")]
    Inconsistent { reasons: String },
    #[error(
        "keySecret key `key` holds an encrypted private key; the Secret must hold it unencrypted, as sign-file reads it"
    )]
    EncryptedKey,
    #[error(
        "keySecret key `key` holds a key of type {kind}; only RSA keys can sign modules for these kernels (no ECDSA support)"
    )]
    NotRsa { kind: String },
    #[error("certSecret key `cert` is not an X.509 certificate in PEM or DER: {reasons}")]
    Certificate { reasons: String },
    #[error(
        "certSecret key `cert` has a negative serial number, which a signature cannot name (RFC 5280 forbids it)"
    )]
    NegativeSerial,
    #[error(
        "keySecret key `key` does not belong to the certificate in certSecret key `cert` ({subject})"
    )]
    Mismatch { subject: String },
}

/// An RSA private key with the certificate the kernel will check its signatures against.
///
/// The key lives in OpenSSL's memory only (which clears it when freed); `Debug` shows the
/// certificate's subject and the key size, never the key.
pub struct SigningKey {
    key: PKey<Private>,
    /// The signer's `IssuerAndSerialNumber`, DER, as every signature names it.
    signer: Vec<u8>,
    subject: String,
}

impl fmt::Debug for SigningKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SigningKey")
            .field("subject", &self.subject)
            .field("bits", &self.key.bits())
            .finish_non_exhaustive()
    }
}

impl SigningKey {
    /// `key`: the private key in PEM (the keySecret's `key`; other PEM blocks, such as a
    /// certificate in the same file like the kernel's `signing_key.pem`, are skipped).
    /// `cert`: the certificate in PEM or DER (the certSecret's `cert`).
    pub fn from_pem(key: &[u8], cert: &[u8]) -> Result<Self, KeyError> {
        let key = parse_key(key)?;
        if key.id() != Id::RSA {
            return Err(KeyError::NotRsa {
                kind: key_kind(key.id()),
            });
        }
        // A damaged private part still parses, and its public part still matches the
        // certificate, but its signatures would be refused by every node.
        let consistent =
            key.rsa()
                .and_then(|rsa| rsa.check_key())
                .map_err(|e| KeyError::Inconsistent {
                    reasons: reasons(&e),
                })?;
        if !consistent {
            return Err(KeyError::Inconsistent {
                reasons: "RSA_check_key failed".into(),
            });
        }
        let cert = parse_cert(cert)?;
        let subject = describe(cert.subject_name());
        let matches = cert.public_key().is_ok_and(|public| public.public_eq(&key));
        if !matches {
            return Err(KeyError::Mismatch { subject });
        }
        let serial = cert
            .serial_number()
            .to_bn()
            .map_err(|e| KeyError::Certificate {
                reasons: reasons(&e),
            })?;
        if serial.is_negative() {
            return Err(KeyError::NegativeSerial);
        }
        let issuer = cert
            .issuer_name()
            .to_der()
            .map_err(|e| KeyError::Certificate {
                reasons: reasons(&e),
            })?;
        let signer = cms::issuer_and_serial(&issuer, &serial.to_vec());
        Ok(Self {
            key,
            signer,
            subject,
        })
    }

    /// The certificate's subject, for messages.
    pub fn subject(&self) -> &str {
        &self.subject
    }

    pub(crate) fn signer(&self) -> &[u8] {
        &self.signer
    }

    /// PKCS#1 v1.5 signature of `data`'s digest (RSA's default padding in OpenSSL).
    pub(crate) fn sign(&self, digest: MessageDigest, data: &[u8]) -> Result<Vec<u8>, ErrorStack> {
        let mut signer = Signer::new(digest, &self.key)?;
        signer.update(data)?;
        signer.sign_to_vec()
    }
}

fn parse_key(pem: &[u8]) -> Result<PKey<Private>, KeyError> {
    // Both PEM forms of an encrypted key say so in their header; refusing them here
    // gives a clear message instead of OpenSSL's decryption failure.
    if contains(pem, b"-----BEGIN ENCRYPTED PRIVATE KEY-----")
        || contains(pem, b"Proc-Type: 4,ENCRYPTED")
    {
        return Err(KeyError::EncryptedKey);
    }
    // The callback answers any passphrase request with none: without it OpenSSL would
    // prompt on the process's terminal.
    PKey::private_key_from_pem_callback(pem, |_| Ok(0)).map_err(|e| KeyError::Key {
        reasons: reasons(&e),
    })
}

fn parse_cert(cert: &[u8]) -> Result<X509, KeyError> {
    let parsed = if contains(cert, b"-----BEGIN") {
        X509::from_pem(cert)
    } else {
        X509::from_der(cert)
    };
    parsed.map_err(|e| KeyError::Certificate {
        reasons: reasons(&e),
    })
}

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    haystack.windows(needle.len()).any(|w| w == needle)
}

fn key_kind(id: Id) -> String {
    match id {
        Id::EC => "EC (ECDSA)".into(),
        Id::ED25519 => "Ed25519".into(),
        Id::ED448 => "Ed448".into(),
        Id::DSA => "DSA".into(),
        Id::RSA_PSS => "RSA-PSS".into(),
        other => format!("non-RSA (OpenSSL key type {})", other.as_raw()),
    }
}

/// `CN=..., O=...` from a name's printable entries.
fn describe(name: &X509NameRef) -> String {
    let parts: Vec<String> = name
        .entries()
        .map(|entry| {
            let field = entry.object().nid().short_name().unwrap_or("?");
            let value = entry.data().to_string().unwrap_or_else(|_| "?".into());
            format!("{field}={value}")
        })
        .collect();
    if parts.is_empty() {
        "empty subject".into()
    } else {
        parts.join(", ")
    }
}

/// OpenSSL's reason strings only. They are static text from OpenSSL's tables; an
/// error's free-form data is left out because nothing promises it holds no input bytes.
pub(crate) fn reasons(stack: &ErrorStack) -> String {
    let mut out: Vec<&str> = stack.errors().iter().filter_map(|e| e.reason()).collect();
    out.dedup();
    if out.is_empty() {
        "no reason given by OpenSSL".into()
    } else {
        out.join("; ")
    }
}
