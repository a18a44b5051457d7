//! The kmm-fleet hub. The binary (`main.rs`) is thin wiring over these modules.

pub mod admission;
pub mod build;
pub mod fleet;
pub mod fleet_ui;
pub mod images;
pub mod resolutions;
pub mod serve;
