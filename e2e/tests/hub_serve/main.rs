//! `kmm-hub serve` against the local fleet's real hub API server (real OCM
//! ManagedClusters spoke1 and spoke2), with a test spoke proxy speaking `Hub.Sync`.
//! Each test runs its own hub in its own namespace, managing only its own modules.

mod addon;
mod admission;
mod certificates;
mod device_plugins;
mod finalizers;
mod images;
mod leadership;
mod placement;
mod rollout;
mod support;

use std::time::Duration;

use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::api::events::v1::Event;
use kmm_api::ManagedClusterModule;
use kmm_api::ocm::MANAGED_CLUSTER;
use kmm_proto::v1::{ModuleState, kernel_target::Target, pull_credential::Content};
use kmm_runtime::pki::{CertificateAuthority, Leaf};
use kube::Api;
use kube::api::{DeleteParams, ListParams, ObjectMeta, Patch, PatchParams, PostParams};
use serde_json::json;

use support::*;

#[tokio::test]
async fn ca_secret_is_created_once_and_reused_across_restarts() {
    let fleet = fleet().await;
    let (hub, namespace) = TestHub::start(&fleet, WAIT).await;
    let first = hub.ca_secret().await;
    assert_eq!(first.type_.as_deref(), Some("kubernetes.io/tls"));
    let mut proxy = hub.proxy("spoke1", &[MAPPED_KERNEL]).await;
    proxy.next_snapshot().await;
    hub.stop().await;

    let hub = TestHub::start_in(&fleet, &namespace.name, WAIT).await;
    let mut proxy = hub.proxy("spoke1", &[MAPPED_KERNEL]).await;
    proxy.next_snapshot().await;
    let second = hub.ca_secret().await;
    assert_eq!(first.data, second.data, "the CA is never overwritten");
    assert_eq!(
        first.metadata.resource_version,
        second.metadata.resource_version
    );
    hub.clean_up(namespace, &[], &[]).await;
}

/// A hub that restarts (or a new leader) finds the proxies holding what it would send
/// them: it sends nothing, and what follows continues from the revision they hold.
#[tokio::test]
async fn a_restarted_hub_sends_no_snapshot_to_a_proxy_holding_its_intents() {
    let fleet = fleet().await;
    let (hub, namespace) = TestHub::start(&fleet, WAIT).await;
    hub.label_cluster("spoke1", true).await;
    hub.create_module("hello-h", module("1", None)).await;
    let mut proxy = hub.proxy("spoke1", &[MAPPED_KERNEL]).await;
    let held = proxy
        .snapshot_where("hello-h", |s| intent(s, "hello-h").is_some())
        .await;
    let loaded = || {
        vec![node_status(
            "hello-h",
            "spoke1-node1",
            ModuleState::Loaded,
            "",
        )]
    };
    proxy.send_status(true, loaded()).await;
    let ready_at = |generation: i64| {
        move |m: Option<ManagedClusterModule>| {
            let status = m.and_then(|m| m.status).ok_or("no status")?;
            (status.observed_generation == Some(generation)
                && status
                    .conditions
                    .first()
                    .is_some_and(|c| c.status == "True"))
            .then_some(())
            .ok_or_else(|| format!("{status:?}"))
        }
    };
    hub.wait_module("hello-h", "hello-h ready", WAIT, ready_at(1))
        .await;
    drop(proxy);
    hub.stop().await;

    let hub = TestHub::start_in(&fleet, &namespace.name, WAIT).await;
    let mut proxy = hub
        .proxy_holding("spoke1", &[MAPPED_KERNEL], Some(held.clone()))
        .await;
    proxy.send_status(true, loaded()).await;
    let metrics = hub.metrics.clone();
    kmm_e2e::fixture::wait_until("the new hub resumes the stream", WAIT, || async {
        let resumed = metrics.snapshots_resumed.get();
        (resumed == 1)
            .then_some(())
            .ok_or_else(|| format!("{resumed} streams resumed"))
    })
    .await
    .unwrap();
    assert_eq!(
        hub.metrics.snapshots_sent.get(),
        0,
        "the proxy held the snapshot: none is sent"
    );
    // The next change is the revision after the one held, and counts as applied.
    hub.set_version("hello-h", "2").await;
    let next = proxy
        .snapshot_where("hello-h at version 2", |s| {
            intent(s, "hello-h").is_some_and(|i| i.generation == 2)
        })
        .await;
    assert_eq!(next.revision, held.revision + 1);
    proxy.send_status(false, loaded()).await;
    hub.wait_module(
        "hello-h",
        "hello-h ready at generation 2",
        WAIT,
        ready_at(2),
    )
    .await;
    hub.clean_up(namespace, &["hello-h"], &["spoke1"]).await;
}

