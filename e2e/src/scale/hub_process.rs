//! `kmm-hub serve` as a child process, confined to one run (its own namespace, add-on
//! name and module selector, no webhook configuration, no election), and what is read
//! from the outside of it: `/readyz`, `/metrics`, and memory and CPU from `/proc`.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use tokio::process::{Child, Command};

use super::{Error, Result, io};
use crate::fleet::http_get_plain;

const LOOPBACK: IpAddr = IpAddr::V4(Ipv4Addr::LOCALHOST);
/// From start to `/readyz` ok: the hub lists every watch first (thousands of
/// ManagedClusters at scale).
const READY_TIMEOUT: Duration = Duration::from_secs(120);
/// SIGTERM to exit: the hub ends every stream and finishes running reconciliations.
const STOP_GRACE: Duration = Duration::from_secs(30);
/// Overrides which binary runs: a path to any `kmm-hub` build.
pub const BINARY_ENV: &str = "KMM_SCALE_HUB_BIN";

/// Which build of kmm-hub runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Profile {
    /// `cargo build --release -p kmm-hub` into `target/fleet-scale` (its own target
    /// directory: the `cargo bench` running the harness holds the lock of the shared one).
    Release,
    /// The workspace's debug binary (`cargo build --bins`; `cargo xtask test` builds it),
    /// for the correctness test, where speed is not measured.
    Debug,
}

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_default()
}

/// The kmm-hub binary of `profile`, built first for [`Profile::Release`]; `$KMM_SCALE_HUB_BIN`
/// wins over both.
pub fn binary(profile: Profile) -> Result<PathBuf> {
    if let Some(path) = std::env::var_os(BINARY_ENV) {
        return existing(PathBuf::from(path), &format!("${BINARY_ENV}"));
    }
    match profile {
        Profile::Release => {
            let target = workspace().join("target").join("fleet-scale");
            let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
            let status = std::process::Command::new(cargo)
                .args(["build", "--release", "-p", "kmm-hub", "--bin", "kmm-hub"])
                .arg("--target-dir")
                .arg(&target)
                .current_dir(workspace())
                .status()
                .map_err(io("running cargo build --release -p kmm-hub"))?;
            if !status.success() {
                return Err(Error::Invalid(format!(
                    "cargo build --release -p kmm-hub failed ({status})"
                )));
            }
            existing(target.join("release").join("kmm-hub"), "the release build")
        }
        Profile::Debug => Ok(crate::binaries::debug("kmm-hub", "kmm-hub")?),
    }
}

fn existing(path: PathBuf, from: &str) -> Result<PathBuf> {
    if path.is_file() {
        Ok(path)
    } else {
        Err(Error::Invalid(format!(
            "{} is missing (expected from {from})",
            path.display()
        )))
    }
}

/// How the run's hub is started.
#[derive(Clone, Debug)]
pub struct HubConfig {
    pub binary: PathBuf,
    /// The fleet hub's admin kubeconfig.
    pub kubeconfig: PathBuf,
    /// `--namespace`: created by the harness, holds the hub's CA Secret.
    pub namespace: String,
    /// `--addon-name`: no add-on of that name exists, so the hub writes to no OCM object.
    pub addon_name: String,
    /// `--module-selector`: only the run's modules.
    pub module_selector: String,
    pub unload_timeout: Duration,
    pub log: PathBuf,
}

/// The hub's counters and gauges the harness reads.
#[derive(Clone, Copy, Debug, Default)]
pub struct HubMetrics {
    pub status_writes: u64,
    pub snapshots_sent: u64,
    pub snapshots_resumed: u64,
    pub connected_clusters: u64,
}

impl HubMetrics {
    /// Streams given their intents: a snapshot sent, or a proxy found holding them.
    pub fn intents_given(&self) -> u64 {
        self.snapshots_sent + self.snapshots_resumed
    }

    fn parse(text: &str) -> Self {
        let value = |name: &str| {
            text.lines()
                .filter(|l| !l.starts_with('#'))
                .find_map(|l| {
                    let (metric, value) = l.rsplit_once(' ')?;
                    (metric == name).then(|| value.parse::<f64>().ok())?
                })
                .map_or(0, |v| v as u64)
        };
        Self {
            status_writes: value("kmm_hub_status_writes_total"),
            snapshots_sent: value("kmm_hub_intent_snapshots_sent_total"),
            snapshots_resumed: value("kmm_hub_intent_snapshots_resumed_total"),
            connected_clusters: value("kmm_hub_connected_clusters"),
        }
    }
}

