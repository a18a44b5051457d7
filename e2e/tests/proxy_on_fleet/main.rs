//! The real kmm-spoke-proxy binary on the fleet's spoke1 kube-apiserver, running with
//! exactly the permissions of rbac.yaml, between a TLS Hub peer and node agent clients
//! holding real node-bound ServiceAccount tokens. The debug binary
//! (`kmm_e2e::binaries`: `cargo build --bins -p kmm-spoke-proxy` first).

mod support;

use std::collections::BTreeSet;
use std::time::Duration;

use anyhow::{Result, bail, ensure};
use k8s_openapi::ByteString;
use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::{ConfigMap, Pod, Secret, ServiceAccount};
use kmm_e2e::fixture::wait_until;
use kmm_proto::v1::{
    Action, DevicePlugin, IntentSnapshot, KernelTarget, ModuleEvent, ModuleIntent, ModuleKey,
    ModuleLoad, ModuleState, Outcome, PullCredential, Unresolved, kernel_target::Target,
    proxy_message, pull_credential::Content,
};
use kube::Api;
use kube::api::{ListParams, ObjectMeta, Patch, PatchParams, PostParams};
use support::{AgentConn, HubPeer, HubPki, ProxyProcess, Spoke, WAIT, hello};
use tonic::Code;

const CREDENTIAL: &[u8] = br#"{"auths":{"registry.example":{"auth":"dGVzdDp0ZXN0"}}}"#;

fn key(spoke: &Spoke, name: &str) -> ModuleKey {
    ModuleKey {
        namespace: spoke.namespace.clone(),
        name: name.into(),
    }
}

/// `name` on the node `i` only, with an image for every kernel of the cluster.
fn intent_for_node(spoke: &Spoke, name: &str, i: usize) -> ModuleIntent {
    let kernels = (0..spoke.nodes.len())
        .map(|n| KernelTarget {
            kernel: spoke.kernel(n),
            target: Some(Target::Load(ModuleLoad {
                image: format!("registry.example/{name}:{}", spoke.kernel(n)),
                version: "v1".into(),
                pull_credential_id: "pull".into(),
                ..Default::default()
            })),
        })
        .collect();
    ModuleIntent {
        key: Some(key(spoke, name)),
        generation: 1,
        pin_generation: 0,
        node_selector: [(
            "kubernetes.io/hostname".to_string(),
            spoke.node_name(i).to_string(),
        )]
        .into(),
        tolerations: vec![],
        kernels,
        unload: false,
        max_unavailable: None,
        device_plugin: None,
        device_plugin_only: false,
    }
}

fn snapshot(revision: u64, modules: Vec<ModuleIntent>) -> IntentSnapshot {
    IntentSnapshot {
        revision,
        modules,
        credentials: vec![PullCredential {
            id: "pull".into(),
            content: Some(Content::DockerConfigJson(CREDENTIAL.to_vec())),
        }],
        ..IntentSnapshot::default()
    }
}

fn event(spoke: &Spoke, name: &str, action: Action, revision: u64) -> ModuleEvent {
    ModuleEvent {
        key: Some(key(spoke, name)),
        action: action.into(),
        outcome: Outcome::Succeeded.into(),
        version: "v1".into(),
        image_digest: "sha256:0123".into(),
        error: String::new(),
        duration_ms: 3,
        desired_revision: revision,
        kept: Vec::new(),
    }
}

fn is(
    status: &kmm_proto::v1::ModuleNodeStatus,
    name: &str,
    node: &str,
    state: ModuleState,
) -> bool {
    status
        .key
        .as_ref()
        .is_some_and(|k| k.node == node && k.module.as_ref().is_some_and(|m| m.name == name))
        && status.state == state as i32
}

/// A module on another node whose ready label proves how far the proxy's label writer
/// got. The writer takes every node changed before a pass and patches them in name
/// order, so once the witness's label flips, the labels of any node named before the
/// witness's show every change made before the flip: a check that a label is absent is
/// then meaningful, not merely early.
struct Witness {
    agent: AgentConn,
    index: usize,
    label: String,
    revision: u64,
    loaded: bool,
}

impl Witness {
    const MODULE: &str = "witness";

    /// The witness's intent, to be part of every snapshot the test sends.
    fn intent(spoke: &Spoke, index: usize) -> ModuleIntent {
        intent_for_node(spoke, Self::MODULE, index)
    }

    /// Attaches the witness node's agent; its intent must have been sent already.
    async fn attach(spoke: &Spoke, proxy: &ProxyProcess, ca: &str, index: usize) -> Result<Self> {
        ensure!(
            spoke.node_name(index) > spoke.node_name(0),
            "the witness must sort after the node it watches"
        );
        let mut agent = AgentConn::attach(
            proxy.agent_addr,
            ca,
            Some(&spoke.agent_token(index).await?),
            hello(spoke.node_name(index)),
        )
        .await?;
        let desired = agent.next_desired().await?;
        ensure!(
            desired
                .modules
                .iter()
                .any(|m| m.key.as_ref().is_some_and(|k| k.name == Self::MODULE)),
            "{desired:?}"
        );
        Ok(Self {
            agent,
            index,
            label: format!(
                "kmm.node.kubernetes.io/{}.{}.ready",
                spoke.namespace,
                Self::MODULE
            ),
            revision: desired.revision,
            loaded: false,
        })
    }

