//! The images real nodes need, built here from files on this machine (no image can be
//! downloaded) and pushed to the fleet's registry:
//!
//! * `kmm-fleet/pause:<kubernetes version>`, the sandbox image: Kubernetes' own
//!   `build/pause/linux/pause.c` from the pinned `k8s.io/kubernetes` module, compiled
//!   statically with gcc;
//! * `kmm-fleet/probe:<source hash>`: `e2e/nodes/probe`, a static Go program that checks
//!   a pod's in-cluster access to its apiserver (and can serve a page on :8080).

use std::path::{Path, PathBuf};
use std::process::Command;

use oci_client::client::{ClientConfig, ClientProtocol, Config, ImageLayer};
use oci_client::manifest::{
    IMAGE_CONFIG_MEDIA_TYPE, IMAGE_LAYER_GZIP_MEDIA_TYPE, OciImageManifest,
};
use oci_client::secrets::RegistryAuth;
use oci_client::{Client, Reference};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use sha2::{Digest, Sha256};

use crate::process::run;
use crate::toolchain::go_module_dir;
use crate::{Error, IoContext, Result, cache_dir, cache_entry};

/// The probe's sources (standard library only).
const PROBE_SOURCES: &[(&str, &str)] = &[
    ("go.mod", include_str!("../../../nodes/probe/go.mod")),
    ("main.go", include_str!("../../../nodes/probe/main.go")),
];

/// The pushed images, named as pods and containerd on the real nodes pull them
/// (`<bridge address>:<registry port>/...`).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct NodeImages {
    /// The sandbox image of every pod (containerd's `sandbox_image`).
    pub pause: String,
    /// The in-cluster probe (`/probe [-serve TEXT]`, see `e2e/nodes/probe`).
    pub probe: String,
}

/// Build (cached) and push both images through `registry` (loopback); name them by
/// `node_registry`, the same registry as the nodes reach it.
pub async fn push(
    registry: &str,
    node_registry: &str,
    kubernetes_version: &str,
) -> Result<NodeImages> {
    let pause = pause_binary(kubernetes_version)?;
    let pause_layer = layer(|tar| append_file(tar, "pause", &pause))?;
    let pause_tag = format!("kmm-fleet/pause:{kubernetes_version}");
    push_image(
        registry,
        &pause_tag,
        pause_layer,
        json!({ "Entrypoint": ["/pause"] }),
    )
    .await?;

    let (probe, hash) = probe_binary()?;
    let probe_layer = layer(|tar| append_file(tar, "probe", &probe))?;
    let probe_tag = format!("kmm-fleet/probe:{hash}");
    push_image(
        registry,
        &probe_tag,
        probe_layer,
        json!({ "Entrypoint": ["/probe"] }),
    )
    .await?;
    Ok(NodeImages {
        pause: format!("{node_registry}/{pause_tag}"),
        probe: format!("{node_registry}/{probe_tag}"),
    })
}

/// `<cache>/node-images/pause-<version>/pause`, compiled once per Kubernetes version.
fn pause_binary(kubernetes_version: &str) -> Result<PathBuf> {
    let dir = cache_dir()
        .join("node-images")
        .join(format!("pause-{kubernetes_version}"));
    let binary = dir.join("pause");
    cache_entry::once(
        &dir,
        || binary.is_file(),
        || {
            let module = go_module_dir(&format!("k8s.io/kubernetes@{kubernetes_version}"))?;
            let source = module.join("build/pause/linux/pause.c");
            std::fs::create_dir_all(&dir).context(|| format!("creating {}", dir.display()))?;
            let partial = dir.join("pause.partial");
            run(Command::new("gcc")
                .args(["-Os", "-static", "-s"])
                .arg(format!("-DVERSION={kubernetes_version}"))
                .arg("-o")
                .arg(&partial)
                .arg(&source))?;
            std::fs::rename(&partial, &binary).context(|| format!("writing {}", binary.display()))
        },
    )?;
    Ok(binary)
}

