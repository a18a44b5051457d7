//! The hostile proxy bench (issue 28): kmm-hub in front of N well-behaved simulated
//! clusters and one more whose proxy, with a valid certificate, sends junk for a
//! minute: inventories of made-up kernels (too many, names no kernel has), node status
//! reports as large as a message allows in parts that never end, statuses and device
//! plugin counts of modules that do not exist. The hub must refuse it and stay within
//! [`RSS_BOUND_MIB`] of its quiet RSS, while a change of the well-behaved clusters'
//! module converges within [`SLOWDOWN`] times its usual time (plus [`SLACK`]).
//!
//! `cargo bench -p kmm-e2e --bench hostile_proxy` (attaches to `cargo xtask env up`, or
//! starts the fleet; runs the release kmm-hub built into `target/fleet-scale`, the debug
//! one with `--debug`, or `$KMM_SCALE_HUB_BIN`). Prints the figures on one
//! `hostile-proxy:` line and fails when a bound is broken.

use std::time::Duration;

use anyhow::{Context, Result, bail};
use clap::Parser;
use kmm_e2e::fixture::Fleet;
use kmm_e2e::scale::Shape;
use kmm_e2e::scale::hub_process::Profile;
use kmm_e2e::scale::scenario::{Harness, HostileFigures, Options};

/// How far above its quiet RSS the hub may go under attack: what the bounds let one
/// cluster make it hold (32 MiB of accounted node statuses, 256 kernels, one unfinished
/// report) with the allocator's and the transport's overheads, and the buffers of
/// messages up to 4 MiB in flight.
const RSS_BOUND_MIB: u64 = 128;
/// How much slower the well-behaved clusters' change may converge under attack.
const SLOWDOWN: f64 = 2.0;
const SLACK: Duration = Duration::from_secs(5);

#[derive(Debug, Parser)]
#[command(about = "kmm-hub against a hostile proxy")]
struct Args {
    #[arg(long, default_value_t = 3)]
    clusters: usize,
    #[arg(long, default_value_t = 5)]
    nodes_per_cluster: usize,
    /// How long the hostile proxy sends junk.
    #[arg(long, default_value_t = 60)]
    attack_seconds: u64,
    /// Deadline of each convergence (and of setup's waits).
    #[arg(long, default_value_t = 300)]
    timeout_seconds: u64,
    /// Runs the workspace's debug kmm-hub rather than building the release one.
    #[arg(long)]
    debug: bool,
    /// `cargo bench` passes it to every bench binary.
    #[arg(long, hide = true)]
    bench: bool,
}

#[tokio::main]
async fn main() -> Result<()> {
    let args = Args::parse();
    if args.clusters == 0 || args.nodes_per_cluster == 0 {
        bail!("--clusters and --nodes-per-cluster must be at least 1");
    }
    let fleet = Fleet::get().await?;
    let mut harness = Harness::new(
        &fleet,
        Options {
            shape: Shape {
                clusters: args.clusters,
                nodes_per_cluster: args.nodes_per_cluster,
                modules: 1,
            },
            profile: if args.debug {
                Profile::Debug
            } else {
                Profile::Release
            },
            converge_timeout: Duration::from_secs(args.timeout_seconds),
            idle: Duration::from_secs(1),
        },
    );
    println!(
        "hostile-proxy: run {} (hub log: {})",
        harness.run(),
        harness.hub_log().display()
    );
    let result = async {
        harness.setup().await?;
        harness.create().await?;
        let usual = harness.spec_edit().await?.converge_s;
        let attacked = harness
            .hostile(Duration::from_secs(args.attack_seconds))
            .await?;
        Ok::<_, kmm_e2e::scale::Error>((usual, attacked))
    }
    .await;
    let log = harness.hub_log();
    let teardown = harness.teardown(result.is_err()).await;
    let (usual, attacked) =
        result.with_context(|| format!("the run failed; hub log: {}", log.display()))?;
    teardown?;
    report(usual, &attacked)
}

fn report(usual_s: f64, f: &HostileFigures) -> Result<()> {
    let grown_mib = f.attack_rss_kib.saturating_sub(f.baseline_rss_kib) / 1024;
    let t = &f.traffic;
    println!(
        "hostile-proxy: baseline_rss_mib={} attack_rss_mib={} grown_mib={grown_mib} (bound {RSS_BOUND_MIB}) \
         peak_rss_mib={} change_usual_s={usual_s:.1} change_under_attack_s={:.1} \
         hostile_streams={} ended={} messages={} sent_mib={}",
        f.baseline_rss_kib / 1024,
        f.attack_rss_kib / 1024,
        f.peak_rss_kib / 1024,
        f.change_converge_s,
        t.streams,
        t.ended,
        t.messages,
        t.bytes >> 20,
    );
    for reason in &t.reasons {
        println!("hostile-proxy: the hub ended a hostile stream: {reason}");
    }
    if grown_mib > RSS_BOUND_MIB {
        bail!("the hub's RSS grew by {grown_mib} MiB under attack, more than {RSS_BOUND_MIB}");
    }
    let allowed = usual_s * SLOWDOWN + SLACK.as_secs_f64();
    if f.change_converge_s > allowed {
        bail!(
            "the change converged in {:.1}s under attack, more than {allowed:.1}s",
            f.change_converge_s
        );
    }
    if t.ended == 0 {
        bail!("the hub never ended a hostile stream");
    }
    Ok(())
}
