//! `kmm-spoke-proxy`: the kmm-fleet add-on agent on each managed cluster.
//!
//! Pure modules (no I/O): [`node_facts`], [`tolerations`], [`placement`], [`inventory`],
//! [`agent_view`], [`agent_identity`], [`node_status`], [`labels`], [`cluster_state`],
//! [`device_plugin`], [`device_plugin_pull_secret`], [`cluster_pull_secret`]. I/O:
//! [`hub_connection`], [`nodes`], [`node_labels`], [`device_plugin_sync`],
//! [`cluster_pull_secret_sync`], [`agent_server`], [`agent_auth`], [`agent_tls`], wired
//! together by [`run`].

pub mod agent_auth;
pub mod agent_identity;
pub mod agent_server;
pub mod agent_tls;
pub mod agent_view;
pub mod cluster_pull_secret;
pub mod cluster_pull_secret_sync;
pub mod cluster_state;
pub mod device_plugin;
pub mod device_plugin_pull_secret;
pub mod device_plugin_sync;
pub mod hub_connection;
pub mod hub_credentials;
pub mod inventory;
pub mod labels;
pub mod metrics;
pub mod module_id;
pub mod node_events;
pub mod node_facts;
pub mod node_labels;
pub mod node_status;
pub mod node_upgrade;
pub mod nodes;
pub mod placement;
pub mod review_cache;
pub mod run;
pub mod shared_state;
pub mod spoke_image_sync;
pub mod spoke_images;
pub mod tolerations;
