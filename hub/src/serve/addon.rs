//! The hub's side of its OCM add-on, on the leader: it publishes the hub's CA into every
//! AddOnDeploymentConfig the add-on uses (the proxies learn the CA only from there) and
//! keeps the `Degraded` condition of each cluster's ManagedClusterAddOn. Level-based:
//! watches of the ClusterManagementAddOn, the ManagedClusterAddOns and the
//! AddOnDeploymentConfigs, and the proxies' sessions opening and closing, trigger a pass
//! over everything that writes (server-side apply, field manager `kmm-hub`) only what
//! differs. Without OCM's CRDs the watches retry until they appear.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use futures::TryStreamExt;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use k8s_openapi::jiff::Timestamp;
use kmm_api::ocm::{ADD_ON_DEPLOYMENT_CONFIG, CLUSTER_MANAGEMENT_ADD_ON, MANAGED_CLUSTER_ADD_ON};
use kube::api::{Patch, PatchParams};
use kube::core::{ApiResource, DynamicObject};
use kube::runtime::reflector::{self, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client, ResourceExt};
use serde_json::json;
use thiserror::Error;
use tokio::sync::{Notify, watch};

use crate::fleet::addon_config::{
    AddOnSpec, AddOnStatus, ConfigName, DeploymentConfigSpec, ManagementAddOnSpec, Variable,
    ca_bundle_variables, config_problem, effective_config, lacks, mirrors_by_cluster, parse,
    used_configs,
};
use crate::fleet::addon_status::{DEGRADED, degraded_condition, is_current, session};

use super::controller::FIELD_MANAGER;
use super::fleet_view::{Connections, FleetView};

/// Changes arriving together make one pass.
const DEBOUNCE: Duration = Duration::from_millis(200);
/// Level-based safety net: a pass at least this often.
const RESYNC: Duration = Duration::from_secs(60);
/// After a failed write, the next pass comes this soon, doubling up to [`RESYNC`].
const RETRY: Duration = Duration::from_secs(1);
/// How long after it began serving the hub waits before it calls a proxy that never
/// connected disconnected: after a failover the proxies take a moment to reconnect, and
/// their add-ons should not all flap to degraded.
const RECONNECT_GRACE: Duration = Duration::from_secs(10);

#[derive(Debug, Error)]
enum WriteError {
    #[error("publishing the hub CA in AddOnDeploymentConfig {config}: {source}")]
    Bundle {
        config: ConfigName,
        source: kube::Error,
    },
    #[error("writing the {DEGRADED} condition of ManagedClusterAddOn {namespace}/{name}: {source}")]
    Condition {
        namespace: String,
        name: String,
        source: kube::Error,
    },
}

/// A watched kind: its store, whether it listed once, and its watch.
struct Watched {
    store: Store<DynamicObject>,
    ready: Arc<AtomicBool>,
}

impl Watched {
    /// Starts nothing by itself: the returned future keeps the store current, waking
    /// `changed` on every change, and never ends.
    fn new(
        api: Api<DynamicObject>,
        config: watcher::Config,
        resource: &ApiResource,
        changed: Arc<Notify>,
        what: &'static str,
    ) -> (Self, impl Future<Output = ()> + Send + 'static) {
        let writer = reflector::store::Writer::new(resource.clone());
        let store = writer.as_reader();
        let ready = Arc::new(AtomicBool::new(false));
        let listed = ready.clone();
        let task = async move {
            let mut events = std::pin::pin!(
                reflector::reflector(writer, watcher(api, config)).default_backoff()
            );
            // Without OCM's CRDs every retry fails alike: say so once, not every few seconds.
            let mut failing = false;
            loop {
                match events.try_next().await {
                    Ok(Some(event)) => {
                        failing = false;
                        match event {
                            watcher::Event::Init | watcher::Event::InitApply(_) => continue,
                            watcher::Event::InitDone => listed.store(true, Ordering::SeqCst),
                            watcher::Event::Apply(_) | watcher::Event::Delete(_) => {}
                        }
                        changed.notify_one();
                    }
                    Ok(None) => return,
                    Err(error) if failing => {
                        tracing::debug!(what, %error, "watch still failing; retrying");
                    }
                    Err(error) => {
                        failing = true;
                        tracing::warn!(
                            what,
                            %error,
                            "cannot watch OCM's add-on objects (are OCM's CRDs installed?); retrying"
                        );
                    }
                }
            }
        };
        (Self { store, ready }, task)
    }

    fn is_ready(&self) -> bool {
        self.ready.load(Ordering::SeqCst)
    }
}

