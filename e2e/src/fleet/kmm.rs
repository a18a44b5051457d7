//! kmm-fleet's own components in the local fleet: `kmm-hub` on the hub, one
//! `kmm-spoke-proxy` per spoke and one `kmm-node-agent` per simulated node (simulated
//! kernel backend), wired the way the add-on deploys them:
//!
//! * the hub runs as Pods on the hub's real node from the images the fleet builds,
//!   installed with `kubectl apply -k` of `addon-manifests/hub` ([`hub_install`]);
//! * the hub creates its CA Secret; until the add-on packaging exists, the environment
//!   issues each proxy's client certificate from that CA with the subject OCM's add-on
//!   registration gives it;
//! * each proxy runs as its ServiceAccount with the least-privilege RBAC of
//!   `addon-manifests/spoke-proxy/rbac.yaml`, not as an administrator;
//! * each agent authenticates with a ServiceAccount token bound to its Node and to the
//!   proxy's audience; its ServiceAccount has no RBAC at all.

use std::path::{Path, PathBuf};
use std::time::Duration;

use k8s_openapi::api::authentication::v1::{BoundObjectReference, TokenRequest, TokenRequestSpec};
use k8s_openapi::api::core::v1::{ConfigMap, Node, Secret, ServiceAccount};
use kmm_runtime::pki::{CertificateAuthority, Leaf};
use kube::api::{Patch, PatchParams, PostParams};
use kube::discovery::{ApiCapabilities, Scope};
use kube::{Api, Client, Discovery, ResourceExt};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use super::{
    ControlPlane, Credentials, MANAGER, Starting, ensure_namespaces, hub_install, wait_for,
    write_kubeconfig,
};
use crate::images;
use crate::process::Tracked;
use crate::{Error, IoContext, Result};

/// The hub's namespace: its CA Secret and the pull secrets modules reference.
pub const HUB_NAMESPACE: &str = "kmm-hub";
/// The add-on's namespace on every spoke.
pub const SPOKE_NAMESPACE: &str = "kmm";
pub const HUB_SERVICE_ACCOUNT: &str = "kmm-hub";
pub const PROXY_SERVICE_ACCOUNT: &str = "kmm-spoke-proxy";
pub const AGENT_SERVICE_ACCOUNT: &str = "kmm-node-agent";
/// Audience of the agents' tokens; the proxy accepts no other.
pub const TOKEN_AUDIENCE: &str = "kmm-spoke-proxy";
const HUB_CA_SECRET: &str = "kmm-hub-ca";
/// Modules carrying this label belong to a hub started by a test, not the fleet's.
pub const TEST_HUB_LABEL: &str = "test.kmm.sigs.x-k8s.io/hub";
const AGENT_CA_CONFIG_MAP: &str = "kmm-agent-ca";
/// The agent name in the proxy's certificate subject (OCM's `<addon>-agent` default).
const PROXY_AGENT_NAME: &str = "kmm-agent";
const TOKEN_LIFETIME: i64 = 7 * 24 * 3600;
const CLIENT_CERT_LIFETIME: Duration = Duration::from_secs(30 * 24 * 3600);

// Port offsets in each cluster's block (see `Ports`).
const PROXY_AGENTS: u16 = 90;
const PROXY_METRICS: u16 = 91;
const AGENT_METRICS_FIRST: u16 = 92;
/// Agents' metrics ports must stay inside the cluster's block of 100.
pub const MAX_NODES_PER_SPOKE: usize = 8;

