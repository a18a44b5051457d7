//! Test peers and helpers for running the real kmm-spoke-proxy binary against the
//! fleet's spoke1 kube-apiserver: a TLS Hub peer, node agent clients with real
//! TokenRequest-issued tokens, the proxy process itself under the RBAC of rbac.yaml.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail};
use k8s_openapi::api::authentication::v1::{BoundObjectReference, TokenRequest, TokenRequestSpec};
use k8s_openapi::api::core::v1::{ConfigMap, Namespace, Node, ServiceAccount};
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, Role, RoleBinding};
use kmm_e2e::fixture::Fleet;
use kmm_proto::v1::agent_client::AgentClient;
use kmm_proto::v1::hub_server::{Hub, HubServer};
use kmm_proto::v1::{
    AgentHello, AgentInstruction, AgentMessage, DesiredModules, HubMessage, IntentSnapshot,
    ModuleEvent, ModuleNodeStatus, ProxyMessage, agent_instruction, agent_message, hub_message,
    proxy_message,
};
use kmm_runtime::pki::{CertificateAuthority, Leaf};
use kube::api::{DeleteParams, ObjectMeta, Patch, PatchParams, PostParams};
use kube::{Api, Client};
use tokio::sync::{mpsc, oneshot};
use tokio_stream::wrappers::{ReceiverStream, TcpListenerStream, UnboundedReceiverStream};
use tonic::transport::{Certificate, ClientTlsConfig, Endpoint, Identity, Server, ServerTlsConfig};
use tonic::{Request, Response, Status, Streaming};

pub const WAIT: Duration = Duration::from_secs(60);
pub const AUDIENCE: &str = "kmm-spoke-proxy";
const AGENT_NAMESPACE: &str = "kmm";
const AGENT_SERVICE_ACCOUNT: &str = "kmm-node-agent";

pub fn agent_common_name(agent: &str) -> String {
    format!("system:open-cluster-management:cluster:spoke1:addon:kmm:agent:{agent}")
}

/// A port free at the time of the call.
pub fn free_addr() -> SocketAddr {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind port 0");
    listener.local_addr().expect("local addr")
}

/// The hub's CA, serving certificate and the proxy's client certificate files.
pub struct HubPki {
    pub ca: CertificateAuthority,
    pub dir: tempfile::TempDir,
    server_cert: String,
    server_key: String,
}

impl HubPki {
    pub fn new(agent: &str) -> Result<Self> {
        let ca = CertificateAuthority::generate("test-hub-ca", Duration::from_secs(3600))?;
        let server = ca.issue(&Leaf::server(
            "kmm-hub",
            &["localhost".to_string()],
            &["127.0.0.1".parse()?],
            Duration::from_secs(3600),
        ))?;
        let pki = Self {
            dir: tempfile::tempdir()?,
            server_cert: server.cert_pem,
            server_key: server.key_pem.to_string(),
            ca,
        };
        std::fs::write(pki.ca_file(), pki.ca.cert_pem())?;
        pki.issue_client(agent)?;
        Ok(pki)
    }

    /// Writes a new client certificate for `agent` the way a renewal replaces files.
    pub fn issue_client(&self, agent: &str) -> Result<()> {
        let client = self.ca.issue(&Leaf::client(
            &agent_common_name(agent),
            &[
                "system:open-cluster-management:cluster:spoke1:addon:kmm".to_string(),
                "system:open-cluster-management:addon:kmm".to_string(),
                "system:authenticated".to_string(),
            ],
            Duration::from_secs(3600),
        ))?;
        std::fs::write(
            self.dir.path().join("tls.key.new"),
            client.key_pem.as_bytes(),
        )?;
        std::fs::write(self.dir.path().join("tls.crt.new"), &client.cert_pem)?;
        std::fs::rename(self.dir.path().join("tls.key.new"), self.key_file())?;
        std::fs::rename(self.dir.path().join("tls.crt.new"), self.cert_file())?;
        Ok(())
    }

