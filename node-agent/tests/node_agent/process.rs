//! The agent binary with the simulated backend: SIGTERM exits promptly without
//! unloading, and a restarted agent does not reload what is loaded.

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use kmm_node_agent::kernel::{Kernel, SimulatedKernel};

use kmm_node_agent::desired::DesiredSnapshot;

use crate::lifecycle::{desired, load};
use crate::support::*;

/// A running agent process; killed on drop if still running.
pub struct AgentProcess {
    pub child: Child,
    pub lines: mpsc::Receiver<serde_json::Value>,
}

impl Drop for AgentProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl AgentProcess {
    pub fn start(node: &Path, kernel: &str, desired_file: &Path) -> Self {
        let (child, lines) = spawn_simulated_agent(node, kernel, desired_file, 20, Stdio::null());
        Self { child, lines }
    }

    /// The next stdout line, within `timeout`.
    pub fn next(&self, timeout: Duration) -> serde_json::Value {
        self.lines
            .recv_timeout(timeout)
            .unwrap_or_else(|e| panic!("no output from the agent within {timeout:?}: {e}"))
    }

    /// Sends SIGTERM and waits (with a deadline) for the exit status.
    pub fn terminate(&mut self, timeout: Duration) -> std::process::ExitStatus {
        let status = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status()
            .unwrap();
        assert!(status.success());
        let started = Instant::now();
        poll("the agent to exit after SIGTERM", timeout, || {
            self.child.try_wait().unwrap()
        });
        let status = self.child.wait().unwrap();
        eprintln!("agent exited {:?} after SIGTERM", started.elapsed());
        status
    }
}

pub fn write_desired(path: &Path, snapshot: &DesiredSnapshot) {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, serde_json::to_vec(snapshot).unwrap()).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

#[tokio::test]
async fn sigterm_never_unloads_and_a_restart_does_not_reload() {
    let k = kernel();
    let registry = Registry::plain();
    registry
        .push_sample("samples/hello:v1", &Sample::good(k))
        .await;
    let node = tempfile::tempdir().unwrap();
    let desired_file = node.path().join("desired.json");
    let first = desired(registry.image("samples/hello:v1"), "1");
    write_desired(&desired_file, &load(std::slice::from_ref(&first)));

    let mut agent = AgentProcess::start(node.path(), k, &desired_file);
    let hello = agent.next(Duration::from_secs(30));
    assert_eq!(hello["hello"]["kernelRelease"], k);
    assert_eq!(hello["hello"]["loaded"].as_array().unwrap().len(), 0);
    let event = agent.next(Duration::from_secs(60));
    assert_eq!(event["event"]["action"], "load", "{event}");
    assert_eq!(event["event"]["outcome"]["result"], "success", "{event}");

    let status = agent.terminate(Duration::from_secs(5));
    assert!(status.success(), "{status}");
    let kernel_state = SimulatedKernel::open(node.path().join("kernel"), k).unwrap();
    assert_eq!(
        kernel_state
            .loaded_modules()
            .unwrap()
            .into_iter()
            .collect::<Vec<_>>(),
        [MODULE, DEP_MODULE],
        "SIGTERM unloaded modules"
    );

    // Restarted: it knows what it loaded, and loads only what is new.
    let mut agent = AgentProcess::start(node.path(), k, &desired_file);
    let hello = agent.next(Duration::from_secs(30));
    assert_eq!(
        hello["hello"]["loaded"][0]["key"], "kmm-ops/hello",
        "{hello}"
    );
    let mut second = desired(registry.image("samples/hello:v1"), "1");
    second.key = "kmm-ops/second".into();
    second.modprobe.module_name = Some(MODULE.into());
    second.modprobe.firmware_path = None;
    write_desired(&desired_file, &load(&[second]));
    let event = agent.next(Duration::from_secs(60));
    assert_eq!(
        event["event"]["key"], "kmm-ops/second",
        "the restart reloaded: {event}"
    );
    assert_eq!(event["event"]["outcome"]["result"], "success", "{event}");
    assert!(agent.terminate(Duration::from_secs(5)).success());
}
