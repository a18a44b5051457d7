//! `cargo xtask env`: the local fleet (real hub and spoke control planes with OCM).

use anyhow::{Context, Result, bail};
use clap::{Args, Subcommand};
use kmm_e2e::fleet::{self, Options, Settings};
use kmm_e2e::kmod;
use kmm_e2e::toolchain::Toolchain;
use kmm_e2e::versions::Versions;

#[derive(Debug, Args)]
pub struct EnvArgs {
    #[command(subcommand)]
    command: EnvCommand,
}

#[derive(Debug, Subcommand)]
enum EnvCommand {
    /// Install the Debian packages the fleet and the tests need that are missing (apt-get;
    /// as root: chromium for the fleet view's browser tests among them), and the
    /// real-kernel test's virt-fw-vars (PyPI virt-firmware, into a venv).
    Setup,
    /// Build the pinned upstream programs from the Go module proxy (cached by version).
    Build,
    /// Start a hub and N spokes on 127.0.0.1 (installs and builds first if needed).
    Up {
        #[arg(long, default_value_t = 2)]
        spokes: usize,
        /// KWOK (simulated) nodes per spoke.
        #[arg(long, default_value_t = 3)]
        nodes_per_spoke: usize,
        /// Real nodes (containerd, kubelet, kube-proxy) per cluster, hub included.
        #[arg(long, default_value_t = 1)]
        real_nodes_per_cluster: usize,
        /// Only the clusters and the registry: no kmm-hub, spoke proxies or node agents.
        #[arg(long)]
        no_kmm: bool,
    },
    /// Stop every process of the fleet and remove its state.
    Down,
    /// Show each component, its PID, whether it runs, and its log.
    Status,
    /// Print the admin kubeconfig path of `hub`, `spoke1`, ...
    Kubeconfig { cluster: String },
    /// Print the URL of the hub's fleet view, reachable from this machine: a `kubectl
    /// port-forward` to the leading hub Pod on 127.0.0.1 (base port + 90), left running
    /// in the background and stopped by `env down`; reused while it reaches the leader.
    Ui,
    /// Print the address of the fleet's OCI registry (on loopback: where to push).
    Registry {
        /// The address the nodes and their Pods pull from (the fleet's bridge; this
        /// machine reaches it too): the one for images in ManagedClusterModules.
        #[arg(long)]
        nodes: bool,
    },
}

pub fn run(args: EnvArgs) -> Result<()> {
    let settings = Settings::from_env()?;
    match args.command {
        EnvCommand::Setup => setup(),
        EnvCommand::Build => build(&settings),
        EnvCommand::Up {
            spokes,
            nodes_per_spoke,
            real_nodes_per_cluster,
            no_kmm,
        } => {
            setup()?;
            // The fleet runs one debug binary, the KWOK runner; the others are the tests'
            // (`cargo xtask test` builds them), and the images carry release builds.
            if !no_kmm {
                cargo_build(&["-p", "kmm-kwok-pod-runner"])?;
            }
            let rt = tokio::runtime::Runtime::new().context("starting the tokio runtime")?;
            let state = rt.block_on(fleet::up(
                &settings,
                &Options {
                    spokes,
                    nodes_per_spoke,
                    real_nodes_per_cluster,
                    ocm: true,
                    kmm: !no_kmm,
                },
            ))?;
            for cluster in &state.clusters {
                println!(
                    "{:<8} {}  kubeconfig: {}",
                    cluster.name,
                    cluster.server,
                    cluster.kubeconfig.display()
                );
                for node in &cluster.real_nodes {
                    println!("  real node {} {}", node.name, node.ip);
                }
            }
            println!(
                "registry {} (from real nodes: {})",
                state.registry, state.node_registry
            );
            Ok(())
        }
        EnvCommand::Down => Ok(fleet::down(&settings)?),
        EnvCommand::Status => {
            let rt = tokio::runtime::Runtime::new().context("starting the tokio runtime")?;
            for line in rt.block_on(fleet::status(&settings))? {
                println!("{line}");
            }
            Ok(())
        }
        EnvCommand::Kubeconfig { cluster } => {
            println!(
                "{}",
                fleet::running(&settings)?
                    .cluster(&cluster)?
                    .kubeconfig
                    .display()
            );
            Ok(())
        }
        EnvCommand::Ui => {
            let rt = tokio::runtime::Runtime::new().context("starting the tokio runtime")?;
            println!("{}/", rt.block_on(fleet::ui::ensure(&settings))?);
            Ok(())
        }
        EnvCommand::Registry { nodes } => {
            let state = fleet::running(&settings)?;
            println!(
                "{}",
                if nodes {
                    state.node_registry
                } else {
                    state.registry
                }
            );
            Ok(())
        }
    }
}

