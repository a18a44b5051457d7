//! A cluster's control plane: the fleet's etcd, each cluster's kube-apiserver,
//! kube-controller-manager and kube-scheduler on loopback ports, their kubeconfigs, and
//! the plain HTTP and API helpers every room of the fleet uses to wait on components.

use std::net::{IpAddr, Ipv4Addr};
use std::path::{Path, PathBuf};
use std::time::Instant;

use base64::Engine as _;
use k8s_openapi::api::core::v1::Namespace;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Patch, PatchParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Api, Client};
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::network::SERVICE_CIDR;
use super::ocm::crd_name;
use super::{Cluster, MANAGER, POLL, STARTUP, Starting, wait_for};
use crate::pki::{self, Ca};
use crate::process::Tracked;
use crate::{Error, IoContext, Result};

/// Ports, all on 127.0.0.1: the base port plus fixed offsets; cluster `i` (hub = 0,
/// spokeN = N) gets the block `base + 100 * i`.
#[derive(Debug, Clone, Copy)]
pub(super) struct Ports {
    pub(super) base: u16,
}

impl Ports {
    pub(super) fn etcd_client(self) -> u16 {
        self.base + 1
    }
    pub(super) fn etcd_peer(self) -> u16 {
        self.base + 2
    }
    pub(super) fn registry(self) -> u16 {
        self.base + 5
    }
    pub(super) fn cluster(self, index: usize, offset: u16) -> u16 {
        self.base + 100 * u16::try_from(index).unwrap_or(u16::MAX / 200) + offset
    }
}

pub(super) const APISERVER: u16 = 43;
const CONTROLLER_MANAGER: u16 = 57;
const SCHEDULER: u16 = 59;
pub(super) const KWOK: u16 = 47;
pub(super) const OCM_AGENT: u16 = 80;
pub(super) const OCM_REGISTRATION: u16 = 81;
pub(super) const OCM_ADDON_MANAGER: u16 = 82;
pub(super) const OCM_PLACEMENT: u16 = 83;
pub(super) const OCM_ADDON_WEBHOOK: u16 = 84;

/// A cluster's control plane while it is being started.
pub(super) struct ControlPlane {
    pub(super) name: String,
    pub(super) index: usize,
    pub(super) dir: PathBuf,
    pub(super) ca: Ca,
    pub(super) server: String,
    pub(super) kubeconfig: PathBuf,
    pub(super) client: Client,
}

impl Starting {
    pub(super) async fn etcd(&mut self) -> Result<()> {
        let data = self.dir.join("etcd");
        let (client, peer) = (self.ports.etcd_client(), self.ports.etcd_peer());
        let args = vec![
            "--name=kmm-fleet".into(),
            format!("--data-dir={}", data.display()),
            format!("--listen-client-urls=http://127.0.0.1:{client}"),
            format!("--advertise-client-urls=http://127.0.0.1:{client}"),
            format!("--listen-peer-urls=http://127.0.0.1:{peer}"),
            format!("--initial-advertise-peer-urls=http://127.0.0.1:{peer}"),
            format!("--initial-cluster=kmm-fleet=http://127.0.0.1:{peer}"),
            // A throwaway test store: durability across power loss is not needed.
            "--unsafe-no-fsync=true".into(),
            "--log-level=warn".into(),
        ];
        let etcd = self.start("etcd", "etcd", args, &[])?;
        wait_for(&etcd, "etcd /health", || async move {
            http_get_plain(LOOPBACK, client, "/health")
                .await
                .is_some_and(|body| body.contains("\"health\":\"true\""))
        })
        .await
    }