/// Cumulative figures of the run's hub: counters and CPU add up over restarts.
#[derive(Clone, Copy, Debug, Default)]
pub struct HubFigures {
    pub cpu_seconds: f64,
    pub rss_kib: u64,
    /// The highest `VmHWM` of every process the run started.
    pub peak_rss_kib: u64,
    pub status_writes: u64,
    pub snapshots_sent: u64,
    pub snapshots_resumed: u64,
    /// Of the running process.
    pub connected_clusters: u64,
}

/// The running hub.
#[derive(Debug)]
pub struct HubProcess {
    config: HubConfig,
    pub grpc: SocketAddr,
    metrics: SocketAddr,
    webhook: SocketAddr,
    child: Option<Child>,
    /// What processes already stopped had done, so that figures span a restart.
    retired: HubFigures,
}

impl HubProcess {
    /// Starts the hub on free loopback ports and waits until it is ready.
    pub async fn start(config: HubConfig) -> Result<Self> {
        let mut hub = Self {
            config,
            grpc: free_port()?,
            metrics: free_port()?,
            webhook: free_port()?,
            child: None,
            retired: HubFigures::default(),
        };
        hub.spawn().await?;
        Ok(hub)
    }

    pub fn log(&self) -> &Path {
        &self.config.log
    }

    async fn spawn(&mut self) -> Result<()> {
        let log = std::fs::File::options()
            .create(true)
            .append(true)
            .open(&self.config.log)
            .map_err(io(format!("opening {}", self.config.log.display())))?;
        let stderr = log
            .try_clone()
            .map_err(io(format!("opening {}", self.config.log.display())))?;
        let c = &self.config;
        let child = Command::new(&c.binary)
            .arg("serve")
            .args(["--leader-elect=false", "--webhook-configuration", ""])
            .args(["--namespace", &c.namespace])
            .args(["--addon-name", &c.addon_name])
            .args(["--module-selector", &c.module_selector])
            .args(["--grpc-san", "127.0.0.1"])
            .arg(format!("--grpc-addr={}", self.grpc))
            .arg(format!("--metrics-addr={}", self.metrics))
            .arg(format!("--webhook-addr={}", self.webhook))
            .arg(format!("--unload-timeout={}s", c.unload_timeout.as_secs()))
            .env("KUBECONFIG", &c.kubeconfig)
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(stderr)
            .kill_on_drop(true)
            .spawn()
            .map_err(io(format!("starting {}", c.binary.display())))?;
        self.child = Some(child);
        self.wait_ready().await
    }

