//! Flags every binary accepts, so that they all behave alike.

use std::net::SocketAddr;

use clap::{Args, ValueEnum};

/// Log output on standard error.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line, for log collectors.
    Json,
}

/// Logging flags; flatten into the top-level command.
#[derive(Debug, Clone, Args)]
pub struct LoggingArgs {
    /// Log format on standard error.
    #[arg(long, value_enum, default_value = "text", global = true)]
    pub log_format: LogFormat,
    /// More logs: -v debug, -vv trace (RUST_LOG, when set, wins).
    #[arg(short, long, action = clap::ArgAction::Count, global = true)]
    pub verbose: u8,
}

/// The observability endpoint; flatten into the long-running subcommand.
#[derive(Debug, Clone, Args)]
pub struct MetricsArgs {
    /// Address serving /metrics (Prometheus text format), /healthz and /readyz.
    #[arg(long, default_value = "0.0.0.0:8080")]
    pub metrics_addr: SocketAddr,
}
