//! A hub started in-process against the local fleet's hub API server, in a namespace of
//! its own and managing only its own test's modules, and a test proxy speaking `Hub.Sync`
//! with a certificate issued from that hub's CA.

use std::net::SocketAddr;
use std::time::Duration;

use k8s_openapi::api::core::v1::Secret;
use kmm_api::ManagedClusterModule;
use kmm_api::testing::ModuleBuilder;
use kmm_e2e::fixture::{Fleet, TempNamespace, wait_until};
use kmm_hub::serve::leadership::LeaderElection;
use kmm_hub::serve::{self, Listeners, ServeError, Settings, ca, metrics::Metrics};
use kmm_proto::v1::{
    HubMessage, IntentSnapshot, Kernel, KernelInventory, ModuleKey, ModuleNodeKey,
    ModuleNodeStatus, ModuleState, NodeStatusReport, ProxyHello, ProxyMessage,
    hub_client::HubClient, hub_message, proxy_message,
};
use kmm_runtime::health::Health;
use kmm_runtime::pki::{CertificateAuthority, IssuedCertificate, Leaf};
use kube::api::{DeleteParams, Patch, PatchParams, PostParams};
use kube::{Api, Client};
use serde_json::json;
use std::sync::atomic::{AtomicU64, Ordering};
use tokio::net::TcpListener;

use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;
use tonic::Streaming;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Identity};

pub const WAIT: Duration = Duration::from_secs(30);
/// Lease duration of the election tests' hubs: a standby takes over within it.
pub const LEASE_DURATION: Duration = Duration::from_secs(6);
/// Label of the test's modules; the test's hub manages only those.
const HUB_LABEL: &str = "test.kmm.sigs.x-k8s.io/hub";
/// A kernel with a mapping in [`module`] and one without.
pub const MAPPED_KERNEL: &str = "6.1.0-56-amd64";
pub const UNMAPPED_KERNEL: &str = "5.14.0-427.13.1.el9_4.x86_64";

pub async fn fleet() -> Fleet {
    static LOGS: std::sync::Once = std::sync::Once::new();
    // The hub's logs, shown for failing tests.
    LOGS.call_once(|| {
        kmm_runtime::logging::init(&kmm_runtime::cli::LoggingArgs {
            log_format: kmm_runtime::cli::LogFormat::Text,
            log_level: None,
            verbose: 0,
        })
    });
    let fleet = Fleet::get()
        .await
        .expect("these tests need the local fleet (cargo xtask env up)");
    let _ = REGISTRY.set(fleet.state.registry.clone());
    for yaml in [
        kmm_api::managed_cluster_module_crd_yaml(),
        kmm_api::preflight_validation_crd_yaml(),
    ] {
        let crd: serde_json::Value = serde_yaml_ng::from_str(&yaml).expect("CRD YAML");
        kmm_e2e::fleet::apply_crd(&fleet.hub, &crd)
            .await
            .expect("the hub's CRDs apply");
    }
    fleet
}

/// What a test hub runs besides the reconciler and `Hub.Sync`.
#[derive(Debug, Default)]
pub struct HubOptions {
    /// Serve the admission webhook and keep the CA in this ValidatingWebhookConfiguration.
    pub webhook_configuration: Option<String>,
    /// Join the election for the Lease `kmm-hub` of the namespace under this identity.
    pub leader_identity: Option<String>,
    /// The OCM add-on the hub serves. Default: the test's namespace, an add-on with no
    /// OCM objects, so that test hubs never write to the fleet's real `kmm` add-on.
    pub addon_name: Option<String>,
    /// Lifetime of the serving certificates. Default: the binary's.
    pub serving_validity: Option<Duration>,
}

/// A running hub.
pub struct TestHub {
    pub client: Client,
    pub webhook_addr: Option<SocketAddr>,
    pub health: Health,
    pub metrics: Metrics,
    pub namespace: String,
    pub addr: SocketAddr,
    pub addon_name: String,
    stop: CancellationToken,
    task: Option<JoinHandle<Result<(), ServeError>>>,
}

impl TestHub {
    pub async fn start(fleet: &Fleet, unload_timeout: Duration) -> (Self, TempNamespace) {
        let namespace = TempNamespace::create(&fleet.hub, "kmm-hub-test")
            .await
            .expect("a test namespace");
        let hub = Self::start_in(fleet, &namespace.name, unload_timeout).await;
        (hub, namespace)
    }

