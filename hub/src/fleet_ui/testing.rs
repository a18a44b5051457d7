//! A small fleet view fed as the watches and proxies would (the `testing` feature): the
//! pages' unit tests render it, and the browser test in `kmm-e2e` serves it to a real
//! Chromium, so both look at the same fleet.

use std::collections::BTreeMap;
use std::sync::Arc;

use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::jiff::Timestamp;
use kmm_api::testing::ModuleBuilder;
use kmm_api::{ManagedClusterModule, ocm};
use kmm_proto::v1::{
    Kernel, KernelInventory, ModuleKey, ModuleNodeKey, ModuleNodeStatus, ModuleState,
    NodeStatusReport,
};
use kube::core::DynamicObject;
use kube::runtime::reflector::store::{Writer, store};
use kube::runtime::watcher;
use tokio::sync::watch;

use crate::fleet::assignment::FINALIZER;
use crate::fleet::outbox::Held;
use crate::images::ImageRecord;
use crate::serve::fleet_view::{ClusterStreams, FleetView, SessionId, Stores};
use crate::serve::metrics::Metrics;
use crate::serve::outbound::{Outbound, OutboundSender};

/// A pull credential's secret part, as a Secret holds it.
pub const TOKEN: &str = "s3cr3t-t0ken-never-shown";

/// One (module, node, state, reason, message) of a cluster's report.
pub type Entry<'a> = (&'a str, &'a str, ModuleState, &'a str, &'a str);

/// A cluster's stream to the hub: its session and what the hub sent it.
pub type Stream = (SessionId, watch::Receiver<Outbound>);

/// A synced fleet view over stores the test writes.
#[derive(Debug)]
pub struct Fleet {
    pub view: Arc<FleetView>,
    modules: Writer<ManagedClusterModule>,
    clusters: Writer<DynamicObject>,
    secrets: Writer<Secret>,
}

impl Default for Fleet {
    fn default() -> Self {
        Self::new()
    }
}

impl Fleet {
    pub fn new() -> Self {
        let modules = Writer::<ManagedClusterModule>::default();
        let clusters = Writer::<DynamicObject>::new(ocm::MANAGED_CLUSTER.api_resource());
        let secrets = Writer::<Secret>::default();
        let stores = Stores {
            modules: modules.as_reader(),
            clusters: clusters.as_reader(),
            secrets: secrets.as_reader(),
            revisions: store().0,
            preflights: store().0,
            decisions: Writer::<DynamicObject>::new(ocm::PLACEMENT_DECISION.api_resource())
                .as_reader(),
        };
        let view = Arc::new(FleetView::new(stores, Metrics::default()));
        view.set_synced();
        Self {
            view,
            modules,
            clusters,
            secrets,
        }
    }

    /// Adds `module`, or replaces the module of its name (a spec change).
    pub fn add_module(&mut self, module: ManagedClusterModule) {
        self.modules
            .apply_watcher_event(&watcher::Event::Apply(module.clone()));
        self.view.note_module(&module);
        self.view.recompute_stale();
    }

    pub fn add_cluster(&mut self, name: &str) {
        let cluster = serde_json::from_value(serde_json::json!({
            "apiVersion": "cluster.open-cluster-management.io/v1",
            "kind": "ManagedCluster",
            "metadata": {"name": name, "labels": {"env": "prod"}},
            "spec": {"hubAcceptsClient": true},
        }))
        .expect("a ManagedCluster");
        self.clusters
            .apply_watcher_event(&watcher::Event::Apply(cluster));
        self.view.cluster_changed(name);
    }

    /// Pull Secret `pull`, its Docker config holding [`TOKEN`].
    pub fn add_pull_secret(&mut self) {
        let config = format!(r#"{{"auths":{{"r.example":{{"auth":"{TOKEN}"}}}}}}"#);
        let mut secret = Secret::default();
        secret.metadata.name = Some("pull".into());
        secret.data = Some(BTreeMap::from([(
            ".dockerconfigjson".to_owned(),
            ByteString(config.into_bytes()),
        )]));
        self.secrets
            .apply_watcher_event(&watcher::Event::Apply(secret));
        self.view.secret_changed("pull");
    }

    /// Connects `cluster` with kernel 6.1, its images found: the stream and what it gets.
    pub fn connect(&self, cluster: &str) -> Stream {
        self.connect_with(cluster, &["6.1"])
    }

    pub fn connect_with(&self, cluster: &str, kernels: &[&str]) -> Stream {
        let outbound = OutboundSender::default();
        let sent = outbound.subscribe();
        let id = self.view.open_session(cluster, Held::default(), outbound);
        let inventory = KernelInventory {
            revision: 1,
            kernels: kernels
                .iter()
                .map(|k| Kernel {
                    release: (*k).into(),
                })
                .collect(),
        };
        self.view.inventory(cluster, id, inventory);
        self.find_images();
        (id, sent)
    }

    /// Every image the fleet needs is found, as the image worker would record it.
    pub fn find_images(&self) {
        for (key, need) in self.view.image_needs(None) {
            if self.view.image(&key).is_none() {
                let record = ImageRecord::seeded(&need, "sha256:0123".into(), Timestamp::now());
                self.view.set_image(key, record);
            }
        }
        self.view.recompute_stale();
    }

    /// The cluster reports each (module, node, state, reason, message) on kernel 6.1, as
    /// made with the snapshot it was last sent.
    pub fn report(&self, cluster: &str, (id, sent): &Stream, entries: &[Entry<'_>]) {
        let revision = match &*sent.borrow() {
            Outbound::Snapshot(snapshot) => snapshot.revision,
            other => panic!("no snapshot sent: {other:?}"),
        };
        let statuses = entries
            .iter()
            .map(|(module, node, state, reason, message)| ModuleNodeStatus {
                key: Some(ModuleNodeKey {
                    module: Some(ModuleKey {
                        namespace: "drivers".into(),
                        name: (*module).into(),
                    }),
                    node: (*node).into(),
                }),
                kernel: "6.1".into(),
                state: (*state).into(),
                reason: (*reason).into(),
                message: (*message).into(),
                ..ModuleNodeStatus::default()
            })
            .collect();
        let report = NodeStatusReport {
            full: true,
            statuses,
            intent_revision: revision,
            ..NodeStatusReport::default()
        };
        self.view.status(cluster, *id, report);
    }

    /// Counts every module's clusters by state, as the controller does after a change
    /// (the fleet page shows those counts).
    pub fn count(&self) {
        for module in self.view.known_modules() {
            self.view.module_view(&module);
        }
    }
}

/// Module `name`, guarded by the hub's finalizer (the hub serves no module without).
pub fn module(name: &str) -> ModuleBuilder {
    ModuleBuilder::new(name).uid("u1").finalizers(&[FINALIZER])
}
