//! The hub's pure fleet logic: who a proxy is, what each cluster must run, how a module's
//! status and deletion progress, what the add-on's configs and status must say. No I/O:
//! the runtime feeds it watched objects and stream messages and ships its answers.

pub mod addon_config;
pub mod addon_status;
pub mod assignment;
pub mod built_intents;
pub mod cluster_identity;
pub mod cluster_states;
pub mod cluster_view;
pub mod credentials;
pub mod deletion;
pub mod device_plugins;
pub mod forgetting;
pub mod image_needs;
pub mod intents;
pub mod inventory;
pub mod mirrors;
pub mod module_events;
pub mod module_id;
pub mod module_view;
pub mod node_statuses;
pub mod outbox;
pub mod pacer;
pub mod placements;
pub mod preflight;
pub mod proxy_hello;
pub mod readiness;
pub mod revisions;
pub mod rollout;
pub mod served_revisions;
pub mod shared_snapshot;
pub mod spoke_answers;
pub mod status;
