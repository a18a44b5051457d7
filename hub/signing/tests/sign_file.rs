//! kmm-signing's output is byte for byte what Debian's `sign-file` writes, for real
//! kernel modules (built here from the e2e samples against Debian's linux-headers),
//! already-signed ones, RSA 2048 and 4096 keys, and every supported hash.
//!
//! The only place the crate's tests write a key to disk: sign-file reads files.

mod support;

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use kmm_signing::{HashAlgorithm, SigningKey, sign_module};
use support::*;

/// An input: its name, the bare module, and the bytes to sign (the bare module, or
/// one sign-file already signed, once or twice, with another key).
struct Input {
    name: String,
    bare: Vec<u8>,
    bytes: Vec<u8>,
}

/// Built once per test binary; in memory, so that the temporary directory (which held
/// another throw-away key for sign-file) is gone once they are made.
fn inputs() -> &'static [Input] {
    static INPUTS: OnceLock<Vec<Input>> = OnceLock::new();
    INPUTS.get_or_init(|| {
        let dir = tempfile::tempdir().unwrap();
        let modules = build_modules(dir.path());
        let mut inputs: Vec<Input> = modules
            .iter()
            .map(|path| {
                let bytes = std::fs::read(path).unwrap();
                Input {
                    name: path.file_name().unwrap().to_string_lossy().into_owned(),
                    bare: bytes.clone(),
                    bytes,
                }
            })
            .collect();
        let other = test_key(2048, "an earlier signing key");
        let (key, cert) = write_key(dir.path(), "other", &other);
        let hello = &modules[0];
        let bare = std::fs::read(hello).unwrap();
        let once = dir.path().join("signed-once.ko");
        let once_bytes = run_sign_file("sha256", &key, &cert, hello, &once);
        let twice = dir.path().join("signed-twice.ko");
        let twice_bytes = run_sign_file("sha512", &key, &cert, &once, &twice);
        inputs.push(Input {
            name: "kmm_hello.ko, already signed".into(),
            bare: bare.clone(),
            bytes: once_bytes,
        });
        inputs.push(Input {
            name: "kmm_hello.ko, signed twice (stacked by sign-file)".into(),
            bare,
            bytes: twice_bytes,
        });
        // A module-like file larger than the real ones: its digest spans many blocks.
        let large = elf_module(3 << 20, 7);
        inputs.push(Input {
            name: "3 MiB ELF-like file".into(),
            bare: large.clone(),
            bytes: large,
        });
        inputs
    })
}

/// Writes the key (mode 0600) and certificate for sign-file; returns their paths.
fn write_key(dir: &Path, name: &str, key: &TestKey) -> (PathBuf, PathBuf) {
    let key_path = dir.join(format!("{name}.key.pem"));
    std::fs::write(&key_path, &key.key_pem).unwrap();
    std::fs::set_permissions(&key_path, std::fs::Permissions::from_mode(0o600)).unwrap();
    let cert_path = dir.join(format!("{name}.cert.pem"));
    std::fs::write(&cert_path, &key.cert_pem).unwrap();
    (key_path, cert_path)
}

fn same_as_sign_file(bits: u32) {
    let test = test_key(bits, &format!("kmm-signing rsa{bits}"));
    let key = SigningKey::from_pem(&test.key_pem, &test.cert_pem).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let (key_path, cert_path) = write_key(dir.path(), "signer", &test);
    let mut compared = 0;
    for hash in HashAlgorithm::ALL {
        for input in inputs() {
            let ours = sign_module(&input.name, &input.bytes, &key, hash).unwrap();
            let bare = dir.path().join("bare.ko");
            std::fs::write(&bare, &input.bare).unwrap();
            let dest = dir.path().join("signed.ko");
            let theirs = run_sign_file(hash.name(), &key_path, &cert_path, &bare, &dest);
            assert!(
                ours == theirs,
                "rsa{bits} {hash} {}: {} bytes from kmm-signing, {} from sign-file; first \
                 difference at byte {:?}",
                input.name,
                ours.len(),
                theirs.len(),
                ours.iter().zip(&theirs).position(|(a, b)| a != b)
            );
            if input.bytes != input.bare {
                // sign-file itself would stack a second signature onto a signed module.
                let src = dir.path().join("input.ko");
                std::fs::write(&src, &input.bytes).unwrap();
                let stacked = run_sign_file(hash.name(), &key_path, &cert_path, &src, &dest);
                assert!(stacked.len() > ours.len(), "{}", input.name);
            }
            compared += 1;
        }
    }
    assert_eq!(compared, 3 * 5);
}

#[test]
fn rsa2048_output_is_sign_files() {
    same_as_sign_file(2048);
}

#[test]
fn rsa4096_output_is_sign_files() {
    same_as_sign_file(4096);
}