#[tokio::test]
async fn two_hubs_starting_at_once_share_one_ca() {
    let fleet = fleet().await;
    let namespace = kmm_e2e::fixture::TempNamespace::create(&fleet.hub, "kmm-hub-test")
        .await
        .unwrap();
    let (a, b) = tokio::join!(
        TestHub::start_in(&fleet, &namespace.name, WAIT),
        TestHub::start_in(&fleet, &namespace.name, WAIT),
    );
    // A certificate from the Secret's CA is accepted by both: neither serves another CA.
    let mut to_a = a.proxy("spoke1", &[MAPPED_KERNEL]).await;
    let mut to_b = b.proxy("spoke2", &[MAPPED_KERNEL]).await;
    to_a.next_snapshot().await;
    to_b.next_snapshot().await;
    b.stop().await;
    a.clean_up(namespace, &[], &[]).await;
}

#[tokio::test]
async fn intents_follow_inventory_module_changes_and_cluster_labels() {
    let fleet = fleet().await;
    let (hub, namespace) = TestHub::start(&fleet, WAIT).await;
    let secrets: Api<Secret> = Api::namespaced(fleet.hub.clone(), &namespace.name);
    let pull = br#"{"auths":{"127.0.0.1:5000":{"auth":"dGVzdDp0ZXN0"}}}"#.to_vec();
    secrets
        .create(
            &PostParams::default(),
            &Secret {
                metadata: ObjectMeta {
                    name: Some("pull".into()),
                    ..ObjectMeta::default()
                },
                type_: Some("kubernetes.io/dockerconfigjson".into()),
                data: Some([(".dockerconfigjson".to_string(), ByteString(pull.clone()))].into()),
                ..Secret::default()
            },
        )
        .await
        .unwrap();
    hub.label_cluster("spoke1", true).await;
    hub.create_module("hello-a", module("1", Some("pull")))
        .await;

    let mut proxy = hub.proxy("spoke1", &[MAPPED_KERNEL, UNMAPPED_KERNEL]).await;
    let first = proxy
        .snapshot_where("hello-a is resolved", |s| intent(s, "hello-a").is_some())
        .await;
    let hello = intent(&first, "hello-a").unwrap();
    assert!(!hello.unload);
    assert_eq!(
        hello
            .node_selector
            .get("kubernetes.io/os")
            .map(String::as_str),
        Some("linux")
    );
    let targets: Vec<_> = hello
        .kernels
        .iter()
        .map(|k| (k.kernel.as_str(), k.target.clone().unwrap()))
        .collect();
    let Some((_, Target::Load(load))) = targets.iter().find(|(k, _)| *k == MAPPED_KERNEL) else {
        panic!("{MAPPED_KERNEL} resolves: {targets:?}")
    };
    assert_eq!(load.image, sample_image(MAPPED_KERNEL));
    assert!(
        load.digest.starts_with("sha256:"),
        "the hub pinned the image it found in the registry: {load:?}"
    );
    assert_eq!(load.version, "1");
    assert_eq!(load.pull_credential_id, "pull");
    let Some((_, Target::Unresolved(why))) = targets.iter().find(|(k, _)| *k == UNMAPPED_KERNEL)
    else {
        panic!("{UNMAPPED_KERNEL} has no mapping: {targets:?}")
    };
    assert_eq!(why.reason, "NoKernelMapping");
    assert_eq!(
        first.credentials.len(),
        1,
        "only the referenced credential travels"
    );
    assert_eq!(
        first.credentials[0].content,
        Some(Content::DockerConfigJson(pull))
    );

    // A spec change is a new revision with the new version.
    hub.set_version("hello-a", "2").await;
    let second = proxy
        .snapshot_where("hello-a has version 2", |s| {
            intent(s, "hello-a").is_some_and(|i| {
                i.kernels
                    .iter()
                    .any(|k| matches!(&k.target, Some(Target::Load(l)) if l.version == "2"))
            })
        })
        .await;
    assert!(second.revision > first.revision);

    // A new inventory re-resolves: only the new kernel is present.
    proxy.send_inventory(2, &["6.1.0-56-cloud-amd64"]).await;
    proxy
        .snapshot_where("the new kernel is resolved", |s| {
            intent(s, "hello-a").is_some_and(|i| {
                i.kernels.len() == 1 && i.kernels[0].kernel == "6.1.0-56-cloud-amd64"
            })
        })
        .await;

    // Deselecting the cluster while a node still runs the module: explicit unload.
    proxy
        .send_status(
            true,
            vec![node_status(
                "hello-a",
                "spoke1-node2",
                ModuleState::Loaded,
                "",
            )],
        )
        .await;
    hub.label_cluster("spoke1", false).await;
    proxy
        .snapshot_where("hello-a is unloaded", |s| {
            intent(s, "hello-a").is_some_and(|i| i.unload)
        })
        .await;
    // Confirmed: forgotten (absent), never "unloaded by absence" before.
    proxy
        .send_status(
            false,
            vec![node_status(
                "hello-a",
                "spoke1-node2",
                ModuleState::Unloaded,
                "",
            )],
        )
        .await;
    let last = proxy
        .snapshot_where("hello-a is forgotten", |s| intent(s, "hello-a").is_none())
        .await;
    assert!(
        last.credentials.is_empty(),
        "no credential without an image needing it"
    );
    hub.clean_up(namespace, &["hello-a"], &["spoke1"]).await;
}

