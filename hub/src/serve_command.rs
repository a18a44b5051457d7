//! `kmm-hub serve`: flags and process wiring around `kmm_hub::serve::run`.

use std::net::SocketAddr;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context as _;
use clap::Args as ClapArgs;
use kmm_hub::serve::leadership::LeaderElection;
use kmm_hub::serve::{self, Listeners, Settings, metrics::Metrics};
use kmm_runtime::cli::MetricsArgs;
use kmm_runtime::health::{self, Health};
use prometheus_client::registry::Registry;
use tokio::net::TcpListener;

/// Run the hub: reconcile ManagedClusterModules and stream intents to spoke proxies.
///
/// Creates the CA Secret `kmm-hub-ca` in --namespace on first start (never overwritten),
/// serves `Hub.Sync` over TLS on --grpc-addr requiring client certificates signed by that
/// CA (as OCM's add-on registration issues them), and writes each module's status. Every
/// replica serves the validating admission webhook on --webhook-addr and keeps the CA in
/// the caBundle of --webhook-configuration; with leader election (the default) only the
/// replica holding the Lease reconciles, serves proxies, publishes the CA into the
/// --addon-name add-on's AddOnDeploymentConfigs and keeps its ManagedClusterAddOns'
/// Degraded condition; the others stand by. Uses the in-cluster configuration or
/// KUBECONFIG.
#[derive(Debug, ClapArgs)]
pub struct Args {
    /// The hub's namespace: its CA Secret, and the modules' pull Secrets (imageRepoSecret).
    #[arg(long, default_value = "kmm-hub", env = "KMM_HUB_NAMESPACE")]
    namespace: String,

    /// Address of the gRPC endpoint spoke proxies connect to.
    #[arg(long, default_value = "0.0.0.0:7443")]
    grpc_addr: SocketAddr,

    /// Subject alternative name (DNS name or IP address) of the gRPC serving certificate;
    /// repeatable. Default: localhost, 127.0.0.1 and kmm-hub.<namespace>.svc.
    #[arg(long = "grpc-san", value_name = "NAME")]
    grpc_sans: Vec<String>,

    /// How long a deleted ManagedClusterModule waits for every affected node to confirm
    /// the unload before its finalizer goes anyway (leftovers are reported in an Event).
    #[arg(long, default_value = "5m", value_parser = humantime::parse_duration)]
    unload_timeout: Duration,

    /// Manage only the ManagedClusterModules matching this label selector (e.g.
    /// `team=storage`); by default every one. Hubs with disjoint selectors can share a hub
    /// cluster.
    #[arg(long, value_name = "SELECTOR")]
    module_selector: Option<String>,

    /// Address of the validating admission webhook (HTTPS, path
    /// /validate-managedclustermodule).
    #[arg(long, default_value = "0.0.0.0:9443")]
    webhook_addr: SocketAddr,

    /// Address of the read-only fleet view (plain HTTP; docs/fleet-view.md). Loopback by
    /// default: `kubectl port-forward` reaches it there, and nothing else in the cluster
    /// can. An empty value serves no view.
    // Spelled out so that clap takes the parser's `Option` as the value, not as "optional".
    #[arg(long, default_value = "127.0.0.1:8090", value_parser = optional_address)]
    ui_addr: std::option::Option<SocketAddr>,

    /// Subject alternative name of the webhook's serving certificate; repeatable.
    /// Default: kmm-hub-webhook.<namespace>.svc (and .svc.cluster.local), localhost,
    /// 127.0.0.1.
    #[arg(long = "webhook-san", value_name = "NAME")]
    webhook_sans: Vec<String>,

    /// The ValidatingWebhookConfiguration whose webhooks get the hub's CA as caBundle;
    /// an empty value leaves every configuration alone.
    #[arg(long, default_value = "kmm-hub")]
    webhook_configuration: String,

    /// Elect one working replica through a Lease (--leader-elect=false: this replica
    /// always works; never run two such hubs for the same modules).
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    leader_elect: bool,