/// Everything the fleet needs before it can start: Debian packages and upstream builds.
pub fn prepare() -> Result<()> {
    setup()?;
    build(&Settings::from_env()?)
}

fn build(settings: &Settings) -> Result<()> {
    Toolchain::ensure(&Versions::pinned(), settings.bin_dir.as_deref())?;
    Ok(())
}

/// Installs the Debian packages the fleet needs that are not installed yet (as root),
/// then the PyPI tool the real-kernel test enrols its test key with.
fn setup() -> Result<()> {
    install_packages()?;
    if kmm_e2e::guest::uefi::virt_fw_vars().is_err() {
        eprintln!("installing virt-fw-vars (PyPI virt-firmware) into a venv");
        kmm_e2e::guest::uefi::install_virt_fw_vars()?;
    }
    Ok(())
}

fn install_packages() -> Result<()> {
    let mut packages: Vec<String> = ["docker-registry", "gcc", "make", "libc6-dev", "kmod"]
        .map(String::from)
        .to_vec();
    packages.extend(kmod::header_packages(
        &Versions::pinned().kernels.with_image,
    ));
    // The real-kernel test (qemu guest) and the fleet's real nodes: both check their
    // lists and name what is missing.
    packages.extend(
        kmm_e2e::guest::host_packages::REQUIRED
            .iter()
            .chain(kmm_e2e::fleet::nodes::HOST_PACKAGES)
            .map(|(package, _)| package.to_string()),
    );
    // `cargo xtask images` and its test build the container images with buildah.
    packages.push("buildah".into());
    // The fleet view's browser tests drive Debian's headless Chromium (kmm_e2e::browser).
    packages.push("chromium".into());
    packages.sort();
    packages.dedup();
    let missing: Vec<&String> = packages.iter().filter(|p| !installed(p)).collect();
    if missing.is_empty() {
        return Ok(());
    }
    eprintln!(
        "installing {}",
        missing
            .iter()
            .map(|p| p.as_str())
            .collect::<Vec<_>>()
            .join(" ")
    );
    let updated = std::process::Command::new("apt-get")
        .args(["update", "-qq"])
        .status()
        .context("running apt-get update")?;
    if !updated.success() {
        bail!("apt-get update failed ({updated})");
    }
    let status = std::process::Command::new("apt-get")
        .args(["install", "-y", "--no-install-recommends"])
        .args(&missing)
        .env("DEBIAN_FRONTEND", "noninteractive")
        .status()
        .context("running apt-get")?;
    if !status.success() {
        bail!("apt-get install failed ({status})");
    }
    Ok(())
}

fn installed(package: &str) -> bool {
    std::process::Command::new("dpkg-query")
        .args(["-W", "-f=${Status}", package])
        .output()
        .is_ok_and(|out| out.status.success() && out.stdout.ends_with(b"install ok installed"))
}

/// Builds the debug kmm-fleet binaries the end-to-end tests start as processes, the
/// fleet's KWOK runner among them (`kmm_e2e::binaries`: `cargo test` cannot build another
/// package's binaries).
pub fn build_kmm() -> Result<()> {
    cargo_build(&[
        "-p",
        "kmm-hub",
        "-p",
        "kmm-spoke-proxy",
        "-p",
        "kmm-node-agent",
        "-p",
        "kmm-kwok-pod-runner",
    ])
}

/// `cargo build --bins` of these packages, in the dev profile.
fn cargo_build(packages: &[&str]) -> Result<()> {
    let args = [["build", "--bins"].as_slice(), packages].concat();
    crate::cargo(&crate::repository_root(), &args)
}
