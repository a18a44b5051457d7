//! `kmm-hub`: the kmm-fleet hub.

mod module_document;
mod render;
mod serve_command;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// The kmm-fleet hub: owns the ManagedClusterModule API on the Open Cluster Management hub.
///
/// It validates and reconciles ManagedClusterModules, resolves every module for every
/// kernel release its managed clusters report (kernel mappings, variables, builds and
/// signing), and streams the result to the kmm-spoke-proxy of each cluster.
#[derive(Debug, Parser)]
#[command(name = "kmm-hub", version)]
struct Cli {
    #[command(subcommand)]
    command: Command,

    #[command(flatten)]
    logging: kmm_runtime::cli::LoggingArgs,
}

#[derive(Debug, Subcommand)]
enum Command {
    Render(render::Args),
    Serve(Box<serve_command::Args>),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    kmm_runtime::logging::init(&cli.logging);
    match cli.command {
        Command::Render(args) => render::run(&args),
        Command::Serve(args) => serve_command::run(*args),
    }
}
