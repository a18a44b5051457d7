//! The test's stand-in for kmm-spoke-proxy's agent endpoint (`kmm.v1.Agent/Attach`),
//! served on the host's loopback where the guest reaches it as [`super::HOST_FROM_GUEST`]:
//! TLS with a serving certificate from a fresh kmm-runtime CA (SANs include that
//! address), and the agent's `authorization: Bearer` token checked. Each accepted stream
//! becomes a [`Session`] the test drives: it sends `DesiredModules` and reads
//! `ModuleEvent`s.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::time::{Duration, Instant};

use kmm_proto::v1 as pb;
use kmm_proto::v1::agent_server::{Agent, AgentServer};
use kmm_runtime::pki::{CertificateAuthority, Leaf};
use tokio::sync::mpsc;
use tokio_stream::wrappers::{ReceiverStream, TcpListenerStream};
use tonic::transport::{Identity, Server, ServerTlsConfig};
use tonic::{Request, Response, Status, Streaming};

use super::HOST_FROM_GUEST;
use crate::{Error, IoContext, Result};

const VALIDITY: Duration = Duration::from_secs(24 * 3600);

/// One accepted `Attach` stream. Dropping it closes the stream.
#[derive(Debug)]
pub struct Session {
    /// The stream's first message.
    pub hello: pb::AgentHello,
    inbound: Streaming<pb::AgentMessage>,
    outbound: mpsc::Sender<Result<pb::AgentInstruction, Status>>,
}

impl Session {
    /// Send the complete desired modules for the node.
    pub async fn send(&self, revision: u64, modules: Vec<pb::NodeModule>) -> Result<()> {
        let desired = pb::DesiredModules { revision, modules };
        self.outbound
            .send(Ok(pb::AgentInstruction {
                message: Some(pb::agent_instruction::Message::Desired(desired)),
            }))
            .await
            .map_err(|_| {
                Error::Invalid(format!(
                    "the agent's stream closed before revision {revision} was sent"
                ))
            })
    }

    /// The next message on the stream, which must be an event, within `timeout`.
    pub async fn next_event(&mut self, timeout: Duration) -> Result<pb::ModuleEvent> {
        let message = match tokio::time::timeout(timeout, self.inbound.message()).await {
            Err(_) => {
                return Err(Error::Timeout {
                    what: "a module event from the agent".into(),
                    seconds: timeout.as_secs(),
                });
            }
            Ok(Err(status)) => {
                return Err(Error::Invalid(format!(
                    "the agent's stream failed: {status}"
                )));
            }
            Ok(Ok(None)) => {
                return Err(Error::Invalid("the agent closed its stream".into()));
            }
            Ok(Ok(Some(message))) => message,
        };
        match message.message {
            Some(pb::agent_message::Message::Event(event)) => Ok(event),
            other => Err(Error::Invalid(format!(
                "expected a module event from the agent, got {other:?}"
            ))),
        }
    }
}

/// The service: checks the token, takes the hello, hands the stream to the test.
struct Peer {
    token: String,
    sessions: mpsc::UnboundedSender<Session>,
    refusals: mpsc::UnboundedSender<String>,
}

#[tonic::async_trait]
impl Agent for Peer {
    type AttachStream = ReceiverStream<Result<pb::AgentInstruction, Status>>;

    async fn attach(
        &self,
        request: Request<Streaming<pb::AgentMessage>>,
    ) -> Result<Response<Self::AttachStream>, Status> {
        let bearer = request
            .metadata()
            .get("authorization")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "));
        if bearer != Some(self.token.as_str()) {
            let why = match bearer {
                None => "no `authorization: Bearer` metadata",
                Some(_) => "a bearer token that is not the one written into the guest",
            };
            let _ = self.refusals.send(why.to_string());
            return Err(Status::unauthenticated(why));
        }
        let mut inbound = request.into_inner();
        let hello = match inbound.message().await? {
            Some(pb::AgentMessage {
                message: Some(pb::agent_message::Message::Hello(hello)),
            }) => hello,
            other => {
                let why = format!("the stream did not start with a hello: {other:?}");
                let _ = self.refusals.send(why.clone());
                return Err(Status::invalid_argument(why));
            }
        };
        let (outbound, rx) = mpsc::channel(16);
        let _ = self.sessions.send(Session {
            hello,
            inbound,
            outbound,
        });
        Ok(Response::new(ReceiverStream::new(rx)))
    }
}