/// Runs until dropped.
pub async fn run(
    client: Client,
    addon: String,
    ca_pem: String,
    connections: watch::Receiver<Connections>,
    fleet: Arc<FleetView>,
) {
    let changed = Arc::new(Notify::new());
    let by_name = || watcher::Config::default().fields(&format!("metadata.name={addon}"));
    let cma_resource = CLUSTER_MANAGEMENT_ADD_ON.api_resource();
    let (management, management_watch) = Watched::new(
        Api::all_with(client.clone(), &cma_resource),
        by_name(),
        &cma_resource,
        changed.clone(),
        "ClusterManagementAddOn",
    );
    let mca_resource = MANAGED_CLUSTER_ADD_ON.api_resource();
    let (addons, addons_watch) = Watched::new(
        Api::all_with(client.clone(), &mca_resource),
        by_name(),
        &mca_resource,
        changed.clone(),
        "ManagedClusterAddOns",
    );
    let adc_resource = ADD_ON_DEPLOYMENT_CONFIG.api_resource();
    let (configs, configs_watch) = Watched::new(
        Api::all_with(client.clone(), &adc_resource),
        watcher::Config::default(),
        &adc_resource,
        changed.clone(),
        "AddOnDeploymentConfigs",
    );
    let bundle = ca_bundle_variables(&ca_pem)
        .inspect_err(|error| tracing::error!(%error, "the hub CA cannot be published"))
        .ok();
    let publisher = Publisher {
        client,
        addon,
        bundle,
        management,
        addons,
        configs,
        serving_since: Timestamp::now(),
        fleet,
    };
    tokio::join!(
        publisher.run(changed, connections),
        management_watch,
        addons_watch,
        configs_watch
    );
}

struct Publisher {
    client: Client,
    addon: String,
    /// `None` when the CA cannot be published (too large for the template).
    bundle: Option<Vec<Variable>>,
    management: Watched,
    addons: Watched,
    configs: Watched,
    serving_since: Timestamp,
    /// Told each cluster's image mirrors.
    fleet: Arc<FleetView>,
}

impl Publisher {
    async fn run(&self, changed: Arc<Notify>, mut connections: watch::Receiver<Connections>) {
        let mut retry: Option<Duration> = None;
        loop {
            let mut wait = retry.unwrap_or(RESYNC);
            if let Some(grace_left) = self.grace_left() {
                // Wake when the grace ends, to say which proxies never connected.
                wait = wait.min(grace_left + DEBOUNCE);
            }
            tokio::select! {
                () = changed.notified() => {}
                result = connections.changed() => if result.is_err() { return },
                () = tokio::time::sleep(wait) => {}
            }
            tokio::time::sleep(DEBOUNCE).await;
            if ![&self.management, &self.addons, &self.configs]
                .iter()
                .all(|w| w.is_ready())
            {
                continue;
            }
            let connections = connections.borrow_and_update().clone();
            let errors = self.pass(&connections).await;
            for error in &errors {
                tracing::warn!(%error, "retrying");
            }
            retry = if errors.is_empty() {
                None
            } else {
                Some(retry.map_or(RETRY, |r| (r * 2).min(RESYNC)))
            };
        }
    }

    fn grace_left(&self) -> Option<Duration> {
        let serving_for = Timestamp::now().duration_since(self.serving_since);
        let serving_for = Duration::try_from(serving_for).unwrap_or_default();
        RECONNECT_GRACE
            .checked_sub(serving_for)
            .filter(|left| !left.is_zero())
    }