    /// Flips the witness's label (a successful load, then a failed one, ...) and waits
    /// until the node shows it.
    async fn catch_up(&mut self, spoke: &Spoke) -> Result<()> {
        let mut report = event(spoke, Self::MODULE, Action::Load, self.revision);
        if self.loaded {
            report.outcome = Outcome::Failed.into();
            report.error = "the witness fails on purpose".into();
        }
        self.agent.send(report).await?;
        self.loaded = !self.loaded;
        let (index, label, loaded) = (self.index, &self.label, self.loaded);
        wait_until("the witness's label to flip", WAIT, || async move {
            let labels = spoke.node_labels(index).await.map_err(|e| e.to_string())?;
            (labels.contains_key(label) == loaded)
                .then_some(())
                .ok_or(format!("{labels:?}"))
        })
        .await?;
        Ok(())
    }
}

struct Started {
    spoke: Spoke,
    pki: HubPki,
    hub: HubPeer,
    proxy: ProxyProcess,
    ca: String,
}

async fn start(prefix: &str) -> Result<Started> {
    let spoke = Spoke::get(prefix).await?;
    let kubeconfig = spoke.proxy_kubeconfig().await?;
    let pki = HubPki::new("first")?;
    let hub = HubPeer::start(&pki, support::free_addr()).await?;
    let mut proxy = ProxyProcess::start(
        &kubeconfig,
        &spoke.namespace,
        &hub.address(),
        &pki,
        spoke.dir.path(),
    )?;
    proxy.wait_ready().await?;
    let ca = spoke.agent_ca().await?;
    Ok(Started {
        spoke,
        pki,
        hub,
        proxy,
        ca,
    })
}

#[tokio::test]
async fn inventory_and_agents_bound_to_their_own_node() -> Result<()> {
    let Started {
        spoke,
        pki: _pki,
        mut hub,
        proxy,
        ca,
    } = start("proxy-bind").await?;

    let mut stream = hub.next_stream().await?;
    let proxy_message::Message::Hello(h) = stream.next().await? else {
        bail!("first message is not ProxyHello");
    };
    ensure!(
        h.applied_intent_revision == 0,
        "fresh proxy applied nothing: {h:?}"
    );
    let proxy_message::Message::Inventory(inventory) = stream.next().await? else {
        bail!("second message is not KernelInventory");
    };
    let distinct: BTreeSet<String> = (0..spoke.nodes.len()).map(|i| spoke.kernel(i)).collect();
    let expected: Vec<String> = distinct.into_iter().collect();
    let got: Vec<String> = inventory
        .kernels
        .iter()
        .map(|k| k.release.clone())
        .collect();
    ensure!(
        got == expected,
        "inventory {got:?} != the nodes' distinct kernels, sorted {expected:?}"
    );
    let proxy_message::Message::DevicePlugins(plugins) = stream.next().await? else {
        bail!("third message is not DevicePluginReport");
    };
    ensure!(plugins.plugins.is_empty(), "{plugins:?}");
    let proxy_message::Message::SpokeImages(resolved) = stream.next().await? else {
        bail!("fourth message is not SpokeImageReport");
    };
    ensure!(
        resolved.images.is_empty(),
        "nothing was asked: {resolved:?}"
    );
    let proxy_message::Message::Status(full) = stream.next().await? else {
        bail!("fifth message is not NodeStatusReport: the plugin counts come before it");
    };
    ensure!(full.full && full.statuses.is_empty(), "{full:?}");

    // The module runs on node 1 only; node 0 gets a module whose kernel is unresolved.
    let mut unresolved = intent_for_node(&spoke, "nomap", 0);
    for target in &mut unresolved.kernels {
        target.target = Some(Target::Unresolved(Unresolved {
            reason: "NoKernelMapping".into(),
            message: format!("no kernel mapping matches {}", target.kernel),
        }));
    }
    stream.send(snapshot(
        1,
        vec![intent_for_node(&spoke, "hello", 1), unresolved],
    ))?;

    let node0 = spoke.node_name(0).to_string();
    let node1 = spoke.node_name(1).to_string();
    let mut agent0 = attach_agent(&proxy, &ca, &spoke, 0, &node0).await?;
    let desired0 = agent0.next_desired().await?;
    ensure!(
        desired0.revision > 0 && desired0.modules.is_empty(),
        "node 0 must get nothing: {desired0:?}"
    );

    let mut agent1 = attach_agent(&proxy, &ca, &spoke, 1, &node1).await?;
    let desired1 = agent1.next_desired().await?;
    ensure!(desired1.modules.len() == 1, "{}", desired1.modules.len());
    let module = &desired1.modules[0];
    let load = module.load.as_ref().expect("a load");
    ensure!(load.image == format!("registry.example/hello:{}", spoke.kernel(1)));
    let credential = module.credential.as_ref().expect("the credential");
    ensure!(credential.content == Some(Content::DockerConfigJson(CREDENTIAL.to_vec())));

    // As upstream, a node no mapping applies to is skipped, not failed.
    let skipped = stream
        .wait_status("nomap SKIPPED on node 0", |s| {
            is(s, "nomap", &node0, ModuleState::Skipped)
        })
        .await?;
    ensure!(skipped.reason == "NoKernelMapping", "{skipped:?}");
    ensure!(skipped.message.contains(&spoke.kernel(0)), "{skipped:?}");

    // Node 0's token cannot ask for node 1's work.
    let refused = AgentConn::attach(
        proxy.agent_addr,
        &ca,
        Some(&spoke.agent_token(0).await?),
        hello(&node1),
    )
    .await
    .err()
    .expect("a node 0 token naming node 1 must be refused");
    ensure!(refused.code() == Code::PermissionDenied, "{refused:?}");
    ensure!(refused.message().contains(&node0), "{refused:?}");

    let other_audience = spoke
        .token("kmm", "kmm-node-agent", 0, "some-other-audience")
        .await?;
    let refused = AgentConn::attach(proxy.agent_addr, &ca, Some(&other_audience), hello(&node0))
        .await
        .err()
        .expect("a token for another audience must be refused");
    ensure!(refused.code() == Code::Unauthenticated, "{refused:?}");

    let refused = AgentConn::attach(proxy.agent_addr, &ca, None, hello(&node0))
        .await
        .err()
        .expect("no token must be refused");
    ensure!(refused.code() == Code::Unauthenticated, "{refused:?}");

    let intruder = ServiceAccount {
        metadata: ObjectMeta {
            name: Some("intruder".into()),
            ..Default::default()
        },
        ..Default::default()
    };
    Api::<ServiceAccount>::namespaced(spoke.client.clone(), &spoke.namespace)
        .create(&PostParams::default(), &intruder)
        .await?;
    let intruder_token = spoke
        .token(&spoke.namespace, "intruder", 0, support::AUDIENCE)
        .await?;
    let refused = AgentConn::attach(proxy.agent_addr, &ca, Some(&intruder_token), hello(&node0))
        .await
        .err()
        .expect("another ServiceAccount's token must be refused");
    ensure!(refused.code() == Code::PermissionDenied, "{refused:?}");
    ensure!(refused.message().contains("intruder"), "{refused:?}");

    let metrics = proxy.metrics().await?;
    for reason in [
        "node_mismatch",
        "unauthenticated",
        "missing_token",
        "forbidden",
    ] {
        let line = format!("kmm_spoke_proxy_agent_refusals_total{{reason=\"{reason}\"}} 1");
        ensure!(metrics.contains(&line), "no {line} in:\n{metrics}");
    }
    ensure!(
        metrics.contains("kmm_spoke_proxy_hub_connected 1"),
        "{metrics}"
    );

    let secret = Api::<Secret>::namespaced(spoke.client.clone(), &spoke.namespace)
        .get("kmm-spoke-proxy-tls")
        .await?;
    let keys: Vec<_> = secret.data.unwrap_or_default().into_keys().collect();
    ensure!(
        keys == ["ca.crt", "ca.key", "tls.crt", "tls.key"],
        "{keys:?}"
    );
    let log = proxy.log_text();
    ensure!(
        !log.contains("dGVzdDp0ZXN0"),
        "a credential reached the log"
    );

    drop((agent0, agent1));
    proxy.stop().await?;
    spoke.cleanup().await
}