    pub async fn start_in(fleet: &Fleet, namespace: &str, unload_timeout: Duration) -> Self {
        Self::start_with(fleet, namespace, unload_timeout, HubOptions::default()).await
    }

    pub async fn start_with(
        fleet: &Fleet,
        namespace: &str,
        unload_timeout: Duration,
        options: HubOptions,
    ) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("a free port");
        let addr = listener.local_addr().unwrap();
        let webhook = match options.webhook_configuration {
            Some(_) => Some(TcpListener::bind("127.0.0.1:0").await.expect("a free port")),
            None => None,
        };
        let webhook_addr = webhook.as_ref().map(|l| l.local_addr().unwrap());
        let addon_name = options.addon_name.unwrap_or_else(|| namespace.to_owned());
        let settings = Settings {
            namespace: namespace.to_owned(),
            grpc_sans: vec!["localhost".into(), "127.0.0.1".into()],
            unload_timeout,
            instance: format!("test-{namespace}"),
            module_selector: Some(format!("{HUB_LABEL}={namespace}")),
            webhook_sans: vec!["127.0.0.1".into()],
            webhook_configuration: options.webhook_configuration,
            leader_election: options.leader_identity.map(|identity| LeaderElection {
                lease: "kmm-hub".into(),
                identity,
                duration: LEASE_DURATION,
                // As the binary does: renew with two thirds left, so a loaded test
                // machine's slow apiserver does not move the Lease mid-test.
                renew_before: LEASE_DURATION * 2 / 3,
                pod: None,
            }),
            addon_name: addon_name.clone(),
            builder_image: "127.0.0.1:1/kmm-fleet/kmm-builder:test".into(),
            registry_ca_file: None,
            image_follow_interval: Duration::from_secs(300),
            serving_validity: options.serving_validity.unwrap_or(ca::SERVING_VALIDITY),
        };
        let (health, metrics) = (Health::default(), Metrics::default());
        let stop = CancellationToken::new();
        let task = tokio::spawn(serve::run(
            fleet.hub.clone(),
            settings,
            Listeners {
                grpc: listener,
                webhook,
                ui: None,
            },
            health.clone(),
            metrics.clone(),
            stop.clone(),
        ));
        Self {
            client: fleet.hub.clone(),
            webhook_addr,
            health,
            metrics,
            namespace: namespace.to_owned(),
            addr,
            addon_name,
            stop,
            task: Some(task),
        }
    }

    /// Whether the hub's run has ended by itself (an error, or leadership lost).
    pub fn ended(&self) -> bool {
        self.task.as_ref().is_some_and(|task| task.is_finished())
    }

    /// Stops the hub and checks it stopped cleanly.
    pub async fn stop(mut self) {
        self.stop.cancel();
        let task = self.task.take().unwrap();
        tokio::time::timeout(WAIT, task)
            .await
            .expect("the hub stops within the deadline")
            .expect("the hub task does not panic")
            .expect("the hub stops without error");
    }

    pub async fn ca_secret(&self) -> Secret {
        let api: Api<Secret> = Api::namespaced(self.client.clone(), &self.namespace);
        wait_until("the hub's CA Secret", WAIT, || async {
            api.get_opt("kmm-hub-ca")
                .await
                .map_err(|e| e.to_string())?
                .ok_or_else(|| "absent".to_string())
        })
        .await
        .expect("the hub creates its CA Secret")
    }

    pub async fn ca(&self) -> CertificateAuthority {
        let secret = self.ca_secret().await;
        let data = secret.data.expect("the CA Secret has data");
        let text = |key: &str| String::from_utf8(data[key].0.clone()).unwrap();
        CertificateAuthority::from_pem(&text("tls.crt"), &text("tls.key")).expect("a usable CA")
    }

    /// A client certificate as OCM's add-on registration issues it for `cluster`.
    pub async fn proxy_certificate(&self, cluster: &str) -> IssuedCertificate {
        self.proxy_certificate_valid_for(cluster, Duration::from_secs(3600))
            .await
    }

    /// [`TestHub::proxy_certificate`] valid for `validity` from now.
    pub async fn proxy_certificate_valid_for(
        &self,
        cluster: &str,
        validity: Duration,
    ) -> IssuedCertificate {
        let addon = &self.addon_name;
        self.ca()
            .await
            .issue(&Leaf::client(
                &format!(
                    "system:open-cluster-management:cluster:{cluster}:addon:{addon}:agent:{addon}-agent"
                ),
                &[
                    format!("system:open-cluster-management:cluster:{cluster}:addon:{addon}"),
                    format!("system:open-cluster-management:addon:{addon}"),
                    "system:authenticated".into(),
                ],
                validity,
            ))
            .expect("a client certificate")
    }

    pub async fn channel(
        &self,
        client_cert: &IssuedCertificate,
    ) -> Result<Channel, tonic::transport::Error> {
        let ca = self.ca().await;
        let tls = ClientTlsConfig::new()
            .ca_certificate(Certificate::from_pem(ca.cert_pem()))
            .identity(Identity::from_pem(
                &client_cert.cert_pem,
                client_cert.key_pem.as_bytes(),
            ))
            .domain_name("localhost");
        Channel::from_shared(format!("https://{}", self.addr))
            .unwrap()
            .tls_config(tls)?
            .connect_timeout(WAIT)
            .connect()
            .await
    }

    /// A proxy for `cluster` that said hello and sent `kernels`.
    pub async fn proxy(&self, cluster: &str, kernels: &[&str]) -> Proxy {
        self.proxy_holding(cluster, kernels, None).await
    }

    /// A proxy for `cluster` holding the complete snapshot `held` (its hello names it, as
    /// a real proxy's does after a hub restart), that sent `kernels`.
    pub async fn proxy_holding(
        &self,
        cluster: &str,
        kernels: &[&str],
        held: Option<IntentSnapshot>,
    ) -> Proxy {
        let cert = self.proxy_certificate(cluster).await;
        let proxy = Proxy::open_holding(
            self.channel(&cert)
                .await
                .expect("the hub accepts the proxy's TLS"),
            held,
        )
        .await
        .expect("the stream opens");
        proxy.send_inventory(1, kernels).await;
        proxy
    }

    pub fn modules(&self) -> Api<ManagedClusterModule> {
        Api::all(self.client.clone())
    }

    /// Creates a module managed by this hub, selecting clusters labelled
    /// [`TestHub::cluster_label`].
    pub async fn create_module(&self, name: &str, spec: serde_json::Value) -> ManagedClusterModule {
        self.create_module_with(name, spec, json!({})).await
    }

    /// [`TestHub::create_module`], with more fields of the ManagedClusterModule's spec.
    pub async fn create_module_with(
        &self,
        name: &str,
        spec: serde_json::Value,
        more: serde_json::Value,
    ) -> ManagedClusterModule {
        let mut object = ModuleBuilder::new(name)
            .without("/metadata/generation")
            .labels(&[(HUB_LABEL, &self.namespace)])
            .spoke_namespace("kmm-test")
            .selector(&[(&self.cluster_label(), "yes")])
            .module_spec(spec);
        for (field, value) in more.as_object().into_iter().flatten() {
            object = object.with(&format!("/spec/{field}"), value.clone());
        }
        let module = object.build();
        self.modules()
            .create(&PostParams::default(), &module)
            .await
            .expect("the module is created")
    }

    /// The ManagedCluster label this test's modules select.
    /// Sets the module's `moduleLoader.container.version`: a new generation.
    pub async fn set_version(&self, module: &str, version: &str) {
        let patch =
            json!({"spec": {"moduleSpec": {"moduleLoader": {"container": {"version": version}}}}});
        self.modules()
            .patch(module, &PatchParams::default(), &Patch::Merge(&patch))
            .await
            .expect("the module's version changes");
    }

    pub fn cluster_label(&self) -> String {
        format!("test.kmm.sigs.x-k8s.io/{}", self.namespace)
    }

    pub async fn label_cluster(&self, cluster: &str, selected: bool) {
        let value = if selected { json!("yes") } else { json!(null) };
        let patch = json!({"metadata": {"labels": {self.cluster_label(): value}}});
        kmm_e2e::fleet::managed_clusters(&self.client)
            .patch(cluster, &PatchParams::default(), &Patch::Merge(&patch))
            .await
            .expect("the ManagedCluster is labelled");
    }

    /// Waits for a module's state to satisfy `check` (which says what it saw otherwise).
    pub async fn wait_module<T>(
        &self,
        name: &str,
        what: &str,
        timeout: Duration,
        check: impl Fn(Option<ManagedClusterModule>) -> Result<T, String>,
    ) -> T {
        let api = self.modules();
        wait_until(what, timeout, || {
            let api = api.clone();
            let check = &check;
            async move { check(api.get_opt(name).await.map_err(|e| e.to_string())?) }
        })
        .await
        .unwrap_or_else(|e| panic!("{e}"))
    }

    /// Removes what a test leaves on the shared fleet.
    pub async fn clean_up(self, namespace: TempNamespace, modules: &[&str], clusters: &[&str]) {
        for cluster in clusters {
            self.label_cluster(cluster, false).await;
        }
        let api = self.modules();
        for name in modules {
            let _ = api.delete(name, &DeleteParams::default()).await;
        }
        self.stop().await;
        // Without a hub, nothing releases the finalizer of a module left behind.
        for name in modules {
            if api.get_opt(name).await.ok().flatten().is_some() {
                let patch = json!({"metadata": {"finalizers": null}});
                let _ = api
                    .patch(name, &PatchParams::default(), &Patch::Merge(&patch))
                    .await;
            }
        }
        namespace
            .delete()
            .await
            .expect("the test namespace is deleted");
    }
}

