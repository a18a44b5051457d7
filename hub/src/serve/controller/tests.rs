//! The controller's pipeline against a mocked API server: every request it makes is
//! checked in order and answered, with no apiserver running.

use std::sync::Arc;
use std::time::Duration;

use futures::FutureExt;
use http::{Method, Request, Response, StatusCode};
use http_body_util::BodyExt;
use k8s_openapi::api::apps::v1::ControllerRevision;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kmm_api::testing::ModuleBuilder;
use kube::client::Body;
use kube::core::DynamicObject;
use kube::runtime::reflector::store::Writer;
use kube::runtime::watcher;
use kube::{Api, Client};
use serde_json::{Value, json};
use tower_test::mock::{Handle, SendResponse};

use super::*;
use crate::fleet::outbox::Held;
use crate::images::ImageRecord;
use crate::serve::fleet_view::{ClusterStreams, SessionId, Stores};
use crate::serve::outbound::{Outbound, OutboundSender};
use kmm_api::ocm;
use kmm_proto::v1::{
    Kernel, KernelInventory, ModuleKey, ModuleNodeKey, ModuleNodeStatus, ModuleState,
    NodeStatusReport,
};

type ApiServer = Handle<Request<Body>, Response<Body>>;

const MODULES: &str = "/apis/hub.kmm.sigs.x-k8s.io/v1beta1/managedclustermodules";

/// A module as the watch would give it.
fn module(finalizers: &[&str], deleting: bool) -> Arc<ManagedClusterModule> {
    let module = ModuleBuilder::new("hello")
        .uid("u1")
        .resource_version("7")
        .finalizers(finalizers)
        .selector(&[("env", "prod")]);
    let module = if deleting {
        // Just now: the unload timeout counts from it.
        module.with(
            "/metadata/deletionTimestamp",
            Time(Timestamp::now()).0.to_string(),
        )
    } else {
        module
    };
    Arc::new(module.build())
}

/// A fleet of `clusters` (each selected by the module), its view synced, and the
/// context reconciling against the mocked API server.
struct Harness {
    ctx: Arc<Context>,
    server: ApiServer,
    /// Keeps the stores' writers alive.
    _clusters: Writer<DynamicObject>,
    modules: Writer<ManagedClusterModule>,
}

fn harness(clusters: &[&str], unload_timeout: Duration) -> Harness {
    let (service, server) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
    let client = Client::new(service, "default");
    let mut cluster_writer = Writer::<DynamicObject>::new(ocm::MANAGED_CLUSTER.api_resource());
    for name in clusters {
        let cluster: DynamicObject = serde_json::from_value(json!({
            "apiVersion": "cluster.open-cluster-management.io/v1",
            "kind": "ManagedCluster",
            "metadata": {"name": name, "labels": {"env": "prod"}},
            "spec": {"hubAcceptsClient": true},
        }))
        .unwrap();
        cluster_writer.apply_watcher_event(&watcher::Event::Apply(cluster));
    }
    let modules = Writer::<ManagedClusterModule>::default();
    let stores = Stores {
        modules: modules.as_reader(),
        clusters: cluster_writer.as_reader(),
        secrets: Writer::default().as_reader(),
        revisions: Writer::default().as_reader(),
        preflights: Writer::default().as_reader(),
        decisions: Writer::<DynamicObject>::new(ocm::PLACEMENT_DECISION.api_resource()).as_reader(),
    };
    let state = Arc::new(FleetView::new(stores, Metrics::default()));
    state.set_synced();
    let events = EventPublisher::new(client.clone(), "test");
    let ctx = Arc::new(Context {
        api: Api::all(client.clone()),
        revisions: Api::namespaced(client, "kmm-hub"),
        namespace: "kmm-hub".into(),
        state,
        events,
        unload_timeout,
        metrics: Metrics::default(),
        status_pacer: StatusPacer::default(),
        deletion_clock: DeletionClock::default(),
    });
    Harness {
        ctx,
        server,
        _clusters: cluster_writer,
        modules,
    }
}

impl Harness {
    /// The module as its watch gives it to the fleet view.
    fn watch(&mut self, module: &ManagedClusterModule) {
        self.modules
            .apply_watcher_event(&watcher::Event::Apply(module.clone()));
        self.ctx.state.note_module(module);
        self.ctx.state.recompute_stale();
    }
}