#[tokio::test]
async fn labels_on_proof_hub_loss_changes_nothing_unload_removes_labels() -> Result<()> {
    let Started {
        spoke,
        pki,
        mut hub,
        proxy,
        ca,
    } = start("proxy-labels").await?;
    let node = spoke.node_name(0).to_string();
    let ready = format!("kmm.node.kubernetes.io/{}.hello.ready", spoke.namespace);
    let version_ready = format!(
        "kmm.node.kubernetes.io/{}.hello.version.ready",
        spoke.namespace
    );

    let mut stream = hub.next_stream().await?;
    stream.send(snapshot(
        1,
        vec![
            intent_for_node(&spoke, "hello", 0),
            Witness::intent(&spoke, 1),
        ],
    ))?;
    let mut agent = attach_agent(&proxy, &ca, &spoke, 0, &node).await?;
    let desired = agent.next_desired().await?;
    ensure!(
        desired.modules.len() == 1 && !desired.modules[0].unload,
        "{desired:?}"
    );
    stream
        .wait_status("PENDING", |s| is(s, "hello", &node, ModuleState::Pending))
        .await?;
    let mut witness = Witness::attach(&spoke, &proxy, &ca, 1).await?;
    witness.catch_up(&spoke).await?;
    ensure!(
        !spoke.node_labels(0).await?.contains_key(&ready),
        "ready label before any proof"
    );

    agent
        .send(event(&spoke, "hello", Action::Load, desired.revision))
        .await?;
    let loaded = stream
        .wait_status("LOADED", |s| is(s, "hello", &node, ModuleState::Loaded))
        .await?;
    ensure!(loaded.loaded_version == "v1", "{loaded:?}");
    wait_until("ready labels on the node", WAIT, || async {
        let labels = spoke.node_labels(0).await.map_err(|e| e.to_string())?;
        match (labels.get(&ready), labels.get(&version_ready)) {
            (Some(r), Some(v)) if r.is_empty() && v == "v1" => Ok(()),
            _ => Err(format!("{labels:?}")),
        }
    })
    .await?;

    // The hub goes away: nothing changes for the agent, and when a hub is back the proxy
    // resumes from the applied revision and resends the full status.
    let addr = hub.addr;
    drop(stream);
    hub.stop().await;
    let mut hub = HubPeer::start(&pki, addr).await?;
    let mut stream = hub.next_stream().await?;
    let proxy_message::Message::Hello(h) = stream.next().await? else {
        bail!("first message after reconnect is not ProxyHello");
    };
    ensure!(h.applied_intent_revision == 1, "{h:?}");
    let proxy_message::Message::Inventory(_) = stream.next().await? else {
        bail!("no inventory after reconnect");
    };
    let proxy_message::Message::DevicePlugins(_) = stream.next().await? else {
        bail!("no device plugin counts after reconnect");
    };
    let proxy_message::Message::SpokeImages(_) = stream.next().await? else {
        bail!("no resolved images after reconnect");
    };
    let proxy_message::Message::Status(full) = stream.next().await? else {
        bail!("no status after reconnect");
    };
    ensure!(full.full, "{full:?}");
    ensure!(
        full.statuses
            .iter()
            .any(|s| is(s, "hello", &node, ModuleState::Loaded)),
        "{full:?}"
    );
    if let Some(unexpected) = agent.quiet_for(Duration::from_millis(500)).await {
        bail!("the agent got something while the hub was away: {unexpected}");
    }
    ensure!(
        spoke.node_labels(0).await?.contains_key(&ready),
        "labels lost with the hub"
    );

    // Explicit unload: labels stay until the agent confirms, then go.
    let mut gone = intent_for_node(&spoke, "hello", 0);
    gone.unload = true;
    stream.send(snapshot(2, vec![gone, Witness::intent(&spoke, 1)]))?;
    let desired = agent.next_desired().await?;
    ensure!(
        desired.modules.len() == 1 && desired.modules[0].unload,
        "{desired:?}"
    );
    ensure!(
        desired.modules[0].credential.is_none(),
        "an unload carries no credential"
    );
    witness.catch_up(&spoke).await?;
    ensure!(
        spoke.node_labels(0).await?.contains_key(&ready),
        "labels removed before proof"
    );
    agent
        .send(event(&spoke, "hello", Action::Unload, desired.revision))
        .await?;
    stream
        .wait_status("UNLOADED", |s| is(s, "hello", &node, ModuleState::Unloaded))
        .await?;
    wait_until("ready labels removed", WAIT, || async {
        let labels = spoke.node_labels(0).await.map_err(|e| e.to_string())?;
        if labels.contains_key(&ready) || labels.contains_key(&version_ready) {
            Err(format!("{labels:?}"))
        } else {
            Ok(())
        }
    })
    .await?;

    // SIGTERM with the agent still attached: the proxy ends the stream and exits 0.
    proxy.stop().await?;
    let ended = agent
        .next_desired()
        .await
        .expect_err("the stream must end when the proxy stops");
    ensure!(format!("{ended:#}").contains("shutting down"), "{ended:#}");
    spoke.cleanup().await
}