/// Where kmm-fleet's components of a running fleet listen, and their files.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Kmm {
    /// `host:port` of the hub's gRPC endpoint for proxies: the NodePort of the Service
    /// that selects the leading replica, on the hub's real node.
    pub hub_grpc: String,
    /// The hub CA's certificate (the proxies trust the hub's serving certificate by it).
    pub hub_ca: PathBuf,
    pub proxies: Vec<Proxy>,
    pub agents: Vec<Agent>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Proxy {
    pub cluster: String,
    /// Process name in `State::processes`.
    pub process: String,
    /// `host:port` agents connect to.
    pub agent_endpoint: String,
    pub metrics_port: u16,
    /// The proxy's serving CA, as published in its ConfigMap.
    pub agent_ca: PathBuf,
    /// Directory holding the proxy's hub client certificate (`tls.crt`, `tls.key`).
    pub client_cert_dir: PathBuf,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Agent {
    pub cluster: String,
    pub node: String,
    /// Process name in `State::processes`.
    pub process: String,
    pub metrics_port: u16,
    /// The node's directory: `kernel/` (simulated kernel), `run/` (agent state),
    /// `cache/`, `firmware/`, `token`.
    pub dir: PathBuf,
}

/// The kmm-fleet binaries the fleet runs as processes, built by `cargo build` in this
/// workspace.
#[derive(Debug, Clone)]
pub struct Binaries {
    pub proxy: PathBuf,
    pub agent: PathBuf,
}

impl Binaries {
    /// `$KMM_BIN_DIR`, else the workspace's `target/debug`. Fails naming the missing
    /// binary and the command that builds it.
    pub fn locate() -> Result<Self> {
        let dir = std::env::var_os("KMM_BIN_DIR").map_or_else(
            || {
                std::env::var_os("CARGO_TARGET_DIR")
                    .map_or_else(
                        || Path::new(env!("CARGO_MANIFEST_DIR")).join("../target"),
                        PathBuf::from,
                    )
                    .join("debug")
            },
            PathBuf::from,
        );
        let find = |name: &str| {
            let path = dir.join(name);
            if path.is_file() {
                Ok(path)
            } else {
                Err(Error::Invalid(format!(
                    "{} is missing; build it with `cargo build --bins` (`cargo xtask env up` \
                     and `cargo xtask test` do)",
                    path.display()
                )))
            }
        };
        Ok(Self {
            proxy: find("kmm-spoke-proxy")?,
            agent: find("kmm-node-agent")?,
        })
    }

    /// Copies the binaries into the fleet's own directory, so that rebuilding the
    /// workspace never changes (or, for the liveness check, kills) a running fleet.
    fn copy_to(self, dir: &Path) -> Result<Self> {
        std::fs::create_dir_all(dir).context(|| format!("creating {}", dir.display()))?;
        let copy = |from: &Path| {
            let to = dir.join(from.file_name().unwrap_or_default());
            std::fs::copy(from, &to)
                .context(|| format!("copying {} to {}", from.display(), to.display()))?;
            Ok::<_, Error>(to)
        };
        Ok(Self {
            proxy: copy(&self.proxy)?,
            agent: copy(&self.agent)?,
        })
    }
}

impl Starting {
    /// Starts the hub, then each spoke's proxy and agents, each waited on until ready.
    pub(super) async fn kmm(&mut self, hub: &ControlPlane, spokes: &[ControlPlane]) -> Result<()> {
        let kmm_dir = self.dir.join("kmm");
        std::fs::create_dir_all(&kmm_dir).context(|| format!("creating {}", kmm_dir.display()))?;
        let binaries = Binaries::locate()?.copy_to(&kmm_dir.join("bin"))?;

        // kmm-hub as a user installs it: images in the registry, `kubectl apply -k`.
        let registry = self.state.registry.clone();
        let built = tokio::task::spawn_blocking(move || {
            images::build(&images::Options::new(Some(registry)))
        })
        .await
        .map_err(|e| Error::Invalid(format!("building the images panicked: {e}")))??;
        let tag = built
            .images
            .first()
            .and_then(|i| i.reference.rsplit_once(':'))
            .map(|(_, tag)| tag.to_owned())
            .ok_or_else(|| Error::Invalid("no image was built".into()))?;
        let node_ip = self
            .state
            .cluster(&hub.name)?
            .real_nodes
            .first()
            .map(|n| n.ip.to_string())
            .ok_or_else(|| {
                Error::Invalid("kmm-hub runs on the hub's real node, and there is none".into())
            })?;
        let installed = std::time::Instant::now();
        hub_install::apply(
            self.toolchain.bin("kubectl"),
            &hub.kubeconfig,
            &kmm_dir.join("hub-install"),
            &hub_install::Overlay {
                registry: &self.state.node_registry,
                tag: &tag,
                node_ip: &node_ip,
            },
        )?;
        let leader = hub_install::wait_installed(&hub.client).await?;
        println!(
            "fleet: kmm-hub installed (kubectl apply -k) and ready in {:.1}s; leader {leader}",
            installed.elapsed().as_secs_f64()
        );
        let hub_grpc = format!("{node_ip}:{}", hub_install::GRPC_NODE_PORT);
        let ca = hub_ca(&hub.client).await?;
        let hub_ca = kmm_dir.join("hub-ca.crt");
        std::fs::write(&hub_ca, ca.cert_pem())
            .context(|| format!("writing {}", hub_ca.display()))?;

        let mut kmm = Kmm {
            hub_grpc,
            hub_ca,
            proxies: vec![],
            agents: vec![],
        };
        for spoke in spokes {
            let proxy = self.proxy(spoke, &binaries, &ca, &kmm).await?;
            let agents = self.agents(spoke, &binaries, &proxy).await?;
            kmm.proxies.push(proxy);
            kmm.agents.extend(agents);
            self.state.kmm = Some(kmm.clone());
            self.state.save(&self.dir)?;
        }
        Ok(())
    }

    async fn proxy(
        &mut self,
        spoke: &ControlPlane,
        binaries: &Binaries,
        hub_ca: &CertificateAuthority,
        kmm: &Kmm,
    ) -> Result<Proxy> {
        let dir = spoke.dir.join("kmm-spoke-proxy");
        std::fs::create_dir_all(&dir).context(|| format!("creating {}", dir.display()))?;
        ensure_namespaces(&spoke.client, &[SPOKE_NAMESPACE]).await?;
        apply_manifests(
            &spoke.client,
            &read_workspace_file("addon-manifests/spoke-proxy/rbac.yaml")?,
        )
        .await?;
        ensure_service_account(&spoke.client, AGENT_SERVICE_ACCOUNT).await?;

        let token = request_token(
            &spoke.client,
            SPOKE_NAMESPACE,
            PROXY_SERVICE_ACCOUNT,
            None,
            None,
        )
        .await?;
        let kubeconfig = dir.join("kubeconfig");
        write_kubeconfig(
            &kubeconfig,
            &spoke.name,
            &spoke.server,
            &spoke.ca.pem,
            Credentials::Token(&token),
        )?;
        let client_cert_dir = dir.join("hub-client-cert");
        write_proxy_client_certificate(hub_ca, &spoke.name, &client_cert_dir)?;

        let agent_endpoint = format!(
            "127.0.0.1:{}",
            self.ports.cluster(spoke.index, PROXY_AGENTS)
        );
        let metrics_port = self.ports.cluster(spoke.index, PROXY_METRICS);
        let process = format!("{}/kmm-spoke-proxy", spoke.name);
        let tracked = self.start_program(
            &process,
            &binaries.proxy,
            vec![
                "run".into(),
                format!("--cluster-name={}", spoke.name),
                format!("--namespace={SPOKE_NAMESPACE}"),
                format!("--hub-address=https://{}", kmm.hub_grpc),
                format!("--hub-ca-file={}", kmm.hub_ca.display()),
                format!(
                    "--client-cert-file={}",
                    client_cert_dir.join("tls.crt").display()
                ),
                format!(
                    "--client-key-file={}",
                    client_cert_dir.join("tls.key").display()
                ),
                format!("--agent-addr={agent_endpoint}"),
                format!("--metrics-addr=127.0.0.1:{metrics_port}"),
            ],
            &[("KUBECONFIG", kubeconfig.display().to_string())],
        )?;
        wait_ready(&tracked, metrics_port).await?;
        let agent_ca = dir.join("agent-ca.crt");
        let config_maps: Api<ConfigMap> = Api::namespaced(spoke.client.clone(), SPOKE_NAMESPACE);
        let published = || {
            let config_maps = config_maps.clone();
            async move {
                config_maps
                    .get_opt(AGENT_CA_CONFIG_MAP)
                    .await
                    .ok()
                    .flatten()
                    .and_then(|cm| cm.data?.remove("ca.crt"))
            }
        };
        wait_for(&tracked, "the agents' CA ConfigMap", || async {
            published().await.is_some()
        })
        .await?;
        let ca_pem = published().await.ok_or_else(|| {
            Error::Invalid(format!(
                "ConfigMap {SPOKE_NAMESPACE}/{AGENT_CA_CONFIG_MAP} vanished"
            ))
        })?;
        std::fs::write(&agent_ca, ca_pem).context(|| format!("writing {}", agent_ca.display()))?;
        Ok(Proxy {
            cluster: spoke.name.clone(),
            process,
            agent_endpoint,
            metrics_port,
            agent_ca,
            client_cert_dir,
        })
    }

    async fn agents(
        &mut self,
        spoke: &ControlPlane,
        binaries: &Binaries,
        proxy: &Proxy,
    ) -> Result<Vec<Agent>> {
        // Real nodes get an agent too, at the kernel they report: the proxy has every
        // node of the cluster confirm a module's unload.
        let cluster = self.state.cluster(&spoke.name)?;
        let mut nodes = cluster.nodes.clone();
        nodes.extend(cluster.real_nodes.iter().map(|n| super::SimulatedNode {
            name: n.name.clone(),
            kernel: n.kernel.clone(),
        }));
        if nodes.len() > MAX_NODES_PER_SPOKE {
            return Err(Error::Invalid(format!(
                "--nodes-per-spoke {} is more than the {MAX_NODES_PER_SPOKE} node agents a \
                 spoke's port block holds",
                nodes.len()
            )));
        }
        let node_api: Api<Node> = Api::all(spoke.client.clone());
        let mut agents = vec![];
        let mut started = vec![];
        for (i, node) in nodes.iter().enumerate() {
            let dir = spoke.dir.join("nodes").join(&node.name);
            for sub in ["kernel", "run", "cache", "firmware"] {
                std::fs::create_dir_all(dir.join(sub))
                    .context(|| format!("creating {}", dir.join(sub).display()))?;
            }
            let uid = node_api.get(&node.name).await?.uid().unwrap_or_default();
            let token = request_token(
                &spoke.client,
                SPOKE_NAMESPACE,
                AGENT_SERVICE_ACCOUNT,
                Some(TOKEN_AUDIENCE),
                Some((&node.name, &uid)),
            )
            .await?;
            let token_file = dir.join("token");
            std::fs::write(&token_file, token)
                .context(|| format!("writing {}", token_file.display()))?;
            let offset = AGENT_METRICS_FIRST + u16::try_from(i).unwrap_or(u16::MAX);
            let metrics_port = self.ports.cluster(spoke.index, offset);
            let process = format!("{}/kmm-node-agent/{}", spoke.name, node.name);
            let tracked = self.start_program(
                &process,
                &binaries.agent,
                agent_args(&dir, &node.name, &node.kernel, proxy, metrics_port),
                &[],
            )?;
            started.push((tracked, metrics_port));
            agents.push(Agent {
                cluster: spoke.name.clone(),
                node: node.name.clone(),
                process,
                metrics_port,
                dir,
            });
        }
        for (tracked, port) in &started {
            wait_ready(tracked, *port).await?;
        }
        Ok(agents)
    }
}

/// The agent's command line; also used to restart it on a new kernel.
pub fn agent_args(
    dir: &Path,
    node: &str,
    kernel: &str,
    proxy: &Proxy,
    metrics_port: u16,
) -> Vec<String> {
    vec![
        "run".into(),
        format!("--node-name={node}"),
        format!("--proxy-address=https://{}", proxy.agent_endpoint),
        format!("--proxy-ca-file={}", proxy.agent_ca.display()),
        format!("--token-file={}", dir.join("token").display()),
        "--kernel-backend=simulated".into(),
        format!("--simulated-dir={}", dir.join("kernel").display()),
        format!("--simulated-kernel={kernel}"),
        format!("--state-dir={}", dir.join("run").display()),
        format!("--cache-dir={}", dir.join("cache").display()),
        format!("--firmware-dir={}", dir.join("firmware").display()),
        format!("--metrics-addr=127.0.0.1:{metrics_port}"),
        "--retry-seconds=1".into(),
    ]
}

/// Waits until a kmm component's `/readyz` (plain HTTP) answers ok.
pub(crate) async fn wait_ready(process: &Tracked, port: u16) -> Result<()> {
    wait_for(process, &format!("/readyz on port {port}"), || async move {
        super::http_get_plain(super::LOOPBACK, port, "/readyz")
            .await
            .is_some_and(|body| body.trim() == "ok")
    })
    .await
}

/// The hub's CA, read from the Secret the hub created.
async fn hub_ca(hub: &Client) -> Result<CertificateAuthority> {
    let secrets: Api<Secret> = Api::namespaced(hub.clone(), HUB_NAMESPACE);
    let secret = secrets.get(HUB_CA_SECRET).await?;
    let field = |key: &str| {
        secret
            .data
            .as_ref()
            .and_then(|d| d.get(key))
            .map(|v| String::from_utf8_lossy(&v.0).into_owned())
            .ok_or_else(|| {
                Error::Invalid(format!(
                    "Secret {HUB_NAMESPACE}/{HUB_CA_SECRET} has no {key}"
                ))
            })
    };
    CertificateAuthority::from_pem(&field("tls.crt")?, &field("tls.key")?)
        .map_err(|e| Error::Invalid(format!("Secret {HUB_NAMESPACE}/{HUB_CA_SECRET}: {e}")))
}

/// The subject OCM's add-on registration gives the kmm agent of `cluster`.
pub fn proxy_subject(cluster: &str) -> (String, Vec<String>) {
    (
        format!(
            "system:open-cluster-management:cluster:{cluster}:addon:kmm:agent:{PROXY_AGENT_NAME}"
        ),
        vec![
            format!("system:open-cluster-management:cluster:{cluster}:addon:kmm"),
            "system:open-cluster-management:addon:kmm".to_owned(),
            "system:authenticated".to_owned(),
        ],
    )
}

/// Writes `tls.crt` and `tls.key` for `cluster`'s proxy into `dir`, as OCM would mount
/// them; rewriting them is how a test renews the certificate.
pub fn write_proxy_client_certificate(
    hub_ca: &CertificateAuthority,
    cluster: &str,
    dir: &Path,
) -> Result<()> {
    let (common_name, organizations) = proxy_subject(cluster);
    let issued = hub_ca
        .issue(&Leaf::client(
            &common_name,
            &organizations,
            CLIENT_CERT_LIFETIME,
        ))
        .map_err(|e| Error::Invalid(format!("issuing {cluster}'s proxy certificate: {e}")))?;
    std::fs::create_dir_all(dir).context(|| format!("creating {}", dir.display()))?;
    // The key first: a proxy that sees the new certificate must find its key.
    let key = dir.join("tls.key");
    std::fs::write(&key, issued.key_pem.as_bytes())
        .context(|| format!("writing {}", key.display()))?;
    let cert = dir.join("tls.crt");
    std::fs::write(&cert, &issued.cert_pem).context(|| format!("writing {}", cert.display()))
}

async fn ensure_service_account(client: &Client, name: &str) -> Result<()> {
    let api: Api<ServiceAccount> = Api::namespaced(client.clone(), SPOKE_NAMESPACE);
    let sa = json!({ "apiVersion": "v1", "kind": "ServiceAccount", "metadata": { "name": name } });
    api.patch(
        name,
        &PatchParams::apply(MANAGER).force(),
        &Patch::Apply(&sa),
    )
    .await?;
    Ok(())
}

/// A token of ServiceAccount `namespace/name`, optionally for one audience and bound to
/// a Node (`(name, uid)`), as kubelet projects it into a pod on that node.
pub async fn request_token(
    client: &Client,
    namespace: &str,
    name: &str,
    audience: Option<&str>,
    node: Option<(&str, &str)>,
) -> Result<String> {
    let api: Api<ServiceAccount> = Api::namespaced(client.clone(), namespace);
    let request = TokenRequest {
        spec: TokenRequestSpec {
            audiences: audience.map(|a| vec![a.to_owned()]).unwrap_or_default(),
            expiration_seconds: Some(TOKEN_LIFETIME),
            bound_object_ref: node.map(|(name, uid)| BoundObjectReference {
                api_version: Some("v1".into()),
                kind: Some("Node".into()),
                name: Some(name.into()),
                uid: Some(uid.into()),
            }),
        },
        ..Default::default()
    };
    api.create_token_request(name, &PostParams::default(), &request)
        .await?
        .status
        .map(|s| s.token)
        .ok_or_else(|| Error::Invalid(format!("the TokenRequest for {name} returned no token")))
}

fn read_workspace_file(relative: &str) -> Result<String> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join(relative);
    std::fs::read_to_string(&path).context(|| format!("reading {}", path.display()))
}

