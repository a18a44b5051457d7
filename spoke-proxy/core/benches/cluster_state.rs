//! Figures for the proxy's state (`cargo bench -p kmm-spoke-proxy-core --bench cluster_state`):
//! a cluster of N nodes (1,000 and 5,000; `KMM_BENCH_NODES` for others) x 20 modules, each
//! node with the labels a kubelet sets, running one of two kernels, every module loaded
//! everywhere. Printed per size:
//!
//! - the time to list the nodes, apply a snapshot (every node placed), take every agent's
//!   hello, and give each (module, node) its load event with the status delta and label
//!   patch the proxy then sends;
//! - the time of a full status report (what a (re)connect to the hub sends) and of one
//!   node's labels changing;
//! - **the heap the state holds per node**, counted exactly by the bench's allocator (the
//!   system's, counting the bytes allocated and freed): after the nodes are listed, and with every
//!   module loaded and labelled.

use std::collections::BTreeMap;
use std::time::Instant;

use kmm_proto::v1::{
    Action, AgentHello, IntentSnapshot, KernelTarget, ModuleEvent, ModuleIntent, ModuleKey,
    ModuleLoad, Outcome, PullCredential, kernel_target::Target, pull_credential::Content,
};
use kmm_spoke_proxy_core::cluster_state::ClusterState;
use kmm_spoke_proxy_core::node_facts::NodeFacts;

#[global_allocator]
static ALLOC: stats_alloc::StatsAlloc<std::alloc::System> = stats_alloc::StatsAlloc::system();

const MODULES: usize = 20;
const KERNELS: [&str; 2] = ["6.1.0-27-amd64", "6.1.0-28-amd64"];

fn heap() -> u64 {
    let stats = ALLOC.stats();
    (stats.bytes_allocated - stats.bytes_deallocated) as u64
}

fn node_name(i: usize) -> String {
    format!("worker-{i:05}.pool-a.example.internal")
}

