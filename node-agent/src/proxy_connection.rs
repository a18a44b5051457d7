//! The agent's connection to kmm-spoke-proxy: one `Agent.Attach` stream over TLS,
//! authenticated with the node's projected ServiceAccount token. Every (re)connect
//! re-reads the CA and the token (the kubelet rotates it) and opens with a hello
//! carrying what the agent has loaded; desired modules come down, every event goes up.
//! A lost connection never unloads anything: the last snapshot stays in force.

use std::path::{Path, PathBuf};
use std::time::Duration;

use kmm_proto::v1 as pb;
use kmm_proto::v1::agent_client::AgentClient;
use tokio::sync::{mpsc, watch};
use tokio_stream::wrappers::ReceiverStream;
use tonic::metadata::MetadataValue;
use tonic::transport::{Certificate, ClientTlsConfig, Endpoint};

use crate::control::{EventReceiver, Hello, IntentSender, Progress};
use crate::image::pull::error_chain;
use crate::metrics::Metrics;
use crate::proxy_messages;
use kmm_runtime::backoff::{Backoff, random_fraction};

/// Where and how to reach the proxy.
#[derive(Clone, Debug)]
pub struct ProxyConfig {
    /// `https://host:port`.
    pub address: String,
    /// The name the proxy's serving certificate must carry; `None`: the host of
    /// `address`. Set when the address is one the certificate cannot name, such as the
    /// Service's ClusterIP.
    pub server_name: Option<String>,
    /// PEM CA certificate(s) the proxy's serving certificate must chain to.
    pub ca_file: PathBuf,
    /// The projected ServiceAccount token.
    pub token_file: PathBuf,
    pub connect_timeout: Duration,
    pub backoff_initial: Duration,
    pub backoff_max: Duration,
}

