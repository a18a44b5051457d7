//! The installed kmm-hub building and signing on the local fleet, as figures (not a timed
//! test): for each round, a ManagedClusterModule with `build` and `sign` for the fleet's
//! kernel without a sample image, made with a new test key (so a new image), timed from
//! its creation through the phases its `status.images` shows:
//!
//! - `created_to_building`: the hub checked the registry, found neither image and
//!   started a build Job;
//! - `building_to_pinned`: the Job on the hub's real node (pod start, compiling the
//!   sample modules against Debian's headers, pushing the unsigned image), the hub
//!   seeing it succeed, then pulling the unsigned image, signing both modules natively,
//!   pushing the signed image and resolving its digest (the signing takes well under a
//!   second: status never shows `Signing` between two polls);
//! - `job`: of that, the Job's own run, from its status (start to completion, whole
//!   seconds);
//! - `created_to_pinned`: the sum, what a user waits from `kubectl apply` to a digest
//!   every node can load.
//!
//! `cargo bench -p kmm-e2e --bench build_sign` (attaches to `cargo xtask env up`, or
//! starts the fleet). `KMM_BENCH_ROUNDS` sets the number of rounds (3).

#[path = "../tests/support/mod.rs"]
mod support;

use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use k8s_openapi::api::batch::v1::Job;
use kmm_api::ManagedClusterModule;
use kmm_e2e::fixture::Fleet;
use kmm_e2e::guest::module_signing::TestKey;
use kmm_e2e::versions::Versions;
use kmm_hub::build::job::{MODULE_UID_LABEL, builds_namespace};
use kube::api::ListParams;
use kube::{Api, ResourceExt};
use support::HubBuildSign;

/// How long a round may take: a build of about a minute, then the signing.
const ROUND: Duration = Duration::from_secs(420);

#[tokio::main]
async fn main() -> Result<()> {
    let rounds: usize = match std::env::var("KMM_BENCH_ROUNDS") {
        Ok(value) => value
            .parse()
            .with_context(|| format!("KMM_BENCH_ROUNDS={value:?} is not a count"))?,
        Err(_) => 3,
    };
    let fleet = Fleet::get().await?;
    let kernel = Versions::pinned().kernels.without_image;
    let work = std::env::temp_dir().join(format!("kmm-bench-build-sign-{}", std::process::id()));
    for round in 1..=rounds {
        let key = TestKey::generate(&work, &format!("round{round}"), "kmm-fleet bench key")?;
        let created = Instant::now();
        let made = HubBuildSign::create(&fleet, &kernel, &key).await?;
        let mut building = None;
        let pinned = loop {
            let state = made.state(&fleet).await?;
            let at = created.elapsed();
            match state.as_ref().map(|(s, d)| (s.as_str(), d.is_some())) {
                Some(("Exists", true)) => break at,
                Some(("Failed" | "NotFound", _)) => {
                    bail!("round {round}: the hub gave up: {state:?}")
                }
                Some(("Building" | "Signing", _)) => {
                    building.get_or_insert(at);
                }
                _ => {}
            }
            if at > ROUND {
                bail!("round {round}: no pinned image after {ROUND:?} (last: {state:?})");
            }
            // Polling status: the phases are seconds long, a 100 ms step resolves them.
            tokio::time::sleep(Duration::from_millis(100)).await;
        };
        let building = building.unwrap_or(pinned);
        println!(
            "build-sign: round={round} kernel={kernel} created_to_building_s={:.1} building_to_pinned_s={:.1} job_s={} created_to_pinned_s={:.1}",
            building.as_secs_f64(),
            pinned.saturating_sub(building).as_secs_f64(),
            job_seconds(&fleet, &made.module).await?,
            pinned.as_secs_f64(),
        );
        made.clean_up(&fleet).await?;
    }
    std::fs::remove_dir_all(&work).ok();
    Ok(())
}

/// The module's build Job's run, start to completion, from its status.
async fn job_seconds(fleet: &Fleet, module: &str) -> Result<i64> {
    let uid = Api::<ManagedClusterModule>::all(fleet.hub.clone())
        .get(module)
        .await?
        .uid()
        .context("the module's uid")?;
    let jobs = Api::<Job>::namespaced(fleet.hub.clone(), &builds_namespace(support::HUB_NAMESPACE))
        .list(&ListParams::default().labels(&format!("{MODULE_UID_LABEL}={uid}")))
        .await?;
    let [job] = jobs.items.as_slice() else {
        bail!("{} build Jobs for {module}, expected one", jobs.items.len());
    };
    let status = job.status.as_ref().context("the Job's status")?;
    match (&status.start_time, &status.completion_time) {
        (Some(start), Some(end)) => Ok(end.0.duration_since(start.0).as_secs()),
        _ => bail!("the Job of {module} has not completed: {status:?}"),
    }
}