    pub fn ca_file(&self) -> PathBuf {
        self.dir.path().join("ca.crt")
    }
    pub fn cert_file(&self) -> PathBuf {
        self.dir.path().join("tls.crt")
    }
    pub fn key_file(&self) -> PathBuf {
        self.dir.path().join("tls.key")
    }
}

/// One Sync stream as the hub peer sees it.
pub struct PeerStream {
    /// DER of the client certificate the proxy presented.
    pub client_cert: Vec<u8>,
    inbound: mpsc::UnboundedReceiver<ProxyMessage>,
    outbound: mpsc::UnboundedSender<Result<HubMessage, Status>>,
}

impl PeerStream {
    pub async fn next(&mut self) -> Result<proxy_message::Message> {
        let message = tokio::time::timeout(WAIT, self.inbound.recv())
            .await
            .context("no message from the proxy in time")?
            .ok_or_else(|| anyhow!("the proxy closed the stream"))?;
        message.message.ok_or_else(|| anyhow!("empty ProxyMessage"))
    }

    pub fn send(&self, snapshot: IntentSnapshot) -> Result<()> {
        self.outbound
            .send(Ok(HubMessage {
                message: Some(hub_message::Message::Intents(snapshot)),
            }))
            .map_err(|_| anyhow!("the stream to the proxy is gone"))
    }

    /// Reads status reports until one contains an entry for which `pred` holds.
    pub async fn wait_status(
        &mut self,
        what: &str,
        pred: impl Fn(&ModuleNodeStatus) -> bool,
    ) -> Result<ModuleNodeStatus> {
        let deadline = Instant::now() + WAIT;
        let mut seen = Vec::new();
        while Instant::now() < deadline {
            if let proxy_message::Message::Status(report) = self.next().await? {
                if let Some(found) = report.statuses.iter().find(|s| pred(s)) {
                    return Ok(found.clone());
                }
                seen.extend(report.statuses);
            }
        }
        bail!("no status {what}; saw {seen:?}")
    }

    pub fn client_cert_contains(&self, text: &str) -> bool {
        self.client_cert
            .windows(text.len())
            .any(|w| w == text.as_bytes())
    }
}

struct PeerService {
    streams: mpsc::UnboundedSender<PeerStream>,
}

#[tonic::async_trait]
impl Hub for PeerService {
    type SyncStream = UnboundedReceiverStream<Result<HubMessage, Status>>;

    async fn sync(
        &self,
        request: Request<Streaming<ProxyMessage>>,
    ) -> Result<Response<Self::SyncStream>, Status> {
        let client_cert = request
            .peer_certs()
            .and_then(|certs| certs.first().map(|c| c.to_vec()))
            .ok_or_else(|| Status::unauthenticated("no client certificate"))?;
        let mut inbound = request.into_inner();
        let (itx, irx) = mpsc::unbounded_channel();
        tokio::spawn(async move {
            while let Ok(Some(message)) = inbound.message().await {
                if itx.send(message).is_err() {
                    break;
                }
            }
        });
        let (otx, orx) = mpsc::unbounded_channel();
        let _ = self.streams.send(PeerStream {
            client_cert,
            inbound: irx,
            outbound: otx,
        });
        Ok(Response::new(UnboundedReceiverStream::new(orx)))
    }
}

/// A Hub server on TLS that requires client certificates signed by the hub CA.
pub struct HubPeer {
    pub addr: SocketAddr,
    streams: mpsc::UnboundedReceiver<PeerStream>,
    stop: Option<oneshot::Sender<()>>,
    server: tokio::task::JoinHandle<()>,
}

impl HubPeer {
    pub async fn start(pki: &HubPki, addr: SocketAddr) -> Result<Self> {
        let listener = tokio::net::TcpListener::bind(addr).await?;
        let addr = listener.local_addr()?;
        let (tx, streams) = mpsc::unbounded_channel();
        let (stop, stopped) = oneshot::channel::<()>();
        let tls = ServerTlsConfig::new()
            .identity(Identity::from_pem(&pki.server_cert, &pki.server_key))
            .client_ca_root(Certificate::from_pem(pki.ca.cert_pem()));
        let router = Server::builder()
            .tls_config(tls)?
            .add_service(HubServer::new(PeerService { streams: tx }));
        let server = tokio::spawn(async move {
            let _ = router
                .serve_with_incoming_shutdown(TcpListenerStream::new(listener), async {
                    let _ = stopped.await;
                })
                .await;
        });
        Ok(Self {
            addr,
            streams,
            stop: Some(stop),
            server,
        })
    }

