//! Sample kmod images: real out-of-tree modules (`e2e/kmod/`) built with gcc against
//! Debian's linux-headers for each sample kernel, laid out as KMM expects
//! (`/opt/lib/modules/<kernel>/` with `modules.dep` from `depmod -b`), and pushed to
//! the fleet's registry (Debian's `docker-registry`) as `samples/kmm-hello:<kernel>`.

use crate::process::run;
use std::path::{Path, PathBuf};
use std::process::Command;

use flate2::Compression;
use flate2::write::GzEncoder;
use oci_client::client::{ClientConfig, ClientProtocol, Config, ImageLayer};
use oci_client::manifest::{
    IMAGE_CONFIG_MEDIA_TYPE, IMAGE_LAYER_GZIP_MEDIA_TYPE, OciImageManifest,
};
use oci_client::secrets::RegistryAuth;
use oci_client::{Client, Reference};
use serde::{Deserialize, Serialize};
use serde_json::json;
use sha2::{Digest, Sha256};

use crate::{Error, IoContext, Result, cache_dir, cache_entry};

const SOURCES: &[(&str, &str)] = &[
    ("Kbuild", include_str!("../kmod/Kbuild")),
    ("kmm_hello.c", include_str!("../kmod/kmm_hello.c")),
    ("kmm_hello_dep.c", include_str!("../kmod/kmm_hello_dep.c")),
];
/// The modules every sample image holds, in load order.
pub const MODULES: &[&str] = &["kmm_hello", "kmm_hello_dep"];
pub const REPOSITORY: &str = "samples/kmm-hello";

/// A pushed sample image.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SampleImage {
    pub kernel: String,
    /// `<registry>/samples/kmm-hello:<kernel>`
    pub image: String,
    pub digest: String,
}

/// Debian packages the samples need (besides gcc, make and kmod).
pub fn header_packages(kernels: &[String]) -> Vec<String> {
    kernels
        .iter()
        .map(|k| format!("linux-headers-{k}"))
        .collect()
}

/// Build (or reuse) the modules for every kernel and push one image per kernel.
pub async fn push_samples(registry: &str, kernels: &[String]) -> Result<Vec<SampleImage>> {
    let mut images = vec![];
    for kernel in kernels {
        images.push(push(registry, REPOSITORY, kernel, &[]).await?);
    }
    Ok(images)
}

/// A file an image carries besides the modules (firmware, ...).
#[derive(Debug, Clone)]
pub struct ImageFile {
    /// Path inside the image, relative to its root (`firmware/x.fw`).
    pub path: String,
    pub contents: Vec<u8>,
}

/// Push `<registry>/<repository>:<kernel>` (plain HTTP): one layer with the sample
/// modules built for `kernel` ([`build`]) under `opt/` and `extra` files.
pub async fn push(
    registry: &str,
    repository: &str,
    kernel: &str,
    extra: &[ImageFile],
) -> Result<SampleImage> {
    push_root(registry, repository, kernel, kernel, &build(kernel)?, extra).await
}

/// Push the sample for a kernel release no headers exist for (the real nodes report this
/// machine's): the modules built for `donor`, retargeted to `release` ([`retarget`]).
pub async fn push_retargeted(registry: &str, donor: &str, release: &str) -> Result<SampleImage> {
    let root = retarget(&build(donor)?, donor, release)?;
    push_root(registry, REPOSITORY, release, release, &root, &[]).await
}

/// A copy of the modules built for `kernel` ([`build`]) as `<dir>/root`, to change
/// (sign) without changing the cache; `dir` must not hold a `root` yet.
pub fn copy_built(kernel: &str, dir: &Path) -> Result<PathBuf> {
    let built = build(kernel)?;
    std::fs::create_dir_all(dir).context(|| format!("creating {}", dir.display()))?;
    let root = dir.join("root");
    run(Command::new("cp").arg("-a").arg(&built).arg(&root))?;
    Ok(root)
}