    /// A cluster's kube-apiserver (reachable from the real nodes at the bridge address
    /// through a forwarder), kube-controller-manager and kube-scheduler.
    pub(super) async fn control_plane(&mut self, name: &str, index: usize) -> Result<ControlPlane> {
        let dir = self.dir.join(name);
        let pki_dir = dir.join("pki");
        std::fs::create_dir_all(&pki_dir).context(|| format!("creating {}", pki_dir.display()))?;
        let ca = Ca::create(&pki_dir, "ca", &format!("kmm-fleet {name} CA"))?;
        let gateway = self.network.gateway.to_string();
        let serving = ca.serving(
            &pki_dir,
            "apiserver",
            &[
                "localhost",
                "kubernetes",
                "kubernetes.default",
                "kubernetes.default.svc",
                "kubernetes.default.svc.cluster.local",
            ],
            // Loopback for the host, the bridge for the kubelets, the `kubernetes`
            // Service's ClusterIP for pods.
            &["127.0.0.1", &gateway, "10.0.0.1"],
        )?;
        let admin = ca.client(&pki_dir, "admin", "kmm-fleet-admin", "system:masters")?;
        // The apiserver's identity towards kubelets (logs, exec, port-forward).
        let kubelet_client = ca.client(
            &pki_dir,
            "apiserver-kubelet-client",
            "kube-apiserver-kubelet-client",
            "system:masters",
        )?;
        let sa = pki::key_pair(&pki_dir, "service-account")?;
        let port = self.ports.cluster(index, APISERVER);
        let server = format!("https://127.0.0.1:{port}");
        let kubeconfig = dir.join("admin.kubeconfig");
        write_kubeconfig(
            &kubeconfig,
            name,
            &server,
            &ca.pem,
            Credentials::Certificate(&admin),
        )?;

        let p = |path: &Path| path.display().to_string();
        let apiserver = self.start(
            &format!("{name}/kube-apiserver"),
            "kube-apiserver",
            vec![
                format!(
                    "--etcd-servers=http://127.0.0.1:{}",
                    self.ports.etcd_client()
                ),
                format!("--etcd-prefix=/kmm-fleet/{name}"),
                "--bind-address=127.0.0.1".into(),
                // The `kubernetes` Service's endpoint: pods reach it through their
                // node and the forwarder on the bridge.
                format!("--advertise-address={gateway}"),
                format!("--secure-port={port}"),
                format!("--cert-dir={}", p(&dir.join("apiserver-certs"))),
                format!("--tls-cert-file={}", p(&serving.cert)),
                format!("--tls-private-key-file={}", p(&serving.key)),
                format!("--client-ca-file={}", p(&ca.cert)),
                "--service-account-issuer=https://kubernetes.default.svc.cluster.local".into(),
                format!("--service-account-key-file={}", p(&sa.cert)),
                format!("--service-account-signing-key-file={}", p(&sa.key)),
                format!("--service-cluster-ip-range={SERVICE_CIDR}"),
                // Node: what kubelets may read and write, as in any kubeadm cluster.
                "--authorization-mode=Node,RBAC".into(),
                "--allow-privileged=true".into(),
                format!("--kubelet-certificate-authority={}", p(&ca.cert)),
                format!("--kubelet-client-certificate={}", p(&kubelet_client.cert)),
                format!("--kubelet-client-key={}", p(&kubelet_client.key)),
                // Nodes' host names do not resolve; their InternalIP is on the bridge.
                "--kubelet-preferred-address-types=InternalIP".into(),
                // Webhooks and aggregated APIs by endpoint (pod) IP, which the host
                // routes to the real nodes; ClusterIPs exist only inside the nodes.
                "--enable-aggregator-routing=true".into(),
                // Only to give aggregated/extension servers a client CA to read.
                format!("--requestheader-client-ca-file={}", p(&ca.cert)),
                "--requestheader-allowed-names=front-proxy-client".into(),
                "--requestheader-username-headers=X-Remote-User".into(),
                "--requestheader-group-headers=X-Remote-Group".into(),
                "--requestheader-extra-headers-prefix=X-Remote-Extra-".into(),
            ],
            &[],
        )?;
        let client = client_for(&kubeconfig).await?;
        let probe = client.clone();
        wait_for(&apiserver, "kube-apiserver /readyz", || {
            let probe = probe.clone();
            async move {
                get_text(&probe, "/readyz")
                    .await
                    .is_some_and(|t| t.trim() == "ok")
            }
        })
        .await?;
        self.state.clusters.push(Cluster {
            name: name.into(),
            kubeconfig: kubeconfig.clone(),
            server: server.clone(),
            nodes: vec![],
            real_nodes: vec![],
        });
        self.state.save(&self.dir)?;
        self.forward(&format!("{name}/apiserver-forward"), port)
            .await?;

        let kc = p(&kubeconfig);
        let kcm_port = self.ports.cluster(index, CONTROLLER_MANAGER);
        let kcm = self.start(
            &format!("{name}/kube-controller-manager"),
            "kube-controller-manager",
            vec![
                format!("--kubeconfig={kc}"),
                format!("--authentication-kubeconfig={kc}"),
                format!("--authorization-kubeconfig={kc}"),
                "--bind-address=127.0.0.1".into(),
                format!("--secure-port={kcm_port}"),
                format!("--cert-dir={}", p(&dir.join("kcm-certs"))),
                "--leader-elect=false".into(),
                format!("--cluster-name={name}"),
                // Signs kubernetes.io/kube-apiserver-client CSRs, e.g. OCM's cluster registration.
                format!("--cluster-signing-cert-file={}", p(&ca.cert)),
                format!("--cluster-signing-key-file={}", p(&ca.key)),
                format!("--root-ca-file={}", p(&ca.cert)),
                format!("--service-account-private-key-file={}", p(&sa.key)),
                // KWOK's heartbeat stage renews a Node every 20-45 s: with the default
                // grace a busy machine sees KWOK nodes go NotReady, and their Pods with
                // them (for good: KWOK never marks them ready again).
                "--node-monitor-grace-period=2m".into(),
            ],
            &[],
        )?;
        wait_healthz(&kcm, kcm_port, "/healthz").await?;
        // The hub's too: Deployments on its real nodes (kmm-hub's own) need one.
        let sched_port = self.ports.cluster(index, SCHEDULER);
        let sched = self.start(
            &format!("{name}/kube-scheduler"),
            "kube-scheduler",
            vec![
                format!("--kubeconfig={kc}"),
                format!("--authentication-kubeconfig={kc}"),
                format!("--authorization-kubeconfig={kc}"),
                "--bind-address=127.0.0.1".into(),
                format!("--secure-port={sched_port}"),
                "--leader-elect=false".into(),
            ],
            &[],
        )?;
        wait_healthz(&sched, sched_port, "/healthz").await?;
        Ok(ControlPlane {
            name: name.into(),
            index,
            dir,
            ca,
            server,
            kubeconfig,
            client,
        })
    }
}

