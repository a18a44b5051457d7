//! The gRPC contract between the three kmm-fleet binaries, package `kmm.v1`:
//!
//! - [`v1::hub_server`] / [`v1::hub_client`]: one stream per managed cluster, spoke proxy to hub;
//! - [`v1::agent_server`] / [`v1::agent_client`]: one stream per node, node agent to spoke proxy.
//!
//! The `.proto` sources under `proto/kmm/v1/` are the documentation of every message.

/// Largest messages each side accepts, part of the contract: a peer sending more gets
/// `RESOURCE_EXHAUSTED`, never an unbounded allocation on the receiving side. Sizes are of
/// the encoded message.
pub mod limits {
    /// Proxy to hub (`ProxyMessage`): a full node status report of a large cluster.
    pub const PROXY_MESSAGE: usize = 32 << 20;
    /// Hub to proxy (`HubMessage`): a cluster's complete intents with credentials.
    pub const HUB_MESSAGE: usize = 64 << 20;
    /// Agent to proxy (`AgentMessage`): a hello or one event.
    pub const AGENT_MESSAGE: usize = 1 << 20;
    /// Proxy to agent (`AgentInstruction`): one node's desired modules.
    pub const AGENT_INSTRUCTION: usize = 16 << 20;
}

/// Generated code for package `kmm.v1`.
#[allow(missing_docs, clippy::all, clippy::pedantic)]
pub mod v1 {
    tonic::include_proto!("kmm.v1");
}
