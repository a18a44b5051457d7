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

/// How much is logged; declared from least to most verbose, which is their order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, ValueEnum)]
pub enum LogLevel {
    Error,
    Warn,
    Info,
    Debug,
    Trace,
}

/// Logging flags; flatten into the top-level command.
#[derive(Debug, Clone, Args)]
pub struct LoggingArgs {
    /// Log format on standard error.
    #[arg(long, value_enum, default_value = "text", global = true)]
    pub log_format: LogFormat,
    /// Log level (default info). With -v too, the more verbose of the two wins, so that
    /// -v adds detail to a deployment's fixed level; RUST_LOG, when set, wins over both.
    #[arg(long, value_enum, value_name = "LEVEL", global = true)]
    pub log_level: Option<LogLevel>,
    /// More logs: -v debug, -vv trace (see --log-level).
    #[arg(short, long, action = clap::ArgAction::Count, global = true)]
    pub verbose: u8,
}

impl LoggingArgs {
    /// The level the flags ask for: the more verbose of --log-level and -v, info
    /// when neither is given.
    pub fn level(&self) -> LogLevel {
        let from_verbose = match self.verbose {
            0 => None,
            1 => Some(LogLevel::Debug),
            _ => Some(LogLevel::Trace),
        };
        // `None` orders before any `Some`: an absent flag never wins.
        self.log_level.max(from_verbose).unwrap_or(LogLevel::Info)
    }
}

/// The observability endpoint; flatten into the long-running subcommand.
#[derive(Debug, Clone, Args)]
pub struct MetricsArgs {
    /// Address serving /metrics (Prometheus text format), /healthz and /readyz.
    #[arg(long, default_value = "0.0.0.0:8080")]
    pub metrics_addr: SocketAddr,
}

#[cfg(test)]
mod tests {
    use clap::{CommandFactory, Parser, Subcommand};

    use super::*;

    /// A binary's shape: logging flags at the top, a subcommand below (they are global).
    #[derive(Debug, Parser)]
    struct Cli {
        #[command(flatten)]
        logging: LoggingArgs,
        #[command(subcommand)]
        command: Command,
    }

    #[derive(Debug, Subcommand)]
    enum Command {
        Run,
    }

    fn level(args: &[&str]) -> LogLevel {
        let argv = ["bin"].iter().chain(args).copied();
        Cli::try_parse_from(argv).unwrap().logging.level()
    }

    #[test]
    fn the_more_verbose_of_log_level_and_v_wins() {
        Cli::command().debug_assert();
        assert_eq!(level(&["run"]), LogLevel::Info);
        assert_eq!(level(&["run", "--log-level=error"]), LogLevel::Error);
        assert_eq!(level(&["--log-level", "warn", "run"]), LogLevel::Warn);
        assert_eq!(level(&["run", "-v"]), LogLevel::Debug);
        assert_eq!(level(&["run", "-vv"]), LogLevel::Trace);
        assert_eq!(level(&["run", "-v", "--log-level=error"]), LogLevel::Debug);
        assert_eq!(level(&["run", "-v", "--log-level=trace"]), LogLevel::Trace);
        assert_eq!(level(&["run", "-vvv", "--log-level=info"]), LogLevel::Trace);
    }

    /// What `--log-level={{LOG_LEVEL}}` becomes when OCM renders an unset variable.
    #[test]
    fn an_empty_or_unknown_level_is_refused_naming_the_flag() {
        for bad in ["--log-level=", "--log-level=verbose", "--log-level=INFO"] {
            let error = Cli::try_parse_from(["bin", "run", bad]).unwrap_err();
            assert_eq!(error.kind(), clap::error::ErrorKind::InvalidValue, "{bad}");
            let text = error.to_string();
            assert!(text.contains("--log-level"), "{text}");
            assert!(text.contains("error, warn, info, debug, trace"), "{text}");
        }
    }
}
