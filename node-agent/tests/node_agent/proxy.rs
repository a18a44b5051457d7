//! The agent binary against a test peer speaking `kmm.v1.Agent` over TLS (certificates
//! from kmm-runtime's CA, the bearer token checked), with the simulated kernel backend
//! and a real registry: hello, load and unload events with revisions, absence never
//! unloads, reconnects resend the hello and change nothing, a wrong CA or token is
//! retried until fixed, and /healthz /readyz /metrics answer.

use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kmm_node_agent::kernel::{Kernel, SimulatedKernel};
use kmm_proto::v1 as pb;
use kmm_proto::v1::agent_server::{Agent, AgentServer};
use kmm_runtime::pki::{CertificateAuthority, Leaf};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::mpsc;
use tokio_stream::StreamExt;
use tokio_stream::wrappers::{ReceiverStream, TcpListenerStream};
use tonic::transport::{Identity, Server, ServerTlsConfig};
use tonic::{Request, Response, Status, Streaming};

use crate::process::AgentProcess;
use crate::support::*;

const WAIT: Duration = Duration::from_secs(60);

/// One accepted `Attach` stream, as the test drives it. Dropping it closes the stream.
struct Session {
    token: String,
    hello: pb::AgentHello,
    inbound: Streaming<pb::AgentMessage>,
    outbound: mpsc::Sender<Result<pb::AgentInstruction, Status>>,
}

impl Session {
    async fn send(&self, revision: u64, modules: Vec<pb::NodeModule>) {
        let desired = pb::DesiredModules { revision, modules };
        self.outbound
            .send(Ok(pb::AgentInstruction {
                message: Some(pb::agent_instruction::Message::Desired(desired)),
            }))
            .await
            .expect("the agent's stream is open");
    }

    async fn next_event(&mut self) -> pb::ModuleEvent {
        let message = tokio::time::timeout(WAIT, self.inbound.message())
            .await
            .expect("an event within the deadline")
            .expect("the stream is healthy")
            .expect("the stream is open");
        match message.message {
            Some(pb::agent_message::Message::Event(event)) => event,
            other => panic!("expected an event, got {other:?}"),
        }
    }
}

/// The test's stand-in for kmm-spoke-proxy's agent service.
struct Peer {
    expected_token: Arc<Mutex<String>>,
    refused: Arc<AtomicUsize>,
    sessions: mpsc::UnboundedSender<Session>,
}

#[tonic::async_trait]
impl Agent for Peer {
    type AttachStream = ReceiverStream<Result<pb::AgentInstruction, Status>>;

    async fn attach(
        &self,
        request: Request<Streaming<pb::AgentMessage>>,
    ) -> Result<Response<Self::AttachStream>, Status> {
        let token = request
            .metadata()
            .get("authorization")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .unwrap_or_default()
            .to_string();
        if token != *self.expected_token.lock().unwrap() {
            self.refused.fetch_add(1, Ordering::SeqCst);
            return Err(Status::unauthenticated("the token is not the expected one"));
        }
        let mut inbound = request.into_inner();
        let hello = match inbound.message().await? {
            Some(pb::AgentMessage {
                message: Some(pb::agent_message::Message::Hello(hello)),
            }) => hello,
            other => {
                return Err(Status::invalid_argument(format!(
                    "no hello first: {other:?}"
                )));
            }
        };
        let (outbound, rx) = mpsc::channel(16);
        let _ = self.sessions.send(Session {
            token,
            hello,
            inbound,
            outbound,
        });
        Ok(Response::new(ReceiverStream::new(rx)))
    }
}

/// A running peer: its CA, its TCP accept count and the sessions it accepted.
struct ProxyPeer {
    addr: SocketAddr,
    ca_pem: String,
    expected_token: Arc<Mutex<String>>,
    refused: Arc<AtomicUsize>,
    accepted: Arc<AtomicUsize>,
    sessions: mpsc::UnboundedReceiver<Session>,
}

