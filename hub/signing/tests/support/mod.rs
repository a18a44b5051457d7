//! Shared by the crate's unit tests, the sign-file comparison test and the benchmark:
//! throw-away keys, module-like inputs, Debian's sign-file and a real kernel module.

// Each user (the unit tests, a test binary, the benchmark) uses a different part.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::Command;

use openssl::asn1::Asn1Time;
use openssl::bn::{BigNum, MsbOption};
use openssl::hash::MessageDigest;
use openssl::nid::Nid;
use openssl::pkey::{PKey, Private};
use openssl::rsa::Rsa;
use openssl::x509::extension::{
    AuthorityKeyIdentifier, BasicConstraints, KeyUsage, SubjectKeyIdentifier,
};
use openssl::x509::{X509, X509NameBuilder};

/// Debian's sign-file (package linux-kbuild-6.1).
pub const SIGN_FILE: &str = "/usr/lib/linux-kbuild-6.1/scripts/sign-file";

/// A key and its self-signed certificate, both PEM, in memory.
pub struct TestKey {
    pub key_pem: Vec<u8>,
    pub cert_pem: Vec<u8>,
    pub key: PKey<Private>,
    pub cert: X509,
}

/// What `openssl req -new -x509 -newkey rsa:<bits> -nodes -config x509.genkey` makes:
/// an RSA key and a self-signed certificate with the extensions the kernel's
/// `certs/default_x509.genkey` asks for.
pub fn test_key(bits: u32, common_name: &str) -> TestKey {
    let key = PKey::from_rsa(Rsa::generate(bits).unwrap()).unwrap();
    let cert = self_signed(&key, common_name);
    TestKey {
        key_pem: key.private_key_to_pem_pkcs8().unwrap(),
        cert_pem: cert.to_pem().unwrap(),
        key,
        cert,
    }
}

/// A certificate for `key`, signed by `key` (the subject is also the issuer).
pub fn self_signed(key: &PKey<Private>, common_name: &str) -> X509 {
    // 159 random bits, as openssl req draws them: positive, sometimes with a leading
    // 1 bit in its top byte, so DER needs a zero byte before it.
    let mut serial = BigNum::new().unwrap();
    serial.rand(159, MsbOption::MAYBE_ZERO, false).unwrap();
    self_signed_with_serial(key, common_name, &serial)
}

pub fn self_signed_with_serial(key: &PKey<Private>, common_name: &str, serial: &BigNum) -> X509 {
    let mut name = X509NameBuilder::new().unwrap();
    name.append_entry_by_nid(Nid::ORGANIZATIONNAME, "kmm-fleet tests")
        .unwrap();
    name.append_entry_by_nid(Nid::COMMONNAME, common_name)
        .unwrap();
    let name = name.build();
    let mut builder = X509::builder().unwrap();
    builder.set_version(2).unwrap();
    builder
        .set_serial_number(&serial.to_asn1_integer().unwrap())
        .unwrap();
    builder.set_subject_name(&name).unwrap();
    builder.set_issuer_name(&name).unwrap();
    builder.set_pubkey(key).unwrap();
    builder
        .set_not_before(&Asn1Time::days_from_now(0).unwrap())
        .unwrap();
    builder
        .set_not_after(&Asn1Time::days_from_now(36500).unwrap())
        .unwrap();
    builder
        .append_extension(BasicConstraints::new().critical().build().unwrap())
        .unwrap();
    builder
        .append_extension(KeyUsage::new().digital_signature().build().unwrap())
        .unwrap();
    let ski = SubjectKeyIdentifier::new()
        .build(&builder.x509v3_context(None, None))
        .unwrap();
    builder.append_extension(ski).unwrap();
    let aki = AuthorityKeyIdentifier::new()
        .keyid(false)
        .build(&builder.x509v3_context(None, None))
        .unwrap();
    builder.append_extension(aki).unwrap();
    builder.sign(key, MessageDigest::sha256()).unwrap();
    builder.build()
}