/// A node as a kubelet and a cloud provider label it.
fn node(i: usize) -> NodeFacts {
    let name = node_name(i);
    let labels: BTreeMap<String, String> = [
        ("beta.kubernetes.io/arch", "amd64".to_string()),
        ("beta.kubernetes.io/os", "linux".to_string()),
        ("kubernetes.io/arch", "amd64".to_string()),
        ("kubernetes.io/hostname", name.clone()),
        ("kubernetes.io/os", "linux".to_string()),
        ("node-role.kubernetes.io/worker", String::new()),
        (
            "node.kubernetes.io/instance-type",
            "m6i.2xlarge".to_string(),
        ),
        ("topology.kubernetes.io/region", "eu-west-1".to_string()),
        (
            "topology.kubernetes.io/zone",
            format!("eu-west-1{}", ["a", "b", "c"][i % 3]),
        ),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect();
    NodeFacts {
        uid: format!("6f1c2d4e-0000-4000-8000-{i:012}"),
        kernel: KERNELS[i % KERNELS.len()].to_string(),
        boot_id: format!("b0071d00-0000-4000-8000-{i:012}"),
        labels,
        taints: Vec::new(),
        name,
    }
}

fn key(m: usize) -> ModuleKey {
    ModuleKey {
        namespace: "kmm-fleet".into(),
        name: format!("module-{m:02}"),
    }
}

fn snapshot(revision: u64) -> IntentSnapshot {
    let modules = (0..MODULES)
        .map(|m| ModuleIntent {
            key: Some(key(m)),
            generation: 1,
            node_selector: [("kubernetes.io/os".to_string(), "linux".to_string())].into(),
            kernels: KERNELS
                .iter()
                .map(|kernel| KernelTarget {
                    kernel: (*kernel).to_string(),
                    target: Some(Target::Load(ModuleLoad {
                        image: format!("registry.example.com/kmm/module-{m:02}:{kernel}"),
                        version: "v1".into(),
                        pull_credential_id: "pull".into(),
                        ..Default::default()
                    })),
                })
                .collect(),
            ..Default::default()
        })
        .collect();
    IntentSnapshot {
        revision,
        modules,
        credentials: vec![PullCredential {
            id: "pull".into(),
            content: Some(Content::DockerConfigJson(
                br#"{"auths":{"registry.example.com":{"auth":"cm9ib3Q6cHc="}}}"#.to_vec(),
            )),
        }],
        ..IntentSnapshot::default()
    }
}

fn hello(node: &NodeFacts) -> AgentHello {
    AgentHello {
        node_name: node.name.clone(),
        boot_id: node.boot_id.clone(),
        kernel_release: node.kernel.clone(),
        agent_version: "bench".into(),
        loaded: Vec::new(),
    }
}

fn loaded(m: usize, revision: u64) -> ModuleEvent {
    ModuleEvent {
        key: Some(key(m)),
        action: Action::Load.into(),
        outcome: Outcome::Succeeded.into(),
        version: "v1".into(),
        image_digest: format!("sha256:{m:064}"),
        duration_ms: 40,
        desired_revision: revision,
        ..Default::default()
    }
}

/// The node as the watch sees it once the proxy's label patch (a JSON merge patch) applied.
fn patched(mut node: NodeFacts, patch: &serde_json::Value) -> NodeFacts {
    if let Some(labels) = patch["metadata"]["labels"].as_object() {
        for (k, v) in labels {
            match v.as_str() {
                Some(v) => node.labels.insert(k.clone(), v.to_string()),
                None => node.labels.remove(k),
            };
        }
    }
    node
}

fn ms(since: Instant) -> f64 {
    since.elapsed().as_secs_f64() * 1000.0
}

fn run(nodes: usize) {
    let facts: Vec<NodeFacts> = (0..nodes).map(node).collect();
    let start = heap();
    let mut state = ClusterState::new(1);

    let t = Instant::now();
    state.replace_nodes(facts.clone());
    let list_ms = ms(t);
    let listed = heap() - start;

    let t = Instant::now();
    state.set_intents(snapshot(1));
    let snapshot_ms = ms(t);
    let placed = heap() - start;

    let t = Instant::now();
    for node in &facts {
        state.agent_hello(&node.name, &hello(node));
    }
    let hellos_ms = ms(t);

    let t = Instant::now();
    let mut events = 0;
    for node in &facts {
        let revision = state.desired_revision(&node.name);
        assert_eq!(state.desired_modules(&node.name).modules.len(), MODULES);
        for m in 0..MODULES {
            state
                .agent_event(&node.name, &loaded(m, revision))
                .expect("a module sent to the node");
            events += 1;
            let dirty = state.take_status_dirty();
            let statuses = state.statuses_of(&dirty);
            assert_eq!(statuses[&node.name].len(), MODULES);
            for dirty in state.take_label_dirty() {
                if let Some(patch) = state.label_patch(&dirty) {
                    let current = state.node(&dirty).expect("a listed node").clone();
                    state.upsert_node(patched(current, &patch));
                }
            }
        }
    }
    let per_event_ms = ms(t) / events as f64;
    let held = heap() - start;

    let t = Instant::now();
    let report = state.all_statuses();
    let full_ms = ms(t);
    assert_eq!(report.len(), nodes);
    drop(report);

    // A hundred nodes each change a label, a hundred others their kernel.
    let some = nodes.min(100);
    let t = Instant::now();
    for node in &facts[..some] {
        let current = state.node(&node.name).expect("listed").clone();
        let labelled = patched(
            current,
            &serde_json::json!({"metadata": {"labels": {"team": "storage"}}}),
        );
        assert!(state.upsert_node(labelled));
    }
    let labels_ms = ms(t) / some as f64;
    let t = Instant::now();
    for node in &facts[nodes - some..] {
        let mut upgraded = state.node(&node.name).expect("listed").clone();
        upgraded.kernel = "6.1.0-29-amd64".into();
        assert!(state.upsert_node(upgraded));
    }
    let kernel_ms = ms(t) / some as f64;

    println!(
        "{nodes} nodes x {MODULES} modules: list {list_ms:.1} ms, snapshot applied {snapshot_ms:.1} ms, \
         {nodes} hellos {hellos_ms:.1} ms, one load event with its status delta and label patch \
         {per_event_ms:.3} ms ({events} events), full status report {full_ms:.1} ms, one node's \
         labels {labels_ms:.2} ms, one node's kernel {kernel_ms:.2} ms"
    );
    println!(
        "{nodes} nodes x {MODULES} modules: heap {:.1} MiB, {:.0} bytes per node listed, \
         {:.0} with the snapshot placed, {:.0} with every module loaded and labelled \
         ({:.0} per node and module)",
        held as f64 / (1024.0 * 1024.0),
        listed as f64 / nodes as f64,
        placed as f64 / nodes as f64,
        held as f64 / nodes as f64,
        (held - listed) as f64 / (nodes * MODULES) as f64,
    );
}

fn main() {
    let sizes: Vec<usize> = match std::env::var("KMM_BENCH_NODES") {
        Ok(nodes) => vec![nodes.parse().expect("KMM_BENCH_NODES is a count")],
        Err(_) => vec![1_000, 5_000],
    };
    for nodes in sizes {
        run(nodes);
    }
}
