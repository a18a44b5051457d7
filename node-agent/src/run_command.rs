//! `kmm-node-agent run`: the agent with its control plane (the proxy, or a desired-modules
//! file), its metrics and health endpoint, until SIGTERM. Stopping never unloads.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use kmm_node_agent::agent::{self, LoopTiming};
use kmm_node_agent::control::{self, EventReceiver};
use kmm_node_agent::event_queue::event_queue;
use kmm_node_agent::image::ImageStore;
use kmm_node_agent::image::cache::Cache;
use kmm_node_agent::kernel::{HostKernel, Kernel, SimulatedKernel};
use kmm_node_agent::metrics::Metrics;
use kmm_node_agent::proxy_connection::{ProxyConfig, ProxyConnection};
use kmm_node_agent::readiness;
use kmm_node_agent::reconcile::Reconciler;
use kmm_node_agent::state::StateStore;
use kmm_runtime::health::Health;
use prometheus_client::registry::Registry;
use tokio::sync::watch;

use crate::standalone;
use crate::{Backend, RunArgs};

pub(crate) async fn run(args: RunArgs) -> anyhow::Result<()> {
    let kernel: Arc<dyn Kernel> = match args.kernel_backend {
        Backend::Host => Arc::new(HostKernel::default()),
        Backend::Simulated => {
            let dir = args.simulated_dir.clone().context("--simulated-dir")?;
            let release = match args.simulated_kernel.clone() {
                Some(release) => release,
                None => SimulatedKernel::node_release(&dir)
                    .context("without --simulated-kernel, reading the node's release")?,
            };
            Arc::new(SimulatedKernel::open(dir, release).context("opening the simulated kernel")?)
        }
    };
    let cache = Cache::open(&args.cache_dir).context("opening the image cache")?;
    let mut registry = Registry::default();
    let metrics = Metrics::register(&mut registry);
    let images = ImageStore::new(cache, args.limits.limits())
        .with_pull_limits(args.limits.pull_limits())
        .with_concurrent_pulls(args.concurrent_pulls)
        .with_registry_ca_file(args.registry_ca_file.clone())
        .with_metrics(metrics.clone());
    let reconciler = Reconciler::new(
        kernel,
        images,
        StateStore::new(&args.state_dir),
        args.firmware_dir.clone(),
    )
    .context("loading the agent state")?
    .with_unused_image_retention(Duration::from_secs(args.unused_image_retention_seconds));
    let hello = reconciler.hello(&args.node_name);
    tracing::info!(
        node = %hello.node_name,
        kernel = %hello.kernel_release,
        boot_id = %hello.boot_id,
        backend = reconciler.kernel().backend(),
        loaded = hello.loaded.len(),
        "agent started"
    );

    let health = Health::default();
    let listener = tokio::net::TcpListener::bind(args.metrics_addr)
        .await
        .with_context(|| format!("cannot listen on --metrics-addr {}", args.metrics_addr))?;
    tokio::spawn(kmm_runtime::health::serve_on(
        listener,
        registry,
        health.clone(),
        std::future::pending(),
    ));

    let progress = reconciler.progress();
    let ((intent_tx, intent_rx), (event_tx, event_rx)) = control::channels();
    let events = observed(event_rx, metrics.clone());
    let (control, connected) = match (&args.proxy_address, &args.desired_file) {
        (Some(address), _) => {
            let (connected_tx, connected_rx) = watch::channel(false);
            let connection = ProxyConnection {
                config: ProxyConfig {
                    server_name: args.proxy_server_name.clone(),
                    ..ProxyConfig::new(
                        address.clone(),
                        args.proxy_ca_file.clone().context("--proxy-ca-file")?,
                        args.token_file.clone().context("--token-file")?,
                    )
                },
                hello,
                agent_version: env!("CARGO_PKG_VERSION").into(),
                progress: progress.clone(),
                intents: intent_tx,
                events,
                connected: connected_tx,
                metrics: metrics.clone(),
            };
            (tokio::spawn(connection.run()), Some(connected_rx))
        }
        (None, Some(file)) => {
            println!("{}", serde_json::json!({ "hello": hello }));
            let poll = Duration::from_millis(args.desired_poll_ms);
            let task = tokio::spawn(standalone::run(
                file.clone(),
                poll,
                intent_tx,
                events,
                metrics.clone(),
            ));
            (task, None)
        }
        (None, None) => anyhow::bail!("one of --proxy-address or --desired-file is required"),
    };
    let readiness = tokio::spawn(readiness::track(progress, connected, health, metrics));
    let timing = LoopTiming {
        retry_initial: Duration::from_secs(args.retry_seconds.max(1)),
        ..LoopTiming::default()
    };
    let shutdown = kmm_runtime::shutdown::on_signal();
    tokio::select! {
        () = agent::run(reconciler, intent_rx, event_tx, timing) => {}
        () = shutdown.cancelled() => tracing::info!("exiting without unloading anything"),
    }
    control.abort();
    readiness.abort();
    Ok(())
}

/// Counts every event in the metrics on its way to the control plane, connected or not.
fn observed(mut events: EventReceiver, metrics: Metrics) -> EventReceiver {
    let (tx, rx) = event_queue();
    tokio::spawn(async move {
        while let Some(event) = events.recv().await {
            metrics.observe(&event);
            if tx.send(event).is_err() {
                break;
            }
        }
    });
    rx
}
