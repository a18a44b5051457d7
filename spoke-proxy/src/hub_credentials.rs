//! The hub address's CA and the proxy's client certificate and key, read from the files
//! OCM's add-on registration mounts. Read again on every (re)connect and polled for
//! changes, so a renewed certificate is used without a restart.

use std::fmt;
use std::hash::{DefaultHasher, Hash, Hasher};
use std::path::{Path, PathBuf};

use thiserror::Error;

#[derive(Debug, Error)]
#[error("cannot read {flag} {path}: {source}")]
pub struct ReadError {
    flag: &'static str,
    path: PathBuf,
    source: std::io::Error,
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
}

impl fmt::Debug for HubCredentials {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HubCredentials")
            .field("fingerprint", &self.fingerprint())
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
    std::fs::read(path).map_err(|source| ReadError {
        flag,
        path: path.to_owned(),
        source,
    })
}

impl HubCredentialFiles {
    pub fn read(&self) -> Result<HubCredentials, ReadError> {
        Ok(HubCredentials {
            ca_pem: read("--hub-ca-file", &self.ca)?,
            cert_pem: read("--client-cert-file", &self.cert)?,
            key_pem: read("--client-key-file", &self.key)?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_all_three_and_notices_a_change() {
        let dir = tempfile::tempdir().unwrap();
        let files = HubCredentialFiles {
            ca: dir.path().join("ca.crt"),
            cert: dir.path().join("tls.crt"),
            key: dir.path().join("tls.key"),
        };
        for (path, text) in [
            (&files.ca, "ca"),
            (&files.cert, "cert"),
            (&files.key, "key"),
        ] {
            std::fs::write(path, text).unwrap();
        }
        let first = files.read().unwrap();
        assert_eq!(first.cert_pem, b"cert");
        assert!(!format!("{first:?}").contains("key\""));
        std::fs::write(&files.cert, "renewed").unwrap();
        let second = files.read().unwrap();
        assert_ne!(first.fingerprint(), second.fingerprint());
        assert_eq!(second.fingerprint(), files.read().unwrap().fingerprint());
    }

    #[test]
    fn a_missing_file_names_its_flag_and_path() {
        let dir = tempfile::tempdir().unwrap();
        let files = HubCredentialFiles {
            ca: dir.path().join("absent-ca.crt"),
            cert: dir.path().join("tls.crt"),
            key: dir.path().join("tls.key"),
        };
        let error = files.read().unwrap_err().to_string();
        assert!(error.contains("--hub-ca-file"), "{error}");
        assert!(error.contains("absent-ca.crt"), "{error}");
    }
}
