//! What every kmm-fleet binary shares at runtime: command-line conventions, logging,
//! the `/metrics` `/healthz` `/readyz` endpoint, the bounded HTTP accept loop it and the
//! admission webhook share, shutdown on SIGTERM, reconnect backoff,
//! the certificates the components issue to each other and the TLS servers that renew
//! them while running, timestamp gauges, and (feature `events`) Events on Kubernetes
//! objects.

pub mod backoff;
pub mod cli;
#[cfg(feature = "events")]
pub mod events;
pub mod health;
pub mod http_server;
pub mod logging;
pub mod pki;
pub mod rate_limit;
pub mod serving;
pub mod shutdown;
pub mod timestamp;
