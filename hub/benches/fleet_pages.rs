//! Figures for the fleet UI (`cargo bench -p kmm-hub --bench fleet_pages`): a synthetic
//! fleet of 3,500 clusters of 20 nodes running 20 modules (1.4 million node statuses),
//! fed to the hub's fleet view in memory as watches and proxies would (no apiserver);
//! then each page is built and rendered as the server does, and the median and p95
//! time and the page's size are printed. Issue #30 asks for under 100 ms and 500 KB.
//! The fleet page shows each module's clusters as the controller last counted them;
//! the time the controller takes to count one module is printed too.
//!
//! `KMM_BENCH_CLUSTERS`, `KMM_BENCH_NODES`, `KMM_BENCH_MODULES` change the fleet's size;
//! `KMM_BENCH_RENDERS` how often each page is rendered and each module counted (20).

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use k8s_openapi::jiff::Timestamp;
use kmm_api::testing::ModuleBuilder;
use kmm_api::{ManagedClusterModule, ocm};
use kmm_hub::fleet::assignment::FINALIZER;
use kmm_hub::fleet::outbox::Held;
use kmm_hub::fleet_ui::render::Chrome;
use kmm_hub::fleet_ui::routes::route;
use kmm_hub::fleet_ui::server::{Answer, leader_answer};
use kmm_hub::images::ImageRecord;
use kmm_hub::serve::fleet_view::{ClusterStreams, FleetView, SessionId, Stores};
use kmm_hub::serve::metrics::Metrics;
use kmm_hub::serve::outbound::{Outbound, OutboundSender};
use kmm_proto::v1::{
    Kernel, KernelInventory, ModuleKey, ModuleNodeKey, ModuleNodeStatus, ModuleState,
    NodeStatusReport,
};
use kube::core::DynamicObject;
use kube::runtime::reflector::store::Writer;
use kube::runtime::watcher;
use serde_json::json;

/// Issue #30's bounds for every page.
const MAX_RENDER: Duration = Duration::from_millis(100);
const MAX_BYTES: usize = 500 * 1024;

/// The fleet's kernels: each cluster runs two of them.
const KERNELS: [&str; 5] = [
    "6.1.0-21-amd64",
    "6.1.0-22-amd64",
    "6.1.0-23-amd64",
    "6.8.0-40-generic",
    "6.8.0-41-generic",
];

fn count(variable: &str, default: usize) -> Result<usize> {
    match std::env::var(variable) {
        Ok(value) => value
            .parse()
            .with_context(|| format!("{variable}={value:?} is not a count")),
        Err(_) => Ok(default),
    }
}

fn module(i: usize) -> ManagedClusterModule {
    ModuleBuilder::new(&format!("module-{i:02}"))
        .uid(&format!("u{i}"))
        .finalizers(&[FINALIZER])
        .kernel_mappings(json!([{
            "regexp": "^6\\.",
            "containerImage": format!("registry.example/drivers/module-{i:02}:${{KERNEL_FULL_VERSION}}"),
        }]))
        .build()
}

fn managed_cluster(name: &str) -> Result<DynamicObject> {
    Ok(serde_json::from_value(json!({
        "apiVersion": "cluster.open-cluster-management.io/v1",
        "kind": "ManagedCluster",
        "metadata": {"name": name, "labels": {"env": "prod"}},
        "spec": {"hubAcceptsClient": true},
    }))?)
}

fn cluster_name(c: usize) -> String {
    format!("spoke-{c:05}")
}

fn node_name(n: usize) -> String {
    format!("worker-{n:03}.example.internal")
}

/// The kernel of node `n` of cluster `c`: two kernels per cluster, half its nodes each.
fn kernel_of(c: usize, n: usize) -> &'static str {
    KERNELS[(c + n % 2) % KERNELS.len()]
}

/// Every image the fleet needs is found, as the image worker would record it.
fn check_images(view: &FleetView) {
    for (key, need) in view.image_needs(None) {
        if view.image(&key).is_none() {
            let digest = format!("sha256:{:064x}", key.image.len());
            view.set_image(key, ImageRecord::seeded(&need, digest, Timestamp::now()));
        }
    }
}

/// Most clusters run every module; one in 50 fails one on a node, one in 20 has nodes
/// still loading, one in 100 is disconnected after reporting.
fn report(c: usize, nodes: usize, modules: usize, revision: u64) -> NodeStatusReport {
    let mut statuses = Vec::with_capacity(nodes * modules);
    for n in 0..nodes {
        for m in 0..modules {
            let (state, reason, message) = if c.is_multiple_of(50) && n == 0 && m == 3 {
                (
                    ModuleState::Failed,
                    "LoadFailed",
                    "modprobe: ERROR: could not insert 'module_03': Exec format error",
                )
            } else if c % 20 == 1 && n < 3 {
                (ModuleState::Pending, "", "")
            } else {
                (ModuleState::Loaded, "", "")
            };
            statuses.push(ModuleNodeStatus {
                key: Some(ModuleNodeKey {
                    module: Some(ModuleKey {
                        namespace: "drivers".into(),
                        name: format!("module-{m:02}"),
                    }),
                    node: node_name(n),
                }),
                kernel: kernel_of(c, n).into(),
                state: state.into(),
                reason: reason.into(),
                message: message.into(),
                ..ModuleNodeStatus::default()
            });
        }
    }
    NodeStatusReport {
        full: true,
        statuses,
        intent_revision: revision,
        ..NodeStatusReport::default()
    }
}