#[tokio::test]
async fn identity_comes_from_the_certificate() {
    let fleet = fleet().await;
    let (hub, namespace) = TestHub::start(&fleet, WAIT).await;
    hub.label_cluster("spoke1", true).await;
    hub.create_module("hello-b", module("1", None)).await;

    let mut spoke1 = hub.proxy("spoke1", &[MAPPED_KERNEL]).await;
    spoke1
        .snapshot_where("spoke1 gets hello-b", |s| intent(s, "hello-b").is_some())
        .await;
    let mut spoke2 = hub.proxy("spoke2", &[MAPPED_KERNEL]).await;
    let snapshot = spoke2.next_snapshot().await;
    assert!(
        intent(&snapshot, "hello-b").is_none(),
        "spoke2 is not selected: {snapshot:?}"
    );

    // Signed by the right CA, but not an add-on agent's subject.
    let ca = hub.ca().await;
    let stranger = ca
        .issue(&Leaf::client(
            "system:serviceaccount:default:someone",
            &[],
            Duration::from_secs(600),
        ))
        .unwrap();
    let status = match Proxy::open(hub.channel(&stranger).await.unwrap()).await {
        Ok(mut proxy) => proxy
            .inbound
            .message()
            .await
            .expect_err("the stream is refused"),
        Err(status) => status,
    };
    assert_eq!(status.code(), tonic::Code::PermissionDenied, "{status:?}");
    assert!(
        status
            .message()
            .contains("system:serviceaccount:default:someone"),
        "{status:?}"
    );

    // An add-on agent's subject, but for a cluster the hub does not manage (removed
    // from the fleet while its certificate is still valid).
    let removed = hub.proxy_certificate("no-such-cluster").await;
    let status = match Proxy::open(hub.channel(&removed).await.unwrap()).await {
        Ok(mut proxy) => proxy
            .inbound
            .message()
            .await
            .expect_err("the stream is refused"),
        Err(status) => status,
    };
    assert_eq!(status.code(), tonic::Code::PermissionDenied, "{status:?}");
    assert!(status.message().contains("no-such-cluster"), "{status:?}");
    hub.clean_up(namespace, &["hello-b"], &["spoke1"]).await;
}

/// Connects with `cert` and reads the first answer; `Err` says where it failed.
async fn try_certificate(
    hub: &TestHub,
    cert: &kmm_runtime::pki::IssuedCertificate,
) -> Result<(), String> {
    let channel = hub
        .channel(cert)
        .await
        .map_err(|e| format!("connect: {e:?}"))?;
    let mut proxy = Proxy::open(channel)
        .await
        .map_err(|e| format!("open: {e:?}"))?;
    proxy.send_inventory(1, &[MAPPED_KERNEL]).await;
    proxy
        .inbound
        .message()
        .await
        .map(drop)
        .map_err(|e| format!("first message: {e:?}"))
}

#[tokio::test]
async fn foreign_and_expired_certificates_fail_the_handshake() {
    let fleet = fleet().await;
    let (hub, namespace) = TestHub::start(&fleet, WAIT).await;
    let subject = &format!(
        "system:open-cluster-management:cluster:spoke1:addon:{0}:agent:{0}-agent",
        hub.addon_name
    );
    let good = hub.proxy_certificate("spoke1").await;
    try_certificate(&hub, &good)
        .await
        .expect("the CA's certificate is accepted");

    let foreign = CertificateAuthority::generate("not-the-hub", Duration::from_secs(3600))
        .unwrap()
        .issue(&Leaf::client(subject, &[], Duration::from_secs(3600)))
        .unwrap();
    let error = try_certificate(&hub, &foreign)
        .await
        .expect_err("another CA's certificate is refused");
    // The TLS alert the hub sends, not a gRPC status from the service.
    assert!(error.contains("UnknownCA"), "{error}");

    let mut expired = Leaf::client(subject, &[], Duration::from_secs(3600));
    expired.not_before = time::OffsetDateTime::now_utc() - time::Duration::hours(2);
    expired.not_after = time::OffsetDateTime::now_utc() - time::Duration::hours(1);
    let expired = hub.ca().await.issue(&expired).unwrap();
    let error = try_certificate(&hub, &expired)
        .await
        .expect_err("an expired certificate is refused");
    assert!(error.contains("CertificateExpired"), "{error}");
    hub.clean_up(namespace, &[], &[]).await;
}

