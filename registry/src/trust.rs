//! Certificate authorities a registry's TLS certificate may chain to besides the system's:
//! the internal CA of a cluster's or the hub's registries. Held as checked DER
//! certificates, so that a bundle that cannot be used is refused with its reason before
//! any client is built (`oci-client` falls back to a client without them, silently).

use oci_client::client::{Certificate, CertificateEncoding};
use x509_parser::pem::Pem;

/// Why a CA bundle cannot be trusted. Names the certificate by its place in the bundle.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CaBundleError {
    #[error("PEM block {index}: {reason}")]
    Pem { index: usize, reason: String },
    #[error("PEM block {index} is a {label}, not a CERTIFICATE")]
    NotACertificate { index: usize, label: String },
    #[error("PEM block {index} is not an X.509 certificate: {reason}")]
    Certificate { index: usize, reason: String },
    #[error("holds text but no PEM certificate")]
    NoCertificate,
}

/// Extra trusted CAs; empty for the system's alone.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RegistryCas {
    certificates: Vec<Vec<u8>>,
}

impl RegistryCas {
    /// The certificates of a PEM bundle, every block checked. An empty (or blank) bundle
    /// trusts nothing more, as an unset add-on variable renders it.
    pub fn from_pem(bundle: &[u8]) -> Result<Self, CaBundleError> {
        if bundle.iter().all(u8::is_ascii_whitespace) {
            return Ok(Self::default());
        }
        let mut certificates = Vec::new();
        for (index, block) in Pem::iter_from_buffer(bundle).enumerate() {
            let index = index + 1;
            let pem = block.map_err(|e| CaBundleError::Pem {
                index,
                reason: e.to_string(),
            })?;
            if pem.label != "CERTIFICATE" {
                return Err(CaBundleError::NotACertificate {
                    index,
                    label: pem.label,
                });
            }
            pem.parse_x509().map_err(|e| CaBundleError::Certificate {
                index,
                reason: e.to_string(),
            })?;
            certificates.push(pem.contents);
        }
        if certificates.is_empty() {
            return Err(CaBundleError::NoCertificate);
        }
        Ok(Self { certificates })
    }

    pub fn is_empty(&self) -> bool {
        self.certificates.is_empty()
    }

    pub fn len(&self) -> usize {
        self.certificates.len()
    }

    /// The bundle as PEM again, for programs that read files (buildah's `--cert-dir`).
    pub fn to_pem(&self) -> String {
        use base64::Engine as _;
        let mut pem = String::new();
        for der in &self.certificates {
            pem.push_str("-----BEGIN CERTIFICATE-----\n");
            let encoded = base64::engine::general_purpose::STANDARD.encode(der);
            for line in encoded.as_bytes().chunks(64) {
                // Base64 is ASCII.
                pem.push_str(&String::from_utf8_lossy(line));
                pem.push('\n');
            }
            pem.push_str("-----END CERTIFICATE-----\n");
        }
        pem
    }

    /// The certificates, DER.
    pub(crate) fn ders(&self) -> &[Vec<u8>] {
        &self.certificates
    }

    /// As `oci-client` takes them.
    pub(crate) fn certificates(&self) -> Vec<Certificate> {
        self.certificates
            .iter()
            .map(|der| Certificate {
                encoding: CertificateEncoding::Der,
                data: der.clone(),
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use rcgen::{BasicConstraints, CertificateParams, IsCa, KeyPair};

    use super::*;

    fn ca_pem(name: &str) -> String {
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, name);
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params
            .self_signed(&KeyPair::generate().unwrap())
            .unwrap()
            .pem()
    }

    #[test]
    fn a_bundle_of_certificates_is_trusted_whole() {
        let bundle = format!("{}\n{}", ca_pem("one"), ca_pem("two"));
        let cas = RegistryCas::from_pem(bundle.as_bytes()).unwrap();
        assert_eq!(cas.len(), 2);
        assert_eq!(
            RegistryCas::from_pem(cas.to_pem().as_bytes()).unwrap(),
            cas,
            "written again as PEM, the same certificates"
        );
        assert!(
            cas.certificates()
                .iter()
                .all(|c| matches!(c.encoding, CertificateEncoding::Der))
        );
    }

    #[test]
    fn a_blank_bundle_trusts_nothing_more() {
        for blank in ["", "\n", "  \n\t"] {
            assert!(RegistryCas::from_pem(blank.as_bytes()).unwrap().is_empty());
        }
    }

    #[test]
    fn what_cannot_be_trusted_is_refused_naming_the_block() {
        let key = KeyPair::generate().unwrap().serialize_pem();
        let corrupt = "-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n";
        let truncated = ca_pem("cut");
        let truncated = &truncated[..truncated.len() / 2];
        for (bundle, says) in [
            (
                format!("{}{key}", ca_pem("ca")),
                "PEM block 2 is a PRIVATE KEY",
            ),
            (
                corrupt.to_owned(),
                "PEM block 1 is not an X.509 certificate",
            ),
            (truncated.to_owned(), "PEM block 1: "),
            ("not a PEM bundle".to_owned(), "no PEM certificate"),
        ] {
            let error = RegistryCas::from_pem(bundle.as_bytes()).unwrap_err();
            assert!(error.to_string().contains(says), "{says}: {error}");
        }
    }
}
