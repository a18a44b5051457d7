//! `kmm-spoke-proxy`: the kmm-fleet add-on agent on each managed cluster.
//!
//! The pure modules (no I/O: [`node_facts`], [`tolerations`], [`placement`],
//! [`inventory`], [`agent_view`], [`agent_identity`], [`node_status`], [`labels`],
//! [`cluster_state`], [`device_plugin`], [`device_plugin_pull_secret`],
//! [`cluster_pull_secret`]) are the `kmm-spoke-proxy-core` crate, re-exported here. I/O:
//! [`hub_connection`], [`nodes`], [`node_labels`], [`device_plugin_sync`],
//! [`cluster_pull_secret_sync`], [`agent_server`], [`agent_auth`], [`agent_tls`], wired
//! together by [`run`].

pub mod agent_auth;
pub mod agent_server;
pub mod agent_tls;
pub mod cluster_pull_secret_sync;
pub mod device_plugin_sync;
pub mod hub_connection;
pub mod hub_credentials;
pub mod metrics;
pub mod node_events;
pub mod node_labels;
pub mod nodes;
pub mod review_cache;
pub mod run;
pub mod shared_state;
pub mod spoke_image_sync;

pub use kmm_spoke_proxy_core::{
    agent_identity, agent_view, cluster_pull_secret, cluster_state, device_plugin,
    device_plugin_pull_secret, inventory, labels, module_id, node_facts, node_status, node_upgrade,
    placement, spoke_images, tolerations,
};
