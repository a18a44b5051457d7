//! The chaos soak (issue #27): seeded random faults (kmm's processes killed, apiservers
//! down, an OCM agent stalled, the registry down, a real node's network cut, the leading
//! hub cut from its apiserver) while modules, labels and a Placement change, judged the
//! whole time by the invariant checker of `kmm_e2e::chaos`.
//!
//! `cargo bench -p kmm-e2e --bench chaos -- --minutes N --seed S` (attaches to
//! `cargo xtask env up`, or starts the fleet). Prints the sequence as it goes, then one
//! `chaos: minutes=... seed=... ...` line; fails unless every count is 0. It restores
//! what it broke and deletes what it created. See e2e/README.md, "The chaos soak".

use anyhow::{Result, bail};
use clap::Parser;
use kmm_e2e::chaos::{self, Options};
use kmm_e2e::fixture::Fleet;
use kmm_e2e::fleet::Settings;

#[derive(Debug, Parser)]
#[command(about = "seeded faults and changes on the local fleet, judged by invariants")]
struct Args {
    /// How long faults are injected (the last round, the settle and the cleanup come
    /// on top).
    #[arg(long, default_value_t = 3.0)]
    minutes: f64,
    /// Names the sequence of faults and changes.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// `cargo bench` passes it to every bench binary.
    #[arg(long, hide = true)]
    bench: bool,
}

// Multi-threaded: a fault undone on an early exit restores the spoke's lease from a
// drop, which blocks in place.
#[tokio::main(flavor = "multi_thread")]
async fn main() -> Result<()> {
    let args = Args::parse();
    let fleet = Fleet::get().await?;
    let settings = Settings::from_env()?;
    let report = chaos::run(
        &fleet,
        &settings,
        &Options {
            minutes: args.minutes,
            seed: args.seed,
        },
    )
    .await?;
    println!("{}", report.figures());
    println!("{}", report.line());
    let failures = report.failures();
    if !failures.is_empty() || report.aborted.is_some() {
        bail!(
            "the chaos soak failed: {failures:?}{}",
            report
                .aborted
                .as_ref()
                .map(|a| format!("; stopped early: {a}"))
                .unwrap_or_default()
        );
    }
    Ok(())
}