#[tokio::test]
async fn renewed_client_certificate_is_used_for_the_next_stream() -> Result<()> {
    let Started {
        spoke,
        pki,
        mut hub,
        proxy,
        ca: _,
    } = start("proxy-renew").await?;
    let first = hub.next_stream().await?;
    ensure!(
        first.client_cert_contains("agent:first"),
        "first stream's certificate"
    );

    pki.issue_client("renewed")?;
    let mut second = hub.next_stream().await?;
    ensure!(
        second.client_cert_contains("agent:renewed"),
        "the stream after renewal must use the renewed certificate"
    );
    let proxy_message::Message::Hello(_) = second.next().await? else {
        bail!("the new stream does not start with ProxyHello");
    };
    drop(first);
    proxy.stop().await?;

    // A restarted proxy keeps its CA (agents keep trusting it) and issues a new serving
    // certificate; other keys of the CA ConfigMap are left alone.
    let secrets = Api::<Secret>::namespaced(spoke.client.clone(), &spoke.namespace);
    let data = |s: Secret, key: &str| s.data.and_then(|d| d.get(key).cloned());
    let before = secrets.get("kmm-spoke-proxy-tls").await?;
    let (ca_before, tls_before) = (data(before.clone(), "ca.crt"), data(before, "tls.crt"));
    let maps = Api::<ConfigMap>::namespaced(spoke.client.clone(), &spoke.namespace);
    let extra = serde_json::json!({"data": {"note": "kept"}});
    maps.patch(
        "kmm-agent-ca",
        &PatchParams::default(),
        &Patch::Merge(&extra),
    )
    .await?;
    let mut restarted = ProxyProcess::start(
        &spoke.proxy_kubeconfig().await?,
        &spoke.namespace,
        &hub.address(),
        &pki,
        spoke.dir.path(),
    )?;
    restarted.wait_ready().await?;
    let after = secrets.get("kmm-spoke-proxy-tls").await?;
    ensure!(
        data(after.clone(), "ca.crt") == ca_before,
        "the CA changed on restart"
    );
    ensure!(
        data(after, "tls.crt") != tls_before,
        "the serving certificate was not reissued"
    );
    let map = maps.get("kmm-agent-ca").await?.data.unwrap_or_default();
    ensure!(
        map.get("note").map(String::as_str) == Some("kept"),
        "{map:?}"
    );
    ensure!(
        map.get("ca.crt").map(|c| c.as_bytes().to_vec()) == ca_before.map(|c| c.0),
        "the published CA differs from the Secret's"
    );
    restarted.stop().await?;
    spoke.cleanup().await
}

