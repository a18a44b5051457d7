//! `kmm-spoke-proxy`: the kmm-fleet add-on agent on each managed cluster.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use clap::{Parser, Subcommand};
use kmm_runtime::cli::LoggingArgs;
use kmm_spoke_proxy::agent_tls::default_sans;
use kmm_spoke_proxy::hub_connection::{HubLink, parse_address};
use kmm_spoke_proxy::hub_credentials::HubCredentialFiles;
use kmm_spoke_proxy::run::{ProxyConfig, run};
use tonic::transport::Uri;

/// The kmm-fleet add-on agent that runs once on every managed cluster.
///
/// It connects up to kmm-hub over gRPC with the client certificate issued by Open
/// Cluster Management's add-on registration (renewed files are picked up without a
/// restart), pushes the kernel releases of its cluster's nodes, serves the node agents
/// over TLS (authenticating each with its projected ServiceAccount token and binding it
/// to its node), decides per node which resolved module applies, and labels nodes
/// (kmm.node.kubernetes.io/<namespace>.<name>.ready) only once their node agent has
/// proven the module loaded. Losing the hub never unloads anything.
///
/// Kubernetes access: in-cluster configuration, or KUBECONFIG.
#[derive(Debug, Parser)]
#[command(name = "kmm-spoke-proxy", version)]
struct Cli {
    #[command(flatten)]
    logging: LoggingArgs,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run the proxy until SIGTERM or SIGINT.
    Run(RunArgs),
}

#[derive(Debug, clap::Args)]
struct RunArgs {
    /// kmm-hub's gRPC endpoint, https://HOST:PORT (the add-on's variable HUB_ADDRESS).
    #[arg(long, env = "KMM_HUB_ADDRESS", value_parser = parse_hub_address)]
    hub_address: Uri,
    /// CA certificate (PEM) that signed kmm-hub's serving certificate (the add-on's
    /// variable HUB_CA_BUNDLE, which kmm-hub publishes). Re-read at every connect: while
    /// it holds no certificate the proxy reports it and retries.
    #[arg(long)]
    hub_ca_file: PathBuf,
    /// The proxy's client certificate (PEM), as OCM's add-on registration mounts it
    /// (tls.crt). Re-read at every connect and watched for renewal.
    #[arg(long)]
    client_cert_file: PathBuf,
    /// The client certificate's private key (PEM, tls.key).
    #[arg(long)]
    client_key_file: PathBuf,
    /// Namespace of the proxy's Secret (kmm-spoke-proxy-tls) and of the ConfigMap
    /// (kmm-agent-ca) the node agents mount.
    #[arg(long, default_value = "kmm")]
    namespace: String,
    /// The managed cluster's name (OCM's built-in variable CLUSTER_NAME), for logs only:
    /// the hub takes the identity from the client certificate.
    #[arg(long, value_parser = parse_cluster_name)]
    cluster_name: String,
    /// Address of the TLS gRPC server for node agents.
    #[arg(long, default_value = "0.0.0.0:7444")]
    agent_addr: SocketAddr,
    /// Subject alternative name of the agent-facing serving certificate (repeatable;
    /// default: localhost, 127.0.0.1, kmm-spoke-proxy.<namespace>.svc).
    #[arg(long = "agent-san")]
    agent_sans: Vec<String>,
    /// Lifetime of the agent-facing serving certificate, in seconds. It is re-issued
    /// while the proxy runs, with a third of it left.
    #[arg(long, default_value_t = kmm_spoke_proxy::agent_tls::SERVING_VALIDITY.as_secs(), value_parser = clap::value_parser!(u64).range(5..))]
    agent_cert_validity_seconds: u64,
    /// Audience the node agents' projected ServiceAccount tokens must be issued for.
    #[arg(long, default_value = "kmm-spoke-proxy")]
    token_audience: String,
    /// The node agents' ServiceAccount, <namespace>:<name>; tokens of any other account
    /// are refused.
    #[arg(long, default_value = "kmm:kmm-node-agent")]
    agent_service_account: String,
    /// Address serving /metrics, /healthz and /readyz.
    #[arg(long, default_value = "0.0.0.0:8081")]
    metrics_addr: SocketAddr,
    /// How often the hub credential files are checked for a renewal, in seconds.
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u64).range(1..))]
    credentials_poll_seconds: u64,
    /// First delay before reconnecting to the hub, in milliseconds; doubles up to
    /// --reconnect-max-seconds, with jitter.
    #[arg(long, default_value_t = 500, value_parser = clap::value_parser!(u64).range(1..))]
    reconnect_initial_ms: u64,
    /// Longest delay between reconnects to the hub, in seconds.
    #[arg(long, default_value_t = 30, value_parser = clap::value_parser!(u64).range(1..))]
    reconnect_max_seconds: u64,
    /// The cluster's own pull Secret in --namespace (the add-on's variable
    /// CLUSTER_PULL_SECRET; empty: none). The node agents pull with it the images of
    /// modules that name no imageRepoSecret, and device plugins' Pods get a copy of it in
    /// their namespace. A missing or malformed one is reported on the nodes' module status.
    #[arg(long, default_value = "", value_parser = parse_pull_secret_name)]
    cluster_pull_secret: String,
    /// How often the cluster pull Secret is read, in seconds.
    #[arg(long, default_value_t = kmm_spoke_proxy::cluster_pull_secret_sync::DEFAULT_POLL.as_secs(), value_parser = clap::value_parser!(u64).range(1..))]
    cluster_pull_secret_poll_seconds: u64,
    /// PEM CAs the cluster's registries chain to, besides the system's (the add-on's
    /// variables REGISTRY_CA_BUNDLE_n): the proxy resolves the images the hub cannot
    /// check with them. Read at each resolution; absent or empty: none.
    #[arg(long)]
    registry_ca_file: Option<std::path::PathBuf>,
}