    pub fn address(&self) -> String {
        format!("https://127.0.0.1:{}", self.addr.port())
    }

    pub async fn next_stream(&mut self) -> Result<PeerStream> {
        tokio::time::timeout(WAIT, self.streams.recv())
            .await
            .context("the proxy opened no stream in time")?
            .ok_or_else(|| anyhow!("hub peer stopped"))
    }

    /// Stops listening and waits until the server is gone. Streams end when their
    /// `PeerStream` is dropped.
    pub async fn stop(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        let _ = (&mut self.server).await;
    }
}

/// The real proxy binary, stopped with SIGTERM.
pub struct ProxyProcess {
    child: Child,
    pub agent_addr: SocketAddr,
    pub metrics_addr: SocketAddr,
    pub log: PathBuf,
}

impl ProxyProcess {
    pub fn start(
        kubeconfig: &Path,
        namespace: &str,
        hub_address: &str,
        pki: &HubPki,
        log_dir: &Path,
    ) -> Result<Self> {
        Self::start_with(kubeconfig, namespace, hub_address, pki, log_dir, &[])
    }

    /// [`ProxyProcess::start`] with `extra` arguments.
    pub fn start_with(
        kubeconfig: &Path,
        namespace: &str,
        hub_address: &str,
        pki: &HubPki,
        log_dir: &Path,
        extra: &[&str],
    ) -> Result<Self> {
        let agent_addr = free_addr();
        let metrics_addr = free_addr();
        let log = log_dir.join("proxy.log");
        let log_file = std::fs::File::create(&log)?;
        let child = Command::new(kmm_e2e::binaries::debug(
            "kmm-spoke-proxy",
            "kmm-spoke-proxy",
        )?)
        .env("KUBECONFIG", kubeconfig)
        .env("RUST_LOG", "info,kmm_spoke_proxy=debug")
        .args(["run", "--hub-address", hub_address])
        .arg("--hub-ca-file")
        .arg(pki.ca_file())
        .arg("--client-cert-file")
        .arg(pki.cert_file())
        .arg("--client-key-file")
        .arg(pki.key_file())
        .args(["--namespace", namespace, "--cluster-name", "spoke1"])
        .args(["--agent-addr", &agent_addr.to_string()])
        .args(["--metrics-addr", &metrics_addr.to_string()])
        .args([
            "--credentials-poll-seconds",
            "1",
            "--reconnect-initial-ms",
            "100",
        ])
        .args(["--reconnect-max-seconds", "1"])
        .args(extra)
        .stdout(Stdio::null())
        .stderr(log_file)
        .spawn()
        .context("starting kmm-spoke-proxy")?;
        Ok(Self {
            child,
            agent_addr,
            metrics_addr,
            log,
        })
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    async fn get(&self, path: &str) -> Result<String> {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut stream = tokio::net::TcpStream::connect(self.metrics_addr).await?;
        stream
            .write_all(
                format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").as_bytes(),
            )
            .await?;
        let mut response = String::new();
        stream.read_to_string(&mut response).await?;
        Ok(response)
    }

    /// Waits for /readyz: the stream to the hub is open (after the Nodes were listed).
    pub async fn wait_ready(&mut self) -> Result<()> {
        let deadline = Instant::now() + WAIT;
        while Instant::now() < deadline {
            if let Some(status) = self.child.try_wait()? {
                bail!("kmm-spoke-proxy exited with {status}:\n{}", self.log_text());
            }
            if let Ok(response) = self.get("/readyz").await
                && response.starts_with("HTTP/1.1 200")
            {
                return Ok(());
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        bail!("kmm-spoke-proxy not ready in time:\n{}", self.log_text())
    }

    pub async fn metrics(&self) -> Result<String> {
        self.get("/metrics").await
    }

    /// SIGTERM, then the exit status must be success.
    pub async fn stop(mut self) -> Result<()> {
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(self.child.id() as i32),
            nix::sys::signal::Signal::SIGTERM,
        )?;
        let deadline = Instant::now() + Duration::from_secs(20);
        while Instant::now() < deadline {
            if let Some(status) = self.child.try_wait()? {
                if !status.success() {
                    bail!("kmm-spoke-proxy exited with {status}:\n{}", self.log_text());
                }
                return Ok(());
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        bail!(
            "kmm-spoke-proxy did not stop on SIGTERM:\n{}",
            self.log_text()
        )
    }
}

impl Drop for ProxyProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The spoke1 client, its Nodes and a fresh namespace for one test.
pub struct Spoke {
    pub client: Client,
    pub kubeconfig: PathBuf,
    pub namespace: String,
    pub nodes: Vec<Node>,
    pub dir: tempfile::TempDir,
}

impl Spoke {
    pub async fn get(prefix: &str) -> Result<Self> {
        let fleet = Fleet::get()
            .await
            .map_err(|e| anyhow!("the spoke-proxy tests need the local fleet: {e}"))?;
        let client = fleet.spoke("spoke1")?.clone();
        let kubeconfig = fleet.state.cluster("spoke1")?.kubeconfig.clone();
        let namespace = kmm_e2e::fixture::TempNamespace::create(&client, prefix)
            .await?
            .name;
        let mut nodes = Api::<Node>::all(client.clone())
            .list(&Default::default())
            .await?
            .items;
        nodes.sort_by(|a, b| a.metadata.name.cmp(&b.metadata.name));
        if nodes.len() < 2 {
            bail!("spoke1 has {} nodes; the tests need two", nodes.len());
        }
        Ok(Self {
            client,
            kubeconfig,
            namespace,
            nodes,
            dir: tempfile::tempdir()?,
        })
    }

    pub fn node_name(&self, i: usize) -> &str {
        self.nodes[i].metadata.name.as_deref().unwrap_or_default()
    }

    pub fn kernel(&self, i: usize) -> String {
        self.nodes[i]
            .status
            .as_ref()
            .and_then(|s| s.node_info.as_ref())
            .map(|n| n.kernel_version.clone())
            .unwrap_or_default()
    }

    /// Applies the ServiceAccounts and RBAC of the add-on's AddOnTemplate into the test
    /// namespace and writes a kubeconfig that speaks as the proxy's ServiceAccount, so
    /// the proxy runs with exactly the permissions OCM gives it.
    pub async fn proxy_kubeconfig(&self) -> Result<PathBuf> {
        let text = std::fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../addon-manifests/addon/addon-template.yaml"
        ))?;
        let template: serde_json::Value = serde_yaml_ng::from_str(&text)?;
        let rbac = template["spec"]["agentSpec"]["workload"]["manifests"]
            .as_array()
            .context("the AddOnTemplate has manifests")?
            .iter()
            .filter(|m| {
                m["kind"].as_str().is_some_and(|kind| {
                    kind == "ServiceAccount" || kind.ends_with("Role") || kind.ends_with("Binding")
                })
            })
            .cloned()
            .collect::<Vec<_>>();
        let binding = format!("kmm-spoke-proxy-{}", self.namespace);
        let pp = PatchParams::apply("kmm-spoke-proxy-test").force();
        let ns = self.namespace.as_str();
        for mut value in rbac {
            if value["metadata"].get("namespace").is_some() {
                value["metadata"]["namespace"] = ns.into();
            }
            if let Some(subjects) = value["subjects"].as_array_mut() {
                for s in subjects {
                    s["namespace"] = ns.into();
                }
            }
            let name = value["metadata"]["name"]
                .as_str()
                .unwrap_or_default()
                .to_owned();
            match value["kind"].as_str() {
                Some("ServiceAccount") => {
                    let o: ServiceAccount = serde_json::from_value(value)?;
                    Api::<ServiceAccount>::namespaced(self.client.clone(), ns)
                        .patch(&name, &pp, &Patch::Apply(&o))
                        .await?;
                }
                Some("ClusterRole") => {
                    let o: ClusterRole = serde_json::from_value(value)?;
                    Api::<ClusterRole>::all(self.client.clone())
                        .patch(&name, &pp, &Patch::Apply(&o))
                        .await?;
                }
                Some("ClusterRoleBinding") => {
                    value["metadata"]["name"] = binding.clone().into();
                    let o: ClusterRoleBinding = serde_json::from_value(value)?;
                    Api::<ClusterRoleBinding>::all(self.client.clone())
                        .patch(&binding, &pp, &Patch::Apply(&o))
                        .await?;
                }
                Some("Role") => {
                    let o: Role = serde_json::from_value(value)?;
                    Api::<Role>::namespaced(self.client.clone(), ns)
                        .patch(&name, &pp, &Patch::Apply(&o))
                        .await?;
                }
                Some("RoleBinding") => {
                    let o: RoleBinding = serde_json::from_value(value)?;
                    Api::<RoleBinding>::namespaced(self.client.clone(), ns)
                        .patch(&name, &pp, &Patch::Apply(&o))
                        .await?;
                }
                other => bail!("rbac.yaml: unexpected kind {other:?}"),
            }
        }
        let token = Api::<ServiceAccount>::namespaced(self.client.clone(), ns)
            .create_token_request(
                "kmm-spoke-proxy",
                &PostParams::default(),
                &TokenRequest {
                    spec: TokenRequestSpec {
                        audiences: vec![],
                        expiration_seconds: Some(3600),
                        bound_object_ref: None,
                    },
                    ..Default::default()
                },
            )
            .await?
            .status
            .ok_or_else(|| anyhow!("TokenRequest without status"))?
            .token;
        let token_file = self.dir.path().join("proxy.token");
        std::fs::write(&token_file, token)?;
        let admin: serde_json::Value =
            serde_yaml_ng::from_str(&std::fs::read_to_string(&self.kubeconfig)?)?;
        let cluster = admin["clusters"][0]["cluster"].clone();
        let kubeconfig = serde_json::json!({
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "spoke1", "cluster": cluster}],
            "users": [{"name": "kmm-spoke-proxy", "user": {"tokenFile": token_file}}],
            "contexts": [{"name": "proxy", "context": {"cluster": "spoke1", "user": "kmm-spoke-proxy"}}],
            "current-context": "proxy",
        });
        let path = self.dir.path().join("proxy.kubeconfig");
        std::fs::write(&path, serde_yaml_ng::to_string(&kubeconfig)?)?;
        Ok(path)
    }

