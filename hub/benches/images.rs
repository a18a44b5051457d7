//! Figures for the hub's image tracking (`cargo bench -p kmm-hub --bench images`):
//!
//! - **checks per second**: the image worker's check, a manifest HEAD that resolves a
//!   tag to its digest through `kmm-registry`, 16 in flight as in the worker, against a
//!   real docker-registry of the bench's own on loopback (plain HTTP, and HTTPS with
//!   credentials), with p50/p99 latency;
//! - **memory with 1,000 images tracked**: the heap the leader holds for them (a record
//!   per image, with the need it was computed for, as `FleetView` keeps them) and their
//!   status entries (at most 100 per module), counted exactly by dhat's allocator; for
//!   plain images and for images the hub builds and signs (the largest needs);
//! - the time to compute a module's needs for 1,000 kernels, which the image worker does
//!   on every wake-up.
//!
//! `KMM_BENCH_CHECKS` sets the number of images checked (500), `KMM_BENCH_IMAGES` the
//! number of images tracked (1,000).

use std::collections::{BTreeMap, BTreeSet};
use std::time::Instant;

use anyhow::{Context, Result, ensure};
use futures::StreamExt;
use k8s_openapi::jiff::Timestamp;
use kmm_api::ManagedClusterModule;
use kmm_api::testing::ModuleBuilder;
use kmm_hub::images::status::image_statuses;
use kmm_hub::images::{ImageKey, ImageRecord, Next, Observation, module_needs, record};
use kmm_hub::resolutions::Resolutions;
use kmm_registry::{PullSecret, RegistryTls};
use kmm_registry_fixture::RegistryServer;
use serde_json::json;

#[global_allocator]
static ALLOC: dhat::Alloc = dhat::Alloc;

/// As the image worker.
const IN_FLIGHT: usize = 16;

fn count(variable: &str, default: usize) -> Result<usize> {
    match std::env::var(variable) {
        Ok(value) => value
            .parse()
            .with_context(|| format!("{variable}={value:?} is not a count")),
        Err(_) => Ok(default),
    }
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    sorted[((sorted.len() as f64 - 1.0) * p).round() as usize]
}

/// Pushes `images` tags to `registry`, then resolves every one `IN_FLIGHT` at a time.
async fn checks(
    what: &str,
    registry: &RegistryServer,
    tls: RegistryTls,
    secret: Option<PullSecret>,
    images: usize,
) -> Result<()> {
    for i in 0..images {
        registry
            .push_files(
                &format!("bench/checked:{i}"),
                &[("opt/n", i.to_string().as_bytes())],
            )
            .await?;
    }
    let client = kmm_registry::client(tls);
    let started = Instant::now();
    let mut latencies: Vec<f64> = futures::stream::iter(0..images)
        .map(|i| {
            let (client, secret) = (&client, secret.as_ref());
            let image = registry.image(&format!("bench/checked:{i}"));
            async move {
                let asked = Instant::now();
                let digest = kmm_registry::resolve_digest(client, &image, secret).await?;
                ensure!(
                    digest.starts_with("sha256:"),
                    "{image} resolved to {digest}"
                );
                Ok(asked.elapsed().as_secs_f64() * 1000.0)
            }
        })
        .buffer_unordered(IN_FLIGHT)
        .collect::<Vec<Result<f64>>>()
        .await
        .into_iter()
        .collect::<Result<_>>()?;
    let took = started.elapsed().as_secs_f64();
    latencies.sort_by(f64::total_cmp);
    println!(
        "image-checks: registry={what} images={images} in_flight={IN_FLIGHT} checks_per_s={:.0} p50_ms={:.1} p99_ms={:.1}",
        images as f64 / took,
        percentile(&latencies, 0.5),
        percentile(&latencies, 0.99),
    );
    Ok(())
}

/// A module whose image differs per kernel; built and signed when `made`.
fn module(made: bool) -> Result<ManagedClusterModule> {
    let mut mapping = json!({
        "regexp": "^.+$",
        "containerImage": "registry.example.com/drivers/acme-nic:${KERNEL_FULL_VERSION}",
        "registryTLS": {"insecure": true},
    });
    if made {
        mapping["build"] = json!({
            "dockerfileConfigMap": {"name": "acme-nic-build"},
            "buildArgs": [{"name": "DRIVER_VERSION", "value": "4.2.1"}],
            "secrets": [{"name": "acme-license"}],
            "baseImageRegistryTLS": {"insecure": true},
        });
        mapping["sign"] = json!({
            "keySecret": {"name": "acme-signing-key"},
            "certSecret": {"name": "acme-signing-cert"},
            "filesToSign": [
                "/opt/lib/modules/${KERNEL_FULL_VERSION}/extra/acme_nic.ko",
                "/opt/lib/modules/${KERNEL_FULL_VERSION}/extra/acme_nic_core.ko",
            ],
        });
    }
    Ok(ModuleBuilder::new("acme-nic")
        .uid("0b5d5f3e-7c1e-4b8e-9a51-3f0c1d2e4a6b")
        .without("/metadata/generation")
        .spoke_namespace("acme-drivers")
        .selector(&[("env", "prod")])
        .with("/spec/imageRepoSecret", json!({"name": "acme-pull"}))
        .with(
            "/spec/moduleSpec/selector",
            json!({"kubernetes.io/os": "linux"}),
        )
        .with(
            "/spec/moduleSpec/moduleLoader/container/modprobe/moduleName",
            "acme_nic",
        )
        .kernel_mappings(json!([mapping]))
        .build())
}

