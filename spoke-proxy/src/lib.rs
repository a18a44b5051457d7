//! `kmm-spoke-proxy`: the kmm-fleet add-on agent on each managed cluster.
//!
//! Pure modules (no I/O): [`node_facts`], [`tolerations`], [`placement`], [`inventory`],
//! [`agent_view`], [`node_status`], [`labels`], [`cluster_state`], [`backoff`].

pub mod agent_view;
pub mod cluster_state;
pub mod inventory;
pub mod labels;
pub mod module_id;
pub mod node_facts;
pub mod node_status;
pub mod placement;
pub mod tolerations;