pub(super) async fn wait_healthz(process: &Tracked, port: u16, path: &'static str) -> Result<()> {
    let client = insecure_client(port)?;
    wait_for(process, &format!("{path} on port {port}"), || {
        let client = client.clone();
        async move {
            get_text(&client, path)
                .await
                .is_some_and(|t| t.trim() == "ok")
        }
    })
    .await
}

/// A client for a component's own serving endpoint (self-signed, no credentials).
fn insecure_client(port: u16) -> Result<Client> {
    let url = format!("https://127.0.0.1:{port}")
        .parse()
        .map_err(|e| Error::Invalid(format!("url: {e}")))?;
    let mut config = kube::Config::new(url);
    config.accept_invalid_certs = true;
    Ok(Client::try_from(config)?)
}

pub(super) async fn get_text(client: &Client, path: &str) -> Option<String> {
    let request = http::Request::get(path).body(Vec::new()).ok()?;
    client.request_text(request).await.ok()
}

pub(super) const LOOPBACK: IpAddr = IpAddr::V4(Ipv4Addr::LOCALHOST);

/// A plain-HTTP GET, for etcd, the registry and the real nodes' daemons; `None` unless
/// 200 OK.
pub(crate) async fn http_get_plain(ip: IpAddr, port: u16, path: &str) -> Option<String> {
    let mut stream = tokio::net::TcpStream::connect((ip, port)).await.ok()?;
    let request = format!("GET {path} HTTP/1.0\r\nHost: {ip}\r\n\r\n");
    stream.write_all(request.as_bytes()).await.ok()?;
    let mut response = String::new();
    stream.read_to_string(&mut response).await.ok()?;
    ok_body(&response)
}

