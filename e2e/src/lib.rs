//! The kmm-fleet local fleet: real hub and spoke control planes (kube-apiserver, etcd,
//! kube-controller-manager, kube-scheduler, KWOK, Open Cluster Management) running as
//! processes on 127.0.0.1, real kubelet nodes (containerd, kube-proxy) in their own
//! namespaces, a real OCI registry with sample kmod images, and the test fixture the
//! end-to-end tests use.
//!
//! * [`toolchain`] builds the pinned upstream programs from the Go module proxy.
//! * [`fleet`] starts, inspects and stops the environment (`cargo xtask env ...`).
//! * [`chaos`] the chaos soak: seeded faults and changes, and an invariant checker.
//! * [`fixture`] attaches tests to a running environment (or starts one).
//! * [`browser`] drives a headless Chromium, for the tests of the fleet view's pages.
//! * [`binaries`] finds kmm-fleet's debug binaries for the tests that run them.
//! * [`kmod_builder`] assembles the fleet's base for kmod builds, the way `kmm-images`
//!   (which builds kmm-fleet's container images, `cargo xtask images`) assembles bases.
//! * [`helm`] renders `charts/kmm-fleet` and the kustomize bases and compares them.
//! * [`scale`] puts a real kmm-hub in front of thousands of simulated clusters.
//! * [`watched`] keeps a kind's objects current by a watch and waits on them;
//!   [`wait`] polls until a probe answers.
//! * [`hops`] turns the components' timestamp gauges into the hops of a load, read out
//!   of their `/metrics` by [`metrics_text`].

pub mod binaries;
pub mod browser;
mod cache_entry;
mod cgroup;
pub mod chaos;
pub mod fixture;
pub mod fleet;
pub mod guest;
pub mod helm;
pub mod hops;
pub mod kmod;
pub mod kmod_builder;
pub mod metrics_text;
pub mod monitoring;
mod pki;
mod process;
pub mod scale;
pub mod toolchain;
pub mod versions;
pub mod wait;
pub mod watched;

use std::path::PathBuf;

/// Root of everything cached across runs, the image builder's downloads included.
pub use kmm_images::cache_dir;

/// Why an operation on the local fleet failed.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },
    #[error("`{command}` failed ({status})")]
    Command { command: String, status: String },
    #[error("{component} failed to start: {reason}; log: {}", log.display())]
    Component {
        component: String,
        reason: String,
        log: PathBuf,
    },
    #[error("timed out after {seconds}s waiting for {what}")]
    Timeout { what: String, seconds: u64 },
    #[error("kubernetes API: {0}")]
    Kube(#[from] kube::Error),
    #[error("kubeconfig: {0}")]
    Kubeconfig(#[from] kube::config::KubeconfigError),
    #[error("certificates: {0}")]
    Pki(#[from] rcgen::Error),
    #[error("OCI registry: {0}")]
    Oci(#[from] oci_client::errors::OciDistributionError),
    #[error(transparent)]
    Registry(#[from] kmm_registry_fixture::Error),
    #[error(transparent)]
    Images(#[from] kmm_images::Error),
    #[error("{0}")]
    Invalid(String),
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Attach a description to an I/O error.
pub(crate) trait IoContext<T> {
    fn context(self, context: impl FnOnce() -> String) -> Result<T>;
}

impl<T> IoContext<T> for std::io::Result<T> {
    fn context(self, context: impl FnOnce() -> String) -> Result<T> {
        self.map_err(|source| Error::Io {
            context: context(),
            source,
        })
    }
}