    async fn wait_ready(&mut self) -> Result<()> {
        let deadline = Instant::now() + READY_TIMEOUT;
        loop {
            if let Some(status) = self
                .child
                .as_mut()
                .and_then(|c| c.try_wait().ok().flatten())
            {
                return Err(self.failed(format!("exited before it was ready ({status})")));
            }
            if http_get_plain(LOOPBACK, self.metrics.port(), "/readyz")
                .await
                .is_some()
            {
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(self.failed(format!(
                    "not ready within {}s (/readyz)",
                    READY_TIMEOUT.as_secs()
                )));
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    fn failed(&self, what: String) -> Error {
        Error::Hub {
            what,
            log: self.config.log.clone(),
        }
    }

    pub fn pid(&self) -> Result<i32> {
        self.child
            .as_ref()
            .and_then(Child::id)
            .map(|pid| pid as i32)
            .ok_or_else(|| self.failed("is not running".into()))
    }

    pub async fn metrics(&self) -> Result<HubMetrics> {
        http_get_plain(LOOPBACK, self.metrics.port(), "/metrics")
            .await
            .map(|text| HubMetrics::parse(&text))
            .ok_or_else(|| self.failed(format!("/metrics on {} did not answer", self.metrics)))
    }

    /// The running process's CPU seconds and memory, plus what stopped ones had used.
    pub async fn figures(&self) -> Result<HubFigures> {
        let pid = self.pid()?;
        let metrics = self.metrics().await?;
        let (rss, peak) = crate::process::memory_kib(pid)
            .ok_or_else(|| self.failed(format!("/proc/{pid}/status is unreadable")))?;
        let r = &self.retired;
        Ok(HubFigures {
            cpu_seconds: r.cpu_seconds + cpu_seconds(pid)?,
            rss_kib: rss,
            peak_rss_kib: r.peak_rss_kib.max(peak),
            status_writes: r.status_writes + metrics.status_writes,
            snapshots_sent: r.snapshots_sent + metrics.snapshots_sent,
            snapshots_resumed: r.snapshots_resumed + metrics.snapshots_resumed,
            connected_clusters: metrics.connected_clusters,
        })
    }

    /// SIGTERM and wait for the exit, keeping what the process had done.
    pub async fn stop(&mut self) -> Result<()> {
        let figures = self.figures().await?;
        let pid = self.pid()?;
        // Between the sample and the exit only the shutdown runs: nothing is lost that
        // a scenario's figures would miss.
        self.retired = HubFigures {
            connected_clusters: 0,
            rss_kib: 0,
            ..figures
        };
        kill(Pid::from_raw(pid), Signal::SIGTERM)
            .map_err(|e| self.failed(format!("cannot be signalled: {e}")))?;
        let child = self.child.as_mut().expect("pid() found the child");
        let status = tokio::time::timeout(STOP_GRACE, child.wait()).await;
        self.child = None;
        match status {
            Ok(Ok(status)) if status.success() => Ok(()),
            Ok(Ok(status)) => Err(self.failed(format!("exited with {status} on SIGTERM"))),
            Ok(Err(e)) => Err(self.failed(format!("cannot be waited for: {e}"))),
            // Dropping the child killed it (kill_on_drop).
            Err(_) => Err(self.failed(format!(
                "did not exit within {}s of SIGTERM",
                STOP_GRACE.as_secs()
            ))),
        }
    }

    /// Starts the hub again with the same flags and ports.
    pub async fn restart(&mut self) -> Result<()> {
        if self.child.is_some() {
            self.stop().await?;
        }
        self.spawn().await
    }

    /// CPU seconds of the current process (for a rate over an interval).
    pub fn cpu_seconds(&self) -> Result<f64> {
        cpu_seconds(self.pid()?)
    }
}

/// A port free on loopback now (the hub binds it a moment later).
fn free_port() -> Result<SocketAddr> {
    std::net::TcpListener::bind((LOOPBACK, 0))
        .and_then(|l| l.local_addr())
        .map_err(io("finding a free loopback port"))
}

/// User plus system CPU time of process `pid` (`/proc/<pid>/stat`), in seconds.
pub fn cpu_seconds(pid: i32) -> Result<f64> {
    let path = format!("/proc/{pid}/stat");
    let stat = std::fs::read_to_string(&path).map_err(io(format!("reading {path}")))?;
    // Fields after the command name, which may hold spaces: state is field 3, utime 14,
    // stime 15.
    let fields: Vec<&str> = stat
        .rsplit_once(')')
        .map(|(_, rest)| rest.split_whitespace().collect())
        .unwrap_or_default();
    let ticks = |i: usize| fields.get(i).and_then(|v| v.parse::<u64>().ok());
    let (Some(user), Some(system)) = (ticks(11), ticks(12)) else {
        return Err(Error::Invalid(format!("{path}: unexpected format")));
    };
    Ok((user + system) as f64 / clock_ticks())
}

fn clock_ticks() -> f64 {
    nix::unistd::sysconf(nix::unistd::SysconfVar::CLK_TCK)
        .ok()
        .flatten()
        .map_or(100.0, |t| t as f64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_hubs_counters_and_gauges() {
        let text = "# HELP kmm_hub_status_writes ManagedClusterModule status writes\n\
                    # TYPE kmm_hub_status_writes counter\n\
                    kmm_hub_status_writes_total 12\n\
                    kmm_hub_connected_clusters 1000\n\
                    kmm_hub_intent_snapshots_sent_total 3005\n\
                    kmm_hub_intent_snapshots_resumed_total 7\n\
                    kmm_hub_admission_reviews_total{decision=\"allowed\"} 3\n";
        let m = HubMetrics::parse(text);
        assert_eq!(
            (m.status_writes, m.snapshots_sent, m.connected_clusters),
            (12, 3005, 1000)
        );
        assert_eq!(m.intents_given(), 3012);
    }

    #[test]
    fn reads_this_process_cpu_time() {
        let pid = std::process::id() as i32;
        assert!(cpu_seconds(pid).unwrap() >= 0.0);
    }
}
