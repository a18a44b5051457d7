//! kmm-signing against Debian's `sign-file` on the same module-like ELF files (1 MiB and
//! 10 MiB), RSA 2048 and 4096 keys, SHA-256, printed as figures (not a timed test):
//! the median time per module over the runs and the throughput it gives (MB = 10^6
//! bytes). kmm-signing signs bytes in memory, as the hub does; a `sign-file` run
//! includes its process start, reading the key, certificate and module, and writing the
//! signed copy, which is what a signing Pod pays per module.
//!
//! `cargo bench -p kmm-signing`. `KMM_BENCH_RUNS` sets the runs per figure (15).

#[path = "../tests/support/mod.rs"]
mod support;

use std::os::unix::fs::PermissionsExt;
use std::time::Instant;

use kmm_signing::{HashAlgorithm, SigningKey, sign_module};
use support::{elf_module, run_sign_file, sign_file, test_key};

fn median_ms(runs: usize, mut once: impl FnMut()) -> f64 {
    once(); // warm-up: page cache, lazy initialisation
    let mut millis: Vec<f64> = (0..runs)
        .map(|_| {
            let started = Instant::now();
            once();
            started.elapsed().as_secs_f64() * 1000.0
        })
        .collect();
    millis.sort_by(f64::total_cmp);
    millis[millis.len() / 2]
}

fn main() {
    let runs: usize = std::env::var("KMM_BENCH_RUNS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(15);
    sign_file();
    let dir = tempfile::tempdir().expect("a temporary directory");
    for bits in [2048, 4096] {
        let test = test_key(bits, &format!("kmm-signing bench rsa{bits}"));
        let key = SigningKey::from_pem(&test.key_pem, &test.cert_pem).expect("the test key");
        // sign-file reads files: the throw-away key goes to the temporary directory.
        let key_path = dir.path().join(format!("rsa{bits}.key.pem"));
        std::fs::write(&key_path, &test.key_pem).expect("writing the test key");
        std::fs::set_permissions(&key_path, std::fs::Permissions::from_mode(0o600))
            .expect("key permissions");
        let cert_path = dir.path().join(format!("rsa{bits}.cert.pem"));
        std::fs::write(&cert_path, &test.cert_pem).expect("writing the certificate");
        for mib in [1, 10] {
            let bytes = mib << 20;
            let module = elf_module(bytes, mib as u64);
            let module_path = dir.path().join(format!("{mib}mib.ko"));
            std::fs::write(&module_path, &module).expect("writing the module");
            let dest = dir.path().join("signed.ko");

            let mut ours = Vec::new();
            let native = median_ms(runs, || {
                ours =
                    sign_module("bench.ko", &module, &key, HashAlgorithm::Sha256).expect("signing");
            });
            let mut theirs = Vec::new();
            let external = median_ms(runs, || {
                theirs = run_sign_file("sha256", &key_path, &cert_path, &module_path, &dest);
            });
            assert!(ours == theirs, "kmm-signing and sign-file disagree");
            let mb_per_s = |ms: f64| bytes as f64 / 1e6 / (ms / 1000.0);
            for (who, ms) in [("kmm-signing", native), ("sign-file", external)] {
                println!(
                    "signing: {who:<11} rsa{bits} sha256 {mib:>2} MiB: {ms:8.2} ms/module, {:7.1} MB/s (median of {runs})",
                    mb_per_s(ms)
                );
            }
            println!(
                "signing: rsa{bits} sha256 {mib:>2} MiB: kmm-signing takes {:.2}x sign-file's time",
                native / external
            );
        }
    }
}