fn parse_hub_address(address: &str) -> Result<Uri, String> {
    parse_address(address).map_err(|e| e.to_string())
}

/// Empty, as an unset variable renders, is no Secret.
fn parse_pull_secret_name(name: &str) -> Result<String, String> {
    if name.is_empty() || kmm_spoke_proxy::cluster_pull_secret::is_secret_name(name) {
        Ok(name.to_owned())
    } else {
        Err(format!(
            "{name:?} (the add-on's variable CLUSTER_PULL_SECRET) is not a Secret's name: \
             lower-case letters, digits, - and ., at most 253 characters"
        ))
    }
}

/// A template variable OCM could not render arrives as an empty string.
fn parse_cluster_name(name: &str) -> Result<String, String> {
    if name.trim().is_empty() {
        return Err(
            "--cluster-name is empty: it is OCM's built-in variable CLUSTER_NAME in \
                    the add-on's manifests"
                .to_owned(),
        );
    }
    Ok(name.to_owned())
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    kmm_runtime::logging::init(&cli.logging);
    let Command::Run(args) = cli.command;
    if !args.agent_service_account.contains(':') {
        anyhow::bail!(
            "--agent-service-account {:?} must be <namespace>:<name>",
            args.agent_service_account
        );
    }
    let agent_sans = if args.agent_sans.is_empty() {
        default_sans(&args.namespace)
    } else {
        args.agent_sans
    };
    let config = ProxyConfig {
        hub: HubLink {
            address: args.hub_address,
            files: HubCredentialFiles {
                ca: args.hub_ca_file,
                cert: args.client_cert_file,
                key: args.client_key_file,
            },
            poll: Duration::from_secs(args.credentials_poll_seconds),
            backoff_initial: Duration::from_millis(args.reconnect_initial_ms),
            backoff_max: Duration::from_secs(args.reconnect_max_seconds),
        },
        namespace: args.namespace,
        // The Pod's name (the kubelet sets HOSTNAME to it): the Events' reporting instance.
        instance: std::env::var("HOSTNAME").unwrap_or_else(|_| args.cluster_name.clone()),
        cluster_name: args.cluster_name,
        agent_addr: args.agent_addr,
        agent_sans,
        agent_cert_validity: Duration::from_secs(args.agent_cert_validity_seconds),
        token_audience: args.token_audience,
        agent_service_account: args.agent_service_account,
        metrics_addr: args.metrics_addr,
        cluster_pull_secret: Some(args.cluster_pull_secret).filter(|name| !name.is_empty()),
        cluster_pull_secret_poll: Duration::from_secs(args.cluster_pull_secret_poll_seconds),
        registry_ca_file: args.registry_ca_file,
    };
    let client = kube::Client::try_default()
        .await
        .context("no Kubernetes configuration (in-cluster or KUBECONFIG)")?;
    run(config, client, kmm_runtime::shutdown::on_signal()).await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    use super::*;

    fn run_error(args: &[&str]) -> String {
        let required = [
            "kmm-spoke-proxy",
            "run",
            "--hub-ca-file=ca.crt",
            "--client-cert-file=tls.crt",
            "--client-key-file=tls.key",
        ];
        let argv = required.iter().chain(args);
        Cli::try_parse_from(argv).unwrap_err().to_string()
    }

    /// What an AddOnTemplate renders when a variable is unset: `--flag=`.
    #[test]
    fn unset_add_on_variables_are_refused_naming_flag_and_variable() {
        Cli::command().debug_assert();
        let e = run_error(&["--hub-address=", "--cluster-name=spoke1"]);
        assert!(
            e.contains("--hub-address is empty") && e.contains("HUB_ADDRESS"),
            "{e}"
        );
        let e = run_error(&["--hub-address=https://hub:7443", "--cluster-name="]);
        assert!(
            e.contains("--cluster-name is empty") && e.contains("CLUSTER_NAME"),
            "{e}"
        );
        let e = run_error(&["--hub-address=https://hub:7443"]);
        assert!(e.contains("--cluster-name"), "required: {e}");
        let e = run_error(&["--hub-address=http://hub:7443", "--cluster-name=spoke1"]);
        assert!(e.contains("https://HOST:PORT"), "{e}");
    }

    #[test]
    fn the_cluster_pull_secret_is_optional_and_must_be_a_secrets_name() {
        let parse = |value: &str| {
            Cli::try_parse_from([
                "kmm-spoke-proxy",
                "run",
                "--hub-address=https://hub:7443",
                "--cluster-name=spoke1",
                "--hub-ca-file=ca.crt",
                "--client-cert-file=tls.crt",
                "--client-key-file=tls.key",
                &format!("--cluster-pull-secret={value}"),
            ])
            .map(|cli| {
                let Command::Run(args) = cli.command;
                args.cluster_pull_secret
            })
            .map_err(|e| e.to_string())
        };
        assert_eq!(parse("").unwrap(), "", "unset: none");
        assert_eq!(parse("regcred").unwrap(), "regcred");
        let e = parse("Reg_Cred").unwrap_err();
        assert!(
            e.contains("--cluster-pull-secret")
                && e.contains("\"Reg_Cred\"")
                && e.contains("CLUSTER_PULL_SECRET"),
            "{e}"
        );
    }
}
