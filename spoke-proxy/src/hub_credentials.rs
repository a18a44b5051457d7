//! The hub address's CA and the proxy's client certificate and key, read from the files
//! OCM's add-on registration mounts. Read again on every (re)connect and polled for
//! changes, so a renewed certificate is used without a restart.
//!
//! The CA file is the add-on's ConfigMap rendered from the variable HUB_CA_BUNDLE, which
//! kmm-hub writes into the AddOnDeploymentConfig once it runs: until then it is empty,
//! which is reported as such (and retried) rather than as a failed TLS handshake.

use std::fmt;
use std::hash::{DefaultHasher, Hash, Hasher};
use std::path::{Path, PathBuf};

use thiserror::Error;
use x509_parser::certificate::X509Certificate;
use x509_parser::pem::Pem;

#[derive(Debug, Error)]
pub enum ReadError {
    #[error("cannot read {flag} {path}: {source}")]
    Io {
        flag: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(
        "--hub-ca-file {path} {problem}; its content is the variable HUB_CA_BUNDLE of the \
         add-on's AddOnDeploymentConfig, which kmm-hub publishes (its CA): retrying until it does"
    )]
    HubCa { path: PathBuf, problem: String },
    #[error("--client-cert-file {path} {problem}")]
    ClientCertificate { path: PathBuf, problem: String },
}

/// Where the files are.
#[derive(Clone, Debug)]
pub struct HubCredentialFiles {
    pub ca: PathBuf,
    pub cert: PathBuf,
    pub key: PathBuf,
}

/// The files' contents. The key is never printed.
#[derive(Clone, PartialEq, Eq)]
pub struct HubCredentials {
    pub ca_pem: Vec<u8>,
    pub cert_pem: Vec<u8>,
    pub key_pem: Vec<u8>,
    /// NotAfter of the client certificate (the first of its file), in seconds since the
    /// Unix epoch.
    pub cert_not_after: i64,
}

impl fmt::Debug for HubCredentials {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HubCredentials")
            .field("fingerprint", &self.fingerprint())
            .field("cert_not_after", &self.cert_not_after)
            .finish_non_exhaustive()
    }
}

impl HubCredentials {
    /// A digest of the three files, to notice a change without keeping copies around.
    pub fn fingerprint(&self) -> u64 {
        let mut hasher = DefaultHasher::new();
        (&self.ca_pem, &self.cert_pem, &self.key_pem).hash(&mut hasher);
        hasher.finish()
    }
}

fn read(flag: &'static str, path: &Path) -> Result<Vec<u8>, ReadError> {
    std::fs::read(path).map_err(|source| ReadError::Io {
        flag,
        path: path.to_owned(),
        source,
    })
}