/// The revision of the last snapshot `cluster`'s stream was sent.
fn last_revision(sent: &tokio::sync::watch::Receiver<Outbound>) -> u64 {
    match &*sent.borrow() {
        Outbound::Snapshot(snapshot) => snapshot.revision,
        other => panic!("no snapshot sent: {other:?}"),
    }
}

/// A full report of `hello` on node n1, made with the intents of `revision` applied.
fn hello_on_n1(revision: u64, state: ModuleState, reason: &str, message: &str) -> NodeStatusReport {
    NodeStatusReport {
        full: true,
        statuses: vec![ModuleNodeStatus {
            key: Some(ModuleNodeKey {
                module: Some(ModuleKey {
                    namespace: "drivers".into(),
                    name: "hello".into(),
                }),
                node: "n1".into(),
            }),
            kernel: "6.1".into(),
            state: state.into(),
            reason: reason.into(),
            message: message.into(),
            ..ModuleNodeStatus::default()
        }],
        intent_revision: revision,
        ..NodeStatusReport::default()
    }
}

/// The next request: its method, path and JSON body, and where to answer it.
async fn next(server: &mut ApiServer) -> (Method, String, Value, SendResponse<Response<Body>>) {
    let (request, respond) = tokio::time::timeout(Duration::from_secs(10), server.next_request())
        .await
        .expect("a request within 10 s")
        .expect("the client is alive");
    let method = request.method().clone();
    let path = request.uri().path().to_owned();
    let bytes = request.into_body().collect().await.unwrap().to_bytes();
    let body = if bytes.is_empty() {
        Value::Null
    } else {
        serde_json::from_slice(&bytes).unwrap()
    };
    (method, path, body, respond)
}

fn answer(respond: SendResponse<Response<Body>>, status: StatusCode, body: &Value) {
    respond.send_response(
        Response::builder()
            .status(status)
            .body(Body::from(serde_json::to_vec(body).unwrap()))
            .unwrap(),
    );
}

/// A Kubernetes `Status` refusal.
fn refusal(code: u16, reason: &str, message: &str) -> Value {
    json!({
        "kind": "Status", "apiVersion": "v1", "status": "Failure",
        "code": code, "reason": reason, "message": message,
    })
}

/// Answers the Event the reconciliation records; gives its (type, reason, note).
async fn expect_event(server: &mut ApiServer) -> (String, String, String) {
    let (method, path, body, respond) = next(server).await;
    assert_eq!(method, Method::POST);
    assert!(path.ends_with("/events"), "{path}");
    answer(respond, StatusCode::CREATED, &body);
    let text = |field: &str| body[field].as_str().unwrap_or_default().to_owned();
    (text("type"), text("reason"), text("note"))
}

/// Nothing more was asked of the API server.
fn assert_quiet(server: &mut ApiServer) {
    if let Some(Some((request, _))) = server.next_request().now_or_never() {
        panic!("unexpected request: {} {}", request.method(), request.uri());
    }
}

#[tokio::test]
async fn a_new_module_gets_the_finalizer_first_at_the_version_it_was_read() {
    let Harness {
        ctx, mut server, ..
    } = harness(&[], Duration::from_secs(60));
    let reconciling = tokio::spawn(reconcile(module(&["other"], false), ctx));
    let (method, path, body, respond) = next(&mut server).await;
    assert_eq!(
        (method, path.as_str()),
        (Method::PATCH, &*format!("{MODULES}/hello"))
    );
    assert_eq!(
        body,
        json!({"metadata": {"resourceVersion": "7", "finalizers": ["other", FINALIZER]}})
    );
    answer(
        respond,
        StatusCode::OK,
        &serde_json::to_value(&*module(&[], false)).unwrap(),
    );
    let action = reconciling.await.unwrap().expect("the finalizer is added");
    assert_eq!(action, Action::await_change());
    assert_quiet(&mut server);
}

#[tokio::test]
async fn a_stale_view_is_retried_without_an_event() {
    let Harness {
        ctx, mut server, ..
    } = harness(&[], Duration::from_secs(60));
    let reconciling = tokio::spawn(reconcile(module(&[], false), ctx.clone()));
    let (_, _, _, respond) = next(&mut server).await;
    answer(
        respond,
        StatusCode::CONFLICT,
        &refusal(409, "Conflict", "the object has been modified"),
    );
    let error = reconciling
        .await
        .unwrap()
        .expect_err("a conflict fails the reconciliation");
    assert!(matches!(error, ReconcileError::Stale { .. }), "{error}");
    assert_eq!(
        error_policy(module(&[], false), &error, ctx),
        Action::requeue(STALE_RETRY)
    );
    assert_quiet(&mut server);
}