/// Server-side applies every object of a multi-document YAML manifest, finding each
/// kind's resource through discovery.
pub async fn apply_manifests(client: &Client, yaml: &str) -> Result<()> {
    let discovery = Discovery::new(client.clone()).run().await?;
    for document in serde_yaml_ng::Deserializer::from_str(yaml) {
        let object: Value =
            Value::deserialize(document).map_err(|e| Error::Invalid(format!("manifest: {e}")))?;
        if object.is_null() {
            continue;
        }
        let (api_version, kind) = (
            object["apiVersion"].as_str().unwrap_or_default(),
            object["kind"].as_str().unwrap_or_default(),
        );
        let name = object["metadata"]["name"].as_str().unwrap_or_default();
        let (group, version) = api_version.split_once('/').unwrap_or(("", api_version));
        let gvk = kube::api::GroupVersionKind::gvk(group, version, kind);
        let (resource, capabilities): (_, ApiCapabilities) =
            discovery.resolve_gvk(&gvk).ok_or_else(|| {
                Error::Invalid(format!("manifest: unknown kind {api_version} {kind}"))
            })?;
        let api: Api<kube::api::DynamicObject> = match capabilities.scope {
            Scope::Cluster => Api::all_with(client.clone(), &resource),
            Scope::Namespaced => Api::namespaced_with(
                client.clone(),
                object["metadata"]["namespace"]
                    .as_str()
                    .unwrap_or(SPOKE_NAMESPACE),
                &resource,
            ),
        };
        api.patch(
            name,
            &PatchParams::apply(MANAGER).force(),
            &Patch::Apply(&object),
        )
        .await?;
    }
    Ok(())
}

/// The `/metrics` text of a kmm component on loopback.
pub async fn metrics(port: u16) -> Result<String> {
    super::http_get_plain(super::LOOPBACK, port, "/metrics")
        .await
        .ok_or_else(|| Error::Invalid(format!("no /metrics on port {port}")))
}

/// Waits until the kmm component on `port` answers `/readyz` with ok.
pub async fn wait_ready_port(port: u16, timeout: Duration) -> Result<()> {
    crate::fixture::wait_until(&format!("/readyz on port {port}"), timeout, || async move {
        match super::http_get_plain(super::LOOPBACK, port, "/readyz").await {
            Some(body) if body.trim() == "ok" => Ok(()),
            Some(body) => Err(body),
            None => Err("not ready or not answering".to_owned()),
        }
    })
    .await
}