/// The body of an HTTP/1.x response whose status is 200.
fn ok_body(response: &str) -> Option<String> {
    let (head, body) = response.split_once("\r\n\r\n")?;
    let status_line = head.lines().next()?;
    status_line
        .split_whitespace()
        .nth(1)
        .is_some_and(|code| code == "200")
        .then(|| body.to_string())
}

/// A client from a kubeconfig file written by the fleet.
pub async fn client_for(kubeconfig: &Path) -> Result<Client> {
    let kc = Kubeconfig::read_from(kubeconfig)?;
    let config = kube::Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default()).await?;
    Ok(Client::try_from(config)?)
}

/// Who a kubeconfig authenticates as.
pub(super) enum Credentials<'a> {
    Certificate(&'a pki::Pair),
    Token(&'a str),
}

pub(super) fn write_kubeconfig(
    path: &Path,
    cluster: &str,
    server: &str,
    ca_pem: &str,
    credentials: Credentials<'_>,
) -> Result<()> {
    let b64 = |s: &[u8]| base64::engine::general_purpose::STANDARD.encode(s);
    let read = |p: &Path| std::fs::read(p).context(|| format!("reading {}", p.display()));
    let user = match credentials {
        Credentials::Certificate(pair) => json!({
            "client-certificate-data": b64(&read(&pair.cert)?),
            "client-key-data": b64(&read(&pair.key)?),
        }),
        Credentials::Token(token) => json!({ "token": token }),
    };
    let config = json!({
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{ "name": cluster, "cluster": {
            "server": server,
            "certificate-authority-data": b64(ca_pem.as_bytes()),
        }}],
        "users": [{ "name": "user", "user": user }],
        "contexts": [{ "name": cluster, "context": { "cluster": cluster, "user": "user" } }],
        "current-context": cluster,
    });
    let text = serde_yaml_ng::to_string(&config).map_err(|e| Error::Invalid(e.to_string()))?;
    std::fs::write(path, text).context(|| format!("writing {}", path.display()))
}

/// Server-side apply a CRD and wait until it is established.
pub async fn apply_crd(client: &Client, crd: &Value) -> Result<()> {
    let api: Api<CustomResourceDefinition> = Api::all(client.clone());
    let name = crd_name(crd).to_string();
    api.patch(
        &name,
        &PatchParams::apply(MANAGER).force(),
        &Patch::Apply(crd),
    )
    .await?;
    let deadline = Instant::now() + STARTUP;
    loop {
        let current = api.get(&name).await?;
        let established = current
            .status
            .as_ref()
            .and_then(|s| s.conditions.as_ref())
            .is_some_and(|cs| {
                cs.iter()
                    .any(|c| c.type_ == "Established" && c.status == "True")
            });
        if established {
            return Ok(());
        }
        if Instant::now() >= deadline {
            return Err(Error::Timeout {
                what: format!("CRD {name} to be established"),
                seconds: STARTUP.as_secs(),
            });
        }
        tokio::time::sleep(POLL).await;
    }
}

pub(super) async fn ensure_namespaces(client: &Client, names: &[&str]) -> Result<()> {
    let api: Api<Namespace> = Api::all(client.clone());
    for name in names {
        let ns = json!({ "apiVersion": "v1", "kind": "Namespace", "metadata": { "name": name } });
        api.patch(
            name,
            &PatchParams::apply(MANAGER).force(),
            &Patch::Apply(&ns),
        )
        .await?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_200_responses_have_a_body() {
        assert_eq!(
            ok_body("HTTP/1.0 200 OK\r\nA: b\r\n\r\n{}"),
            Some("{}".into())
        );
        assert_eq!(ok_body("HTTP/1.1 404 Not Found\r\n\r\nno"), None);
        assert_eq!(ok_body("garbage"), None);
    }
}