    /// Writes what differs; returns the writes that failed.
    async fn pass(&self, connections: &Connections) -> Vec<WriteError> {
        let mut errors = Vec::new();
        let management: Option<ManagementAddOnSpec> = self
            .management
            .store
            .state()
            .iter()
            .find(|cma| cma.name_any() == self.addon)
            .map(|cma| parse(&cma.data["spec"]));
        let addons: Vec<(Arc<DynamicObject>, AddOnSpec, AddOnStatus)> = self
            .addons
            .store
            .state()
            .into_iter()
            .filter(|mca| mca.name_any() == self.addon)
            .map(|mca| {
                let spec = parse(&mca.data["spec"]);
                let status = parse(&mca.data["status"]);
                (mca, spec, status)
            })
            .collect();
        let configs: BTreeMap<ConfigName, (Arc<DynamicObject>, DeploymentConfigSpec)> = self
            .configs
            .store
            .state()
            .into_iter()
            .map(|adc| {
                let name = ConfigName::new(&adc.namespace().unwrap_or_default(), &adc.name_any());
                let spec = parse(&adc.data["spec"]);
                (name, (adc, spec))
            })
            .collect();

        let clusters: Vec<String> = addons
            .iter()
            .map(|(mca, ..)| mca.namespace().unwrap_or_default())
            .collect();
        self.fleet.set_mirrors(mirrors_by_cluster(
            management.as_ref(),
            clusters
                .iter()
                .zip(&addons)
                .map(|(cluster, (_, spec, status))| (cluster.as_str(), spec, status)),
            |name| configs.get(name).map(|(_, spec)| spec),
        ));

        if let Some(bundle) = &self.bundle {
            let used = used_configs(
                management.as_ref(),
                addons.iter().map(|(_, spec, status)| (spec, status)),
            );
            for name in used {
                // An absent one is reported in the conditions of the add-ons using it.
                if let Some((adc, spec)) = configs.get(&name)
                    && lacks(spec, bundle)
                {
                    match self.publish(adc, bundle).await {
                        Ok(()) => tracing::info!(config = %name, "published the hub CA"),
                        Err(source) => errors.push(WriteError::Bundle {
                            config: name.clone(),
                            source,
                        }),
                    }
                }
            }
        }

        let now = Timestamp::now();
        for (mca, spec, status) in &addons {
            let cluster = mca.namespace().unwrap_or_default();
            let effective = effective_config(management.as_ref(), spec, status);
            let problem = config_problem(effective.as_ref(), |c| configs.get(c).map(|(_, s)| s));
            let session = session(
                connections.open.contains(&cluster),
                connections.closed_at.get(&cluster),
                self.serving_since,
                now,
                RECONNECT_GRACE,
            );
            let previous = degraded(mca);
            let Some(next) = degraded_condition(
                &cluster,
                &session,
                problem.as_ref(),
                mca.metadata.generation,
                previous.as_ref(),
                Time(now),
            ) else {
                continue;
            };
            if is_current(previous.as_ref(), &next) {
                continue;
            }
            match self.write_condition(mca, &next).await {
                Ok(()) => tracing::info!(
                    cluster,
                    status = next.status,
                    reason = next.reason,
                    message = next.message,
                    "add-on {DEGRADED}"
                ),
                Err(source) => errors.push(WriteError::Condition {
                    namespace: cluster.clone(),
                    name: mca.name_any(),
                    source,
                }),
            }
        }
        errors
    }

    /// Applies the bundle's variables, which the hub alone owns in the list (a map keyed
    /// by name): users' variables stay as they are. The UID makes the apply fail rather
    /// than create an ADC deleted meanwhile.
    async fn publish(&self, adc: &DynamicObject, bundle: &[Variable]) -> Result<(), kube::Error> {
        let namespace = adc.namespace().unwrap_or_default();
        let api: Api<DynamicObject> = Api::namespaced_with(
            self.client.clone(),
            &namespace,
            &ADD_ON_DEPLOYMENT_CONFIG.api_resource(),
        );
        let patch = json!({
            "apiVersion": ADD_ON_DEPLOYMENT_CONFIG.api_version(),
            "kind": ADD_ON_DEPLOYMENT_CONFIG.kind,
            "metadata": {"name": adc.name_any(), "namespace": namespace, "uid": adc.uid()},
            "spec": {"customizedVariables": bundle},
        });
        api.patch(
            &adc.name_any(),
            &PatchParams::apply(FIELD_MANAGER).force(),
            &Patch::Apply(&patch),
        )
        .await
        .map(drop)
    }

    /// Applies the condition, which the hub alone owns in the list (a map keyed by type):
    /// OCM's conditions stay as they are.
    async fn write_condition(
        &self,
        mca: &DynamicObject,
        condition: &Condition,
    ) -> Result<(), kube::Error> {
        let namespace = mca.namespace().unwrap_or_default();
        let api: Api<DynamicObject> = Api::namespaced_with(
            self.client.clone(),
            &namespace,
            &MANAGED_CLUSTER_ADD_ON.api_resource(),
        );
        let patch = json!({
            "apiVersion": MANAGED_CLUSTER_ADD_ON.api_version(),
            "kind": MANAGED_CLUSTER_ADD_ON.kind,
            "metadata": {"name": mca.name_any(), "namespace": namespace, "uid": mca.uid()},
            "status": {"conditions": [condition]},
        });
        api.patch_status(
            &mca.name_any(),
            &PatchParams::apply(FIELD_MANAGER).force(),
            &Patch::Apply(&patch),
        )
        .await
        .map(drop)
    }
}

/// The add-on's current `Degraded` condition.
fn degraded(mca: &DynamicObject) -> Option<Condition> {
    let conditions: Vec<Condition> = parse(&mca.data["status"]["conditions"]);
    conditions.into_iter().find(|c| c.type_ == DEGRADED)
}
