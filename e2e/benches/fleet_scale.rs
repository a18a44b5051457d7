//! The fleet scale bench (issue 14): the release kmm-hub in front of N simulated
//! clusters of M nodes with K modules, on the local fleet's real hub apiserver.
//!
//! `cargo bench -p kmm-e2e --bench fleet_scale -- --clusters N --nodes-per-cluster M
//! --modules K` (attaches to `cargo xtask env up`, or starts the fleet; builds the
//! release kmm-hub into `target/fleet-scale` first, or runs `$KMM_SCALE_HUB_BIN`).
//! Prints one `fleet-scale: scenario=...` line per scenario, then the hub's peak memory,
//! its idle CPU and the unload audit. See e2e/README.md, "The fleet scale harness".

use std::time::Duration;

use anyhow::{Context, Result, bail};
use clap::Parser;
use kmm_e2e::fixture::Fleet;
use kmm_e2e::scale::Shape;
use kmm_e2e::scale::hub_process::Profile;
use kmm_e2e::scale::scenario::{Harness, Options};

#[derive(Debug, Parser)]
#[command(about = "kmm-hub in front of N simulated clusters")]
struct Args {
    #[arg(long, default_value_t = 100)]
    clusters: usize,
    #[arg(long, default_value_t = 10)]
    nodes_per_cluster: usize,
    #[arg(long, default_value_t = 1)]
    modules: usize,
    /// Deadline of each scenario's convergence (and of setup's waits).
    #[arg(long, default_value_t = 600)]
    timeout_seconds: u64,
    /// How long the idle hub's CPU is measured.
    #[arg(long, default_value_t = 10)]
    idle_seconds: u64,
    /// `cargo bench` passes it to every bench binary.
    #[arg(long, hide = true)]
    bench: bool,
}

#[tokio::main]
async fn main() -> Result<()> {
    let args = Args::parse();
    if args.clusters == 0 || args.nodes_per_cluster == 0 || args.modules == 0 {
        bail!("--clusters, --nodes-per-cluster and --modules must be at least 1");
    }
    let fleet = Fleet::get().await?;
    let mut harness = Harness::new(
        &fleet,
        Options {
            shape: Shape {
                clusters: args.clusters,
                nodes_per_cluster: args.nodes_per_cluster,
                modules: args.modules,
            },
            profile: Profile::Release,
            converge_timeout: Duration::from_secs(args.timeout_seconds),
            idle: Duration::from_secs(args.idle_seconds),
        },
    );
    println!(
        "fleet-scale: run {} (hub log: {})",
        harness.run(),
        harness.hub_log().display()
    );
    let result = async {
        println!("{}", harness.setup().await?.line());
        harness.run_all(|line| println!("{line}")).await
    }
    .await;
    let failed = !matches!(&result, Ok(audit) if audit.is_clean());
    let log = harness.hub_log();
    let teardown = harness.teardown(failed).await;
    let audit = result.with_context(|| format!("the run failed; hub log: {}", log.display()))?;
    teardown?;
    if !audit.is_clean() {
        bail!("{}; hub log: {}", audit.line(), log.display());
    }
    Ok(())
}
