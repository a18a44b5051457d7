//! kmm-hub as installed on the local fleet (`kubectl apply -k addon-manifests/hub`, two
//! replicas on the hub's real node), printed as figures (not a timed test):
//!
//! - admission latency through the real apiserver: server-side dry-run creates of a valid
//!   and of an invalid ManagedClusterModule (nothing is stored), p50/p99;
//! - a rolling restart: `kubectl rollout restart` to both new replicas ready and one
//!   leading;
//! - failover: the leader's process killed (SIGKILL) to a new ready leader (bounded below
//!   by the Lease duration, 15 s).
//!
//! `cargo bench -p kmm-e2e --bench hub` (attaches to `cargo xtask env up`, or starts the
//! fleet). `KMM_BENCH_REVIEWS` sets the number of admission requests of each kind (200).

#[path = "../tests/support/mod.rs"]
mod support;

use std::time::{Duration, Instant};

use anyhow::{Result, ensure};
use k8s_openapi::api::apps::v1::Deployment;
use kmm_api::ManagedClusterModule;
use kmm_e2e::fixture::Fleet;
use kmm_e2e::fleet::hub_install;
use kmm_e2e::fleet::kmm::HUB_NAMESPACE;
use kube::Api;
use kube::api::{Patch, PatchParams, PostParams};
use serde_json::json;
use support::*;

fn percentile(sorted: &[f64], p: f64) -> f64 {
    let index = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[index]
}

async fn dry_run_creates(
    api: &Api<ManagedClusterModule>,
    module: &ManagedClusterModule,
    count: usize,
    expect_ok: bool,
) -> Result<Vec<f64>> {
    let params = PostParams {
        dry_run: true,
        ..PostParams::default()
    };
    let mut millis = Vec::with_capacity(count);
    for _ in 0..count {
        let started = Instant::now();
        let result = api.create(&params, module).await;
        millis.push(started.elapsed().as_secs_f64() * 1000.0);
        ensure!(
            result.is_ok() == expect_ok,
            "unexpected admission answer: {result:?}"
        );
    }
    millis.sort_by(f64::total_cmp);
    Ok(millis)
}

#[tokio::main]
async fn main() -> Result<()> {
    let count: usize = std::env::var("KMM_BENCH_REVIEWS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(200);
    let fleet = Fleet::get().await?;
    kmm(&fleet)?;
    let api: Api<ManagedClusterModule> = Api::all(fleet.hub.clone());
    let name = unique("bench-admission");
    let valid = module(&name, "kmm-bench.dev/none", sample_mapping(&fleet))?;
    let mut invalid = valid.clone();
    invalid.spec.spoke_namespace = "Bad_NS".into();
    for (what, module, ok) in [("admitted", &valid, true), ("refused", &invalid, false)] {
        let millis = dry_run_creates(&api, module, count, ok).await?;
        println!(
            "admission ({what}, server-side dry-run create through the webhook): p50 {:.1} ms, p99 {:.1} ms over {count}",
            percentile(&millis, 0.5),
            percentile(&millis, 0.99)
        );
    }

    let deployments: Api<Deployment> = Api::namespaced(fleet.hub.clone(), HUB_NAMESPACE);
    let restart = json!({"spec": {"template": {"metadata": {"annotations": {
        "kubectl.kubernetes.io/restartedAt": format!("{:?}", std::time::SystemTime::now())
    }}}}});
    let started = Instant::now();
    deployments
        .patch(
            hub_install::DEPLOYMENT,
            &PatchParams::default(),
            &Patch::Merge(&restart),
        )
        .await?;
    hub_install::scale(&fleet.hub, 2).await?;
    println!(
        "rolling restart: both new replicas ready and one leading in {:.1}s",
        started.elapsed().as_secs_f64()
    );

    let started = Instant::now();
    let former = hub_install::lease_holder(&fleet.hub).await?;
    hub_install::crash_leader(&fleet.hub).await?;
    hub_install::wait_lease_moved(&fleet.hub, Duration::from_secs(60), &former).await?;
    println!(
        "failover: leader crashed (SIGKILL, Lease not released) -> new ready leader in {:.1}s",
        started.elapsed().as_secs_f64()
    );
    hub_install::scale(&fleet.hub, 2).await?;
    Ok(())
}
