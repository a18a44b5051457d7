//! The fleet scale harness as a correctness test (issue 14): kmm-hub in front of 100
//! simulated clusters of 5 nodes with 3 modules. Every scenario must converge as the
//! hub's module status says, and deleting the modules must unload each from every node
//! exactly once (no unload lost, none repeated) before the hub releases them. Not
//! timed: the deadlines only turn a hang into a failure.
//!
//! Runs the workspace's debug kmm-hub (`cargo build --bins`, which `cargo xtask test`
//! does), or `$KMM_SCALE_HUB_BIN`. Needs the local fleet (attaches to a running one or
//! starts it; fails if it cannot).

use std::time::Duration;

use anyhow::{Context, Result, ensure};
use kmm_e2e::fixture::Fleet;
use kmm_e2e::fleet::managed_clusters;
use kmm_e2e::scale::Shape;
use kmm_e2e::scale::clusters::RUN_LABEL;
use kmm_e2e::scale::hub_process::Profile;
use kmm_e2e::scale::scenario::{Harness, Options};
use kube::api::ListParams;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hundred_clusters_converge_in_every_scenario_and_unload_exactly_once() -> Result<()> {
    let fleet = Fleet::get().await?;
    let mut harness = Harness::new(
        &fleet,
        Options {
            shape: Shape {
                clusters: 100,
                nodes_per_cluster: 5,
                modules: 3,
            },
            profile: Profile::Debug,
            converge_timeout: Duration::from_secs(300),
            idle: Duration::from_secs(2),
        },
    );
    let run = harness.run().to_owned();
    let log = harness.hub_log();
    let result = async {
        println!("{}", harness.setup().await?.line());
        harness.run_all(|line| println!("{line}")).await
    }
    .await;
    let failed = !matches!(&result, Ok(audit) if audit.is_clean());
    let teardown = harness.teardown(failed).await;
    let audit = result.with_context(|| format!("the run failed; hub log: {}", log.display()))?;
    teardown.context("cleaning up the run")?;
    ensure!(
        audit.is_clean(),
        "{}; hub log: {}",
        audit.line(),
        log.display()
    );
    ensure!(audit.expected == 100 * 5 * 3, "{}", audit.line());

    // Other tests on the shared fleet count its clusters: none of the run's is left.
    let left = managed_clusters(&fleet.hub)
        .list_metadata(&ListParams::default().labels(&format!("{RUN_LABEL}={run}")))
        .await?
        .items
        .len();
    ensure!(left == 0, "{left} ManagedClusters of run {run} left");
    Ok(())
}
