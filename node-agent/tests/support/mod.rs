//! Test fixtures: the machine's packages (via `setup.sh`), real sample modules built
//! with gcc against Debian's linux-headers, a real registry (Debian's
//! `docker-registry`) on 127.0.0.1, and images pushed to it with `oci-client`.
//! Every fixture fails with a clear reason when it cannot be set up.

#![allow(dead_code)]

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use kmm_registry_fixture::RegistryServer;
use oci_client::client::{Config, ImageLayer};
use oci_client::manifest::{IMAGE_CONFIG_MEDIA_TYPE, OciImageManifest};
use oci_client::secrets::RegistryAuth;
use oci_client::{Client, Reference};
use sha2::{Digest, Sha256};

pub const GZIP: &str = "application/vnd.oci.image.layer.v1.tar+gzip";
pub const ZSTD: &str = "application/vnd.oci.image.layer.v1.tar+zstd";
pub const MODULE: &str = "kmm_hello";
pub const DEP_MODULE: &str = "kmm_hello_dep";

const SOURCES: &[(&str, &str)] = &[
    ("Kbuild", include_str!("../../../e2e/kmod/Kbuild")),
    ("kmm_hello.c", include_str!("../../../e2e/kmod/kmm_hello.c")),
    (
        "kmm_hello_dep.c",
        include_str!("../../../e2e/kmod/kmm_hello_dep.c"),
    ),
];

/// Polls `ready` until it returns `Some` or the deadline passes.
pub fn poll<T>(what: &str, timeout: Duration, mut ready: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(value) = ready() {
            return value;
        }
        assert!(
            Instant::now() < deadline,
            "timed out after {timeout:?} waiting for {what}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Scratch space under the target directory, kept between runs (module builds).
pub fn scratch() -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("kmm-node-agent");
    std::fs::create_dir_all(&dir).expect("creating the scratch directory");
    dir
}

/// The kernel release the samples are built for (after installing what is missing).
pub fn kernel() -> &'static str {
    static KERNEL: OnceLock<String> = OnceLock::new();
    KERNEL.get_or_init(|| {
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/setup.sh");
        let out = Command::new(&script)
            .stderr(Stdio::inherit())
            .output()
            .unwrap_or_else(|e| panic!("cannot run {}: {e}", script.display()));
        assert!(
            out.status.success(),
            "{} failed ({}): the tests need docker-registry, kmod, gcc, make, openssl and linux-headers",
            script.display(),
            out.status
        );
        String::from_utf8(out.stdout).unwrap().trim().to_string()
    })
}