    /// A token of `service_account` in `namespace` bound to node `i`, for `audience`.
    pub async fn token(
        &self,
        namespace: &str,
        service_account: &str,
        i: usize,
        audience: &str,
    ) -> Result<String> {
        let node = &self.nodes[i];
        let request = TokenRequest {
            spec: TokenRequestSpec {
                audiences: vec![audience.to_owned()],
                expiration_seconds: Some(3600),
                bound_object_ref: Some(BoundObjectReference {
                    api_version: Some("v1".into()),
                    kind: Some("Node".into()),
                    name: node.metadata.name.clone(),
                    uid: node.metadata.uid.clone(),
                }),
            },
            ..Default::default()
        };
        Ok(
            Api::<ServiceAccount>::namespaced(self.client.clone(), namespace)
                .create_token_request(service_account, &PostParams::default(), &request)
                .await?
                .status
                .ok_or_else(|| anyhow!("TokenRequest without status"))?
                .token,
        )
    }

    /// A token of the shared node agent ServiceAccount (kmm/kmm-node-agent), created if
    /// absent and never deleted.
    pub async fn agent_token(&self, i: usize) -> Result<String> {
        let pp = PostParams::default();
        let namespaces: Api<Namespace> = Api::all(self.client.clone());
        if namespaces.get_opt(AGENT_NAMESPACE).await?.is_none() {
            let ns = Namespace {
                metadata: ObjectMeta {
                    name: Some(AGENT_NAMESPACE.into()),
                    ..Default::default()
                },
                ..Default::default()
            };
            ignore_conflict(namespaces.create(&pp, &ns).await)?;
        }
        let accounts: Api<ServiceAccount> = Api::namespaced(self.client.clone(), AGENT_NAMESPACE);
        if accounts.get_opt(AGENT_SERVICE_ACCOUNT).await?.is_none() {
            let sa = ServiceAccount {
                metadata: ObjectMeta {
                    name: Some(AGENT_SERVICE_ACCOUNT.into()),
                    ..Default::default()
                },
                ..Default::default()
            };
            ignore_conflict(accounts.create(&pp, &sa).await)?;
        }
        self.token(AGENT_NAMESPACE, AGENT_SERVICE_ACCOUNT, i, AUDIENCE)
            .await
    }

