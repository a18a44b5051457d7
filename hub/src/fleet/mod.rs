//! The hub's pure fleet logic: who a proxy is, what each cluster must run. No I/O: the
//! runtime feeds it watched objects and ships its answers.

pub mod cluster_identity;
pub mod intents;
pub mod status;