/// A running peer.
#[derive(Debug)]
pub struct AgentPeer {
    /// Where it listens on the host (loopback).
    pub addr: SocketAddr,
    /// The CA the agent must trust (PEM).
    pub ca_pem: String,
    sessions: mpsc::UnboundedReceiver<Session>,
    refusals: mpsc::UnboundedReceiver<String>,
    server: tokio::task::JoinHandle<()>,
}

impl AgentPeer {
    /// Serve on `127.0.0.1:<free port>`, accepting only `token`.
    pub async fn start(token: &str) -> Result<Self> {
        let ca = CertificateAuthority::generate("kmm real-kernel test proxy CA", VALIDITY)
            .map_err(|e| Error::Invalid(format!("the test proxy CA: {e}")))?;
        let guest_side: IpAddr = HOST_FROM_GUEST
            .parse()
            .map_err(|e| Error::Invalid(format!("HOST_FROM_GUEST `{HOST_FROM_GUEST}`: {e}")))?;
        let serving = ca
            .issue(&Leaf::server(
                "kmm-spoke-proxy",
                &["localhost".into()],
                &[guest_side, IpAddr::V4(Ipv4Addr::LOCALHOST)],
                VALIDITY,
            ))
            .map_err(|e| Error::Invalid(format!("the test proxy's serving certificate: {e}")))?;
        // qemu's user network forwards the guest's 10.0.2.2 to the host's loopback.
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .context(|| "binding the test proxy on 127.0.0.1".into())?;
        let addr = listener
            .local_addr()
            .context(|| "the test proxy's address".into())?;
        let (sessions_tx, sessions) = mpsc::unbounded_channel();
        let (refusals_tx, refusals) = mpsc::unbounded_channel();
        let peer = Peer {
            token: token.to_string(),
            sessions: sessions_tx,
            refusals: refusals_tx,
        };
        let identity = Identity::from_pem(&serving.cert_pem, serving.key_pem.as_bytes());
        let server = Server::builder()
            .tls_config(ServerTlsConfig::new().identity(identity))
            .map_err(|e| Error::Invalid(format!("the test proxy's TLS: {e}")))?
            .add_service(AgentServer::new(peer))
            .serve_with_incoming(TcpListenerStream::new(listener));
        let server = tokio::spawn(async move {
            if let Err(e) = server.await {
                eprintln!("the test proxy stopped: {e}");
            }
        });
        Ok(Self {
            addr,
            ca_pem: ca.cert_pem().to_string(),
            sessions,
            refusals,
            server,
        })
    }

    /// The address the agent in the guest dials.
    pub fn address_from_guest(&self) -> String {
        format!("https://{HOST_FROM_GUEST}:{}", self.addr.port())
    }

    /// The next stream an agent opens, within `timeout`. A refused attempt fails this
    /// at once with the reason, rather than waiting out the agent's retries.
    pub async fn session(&mut self, timeout: Duration) -> Result<Session> {
        let deadline = Instant::now() + timeout;
        tokio::select! {
            session = tokio::time::timeout_at(deadline.into(), self.sessions.recv()) => match session {
                Ok(Some(session)) => Ok(session),
                Ok(None) => Err(Error::Invalid("the test proxy stopped".into())),
                Err(_) => Err(Error::Timeout {
                    what: "the agent to open its stream to the test proxy".into(),
                    seconds: timeout.as_secs(),
                }),
            },
            Some(why) = self.refusals.recv() => {
                Err(Error::Invalid(format!("the test proxy refused the agent's stream: {why}")))
            }
        }
    }
}

impl Drop for AgentPeer {
    fn drop(&mut self) {
        self.server.abort();
    }
}