impl Drop for TestHub {
    fn drop(&mut self) {
        if let Some(task) = &self.task {
            task.abort();
        }
    }
}

/// A test spoke proxy: one `Hub.Sync` stream.
pub struct Proxy {
    outbound: mpsc::Sender<ProxyMessage>,
    pub inbound: Streaming<HubMessage>,
    /// The revision of the last snapshot received: what its statuses are made with, as a
    /// real proxy's are.
    applied: AtomicU64,
    /// The complete snapshot the ones received so far stand for (deltas applied).
    current: Option<IntentSnapshot>,
}

impl Proxy {
    pub async fn open(channel: Channel) -> Result<Self, tonic::Status> {
        Self::open_holding(channel, None).await
    }

    /// A stream whose hello says the proxy holds `held`.
    pub async fn open_holding(
        channel: Channel,
        held: Option<IntentSnapshot>,
    ) -> Result<Self, tonic::Status> {
        let (outbound, rx) = mpsc::channel(16);
        let applied = held.as_ref().map_or(0, |s| s.revision);
        let digest = held.as_ref().map_or_else(Vec::new, |s| {
            kmm_proto::snapshot_digest(&s.modules, &s.credentials).to_vec()
        });
        outbound
            .send(ProxyMessage {
                message: Some(proxy_message::Message::Hello(ProxyHello {
                    proxy_version: "test".into(),
                    applied_intent_revision: applied,
                    applied_intent_digest: digest,
                })),
            })
            .await
            .unwrap();
        let inbound = HubClient::new(channel)
            .sync(ReceiverStream::new(rx))
            .await?
            .into_inner();
        Ok(Self {
            outbound,
            inbound,
            applied: AtomicU64::new(applied),
            current: held,
        })
    }