#[tokio::test]
async fn a_newer_stream_of_a_cluster_replaces_the_older() {
    let fleet = fleet().await;
    let (hub, namespace) = TestHub::start(&fleet, WAIT).await;
    let mut old = hub.proxy("spoke2", &[MAPPED_KERNEL]).await;
    let first = old.next_snapshot().await;
    let mut new = hub.proxy("spoke2", &[MAPPED_KERNEL]).await;
    let resent = new.next_snapshot().await;
    assert!(resent.revision >= first.revision, "revisions never go back");
    let ended = tokio::time::timeout(WAIT, old.inbound.message())
        .await
        .expect("the old stream ends within the deadline");
    let status = ended.expect_err("the old stream ends with a status");
    assert_eq!(status.code(), tonic::Code::Aborted, "{status:?}");
    assert!(
        status
            .message()
            .contains("replaced by a newer stream of cluster spoke2"),
        "{status:?}"
    );
    // The new stream is live: a change reaches it.
    hub.label_cluster("spoke2", true).await;
    hub.create_module("hello-c", module("1", None)).await;
    new.snapshot_where("the new stream gets hello-c", |s| {
        intent(s, "hello-c").is_some()
    })
    .await;
    hub.clean_up(namespace, &["hello-c"], &["spoke2"]).await;
}

