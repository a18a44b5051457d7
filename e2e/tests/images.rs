//! Issue 10: the container images. `kmm_images::build` makes the bases from Debian
//! packages and the three images with buildah, exactly as `cargo xtask images` does;
//! these tests run each image's binary in the image's root filesystem as its user
//! (`kmm_images::run_in`), read the images' configuration and files, build again
//! to see nothing rebuilt, and push everything to a registry of their own, from which a
//! Dockerfile build then takes its base as a `docker build` user's would.
//!
//! They need buildah (`cargo xtask env setup` installs it) and fail naming it when it
//! is missing. The first run builds the release binaries (minutes on 2 cores); later
//! runs reuse them and the images. Figures are printed with the prefix `images:`.

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::Path;
use std::sync::OnceLock;
use std::time::Instant;

use anyhow::{Context, Result, anyhow, bail, ensure};
use kmm_images::{self as images, Built, Image, Options, SOURCE, VERSION};
use kmm_registry_fixture::RegistryServer;

const MIB: u64 = 1024 * 1024;
/// Issue 10's goals; the hub's raised from 40 MiB when it took on the fleet view's web
/// pages (issue 30) at 40.1 MiB.
const HUB_MAX: u64 = 48 * MIB;
const PROXY_MAX: u64 = 40 * MIB;
const AGENT_MAX: u64 = 60 * MIB;

static BUILT: OnceLock<std::result::Result<Built, String>> = OnceLock::new();

/// The images, built once per test binary (tests run in parallel and share them).
fn built() -> Result<&'static Built> {
    BUILT
        .get_or_init(|| {
            let started = Instant::now();
            let built = images::build(&Options::new(None)).map_err(|e| format!("{e}"));
            eprintln!(
                "images: first build {:.1}s",
                started.elapsed().as_secs_f64()
            );
            built
        })
        .as_ref()
        .map_err(|e| anyhow!("building the images: {e}"))
}

fn image<'a>(built: &'a Built, name: &str) -> Result<&'a Image> {
    built
        .images
        .iter()
        .chain(&built.bases)
        .find(|i| i.name == name)
        .with_context(|| format!("no image {name}"))
}