#[tokio::test]
async fn deselected_node_gets_an_explicit_unload_and_a_newer_stream_wins() -> Result<()> {
    let Started {
        spoke,
        pki: _pki,
        mut hub,
        proxy,
        ca,
    } = start("proxy-deselect").await?;
    let node = spoke.node_name(0).to_string();
    let other = spoke.node_name(1).to_string();
    let selector = format!("kmm-fleet.dev/test-{}", spoke.namespace);
    let ready = format!("kmm.node.kubernetes.io/{}.hello.ready", spoke.namespace);
    spoke.set_node_label(0, &selector, Some("yes")).await?;

    let mut intent = intent_for_node(&spoke, "hello", 0);
    intent.node_selector = [(selector.clone(), "yes".to_string())].into();
    let mut stream = hub.next_stream().await?;
    stream.send(snapshot(1, vec![intent, Witness::intent(&spoke, 2)]))?;

    let mut agent = attach_agent(&proxy, &ca, &spoke, 0, &node).await?;
    let desired = agent.next_desired().await?;
    ensure!(
        desired.modules.len() == 1 && !desired.modules[0].unload,
        "{desired:?}"
    );

    // A newer stream for the same node replaces the older one, and gets the same work.
    let mut newer = attach_agent(&proxy, &ca, &spoke, 0, &node).await?;
    let again = newer.next_desired().await?;
    ensure!(
        again == desired,
        "the newer stream gets the node's current work"
    );
    let ended = agent
        .next_desired()
        .await
        .expect_err("the older stream must end");
    ensure!(format!("{ended:#}").contains("replaced"), "{ended:#}");
    let mut agent = newer;

    agent
        .send(event(&spoke, "hello", Action::Load, desired.revision))
        .await?;
    wait_until("ready label", WAIT, || async {
        let labels = spoke.node_labels(0).await.map_err(|e| e.to_string())?;
        labels
            .contains_key(&ready)
            .then_some(())
            .ok_or(format!("{labels:?}"))
    })
    .await?;

    // A node that never had the module gets no unload for it.
    let mut bystander = attach_agent(&proxy, &ca, &spoke, 1, &other).await?;
    let nothing = bystander.next_desired().await?;
    ensure!(nothing.modules.is_empty(), "{nothing:?}");

    let mut witness = Witness::attach(&spoke, &proxy, &ca, 2).await?;
    spoke.set_node_label(0, &selector, None).await?;
    let desired = agent.next_desired().await?;
    ensure!(
        desired.modules.len() == 1 && desired.modules[0].unload,
        "{desired:?}"
    );
    witness.catch_up(&spoke).await?;
    ensure!(
        spoke.node_labels(0).await?.contains_key(&ready),
        "labels removed before proof"
    );
    agent
        .send(event(&spoke, "hello", Action::Unload, desired.revision))
        .await?;
    stream
        .wait_status("UNLOADED", |s| is(s, "hello", &node, ModuleState::Unloaded))
        .await?;
    wait_until("ready label removed", WAIT, || async {
        let labels = spoke.node_labels(0).await.map_err(|e| e.to_string())?;
        (!labels.contains_key(&ready))
            .then_some(())
            .ok_or(format!("{labels:?}"))
    })
    .await?;

    drop((agent, bystander, witness));
    proxy.stop().await?;
    spoke.cleanup().await
}

/// Two proxies starting together (a rolling update, a rescheduled Pod) each read, create
/// or update the serving Secret; whoever writes second must read the first one's CA and
/// issue from it, not fail or overwrite it: every agent trusts one CA.
#[tokio::test]
async fn proxies_starting_together_agree_on_one_ca() -> Result<()> {
    let spoke = Spoke::get("proxy-race").await?;
    let client = kmm_e2e::fleet::client_for(&spoke.proxy_kubeconfig().await?).await?;
    let sans = kmm_spoke_proxy::agent_tls::default_sans(&spoke.namespace);
    let secrets: Api<Secret> = Api::namespaced(spoke.client.clone(), &spoke.namespace);
    // Each round from nothing (both create) and from an existing Secret (both update).
    for round in 0..4 {
        if round % 2 == 0 {
            let _ = secrets
                .delete("kmm-spoke-proxy-tls", &Default::default())
                .await;
        }
        let ensure = || {
            kmm_spoke_proxy::agent_tls::ensure(
                &client,
                &spoke.namespace,
                &sans,
                Duration::from_secs(3600),
            )
        };
        let (first, second) = tokio::join!(ensure(), ensure());
        let (first, second) = (first?, second?);
        ensure!(
            first.ca_pem == second.ca_pem,
            "round {round}: two CAs for one proxy"
        );
        let stored = secrets
            .get("kmm-spoke-proxy-tls")
            .await?
            .data
            .unwrap_or_default();
        ensure!(
            stored.get("ca.crt").map(|c| c.0.as_slice()) == Some(first.ca_pem.as_bytes()),
            "round {round}: the Secret holds another CA"
        );
        ensure!(
            spoke.agent_ca().await? == first.ca_pem,
            "round {round}: the agents are told another CA"
        );
    }
    spoke.cleanup().await
}

/// An administrator replaces the CA in the Secret (or deletes the Secret): the running
/// proxy serves a certificate of the new CA and publishes it, without a restart.
#[tokio::test]
async fn a_replaced_ca_is_served_from_without_a_restart() -> Result<()> {
    let Started {
        spoke,
        pki: _pki,
        hub: _hub,
        proxy,
        ca,
    } = start("proxy-ca-rotation").await?;
    let before = support::served_certificate(proxy.agent_addr, &ca).await?;
    let new_ca = kmm_runtime::pki::CertificateAuthority::generate(
        "rotated",
        Duration::from_secs(24 * 3600),
    )?;
    let secrets: Api<Secret> = Api::namespaced(spoke.client.clone(), &spoke.namespace);
    let mut secret = secrets.get("kmm-spoke-proxy-tls").await?;
    let stored = secret.data.get_or_insert_default();
    stored.insert("ca.crt".into(), ByteString(new_ca.cert_pem().into()));
    stored.insert("ca.key".into(), ByteString(new_ca.key_pem().into()));
    secrets
        .replace("kmm-spoke-proxy-tls", &PostParams::default(), &secret)
        .await?;
    wait_until("a certificate of the new CA served", WAIT, || async {
        support::served_certificate(proxy.agent_addr, new_ca.cert_pem())
            .await
            .map(drop)
            .map_err(|e| format!("{e:#}"))
    })
    .await?;
    ensure!(
        support::served_certificate(proxy.agent_addr, &ca)
            .await
            .is_err(),
        "the old CA still verifies the served certificate"
    );
    ensure!(
        spoke.agent_ca().await? == new_ca.cert_pem(),
        "the agents are not told the new CA"
    );
    ensure!(!before.is_empty());

    // Deleted: a new CA is made, served and published.
    secrets
        .delete("kmm-spoke-proxy-tls", &Default::default())
        .await?;
    let published = wait_until("a new CA published", WAIT, || async {
        let published = spoke.agent_ca().await.map_err(|e| e.to_string())?;
        (published != new_ca.cert_pem())
            .then_some(published)
            .ok_or("the deleted CA is still published".to_owned())
    })
    .await?;
    wait_until("a certificate of the newest CA served", WAIT, || async {
        support::served_certificate(proxy.agent_addr, &published)
            .await
            .map(drop)
            .map_err(|e| format!("{e:#}"))
    })
    .await?;
    proxy.stop().await?;
    spoke.cleanup().await
}

