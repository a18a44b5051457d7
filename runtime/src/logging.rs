//! Structured logs on standard error.

use tracing_subscriber::EnvFilter;

use crate::cli::{LogFormat, LoggingArgs};

/// Installs the global subscriber. `RUST_LOG` overrides the verbosity flags.
pub fn init(args: &LoggingArgs) {
    let default = match args.verbose {
        0 => "info",
        1 => "debug",
        _ => "trace",
    };
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match args.log_format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().init(),
    }
}