fn run(command: &mut Command) {
    let shown = format!("{command:?}");
    let out = command
        .output()
        .unwrap_or_else(|e| panic!("cannot run {shown}: {e}"));
    assert!(
        out.status.success(),
        "{shown} failed ({}):\n{}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Builds `kmm_hello.ko` and `kmm_hello_dep.ko` for `kernel` (cached by source hash,
/// locked against concurrent test binaries); returns the directory holding them.
pub fn build_modules(kernel: &str) -> PathBuf {
    let mut hash = Sha256::new();
    for (name, text) in SOURCES {
        hash.update(name.as_bytes());
        hash.update(text.as_bytes());
    }
    let key = format!("{:x}", hash.finalize());
    let base = scratch().join("kmod").join(&key[..16]).join(kernel);
    std::fs::create_dir_all(&base).unwrap();
    let lock = std::fs::File::create(base.join(".lock")).unwrap();
    lock.lock().expect("locking the module build");
    let src = base.join("src");
    if !src.join(format!("{DEP_MODULE}.ko")).is_file() {
        std::fs::create_dir_all(&src).unwrap();
        for (name, text) in SOURCES {
            std::fs::write(src.join(name), text).unwrap();
        }
        run(Command::new("make")
            .arg("-C")
            .arg(format!("/usr/src/linux-headers-{kernel}"))
            .arg(format!("M={}", src.display()))
            .arg("modules"));
    }
    src
}

/// What a sample image holds.
#[derive(Clone, Debug)]
pub struct Sample {
    /// Kernel the modules were built for.
    pub built_for: String,
    /// Kernel directory name in the image (`lib/modules/<this>`).
    pub kernel_dir: String,
    pub modules: Vec<&'static str>,
    /// Run `depmod -b` on the image content (else the agent must).
    pub depmod: bool,
    /// Firmware files under `/firmware`.
    pub firmware: Vec<(String, Vec<u8>)>,
    /// Modules deleted after depmod ran (listed in modules.dep, not shipped).
    pub removed_after_depmod: Vec<&'static str>,
    /// Sign the modules with a throw-away key (`sign-file` from the headers).
    pub signed: bool,
}

impl Sample {
    pub fn good(kernel: &str) -> Self {
        Self {
            built_for: kernel.into(),
            kernel_dir: kernel.into(),
            modules: vec![MODULE, DEP_MODULE],
            depmod: true,
            firmware: vec![("kmm/hello.bin".into(), b"firmware v1".to_vec())],
            removed_after_depmod: vec![],
            signed: false,
        }
    }

    /// The image's filesystem, staged in `dir`.
    pub fn stage(&self, dir: &Path) -> PathBuf {
        let root = dir.join("root");
        let modules = root.join("opt/lib/modules").join(&self.kernel_dir);
        let extra = modules.join("extra");
        std::fs::create_dir_all(&extra).unwrap();
        let built = build_modules(&self.built_for);
        for module in &self.modules {
            std::fs::copy(
                built.join(format!("{module}.ko")),
                extra.join(format!("{module}.ko")),
            )
            .unwrap();
        }
        let order: String = self
            .modules
            .iter()
            .map(|m| format!("extra/{m}.ko\n"))
            .collect();
        std::fs::write(modules.join("modules.order"), order).unwrap();
        std::fs::write(modules.join("modules.builtin"), "").unwrap();
        std::fs::write(modules.join("modules.builtin.modinfo"), "").unwrap();
        if self.depmod {
            run(Command::new("depmod")
                .arg("-b")
                .arg(root.join("opt"))
                .arg(&self.kernel_dir));
        }
        for module in &self.removed_after_depmod {
            std::fs::remove_file(extra.join(format!("{module}.ko"))).unwrap();
        }
        for (path, data) in &self.firmware {
            let path = root.join("firmware").join(path);
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            std::fs::write(path, data).unwrap();
        }
        // Unrelated content a real image carries; never extracted.
        std::fs::create_dir_all(root.join("usr/bin")).unwrap();
        std::fs::write(root.join("usr/bin/tool"), b"#!/bin/sh\n").unwrap();
        root
    }

    /// The image as one uncompressed tar layer.
    pub fn tar(&self) -> Vec<u8> {
        let dir = tempfile::tempdir().unwrap();
        let root = self.stage(dir.path());
        let mut builder = tar::Builder::new(Vec::new());
        builder.mode(tar::HeaderMode::Deterministic);
        for top in ["opt", "firmware", "usr"] {
            if root.join(top).exists() {
                builder.append_dir_all(top, root.join(top)).unwrap();
            }
        }
        builder.into_inner().unwrap()
    }
}

/// A raw tar entry, hostile names allowed.
#[derive(Clone, Debug)]
pub enum Raw {
    File(String, Vec<u8>),
    Symlink(String, String),
    HardLink(String, String),
}

/// A tar layer written with raw headers (names are not sanitised).
pub fn raw_tar(entries: &[Raw]) -> Vec<u8> {
    let mut builder = tar::Builder::new(Vec::new());
    for entry in entries {
        let mut header = tar::Header::new_gnu();
        let (name, link, kind, data): (&str, &str, _, &[u8]) = match entry {
            Raw::File(p, d) => (p, "", tar::EntryType::Regular, d),
            Raw::Symlink(p, t) => (p, t, tar::EntryType::Symlink, &[]),
            Raw::HardLink(p, t) => (p, t, tar::EntryType::Link, &[]),
        };
        header.as_old_mut().name[..name.len()].copy_from_slice(name.as_bytes());
        header.as_old_mut().linkname[..link.len()].copy_from_slice(link.as_bytes());
        header.set_entry_type(kind);
        header.set_size(data.len() as u64);
        header.set_mode(0o644);
        header.set_cksum();
        builder.append(&header, data).unwrap();
    }
    builder.into_inner().unwrap()
}

pub fn gzip(data: &[u8]) -> Vec<u8> {
    let mut encoder = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    encoder.write_all(data).unwrap();
    encoder.finish().unwrap()
}

pub fn zstd(data: &[u8]) -> Vec<u8> {
    zstd::encode_all(data, 3).unwrap()
}

/// A layer to push: media type, blob, and the uncompressed tar's digest.
pub struct PushLayer {
    pub media_type: &'static str,
    pub blob: Vec<u8>,
    pub diff_id: String,
}

pub fn gzip_layer(tar: &[u8]) -> PushLayer {
    PushLayer {
        media_type: GZIP,
        blob: gzip(tar),
        diff_id: format!("sha256:{:x}", Sha256::digest(tar)),
    }
}

pub fn zstd_layer(tar: &[u8]) -> PushLayer {
    PushLayer {
        media_type: ZSTD,
        blob: zstd(tar),
        diff_id: format!("sha256:{:x}", Sha256::digest(tar)),
    }
}

/// A running `docker-registry` (kmm-registry-fixture's), stopped on drop.
pub struct Registry {
    server: RegistryServer,
    /// `127.0.0.1:<port>`
    pub addr: String,
    pub tls: bool,
    pub user: Option<(String, String)>,
}

impl Registry {
    /// Plain HTTP, no authentication (`registryTLS.insecure`).
    pub fn plain() -> Self {
        Self::of(RegistryServer::plain())
    }

    /// HTTPS with a self-signed certificate and htpasswd authentication
    /// (`insecureSkipTLSVerify` and a pull secret).
    pub fn tls_with_auth(user: &str, password: &str) -> Self {
        Self::of(RegistryServer::tls_with_auth(user, password))
    }

    /// HTTPS with a certificate issued by the CA `ca_cert_pem` (key `ca_key_pem`), no
    /// authentication: a registry behind an internal CA.
    pub fn tls_issued_by(ca_cert_pem: &str, ca_key_pem: &str) -> Self {
        Self::of(RegistryServer::tls_issued_by(ca_cert_pem, ca_key_pem))
    }

    fn of(server: kmm_registry_fixture::Result<RegistryServer>) -> Self {
        kernel(); // packages installed
        let server = server.unwrap_or_else(|e| panic!("starting a registry: {e}"));
        Self {
            addr: server.address.clone(),
            tls: server.tls,
            user: server.user.clone(),
            server,
        }
    }

    fn client(&self) -> Client {
        self.server.client()
    }

    fn auth(&self) -> RegistryAuth {
        self.server.auth()
    }

    /// `<addr>/<name>`
    pub fn image(&self, name: &str) -> String {
        self.server.image(name)
    }

    /// Pushes an image made of `layers` as `<addr>/<name>`; returns its digest.
    pub async fn push(&self, name: &str, layers: Vec<PushLayer>) -> String {
        let reference: Reference = self.image(name).parse().unwrap();
        let config = serde_json::json!({
            "architecture": "amd64",
            "os": "linux",
            "rootfs": { "type": "layers", "diff_ids": layers.iter().map(|l| l.diff_id.clone()).collect::<Vec<_>>() },
        });
        let config = Config::new(
            serde_json::to_vec(&config).unwrap(),
            IMAGE_CONFIG_MEDIA_TYPE.to_string(),
            None,
        );
        let layers: Vec<ImageLayer> = layers
            .into_iter()
            .map(|l| ImageLayer::new(l.blob, l.media_type.to_string(), None))
            .collect();
        let manifest = OciImageManifest::build(&layers, &config, None);
        let client = self.client();
        client
            .push(&reference, &layers, config, &self.auth(), Some(manifest))
            .await
            .unwrap_or_else(|e| panic!("pushing {reference}: {e}"));
        client
            .fetch_manifest_digest(&reference, &self.auth())
            .await
            .unwrap_or_else(|e| panic!("digest of {reference}: {e}"))
    }

    /// Pushes a sample image as one gzip layer.
    pub async fn push_sample(&self, name: &str, sample: &Sample) -> String {
        self.push(name, vec![gzip_layer(&sample.tar())]).await
    }
}

/// Every path below `dir` (links not followed).
pub fn tree(dir: &Path) -> Vec<PathBuf> {
    let mut out = vec![];
    if let Ok(entries) = std::fs::read_dir(dir) {
        for entry in entries.flatten() {
            let path = entry.path();
            out.push(path.clone());
            if std::fs::symlink_metadata(&path)
                .map(|m| m.is_dir())
                .unwrap_or(false)
            {
                out.extend(tree(&path));
            }
        }
    }
    out.sort();
    out
}

/// The agent's flags for a simulated node whose directories (state, cache, firmware,
/// kernel) live under `node`, running `kernel`.
pub fn simulated_node_args(node: &Path, kernel: &str) -> Vec<std::ffi::OsString> {
    let dir = |sub: &str| node.join(sub).into_os_string();
    vec![
        "--state-dir".into(),
        dir("run-kmm"),
        "--cache-dir".into(),
        dir("cache"),
        "--firmware-dir".into(),
        dir("firmware"),
        "--kernel-backend".into(),
        "simulated".into(),
        "--simulated-kernel".into(),
        kernel.into(),
        "--simulated-dir".into(),
        dir("kernel"),
    ]
}

/// Starts the real agent binary on a simulated node under `node`, reading its desired
/// modules from `desired_file`, and streams its JSON stdout lines into the receiver.
pub fn spawn_simulated_agent(
    node: &Path,
    kernel: &str,
    desired_file: &Path,
    poll_ms: u64,
    stderr: Stdio,
) -> (Child, std::sync::mpsc::Receiver<serde_json::Value>) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_kmm-node-agent"))
        .args(["--log-format", "json", "run", "--node-name", "node-1"])
        .args(simulated_node_args(node, kernel))
        .arg("--desired-file")
        .arg(desired_file)
        .args(["--desired-poll-ms", &poll_ms.to_string()])
        .args(["--metrics-addr", "127.0.0.1:0"])
        .stdout(Stdio::piped())
        .stderr(stderr)
        .spawn()
        .expect("the kmm-node-agent binary starts");
    let stdout = child.stdout.take().expect("stdout is piped");
    let (tx, lines) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        use std::io::BufRead;
        for line in std::io::BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            let value = serde_json::from_str(&line)
                .unwrap_or_else(|e| panic!("not JSON on stdout: {line}: {e}"));
            if tx.send(value).is_err() {
                break;
            }
        }
    });
    (child, lines)
}