    pub async fn agent_ca(&self) -> Result<String> {
        let map = Api::<ConfigMap>::namespaced(self.client.clone(), &self.namespace)
            .get("kmm-agent-ca")
            .await?;
        map.data
            .and_then(|d| d.get("ca.crt").cloned())
            .ok_or_else(|| anyhow!("ConfigMap kmm-agent-ca has no ca.crt"))
    }

    pub async fn node_labels(
        &self,
        i: usize,
    ) -> Result<std::collections::BTreeMap<String, String>> {
        Ok(Api::<Node>::all(self.client.clone())
            .get(self.node_name(i))
            .await?
            .metadata
            .labels
            .unwrap_or_default())
    }

    /// Sets (or with `None` removes) a label on node `i`.
    pub async fn set_node_label(&self, i: usize, key: &str, value: Option<&str>) -> Result<()> {
        self.patch_node(i, serde_json::json!({"metadata": {"labels": {key: value}}}))
            .await
    }

    /// Sets node `i`'s taints to `taints` (key, effect), replacing any it had.
    pub async fn set_node_taints(&self, i: usize, taints: &[(&str, &str)]) -> Result<()> {
        let taints: Vec<_> = taints
            .iter()
            .map(|(key, effect)| serde_json::json!({"key": key, "effect": effect}))
            .collect();
        self.patch_node(i, serde_json::json!({"spec": {"taints": taints}}))
            .await
    }