#[tokio::test]
async fn a_refused_finalizer_patch_is_reported_as_a_warning_and_retried() {
    let Harness {
        ctx, mut server, ..
    } = harness(&[], Duration::from_secs(60));
    let reconciling = tokio::spawn(reconcile(module(&[], false), ctx.clone()));
    let (_, _, _, respond) = next(&mut server).await;
    let denial = "ValidatingAdmissionPolicy 'keep' denied request: the test keeps it";
    answer(
        respond,
        StatusCode::UNPROCESSABLE_ENTITY,
        &refusal(422, "Invalid", denial),
    );
    let (type_, reason, note) = expect_event(&mut server).await;
    assert_eq!(
        (type_.as_str(), reason.as_str()),
        ("Warning", "FinalizerPatchFailed")
    );
    assert!(
        note.contains("adding the finalizer") && note.contains(denial),
        "{note}"
    );
    let error = reconciling
        .await
        .unwrap()
        .expect_err("a refusal is never taken for done");
    assert!(matches!(error, ReconcileError::Api { .. }), "{error}");
    assert_eq!(
        error_policy(module(&[], false), &error, ctx),
        Action::requeue(ERROR_RETRY)
    );
}

#[tokio::test]
async fn status_is_written_by_server_side_apply_and_its_transition_announced() {
    let Harness {
        ctx, mut server, ..
    } = harness(&["spoke1"], Duration::from_secs(60));
    let reconciling = tokio::spawn(reconcile(module(&[FINALIZER], false), ctx.clone()));
    // The rollout keeps the spec's revision first.
    let (method, path, body, respond) = next(&mut server).await;
    assert_eq!(method, Method::POST);
    assert_eq!(path, "/apis/apps/v1/namespaces/kmm-hub/controllerrevisions");
    assert_eq!(
        body["metadata"]["labels"]["hub.kmm.sigs.x-k8s.io/module"],
        "hello"
    );
    let revision: ControllerRevision = serde_json::from_value(body.clone()).unwrap();
    answer(
        respond,
        StatusCode::CREATED,
        &serde_json::to_value(&revision).unwrap(),
    );

    let (method, path, body, respond) = next(&mut server).await;
    assert_eq!(
        (method, path.as_str()),
        (Method::PATCH, &*format!("{MODULES}/hello/status"))
    );
    let status = &body["status"];
    assert_eq!(status["clusters"]["selected"], 1, "{status}");
    assert_eq!(status["clusters"]["connected"], 0, "{status}");
    let ready = &status["conditions"][0];
    assert_eq!(
        (ready["type"].as_str(), ready["status"].as_str()),
        (Some("Ready"), Some("False"))
    );
    answer(
        respond,
        StatusCode::OK,
        &serde_json::to_value(&*module(&[FINALIZER], false)).unwrap(),
    );

    // The selected cluster has no proxy connected: a warning, named as status names it.
    let (type_, reason, _) = expect_event(&mut server).await;
    assert_eq!(type_, "Warning");
    assert_eq!(reason, ready["reason"].as_str().unwrap());
    let action = reconciling.await.unwrap().expect("reconciled");
    assert_eq!(action, Action::requeue(RESYNC));
    assert_quiet(&mut server);
    assert_eq!(ctx.metrics.status_writes.get(), 1);
}