impl ProxyPeer {
    async fn start(token: &str) -> Self {
        let ca =
            CertificateAuthority::generate("test proxy CA", Duration::from_secs(3600)).unwrap();
        let serving = ca
            .issue(&Leaf::server(
                "kmm-spoke-proxy",
                &["localhost".into()],
                &[IpAddr::V4(Ipv4Addr::LOCALHOST)],
                Duration::from_secs(3600),
            ))
            .unwrap();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let accepted = Arc::new(AtomicUsize::new(0));
        let counter = accepted.clone();
        let incoming = TcpListenerStream::new(listener).map(move |conn| {
            counter.fetch_add(1, Ordering::SeqCst);
            conn
        });
        let expected_token = Arc::new(Mutex::new(token.to_string()));
        let refused = Arc::new(AtomicUsize::new(0));
        let (sessions_tx, sessions) = mpsc::unbounded_channel();
        let peer = Peer {
            expected_token: expected_token.clone(),
            refused: refused.clone(),
            sessions: sessions_tx,
        };
        let identity = Identity::from_pem(serving.cert_pem, serving.key_pem.as_bytes());
        let server = Server::builder()
            .tls_config(ServerTlsConfig::new().identity(identity))
            .unwrap()
            .add_service(AgentServer::new(peer))
            .serve_with_incoming(incoming);
        tokio::spawn(server);
        Self {
            addr,
            ca_pem: ca.cert_pem().to_string(),
            expected_token,
            refused,
            accepted,
            sessions,
        }
    }

    async fn session(&mut self) -> Session {
        tokio::time::timeout(WAIT, self.sessions.recv())
            .await
            .expect("the agent connects within the deadline")
            .expect("the peer runs")
    }

    fn expect_token(&self, token: &str) {
        *self.expected_token.lock().unwrap() = token.to_string();
    }
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A node's directories and the files the agent reads its connection settings from.
struct NodeFiles {
    dir: tempfile::TempDir,
    ca: PathBuf,
    token: PathBuf,
    metrics_port: u16,
}

impl NodeFiles {
    fn new(ca_pem: &str, token: &str) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let files = Self {
            ca: dir.path().join("ca.crt"),
            token: dir.path().join("token"),
            metrics_port: free_port(),
            dir,
        };
        files.write_ca(ca_pem);
        files.write_token(token);
        files
    }

    fn write_token(&self, token: &str) {
        replace(&self.token, token);
    }

    fn write_ca(&self, pem: &str) {
        replace(&self.ca, pem);
    }

    fn log(&self) -> PathBuf {
        self.dir.path().join("agent.log")
    }

    fn node(&self) -> &Path {
        self.dir.path()
    }

    /// Starts the real binary connected to `peer`, logging to `agent.log`.
    fn start(&self, peer: &ProxyPeer, kernel: &str) -> AgentProcess {
        let node = self.node();
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.log())
            .unwrap();
        let child = Command::new(env!("CARGO_BIN_EXE_kmm-node-agent"))
            .args(["--log-format", "json", "run", "--node-name", "node-1"])
            .arg(format!(
                "--proxy-address=https://127.0.0.1:{}",
                peer.addr.port()
            ))
            .arg("--proxy-ca-file")
            .arg(&self.ca)
            .arg("--token-file")
            .arg(&self.token)
            .arg(format!("--metrics-addr=127.0.0.1:{}", self.metrics_port))
            .args(simulated_node_args(node, kernel))
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("the kmm-node-agent binary starts");
        // Nothing is printed on stdout in proxy mode.
        let (_, lines) = std::sync::mpsc::channel();
        AgentProcess { child, lines }
    }

    fn kernel(&self, release: &str) -> SimulatedKernel {
        SimulatedKernel::open(self.node().join("kernel"), release).unwrap()
    }
}

/// Writes a file atomically, as the kubelet updates projected volumes.
fn replace(path: &Path, content: &str) {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, content).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

/// A plain HTTP GET on the agent's metrics port: (status code, body).
async fn get(port: u16, path: &str) -> (u16, String) {
    let mut stream = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .unwrap_or_else(|e| panic!("connecting to the metrics port {port}: {e}"));
    let request = format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).await.unwrap();
    let status = response[9..12].parse().unwrap();
    let body = response
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default();
    (status, body)
}

/// Polls `path` until `ok` accepts the answer; returns the body.
async fn wait_http(port: u16, path: &str, ok: impl Fn(u16, &str) -> bool) -> String {
    until(
        &format!("{path} on port {port} to answer as expected"),
        || async {
            let (status, body) = get(port, path).await;
            ok(status, &body).then_some(body)
        },
    )
    .await
}