/// The serving certificate is re-issued while the proxy runs, well before it expires.
#[tokio::test]
async fn the_serving_certificate_is_renewed_before_it_expires() -> Result<()> {
    let spoke = Spoke::get("proxy-renewal").await?;
    let kubeconfig = spoke.proxy_kubeconfig().await?;
    let pki = HubPki::new("renewal")?;
    let hub = HubPeer::start(&pki, support::free_addr()).await?;
    // Renewed with a third (10 s) of its 30 s left.
    let mut proxy = ProxyProcess::start_with(
        &kubeconfig,
        &spoke.namespace,
        &hub.address(),
        &pki,
        spoke.dir.path(),
        &["--agent-cert-validity-seconds", "30"],
    )?;
    proxy.wait_ready().await?;
    let ca = spoke.agent_ca().await?;
    let first = support::served_certificate(proxy.agent_addr, &ca).await?;
    let issued = std::time::Instant::now();
    wait_until("a renewed certificate served", WAIT, || async {
        let now = support::served_certificate(proxy.agent_addr, &ca)
            .await
            .map_err(|e| format!("{e:#}"))?;
        (now != first)
            .then_some(())
            .ok_or("the first certificate is still served".to_owned())
    })
    .await?;
    // Due 20 s after issue: not at once (a renewal loop), not after expiry.
    ensure!(
        (Duration::from_secs(10)..Duration::from_secs(30)).contains(&issued.elapsed()),
        "renewed {:?} after the first certificate was served, for a 30 s lifetime",
        issued.elapsed()
    );
    proxy.stop().await?;
    spoke.cleanup().await
}

/// Kubernetes marking a node NotReady and unreachable (its taints, with effect
/// `NoExecute`) never unloads the module the node has; a user's taint does.
#[tokio::test]
async fn a_node_kubernetes_marks_not_ready_keeps_its_module() -> Result<()> {
    let Started {
        spoke,
        pki: _pki,
        mut hub,
        proxy,
        ca,
    } = start("proxy-not-ready").await?;
    let node = spoke.node_name(0).to_string();
    let ready = format!("kmm.node.kubernetes.io/{}.hello.ready", spoke.namespace);
    // Removed from the nodes by cleanup(), as every label named after the namespace.
    let witness_label = format!("kmm-fleet.dev/test-{}", spoke.namespace);
    let mut witness_intent = intent_for_node(&spoke, "witness", 1);
    witness_intent.node_selector = [(witness_label.clone(), "yes".to_string())].into();
    let stream = hub.next_stream().await?;
    stream.send(snapshot(
        1,
        vec![intent_for_node(&spoke, "hello", 0), witness_intent],
    ))?;
    let mut agent = attach_agent(&proxy, &ca, &spoke, 0, &node).await?;
    let desired = agent.next_desired().await?;
    agent
        .send(event(&spoke, "hello", Action::Load, desired.revision))
        .await?;
    wait_until("the ready label", WAIT, || async {
        let labels = spoke.node_labels(0).await.map_err(|e| e.to_string())?;
        labels
            .contains_key(&ready)
            .then_some(())
            .ok_or(format!("{labels:?}"))
    })
    .await?;
    let mut witness = attach_agent(&proxy, &ca, &spoke, 1, spoke.node_name(1)).await?;
    let nothing = witness.next_desired().await?;
    ensure!(nothing.modules.is_empty(), "{nothing:?}");

    spoke
        .set_node_taints(
            0,
            &[
                ("node.kubernetes.io/not-ready", "NoExecute"),
                ("node.kubernetes.io/unreachable", "NoExecute"),
            ],
        )
        .await?;
    // The proxy's Node watch delivers in order: once node 1's later label reaches the
    // witness as work, the proxy has acted on node 0's taints.
    spoke.set_node_label(1, &witness_label, Some("yes")).await?;
    let witnessed = witness.next_desired().await?;
    ensure!(witnessed.modules.len() == 1, "{witnessed:?}");
    if let Some(unexpected) = agent.quiet_for(Duration::from_millis(500)).await {
        bail!("a NotReady node was sent work: {unexpected}");
    }
    ensure!(
        spoke.node_labels(0).await?.contains_key(&ready),
        "a NotReady node lost its ready label"
    );

    // A user's taint beside them does unload.
    spoke
        .set_node_taints(
            0,
            &[
                ("node.kubernetes.io/not-ready", "NoExecute"),
                ("example.com/drain", "NoExecute"),
            ],
        )
        .await?;
    let desired = agent.next_desired().await?;
    ensure!(
        desired.modules.len() == 1 && desired.modules[0].unload,
        "{desired:?}"
    );
    spoke.set_node_taints(0, &[]).await?;
    drop((agent, witness));
    proxy.stop().await?;
    spoke.cleanup().await
}

