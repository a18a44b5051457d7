//! The kmm-fleet spoke proxy's pure core: what each node of the cluster must load
//! ([`placement`], [`tolerations`], [`node_upgrade`]), what the agents report
//! ([`agent_view`], [`node_status`]), the labels and the inventory that follow from it
//! ([`labels`], [`inventory`]), the device plugins and pull Secrets the cluster needs, and
//! [`cluster_state`], which holds them together. No I/O and no Kubernetes client: the
//! proxy's runtime (`kmm-spoke-proxy`) feeds it watched nodes, the hub's snapshots and
//! the agents' events, and the fuzz targets drive it directly.

pub mod agent_identity;
pub mod agent_view;
pub mod cluster_pull_secret;
pub mod cluster_state;
pub mod device_plugin;
pub mod device_plugin_pull_secret;
pub mod inventory;
pub mod labels;
pub mod module_id;
pub mod node_facts;
pub mod node_status;
pub mod node_upgrade;
pub mod placement;
pub mod spoke_images;
pub mod tolerations;