/// Polls `ready` (without blocking the runtime the peer runs on) until it returns
/// `Some` or the deadline passes.
async fn until<T, F: std::future::Future<Output = Option<T>>>(
    what: &str,
    mut ready: impl FnMut() -> F,
) -> T {
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        if let Some(value) = ready().await {
            return value;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out after {WAIT:?} waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn has_line(text: &str, line: &str) -> bool {
    text.lines().any(|l| l == line)
}

fn key(name: &str) -> Option<pb::ModuleKey> {
    Some(pb::ModuleKey {
        namespace: "kmm-ops".into(),
        name: name.into(),
    })
}

fn hello_module(image: String) -> pb::NodeModule {
    pb::NodeModule {
        key: key("hello"),
        load: Some(pb::ModuleLoad {
            image,
            registry_tls: Some(pb::RegistryTls {
                insecure: true,
                insecure_skip_tls_verify: false,
            }),
            modprobe: Some(pb::Modprobe {
                module_name: DEP_MODULE.into(),
                firmware_path: "/firmware".into(),
                ..Default::default()
            }),
            version: "1".into(),
            ..Default::default()
        }),
        credential: None,
        unload: false,
    }
}

fn unload(name: &str) -> pb::NodeModule {
    pb::NodeModule {
        key: key(name),
        unload: true,
        ..Default::default()
    }
}

fn assert_event(
    event: &pb::ModuleEvent,
    name: &str,
    action: pb::Action,
    outcome: pb::Outcome,
    revision: u64,
) {
    assert_eq!(event.key, key(name), "{event:?}");
    assert_eq!(event.action(), action, "{event:?}");
    assert_eq!(event.outcome(), outcome, "{event:?}");
    assert_eq!(event.desired_revision, revision, "{event:?}");
}

fn loaded(kernel: &SimulatedKernel) -> Vec<String> {
    kernel.loaded_modules().unwrap().into_iter().collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drives_loads_and_unloads_over_the_proxy_stream() {
    let k = kernel();
    let registry = Registry::plain();
    let digest = registry
        .push_sample("samples/hello:v1", &Sample::good(k))
        .await;
    let image = registry.image("samples/hello:v1");
    let mut peer = ProxyPeer::start("token-1").await;
    let files = NodeFiles::new(&peer.ca_pem, "token-1");
    let node_kernel = files.kernel(k);
    let boot_id = node_kernel.boot_id().unwrap();
    let mut agent = files.start(&peer, k);
    let port = files.metrics_port;

    // The hello: node, boot, kernel, version, nothing loaded yet.
    let mut session = peer.session().await;
    assert_eq!(session.token, "token-1");
    assert_eq!(session.hello.node_name, "node-1");
    assert_eq!(session.hello.boot_id, boot_id);
    assert_eq!(session.hello.kernel_release, k);
    assert_eq!(session.hello.agent_version, env!("CARGO_PKG_VERSION"));
    assert!(session.hello.loaded.is_empty(), "{:?}", session.hello);
    // Alive, but not ready before it acted on desired modules.
    assert_eq!(get(port, "/healthz").await.0, 200);
    assert_eq!(get(port, "/readyz").await.0, 503);

    // Revision 1 loads the module; the event says so, with digest and duration.
    let sent = std::time::Instant::now();
    session.send(1, vec![hello_module(image.clone())]).await;
    let event = session.next_event().await;
    eprintln!(
        "DesiredModules to load event (first load): {:?}",
        sent.elapsed()
    );
    assert_event(&event, "hello", pb::Action::Load, pb::Outcome::Succeeded, 1);
    assert_eq!(event.image_digest, digest);
    assert_eq!(event.version, "1");
    assert!(event.error.is_empty(), "{event:?}");
    assert!(event.duration_ms > 0, "{event:?}");
    assert_eq!(loaded(&node_kernel), [MODULE, DEP_MODULE]);
    wait_http(port, "/readyz", |status, _| status == 200).await;
    let metrics = wait_http(port, "/metrics", |_, body| {
        has_line(body, "kmm_agent_modules_loaded 1")
    })
    .await;
    for line in [
        r#"kmm_agent_loads_total{outcome="succeeded"} 1"#,
        "kmm_agent_load_duration_seconds_count 1",
        "kmm_agent_proxy_connected 1",
    ] {
        assert!(has_line(&metrics, line), "{line} missing in:\n{metrics}");
    }

    // Revision 2 no longer mentions it: it stays loaded.
    session.send(2, vec![]).await;

    // The token rotates and the proxy drops the stream: the agent reconnects with the
    // new token and resends its hello, which lists the loaded module.
    files.write_token("token-2");
    peer.expect_token("token-2");
    let dropped = std::time::Instant::now();
    drop(session);
    let mut session = peer.session().await;
    eprintln!(
        "stream closed by the proxy to the next hello: {:?}",
        dropped.elapsed()
    );
    assert_eq!(session.token, "token-2");
    assert_eq!(session.hello.boot_id, boot_id);
    assert_eq!(session.hello.loaded.len(), 1, "{:?}", session.hello);
    assert_eq!(session.hello.loaded[0].key, key("hello"));
    assert_eq!(session.hello.loaded[0].image_digest, digest);
    assert_eq!(session.hello.loaded[0].version, "1");
    assert_eq!(loaded(&node_kernel), [MODULE, DEP_MODULE]);

    // The proxy resends revision 2, then asks for explicit unloads (one of a module
    // never loaded here). The first events are exactly those: nothing was reloaded or
    // unloaded in between.
    session.send(2, vec![]).await;
    session
        .send(3, vec![unload("never-loaded"), unload("hello")])
        .await;
    let confirmed = session.next_event().await;
    assert_event(
        &confirmed,
        "never-loaded",
        pb::Action::Unload,
        pb::Outcome::Succeeded,
        3,
    );
    let event = session.next_event().await;
    assert_event(
        &event,
        "hello",
        pb::Action::Unload,
        pb::Outcome::Succeeded,
        3,
    );
    assert_eq!(event.image_digest, digest);
    assert!(loaded(&node_kernel).is_empty());
    assert!(!files.node().join("firmware/kmm/hello.bin").exists());
    wait_http(port, "/metrics", |_, body| {
        has_line(body, r#"kmm_agent_unloads_total{outcome="succeeded"} 2"#)
            && has_line(body, "kmm_agent_modules_loaded 0")
    })
    .await;

    // Loaded again; SIGTERM exits promptly and unloads nothing; a restarted agent says
    // in its hello what is loaded.
    let sent = std::time::Instant::now();
    session.send(4, vec![hello_module(image)]).await;
    let event = session.next_event().await;
    eprintln!(
        "DesiredModules to load event (load after an unload): {:?}",
        sent.elapsed()
    );
    assert_event(&event, "hello", pb::Action::Load, pb::Outcome::Succeeded, 4);
    let status = agent.terminate(Duration::from_secs(5));
    assert!(status.success(), "{status}");
    assert_eq!(
        loaded(&node_kernel),
        [MODULE, DEP_MODULE],
        "SIGTERM unloaded"
    );
    let mut agent = files.start(&peer, k);
    let session = peer.session().await;
    assert_eq!(session.hello.loaded.len(), 1, "{:?}", session.hello);
    assert_eq!(session.hello.loaded[0].key, key("hello"));
    assert_eq!(session.hello.loaded[0].image_digest, digest);
    assert!(agent.terminate(Duration::from_secs(5)).success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_ca_or_token_is_retried_until_fixed() {
    let k = kernel();
    let mut peer = ProxyPeer::start("good").await;
    let other_ca = CertificateAuthority::generate("another CA", Duration::from_secs(3600)).unwrap();
    let files = NodeFiles::new(other_ca.cert_pem(), "stale");
    let _agent = files.start(&peer, k);
    let port = files.metrics_port;

    // The agent keeps trying; the handshake fails every time, so no stream opens.
    let accepted = peer.accepted.clone();
    until("three connection attempts", || async {
        (accepted.load(Ordering::SeqCst) >= 3).then_some(())
    })
    .await;
    assert!(
        peer.sessions.try_recv().is_err(),
        "a stream opened with the wrong CA"
    );
    assert_eq!(
        peer.refused.load(Ordering::SeqCst),
        0,
        "a request passed the TLS handshake"
    );
    let log = std::fs::read_to_string(files.log()).unwrap();
    assert!(
        log.contains("UnknownIssuer"),
        "the log does not say why:\n{log}"
    );
    assert_eq!(get(port, "/healthz").await.0, 200);
    assert_eq!(get(port, "/readyz").await.0, 503);
    let metrics = get(port, "/metrics").await.1;
    assert!(
        has_line(&metrics, "kmm_agent_proxy_connected 0"),
        "{metrics}"
    );

    // The right CA: TLS succeeds (re-read on the next attempt), but the token is refused.
    files.write_ca(&peer.ca_pem);
    let refused = peer.refused.clone();
    until("a refused token", || async {
        (refused.load(Ordering::SeqCst) >= 1).then_some(())
    })
    .await;
    assert!(peer.sessions.try_recv().is_err());

    // The token is fixed in the file: the next attempt reads it and gets in.
    files.write_token("good");
    let session = peer.session().await;
    assert_eq!(session.token, "good");
    assert_eq!(session.hello.node_name, "node-1");
    // Connected but no desired modules yet: still not ready.
    assert_eq!(get(port, "/readyz").await.0, 503);
    session.send(1, vec![]).await;
    wait_http(port, "/readyz", |status, _| status == 200).await;
    let metrics = get(port, "/metrics").await.1;
    assert!(
        has_line(&metrics, "kmm_agent_proxy_connected 1"),
        "{metrics}"
    );
}
