//! The kmm-fleet hub. The binary (`main.rs`) is thin wiring over these modules; the pure
//! fleet logic (what each cluster must run, images, resolutions, the clusters' sessions)
//! is the `kmm-hub-core` crate, re-exported here under the names the runtime uses.

pub mod admission;
pub mod build;
pub mod fleet_ui;
pub mod serve;

pub use kmm_hub_core::{fleet, images, resolutions};
