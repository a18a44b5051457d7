//! `kmm-hub serve` as a process: flags, /healthz /readyz /metrics, and a clean exit on
//! SIGTERM, against the local fleet's hub API server. Runs the debug binary
//! (`kmm_e2e::binaries`: `cargo build --bins -p kmm-hub` first).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use kmm_e2e::fixture::{Fleet, TempNamespace, wait_until};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const WAIT: Duration = Duration::from_secs(30);

fn hub_binary() -> PathBuf {
    kmm_e2e::binaries::debug("kmm-hub", "kmm-hub").unwrap_or_else(|e| panic!("{e}"))
}

async fn get(addr: SocketAddr, path: &str) -> Result<String, String> {
    let mut stream = tokio::net::TcpStream::connect(addr)
        .await
        .map_err(|e| e.to_string())?;
    let request = format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
    stream
        .write_all(request.as_bytes())
        .await
        .map_err(|e| e.to_string())?;
    let mut response = String::new();
    stream
        .read_to_string(&mut response)
        .await
        .map_err(|e| e.to_string())?;
    Ok(response)
}

fn free_port() -> SocketAddr {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
}

struct KillOnDrop(Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[tokio::test]
async fn serves_health_and_metrics_and_stops_on_sigterm() {
    let fleet = Fleet::get()
        .await
        .expect("this test needs the local fleet (cargo xtask env up)");
    let namespace = TempNamespace::create(&fleet.hub, "kmm-hub-process")
        .await
        .unwrap();
    let kubeconfig = &fleet.state.cluster("hub").unwrap().kubeconfig;
    let metrics = free_port();
    let mut hub = KillOnDrop(
        Command::new(hub_binary())
            .args([
                "serve",
                "--log-format",
                "json",
                "--namespace",
                &namespace.name,
            ])
            .args(["--grpc-addr", "127.0.0.1:0", "--unload-timeout", "30s"])
            .args(["--metrics-addr", &metrics.to_string()])
            // Leave the fleet's own webhook configuration to the fleet's hub.
            .args(["--webhook-addr", "127.0.0.1:0", "--webhook-configuration="])
            // Manage no module of anyone else sharing the fleet.
            .args([
                "--module-selector",
                &format!("test.kmm.sigs.x-k8s.io/hub={}", namespace.name),
            ])
            // Nor the fleet's own add-on: this one has no OCM objects.
            .args(["--addon-name", &namespace.name])
            .env("KUBECONFIG", kubeconfig)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("kmm-hub starts"),
    );

    // Read as it is written: a full pipe would block the hub's logging, and its exit.
    let logs = {
        let mut stderr = hub.0.stderr.take().expect("stderr is piped");
        std::thread::spawn(move || {
            let mut logs = String::new();
            std::io::Read::read_to_string(&mut stderr, &mut logs)
                .map(|_| logs)
                .unwrap_or_default()
        })
    };
    wait_until("kmm-hub to be ready", WAIT, || async {
        let response = get(metrics, "/readyz").await?;
        if response.starts_with("HTTP/1.1 200") {
            Ok(())
        } else {
            Err(response)
        }
    })
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    assert!(
        get(metrics, "/healthz")
            .await
            .unwrap()
            .starts_with("HTTP/1.1 200")
    );
    let body = get(metrics, "/metrics").await.unwrap();
    for metric in [
        "kmm_hub_connected_clusters 0",
        // Alone, it wins the namespace's Lease.
        "kmm_hub_leader 1",
        "kmm_hub_intent_snapshots_sent_total",
        "kmm_hub_reconcile_errors_total",
    ] {
        assert!(body.contains(metric), "{metric} missing from {body}");
    }

    kill(Pid::from_raw(hub.0.id() as i32), Signal::SIGTERM).unwrap();
    let status = wait_until("kmm-hub to exit after SIGTERM", WAIT, || {
        let status = hub.0.try_wait();
        async move {
            match status {
                Ok(Some(status)) => Ok(status),
                Ok(None) => Err("still running".to_string()),
                Err(e) => Err(e.to_string()),
            }
        }
    })
    .await;
    if status.is_err() {
        let _ = hub.0.kill();
        let _ = hub.0.wait();
    }
    let logs = logs.join().expect("the log reader");
    let status = status.unwrap_or_else(|e| panic!("{e}; its log: {logs}"));
    assert!(status.success(), "kmm-hub exited with {status}: {logs}");
    for line in logs.lines() {
        let _: serde_json::Value = serde_json::from_str(line)
            .unwrap_or_else(|e| panic!("--log-format json prints JSON lines ({e}): {line}"));
    }
    assert!(logs.contains("shutting down"), "{logs}");
    assert!(
        !logs.contains("PRIVATE KEY"),
        "key material in the logs: {logs}"
    );
    namespace.delete().await.unwrap();
}

#[test]
fn an_unusable_builder_image_is_refused_at_start() {
    let out = Command::new(hub_binary())
        .args([
            "serve",
            "--builder-image",
            "registry.example.com/kmm-builder",
        ])
        // Refused before any API server is needed.
        .env("KUBECONFIG", "/nonexistent")
        .output()
        .expect("kmm-hub runs");
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("--builder-image") && stderr.contains("neither a tag nor a digest"),
        "{stderr}"
    );
}