/// Run `command` in a container of `reference`; its standard output, failing on an
/// unsuccessful exit.
fn run(reference: &str, command: &[&str]) -> Result<String> {
    let out = images::run_in(reference, command)?;
    ensure!(
        out.status.success(),
        "`{}` in {reference}: {}; stderr: {}",
        command.join(" "),
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

#[test]
fn each_image_runs_its_binary_and_the_agent_image_the_kmod_tools() -> Result<()> {
    let built = built()?;
    for image in &built.images {
        let config = images::inspect(&image.reference)?.context("the image is gone")?;
        let entrypoint: Vec<&str> = config.entrypoint.iter().map(String::as_str).collect();
        ensure!(
            entrypoint == [format!("/usr/local/bin/{}", image.name)],
            "{}: entrypoint {entrypoint:?}",
            image.name
        );
        let version = run(
            &image.reference,
            &[entrypoint.as_slice(), &["--version"]].concat(),
        )?;
        ensure!(
            version == format!("{} {VERSION}\n", image.name),
            "{}: --version printed {version:?}",
            image.name
        );
        let help = run(
            &image.reference,
            &[entrypoint.as_slice(), &["--help"]].concat(),
        )?;
        ensure!(
            help.contains(&format!("Usage: {}", image.name)),
            "{}: --help printed {help:?}",
            image.name
        );
    }
    // The agent runs them by name, from PATH, as the image's user.
    let agent = &image(built, "kmm-node-agent")?.reference;
    for tool in ["modprobe", "depmod", "modinfo"] {
        let out = run(agent, &[tool, "--version"])?;
        ensure!(
            out.starts_with("kmod version 30"),
            "{tool} --version printed {out:?}"
        );
    }
    Ok(())
}

#[test]
fn images_carry_oci_labels_run_as_nonroot_and_stay_small() -> Result<()> {
    let built = built()?;
    for image in &built.images {
        let config = images::inspect(&image.reference)?.context("the image is gone")?;
        let label = |name: &str| {
            config
                .labels
                .get(&format!("org.opencontainers.image.{name}"))
                .cloned()
                .unwrap_or_default()
        };
        ensure!(
            label("title") == image.name,
            "{}: title {}",
            image.name,
            label("title")
        );
        ensure!(
            label("version") == VERSION,
            "{}: version {}",
            image.name,
            label("version")
        );
        ensure!(
            label("source") == SOURCE,
            "{}: source {}",
            image.name,
            label("source")
        );
        ensure!(
            label("licenses") == "Apache-2.0",
            "{}: licenses",
            image.name
        );
        ensure!(
            !label("description").is_empty(),
            "{}: no description",
            image.name
        );
        let revision = label("revision");
        let commit = revision.trim_end_matches("-dirty");
        ensure!(
            commit.len() == 40 && commit.chars().all(|c| c.is_ascii_hexdigit()),
            "{}: revision {revision} is not a commit",
            image.name
        );
        // The sample device plugin is no product image: like every device plugin it runs
        // as root, to make its socket in the kubelet's root-owned directory.
        let user = if image.name == "kmm-sample-device-plugin" {
            "0:0"
        } else {
            "65532:65532"
        };
        ensure!(config.user == user, "{}: user {}", image.name, config.user);
        let packages = config
            .labels
            .get(images::PACKAGES_LABEL)
            .cloned()
            .unwrap_or_default();
        ensure!(
            packages.contains("libc6="),
            "{}: packages {packages}",
            image.name
        );
        let max = match image.name.as_str() {
            "kmm-node-agent" => AGENT_MAX,
            "kmm-hub" => HUB_MAX,
            _ => PROXY_MAX,
        };
        ensure!(
            image.size < max,
            "{}: {:.1} MiB, over the {} MiB goal",
            image.name,
            image.size as f64 / MIB as f64,
            max / MIB
        );
        eprintln!(
            "images: {} size_mib={:.1} compressed_mib={:.1}",
            image.name,
            image.size as f64 / MIB as f64,
            image.compressed_size as f64 / MIB as f64
        );
    }
    let agent = images::inspect(&image(built, "kmm-node-agent")?.reference)?
        .context("the agent image is gone")?;
    let packages = agent
        .labels
        .get(images::PACKAGES_LABEL)
        .cloned()
        .unwrap_or_default();
    ensure!(packages.contains(" kmod="), "agent packages: {packages}");
    // Hub, proxy and agent share the base's layer: nodes and registries hold it once.
    let base = images::inspect(&image(built, "base")?.reference)?.context("base is gone")?;
    ensure!(
        agent.layers.starts_with(&base.layers),
        "the agent's layers {:?} do not start with the base's {:?}",
        agent.layers,
        base.layers
    );
    Ok(())
}

/// The files of the base every image is on, read from a mounted container of it.
#[test]
fn the_base_has_the_nonroot_user_certificates_and_no_shell() -> Result<()> {
    let built = built()?;
    let base = &image(built, "base")?.reference;
    let container = buildah(&["from", "--pull=never", "--quiet", base])?;
    let checked = (|| -> Result<()> {
        let root = buildah(&["mount", &container])?;
        let root = Path::new(&root);
        let passwd = std::fs::read_to_string(root.join("etc/passwd"))?;
        ensure!(
            passwd.contains("nonroot:x:65532:65532:nonroot:/home/nonroot:/sbin/nologin"),
            "/etc/passwd: {passwd}"
        );
        let home = std::fs::metadata(root.join("home/nonroot"))?;
        ensure!(
            home.uid() == 65532 && home.gid() == 65532,
            "/home/nonroot is not nonroot's"
        );
        let tmp = std::fs::metadata(root.join("tmp"))?;
        ensure!(
            tmp.permissions().mode() & 0o7777 == 0o1777,
            "/tmp mode {:o}",
            tmp.mode()
        );
        let bundle = std::fs::read_to_string(root.join("etc/ssl/certs/ca-certificates.crt"))?;
        ensure!(
            bundle.matches("BEGIN CERTIFICATE").count() > 100,
            "the CA bundle holds {} certificates",
            bundle.matches("BEGIN CERTIFICATE").count()
        );
        ensure!(
            root.join("var/lib/dpkg/status.d/libc6").is_file(),
            "no package record"
        );
        ensure!(root.join("etc/os-release").exists(), "no /etc/os-release");
        for shell in ["bin/sh", "bin/bash", "usr/bin/apt-get"] {
            ensure!(!root.join(shell).exists(), "the base has /{shell}");
        }
        Ok(())
    })();
    buildah(&["rm", &container])?;
    checked
}

#[test]
fn a_second_build_with_nothing_changed_rebuilds_nothing() -> Result<()> {
    let first = built()?;
    let started = Instant::now();
    let second = images::build(&Options::new(None))?;
    let elapsed = started.elapsed();
    eprintln!("images: second build {:.1}s", elapsed.as_secs_f64());
    for (a, b) in first
        .bases
        .iter()
        .chain(&first.images)
        .zip(second.bases.iter().chain(&second.images))
    {
        ensure!(!b.rebuilt, "{} was rebuilt", b.name);
        ensure!(a.id == b.id, "{}: {} then {}", a.name, a.id, b.id);
    }
    Ok(())
}

/// Pushes bases and images to a registry of its own, then builds the hub's Dockerfile
/// with its base from that registry, as a `docker build` user does.
#[test]
fn bases_and_images_push_to_a_registry_a_dockerfile_build_takes_its_base_from() -> Result<()> {
    built()?;
    let registry = RegistryServer::plain()?;
    let address = registry.address.clone();
    let runtime = tokio::runtime::Runtime::new()?;
    let options = Options::new(Some(address.clone()));
    let pushed = images::build(&options)?;
    let mut local: Vec<String> = pushed.images.iter().map(|i| i.reference.clone()).collect();
    let checked = (|| -> Result<()> {
        for image in pushed.bases.iter().chain(&pushed.images) {
            let name = image
                .pushed
                .as_deref()
                .with_context(|| format!("{} not pushed", image.name))?;
            ensure!(
                name.starts_with(&format!("{address}/kmm-fleet/")),
                "pushed as {name}"
            );
            let (repository, tag) = name
                .strip_prefix(&format!("{address}/"))
                .and_then(|n| n.rsplit_once(':'))
                .context("reference")?;
            ensure!(
                runtime.block_on(registry.has(&format!("{repository}:{tag}")))?,
                "{repository}:{tag} is not in the registry"
            );
        }
        // The hub's own base: kmm-hub loads OpenSSL's libraries (its module signer).
        let base = format!("{address}/kmm-fleet/base-openssl:bookworm");
        let tag = "localhost/kmm-e2e/dockerfile-user:test";
        local.extend([base.clone(), tag.to_string()]);
        let release = options.target_dir.join("release");
        let dockerfile = Path::new(env!("CARGO_MANIFEST_DIR")).join("../hub/Dockerfile");
        buildah(&[
            "bud",
            "--quiet",
            "--isolation",
            "chroot",
            "--tls-verify=false",
            "--build-arg",
            &format!("BASE_IMAGE={base}"),
            "--file",
            &dockerfile.to_string_lossy(),
            "--tag",
            tag,
            &release.to_string_lossy(),
        ])?;
        let version = run(tag, &["kmm-hub", "--version"])?;
        ensure!(
            version == format!("kmm-hub {VERSION}\n"),
            "--version printed {version:?}"
        );
        Ok(())
    })();
    for reference in &local {
        let _ = buildah(&["rmi", reference]);
    }
    checked
}

fn buildah(args: &[&str]) -> Result<String> {
    let out = images::buildah().args(args).output()?;
    if !out.status.success() {
        bail!(
            "buildah {}: {}: {}",
            args.join(" "),
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
}