fn connect(view: &FleetView, c: usize) -> (SessionId, tokio::sync::watch::Receiver<Outbound>) {
    let cluster = cluster_name(c);
    let outbound = OutboundSender::default();
    let sent = outbound.subscribe();
    let id = view.open_session(&cluster, Held::default(), outbound);
    let kernels = [kernel_of(c, 0), kernel_of(c, 1)]
        .into_iter()
        .map(|release| Kernel {
            release: release.into(),
        })
        .collect();
    view.inventory(
        &cluster,
        id,
        KernelInventory {
            revision: 1,
            kernels,
        },
    );
    (id, sent)
}

/// The fleet view of a synthetic fleet, every watch listed and every proxy reported.
fn fleet(clusters: usize, nodes: usize, modules: usize) -> Result<Arc<FleetView>> {
    let mut module_writer = Writer::<ManagedClusterModule>::default();
    let mut cluster_writer = Writer::<DynamicObject>::new(ocm::MANAGED_CLUSTER.api_resource());
    let stores = Stores {
        modules: module_writer.as_reader(),
        clusters: cluster_writer.as_reader(),
        secrets: Writer::default().as_reader(),
        revisions: Writer::default().as_reader(),
        preflights: Writer::default().as_reader(),
        decisions: Writer::<DynamicObject>::new(ocm::PLACEMENT_DECISION.api_resource()).as_reader(),
    };
    let view = Arc::new(FleetView::new(stores, Metrics::default()));
    view.set_synced();
    for m in 0..modules {
        let module = module(m);
        module_writer.apply_watcher_event(&watcher::Event::Apply(module.clone()));
        view.note_module(&module);
    }
    for c in 0..clusters {
        cluster_writer
            .apply_watcher_event(&watcher::Event::Apply(managed_cluster(&cluster_name(c))?));
        view.cluster_changed(&cluster_name(c));
    }
    // One cluster per pair of kernels first: their images are checked once, so that the
    // others' snapshots go out as they connect.
    for c in 0..KERNELS.len().min(clusters) {
        connect(&view, c);
    }
    check_images(&view);
    for c in 0..clusters {
        let (id, sent) = connect(&view, c);
        let revision = match &*sent.borrow() {
            Outbound::Snapshot(snapshot) => snapshot.revision,
            other => bail!("cluster {c} was sent no snapshot: {other:?}"),
        };
        view.status(&cluster_name(c), id, report(c, nodes, modules, revision));
        if c % 100 == 99 {
            view.close_session(&cluster_name(c), id);
        }
    }
    Ok(view)
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    sorted[((sorted.len() as f64 - 1.0) * p).round() as usize]
}

fn main() -> Result<()> {
    let clusters = count("KMM_BENCH_CLUSTERS", 3_500)?;
    let nodes = count("KMM_BENCH_NODES", 20)?;
    let modules = count("KMM_BENCH_MODULES", 20)?;
    let renders = count("KMM_BENCH_RENDERS", 20)?.max(1);
    let started = Instant::now();
    let view = fleet(clusters, nodes, modules)?;
    println!(
        "fleet of {clusters} clusters x {nodes} nodes x {modules} modules ({} node statuses) built in {:.1} s",
        clusters * nodes * modules,
        started.elapsed().as_secs_f64()
    );
    // The controller counts each touched module's view (and the fleet page shows those
    // counts): as it would after the fleet reported.
    let mut counts = Vec::new();
    for _ in 0..renders {
        for module in view.known_modules() {
            let counting = Instant::now();
            view.module_view(&module);
            counts.push(counting.elapsed());
        }
    }
    counts.sort();
    println!(
        "a module's view counted (the controller's part, per touched module): median {:.1} ms, p95 {:.1} ms",
        percentile(&counts, 0.5).as_secs_f64() * 1e3,
        percentile(&counts, 0.95).as_secs_f64() * 1e3,
    );
    let chrome = Chrome {
        instance: "kmm-hub-bench".into(),
        note: None,
    };
    let first = cluster_name(0);
    let node = node_name(0);
    let pages = [
        ("fleet", "/".to_owned(), None),
        ("module", "/modules/module-03".to_owned(), None),
        (
            "module, failed only",
            "/modules/module-03".to_owned(),
            Some("state=failed"),
        ),
        ("cluster", format!("/clusters/{first}"), None),
        ("node", format!("/clusters/{first}/nodes/{node}"), None),
    ];
    println!(
        "{:<22} {:>10} {:>10} {:>10}  within #30's bounds",
        "page", "median ms", "p95 ms", "KB"
    );
    let mut over = Vec::new();
    for (name, path, query) in pages {
        let mut times = Vec::with_capacity(renders);
        let mut bytes = 0;
        for _ in 0..renders {
            let start = Instant::now();
            let answer = leader_answer(&view, &chrome, route(&path, query));
            times.push(start.elapsed());
            match answer {
                Answer::Page(status, html) if status.is_success() => bytes = html.len(),
                other => bail!("{path}: {other:?}"),
            }
        }
        times.sort();
        let (median, p95) = (percentile(&times, 0.5), percentile(&times, 0.95));
        let within = p95 < MAX_RENDER && bytes < MAX_BYTES;
        if !within {
            over.push(name);
        }
        println!(
            "{name:<22} {:>10.1} {:>10.1} {:>10.1}  {}",
            median.as_secs_f64() * 1e3,
            p95.as_secs_f64() * 1e3,
            bytes as f64 / 1024.0,
            if within { "yes" } else { "NO" }
        );
    }
    if !over.is_empty() {
        bail!("over 100 ms or 500 KB: {}", over.join(", "));
    }
    Ok(())
}