    pub async fn send(&self, message: proxy_message::Message) {
        self.outbound
            .send(ProxyMessage {
                message: Some(message),
            })
            .await
            .expect("the stream is open");
    }

    pub async fn send_inventory(&self, revision: u64, kernels: &[&str]) {
        assert!(
            self.try_send_inventory(revision, kernels).await,
            "the stream is open"
        );
    }

    /// [`Proxy::send_inventory`]; `false` when the hub already ended the stream.
    pub async fn try_send_inventory(&self, revision: u64, kernels: &[&str]) -> bool {
        let message = proxy_message::Message::Inventory(KernelInventory {
            revision,
            kernels: kernels
                .iter()
                .map(|k| Kernel {
                    release: (*k).into(),
                })
                .collect(),
        });
        self.outbound
            .send(ProxyMessage {
                message: Some(message),
            })
            .await
            .is_ok()
    }

    pub async fn send_status(&self, full: bool, statuses: Vec<ModuleNodeStatus>) {
        self.send_status_part(full, statuses, false).await;
    }

    /// One part of a report; more follow while `continued`.
    pub async fn send_status_part(
        &self,
        full: bool,
        statuses: Vec<ModuleNodeStatus>,
        continued: bool,
    ) {
        self.send(proxy_message::Message::Status(NodeStatusReport {
            full,
            statuses,
            removed: vec![],
            intent_revision: self.applied.load(Ordering::Relaxed),
            continued,
        }))
        .await;
    }