#[tokio::test]
async fn status_reports_become_counts_failures_and_events() {
    let fleet = fleet().await;
    let (hub, namespace) = TestHub::start(&fleet, WAIT).await;
    hub.label_cluster("spoke1", true).await;
    hub.create_module("hello-d", module("1", None)).await;
    let mut proxy = hub.proxy("spoke1", &[MAPPED_KERNEL]).await;
    proxy
        .snapshot_where("hello-d", |s| intent(s, "hello-d").is_some())
        .await;
    proxy
        .send_status(
            true,
            vec![
                node_status("hello-d", "spoke1-node1", ModuleState::Loaded, ""),
                node_status("hello-d", "spoke1-node2", ModuleState::Failed, "LoadFailed"),
                node_status("hello-d", "spoke1-node3", ModuleState::Pending, ""),
            ],
        )
        .await;
    let status = hub
        .wait_module("hello-d", "hello-d status counts the report", WAIT, |m| {
            let status = m.and_then(|m| m.status).ok_or("no status")?;
            if status.nodes.matching == 3 {
                Ok(status)
            } else {
                Err(format!("{status:?}"))
            }
        })
        .await;
    assert_eq!(
        (
            status.clusters.selected,
            status.clusters.connected,
            status.clusters.converged
        ),
        (1, 1, 0)
    );
    assert_eq!((status.nodes.loaded, status.nodes.failed), (1, 1));
    assert_eq!(status.kernels.resolved, 1);
    let failure = &status.failures[0];
    assert_eq!(
        (
            failure.cluster.as_str(),
            failure.node.as_deref(),
            failure.kernel.as_str(),
            failure.reason.as_str()
        ),
        ("spoke1", Some("spoke1-node2"), MAPPED_KERNEL, "LoadFailed")
    );
    assert!(
        failure
            .message
            .contains("modprobe: LoadFailed on spoke1-node2")
    );
    let ready = &status.conditions[0];
    assert_eq!(
        (ready.status.as_str(), ready.reason.as_str()),
        ("False", "LoadFailed")
    );
    let module = hub.modules().get("hello-d").await.unwrap();
    assert_eq!(status.observed_generation, module.metadata.generation);
    assert!(
        module
            .metadata
            .finalizers
            .unwrap_or_default()
            .contains(&"hub.kmm.sigs.x-k8s.io/unload".to_string())
    );

    // Everything loaded: converged, and an Event says so.
    proxy
        .send_status(
            false,
            vec![
                node_status("hello-d", "spoke1-node2", ModuleState::Loaded, ""),
                node_status("hello-d", "spoke1-node3", ModuleState::Loaded, ""),
            ],
        )
        .await;
    hub.wait_module("hello-d", "hello-d converges", WAIT, |m| {
        let status = m.and_then(|m| m.status).ok_or("no status")?;
        match status.conditions.first() {
            Some(c)
                if c.status == "True"
                    && status.clusters.converged == 1
                    && status.nodes.loaded == 3 =>
            {
                Ok(())
            }
            _ => Err(format!("{status:?}")),
        }
    })
    .await;
    // Only this run's module's Events: an earlier run's hello-d left its own behind.
    let events: Api<Event> = Api::all(fleet.hub.clone());
    let uid = module.metadata.uid.clone();
    let of_this_module = || async {
        let list = events
            .list(&ListParams::default().fields("regarding.name=hello-d"))
            .await
            .map_err(|e| e.to_string())?;
        Ok::<_, String>(
            list.items
                .into_iter()
                .filter(|e| e.regarding.as_ref().and_then(|r| r.uid.as_ref()) == uid.as_ref())
                .collect::<Vec<_>>(),
        )
    };
    let recorded = kmm_e2e::fixture::wait_until("Events for hello-d", WAIT, || async {
        let items = of_this_module().await?;
        let reasons: Vec<&str> = items.iter().filter_map(|e| e.reason.as_deref()).collect();
        if reasons.contains(&"LoadFailed") && reasons.contains(&"Converged") {
            Ok(items.clone())
        } else {
            Err(format!("{reasons:?}"))
        }
    })
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    // The wait saw both reasons; what each Event says is the test.
    let event = |reason: &str| {
        let event = recorded
            .iter()
            .find(|e| e.reason.as_deref() == Some(reason))
            .expect("waited for");
        (
            event.type_.as_deref(),
            event.note.as_deref().unwrap_or_default(),
        )
    };
    let (type_, note) = event("LoadFailed");
    assert_eq!(type_, Some("Warning"), "{note}");
    assert!(
        note.contains("node spoke1-node2") && note.contains("modprobe: LoadFailed on spoke1-node2"),
        "the failure's Event names the node and its error: {note}"
    );
    let (type_, note) = event("Converged");
    assert_eq!(type_, Some("Normal"), "{note}");
    assert!(
        note.contains("1 converged") && note.contains("3 loaded, 0 failed"),
        "the convergence's Event gives the counts: {note}"
    );

    // Another failure of the same reason is an Event of its own, with its own note, not a
    // repeat counted on the first one (whose note names spoke1-node2).
    proxy
        .send_status(
            false,
            vec![node_status(
                "hello-d",
                "spoke1-node3",
                ModuleState::Failed,
                "LoadFailed",
            )],
        )
        .await;
    kmm_e2e::fixture::wait_until(
        "an Event naming the failure on spoke1-node3",
        WAIT,
        || async {
            let items = of_this_module().await?;
            let failures: Vec<&str> = items
                .iter()
                .filter(|e| e.reason.as_deref() == Some("LoadFailed"))
                .filter_map(|e| e.note.as_deref())
                .collect();
            if failures.iter().any(|n| n.contains("node spoke1-node3"))
                && failures.iter().any(|n| n.contains("node spoke1-node2"))
            {
                Ok(())
            } else {
                Err(format!("LoadFailed notes: {failures:?}"))
            }
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    hub.clean_up(namespace, &["hello-d"], &["spoke1"]).await;
}

#[tokio::test]
async fn deletion_waits_for_confirmed_unloads() {
    let fleet = fleet().await;
    let (hub, namespace) = TestHub::start(&fleet, Duration::from_secs(300)).await;
    hub.label_cluster("spoke1", true).await;
    hub.create_module("hello-e", module("1", None)).await;
    let mut proxy = hub.proxy("spoke1", &[MAPPED_KERNEL]).await;
    proxy
        .snapshot_where("hello-e", |s| intent(s, "hello-e").is_some())
        .await;
    proxy
        .send_status(
            true,
            vec![node_status(
                "hello-e",
                "spoke1-node1",
                ModuleState::Loaded,
                "",
            )],
        )
        .await;
    hub.wait_module("hello-e", "the finalizer is set", WAIT, |m| {
        let m = m.ok_or("absent")?;
        if m.metadata.finalizers.is_some_and(|f| !f.is_empty()) {
            Ok(())
        } else {
            Err("no finalizer".into())
        }
    })
    .await;
    hub.modules()
        .delete("hello-e", &DeleteParams::default())
        .await
        .unwrap();
    proxy
        .snapshot_where("hello-e is unloaded", |s| {
            intent(s, "hello-e").is_some_and(|i| i.unload)
        })
        .await;
    let waiting = hub
        .wait_module("hello-e", "hello-e waits for the unload", WAIT, |m| {
            let status = m.and_then(|m| m.status).ok_or("gone or no status")?;
            match status.conditions.first() {
                Some(c) if c.reason == "Unloading" => Ok(c.message.clone()),
                other => Err(format!("{other:?}")),
            }
        })
        .await;
    assert!(waiting.contains("spoke1/spoke1-node1"), "{waiting}");
    proxy
        .send_status(
            false,
            vec![node_status(
                "hello-e",
                "spoke1-node1",
                ModuleState::Unloaded,
                "",
            )],
        )
        .await;
    hub.wait_module(
        "hello-e",
        "hello-e is deleted once unloaded",
        WAIT,
        |m| match m {
            None => Ok(()),
            Some(m) => Err(format!("still there: {:?}", m.status)),
        },
    )
    .await;
    proxy
        .snapshot_where("hello-e is forgotten", |s| intent(s, "hello-e").is_none())
        .await;
    hub.clean_up(namespace, &[], &["spoke1"]).await;
}

#[tokio::test]
async fn deletion_completes_after_the_unload_timeout_naming_the_leftovers() {
    let fleet = fleet().await;
    let (hub, namespace) = TestHub::start(&fleet, Duration::from_secs(3)).await;
    hub.label_cluster("spoke1", true).await;
    hub.create_module("hello-f", module("1", None)).await;
    let mut proxy = hub.proxy("spoke1", &[MAPPED_KERNEL]).await;
    proxy
        .snapshot_where("hello-f", |s| intent(s, "hello-f").is_some())
        .await;
    proxy
        .send_status(
            true,
            vec![node_status(
                "hello-f",
                "spoke1-node3",
                ModuleState::Loaded,
                "",
            )],
        )
        .await;
    hub.wait_module("hello-f", "the finalizer is set", WAIT, |m| {
        let m = m.ok_or("absent")?;
        if m.metadata.finalizers.is_some_and(|f| !f.is_empty()) {
            Ok(())
        } else {
            Err("no finalizer".into())
        }
    })
    .await;
    hub.modules()
        .delete("hello-f", &DeleteParams::default())
        .await
        .unwrap();
    hub.wait_module(
        "hello-f",
        "hello-f is deleted after the timeout",
        WAIT,
        |m| match m {
            None => Ok(()),
            Some(m) => Err(format!("still there: {:?}", m.status)),
        },
    )
    .await;
    let note = event_note(&fleet.hub, "hello-f", "UnloadTimedOut").await;
    assert!(note.contains("spoke1/spoke1-node3"), "{note}");
    hub.clean_up(namespace, &[], &["spoke1"]).await;
}

/// Ready means loaded: statuses that do not reflect the module's current generation (none
/// yet, or made before the proxy applied the snapshot carrying it) never make it Ready,
/// even when they say every matching node is loaded.
#[tokio::test]
async fn a_module_is_ready_only_once_the_statuses_reflect_its_current_generation() {
    let fleet = fleet().await;
    let (hub, namespace) = TestHub::start(&fleet, WAIT).await;
    hub.label_cluster("spoke1", true).await;
    hub.create_module("hello-r", module("1", None)).await;
    let mut proxy = hub.proxy("spoke1", &[MAPPED_KERNEL]).await;
    // Before the proxy applied anything, it knows no node of the module: zero matching
    // nodes, all loaded, would read as converged.
    proxy.send_status(true, vec![]).await;
    let early = hub
        .wait_module(
            "hello-r",
            "a status with the cluster connected",
            WAIT,
            |m| {
                let status = m.and_then(|m| m.status).ok_or("no status")?;
                (status.clusters.connected == 1)
                    .then_some(status.clone())
                    .ok_or_else(|| format!("{status:?}"))
            },
        )
        .await;
    let ready = |status: &kmm_api::ManagedClusterModuleStatus| {
        status
            .conditions
            .first()
            .is_some_and(|c| c.status == "True")
    };
    assert!(
        !ready(&early) && early.clusters.converged == 0,
        "ready before any report of the module: {early:?}"
    );

    proxy
        .snapshot_where("hello-r", |s| intent(s, "hello-r").is_some())
        .await;
    let loaded = || {
        vec![node_status(
            "hello-r",
            "spoke1-node1",
            ModuleState::Loaded,
            "",
        )]
    };
    proxy.send_status(false, loaded()).await;
    hub.wait_module("hello-r", "hello-r ready", WAIT, |m| {
        let status = m.and_then(|m| m.status).ok_or("no status")?;
        ready(&status)
            .then_some(())
            .ok_or_else(|| format!("{status:?}"))
    })
    .await;

    // A spec change: until the proxy applied it, its statuses are of the old generation.
    hub.set_version("hello-r", "2").await;
    let changed = hub
        .wait_module("hello-r", "a status of generation 2", WAIT, |m| {
            let m = m.ok_or("gone")?;
            let status = m.status.clone().ok_or("no status")?;
            (status.observed_generation == m.metadata.generation
                && m.metadata.generation == Some(2))
            .then_some(status.clone())
            .ok_or_else(|| format!("{status:?}"))
        })
        .await;
    assert!(
        !ready(&changed),
        "ready on statuses of the previous generation: {changed:?}"
    );
    proxy
        .snapshot_where("hello-r at version 2", |s| {
            intent(s, "hello-r").is_some_and(|i| i.generation == 2)
        })
        .await;
    proxy.send_status(false, loaded()).await;
    hub.wait_module("hello-r", "hello-r ready at generation 2", WAIT, |m| {
        let status = m.and_then(|m| m.status).ok_or("no status")?;
        (ready(&status) && status.observed_generation == Some(2))
            .then_some(())
            .ok_or_else(|| format!("{status:?}"))
    })
    .await;
    hub.clean_up(namespace, &["hello-r"], &["spoke1"]).await;
}

/// A report sent in parts counts only once its last part arrived: its first parts alone
/// never show as loaded nodes, whatever else the stream carries meanwhile.
#[tokio::test]
async fn a_report_in_parts_counts_only_once_whole() {
    let fleet = fleet().await;
    let (hub, namespace) = TestHub::start(&fleet, WAIT).await;
    hub.label_cluster("spoke1", true).await;
    hub.create_module("hello-p", module("1", None)).await;
    let mut proxy = hub.proxy("spoke1", &[MAPPED_KERNEL]).await;
    proxy.send_status(true, vec![]).await;
    proxy
        .snapshot_where("hello-p", |s| intent(s, "hello-p").is_some())
        .await;
    let loaded = |node: &str| node_status("hello-p", node, ModuleState::Loaded, "");
    proxy
        .send_status_part(false, vec![loaded("spoke1-node1")], true)
        .await;
    // The stream goes on while the report is incomplete: a second kernel arrives, and the
    // status counting it is computed after the first part was received.
    proxy
        .send_inventory(2, &[MAPPED_KERNEL, UNMAPPED_KERNEL])
        .await;
    let meanwhile = hub
        .wait_module("hello-p", "the second kernel counted", WAIT, |m| {
            let status = m.and_then(|m| m.status).ok_or("no status")?;
            (status.kernels.unresolved == 1)
                .then_some(status.clone())
                .ok_or_else(|| format!("{status:?}"))
        })
        .await;
    assert_eq!(
        meanwhile.nodes.loaded, 0,
        "a first part counted before the report was whole: {meanwhile:?}"
    );
    proxy
        .send_status_part(false, vec![loaded("spoke1-node2")], false)
        .await;
    hub.wait_module("hello-p", "both parts counted", WAIT, |m| {
        let status = m.and_then(|m| m.status).ok_or("no status")?;
        (status.nodes.loaded == 2 && status.nodes.matching == 2)
            .then_some(())
            .ok_or_else(|| format!("{status:?}"))
    })
    .await;
    hub.clean_up(namespace, &["hello-p"], &["spoke1"]).await;
}

/// A cluster the hub stops accepting (`hubAcceptsClient: false`, or deleted) loses its
/// stream at once: no more intents or credentials reach it.
#[tokio::test]
async fn a_cluster_no_longer_accepted_loses_its_stream_at_once() {
    let fleet = fleet().await;
    let (hub, namespace) = TestHub::start(&fleet, WAIT).await;
    let cluster = format!("deny-{}", namespace.name.rsplit('-').next().unwrap_or("x"));
    let clusters = kmm_e2e::fleet::managed_clusters(&fleet.hub);
    let object: kube::core::DynamicObject = serde_json::from_value(json!({
        "apiVersion": MANAGED_CLUSTER.api_version(),
        "kind": MANAGED_CLUSTER.kind,
        "metadata": { "name": cluster, "labels": { hub.cluster_label(): "yes" } },
        "spec": { "hubAcceptsClient": true },
    }))
    .unwrap();
    clusters
        .create(&PostParams::default(), &object)
        .await
        .expect("a ManagedCluster of the test's");
    hub.create_module("hello-deny", module("1", None)).await;
    let accept = |accepted: bool| json!({"spec": {"hubAcceptsClient": accepted}});
    let ended = |proxy: Proxy| async move {
        let mut proxy = proxy;
        loop {
            match tokio::time::timeout(WAIT, proxy.inbound.message())
                .await
                .expect("the stream ends within the deadline")
            {
                Ok(Some(_)) => continue,
                Ok(None) => panic!("the stream ended without saying why"),
                Err(status) => return status,
            }
        }
    };

    let mut proxy = hub.proxy(&cluster, &[MAPPED_KERNEL]).await;
    proxy
        .snapshot_where("the module reaches the cluster", |s| {
            intent(s, "hello-deny").is_some()
        })
        .await;
    clusters
        .patch(
            &cluster,
            &PatchParams::default(),
            &Patch::Merge(&accept(false)),
        )
        .await
        .unwrap();
    let status = ended(proxy).await;
    assert_eq!(status.code(), tonic::Code::PermissionDenied, "{status:?}");
    assert!(status.message().contains(&cluster), "{status:?}");

    // Accepted again, it connects; deleted, it loses the stream again.
    clusters
        .patch(
            &cluster,
            &PatchParams::default(),
            &Patch::Merge(&accept(true)),
        )
        .await
        .unwrap();
    let mut proxy = hub.proxy(&cluster, &[MAPPED_KERNEL]).await;
    proxy
        .snapshot_where("the module reaches the cluster again", |s| {
            intent(s, "hello-deny").is_some()
        })
        .await;
    clusters
        .delete(&cluster, &DeleteParams::background())
        .await
        .unwrap();
    let status = ended(proxy).await;
    assert_eq!(status.code(), tonic::Code::PermissionDenied, "{status:?}");
    hub.clean_up(namespace, &["hello-deny"], &[]).await;
}

/// A stream lives no longer than the client certificate it was opened with.
#[tokio::test]
async fn a_stream_ends_when_its_client_certificate_expires() {
    let fleet = fleet().await;
    let (hub, namespace) = TestHub::start(&fleet, WAIT).await;
    let certificate = hub
        .proxy_certificate_valid_for("spoke1", Duration::from_secs(8))
        .await;
    let mut proxy = Proxy::open(hub.channel(&certificate).await.expect("the handshake"))
        .await
        .expect("the stream opens");
    proxy.send_inventory(1, &[MAPPED_KERNEL]).await;
    let status = loop {
        match tokio::time::timeout(WAIT, proxy.inbound.message())
            .await
            .expect("the stream ends within the deadline")
        {
            Ok(Some(_)) => continue,
            Ok(None) => panic!("the stream ended without saying why"),
            Err(status) => break status,
        }
    };
    assert_eq!(status.code(), tonic::Code::Unauthenticated, "{status:?}");
    assert!(status.message().contains("expired"), "{status:?}");
    hub.clean_up(namespace, &[], &[]).await;
}

/// A proxy with a valid certificate that sends a message over the contract's limit loses
/// its stream; the hub keeps serving the other clusters.
#[tokio::test]
async fn a_giant_message_ends_only_its_own_stream() {
    let fleet = fleet().await;
    let (hub, namespace) = TestHub::start(&fleet, WAIT).await;
    hub.label_cluster("spoke1", true).await;
    hub.label_cluster("spoke2", true).await;
    hub.create_module("hello-big", module("1", None)).await;
    let mut hostile = hub.proxy("spoke1", &[MAPPED_KERNEL]).await;
    let mut other = hub.proxy("spoke2", &[MAPPED_KERNEL]).await;
    other
        .snapshot_where("hello-big for spoke2", |s| intent(s, "hello-big").is_some())
        .await;
    let mut giant = node_status(
        "hello-big",
        "spoke1-node1",
        ModuleState::Failed,
        "LoadFailed",
    );
    giant.message = "x".repeat(kmm_proto::limits::PROXY_MESSAGE + 1);
    hostile.send_status(true, vec![giant]).await;
    let ended = loop {
        match tokio::time::timeout(WAIT, hostile.inbound.message())
            .await
            .expect("the stream ends within the deadline")
        {
            Ok(Some(_)) => continue,
            Ok(None) => break tonic::Status::ok("ended"),
            Err(status) => break status,
        }
    };
    assert!(
        matches!(
            ended.code(),
            tonic::Code::OutOfRange | tonic::Code::ResourceExhausted
        ),
        "{ended:?}"
    );
    // spoke2 is served as before: a spec change reaches it.
    hub.set_version("hello-big", "2").await;
    other
        .snapshot_where("hello-big at version 2 for spoke2", |s| {
            intent(s, "hello-big").is_some_and(|i| i.generation == 2)
        })
        .await;
    hub.clean_up(namespace, &["hello-big"], &["spoke1", "spoke2"])
        .await;
}

/// A proxy reconnecting in a tight loop is refused after a burst, and only its cluster.
#[tokio::test]
async fn a_cluster_reconnecting_in_a_tight_loop_is_refused() {
    let fleet = fleet().await;
    let (hub, namespace) = TestHub::start(&fleet, WAIT).await;
    let certificate = hub.proxy_certificate("spoke1").await;
    let mut codes = Vec::new();
    for _ in 0..15 {
        let proxy = Proxy::open(hub.channel(&certificate).await.unwrap()).await;
        let code = match proxy {
            Err(status) => status.code(),
            Ok(mut proxy) => {
                // Served, it answers the inventory with a snapshot; refused, with an error
                // (maybe before the inventory could even be sent).
                let _ = proxy.try_send_inventory(1, &[MAPPED_KERNEL]).await;
                match tokio::time::timeout(WAIT, proxy.inbound.message()).await {
                    Ok(Ok(Some(_))) => tonic::Code::Ok,
                    Ok(Err(status)) => status.code(),
                    other => panic!("{other:?}"),
                }
            }
        };
        codes.push(code);
    }
    assert!(
        codes.contains(&tonic::Code::ResourceExhausted),
        "never refused: {codes:?}"
    );
    assert!(
        codes[..10].iter().all(|c| *c == tonic::Code::Ok),
        "{codes:?}"
    );
    // Another cluster is not held back.
    let mut other = hub.proxy("spoke2", &[MAPPED_KERNEL]).await;
    other
        .snapshot_where("a snapshot for spoke2", |_| true)
        .await;
    hub.clean_up(namespace, &[], &[]).await;
}