    async fn patch_node(&self, i: usize, patch: serde_json::Value) -> Result<()> {
        Api::<Node>::all(self.client.clone())
            .patch(
                self.node_name(i),
                &PatchParams::default(),
                &Patch::Merge(&patch),
            )
            .await?;
        Ok(())
    }

    /// Removes the test namespace and cluster-scoped binding, and any label of this
    /// test (all named after the namespace) left on the nodes.
    pub async fn cleanup(self) -> Result<()> {
        let binding = format!("kmm-spoke-proxy-{}", self.namespace);
        let _ = Api::<ClusterRoleBinding>::all(self.client.clone())
            .delete(&binding, &DeleteParams::default())
            .await;
        let prefix = format!("kmm.node.kubernetes.io/{}.", self.namespace);
        let selector = format!("kmm-fleet.dev/test-{}", self.namespace);
        let nodes: Api<Node> = Api::all(self.client.clone());
        for node in nodes.list(&Default::default()).await?.items {
            let stale: serde_json::Map<String, serde_json::Value> = node
                .metadata
                .labels
                .unwrap_or_default()
                .into_keys()
                .filter(|k| k.starts_with(&prefix) || *k == selector)
                .map(|k| (k, serde_json::Value::Null))
                .collect();
            if !stale.is_empty() {
                let name = node.metadata.name.unwrap_or_default();
                let patch = serde_json::json!({"metadata": {"labels": stale}});
                nodes
                    .patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
                    .await?;
            }
        }
        Api::<Namespace>::all(self.client.clone())
            .delete(&self.namespace, &DeleteParams::background())
            .await?;
        Ok(())
    }
}

