//! `kmm-hub serve`: the hub's runtime. Watches feed the fleet view, the gRPC service
//! streams intents to spoke proxies, the controller writes status and guards deletion,
//! the add-on publisher keeps the OCM add-on's configs and status.

pub mod addon;
pub mod ca;
pub mod controller;
pub mod events;
pub mod fleet_view;
mod image_tasks;
pub mod images;
pub mod leadership;
pub mod metrics;
pub mod module_events;
pub mod preflight;
pub mod signing;
pub mod sync_service;
mod watches;
pub mod webhook;
pub mod webhook_configuration;

pub use kmm_hub_core::outbound;

use std::collections::{BTreeSet, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;
use k8s_openapi::api::apps::v1::ControllerRevision;
use k8s_openapi::api::core::v1::Secret;
use kmm_api::{ManagedClusterModule, PreflightValidation, ocm};
use kmm_proto::limits;
use kmm_proto::v1::hub_server::HubServer;
use kmm_runtime::health::Health;
use kmm_runtime::serving;
use kube::ResourceExt;
use kube::core::DynamicObject;
use kube::runtime::reflector::{self, ObjectRef};
use kube::runtime::{Controller, WatchStreamExt, watcher};
use kube::{Api, Client};
use thiserror::Error;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tokio_util::task::AbortOnDropHandle;
use tonic::transport::Server;

use self::ca::{CaError, RenewingCertificate};
use self::controller::deletion_clock::DeletionClock;
use self::controller::status_writer::StatusPacer;
use self::controller::{Context, ReconcileError};
use self::events::{EventPublisher, EventQueue};
use self::fleet_view::{FleetView, Stores};
use self::leadership::{Election, LeaderElection, LeadershipError};
use self::metrics::Metrics;
use self::sync_service::SyncService;
use self::watches::{Seen, reflected, wait_synced, watch_into};
use self::webhook::WebhookError;
use crate::build::BuildJobs;
use crate::fleet::cluster_view::trim_managed_cluster;
use crate::fleet::pacer::{Pacer, count_spacing};
use crate::fleet::revisions;
use crate::fleet_ui::replica::{LeaseLookup, Replica, Role};

/// Everything `serve` needs besides its clients and listeners.
#[derive(Clone, Debug)]
pub struct Settings {
    /// The hub's namespace: its CA Secret and the modules' pull Secrets.
    pub namespace: String,
    /// Subject alternative names of the gRPC serving certificate.
    pub grpc_sans: Vec<String>,
    /// How long a deleted module waits for its unload to be confirmed.
    pub unload_timeout: Duration,
    /// This replica's name in Events.
    pub instance: String,
    /// Label selector limiting the ManagedClusterModules this hub manages (`None`: all).
    pub module_selector: Option<String>,
    /// Subject alternative names of the admission webhook's serving certificate.
    pub webhook_sans: Vec<String>,
    /// The ValidatingWebhookConfiguration whose caBundle the hub keeps (`None`: none).
    pub webhook_configuration: Option<String>,
    /// How replicas elect the one that works (`None`: this one always does).
    pub leader_election: Option<LeaderElection>,
    /// The OCM add-on's name: its ClusterManagementAddOn, every cluster's
    /// ManagedClusterAddOn, and the add-on named in the proxies' certificate subjects.
    pub addon_name: String,
    /// The image kmod build Jobs run.
    pub builder_image: String,
    /// PEM CAs the registries of checks, builds and signing chain to besides the
    /// system's; an absent file adds none.
    pub registry_ca_file: Option<std::path::PathBuf>,
    /// How often the tags of `imagePullPolicy: Always` images are resolved again.
    pub image_follow_interval: Duration,
    /// Lifetime of the serving certificates; they are re-issued with a third of it left.
    pub serving_validity: Duration,
}

/// Where the hub listens.
#[derive(Debug)]
pub struct Listeners {
    /// `Hub.Sync` for spoke proxies (mTLS); served by the leader only.
    pub grpc: TcpListener,
    /// The admission webhook (TLS); served by every replica.
    pub webhook: Option<TcpListener>,
    /// The fleet UI (plain HTTP, reached by port-forward); served by every replica, a
    /// standby saying it is one.
    pub ui: Option<TcpListener>,
}

#[derive(Debug, Error)]
pub enum ServeError {
    #[error(transparent)]
    Ca(#[from] CaError),
    #[error("the gRPC server's TLS settings are invalid: {0}")]
    Tls(#[from] serving::ServingError),
    #[error("the gRPC server failed: {0}")]
    Grpc(tonic::transport::Error),
    #[error(transparent)]
    Webhook(#[from] WebhookError),
    #[error(transparent)]
    Leadership(#[from] LeadershipError),
    #[error("lost the leader Lease; exiting so that this replica rejoins as standby")]
    LeadershipLost,
}

/// Module events the controller may fall behind the watch by before the watch waits.
const MODULE_EVENTS_BUFFERED: usize = 256;

/// Longest a touched module waits for its reconciliation while its clusters keep
/// reporting: bounds both the status latency and the reconciliations of a busy fleet.
/// A fleet whose modules take longer to count waits longer ([`count_spacing`]).
const TOUCH_INTERVAL: Duration = Duration::from_millis(100);

/// Runs the hub until `shutdown` is cancelled: the CA is loaded or created first, then the
/// admission webhook serves; with leader election the replica stands by (ready) until it
/// wins the Lease. Readiness of the leader turns true once every watch has listed.
pub async fn run(
    client: Client,
    settings: Settings,
    listeners: Listeners,
    health: Health,
    metrics: Metrics,
    shutdown: CancellationToken,
) -> Result<(), ServeError> {
    let ca = ca::load_or_create(&client, &settings.namespace).await?;
    if let Some(not_after) = ca::ca_not_after(&ca) {
        metrics.certificate_expiry("ca").set(not_after);
    }
    let grpc_certificate = RenewingCertificate::issue(
        &ca,
        "kmm-hub",
        &settings.grpc_sans,
        settings.serving_validity,
        metrics.certificate_expiry("grpc"),
    )?;
    let grpc_tls = serving::server_config(
        grpc_certificate.certificate.clone(),
        Some(ca.cert_pem()),
        &[b"h2"],
    )?;
    // Ends the servers and every background task: on shutdown, or when leadership is lost.
    let stop = CancellationToken::new();

    let mut background = vec![AbortOnDropHandle::new(tokio::spawn(
        grpc_certificate.keep_renewed(client.clone(), settings.namespace.clone(), stop.clone()),
    ))];
    if let Some(listener) = listeners.webhook {
        let certificate = RenewingCertificate::issue(
            &ca,
            "kmm-hub-webhook",
            &settings.webhook_sans,
            settings.serving_validity,
            metrics.certificate_expiry("webhook"),
        )?;
        let tls = webhook::tls_config(certificate.certificate.clone())?;
        background.push(AbortOnDropHandle::new(tokio::spawn(
            certificate.keep_renewed(client.clone(), settings.namespace.clone(), stop.clone()),
        )));
        background.push(AbortOnDropHandle::new(tokio::spawn(webhook::serve(
            listener,
            tls,
            webhook::LIMITS,
            client.clone(),
            metrics.clone(),
            stop.clone().cancelled_owned(),
        ))));
    }
    // Until this replica leads, its UI says it stands by (or starts).
    let role = tokio::sync::watch::Sender::new(Role::Standby);
    let serves_ui = listeners.ui.is_some();
    if let Some(listener) = listeners.ui {
        let replica = Replica {
            instance: settings.instance.clone(),
            role: role.subscribe(),
            lease: settings
                .leader_election
                .as_ref()
                .map(|election| LeaseLookup {
                    api: Api::namespaced(client.clone(), &settings.namespace),
                    namespace: settings.namespace.clone(),
                    name: election.lease.clone(),
                }),
        };
        background.push(AbortOnDropHandle::new(tokio::spawn(
            crate::fleet_ui::server::serve(
                listener,
                replica,
                metrics.ui_connections.clone(),
                stop.clone().cancelled_owned(),
            ),
        )));
    }
    if let Some(name) = &settings.webhook_configuration {
        background.push(AbortOnDropHandle::new(tokio::spawn(
            webhook_configuration::keep_ca_bundle(
                client.clone(),
                name.clone(),
                ca.cert_pem().to_owned(),
            ),
        )));
    }
    let ca_pem = ca.cert_pem().to_owned();
    drop(ca);

    let election = match &settings.leader_election {
        None => None,
        Some(election_settings) => {
            let mut election =
                Election::join(&client, &settings.namespace, election_settings).await?;
            metrics.leader.set(0);
            health.set_note(Some(format!(
                "standing by: Lease {}/{} is held by another replica",
                settings.namespace, election_settings.lease
            )));
            health.set_ready(true);
            tracing::info!(
                lease = election_settings.lease,
                identity = election_settings.identity,
                "standing by for the leader Lease"
            );
            tokio::select! {
                won = election.won() => won?,
                () = shutdown.cancelled() => {
                    stop.cancel();
                    election.resign().await;
                    return Ok(());
                }
            }
            tracing::info!(lease = election_settings.lease, "leading");
            health.set_note(Some("leading; syncing caches".to_owned()));
            Some(election)
        }
    };
    metrics.leader.set(1);
    let lost = election.as_ref().map(Election::lost);

    let modules: Api<ManagedClusterModule> = Api::all(client.clone());
    let module_watch = match &settings.module_selector {
        Some(selector) => watcher::Config::default().labels(selector),
        None => watcher::Config::default(),
    };
    // The modules' watch feeds the fleet view like every other kind, and shares its store
    // and events with the controller.
    let (module_store, module_writer) = reflector::store_shared(MODULE_EVENTS_BUFFERED);
    let module_events = module_writer
        .subscribe()
        .expect("a shared store has subscribers");
    let controller = Controller::for_shared_stream(module_events, module_store.clone());
    let cluster_resource = ocm::MANAGED_CLUSTER.api_resource();
    let clusters_writer = reflector::store::Writer::<DynamicObject>::new(cluster_resource.clone());
    let secrets_writer = reflector::store::Writer::<Secret>::default();
    let revisions_writer = reflector::store::Writer::<ControllerRevision>::default();
    let preflights_writer = reflector::store::Writer::<PreflightValidation>::default();
    let decision_resource = ocm::PLACEMENT_DECISION.api_resource();
    let decisions_writer =
        reflector::store::Writer::<DynamicObject>::new(decision_resource.clone());
    let stores = Stores {
        modules: module_store,
        clusters: clusters_writer.as_reader(),
        secrets: secrets_writer.as_reader(),
        revisions: revisions_writer.as_reader(),
        preflights: preflights_writer.as_reader(),
        decisions: decisions_writer.as_reader(),
    };
    let state = Arc::new(FleetView::new(stores.clone(), metrics.clone()));
    role.send_replace(Role::Leading(state.clone()));

    let modules_watched = watch_into(
        state.clone(),
        watcher(modules.clone(), module_watch)
            .default_backoff()
            .reflect_shared(module_writer),
        "ManagedClusterModules",
        |state, module, seen| match seen {
            Seen::Applied => state.note_module(module),
            Seen::Deleted => state.forget_module(module),
        },
    );
    let clusters_api: Api<DynamicObject> = Api::all_with(client.clone(), &cluster_resource);
    let clusters = watch_into(
        state.clone(),
        reflected(
            clusters_writer,
            watcher(clusters_api, watcher::Config::default()).modify(trim_managed_cluster),
        ),
        "ManagedClusters",
        |state, cluster, _| state.cluster_changed(&cluster.name_any()),
    );
    let secrets_api: Api<Secret> = Api::namespaced(client.clone(), &settings.namespace);
    let secrets = watch_into(
        state.clone(),
        reflected(
            secrets_writer,
            watcher(secrets_api, watcher::Config::default()),
        ),
        "Secrets",
        |state, secret, _| state.secret_changed(&secret.name_any()),
    );
    let revisions_api: Api<ControllerRevision> =
        Api::namespaced(client.clone(), &settings.namespace);
    let revisions = watch_into(
        state.clone(),
        reflected(
            revisions_writer,
            watcher(
                revisions_api,
                watcher::Config::default().labels(revisions::MODULE_LABEL),
            ),
        ),
        "ControllerRevisions",
        |state, revision, _| state.revision_changed(revision),
    );
    let preflights_api: Api<PreflightValidation> = Api::all(client.clone());
    let preflights = watch_into(
        state.clone(),
        reflected(
            preflights_writer,
            watcher(preflights_api.clone(), watcher::Config::default()),
        ),
        "PreflightValidations",
        |state, _, _| state.preflight_changed(),
    );
    let decisions_api: Api<DynamicObject> = Api::all_with(client.clone(), &decision_resource);
    let decisions = watch_into(
        state.clone(),
        reflected(
            decisions_writer,
            watcher(
                decisions_api,
                watcher::Config::default().labels(ocm::PLACEMENT_LABEL),
            )
            .modify(|decision| decision.metadata.managed_fields = None),
        ),
        "PlacementDecisions",
        |state, _, _| state.decisions_changed(),
    );
    if serves_ui {
        background.push(AbortOnDropHandle::new(tokio::spawn(module_events::follow(
            Api::namespaced(client.clone(), module_events::NAMESPACE),
            state.clone(),
        ))));
    }
    let preflight_writer = AbortOnDropHandle::new(tokio::spawn(preflight::run(
        state.clone(),
        preflights_api,
        stores.preflights.clone(),
    )));
    tokio::spawn(wait_synced(stores.clone(), state.clone(), health.clone()));
    let departures = AbortOnDropHandle::new(tokio::spawn(settle_departures(state.clone())));
    background.push(AbortOnDropHandle::new(tokio::spawn(
        state.clone().follow_stale(),
    )));
    background.push(AbortOnDropHandle::new(tokio::spawn(
        metrics::follow_connections(state.connections(), metrics.clone()),
    )));
    let addon = AbortOnDropHandle::new(tokio::spawn(addon::run(
        client.clone(),
        settings.addon_name.clone(),
        ca_pem,
        state.connections(),
        state.clone(),
    )));

    let events = EventPublisher::new(client.clone(), &settings.instance);
    let image_worker = AbortOnDropHandle::new(tokio::spawn(images::run(images::ImageWorker {
        state: state.clone(),
        modules: stores.modules.clone(),
        secrets: stores.secrets.clone(),
        config_maps: Api::namespaced(client.clone(), &settings.namespace),
        namespace: settings.namespace.clone(),
        builds: BuildJobs::new(client.clone(), &settings.namespace, &settings.builder_image),
        events: EventQueue::start(events.clone()),
        registry_ca_file: settings.registry_ca_file.clone(),
        follow_interval: settings.image_follow_interval,
    })));

    let context = Arc::new(Context {
        api: modules,
        revisions: Api::namespaced(client.clone(), &settings.namespace),
        namespace: settings.namespace.clone(),
        state: state.clone(),
        events,
        unload_timeout: settings.unload_timeout,
        metrics: metrics.clone(),
        status_pacer: StatusPacer::default(),
        deletion_clock: DeletionClock::default(),
    });
    let results = metrics.clone();
    let reconciler = controller
        .reconcile_on(touched_modules(state.clone()))
        .graceful_shutdown_on(stop.clone().cancelled_owned())
        .run(controller::reconcile, controller::error_policy, context)
        .for_each(move |result| {
            observe_controller(&results, result);
            futures::future::ready(())
        });

    let grpc_server = Server::builder()
        .http2_keepalive_interval(Some(Duration::from_secs(30)))
        .add_service(
            HubServer::new(SyncService {
                state: state.clone(),
                metrics: metrics.clone(),
                addon_name: settings.addon_name.clone(),
                opens: Arc::default(),
            })
            .max_decoding_message_size(limits::PROXY_MESSAGE)
            .max_encoding_message_size(limits::HUB_MESSAGE),
        )
        .serve_with_incoming_shutdown(
            serving::incoming(listeners.grpc, grpc_tls, stop.clone()),
            stop.clone().cancelled_owned(),
        );
    tracing::info!(namespace = settings.namespace, "kmm-hub serving");

    let stopping = state.clone();
    let stopper = async move {
        shutdown.cancelled().await;
        tracing::info!("shutting down");
        // Streams never end by themselves; the server's graceful stop waits for them.
        stopping.end_streams("the hub is shutting down");
        stop.cancel();
    };
    let lost = async move {
        match lost {
            Some(lost) => lost.await,
            None => std::future::pending().await,
        }
    };
    let modules_watched = AbortOnDropHandle::new(tokio::spawn(modules_watched));
    let clusters = AbortOnDropHandle::new(tokio::spawn(clusters));
    let secrets = AbortOnDropHandle::new(tokio::spawn(secrets));
    let revisions = AbortOnDropHandle::new(tokio::spawn(revisions));
    let preflights = AbortOnDropHandle::new(tokio::spawn(preflights));
    let decisions = AbortOnDropHandle::new(tokio::spawn(decisions));
    // A shutdown is graceful: streams end, in-flight reconciles finish. A lost Lease is
    // not: the server, the reconciles and their requests are dropped at once, so that
    // nothing is served or written after the renew deadline (a standby may lead soon).
    let graceful = async { tokio::join!(grpc_server, reconciler, stopper) };
    let grpc_result = tokio::select! {
        (grpc_result, (), ()) = graceful => Some(grpc_result),
        () = lost => None,
    };
    drop((
        modules_watched,
        clusters,
        secrets,
        revisions,
        preflights,
        decisions,
        preflight_writer,
        departures,
        addon,
        image_worker,
        background,
    ));
    health.set_ready(false);
    metrics.leader.set(0);
    let Some(grpc_result) = grpc_result else {
        tracing::error!("lost the leader Lease; stopped serving and writing");
        state.end_streams("the hub lost its leadership");
        return Err(ServeError::LeadershipLost);
    };
    if let Some(election) = election {
        election.resign().await;
    }
    grpc_result.map_err(ServeError::Grpc)?;
    Ok(())
}

/// Looks again, about every second, at the clusters whose departure from a Placement's
/// decisions has settled: from then on it is meant, and unloads.
async fn settle_departures(state: Arc<FleetView>) {
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        state.settle_departures(std::time::Instant::now());
    }
}

/// Counts every run of the module controller by its result. A failed reconciliation
/// was logged by the error policy; anything else failing (a watch, the queue) is logged
/// here: a broken watch must not be silent.
fn observe_controller(
    metrics: &Metrics,
    result: Result<
        (
            ObjectRef<ManagedClusterModule>,
            kube::runtime::controller::Action,
        ),
        kube::runtime::controller::Error<ReconcileError, watcher::Error>,
    >,
) {
    use kube::runtime::controller::Error;
    let label = match result {
        Ok(_) => "reconciled",
        Err(Error::ReconcilerFailed(..)) => "reconcile_failed",
        Err(Error::ObjectNotFound(object)) => {
            tracing::debug!(module = object.name, "queued module is gone");
            "object_not_found"
        }
        Err(error @ Error::QueueError(_)) => {
            tracing::warn!(%error, "the ManagedClusterModule watch failed; retrying");
            "watch_failed"
        }
        Err(error) => {
            tracing::warn!(%error, "the ManagedClusterModule controller failed");
            "controller_failed"
        }
    };
    metrics.observe_controller(label);
}

/// The modules an event touched, paced: a module is reconciled at once after a quiet
/// period, and at most once per [`TOUCH_INTERVAL`] (or [`count_spacing`]) while its
/// clusters keep reporting.
fn touched_modules(
    state: Arc<FleetView>,
) -> impl futures::Stream<Item = ObjectRef<ManagedClusterModule>> + Send {
    let pacer = Pacer::new(TOUCH_INTERVAL);
    futures::stream::unfold(
        (state, pacer, VecDeque::<String>::new()),
        |(state, mut pacer, mut ready)| async move {
            loop {
                if let Some(name) = ready.pop_front() {
                    return Some((ObjectRef::new(&name), (state, pacer, ready)));
                }
                let next = pacer.next_due();
                let touched = tokio::select! {
                    touched = state.touched().take() => touched,
                    () = sleep_until(next), if next.is_some() => BTreeSet::new(),
                };
                let now = Instant::now();
                ready.extend(pacer.due(now));
                for name in touched {
                    let cost = state.count_cost(&name).unwrap_or_default();
                    let spacing = count_spacing(cost, pacer.busy_with(&name));
                    if pacer.request_spaced(name.clone(), now, spacing) {
                        ready.push_back(name);
                    }
                }
            }
        },
    )
}

async fn sleep_until(at: Option<Instant>) {
    if let Some(at) = at {
        tokio::time::sleep_until(at.into()).await;
    }
}