/// The first certificate of a PEM file, parsed; `Err` says what is wrong with the file.
fn first_certificate<T>(
    pem: &[u8],
    f: impl FnOnce(&X509Certificate<'_>) -> T,
) -> Result<T, String> {
    for block in Pem::iter_from_buffer(pem) {
        let block = block.map_err(|e| format!("is not PEM: {e}"))?;
        if block.label == "CERTIFICATE" {
            return block
                .parse_x509()
                .map(|certificate| f(&certificate))
                .map_err(|e| format!("holds an unreadable certificate: {e}"));
        }
    }
    Err(if pem.iter().all(u8::is_ascii_whitespace) {
        "is empty".to_owned()
    } else {
        "holds no PEM certificate".to_owned()
    })
}

impl HubCredentialFiles {
    pub fn read(&self) -> Result<HubCredentials, ReadError> {
        let ca_pem = read("--hub-ca-file", &self.ca)?;
        first_certificate(&ca_pem, |_| ()).map_err(|problem| ReadError::HubCa {
            path: self.ca.clone(),
            problem,
        })?;
        let cert_pem = read("--client-cert-file", &self.cert)?;
        let cert_not_after = first_certificate(&cert_pem, |c| c.validity().not_after.timestamp())
            .map_err(|problem| ReadError::ClientCertificate {
            path: self.cert.clone(),
            problem,
        })?;
        Ok(HubCredentials {
            ca_pem,
            cert_pem,
            key_pem: read("--client-key-file", &self.key)?,
            cert_not_after,
        })
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use kmm_runtime::pki::{CertificateAuthority, Leaf};

    use super::*;

    /// Files as OCM mounts them: the hub's CA, a client certificate and its key.
    fn files(dir: &Path) -> (HubCredentialFiles, CertificateAuthority) {
        let ca = CertificateAuthority::generate("test-hub-ca", Duration::from_secs(3600)).unwrap();
        let files = HubCredentialFiles {
            ca: dir.join("ca.crt"),
            cert: dir.join("tls.crt"),
            key: dir.join("tls.key"),
        };
        std::fs::write(&files.ca, ca.cert_pem()).unwrap();
        issue(&ca, &files, Duration::from_secs(3600));
        (files, ca)
    }

    /// Writes a client certificate as a renewal does; returns its NotAfter.
    fn issue(ca: &CertificateAuthority, files: &HubCredentialFiles, validity: Duration) -> i64 {
        let leaf = Leaf::client("agent", &[], validity);
        let client = ca.issue(&leaf).unwrap();
        std::fs::write(&files.cert, &client.cert_pem).unwrap();
        std::fs::write(&files.key, client.key_pem.as_bytes()).unwrap();
        leaf.not_after.unix_timestamp()
    }

    #[test]
    fn reads_all_three_and_notices_a_change() {
        let dir = tempfile::tempdir().unwrap();
        let (files, ca) = files(dir.path());
        let first = files.read().unwrap();
        assert_eq!(first.cert_pem, std::fs::read(&files.cert).unwrap());
        // The key is bytes: a derived Debug would print it as numbers, never as text.
        let debug = format!("{first:?}");
        let numbers = format!("{:?}", &first.key_pem[..32]);
        let numbers = numbers.trim_matches(|c| c == '[' || c == ']');
        assert!(format!("{:?}", first.key_pem).contains(numbers));
        assert!(
            !debug.contains("PRIVATE") && !debug.contains(numbers),
            "{debug}"
        );
        let renewed_until = issue(&ca, &files, Duration::from_secs(7200));
        let second = files.read().unwrap();
        assert_ne!(first.fingerprint(), second.fingerprint());
        assert_eq!(second.cert_not_after, renewed_until);
        assert!(second.cert_not_after > first.cert_not_after);
        assert_eq!(second.fingerprint(), files.read().unwrap().fingerprint());
    }

    #[test]
    fn a_missing_file_names_its_flag_and_path() {
        let dir = tempfile::tempdir().unwrap();
        let (mut files, _) = files(dir.path());
        files.key = dir.path().join("absent.key");
        let error = files.read().unwrap_err().to_string();
        assert!(error.contains("--client-key-file"), "{error}");
        assert!(error.contains("absent.key"), "{error}");
    }

    #[test]
    fn the_client_certificate_must_be_one() {
        let dir = tempfile::tempdir().unwrap();
        let (files, _) = files(dir.path());
        std::fs::write(&files.cert, "").unwrap();
        let error = files.read().unwrap_err().to_string();
        assert!(error.starts_with("--client-cert-file "), "{error}");
        assert!(error.contains("tls.crt is empty"), "{error}");
    }

    /// OCM renders the unset variable HUB_CA_BUNDLE as an empty ConfigMap value.
    #[test]
    fn a_hub_ca_without_a_certificate_names_the_variable() {
        let dir = tempfile::tempdir().unwrap();
        let (files, _) = files(dir.path());
        let broken = "-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n";
        for (content, problem) in [
            ("", "is empty"),
            ("\n", "is empty"),
            ("not a certificate", "holds no PEM certificate"),
            (broken, "holds an unreadable certificate"),
        ] {
            std::fs::write(&files.ca, content).unwrap();
            let error = files.read().unwrap_err().to_string();
            assert!(error.starts_with("--hub-ca-file "), "{error}");
            assert!(error.contains("ca.crt"), "{error}");
            assert!(error.contains(problem), "{content:?}: {error}");
            assert!(error.contains("HUB_CA_BUNDLE"), "{error}");
        }
    }
}