/// `count` kernels, one image each.
fn kernels(count: usize) -> BTreeSet<String> {
    (0..count)
        .map(|i| format!("6.1.0-{}-{}-amd64", i / 100, i % 100))
        .collect()
}

/// The time to compute `module`'s needs for `images` kernels (best of 5): resolving
/// every kernel first (a new generation), then from the cached resolutions (every later
/// wake-up of the worker).
fn needs_time(what: &str, module: &ManagedClusterModule, images: usize) -> Result<()> {
    let kernels = kernels(images);
    let (mut cold, mut cached) = (f64::MAX, f64::MAX);
    for _ in 0..5 {
        let mut resolutions = Resolutions::default();
        let started = Instant::now();
        let needs = module_needs(
            module,
            resolutions.resolve(module, &kernels),
            &kernels,
            None,
        );
        cold = cold.min(started.elapsed().as_secs_f64() * 1000.0);
        ensure!(
            needs.len() == images,
            "{} needs for {images} kernels",
            needs.len()
        );
        let started = Instant::now();
        let again = module_needs(
            module,
            resolutions.resolve(module, &kernels),
            &kernels,
            None,
        );
        cached = cached.min(started.elapsed().as_secs_f64() * 1000.0);
        ensure!(again == needs, "the cached resolutions need other images");
    }
    println!(
        "hub-images-needs: images={what} kernels={images} module_needs_ms={cold:.1} \
         cached_ms={cached:.1}"
    );
    Ok(())
}

/// Heap held by `images` tracked records of `module`, and by their status entries.
fn memory(what: &str, module: &ManagedClusterModule, images: usize) -> Result<()> {
    let kernels = kernels(images);
    let needs = module_needs(
        module,
        Resolutions::default().resolve(module, &kernels),
        &kernels,
        None,
    );
    let now = Timestamp::now();
    let before = dhat::HeapStats::get().curr_bytes;
    let records: BTreeMap<ImageKey, ImageRecord> = needs
        .iter()
        .enumerate()
        .map(|(i, (key, need))| {
            let found = Observation::Found {
                digest: format!("sha256:{:064x}", i),
            };
            (
                key.clone(),
                record::observe(need, None, Next::Check, found, now),
            )
        })
        .collect();
    let tracked = dhat::HeapStats::get().curr_bytes - before;
    let needed = needs
        .iter()
        .map(|(key, need)| (key.clone(), need.kernels.clone()))
        .collect();
    let before_status = dhat::HeapStats::get().curr_bytes;
    let statuses = image_statuses(records.iter(), &needed, &BTreeMap::new());
    let status_bytes = dhat::HeapStats::get().curr_bytes - before_status;
    println!(
        "hub-images-memory: images={what} tracked={images} records_kib={} per_image_bytes={} status_entries={} status_kib={}",
        tracked / 1024,
        tracked / images,
        statuses.len(),
        status_bytes / 1024,
    );
    Ok(())
}

#[tokio::main]
async fn main() -> Result<()> {
    let (checked, tracked) = (
        count("KMM_BENCH_CHECKS", 500)?,
        count("KMM_BENCH_IMAGES", 1000)?,
    );
    let plain = RegistryServer::plain()?;
    let tls = RegistryServer::tls_with_auth("bench", "secret")?;
    checks(
        "http",
        &plain,
        RegistryTls {
            insecure: true,
            insecure_skip_tls_verify: false,
        },
        None,
        checked,
    )
    .await?;
    checks(
        "https+basic-auth",
        &tls,
        RegistryTls {
            insecure: false,
            insecure_skip_tls_verify: true,
        },
        Some(PullSecret::DockerConfigJson(
            tls.docker_config_json("bench", "secret"),
        )),
        checked,
    )
    .await?;

    needs_time("plain", &module(false)?, tracked)?;
    needs_time("built-and-signed", &module(true)?, tracked)?;
    // Counting starts here: dhat's bookkeeping would slow the checks above.
    let _profiler = dhat::Profiler::builder().testing().build();
    memory("plain", &module(false)?, tracked)?;
    memory("built-and-signed", &module(true)?, tracked)
}