/// The value of counter `name` on the proxy's `/metrics`.
async fn counter(proxy: &ProxyProcess, name: &str) -> Result<u64> {
    let text = proxy.metrics().await?;
    let prefix = format!("kmm_spoke_proxy_{name}_total ");
    text.lines()
        .find_map(|l| l.strip_prefix(&prefix)?.trim().parse().ok())
        .ok_or_else(|| anyhow::anyhow!("no counter {name} in:\n{text}"))
}

/// An agent reconnecting costs one TokenReview, not one per attach; clients attaching
/// with tokens of their own making cannot make the proxy review more than its rate.
#[tokio::test]
async fn token_reviews_are_cached_and_rate_limited() -> Result<()> {
    let Started {
        spoke,
        pki: _pki,
        hub: _hub,
        proxy,
        ca,
    } = start("proxy-reviews").await?;
    let token = spoke.agent_token(0).await?;
    for _ in 0..10 {
        let mut agent = AgentConn::attach(
            proxy.agent_addr,
            &ca,
            Some(&token),
            hello(spoke.node_name(0)),
        )
        .await?;
        // Attached: the stream answers (no intents yet, so it stays quiet).
        ensure!(
            agent.quiet_for(Duration::from_millis(50)).await.is_none(),
            "the stream ended"
        );
    }
    ensure!(
        counter(&proxy, "token_reviews").await? == 1,
        "one token, one review"
    );
    ensure!(counter(&proxy, "token_review_cache_hits").await? >= 9);

    // Made-up tokens, all at once: most are refused without a review.
    let attempts = (0..120).map(|i| {
        let ca = ca.clone();
        let node = spoke.node_name(0).to_string();
        async move {
            AgentConn::attach(
                proxy.agent_addr,
                &ca,
                Some(&format!("made-up-{i}")),
                hello(&node),
            )
            .await
            .err()
            .map(|status| status.code())
        }
    });
    let started = std::time::Instant::now();
    let codes = futures::future::join_all(attempts).await;
    let reviews = counter(&proxy, "token_reviews").await? - 1;
    let allowed = 50 + 10 * (started.elapsed().as_secs() + 1);
    ensure!(
        reviews <= allowed,
        "{reviews} reviews for 120 made-up tokens in {:?}",
        started.elapsed()
    );
    ensure!(
        codes.contains(&Some(Code::ResourceExhausted)),
        "none throttled: {codes:?}"
    );
    ensure!(
        codes
            .iter()
            .all(|c| matches!(c, Some(Code::ResourceExhausted | Code::Unauthenticated))),
        "{codes:?}"
    );
    proxy.stop().await?;
    spoke.cleanup().await
}

/// An agent that floods the proxy with events is cut off; another node's agent keeps
/// its stream and its work.
#[tokio::test]
async fn a_flooding_agent_is_cut_off_without_affecting_others() -> Result<()> {
    let Started {
        spoke,
        pki: _pki,
        mut hub,
        proxy,
        ca,
    } = start("proxy-flood").await?;
    let stream = hub.next_stream().await?;
    stream.send(snapshot(
        1,
        vec![
            intent_for_node(&spoke, "hello", 0),
            intent_for_node(&spoke, "other", 1),
        ],
    ))?;
    let mut flooder = attach_agent(&proxy, &ca, &spoke, 0, spoke.node_name(0)).await?;
    let desired = flooder.next_desired().await?;
    let mut other = attach_agent(&proxy, &ca, &spoke, 1, spoke.node_name(1)).await?;
    other.next_desired().await?;
    for _ in 0..1000 {
        if flooder
            .send(event(&spoke, "hello", Action::Load, desired.revision))
            .await
            .is_err()
        {
            break;
        }
    }
    let ended = loop {
        match flooder.next_desired().await {
            Ok(_) => continue,
            Err(e) => break format!("{e:#}"),
        }
    };
    ensure!(
        ended.contains("too many events") || ended.contains("events a second"),
        "{ended}"
    );
    // The other node is unaffected: its event counts and new work reaches it.
    other.send(event(&spoke, "other", Action::Load, 1)).await?;
    stream.send(snapshot(
        2,
        vec![
            intent_for_node(&spoke, "hello", 0),
            intent_for_node(&spoke, "other", 1),
            intent_for_node(&spoke, "more", 1),
        ],
    ))?;
    let more = other.next_desired().await?;
    ensure!(more.modules.len() == 2, "{more:?}");
    drop((flooder, other));
    proxy.stop().await?;
    spoke.cleanup().await
}

/// An agent of node `i` (its real node-bound token) attached to `proxy`, saying hello as
/// `node`.
async fn attach_agent(
    proxy: &ProxyProcess,
    ca: &str,
    spoke: &Spoke,
    i: usize,
    node: &str,
) -> Result<AgentConn> {
    Ok(AgentConn::attach(
        proxy.agent_addr,
        ca,
        Some(&spoke.agent_token(i).await?),
        hello(node),
    )
    .await?)
}

/// `intent` at `version`, with the device plugin `image`.
fn with_plugin(mut intent: ModuleIntent, version: &str) -> ModuleIntent {
    for kernel in &mut intent.kernels {
        if let Some(Target::Load(load)) = &mut kernel.target {
            load.version = version.into();
        }
    }
    intent.device_plugin = Some(DevicePlugin {
        spec_json: r#"{"container":{"image":"registry.example/plugin:1"}}"#.into(),
        ..DevicePlugin::default()
    });
    intent
}