fn ignore_conflict<T>(result: kube::Result<T>) -> Result<()> {
    match result {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(e)) if e.code == 409 => Ok(()),
        Err(e) => Err(e.into()),
    }
}

/// A node agent's end of `Agent.Attach`.
pub struct AgentConn {
    tx: mpsc::Sender<AgentMessage>,
    inbound: Streaming<AgentInstruction>,
}

pub fn hello(node: &str) -> AgentHello {
    AgentHello {
        node_name: node.into(),
        boot_id: "boot-1".into(),
        kernel_release: String::new(),
        agent_version: "test".into(),
        loaded: vec![],
    }
}

impl AgentConn {
    pub async fn attach(
        addr: SocketAddr,
        ca_pem: &str,
        token: Option<&str>,
        hello: AgentHello,
    ) -> std::result::Result<Self, Status> {
        let tls = ClientTlsConfig::new()
            .ca_certificate(Certificate::from_pem(ca_pem))
            .domain_name("127.0.0.1");
        let channel = Endpoint::from_shared(format!("https://127.0.0.1:{}", addr.port()))
            .map_err(|e| Status::internal(e.to_string()))?
            .tls_config(tls)
            .map_err(|e| Status::internal(e.to_string()))?
            .connect()
            .await
            .map_err(|e| Status::unavailable(format!("connect: {e:?}")))?;
        let (tx, rx) = mpsc::channel(16);
        tx.send(AgentMessage {
            message: Some(agent_message::Message::Hello(hello)),
        })
        .await
        .map_err(|_| Status::internal("queue"))?;
        let mut request = Request::new(ReceiverStream::new(rx));
        if let Some(token) = token {
            request.metadata_mut().insert(
                "authorization",
                format!("Bearer {token}")
                    .parse()
                    .map_err(|_| Status::internal("token header"))?,
            );
        }
        let inbound = AgentClient::new(channel)
            .attach(request)
            .await?
            .into_inner();
        Ok(Self { tx, inbound })
    }

    /// The next DesiredModules, or the stream's end/error.
    pub async fn next_desired(&mut self) -> Result<DesiredModules> {
        let message = tokio::time::timeout(WAIT, self.inbound.message())
            .await
            .context("no DesiredModules in time")??
            .ok_or_else(|| anyhow!("the proxy ended the agent stream"))?;
        match message.message {
            Some(agent_instruction::Message::Desired(desired)) => Ok(desired),
            None => bail!("empty AgentInstruction"),
        }
    }

    /// Waits up to `within` for another message; `None` if none came.
    pub async fn quiet_for(&mut self, within: Duration) -> Option<String> {
        match tokio::time::timeout(within, self.inbound.message()).await {
            Err(_) => None,
            Ok(other) => Some(format!("{other:?}")),
        }
    }

    pub async fn send(&self, event: ModuleEvent) -> Result<()> {
        self.tx
            .send(AgentMessage {
                message: Some(agent_message::Message::Event(event)),
            })
            .await
            .map_err(|_| anyhow!("agent stream closed"))
    }
}

/// The certificate (DER) a TLS client verifying with `ca_pem` is served at `addr` now.
pub async fn served_certificate(addr: SocketAddr, ca_pem: &str) -> Result<Vec<u8>> {
    use rustls::pki_types::pem::PemObject as _;
    use rustls::pki_types::{CertificateDer, ServerName};

    let mut roots = rustls::RootCertStore::empty();
    roots.add(CertificateDer::from_pem_slice(ca_pem.as_bytes())?)?;
    let config = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()?
    .with_root_certificates(roots)
    .with_no_client_auth();
    let tcp = tokio::net::TcpStream::connect(addr).await?;
    let tls = tokio_rustls::TlsConnector::from(Arc::new(config))
        .connect(ServerName::try_from("localhost")?, tcp)
        .await?;
    let certificates = tls
        .get_ref()
        .1
        .peer_certificates()
        .context("no certificate served")?;
    Ok(certificates[0].to_vec())
}
