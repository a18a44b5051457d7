//! `kwok-pod-runner`: runs the selected pods of a cluster's KWOK nodes as host
//! processes (see the `kmm_kwok_pod_runner` library).

use std::collections::BTreeMap;
use std::path::PathBuf;

use anyhow::Context;
use clap::Parser;
use kmm_kwok_pod_runner::{Config, Exec, split_assignment};
use kmm_runtime::cli::LoggingArgs;

/// A stand-in kubelet for KWOK nodes: runs each selected pod bound to a KWOK node as
/// host processes, with the command, arguments, environment and files of the Pod.
#[derive(Debug, Parser)]
#[command(version)]
struct Cli {
    /// The cluster's admin kubeconfig.
    #[arg(long)]
    kubeconfig: PathBuf,
    /// Namespace of the pods to run.
    #[arg(long)]
    namespace: String,
    /// Label selector of the pods to run.
    #[arg(long)]
    selector: String,
    /// Only pods bound to nodes carrying this annotation.
    #[arg(long, value_name = "KEY=VALUE", value_parser = parse_assignment)]
    node_annotation: (String, String),
    /// Network namespace (/run/netns/NAME) of the cluster's first real node; every
    /// process runs in it.
    #[arg(long, value_name = "NAME")]
    netns: String,
    /// Interface the runner creates in that namespace for the pods' IPs.
    #[arg(long, value_name = "NAME", default_value = "kwok0")]
    address_interface: String,
    /// Per-node directories (DIR/<node>/host, DIR/<node>/pods/<uid>,
    /// DIR/<node>/powered-off) and DIR/status.json.
    #[arg(long, value_name = "DIR")]
    root: PathBuf,
    /// A container's command[0] and the host binary to run for it (repeatable).
    #[arg(long = "program", value_name = "IMAGE_PATH=HOST_PATH", value_parser = parse_assignment)]
    programs: Vec<(String, String)>,
    /// Directory of the containers' logs (<namespace>_<pod>_<container>.log).
    #[arg(long, value_name = "DIR")]
    logs: PathBuf,
    #[command(flatten)]
    logging: LoggingArgs,
}

fn parse_assignment(text: &str) -> Result<(String, String), String> {
    split_assignment(text).map_err(|e| e.to_string())
}

fn main() -> anyhow::Result<()> {
    // The runner starts each container's program through itself (see `Exec`).
    if let Some(exec) = Exec::from_args(std::env::args_os()) {
        return Err(exec.run().into());
    }
    let cli = Cli::parse();
    kmm_runtime::logging::init(&cli.logging);
    let programs: BTreeMap<String, PathBuf> = cli
        .programs
        .into_iter()
        .map(|(image, host)| (image, PathBuf::from(host)))
        .collect();
    let config = Config {
        kubeconfig: cli.kubeconfig,
        namespace: cli.namespace,
        selector: cli.selector,
        node_annotation: cli.node_annotation,
        netns: cli.netns,
        address_interface: cli.address_interface,
        root: cli.root,
        programs,
        logs: cli.logs,
    };
    tokio::runtime::Runtime::new()
        .context("starting the async runtime")?
        .block_on(async {
            let shutdown = kmm_runtime::shutdown::on_signal();
            kmm_kwok_pod_runner::run(config, shutdown.cancelled_owned()).await
        })?;
    Ok(())
}