#[tokio::test]
async fn a_deletion_waits_for_every_leftover_then_times_out_on_record() {
    // spoke1 is selected and never reported: its unload is unconfirmed.
    let Harness {
        ctx, mut server, ..
    } = harness(&["spoke1"], Duration::from_secs(600));
    let reconciling = tokio::spawn(reconcile(module(&[FINALIZER], true), ctx));
    let (method, path, body, respond) = next(&mut server).await;
    assert_eq!(
        (method, path.as_str()),
        (Method::PATCH, &*format!("{MODULES}/hello/status"))
    );
    let message = body["status"]["conditions"][0]["message"]
        .as_str()
        .unwrap()
        .to_owned();
    assert!(
        message.contains("waiting for the unload on: spoke1"),
        "{message}"
    );
    answer(
        respond,
        StatusCode::OK,
        &serde_json::to_value(&*module(&[FINALIZER], true)).unwrap(),
    );
    let _ = expect_event(&mut server).await;
    let action = reconciling.await.unwrap().expect("waiting");
    assert_eq!(action, Action::requeue(UNLOAD_RECHECK));

    // With no time left, the leftovers go on record before the finalizer goes.
    let Harness {
        ctx, mut server, ..
    } = harness(&["spoke1"], Duration::ZERO);
    let reconciling = tokio::spawn(reconcile(module(&[FINALIZER, "other"], true), ctx));
    let (type_, reason, note) = expect_event(&mut server).await;
    assert_eq!(
        (type_.as_str(), reason.as_str()),
        ("Warning", "UnloadTimedOut")
    );
    assert!(note.contains("spoke1"), "{note}");
    let (method, path, body, respond) = next(&mut server).await;
    assert_eq!(
        (method, path.as_str()),
        (Method::PATCH, &*format!("{MODULES}/hello"))
    );
    assert_eq!(
        body,
        json!({"metadata": {"resourceVersion": "7", "finalizers": ["other"]}})
    );
    answer(
        respond,
        StatusCode::OK,
        &serde_json::to_value(&*module(&["other"], true)).unwrap(),
    );
    assert_eq!(reconciling.await.unwrap().unwrap(), Action::await_change());
    assert_quiet(&mut server);
}

#[tokio::test]
async fn a_deletion_with_nothing_loaded_is_announced_and_released_at_once() {
    let Harness {
        ctx, mut server, ..
    } = harness(&[], Duration::from_secs(600));
    let reconciling = tokio::spawn(reconcile(module(&[FINALIZER], true), ctx.clone()));
    let (type_, reason, _) = expect_event(&mut server).await;
    assert_eq!((type_.as_str(), reason.as_str()), ("Normal", "Unloaded"));
    let (method, _, body, respond) = next(&mut server).await;
    assert_eq!(method, Method::PATCH);
    assert_eq!(body["metadata"]["finalizers"], json!([]));
    answer(
        respond,
        StatusCode::NOT_FOUND,
        &refusal(404, "NotFound", "gone"),
    );
    assert_eq!(
        reconciling
            .await
            .unwrap()
            .expect("gone already counts as done"),
        Action::await_change()
    );
    assert_quiet(&mut server);
}

#[tokio::test]
async fn an_apiserver_clock_ahead_of_the_hub_releases_nothing_early() {
    // The apiserver stamped the deletion ten minutes before the hub's now: the unload
    // timeout (a minute) counts from when the hub first saw it.
    let Harness {
        ctx, mut server, ..
    } = harness(&["spoke1"], Duration::from_secs(60));
    let skewed = Timestamp::now() - k8s_openapi::jiff::SignedDuration::from_secs(600);
    let module = ModuleBuilder::new("hello")
        .uid("u1")
        .resource_version("7")
        .finalizers(&[FINALIZER])
        .selector(&[("env", "prod")])
        .with("/metadata/deletionTimestamp", skewed.to_string())
        .build();
    let stored = serde_json::to_value(&module).unwrap();
    let reconciling = tokio::spawn(reconcile(Arc::new(module), ctx));
    let (method, path, body, respond) = next(&mut server).await;
    assert_eq!(
        (method, path.as_str()),
        (Method::PATCH, &*format!("{MODULES}/hello/status")),
        "the finalizer is not released: {body}"
    );
    let message = body["status"]["conditions"][0]["message"]
        .as_str()
        .unwrap()
        .to_owned();
    assert!(
        message.contains("waiting for the unload on: spoke1"),
        "{message}"
    );
    answer(respond, StatusCode::OK, &stored);
    let (_, reason, _) = expect_event(&mut server).await;
    assert_ne!(reason, "UnloadTimedOut");
    let action = reconciling.await.unwrap().expect("waiting");
    assert_eq!(action, Action::requeue(UNLOAD_RECHECK));
}

/// Module `hello` loaded on node n1 of spoke1, its proxy connected; returns the stream's
/// session and what it was sent.
fn loaded_on_spoke1(
    harness: &mut Harness,
    reason: &str,
    message: &str,
) -> (SessionId, tokio::sync::watch::Receiver<Outbound>) {
    harness.watch(&module(&[FINALIZER], false));
    let outbound = OutboundSender::default();
    let sent = outbound.subscribe();
    let state = &harness.ctx.state;
    let id = state.open_session("spoke1", Held::default(), outbound);
    state.inventory(
        "spoke1",
        id,
        KernelInventory {
            revision: 1,
            kernels: vec![Kernel {
                release: "6.1".into(),
            }],
        },
    );
    for (key, need) in state.image_needs(None) {
        state.set_image(
            key,
            ImageRecord::seeded(&need, "sha256:0123".into(), Timestamp::now()),
        );
    }
    state.recompute_stale();
    let loaded_at = last_revision(&sent);
    state.status(
        "spoke1",
        id,
        hello_on_n1(loaded_at, ModuleState::Loaded, reason, message),
    );
    (id, sent)
}

