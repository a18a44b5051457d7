//! `kmm-node-agent`: pulls kmod images, extracts them safely, loads and unloads kernel
//! modules, and keeps its state across restarts (but not reboots).
//!
//! The control plane (gRPC to kmm-spoke-proxy, or a file) plugs in through
//! [`control`]: desired modules come in as [`desired::DesiredSnapshot`]s and results go
//! out as [`control::AgentEvent`]s.

pub mod agent;
pub mod check_image;
pub mod control;
pub mod desired;
pub mod event_queue;
pub mod firmware;
pub mod image;
pub mod kernel;
pub mod metrics;
pub mod modprobe;
pub mod plan;
pub mod proxy_connection;
pub mod proxy_messages;
pub mod readiness;
pub mod reconcile;
pub mod shared_modules;
pub mod signature;
pub mod state;
