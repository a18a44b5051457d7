//! Wires the proxy together: agent TLS material, the agent server, the Node watch, the
//! hub link, the label patcher, the Node events, the device plugins' DaemonSets and the
//! observability endpoint, until shutdown.

use std::net::SocketAddr;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use kmm_proto::v1::agent_server::AgentServer;
use kmm_runtime::health::{self, Health};
use kmm_runtime::serving::{self, ServingCertificate};
use prometheus_client::registry::Registry;
use thiserror::Error;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tonic::transport::Server;

use crate::agent_auth::TokenAuthenticator;
use crate::agent_server::AgentService;
use crate::agent_tls::{self, AgentTlsError};
use crate::cluster_pull_secret::SecretRef;
use crate::cluster_state::ClusterState;
use crate::hub_connection::{self, HubLink};
use crate::metrics::Metrics;
use crate::node_events::{self, NodeEvents};
use crate::shared_state::SharedState;
use crate::{cluster_pull_secret_sync, device_plugin_sync, node_labels, nodes, spoke_image_sync};

/// Everything the proxy needs to run.
#[derive(Clone, Debug)]
pub struct ProxyConfig {
    pub hub: HubLink,
    pub namespace: String,
    /// This proxy's name among the Events' reporters (its Pod's name).
    pub instance: String,
    pub cluster_name: String,
    pub agent_addr: SocketAddr,
    pub agent_sans: Vec<String>,
    /// Lifetime of the agent server's certificate; re-issued with a third of it left.
    pub agent_cert_validity: Duration,
    pub token_audience: String,
    /// `<namespace>:<name>` of the node agents' ServiceAccount.
    pub agent_service_account: String,
    pub metrics_addr: SocketAddr,
    /// The cluster's own pull Secret (in `namespace`), if the add-on names one.
    pub cluster_pull_secret: Option<String>,
    /// How often that Secret is read.
    pub cluster_pull_secret_poll: Duration,
    /// The cluster's registry CAs (PEM) besides the system's, for resolving the images
    /// the hub cannot check.
    pub registry_ca_file: Option<std::path::PathBuf>,
}

#[derive(Debug, Error)]
pub enum RunError {
    #[error(transparent)]
    AgentTls(#[from] AgentTlsError),
    #[error("cannot listen on --agent-addr {addr}: {source}")]
    AgentBind {
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error("the agent server cannot start: {0}")]
    AgentServer(#[source] tonic::transport::Error),
    #[error("the agent server's TLS: {0}")]
    AgentServing(#[source] serving::ServingError),
    #[error("cannot listen on --metrics-addr {addr}: {source}")]
    MetricsBind {
        addr: SocketAddr,
        source: std::io::Error,
    },
}

/// Runs the proxy until `shutdown` is cancelled, then stops every task and returns.
pub async fn run(
    config: ProxyConfig,
    client: kube::Client,
    shutdown: CancellationToken,
) -> Result<(), RunError> {
    let metrics = Metrics::default();
    let mut registry = Registry::default();
    metrics.register(&mut registry);
    let health = Health::default();
    // Also cancelled when the agent server fails, ending every task.
    let cancel = shutdown.child_token();

    let metrics_listener = TcpListener::bind(config.metrics_addr)
        .await
        .map_err(|source| RunError::MetricsBind {
            addr: config.metrics_addr,
            source,
        })?;
    let identity = agent_tls::ensure(
        &client,
        &config.namespace,
        &config.agent_sans,
        config.agent_cert_validity,
    )
    .await?;
    let certificate = ServingCertificate::new(&identity.cert_pem, &identity.key_pem)
        .map_err(RunError::AgentServing)?;
    let agent_listener = TcpListener::bind(config.agent_addr)
        .await
        .map_err(|source| RunError::AgentBind {
            addr: config.agent_addr,
            source,
        })?;
    tracing::info!(
        cluster = config.cluster_name,
        namespace = config.namespace,
        hub = %config.hub.address,
        agent_addr = %config.agent_addr,
        metrics_addr = %config.metrics_addr,
        "kmm-spoke-proxy starting"
    );

    // Revisions start from the clock so a restarted proxy continues above its
    // predecessor's, and stale reports of earlier streams never count as current.
    let revision_base = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(1, |d| d.as_millis() as u64);
    let state = SharedState::new(ClusterState::new(revision_base));

    let mut tasks = tokio::task::JoinSet::new();
    if let Some(name) = &config.cluster_pull_secret {
        let secret = SecretRef {
            namespace: config.namespace.clone(),
            name: name.clone(),
        };
        cluster_pull_secret_sync::read_once(&client, &state, &secret).await;
        tasks.spawn(cluster_pull_secret_sync::run(
            client.clone(),
            state.clone(),
            secret,
            config.cluster_pull_secret_poll,
            cancel.clone(),
        ));
    }
    tasks.spawn(spoke_image_sync::run(
        state.clone(),
        config.registry_ca_file.clone(),
        cancel.clone(),
    ));
    tasks.spawn(nodes::run(
        client.clone(),
        state.clone(),
        metrics.clone(),
        cancel.clone(),
    ));
    tasks.spawn(node_labels::run(
        client.clone(),
        state.clone(),
        metrics.clone(),
        cancel.clone(),
    ));
    tasks.spawn(device_plugin_sync::run(
        client.clone(),
        state.clone(),
        config.namespace.clone(),
        cancel.clone(),
    ));
    // Ready only while connected to the hub (hub_connection says why); alive regardless.
    tasks.spawn(hub_connection::run(
        config.hub.clone(),
        state.clone(),
        metrics.clone(),
        health.clone(),
        cancel.clone(),
    ));
    {
        let cancel = cancel.clone();
        tasks.spawn(health::serve_on(
            metrics_listener,
            registry,
            health,
            async move { cancel.cancelled().await },
        ));
    }

    let auth = TokenAuthenticator::new(
        client.clone(),
        config.token_audience.clone(),
        config.agent_service_account.clone(),
        metrics.clone(),
    );
    let (node_events, queued) = NodeEvents::new(metrics.clone());
    tasks.spawn(node_events::run(
        client.clone(),
        config.instance.clone(),
        queued,
        metrics.clone(),
        cancel.clone(),
    ));
    let service = AgentService::new(state, auth, metrics, node_events, cancel.clone());
    let tls = serving::server_config(certificate.clone(), None, &[b"h2"])
        .map_err(RunError::AgentServing)?;
    tasks.spawn(agent_tls::keep_current(
        client.clone(),
        config.namespace.clone(),
        config.agent_sans.clone(),
        config.agent_cert_validity,
        certificate,
        identity,
        cancel.clone(),
    ));
    let server = Server::builder()
        .http2_keepalive_interval(Some(Duration::from_secs(30)))
        .http2_keepalive_timeout(Some(Duration::from_secs(20)))
        .add_service(
            AgentServer::new(service)
                .max_decoding_message_size(kmm_proto::limits::AGENT_MESSAGE)
                .max_encoding_message_size(kmm_proto::limits::AGENT_INSTRUCTION),
        )
        .serve_with_incoming_shutdown(serving::incoming(agent_listener, tls, cancel.clone()), {
            let cancel = cancel.clone();
            async move { cancel.cancelled().await }
        });

    let served = server.await;
    cancel.cancel();
    while tasks.join_next().await.is_some() {}
    tracing::info!("kmm-spoke-proxy stopped");
    served.map_err(RunError::AgentServer)
}