impl ProxyConfig {
    pub fn new(address: String, ca_file: PathBuf, token_file: PathBuf) -> Self {
        Self {
            address,
            server_name: None,
            ca_file,
            token_file,
            connect_timeout: Duration::from_secs(10),
            backoff_initial: Duration::from_millis(500),
            backoff_max: Duration::from_secs(30),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ConnectionError {
    #[error("reading the proxy CA file {path}: {source}")]
    ReadCa {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("reading the token file {path}: {source}")]
    ReadToken {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("the proxy CA file {path} holds no PEM certificate")]
    NoCaCertificate { path: PathBuf },
    /// Never includes the token.
    #[error("the token file {path} {problem}")]
    BadToken {
        path: PathBuf,
        problem: &'static str,
    },
    #[error("--proxy-address {address}: {source}")]
    Address {
        address: String,
        #[source]
        source: tonic::transport::Error,
    },
    #[error("connecting to {address}: {source}")]
    Connect {
        address: String,
        #[source]
        source: tonic::transport::Error,
    },
    #[error("the proxy did not answer the stream within {0:?}")]
    NoAnswer(Duration),
    #[error("the proxy refused the stream: {code:?}: {message}")]
    Refused { code: tonic::Code, message: String },
    #[error("the stream broke: {code:?}: {message}")]
    Broken { code: tonic::Code, message: String },
    #[error("the stream closed while sending")]
    SendClosed,
}

/// How a stream that was established ended.
#[derive(Debug)]
enum Ended {
    /// The proxy closed it (e.g. it is shutting down).
    ClosedByProxy,
    /// The agent's event channel closed: the agent loop is gone.
    AgentStopped,
}

/// Reads `--proxy-address` as this client needs it.
pub fn validate_address(address: &str) -> Result<(), String> {
    // Kubernetes leaves `$(VAR)` as it is when VAR is not defined, and the kubelet
    // defines a Service's variables only for Services that existed when the pod started.
    if address.contains("$(") {
        return Err(format!(
            "--proxy-address {address:?} holds an unexpanded $(VARIABLE): the kubelet sets \
             a Service's variables only if the Service exists when the pod starts"
        ));
    }
    let uri: tonic::transport::Uri = address
        .parse()
        .map_err(|e| format!("--proxy-address {address:?} is not a URI: {e}"))?;
    if uri.scheme_str() != Some("https") {
        return Err(format!(
            "--proxy-address {address:?} must start with https:// (the agent only talks TLS)"
        ));
    }
    if uri.host().is_none_or(str::is_empty) {
        return Err(format!("--proxy-address {address:?} has no host"));
    }
    Ok(())
}

/// Reads `--proxy-server-name`: what TLS can verify, a DNS name or an IP address.
pub fn validate_server_name(name: &str) -> Result<(), String> {
    rustls_pki_types::ServerName::try_from(name)
        .map(drop)
        .map_err(|e| {
            format!("--proxy-server-name {name:?} is neither a DNS name nor an IP address: {e}")
        })
}

fn read_ca(path: &Path) -> Result<Vec<u8>, ConnectionError> {
    let pem = std::fs::read(path).map_err(|source| ConnectionError::ReadCa {
        path: path.to_path_buf(),
        source,
    })?;
    // rustls would only fail later with a vaguer handshake error.
    let marker = b"-----BEGIN CERTIFICATE-----";
    if !pem.windows(marker.len()).any(|w| w == marker) {
        return Err(ConnectionError::NoCaCertificate {
            path: path.to_path_buf(),
        });
    }
    Ok(pem)
}

fn read_token(path: &Path) -> Result<MetadataValue<tonic::metadata::Ascii>, ConnectionError> {
    let text = std::fs::read_to_string(path).map_err(|source| ConnectionError::ReadToken {
        path: path.to_path_buf(),
        source,
    })?;
    let token = text.trim();
    if token.is_empty() {
        return Err(ConnectionError::BadToken {
            path: path.to_path_buf(),
            problem: "is empty",
        });
    }
    let mut value: MetadataValue<_> =
        format!("Bearer {token}")
            .parse()
            .map_err(|_| ConnectionError::BadToken {
                path: path.to_path_buf(),
                problem: "holds characters a header cannot carry",
            })?;
    value.set_sensitive(true);
    Ok(value)
}

/// The TLS endpoint of the proxy, trusting only `ca_pem`.
fn endpoint(config: &ProxyConfig, ca_pem: Vec<u8>) -> Result<Endpoint, ConnectionError> {
    let mut tls = ClientTlsConfig::new().ca_certificate(Certificate::from_pem(ca_pem));
    if let Some(name) = &config.server_name {
        tls = tls.domain_name(name);
    }
    let endpoint = Endpoint::from_shared(config.address.clone())
        .and_then(|e| e.tls_config(tls))
        .map_err(|source| ConnectionError::Address {
            address: config.address.clone(),
            source,
        })?;
    Ok(endpoint
        .connect_timeout(config.connect_timeout)
        // A silently dead peer (node network cut) is noticed without waiting for TCP.
        .http2_keep_alive_interval(Duration::from_secs(30))
        .keep_alive_timeout(Duration::from_secs(10))
        .keep_alive_while_idle(true))
}

/// The client: owns the event receiver and feeds the intent sender, across reconnects.
#[derive(Debug)]
pub struct ProxyConnection {
    pub config: ProxyConfig,
    /// Node name, boot ID and kernel; `loaded` is refreshed from `progress` each time.
    pub hello: Hello,
    pub agent_version: String,
    pub progress: watch::Receiver<Progress>,
    pub intents: IntentSender,
    pub events: EventReceiver,
    /// True while a stream is established.
    pub connected: watch::Sender<bool>,
    pub metrics: Metrics,
}

impl ProxyConnection {
    /// Connects, and reconnects with backoff, until the future is dropped.
    #[tracing::instrument(name = "proxy_link", skip_all, fields(node = %self.hello.node_name))]
    pub async fn run(mut self) {
        let mut backoff = Backoff::new(self.config.backoff_initial, self.config.backoff_max);
        loop {
            let result = self.attempt().await;
            let was_connected = self.connected.send_replace(false);
            if was_connected {
                backoff.reset();
            }
            match result {
                Ok(Ended::AgentStopped) => return,
                Ok(Ended::ClosedByProxy) => {
                    tracing::info!(address = %self.config.address, "the proxy closed the stream; reconnecting")
                }
                Err(e) => {
                    tracing::warn!(address = %self.config.address, error = %error_chain(&e), "proxy connection failed")
                }
            }
            let delay = backoff.next_delay(random_fraction());
            tracing::debug!(?delay, "waiting before reconnecting");
            tokio::time::sleep(delay).await;
        }
    }

    async fn attempt(&mut self) -> Result<Ended, ConnectionError> {
        let address = self.config.address.clone();
        let ca = read_ca(&self.config.ca_file)?;
        let token = read_token(&self.config.token_file)?;
        let channel = endpoint(&self.config, ca)?
            .connect()
            .await
            .map_err(|source| ConnectionError::Connect {
                address: address.clone(),
                source,
            })?;

        let (outbound, outbound_rx) = mpsc::channel::<pb::AgentMessage>(64);
        let hello = Hello {
            loaded: self.progress.borrow().loaded.clone(),
            ..self.hello.clone()
        };
        // Queued before the call so that a proxy waiting for the hello gets it.
        outbound
            .send(pb::AgentMessage {
                message: Some(pb::agent_message::Message::Hello(
                    proxy_messages::agent_hello(&hello, &self.agent_version),
                )),
            })
            .await
            .map_err(|_| ConnectionError::SendClosed)?;
        let mut request = tonic::Request::new(ReceiverStream::new(outbound_rx));
        request.metadata_mut().insert("authorization", token);
        // Bounded, so that a proxy stuck before answering (e.g. on its TokenReview) is
        // retried rather than waited for forever.
        let answer = self.config.connect_timeout * 3;
        let mut inbound = tokio::time::timeout(
            answer,
            AgentClient::new(channel)
                .max_encoding_message_size(kmm_proto::limits::AGENT_MESSAGE)
                .max_decoding_message_size(kmm_proto::limits::AGENT_INSTRUCTION)
                .attach(request),
        )
        .await
        .map_err(|_| ConnectionError::NoAnswer(answer))?
        .map_err(|status| ConnectionError::Refused {
            code: status.code(),
            message: status.message().to_string(),
        })?
        .into_inner();
        self.connected.send_replace(true);
        tracing::info!(%address, loaded = hello.loaded.len(), "connected to the proxy");

        loop {
            tokio::select! {
                message = inbound.message() => match message {
                    Ok(Some(instruction)) => self.instruction(instruction, &outbound).await?,
                    Ok(None) => return Ok(Ended::ClosedByProxy),
                    Err(status) => {
                        return Err(ConnectionError::Broken {
                            code: status.code(),
                            message: status.message().to_string(),
                        })
                    }
                },
                event = self.events.recv() => match event {
                    Some(event) => {
                        let message = pb::AgentMessage {
                            message: Some(pb::agent_message::Message::Event(
                                proxy_messages::module_event(&event),
                            )),
                        };
                        outbound.send(message).await.map_err(|_| ConnectionError::SendClosed)?;
                    }
                    None => return Ok(Ended::AgentStopped),
                },
            }
        }
    }

    async fn instruction(
        &mut self,
        instruction: pb::AgentInstruction,
        outbound: &mpsc::Sender<pb::AgentMessage>,
    ) -> Result<(), ConnectionError> {
        let Some(pb::agent_instruction::Message::Desired(desired)) = instruction.message else {
            tracing::warn!("ignoring an empty instruction from the proxy");
            return Ok(());
        };
        self.metrics.desired_received();
        let translated = proxy_messages::desired_snapshot(desired);
        let revision = translated.snapshot.revision;
        tracing::info!(
            revision,
            modules = translated.snapshot.modules.len(),
            unload = translated.snapshot.unload.len(),
            refused = translated.refused.len(),
            "desired modules received"
        );
        for refused in &translated.refused {
            tracing::warn!(revision, error = %refused, "refusing an entry of the desired modules");
            let event = proxy_messages::refusal_event(refused, revision);
            outbound
                .send(pb::AgentMessage {
                    message: Some(pb::agent_message::Message::Event(event)),
                })
                .await
                .map_err(|_| ConnectionError::SendClosed)?;
        }
        self.intents.send_replace(Some(translated.snapshot));
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use kmm_runtime::pki::{CertificateAuthority, Leaf};
    use tokio_stream::wrappers::TcpListenerStream;
    use tonic::transport::{Identity, Server, ServerTlsConfig};

    use super::*;

    /// Agents reach the proxy by its Service's ClusterIP, which the proxy's certificate
    /// does not name: TLS verifies the name given instead.
    #[tokio::test]
    async fn tls_verifies_the_server_name_rather_than_the_address() {
        let hour = Duration::from_secs(3600);
        let ca = CertificateAuthority::generate("test-agent-ca", hour).unwrap();
        let service = "kmm-spoke-proxy.kmm.svc".to_string();
        let serving = ca
            .issue(&Leaf::server(
                "kmm-spoke-proxy",
                std::slice::from_ref(&service),
                &[],
                hour,
            ))
            .unwrap();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = format!("https://{}", listener.local_addr().unwrap());
        let tls = ServerTlsConfig::new().identity(Identity::from_pem(
            &serving.cert_pem,
            serving.key_pem.as_bytes(),
        ));
        let server = tokio::spawn(
            Server::builder()
                .tls_config(tls)
                .unwrap()
                .add_routes(tonic::service::Routes::default())
                .serve_with_incoming(TcpListenerStream::new(listener)),
        );
        let ca_pem = ca.cert_pem().as_bytes().to_vec();
        let mut config = ProxyConfig::new(address, "unused".into(), "unused".into());

        let refused = endpoint(&config, ca_pem.clone())
            .unwrap()
            .connect()
            .await
            .unwrap_err();
        let refused = error_chain(&refused);
        assert!(
            refused.contains("not valid for name \"127.0.0.1\""),
            "{refused}"
        );
        config.server_name = Some(service);
        endpoint(&config, ca_pem).unwrap().connect().await.unwrap();
        server.abort();
    }

    #[test]
    fn server_names_are_dns_names_or_ip_addresses() {
        assert!(validate_server_name("kmm-spoke-proxy.kmm.svc").is_ok());
        assert!(validate_server_name("10.96.0.12").is_ok());
        for bad in ["", "not a name", "-x."] {
            let e = validate_server_name(bad).unwrap_err();
            assert!(e.contains("--proxy-server-name"), "{e}");
        }
    }

    #[test]
    fn addresses_must_be_https_with_a_host() {
        assert!(validate_address("https://127.0.0.1:7444").is_ok());
        assert!(validate_address("https://kmm-spoke-proxy.kmm.svc:7444").is_ok());
        let e = validate_address("http://127.0.0.1:7444").unwrap_err();
        assert!(
            e.contains("https://") && e.contains("http://127.0.0.1:7444"),
            "{e}"
        );
        let e = validate_address("127.0.0.1:7444").unwrap_err();
        assert!(e.contains("127.0.0.1:7444"), "{e}");
        let e = validate_address("https:// bad").unwrap_err();
        assert!(e.contains("not a URI"), "{e}");
        let unexpanded =
            "https://$(KMM_SPOKE_PROXY_SERVICE_HOST):$(KMM_SPOKE_PROXY_SERVICE_PORT_AGENTS)";
        let e = validate_address(unexpanded).unwrap_err();
        assert!(
            e.contains("unexpanded") && e.contains("Service exists"),
            "{e}"
        );
    }

    #[test]
    fn the_ca_file_must_hold_a_certificate() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("ca.crt");
        std::fs::write(&path, "not a certificate\n").unwrap();
        let e = read_ca(&path).unwrap_err().to_string();
        assert!(
            e.contains("ca.crt") && e.contains("no PEM certificate"),
            "{e}"
        );
        let pem = "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n";
        std::fs::write(&path, pem).unwrap();
        assert_eq!(read_ca(&path).unwrap(), pem.as_bytes());
        let e = read_ca(&dir.path().join("absent")).unwrap_err().to_string();
        assert!(e.contains("absent"), "{e}");
    }

    #[test]
    fn tokens_are_trimmed_checked_and_never_shown() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("token");
        std::fs::write(&path, "abc.def\n").unwrap();
        let value = read_token(&path).unwrap();
        assert!(value.is_sensitive());
        assert_eq!(value.to_str().unwrap(), "Bearer abc.def");
        assert!(!format!("{value:?}").contains("abc"), "{value:?}");

        std::fs::write(&path, " \n").unwrap();
        let e = read_token(&path).unwrap_err().to_string();
        assert!(e.ends_with("is empty") && e.contains("token"), "{e}");
        std::fs::write(&path, "SECRET_TOKEN\u{1}").unwrap();
        let e = read_token(&path).unwrap_err().to_string();
        assert!(
            e.contains("cannot carry") && !e.contains("SECRET_TOKEN"),
            "{e}"
        );
        let e = read_token(&dir.path().join("missing"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("missing"), "{e}");
    }
}
