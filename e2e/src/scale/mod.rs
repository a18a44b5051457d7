//! The fleet scale harness (issue 14): a real `kmm-hub` process in front of N simulated
//! clusters on the local fleet's real hub apiserver.
//!
//! Real: the kube-apiserver, etcd and OCM controllers of the fleet's hub, N accepted
//! `ManagedCluster`s, the `kmm-hub` binary ([`hub_process`]), its gRPC/mTLS endpoint
//! with one client certificate per cluster issued from the hub's CA, the images the hub
//! checks in the fleet's registry, and every figure read from the hub (`/metrics`,
//! `/proc`, `ManagedClusterModule` status). Simulated: only the spoke proxies
//! ([`proxy`]): many per process, each with its own connection, reporting M nodes on a
//! mix of kernels and answering every intent snapshot as a proxy whose agents load at
//! once would.
//!
//! [`scenario::Harness`] sets a run up, drives the scenarios and tears everything down;
//! [`report`] formats the `fleet-scale:` lines.

pub mod clusters;
pub mod hostile;
pub mod hub_process;
pub mod modules;
pub mod proxy;
pub mod report;
pub mod scenario;

use std::path::PathBuf;

/// Why the harness failed.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Fleet(#[from] crate::Error),
    #[error("kubernetes API: {0}")]
    Kube(#[from] kube::Error),
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },
    #[error("kmm-hub {what}; its log: {}", log.display())]
    Hub { what: String, log: PathBuf },
    #[error("the hub's CA: {0}")]
    Pki(#[from] kmm_runtime::pki::Error),
    #[error("gRPC endpoint: {0}")]
    Transport(#[from] tonic::transport::Error),
    #[error("timed out after {seconds}s waiting for {what}; last observed: {observed}")]
    Timeout {
        what: String,
        seconds: u64,
        observed: String,
    },
    #[error(transparent)]
    Wait(#[from] crate::watched::WaitError),
    #[error("{0}")]
    Invalid(String),
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

fn io(context: impl Into<String>) -> impl FnOnce(std::io::Error) -> Error {
    let context = context.into();
    move |source| Error::Io { context, source }
}

/// What one run puts in front of the hub.
#[derive(Clone, Debug)]
pub struct Shape {
    pub clusters: usize,
    pub nodes_per_cluster: usize,
    pub modules: usize,
}

impl Shape {
    pub fn nodes(&self) -> usize {
        self.clusters * self.nodes_per_cluster
    }
}

/// Polls `probe` every `every` until it yields `Some`, failing after `timeout` with
/// `what` and the probe's last observation (its `Err`).
pub async fn poll_until<T, F, Fut>(
    what: &str,
    timeout: std::time::Duration,
    every: std::time::Duration,
    mut probe: F,
) -> Result<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<Result<T, String>>>,
{
    let deadline = std::time::Instant::now() + timeout;
    loop {
        let observed = match probe().await? {
            Ok(value) => return Ok(value),
            Err(observed) => observed,
        };
        if std::time::Instant::now() >= deadline {
            return Err(Error::Timeout {
                what: what.to_owned(),
                seconds: timeout.as_secs(),
                observed,
            });
        }
        tokio::time::sleep(every).await;
    }
}

/// A name for one run: short (it prefixes cluster names) and unlikely to repeat.
pub fn run_id() -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    format!(
        "fs{:06x}",
        (nanos ^ u128::from(std::process::id())) & 0xff_ffff
    )
}
