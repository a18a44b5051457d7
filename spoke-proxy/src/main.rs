//! `kmm-spoke-proxy`: the kmm-fleet add-on agent on each managed cluster.

use clap::Parser;

/// The kmm-fleet add-on agent that runs once on every managed cluster.
///
/// It connects up to kmm-hub over gRPC with the client certificate issued by
/// Open Cluster Management's add-on registration, pushes the kernel releases
/// of its cluster's nodes, serves the node agents, decides per node which
/// resolved module applies, and labels nodes
/// (kmm.node.kubernetes.io/<namespace>.<name>.ready) only once their node
/// agent has proven the module loaded.
#[derive(Debug, Parser)]
#[command(name = "kmm-spoke-proxy", version)]
struct Cli {}

fn main() -> anyhow::Result<()> {
    Cli::parse();
    anyhow::bail!(
        "kmm-spoke-proxy: the proxy runtime is not part of this build yet; only --help and --version work"
    )
}
