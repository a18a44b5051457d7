//! The one command that runs every check and test, in the order CI relies on.

use std::{path::Path, process::Command};

use anyhow::{Context, bail};

/// Fuzz targets run for a bounded time by `cargo xtask test`.
const FUZZ_TARGETS: &[&str] = &["kernel_template"];

#[derive(Debug, clap::Args)]
pub struct Options {
    /// Seconds each fuzz target runs for.
    #[arg(long, default_value_t = 60)]
    fuzz_seconds: u32,
}

pub fn run(root: &Path, options: &Options) -> anyhow::Result<()> {
    cargo(root, &["fmt", "--all", "--", "--check"])?;
    cargo(
        root,
        &[
            "clippy",
            "--workspace",
            "--all-targets",
            "--",
            "-D",
            "warnings",
        ],
    )?;
    crate::crdgen::run(root, true)?;
    for target in FUZZ_TARGETS {
        fuzz(root, target, options.fuzz_seconds)?;
    }
    // Last, so that the test runner's summary closes the output.
    cargo(root, &["test", "--workspace"])
}

fn cargo(root: &Path, args: &[&str]) -> anyhow::Result<()> {
    eprintln!("==> cargo {}", args.join(" "));
    let status = Command::new(env!("CARGO"))
        .args(args)
        .current_dir(root)
        .status()
        .with_context(|| format!("running cargo {}", args.join(" ")))?;
    if !status.success() {
        bail!("cargo {} failed ({status})", args.join(" "));
    }
    Ok(())
}

/// Runs one libFuzzer target with cargo-fuzz. The stable toolchain is used with
/// RUSTC_BOOTSTRAP so that no nightly toolchain has to be downloaded.
fn fuzz(root: &Path, target: &str, seconds: u32) -> anyhow::Result<()> {
    let max_time = format!("-max_total_time={seconds}");
    let args = ["fuzz", "run", target, "--", max_time.as_str()];
    eprintln!("==> cargo {}", args.join(" "));
    let status = Command::new(env!("CARGO"))
        .args(args)
        .env("RUSTC_BOOTSTRAP", "1")
        .current_dir(root)
        .status()
        .context("running cargo fuzz (install it with `cargo install cargo-fuzz --locked`)")?;
    if !status.success() {
        bail!(
            "fuzz target {target} failed ({status}); a crash input is under fuzz/artifacts/{target}/, \
             and `cargo fuzz` itself comes from `cargo install cargo-fuzz --locked`"
        );
    }
    Ok(())
}