    /// Name of the leader Lease in --namespace.
    #[arg(long, default_value = "kmm-hub")]
    leader_election_lease: String,

    /// How long the leader's hold lasts without renewal; a standby takes over after it
    /// when the leader dies without releasing the Lease.
    #[arg(long, default_value = "15s", value_parser = humantime::parse_duration)]
    leader_election_lease_duration: Duration,

    /// Name of the OCM add-on: its ClusterManagementAddOn and every cluster's
    /// ManagedClusterAddOn (whose AddOnDeploymentConfigs get the hub's CA and whose
    /// Degraded condition the hub keeps), and the add-on in the proxies' certificate
    /// subjects.
    #[arg(long, default_value = "kmm")]
    addon_name: String,

    /// This replica's Pod (downward API), labelled with its role so the proxies' Service
    /// reaches the leader only.
    #[arg(long, env = "POD_NAME")]
    pod_name: Option<String>,

    /// The image kmod build Jobs run (`hub/builder`, `cargo xtask images` builds it),
    /// pinned by a tag or a digest. The default is where `cargo xtask images --push`
    /// puts it for the local fleet.
    #[arg(long, value_name = "IMAGE", default_value = DEFAULT_BUILDER_IMAGE)]
    builder_image: String,

    /// PEM CA certificates the registries of image checks, builds and signing may chain
    /// to besides the system's (an internal CA needs no insecureSkipTLSVerify). Read at
    /// each step, so a replaced bundle needs no restart; while the file is absent (its
    /// optional ConfigMap kmm-hub-registry-ca not created) none is added, and one that
    /// cannot be used fails the steps, naming it.
    #[arg(long, value_name = "FILE")]
    registry_ca_file: Option<std::path::PathBuf>,

    /// How often the tag of each `imagePullPolicy: Always` image is resolved again: once
    /// per image of a module, however many clusters load it. A moved tag's new digest
    /// reaches nodes through the module's rollout strategy.
    #[arg(long, default_value = "5m", value_parser = parse_follow_interval)]
    image_follow_interval: Duration,

    /// Lifetime of the gRPC and webhook serving certificates, in seconds. They are
    /// re-issued from the hub CA while the hub runs, with a third of it left.
    #[arg(long, default_value_t = serve::ca::SERVING_VALIDITY.as_secs(), value_parser = clap::value_parser!(u64).range(5..))]
    serving_cert_validity_seconds: u64,

    #[command(flatten)]
    metrics: MetricsArgs,
}

/// The shortest `--image-follow-interval`: a registry answers each image's tag at most
/// this often.
const MIN_FOLLOW_INTERVAL: Duration = Duration::from_secs(5);

fn parse_follow_interval(value: &str) -> Result<Duration, String> {
    let interval = humantime::parse_duration(value).map_err(|e| e.to_string())?;
    if interval < MIN_FOLLOW_INTERVAL {
        return Err(format!(
            "{value:?} is shorter than {}s, which would ask the registries too often",
            MIN_FOLLOW_INTERVAL.as_secs()
        ));
    }
    Ok(interval)
}

/// The builder as `cargo xtask images --push 127.0.0.1:16005` names it.
const DEFAULT_BUILDER_IMAGE: &str = concat!(
    "127.0.0.1:16005/kmm-fleet/kmm-builder:",
    env!("CARGO_PKG_VERSION")
);

pub fn run(args: Args) -> ExitCode {
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(error) => {
            tracing::error!(%error, "cannot start the async runtime");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(serve_main(args)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            tracing::error!("{error:#}");
            ExitCode::FAILURE
        }
    }
}