/// Push `root`, laid out as [`build`] lays out the modules for `kernel`, as
/// `<registry>/<repository>:<tag>` (plain HTTP) with `extra` files.
pub async fn push_root(
    registry: &str,
    repository: &str,
    kernel: &str,
    tag: &str,
    root: &Path,
    extra: &[ImageFile],
) -> Result<SampleImage> {
    let layer = layer(root, extra)?;
    let image = format!("{registry}/{repository}:{tag}");
    let reference: Reference = image
        .parse()
        .map_err(|e| Error::Invalid(format!("image reference {image}: {e}")))?;
    let config = json!({
        "architecture": "amd64",
        "os": "linux",
        "config": { "Labels": { "kmm-fleet.dev/kernel": kernel } },
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
    let response = client
        .push(
            &reference,
            &layers,
            config,
            &RegistryAuth::Anonymous,
            Some(manifest),
        )
        .await?;
    let digest = response
        .manifest_url
        .rsplit('/')
        .next()
        .unwrap_or_default()
        .to_string();
    Ok(SampleImage {
        kernel: kernel.to_string(),
        image,
        digest,
    })
}

/// Build the modules for `kernel` into `<cache>/kmod/<source hash>/<kernel>/root`,
/// whose `opt/lib/modules/<kernel>/` is the image content; cached by source hash.
pub fn build(kernel: &str) -> Result<PathBuf> {
    let root = compile(kernel, SOURCES, MODULES)?;
    let modules = root.join("opt/lib/modules").join(kernel);
    if !modules.join("modules.dep").is_file() {
        index(&root, kernel)?;
    }
    Ok(root)
}

/// Compiles `sources` (a Kbuild and its C files) against Debian's headers for `kernel`
/// and places `modules` in `<root>/opt/lib/modules/<kernel>/extra/`, under
/// `<cache>/kmod/<source hash>/<kernel>/root`; cached by source hash. Indexing is the
/// caller's.
pub fn compile(kernel: &str, sources: &[(&str, &str)], modules: &[&str]) -> Result<PathBuf> {
    let mut hash = Sha256::new();
    for (name, text) in sources {
        hash.update(name.as_bytes());
        hash.update(text.as_bytes());
    }
    let digest = format!("{:x}", hash.finalize());
    let base = cache_dir().join("kmod").join(&digest[..16]).join(kernel);
    let root = base.join("root");
    let extra = root.join("opt/lib/modules").join(kernel).join("extra");
    let ready = || {
        modules
            .iter()
            .all(|module| extra.join(format!("{module}.ko")).is_file())
    };
    cache_entry::once(&base, ready, || {
        let headers = PathBuf::from(format!("/usr/src/linux-headers-{kernel}"));
        if !headers.is_dir() {
            return Err(Error::Invalid(format!(
                "{} is missing: run `cargo xtask env setup` (apt package linux-headers-{kernel})",
                headers.display()
            )));
        }
        let src = base.join("src");
        std::fs::create_dir_all(&src).context(|| format!("creating {}", src.display()))?;
        for (name, text) in sources {
            std::fs::write(src.join(name), text).context(|| format!("writing {name}"))?;
        }
        run(Command::new("make")
            .arg("-C")
            .arg(&headers)
            .arg(format!("M={}", src.display()))
            .arg("modules"))?;
        std::fs::create_dir_all(&extra).context(|| format!("creating {}", extra.display()))?;
        for module in modules {
            let ko = format!("{module}.ko");
            // Copied aside and renamed: a reader outside the lock sees a whole file or none.
            let partial = extra.join(format!("{ko}.partial"));
            std::fs::copy(src.join(&ko), &partial).context(|| format!("copying {ko}"))?;
            std::fs::rename(&partial, extra.join(&ko)).context(|| format!("renaming {ko}"))?;
        }
        Ok(())
    })?;
    Ok(root)
}

/// Writes the index files depmod reads besides the modules in `extra/` (the samples
/// have no built-ins) and runs `depmod` on `<root>/opt/lib/modules/<kernel>/`.
fn index(root: &Path, kernel: &str) -> Result<()> {
    let modules = root.join("opt/lib/modules").join(kernel);
    let order: String = MODULES.iter().map(|m| format!("extra/{m}.ko\n")).collect();
    for (file, contents) in [
        ("modules.order", order.as_str()),
        ("modules.builtin", ""),
        ("modules.builtin.modinfo", ""),
    ] {
        std::fs::write(modules.join(file), contents).context(|| format!("writing {file}"))?;
    }
    run(Command::new("depmod")
        .arg("-b")
        .arg(root.join("opt"))
        .arg(kernel))?;
    Ok(())
}

/// The modules of `donor_root` (built for `donor`) with `vermagic` naming `release`
/// instead, rewritten in their `.modinfo` sections with `objcopy`, in
/// `<donor_root>/../retargeted/<release>/root`. Only the simulated kernel backend takes
/// them (it checks the release a module was built for; no kernel loads them): it is how
/// the real nodes, whose kernel has no headers, get a sample image.
pub fn retarget(donor_root: &Path, donor: &str, release: &str) -> Result<PathBuf> {
    let base = donor_root
        .parent()
        .unwrap_or(donor_root)
        .join("retargeted")
        .join(release);
    let root = base.join("root");
    let modules = root.join("opt/lib/modules").join(release);
    if modules.join("modules.dep").is_file() {
        return Ok(root);
    }
    let extra = modules.join("extra");
    std::fs::create_dir_all(&extra).context(|| format!("creating {}", extra.display()))?;
    for module in MODULES {
        let ko = format!("{module}.ko");
        let from = donor_root
            .join("opt/lib/modules")
            .join(donor)
            .join("extra")
            .join(&ko);
        let modinfo = base.join(format!("{module}.modinfo"));
        run(Command::new("objcopy")
            .arg(format!("--dump-section=.modinfo={}", modinfo.display()))
            .arg(&from)
            .arg(base.join("scratch.ko")))?;
        let original =
            std::fs::read(&modinfo).context(|| format!("reading {}", modinfo.display()))?;
        std::fs::write(&modinfo, retarget_modinfo(&original, donor, release)?)
            .context(|| format!("writing {}", modinfo.display()))?;
        run(Command::new("objcopy")
            .arg(format!("--update-section=.modinfo={}", modinfo.display()))
            .arg(&from)
            .arg(extra.join(&ko)))?;
    }
    index(&root, release)?;
    Ok(root)
}

/// `.modinfo` (NUL-separated `key=value` entries) with the release in `vermagic=`
/// replaced; the rest of the vermagic (SMP, preempt, ...) is kept.
fn retarget_modinfo(modinfo: &[u8], donor: &str, release: &str) -> Result<Vec<u8>> {
    let prefix = format!("vermagic={donor} ");
    let mut found = false;
    let entries: Vec<Vec<u8>> = modinfo
        .split(|b| *b == 0)
        .map(|entry| match entry.strip_prefix(prefix.as_bytes()) {
            Some(rest) => {
                found = true;
                [format!("vermagic={release} ").as_bytes(), rest].concat()
            }
            None => entry.to_vec(),
        })
        .collect();
    if !found {
        return Err(Error::Invalid(format!(
            "no `{prefix}` entry in the module's .modinfo"
        )));
    }
    Ok(entries.join(&0u8))
}

/// The image's single layer: `opt/` of `root` and the extra files, as an uncompressed
/// tar (for the config's diff_id) and gzip-compressed (the blob).
struct Layer {
    gzip: Vec<u8>,
    diff_id: String,
}

fn layer(root: &Path, extra: &[ImageFile]) -> Result<Layer> {
    let mut tar = tar::Builder::new(Vec::new());
    tar.mode(tar::HeaderMode::Deterministic);
    // A link stays a link (upstream's in-tree dependency link points at the node's tree).
    tar.follow_symlinks(false);
    tar.append_dir_all("opt", root.join("opt"))
        .context(|| format!("archiving {}", root.display()))?;
    for file in extra {
        let mut header = tar::Header::new_gnu();
        header.set_size(file.contents.len() as u64);
        header.set_mode(0o644);
        header.set_cksum();
        tar.append_data(&mut header, &file.path, file.contents.as_slice())
            .context(|| format!("archiving {}", file.path))?;
    }
    let tar = tar
        .into_inner()
        .context(|| "finishing the layer tar".into())?;
    let diff_id = format!("sha256:{:x}", Sha256::digest(&tar));
    let mut gz = GzEncoder::new(Vec::new(), Compression::default());
    std::io::Write::write_all(&mut gz, &tar).context(|| "compressing the layer".into())?;
    let gzip = gz.finish().context(|| "compressing the layer".into())?;
    Ok(Layer { gzip, diff_id })
}

/// Tags `image:from` also as `image:to` in `registry` (the same manifest under a new tag):
/// a new version of the image without rebuilding it.
pub async fn retag(registry: &str, image: &str, from: &str, to: &str) -> Result<()> {
    let client = Client::new(ClientConfig {
        protocol: ClientProtocol::Http,
        ..Default::default()
    });
    let reference = |tag: &str| -> Result<Reference> {
        format!("{registry}/{image}:{tag}")
            .parse()
            .map_err(|e| Error::Invalid(format!("{registry}/{image}:{tag}: {e}")))
    };
    let (source, target) = (reference(from)?, reference(to)?);
    let (manifest, _) = client
        .pull_manifest_raw(
            &source,
            &RegistryAuth::Anonymous,
            &[
                "application/vnd.oci.image.manifest.v1+json",
                "application/vnd.docker.distribution.manifest.v2+json",
            ],
        )
        .await?;
    let media_type = serde_json::from_slice::<serde_json::Value>(&manifest)
        .map_err(|e| Error::Invalid(format!("the manifest of {source}: {e}")))?["mediaType"]
        .as_str()
        .unwrap_or("application/vnd.oci.image.manifest.v1+json")
        .parse()
        .map_err(|e| Error::Invalid(format!("the media type of {source}: {e}")))?;
    client
        .push_manifest_raw(&target, manifest.to_vec(), media_type)
        .await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retargeting_replaces_only_the_release_of_the_vermagic() {
        let modinfo = b"license=GPL\0vermagic=6.1.0-1-amd64 SMP preempt mod_unload \0name=x\0";
        let out = retarget_modinfo(modinfo, "6.1.0-1-amd64", "6.18.7").unwrap();
        assert_eq!(
            out,
            b"license=GPL\0vermagic=6.18.7 SMP preempt mod_unload \0name=x\0".to_vec()
        );
        assert!(retarget_modinfo(b"license=GPL\0", "6.1.0-1-amd64", "6.18.7").is_err());
    }
}
