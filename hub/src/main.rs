//! `kmm-hub`: the kmm-fleet hub.

mod module_document;
mod render;

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
}

#[derive(Debug, Subcommand)]
enum Command {
    Render(render::Args),
}

fn main() -> ExitCode {
    match Cli::parse().command {
        Command::Render(args) => render::run(&args),
    }
}
