//! Structured logs on standard error.

use tracing_subscriber::EnvFilter;

use crate::cli::{LogFormat, LogLevel, LoggingArgs};

/// Installs the global subscriber. `RUST_LOG` overrides the level flags.
pub fn init(args: &LoggingArgs) {
    let filter = EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| EnvFilter::new(directive(args.level())));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match args.log_format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().init(),
    }
}

fn directive(level: LogLevel) -> &'static str {
    match level {
        LogLevel::Error => "error",
        LogLevel::Warn => "warn",
        LogLevel::Info => "info",
        LogLevel::Debug => "debug",
        LogLevel::Trace => "trace",
    }
}
