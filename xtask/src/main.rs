//! `cargo xtask <command>`: project automation, written in Rust so it runs wherever cargo does.

mod crdgen;
mod env;
mod images;
mod test;
mod timings;

use std::path::PathBuf;

use clap::{Parser, Subcommand};

#[derive(Debug, Parser)]
#[command(name = "cargo xtask", about = "kmm-fleet project automation")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Generate the CRD YAML under addon-manifests/crds/ (and the chart's crds/) from the Rust API types.
    Crdgen {
        /// Fail instead of writing when the committed YAML differs from the types.
        #[arg(long)]
        check: bool,
    },
    /// Run every check and test: fmt, clippy, unit/integration tests, CRD drift, fuzzing.
    Test(test::Options),
    /// The local fleet: real hub and spoke control planes with OCM (see README).
    Env(env::EnvArgs),
    /// Build the container images (the three binaries, the builder) with buildah (see README).
    Images(images::Options),
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let root = repository_root();
    match cli.command {
        Command::Crdgen { check } => crdgen::run(&root, check),
        Command::Test(options) => test::run(&root, &options),
        Command::Env(args) => env::run(args),
        Command::Images(options) => images::run(&options),
    }
}

/// Runs `cargo ARGS` in `root`, announcing it; fails naming the command.
fn cargo(root: &std::path::Path, args: &[&str]) -> anyhow::Result<()> {
    use anyhow::Context;
    eprintln!("==> cargo {}", args.join(" "));
    let status = std::process::Command::new(env!("CARGO"))
        .args(args)
        .current_dir(root)
        .status()
        .with_context(|| format!("running cargo {}", args.join(" ")))?;
    if !status.success() {
        anyhow::bail!("cargo {} failed ({status})", args.join(" "));
    }
    Ok(())
}

/// The workspace root: xtask lives one level below it.
fn repository_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask sits inside the workspace")
        .to_path_buf()
}