/// Waits until the module's only plugin Pod is on `node`.
async fn plugin_pod_on(spoke: &Spoke, module: &str, node: &str, what: &str) -> Result<()> {
    wait_until(what, WAIT, || async {
        let nodes = plugin_pods(spoke, module)
            .await
            .map_err(|e| e.to_string())?;
        (nodes == [node]).then_some(()).ok_or(format!("{nodes:?}"))
    })
    .await?;
    Ok(())
}

/// The nodes the module's device plugin Pods are bound to.
async fn plugin_pods(spoke: &Spoke, module: &str) -> Result<Vec<String>> {
    let pods: Api<Pod> = Api::namespaced(spoke.client.clone(), &spoke.namespace);
    let list = pods
        .list(&ListParams::default().labels(&format!("kmm.sigs.x-k8s.io/device-plugin={module}")))
        .await?;
    Ok(list
        .items
        .iter()
        .filter_map(|p| p.spec.as_ref()?.node_name.clone())
        .collect())
}

#[tokio::test]
async fn a_device_plugin_runs_where_its_module_is_loaded_and_stops_before_it_changes() -> Result<()>
{
    let Started {
        spoke,
        pki: _pki,
        mut hub,
        proxy,
        ca,
    } = start("proxy-plugin").await?;
    let node = spoke.node_name(0).to_string();
    let label = kmm_api::labels::device_plugin_scheduling_label(&spoke.namespace, "plug");
    let plugin_ready = kmm_api::labels::device_plugin_ready_label(&spoke.namespace, "plug");
    let mut stream = hub.next_stream().await?;
    stream.send(snapshot(
        1,
        vec![with_plugin(intent_for_node(&spoke, "plug", 0), "v1")],
    ))?;
    let mut agent = attach_agent(&proxy, &ca, &spoke, 0, &node).await?;
    let desired = agent.next_desired().await?;
    let daemon_sets: Api<DaemonSet> = Api::namespaced(spoke.client.clone(), &spoke.namespace);
    let set = wait_until("the plugin's DaemonSet", WAIT, || async {
        daemon_sets
            .get_opt("plug-device-plugin")
            .await
            .map_err(|e| e.to_string())?
            .ok_or_else(|| "not yet".to_owned())
    })
    .await?;
    let selector = set.spec.unwrap().template.spec.unwrap().node_selector;
    ensure!(
        selector == Some([(label.clone(), String::new())].into()),
        "{selector:?}"
    );
    ensure!(
        plugin_pods(&spoke, "plug").await?.is_empty(),
        "a plugin Pod before the module is loaded"
    );

    agent
        .send(event(&spoke, "plug", Action::Load, desired.revision))
        .await?;
    plugin_pod_on(&spoke, "plug", &node, "the plugin's Pod on the loaded node").await?;
    // The hub hears how many plugin Pods run where they should.
    loop {
        if let proxy_message::Message::DevicePlugins(report) = stream.next().await? {
            let counted = report
                .plugins
                .iter()
                .find(|p| p.module.as_ref().is_some_and(|m| m.name == "plug"))
                .map(|p| (p.desired, p.available));
            if counted == Some((1, 1)) {
                break;
            }
        }
    }

    // v2: the node keeps v1 until its plugin Pod is gone, and only then gets v2.
    stream.send(snapshot(
        2,
        vec![with_plugin(intent_for_node(&spoke, "plug", 0), "v2")],
    ))?;
    stream
        .wait_status("DevicePluginStopping", |s| {
            is(s, "plug", &node, ModuleState::Pending) && s.reason == "DevicePluginStopping"
        })
        .await?;
    let moved = loop {
        let desired = agent.next_desired().await?;
        let version = desired.modules[0].load.as_ref().map(|l| l.version.clone());
        if version.as_deref() == Some("v2") {
            break desired;
        }
        ensure!(version.as_deref() == Some("v1"), "{desired:?}");
    };
    ensure!(
        plugin_pods(&spoke, "plug").await?.is_empty(),
        "v2 was given while the plugin Pod still existed"
    );
    let labels = spoke.node_labels(0).await?;
    ensure!(
        !labels.contains_key(&label) && !labels.contains_key(&plugin_ready),
        "a plugin label stayed during the change: {labels:?}"
    );
    agent
        .send(ModuleEvent {
            version: "v2".into(),
            ..event(&spoke, "plug", Action::Load, moved.revision)
        })
        .await?;
    plugin_pod_on(&spoke, "plug", &node, "the plugin back once v2 is loaded").await?;

    // Unload: the DaemonSet goes, and the unload waits for its Pod.
    let mut gone = with_plugin(intent_for_node(&spoke, "plug", 0), "v2");
    gone.unload = true;
    stream.send(snapshot(3, vec![gone]))?;
    let unload = loop {
        let desired = agent.next_desired().await?;
        if desired.modules.iter().any(|m| m.unload) {
            break desired;
        }
    };
    ensure!(
        plugin_pods(&spoke, "plug").await?.is_empty(),
        "unloaded while the plugin Pod still existed: {unload:?}"
    );
    wait_until("the DaemonSet deleted", WAIT, || async {
        match daemon_sets.get_opt("plug-device-plugin").await {
            Ok(None) => Ok(()),
            other => Err(format!("{other:?}")),
        }
    })
    .await?;
    proxy.stop().await?;
    spoke.cleanup().await
}