#[tokio::test]
async fn a_module_sharing_a_kernel_module_lists_it_in_status_and_announces_it() {
    let mut harness = harness(&["spoke1"], Duration::from_secs(600));
    let shares = "shares kernel module kmm_hello with kmm-ops/other, whose unload left it loaded for this module";
    loaded_on_spoke1(&mut harness, REASON_KERNEL_MODULE_SHARED, shares);
    let Harness {
        ctx, mut server, ..
    } = harness;
    let reconciling = tokio::spawn(reconcile(module(&[FINALIZER], false), ctx));
    let (method, path, body, respond) = next(&mut server).await;
    assert_eq!(
        (method, path.as_str()),
        (
            Method::POST,
            "/apis/apps/v1/namespaces/kmm-hub/controllerrevisions"
        )
    );
    answer(respond, StatusCode::CREATED, &body);
    let (method, path, body, respond) = next(&mut server).await;
    assert_eq!(
        (method, path.as_str()),
        (Method::PATCH, &*format!("{MODULES}/hello/status"))
    );
    let status = &body["status"];
    assert_eq!(status["nodes"]["loaded"], 1, "{status}");
    assert_eq!(status["nodes"]["failed"], 0, "{status}");
    assert_eq!(
        status["sharedKernelModules"],
        json!([{"cluster": "spoke1", "node": "n1", "message": shares}])
    );
    answer(
        respond,
        StatusCode::OK,
        &serde_json::to_value(&*module(&[FINALIZER], false)).unwrap(),
    );
    let (type_, reason, _) = expect_event(&mut server).await;
    assert_eq!(
        (type_.as_str(), reason.as_str()),
        ("Normal", "Converged"),
        "sharing is no failure: the module is ready"
    );
    let (type_, reason, note) = expect_event(&mut server).await;
    assert_eq!(
        (type_.as_str(), reason.as_str()),
        ("Warning", REASON_KERNEL_MODULE_SHARED)
    );
    assert_eq!(note, format!("cluster spoke1, node n1: {shares}"));
    reconciling.await.unwrap().expect("reconciled");
    assert_quiet(&mut server);
}

#[tokio::test]
async fn a_deleted_module_announces_the_kernel_modules_its_unload_kept_before_it_goes() {
    let mut harness = harness(&["spoke1"], Duration::from_secs(600));
    let (id, sent) = loaded_on_spoke1(&mut harness, "", "");
    let loaded_at = last_revision(&sent);
    let deleting = module(&[FINALIZER], true);
    harness.watch(&deleting);
    let unload_at = last_revision(&sent);
    assert!(unload_at > loaded_at, "the unload is sent");
    let kept = "kernel module kmm_hello stays loaded: kmm-ops/other needs it";
    harness.ctx.state.status(
        "spoke1",
        id,
        hello_on_n1(
            unload_at,
            ModuleState::Unloaded,
            REASON_KERNEL_MODULE_SHARED,
            kept,
        ),
    );

    let Harness {
        ctx, mut server, ..
    } = harness;
    let reconciling = tokio::spawn(reconcile(deleting, ctx));
    // No status is written any more: the Event is the record of what stayed loaded.
    let (type_, reason, note) = expect_event(&mut server).await;
    assert_eq!(
        (type_.as_str(), reason.as_str()),
        ("Warning", REASON_KERNEL_MODULE_SHARED)
    );
    assert_eq!(note, format!("cluster spoke1, node n1: {kept}"));
    let (type_, reason, _) = expect_event(&mut server).await;
    assert_eq!((type_.as_str(), reason.as_str()), ("Normal", "Unloaded"));
    let (method, _, body, respond) = next(&mut server).await;
    assert_eq!(method, Method::PATCH);
    assert_eq!(body["metadata"]["finalizers"], json!([]));
    answer(
        respond,
        StatusCode::OK,
        &serde_json::to_value(&*module(&[], true)).unwrap(),
    );
    assert_eq!(reconciling.await.unwrap().unwrap(), Action::await_change());
    assert_quiet(&mut server);
}
