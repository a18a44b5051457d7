//! Agent figures (a benchmark, not a timed test): RSS idle and during a pull, and the
//! time from receiving an intent to reporting "loaded", excluding the download.
//!
//! Runs the real agent binary with the simulated kernel backend against a real
//! registry (Debian's docker-registry). `cargo bench -p kmm-node-agent --bench agent`.

#[path = "../tests/support/mod.rs"]
mod support;

use std::path::Path;
use std::process::{Child, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, mpsc};
use std::time::{Duration, Instant};

use kmm_node_agent::desired::{DesiredModule, DesiredSnapshot, Modprobe, RegistryTls};
use support::*;

const ITERATIONS: usize = 10;
const BIG_FIRMWARE_MIB: usize = 64;

fn status_kib(pid: u32, field: &str) -> u64 {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    text.lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|v| v.trim().trim_end_matches(" kB").trim().parse().ok())
        .unwrap_or(0)
}

struct Agent {
    child: Child,
    lines: mpsc::Receiver<serde_json::Value>,
}

impl Drop for Agent {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Agent {
    fn next(&self) -> serde_json::Value {
        self.lines
            .recv_timeout(Duration::from_secs(300))
            .expect("agent output")
    }
    /// The next event for `key` and `action` ("load"/"unload"); others are skipped.
    fn wait_for(&self, key: &str, action: &str) -> serde_json::Value {
        loop {
            let line = self.next();
            if let Some(event) = line.get("event") {
                assert_eq!(event["outcome"]["result"], "success", "{event}");
                if event["key"] == key && event["action"] == action {
                    return event.clone();
                }
            }
        }
    }
}

fn start(node: &Path, kernel: &str, desired: &Path) -> Agent {
    let log = std::fs::File::create(node.join("agent.log")).unwrap();
    let (child, lines) = spawn_simulated_agent(node, kernel, desired, 5, Stdio::from(log));
    Agent { child, lines }
}

fn module(key: &str, image: &str, name: &str, firmware: bool) -> DesiredModule {
    DesiredModule {
        key: key.into(),
        version: None,
        image: image.into(),
        digest: None,
        modprobe: Modprobe {
            module_name: Some(name.into()),
            firmware_path: firmware.then(|| "/firmware".into()),
            ..Default::default()
        },
        in_tree_modules_to_remove: vec![],
        registry_tls: RegistryTls {
            insecure: true,
            insecure_skip_tls_verify: false,
        },
        pull_secret: None,
    }
}

/// Writes a snapshot loading `modules` and unloading `unload`; returns when it did.
fn write(path: &Path, modules: &[DesiredModule], unload: &[&str]) -> Instant {
    static REVISION: AtomicU64 = AtomicU64::new(0);
    let snapshot = DesiredSnapshot {
        revision: REVISION.fetch_add(1, Ordering::Relaxed) + 1,
        modules: modules.to_vec(),
        unload: unload.iter().map(|k| k.to_string()).collect(),
    };
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, serde_json::to_vec(&snapshot).unwrap()).unwrap();
    std::fs::rename(&tmp, path).unwrap();
    Instant::now()
}

fn stats(mut ms: Vec<f64>) -> String {
    ms.sort_by(f64::total_cmp);
    let median = ms[ms.len() / 2];
    format!(
        "median {median:.1} ms, min {:.1} ms, max {:.1} ms (n={})",
        ms[0],
        ms[ms.len() - 1],
        ms.len()
    )
}

