//! The hub's pure fleet logic: who a proxy is, what each cluster must run, how a module's
//! status and deletion progress. No I/O: the runtime feeds it watched objects and stream
//! messages and ships its answers.

pub mod assignment;
pub mod cluster_identity;
pub mod deletion;
pub mod intents;
pub mod node_statuses;
pub mod outbox;
pub mod readiness;
pub mod sessions;
pub mod status;