async fn serve_main(args: Args) -> anyhow::Result<()> {
    // Refused at start rather than at the first build, which may come much later.
    kmm_resolver::image_reference::check(&args.builder_image)
        .context("--builder-image is not a usable image reference")?;
    let grpc_sans = if args.grpc_sans.is_empty() {
        vec![
            "localhost".to_owned(),
            "127.0.0.1".to_owned(),
            format!("kmm-hub.{}.svc", args.namespace),
        ]
    } else {
        args.grpc_sans
    };
    let client = kube::Client::try_default()
        .await
        .context("no Kubernetes configuration (in-cluster or KUBECONFIG)")?;
    let webhook_sans = if args.webhook_sans.is_empty() {
        vec![
            format!("kmm-hub-webhook.{}.svc", args.namespace),
            format!("kmm-hub-webhook.{}.svc.cluster.local", args.namespace),
            "localhost".to_owned(),
            "127.0.0.1".to_owned(),
        ]
    } else {
        args.webhook_sans
    };
    let grpc = TcpListener::bind(args.grpc_addr)
        .await
        .with_context(|| format!("cannot listen on --grpc-addr {}", args.grpc_addr))?;
    let webhook = TcpListener::bind(args.webhook_addr)
        .await
        .with_context(|| format!("cannot listen on --webhook-addr {}", args.webhook_addr))?;
    let ui = match args.ui_addr {
        Some(addr) => Some(
            TcpListener::bind(addr)
                .await
                .with_context(|| format!("cannot listen on --ui-addr {addr}"))?,
        ),
        None => None,
    };
    let metrics = Metrics::default();
    let mut registry = Registry::default();
    metrics.register(&mut registry);
    let health = Health::default();
    let shutdown = kmm_runtime::shutdown::on_signal();
    // Ends the endpoint with serving, however serving ends (a lost Lease too).
    let stop = shutdown.child_token();
    let endpoint = tokio::spawn(health::serve(
        args.metrics.metrics_addr,
        registry,
        health.clone(),
        stop.clone().cancelled_owned(),
    ));
    let instance = args
        .pod_name
        .clone()
        .or_else(|| std::env::var("HOSTNAME").ok())
        .unwrap_or_else(|| "kmm-hub".to_owned());
    let leader_election = args.leader_elect.then(|| LeaderElection {
        lease: args.leader_election_lease,
        // Unique per incarnation: a restarted container (pid 1 again) must not find the
        // Lease still its own and lead without the others having had their chance.
        identity: format!("{instance}_{}", incarnation()),
        duration: args.leader_election_lease_duration,
        // Renewing with two thirds of the hold left leaves room for retries when the
        // apiserver is slow, rather than one late renewal costing the leadership.
        renew_before: args.leader_election_lease_duration * 2 / 3,
        pod: args.pod_name,
    });
    let settings = Settings {
        namespace: args.namespace,
        grpc_sans,
        unload_timeout: args.unload_timeout,
        instance,
        module_selector: args.module_selector,
        webhook_sans,
        webhook_configuration: Some(args.webhook_configuration).filter(|n| !n.is_empty()),
        leader_election,
        addon_name: args.addon_name,
        builder_image: args.builder_image,
        registry_ca_file: args.registry_ca_file,
        image_follow_interval: args.image_follow_interval,
        serving_validity: Duration::from_secs(args.serving_cert_validity_seconds),
    };
    let listeners = Listeners {
        grpc,
        webhook: Some(webhook),
        ui,
    };
    let served = serve::run(client, settings, listeners, health, metrics, shutdown).await;
    // The process exits; a replica that lost its leadership restarts as standby.
    stop.cancel();
    let endpoint = endpoint.await.context("the metrics endpoint panicked")?;
    served?;
    endpoint?;
    Ok(())
}

/// An address, or none for an empty value.
fn optional_address(value: &str) -> Result<Option<SocketAddr>, std::net::AddrParseError> {
    if value.is_empty() {
        return Ok(None);
    }
    value.parse().map(Some)
}

/// The process id and start time, in hex: distinct for every start of the binary.
fn incarnation() -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    format!("{:x}{nanos:x}", std::process::id())
}