/// `len` bytes that start like a relocatable x86-64 ELF file and go on with
/// pseudo-random bytes (seeded: the same arguments give the same bytes).
pub fn elf_module(len: usize, seed: u64) -> Vec<u8> {
    let mut out = b"\x7fELF\x02\x01\x01\0\0\0\0\0\0\0\0\0\x01\0\x3e\0\x01\0\0\0".to_vec();
    let mut state = seed ^ 0x9e37_79b9_7f4a_7c15;
    while out.len() < len {
        // xorshift64*: cheap, and enough to keep compressors from shrinking it away.
        state ^= state >> 12;
        state ^= state << 25;
        state ^= state >> 27;
        out.extend_from_slice(&state.wrapping_mul(0x2545_f491_4f6c_dd1d).to_le_bytes());
    }
    out.truncate(len);
    out
}

/// Debian's sign-file; fails (never skips) when the package is missing.
pub fn sign_file() -> &'static Path {
    let path = Path::new(SIGN_FILE);
    assert!(
        path.is_file(),
        "{SIGN_FILE} is missing: install Debian's linux-kbuild-6.1 package \
         (`apt-get install linux-kbuild-6.1`, or `cargo xtask env setup`)"
    );
    path
}

/// Runs `sign-file <hash> <key> <cert> <module> <dest>` and returns what it wrote.
pub fn run_sign_file(hash: &str, key: &Path, cert: &Path, module: &Path, dest: &Path) -> Vec<u8> {
    let out = Command::new(sign_file())
        .args([hash.as_ref(), key.as_os_str(), cert.as_os_str()])
        .arg(module)
        .arg(dest)
        .output()
        .unwrap_or_else(|e| panic!("running {SIGN_FILE}: {e}"));
    assert!(
        out.status.success(),
        "sign-file {hash} {} failed ({}): {}",
        module.display(),
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    std::fs::read(dest).unwrap()
}

/// The newest installed `/usr/src/linux-headers-<version>-<abi>-amd64` (the generic
/// flavour, not cloud or rt); fails naming the package when there is none.
pub fn kernel_headers() -> PathBuf {
    let mut found: Vec<(Vec<u64>, PathBuf)> = std::fs::read_dir("/usr/src")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|entry| {
            let name = entry.file_name().into_string().ok()?;
            let release = name
                .strip_prefix("linux-headers-")?
                .strip_suffix("-amd64")?;
            // "6.1.0-56": digits, dots and one dash only.
            let (version, abi) = release.split_once('-')?;
            let mut key: Vec<u64> = version
                .split('.')
                .map(|n| n.parse().ok())
                .collect::<Option<_>>()?;
            key.push(abi.parse().ok()?);
            entry
                .path()
                .join("Makefile")
                .is_file()
                .then(|| (key, entry.path()))
        })
        .collect();
    found.sort();
    found.pop().map(|(_, path)| path).unwrap_or_else(|| {
        panic!(
            "no /usr/src/linux-headers-*-amd64: install Debian's linux-headers-amd64 package \
             (or `cargo xtask env setup`), with gcc and make, to build a real module"
        )
    })
}

/// Builds the e2e sample modules (`e2e/kmod/`) in `dir`; returns the `.ko` files.
pub fn build_modules(dir: &Path) -> Vec<PathBuf> {
    let sources = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../e2e/kmod");
    for name in ["Kbuild", "kmm_hello.c", "kmm_hello_dep.c"] {
        std::fs::copy(sources.join(name), dir.join(name))
            .unwrap_or_else(|e| panic!("copying {name} from {}: {e}", sources.display()));
    }
    let headers = kernel_headers();
    let out = Command::new("make")
        .arg("-C")
        .arg(&headers)
        .arg(format!("M={}", dir.display()))
        .arg("modules")
        .output()
        .unwrap_or_else(|e| panic!("running make (Debian packages make and gcc): {e}"));
    assert!(
        out.status.success(),
        "building the sample modules against {} failed ({}):\n{}\n{}",
        headers.display(),
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    ["kmm_hello.ko", "kmm_hello_dep.ko"]
        .map(|name| dir.join(name))
        .to_vec()
}