#[tokio::main]
async fn main() {
    let k = kernel();
    let registry = Registry::plain();
    let small = registry.image("bench/hello:v1");
    registry
        .push_sample("bench/hello:v1", &Sample::good(k))
        .await;
    let mut big = Sample::good(k);
    let mut noise = vec![0u8; BIG_FIRMWARE_MIB << 20];
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    for chunk in noise.chunks_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        chunk.copy_from_slice(&x.to_le_bytes()[..chunk.len()]);
    }
    big.firmware.push(("kmm/big.bin".into(), noise));
    let big_image = registry.image("bench/big:v1");
    registry.push_sample("bench/big:v1", &big).await;

    let node = tempfile::tempdir().unwrap();
    eprintln!("agent log: {}", node.path().join("agent.log").display());
    let desired = node.path().join("desired.json");
    write(&desired, &[], &[]);
    let agent = start(node.path(), k, &desired);
    let pid = agent.child.id();
    let hello = agent.next();
    assert!(hello.get("hello").is_some());
    std::thread::sleep(Duration::from_millis(500));
    let idle = status_kib(pid, "VmRSS:");

    // RSS while pulling and extracting a 64 MiB layer.
    let peak = Arc::new(AtomicU64::new(0));
    let done = Arc::new(AtomicBool::new(false));
    let sampler = {
        let (peak, done) = (peak.clone(), done.clone());
        std::thread::spawn(move || {
            while !done.load(Ordering::Relaxed) {
                peak.fetch_max(status_kib(pid, "VmRSS:"), Ordering::Relaxed);
                std::thread::sleep(Duration::from_millis(5));
            }
        })
    };
    let started = write(
        &desired,
        &[module("bench/big", &big_image, MODULE, true)],
        &[],
    );
    let event = agent.wait_for("bench/big", "load");
    let big_wall = started.elapsed();
    done.store(true, Ordering::Relaxed);
    sampler.join().unwrap();
    let hwm = status_kib(pid, "VmHWM:");
    let after = status_kib(pid, "VmRSS:");
    write(&desired, &[], &["bench/big"]);
    agent.wait_for("bench/big", "unload");

    // Intent to loaded, excluding the download: each load pulls afresh (the previous
    // unload let the cache collect the image) and its reported pull time is subtracted.
    let mut fresh = vec![];
    let mut kernel_side = vec![];
    let mut first = None;
    for _ in 0..ITERATIONS {
        let started = write(
            &desired,
            &[module("bench/hello", &small, DEP_MODULE, true)],
            &[],
        );
        let event = agent.wait_for("bench/hello", "load");
        fresh.push(started.elapsed().as_secs_f64() * 1000.0 - event["pullMs"].as_f64().unwrap());
        kernel_side.push(event["durationMs"].as_f64().unwrap());
        first.get_or_insert(event);
        write(&desired, &[], &["bench/hello"]);
        agent.wait_for("bench/hello", "unload");
    }
    let first = first.unwrap();

    // A version change with the image cached: intent to the new version loaded
    // (the old one is unloaded first).
    let mut upgrade = vec![];
    let mut m = module("bench/hello", &small, DEP_MODULE, true);
    m.version = Some("0".into());
    write(&desired, std::slice::from_ref(&m), &[]);
    agent.wait_for("bench/hello", "load");
    for i in 1..=ITERATIONS {
        m.version = Some(i.to_string());
        let started = write(&desired, std::slice::from_ref(&m), &[]);
        let event = agent.wait_for("bench/hello", "load");
        assert_eq!(event["pullMs"], 0, "{event}");
        upgrade.push(started.elapsed().as_secs_f64() * 1000.0);
    }
    let idle_after = status_kib(pid, "VmRSS:");

    println!("kmm-node-agent figures (simulated kernel {k}, registry on 127.0.0.1)");
    println!("  RSS idle: {idle} KiB");
    println!(
        "  RSS during a {BIG_FIRMWARE_MIB} MiB pull+extract+firmware copy: peak sampled {} KiB, VmHWM {hwm} KiB, after {after} KiB",
        peak.load(Ordering::Relaxed)
    );
    println!(
        "  that load: pull+extract {} ms, kernel side {} ms, intent to loaded {} ms",
        event["pullMs"],
        event["durationMs"],
        big_wall.as_millis()
    );
    println!(
        "  first load of the sample image: pull+extract {} ms, kernel side {} ms",
        first["pullMs"], first["durationMs"]
    );
    println!("  intent -> loaded, download excluded: {}", stats(fresh));
    println!(
        "    of which kernel side (firmware, depmod check, modprobe dry run, modinfo): {}",
        stats(kernel_side)
    );
    println!(
        "  version change, image cached, intent -> new version loaded: {}",
        stats(upgrade)
    );
    println!("  RSS idle after the runs: {idle_after} KiB");
    println!("  (intents are fed by polling --desired-file every 5 ms, which is included)");
}
