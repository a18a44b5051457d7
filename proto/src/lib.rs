//! The gRPC contract between the three kmm-fleet binaries, package `kmm.v1`:
//!
//! - [`v1::hub_server`] / [`v1::hub_client`]: one stream per managed cluster, spoke proxy to hub;
//! - [`v1::agent_server`] / [`v1::agent_client`]: one stream per node, node agent to spoke proxy.
//!
//! The `.proto` sources under `proto/kmm/v1/` are the documentation of every message.

/// Generated code for package `kmm.v1`.
#[allow(missing_docs, clippy::all, clippy::pedantic)]
pub mod v1 {
    tonic::include_proto!("kmm.v1");
}
