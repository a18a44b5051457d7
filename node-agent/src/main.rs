//! `kmm-node-agent`: the one kmm-fleet pod on every node.

use clap::Parser;

/// The kmm-fleet agent that runs once on every node (one DaemonSet pod).
///
/// It receives its node's desired kernel modules from kmm-spoke-proxy, pulls
/// the kmod images, extracts only the module and firmware files, runs
/// modprobe, and reports every load and unload with its outcome. It keeps
/// its state under /run/kmm so that a restart never reloads what is loaded
/// and a reboot loads again. It has no Kubernetes API access at all.
#[derive(Debug, Parser)]
#[command(name = "kmm-node-agent", version)]
struct Cli {}

fn main() -> anyhow::Result<()> {
    Cli::parse();
    anyhow::bail!(
        "kmm-node-agent: the agent runtime is not part of this build yet; only --help and --version work"
    )
}
