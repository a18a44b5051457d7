//! Module signing keys for the real-kernel test: RSA test keys made per run with the
//! `openssl` CLI, with the extensions Linux gives its own signing key (Debian's cloud
//! kernel verifies no ECDSA). The modules are signed by kmm-hub itself, so that a real
//! kernel judges exactly the signatures the hub appends.
//!
//! The keys live in the test's work directory only: they are never committed, and the
//! private key is read into memory only to sign, never printed.

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::process::run;
use crate::{Error, IoContext, Result};

/// The extensions Linux's `certs/default_x509.genkey` gives the key it generates at
/// build time: a leaf (not a CA) for digital signatures, with the subject key
/// identifier the kernel names the key by.
const GENKEY: &str = "\
[ req ]
default_bits = 2048
distinguished_name = req_distinguished_name
prompt = no
string_mask = utf8only
x509_extensions = myexts

[ req_distinguished_name ]
CN = {CN}

[ myexts ]
basicConstraints = critical,CA:FALSE
keyUsage = digitalSignature
subjectKeyIdentifier = hash
authorityKeyIdentifier = keyid
";

/// A self-signed RSA 2048 key pair.
#[derive(Debug, Clone)]
pub struct TestKey {
    /// The private key (PEM, mode 0600, as openssl writes it).
    pub key: PathBuf,
    /// The self-signed certificate (PEM).
    pub cert: PathBuf,
    /// The subject key identifier, lowercase hex without separators.
    pub key_id: String,
    /// What the kernel calls the key in a keyring (and in dmesg):
    /// `<subject CN>: <subject key identifier>`.
    pub description: String,
}

impl TestKey {
    /// A new key pair as `<dir>/<name>.key` and `<dir>/<name>.crt` (`dir` is created),
    /// its subject `CN=<common_name>`.
    pub fn generate(dir: &Path, name: &str, common_name: &str) -> Result<Self> {
        // One line of the config file: a newline would add settings to it.
        if common_name.contains('\n') {
            return Err(Error::Invalid(format!(
                "a certificate's CN cannot span lines: {common_name:?}"
            )));
        }
        std::fs::create_dir_all(dir).context(|| format!("creating {}", dir.display()))?;
        let config = dir.join(format!("{name}.genkey"));
        std::fs::write(&config, GENKEY.replace("{CN}", common_name))
            .context(|| format!("writing {}", config.display()))?;
        let key = dir.join(format!("{name}.key"));
        let cert = dir.join(format!("{name}.crt"));
        run(Command::new("openssl")
            .args([
                "req", "-new", "-x509", "-nodes", "-utf8", "-sha256", "-batch",
            ])
            .args(["-days", "30", "-newkey", "rsa:2048", "-config"])
            .arg(&config)
            .arg("-keyout")
            .arg(&key)
            .arg("-out")
            .arg(&cert))?;
        let extension = run(Command::new("openssl")
            .args(["x509", "-noout", "-ext", "subjectKeyIdentifier", "-in"])
            .arg(&cert))?;
        let key_id = subject_key_id(&extension)?;
        Ok(Self {
            key,
            cert,
            description: format!("{common_name}: {key_id}"),
            key_id,
        })
    }
}

/// The identifier from `openssl x509 -ext subjectKeyIdentifier` output
/// (`X509v3 Subject Key Identifier: \n    39:52:...:88`), as the kernel prints it.
fn subject_key_id(openssl_text: &str) -> Result<String> {
    let hex: String = openssl_text
        .lines()
        .skip_while(|l| !l.contains("Subject Key Identifier"))
        .nth(1)
        .unwrap_or_default()
        .trim()
        .split(':')
        .collect::<String>()
        .to_ascii_lowercase();
    if hex.is_empty() || !hex.len().is_multiple_of(2) || !hex.bytes().all(|b| b.is_ascii_hexdigit())
    {
        return Err(Error::Invalid(format!(
            "no subject key identifier in the test certificate: `{}`",
            openssl_text.trim()
        )));
    }
    Ok(hex)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_subject_key_id_is_read_as_the_kernel_prints_it() {
        let text = "X509v3 Subject Key Identifier: \n    39:52:68:F0:03:0A:39:A4:28:CE\n";
        assert_eq!(subject_key_id(text).unwrap(), "395268f0030a39a428ce");
        assert!(subject_key_id("").is_err());
        assert!(subject_key_id("X509v3 Subject Key Identifier: \n    zz:01\n").is_err());
    }
}