/// `<cache>/node-images/probe-<source hash>/probe` and the hash: built once per source
/// version, statically (no libc in the image).
fn probe_binary() -> Result<(PathBuf, String)> {
    let mut digest = Sha256::new();
    for (name, text) in PROBE_SOURCES {
        digest.update(name.as_bytes());
        digest.update(text.as_bytes());
    }
    let hash = format!("{:x}", digest.finalize())[..12].to_string();
    let dir = cache_dir()
        .join("node-images")
        .join(format!("probe-{hash}"));
    let binary = dir.join("probe");
    cache_entry::once(
        &dir,
        || binary.is_file(),
        || {
            let src = dir.join("src");
            std::fs::create_dir_all(&src).context(|| format!("creating {}", src.display()))?;
            for (name, text) in PROBE_SOURCES {
                std::fs::write(src.join(name), text).context(|| format!("writing {name}"))?;
            }
            let partial = dir.join("probe.partial");
            run(Command::new("go")
                .args(["build", "-trimpath", "-ldflags=-s -w", "-o"])
                .arg(&partial)
                .arg(".")
                .current_dir(&src)
                .env("CGO_ENABLED", "0"))?;
            std::fs::rename(&partial, &binary).context(|| format!("writing {}", binary.display()))
        },
    )?;
    Ok((binary, hash))
}

/// An image's single layer as gzip, and its uncompressed digest (the config's diff_id).
struct Layer {
    gzip: Vec<u8>,
    diff_id: String,
}

fn layer(fill: impl FnOnce(&mut tar::Builder<Vec<u8>>) -> Result<()>) -> Result<Layer> {
    let mut tar = tar::Builder::new(Vec::new());
    tar.mode(tar::HeaderMode::Deterministic);
    fill(&mut tar)?;
    let tar = tar
        .into_inner()
        .context(|| "finishing the layer tar".into())?;
    let diff_id = format!("sha256:{:x}", Sha256::digest(&tar));
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    std::io::Write::write_all(&mut gz, &tar).context(|| "compressing the layer".into())?;
    let gzip = gz.finish().context(|| "compressing the layer".into())?;
    Ok(Layer { gzip, diff_id })
}

fn append_file(tar: &mut tar::Builder<Vec<u8>>, path: &str, from: &Path) -> Result<()> {
    let contents = std::fs::read(from).context(|| format!("reading {}", from.display()))?;
    let mut header = tar::Header::new_gnu();
    header.set_size(contents.len() as u64);
    header.set_mode(0o755);
    tar.append_data(&mut header, path, contents.as_slice())
        .context(|| format!("archiving {path}"))
}

async fn push_image(registry: &str, name: &str, layer: Layer, config: Value) -> Result<()> {
    let image = format!("{registry}/{name}");
    let reference: Reference = image
        .parse()
        .map_err(|e| Error::Invalid(format!("image reference {image}: {e}")))?;
    let config = json!({
        "architecture": "amd64",
        "os": "linux",
        "config": config,
        "rootfs": { "type": "layers", "diff_ids": [layer.diff_id] },
    });
    let config = Config::new(
        serde_json::to_vec(&config).map_err(|e| Error::Invalid(e.to_string()))?,
        IMAGE_CONFIG_MEDIA_TYPE.to_string(),
        None,
    );
    let layers = vec![ImageLayer::new(
        layer.gzip,
        IMAGE_LAYER_GZIP_MEDIA_TYPE.to_string(),
        None,
    )];
    let manifest = OciImageManifest::build(&layers, &config, None);
    let client = Client::new(ClientConfig {
        protocol: ClientProtocol::Http,
        ..Default::default()
    });
    client
        .push(
            &reference,
            &layers,
            config,
            &RegistryAuth::Anonymous,
            Some(manifest),
        )
        .await?;
    Ok(())
}
