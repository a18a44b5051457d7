//! The sample kmod image with firmware: the fleet's sample modules for one kernel
//! (`kmod::build`) plus a firmware file under `/firmware`, pushed to the fleet's
//! registry as `samples/kmm-hello-firmware:<kernel>`. The fleet's own samples carry no
//! firmware.

use flate2::Compression;
use flate2::write::GzEncoder;
use oci_client::client::{ClientConfig, ClientProtocol, Config, ImageLayer};
use oci_client::manifest::{
    IMAGE_CONFIG_MEDIA_TYPE, IMAGE_LAYER_GZIP_MEDIA_TYPE, OciImageManifest,
};
use oci_client::secrets::RegistryAuth;
use oci_client::{Client, Reference};
use serde_json::json;
use sha2::{Digest, Sha256};

use crate::{Error, IoContext, Result, kmod};

pub const REPOSITORY: &str = "samples/kmm-hello-firmware";
/// The image's firmware directory (upstream's `firmwarePath`).
pub const FIRMWARE_PATH: &str = "/firmware";
/// The firmware file, relative to [`FIRMWARE_PATH`] and to the host firmware directory.
pub const FIRMWARE_FILE: &str = "kmm/kmm_hello.fw";

/// The firmware's content: fixed, so the guest can compare it byte for byte.
pub fn firmware_contents(kernel: &str) -> Vec<u8> {
    format!("kmm_hello firmware for {kernel}\n").into_bytes()
}

/// Push the image for `kernel` to `registry` (`host:port`, plain HTTP); the pushed
/// reference's tag is the kernel release.
pub async fn push(registry: &str, kernel: &str) -> Result<()> {
    let root = kmod::build(kernel)?;
    let mut tar = tar::Builder::new(Vec::new());
    tar.mode(tar::HeaderMode::Deterministic);
    tar.append_dir_all("opt", root.join("opt"))
        .context(|| format!("archiving {}", root.display()))?;
    let firmware = firmware_contents(kernel);
    let mut header = tar::Header::new_gnu();
    header.set_size(firmware.len() as u64);
    header.set_mode(0o644);
    header.set_cksum();
    let path = format!("{}/{FIRMWARE_FILE}", FIRMWARE_PATH.trim_start_matches('/'));
    tar.append_data(&mut header, &path, firmware.as_slice())
        .context(|| format!("archiving {path}"))?;
    let tar = tar.into_inner().context(|| "finishing the layer".into())?;
    let diff_id = format!("sha256:{:x}", Sha256::digest(&tar));
    let mut gz = GzEncoder::new(Vec::new(), Compression::default());
    std::io::Write::write_all(&mut gz, &tar).context(|| "compressing the layer".into())?;
    let gzip = gz.finish().context(|| "compressing the layer".into())?;

    let image = format!("{registry}/{REPOSITORY}:{kernel}");
    let reference: Reference = image
        .parse()
        .map_err(|e| Error::Invalid(format!("image reference {image}: {e}")))?;
    let config = json!({
        "architecture": "amd64",
        "os": "linux",
        "rootfs": { "type": "layers", "diff_ids": [diff_id] },
    });
    let config = Config::new(
        serde_json::to_vec(&config).map_err(|e| Error::Invalid(e.to_string()))?,
        IMAGE_CONFIG_MEDIA_TYPE.to_string(),
        None,
    );
    let layers = vec![ImageLayer::new(
        gzip,
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
