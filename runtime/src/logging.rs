//! Structured logs on standard error, with no secret in them at any level.

use tracing_subscriber::filter::{EnvFilter, FilterExt, LevelFilter, Targets};
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{Layer, fmt};

use crate::cli::{LogFormat, LogLevel, LoggingArgs};

/// Targets whose events carry registry credentials, and the most they may log. Applied
/// on top of `--log-level`, `-v` and `RUST_LOG`, so no level setting can turn them on.
/// (hyper, h2 and reqwest's other events were read too: none prints a header's value.)
const SECRET_BEARING: [(&str, LevelFilter); 2] = [
    // oci-client logs the token endpoint's whole answer (debug) and bytes of a token
    // that is not a JWT (warn). Its errors reach our logs as the values it returns.
    ("oci_client", LevelFilter::OFF),
    // reqwest's connection log prints every byte sent, Authorization headers included.
    ("reqwest::connect::verbose", LevelFilter::OFF),
];

/// Installs the global subscriber on standard error. `RUST_LOG` overrides the level
/// flags, never [`SECRET_BEARING`].
pub fn init(args: &LoggingArgs) {
    let levels = EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| EnvFilter::new(directive(args.level())));
    let secrets = Targets::new()
        .with_targets(SECRET_BEARING)
        .with_default(LevelFilter::TRACE);
    let filter = levels.and(secrets);
    let layer = fmt::layer().with_writer(std::io::stderr);
    match args.log_format {
        LogFormat::Text => tracing_subscriber::registry()
            .with(layer.with_filter(filter))
            .init(),
        LogFormat::Json => tracing_subscriber::registry()
            .with(layer.json().with_filter(filter))
            .init(),
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