    /// The next snapshot, complete (a delta applied as a real proxy does), failing after
    /// [`WAIT`].
    pub async fn next_snapshot(&mut self) -> IntentSnapshot {
        let message = tokio::time::timeout(WAIT, self.inbound.message())
            .await
            .expect("a snapshot within the deadline")
            .expect("the stream stays healthy")
            .expect("the stream stays open");
        match message.message {
            Some(hub_message::Message::Intents(received)) => {
                self.applied.store(received.revision, Ordering::Relaxed);
                let snapshot = kmm_proto::apply_snapshot(self.current.as_ref(), received);
                self.current = Some(snapshot.clone());
                snapshot
            }
            None => panic!("an empty HubMessage"),
        }
    }

    /// Snapshots until one satisfies `check`.
    pub async fn snapshot_where(
        &mut self,
        what: &str,
        check: impl Fn(&IntentSnapshot) -> bool,
    ) -> IntentSnapshot {
        let deadline = tokio::time::Instant::now() + WAIT;
        let mut seen = Vec::new();
        loop {
            let remaining = deadline.saturating_duration_since(tokio::time::Instant::now());
            let next = tokio::time::timeout(remaining, self.next_snapshot()).await;
            let Ok(snapshot) = next else {
                panic!("no snapshot where {what}; saw {seen:#?}");
            };
            if check(&snapshot) {
                return snapshot;
            }
            seen.push(snapshot);
        }
    }
}

/// The fleet's registry (plain HTTP), where the sample images are: the hub checks them.
static REGISTRY: std::sync::OnceLock<String> = std::sync::OnceLock::new();

/// The sample image for `kernel` in the fleet's registry.
pub fn sample_image(kernel: &str) -> String {
    let registry = REGISTRY.get().expect("fleet() ran first");
    format!("{registry}/samples/kmm-hello:{kernel}")
}

/// The spec of the local fleet's sample module (one mapping, for Debian amd64 kernels).
pub fn module(version: &str, image_repo_secret: Option<&str>) -> serde_json::Value {
    let mut spec = json!({
        "selector": {"kubernetes.io/os": "linux"},
        "moduleLoader": {"container": {
            "version": version,
            "modprobe": {"moduleName": "kmm_hello"},
            "kernelMappings": [{
                "regexp": "^[0-9.]+-[0-9]+-(cloud-|rt-)?amd64$",
                "containerImage": sample_image("${KERNEL_FULL_VERSION}"),
                "registryTLS": {"insecure": true},
            }],
        }},
    });
    if let Some(secret) = image_repo_secret {
        spec["imageRepoSecret"] = json!({"name": secret});
    }
    spec
}

pub fn node_status(module: &str, node: &str, state: ModuleState, reason: &str) -> ModuleNodeStatus {
    ModuleNodeStatus {
        key: Some(ModuleNodeKey {
            module: Some(ModuleKey {
                namespace: "kmm-test".into(),
                name: module.into(),
            }),
            node: node.into(),
        }),
        kernel: MAPPED_KERNEL.into(),
        state: state.into(),
        loaded_version: if state == ModuleState::Loaded {
            "1".into()
        } else {
            String::new()
        },
        message: if reason.is_empty() {
            String::new()
        } else {
            format!("modprobe: {reason} on {node}")
        },
        reason: reason.into(),
    }
}

/// The module's intent in a snapshot.
pub fn intent<'a>(
    snapshot: &'a IntentSnapshot,
    name: &str,
) -> Option<&'a kmm_proto::v1::ModuleIntent> {
    snapshot
        .modules
        .iter()
        .find(|m| m.key.as_ref().is_some_and(|k| k.name == name))
}

/// The note of the first Event about `regarding` with `reason`, waiting for it.
pub async fn event_note(client: &Client, regarding: &str, reason: &str) -> String {
    let events: Api<k8s_openapi::api::events::v1::Event> = Api::all(client.clone());
    let selector = format!("regarding.name={regarding}");
    wait_until(
        &format!("the {reason} Event of {regarding}"),
        WAIT,
        || async {
            let list = events
                .list(&kube::api::ListParams::default().fields(&selector))
                .await
                .map_err(|e| e.to_string())?;
            list.items
                .iter()
                .find(|e| e.reason.as_deref() == Some(reason))
                .and_then(|e| e.note.clone())
                .ok_or_else(|| {
                    format!(
                        "{:?}",
                        list.items.iter().map(|e| &e.reason).collect::<Vec<_>>()
                    )
                })
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"))
}
