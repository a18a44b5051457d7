//! The platform team's side of the soak: a model of what the soak asked for (modules,
//! node and cluster labels, a Placement), the changes it draws from it, and their
//! writes to the API.
//!
//! Every spoke node with an agent belongs to one of [`SLOTS`] slots, and each slot has
//! at most one module at a time: every module loads the same two kmods, and two modules
//! sharing a kmod on one node is a case of its own (issue #27, item 11), not one this
//! soak judges. A slot's deleted module leaves it free only after the next settle, so
//! that what is drawn never depends on how fast the fleet was.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use anyhow::{Context, Result};
use k8s_openapi::api::core::v1::{Namespace, Node};
use kmm_api::ManagedClusterModule;
use kmm_api::ocm::{MANAGED_CLUSTER_SET_BINDING, PLACEMENT};
use kube::api::{DeleteParams, Patch, PatchParams, PostParams};
use kube::core::DynamicObject;
use kube::{Api, Client};
use serde_json::{Value, json};

use super::schedule::Dice;
use crate::fixture::{Fleet, wait_until};
use crate::fleet::managed_clusters;
use crate::kmod::retag;

/// The spokeNamespace of the soak's modules: the agents' state keys and the ready
/// labels name it.
pub const SPOKE_NAMESPACE: &str = "kmm-chaos";
pub const SLOTS: usize = 3;
/// The slot whose modules a Placement places (besides their cluster selector).
const PLACED: usize = 2;
const DOMAIN: &str = "kmm-chaos.dev";
const NARROW_LABEL: &str = "kmm-chaos.dev/narrow";
const ZONE_LABEL: &str = "kmm-chaos.dev/zone";
const PLACEMENT_NAME: &str = "chaos";
const FIELD_MANAGER: &str = "kmm-chaos";
/// The second tag of every sample image (the same manifest): an image edit.
const ALT_TAG: &str = "-chaos";
/// How long one write may keep failing (an apiserver restarting under a fault).
const WRITE_DEADLINE: Duration = Duration::from_secs(120);

fn slot_label(slot: usize) -> String {
    format!("{DOMAIN}/s{slot}")
}

fn cluster_label(slot: usize) -> String {
    format!("{DOMAIN}/c{slot}")
}

/// One spoke node with an agent, as the soak uses it.
#[derive(Clone, Debug)]
pub struct NodeInfo {
    pub cluster: String,
    pub node: String,
    pub slot: usize,
    /// Whether the registry has a sample image for its kernel (else nothing can load).
    pub image: bool,
    /// Whether it carries [`NARROW_LABEL`]: it stays selected when its slot's module
    /// is narrowed.
    pub narrow: bool,
}

#[derive(Clone, Debug)]
pub struct Module {
    pub name: String,
    pub version: u32,
    pub alt_image: bool,
    pub narrow: bool,
}

impl Module {
    pub fn version(&self) -> String {
        format!("v{}", self.version)
    }
}

#[derive(Clone, Debug)]
pub enum Change {
    Create(usize),
    Version(usize),
    Image(usize),
    Narrow(usize),
    Delete(usize),
    NodeLabel(String),
    ClusterLabel(String, usize),
    Placement(Vec<String>),
}

/// What the soak asked for.
#[derive(Debug)]
pub struct Model {
    /// Prefix of this run's module names.
    run: String,
    pub nodes: Vec<NodeInfo>,
    pub spokes: Vec<String>,
    pub modules: [Option<Module>; SLOTS],
    /// Modules deleted since the last settle, by slot.
    pub deleting: Vec<(usize, String)>,
    /// Every module name this run created.
    pub names: Vec<String>,
    node_on: BTreeMap<String, bool>,
    cluster_on: BTreeSet<(String, usize)>,
    /// The zones (spokes) the Placement selects.
    zones: Vec<String>,
    created: usize,
    placement_namespace: Option<String>,
}

impl Model {
    /// Every spoke node with an agent, dealt round-robin to the slots (so each slot has
    /// nodes of every spoke), every node and cluster label on, no module yet.
    pub fn new(fleet: &Fleet, run: &str) -> Result<Self> {
        let kmm = fleet
            .state
            .kmm
            .as_ref()
            .context("the fleet runs without kmm")?;
        let images: BTreeSet<&str> = fleet
            .state
            .images
            .iter()
            .map(|i| i.kernel.as_str())
            .collect();
        let mut agents: Vec<(String, String, String)> = vec![];
        for cluster in fleet.state.spokes() {
            let kwok = cluster.nodes.iter().map(|n| (&n.name, &n.kernel));
            let real = cluster.real_nodes.iter().map(|n| (&n.name, &n.kernel));
            for (node, kernel) in kwok.chain(real) {
                if kmm.agents.iter().any(|a| a.node == *node) {
                    agents.push((cluster.name.clone(), node.clone(), kernel.clone()));
                }
            }
        }
        agents.sort();
        let nodes: Vec<NodeInfo> = agents
            .into_iter()
            .enumerate()
            .map(|(i, (cluster, node, kernel))| NodeInfo {
                cluster,
                node,
                slot: i % SLOTS,
                image: images.contains(kernel.as_str()),
                narrow: (i / SLOTS).is_multiple_of(2),
            })
            .collect();
        let spokes = fleet.spoke_names();
        Ok(Self {
            run: run.to_owned(),
            node_on: nodes.iter().map(|n| (n.node.clone(), true)).collect(),
            cluster_on: spokes
                .iter()
                .flat_map(|s| (0..SLOTS).map(move |k| (s.clone(), k)))
                .collect(),
            zones: spokes.clone(),
            nodes,
            spokes,
            modules: Default::default(),
            deleting: vec![],
            names: vec![],
            created: 0,
            placement_namespace: None,
        })
    }

    /// What `node` should have loaded now: the module and its version.
    pub fn desired(&self, node: &NodeInfo) -> Option<(String, String)> {
        let module = self.modules[node.slot].as_ref()?;
        let selected = self.cluster_on.contains(&(node.cluster.clone(), node.slot))
            && (node.slot != PLACED || self.zones.contains(&node.cluster))
            && self.node_on[&node.node]
            && (!module.narrow || node.narrow)
            && node.image;
        selected.then(|| (module.name.clone(), module.version()))
    }

    /// Draws the next change from what the model holds now.
    pub fn draw(&self, dice: &mut Dice) -> Change {
        let free: Vec<usize> = (0..SLOTS)
            .filter(|k| self.modules[*k].is_none() && !self.deleting.iter().any(|(s, _)| s == k))
            .collect();
        let used: Vec<usize> = (0..SLOTS).filter(|k| self.modules[*k].is_some()).collect();
        let mut kinds = vec!["node", "cluster", "placement"];
        if !free.is_empty() {
            kinds.push("create");
        }
        if !used.is_empty() {
            kinds.extend(["version", "image", "narrow", "delete"]);
        }
        match *dice.pick(&kinds) {
            "create" => Change::Create(*dice.pick(&free)),
            "version" => Change::Version(*dice.pick(&used)),
            "image" => Change::Image(*dice.pick(&used)),
            "narrow" => Change::Narrow(*dice.pick(&used)),
            "delete" => Change::Delete(*dice.pick(&used)),
            "node" => Change::NodeLabel(dice.pick(&self.nodes).node.clone()),
            "cluster" => Change::ClusterLabel(dice.pick(&self.spokes).clone(), dice.below(SLOTS)),
            _ => {
                let mut choices: Vec<Vec<String>> =
                    self.spokes.iter().map(|s| vec![s.clone()]).collect();
                choices.push(self.spokes.clone());
                choices.retain(|c| *c != self.zones);
                Change::Placement(dice.pick(&choices).clone())
            }
        }
    }

    /// The nodes whose module or selection the change touches.
    pub fn affected(&self, change: &Change) -> Vec<String> {
        let in_slot = |k: usize| -> Vec<String> {
            self.nodes
                .iter()
                .filter(|n| n.slot == k)
                .map(|n| n.node.clone())
                .collect()
        };
        match change {
            Change::Create(k)
            | Change::Version(k)
            | Change::Image(k)
            | Change::Narrow(k)
            | Change::Delete(k) => in_slot(*k),
            Change::NodeLabel(node) => vec![node.clone()],
            Change::ClusterLabel(cluster, k) => self
                .nodes
                .iter()
                .filter(|n| n.slot == *k && n.cluster == *cluster)
                .map(|n| n.node.clone())
                .collect(),
            Change::Placement(_) => in_slot(PLACED),
        }
    }

    /// Records the change in the model; says what it is.
    pub fn apply(&mut self, change: &Change) -> String {
        match change {
            Change::Create(k) => {
                self.created += 1;
                let name = format!("{}-s{k}-{}", self.run, self.created);
                self.names.push(name.clone());
                self.modules[*k] = Some(Module {
                    name: name.clone(),
                    version: 1,
                    alt_image: false,
                    narrow: false,
                });
                format!("create {name} in slot {k}")
            }
            Change::Version(k) => {
                let module = self.modules[*k].as_mut().expect("drawn from a used slot");
                module.version += 1;
                format!("version of {} to {}", module.name, module.version())
            }
            Change::Image(k) => {
                let module = self.modules[*k].as_mut().expect("drawn from a used slot");
                module.alt_image = !module.alt_image;
                format!("image of {} to tag {}", module.name, tag(module.alt_image))
            }
            Change::Narrow(k) => {
                let module = self.modules[*k].as_mut().expect("drawn from a used slot");
                module.narrow = !module.narrow;
                let how = if module.narrow { "narrow" } else { "widen" };
                format!("{how} {} (node selector {NARROW_LABEL})", module.name)
            }
            Change::Delete(k) => {
                let module = self.modules[*k].take().expect("drawn from a used slot");
                self.deleting.push((*k, module.name.clone()));
                format!("delete {}", module.name)
            }
            Change::NodeLabel(node) => {
                let on = self.node_on.get_mut(node).expect("drawn from the nodes");
                *on = !*on;
                let on = *on;
                let slot = self.slot_of(node);
                format!("node {node}: {} {}", onoff(on), slot_label(slot))
            }
            Change::ClusterLabel(cluster, k) => {
                let key = (cluster.clone(), *k);
                let on = !self.cluster_on.remove(&key);
                if on {
                    self.cluster_on.insert(key);
                }
                format!("cluster {cluster}: {} {}", onoff(on), cluster_label(*k))
            }
            Change::Placement(zones) => {
                self.zones = zones.clone();
                format!("Placement {PLACEMENT_NAME} selects zones {zones:?}")
            }
        }
    }

    fn slot_of(&self, node: &str) -> usize {
        self.nodes
            .iter()
            .find(|n| n.node == node)
            .map_or(0, |n| n.slot)
    }

    /// Slots whose deletions settled are free again.
    pub fn settled(&mut self) {
        self.deleting.clear();
    }

    /// Deletes every module (in the model), as the soak's end does.
    pub fn clear(&mut self) -> Vec<Change> {
        (0..SLOTS)
            .filter(|k| self.modules[*k].is_some())
            .map(Change::Delete)
            .collect()
    }

    /// Writes the change (already applied to the model) to the API, retrying while an
    /// apiserver is away. Idempotent writes only, so a retry after an answer that got
    /// lost changes nothing.
    pub async fn write(&self, fleet: &Fleet, change: &Change) -> Result<()> {
        match change {
            Change::Create(k) | Change::Version(k) | Change::Image(k) | Change::Narrow(k) => {
                let object = self.module_object(fleet, *k)?;
                let name = object["metadata"]["name"].as_str().unwrap_or_default();
                let api = Api::<ManagedClusterModule>::all(fleet.hub.clone());
                retry(&format!("applying module {name}"), || async {
                    api.patch(
                        name,
                        &PatchParams::apply(FIELD_MANAGER).force(),
                        &Patch::Apply(&object),
                    )
                    .await
                    .map(drop)
                })
                .await
            }
            Change::Delete(k) => {
                let (_, name) = self
                    .deleting
                    .iter()
                    .rev()
                    .find(|(s, _)| s == k)
                    .context("a deleted module")?;
                delete_module(&fleet.hub, name).await
            }
            Change::NodeLabel(node) => {
                let info = self
                    .nodes
                    .iter()
                    .find(|n| n.node == *node)
                    .context("a node of the model")?;
                let on = self.node_on[node];
                label_node(
                    fleet.spoke(&info.cluster)?,
                    node,
                    &slot_label(info.slot),
                    on,
                )
                .await
            }
            Change::ClusterLabel(cluster, k) => {
                let on = self.cluster_on.contains(&(cluster.clone(), *k));
                label_cluster(&fleet.hub, cluster, &cluster_label(*k), on.then_some("yes")).await
            }
            Change::Placement(_) => {
                let namespace = self
                    .placement_namespace
                    .as_deref()
                    .context("the Placement's namespace")?;
                let api = Api::<DynamicObject>::namespaced_with(
                    fleet.hub.clone(),
                    namespace,
                    &PLACEMENT.api_resource(),
                );
                let patch = json!({"spec": self.placement_spec()});
                retry("editing the Placement", || async {
                    api.patch(
                        PLACEMENT_NAME,
                        &PatchParams::default(),
                        &Patch::Merge(&patch),
                    )
                    .await
                    .map(drop)
                })
                .await
            }
        }
    }

    fn placement_spec(&self) -> Value {
        json!({
            "clusterSets": ["default"],
            "predicates": [{"requiredClusterSelector": {"labelSelector": {"matchExpressions": [
                {"key": ZONE_LABEL, "operator": "In", "values": self.zones},
            ]}}}],
        })
    }

    fn module_object(&self, fleet: &Fleet, slot: usize) -> Result<Value> {
        let module = self.modules[slot]
            .as_ref()
            .context("a module in the slot")?;
        let mut node_selector = json!({ slot_label(slot): "yes" });
        if module.narrow {
            node_selector[NARROW_LABEL] = json!("yes");
        }
        let image = format!(
            "{}/samples/kmm-hello:${{KERNEL_FULL_VERSION}}{}",
            fleet.state.node_registry,
            tag(module.alt_image)
        );
        let mut spec = json!({
            "spokeNamespace": SPOKE_NAMESPACE,
            "selector": { cluster_label(slot): "yes" },
            "moduleSpec": {
                "selector": node_selector,
                "moduleLoader": { "container": {
                    "version": module.version(),
                    "modprobe": {
                        "moduleName": "kmm_hello_dep",
                        "modulesLoadingOrder": ["kmm_hello_dep", "kmm_hello"],
                        "parameters": ["who=chaos"],
                    },
                    "registryTLS": { "insecure": true },
                    "kernelMappings": [{ "regexp": "^.+$", "containerImage": image }],
                }},
            },
        });
        if slot == PLACED {
            spec["placementRefs"] = json!([{
                "namespace": self.placement_namespace.as_deref().context("the Placement's namespace")?,
                "name": PLACEMENT_NAME,
            }]);
        }
        Ok(json!({
            "apiVersion": "hub.kmm.sigs.x-k8s.io/v1beta1",
            "kind": "ManagedClusterModule",
            "metadata": { "name": module.name },
            "spec": spec,
        }))
    }

    /// Tags every sample image a second time, creates the Placement (in a namespace of
    /// its own) and sets every label the model starts with.
    pub async fn set_up(&mut self, fleet: &Fleet) -> Result<()> {
        for image in &fleet.state.images {
            retag(
                &fleet.state.registry,
                "samples/kmm-hello",
                &image.kernel,
                &format!("{}{ALT_TAG}", image.kernel),
            )
            .await
            .with_context(|| format!("tagging the sample image of {}", image.kernel))?;
        }
        let namespaces: Api<Namespace> = Api::all(fleet.hub.clone());
        let created = namespaces
            .create(
                &PostParams::default(),
                &serde_json::from_value(
                    json!({"metadata": {"generateName": format!("{}-", self.run)}}),
                )?,
            )
            .await?;
        let namespace = created.metadata.name.context("the namespace's name")?;
        self.placement_namespace = Some(namespace.clone());
        for (resource, object) in [
            (
                MANAGED_CLUSTER_SET_BINDING,
                json!({"metadata": {"name": "default"}, "spec": {"clusterSet": "default"}}),
            ),
            (
                PLACEMENT,
                json!({"metadata": {"name": PLACEMENT_NAME}, "spec": self.placement_spec()}),
            ),
        ] {
            let mut object: DynamicObject = serde_json::from_value(object)?;
            object.types = Some(kube::core::TypeMeta {
                api_version: resource.api_version(),
                kind: resource.kind.to_owned(),
            });
            Api::<DynamicObject>::namespaced_with(
                fleet.hub.clone(),
                &namespace,
                &resource.api_resource(),
            )
            .create(&PostParams::default(), &object)
            .await?;
        }
        for spoke in &self.spokes {
            label_cluster(&fleet.hub, spoke, ZONE_LABEL, Some(spoke)).await?;
            for k in 0..SLOTS {
                label_cluster(&fleet.hub, spoke, &cluster_label(k), Some("yes")).await?;
            }
        }
        for node in &self.nodes {
            let client = fleet.spoke(&node.cluster)?;
            label_node(client, &node.node, &slot_label(node.slot), true).await?;
            label_node(client, &node.node, NARROW_LABEL, node.narrow).await?;
        }
        Ok(())
    }

    /// Removes every label and the Placement's namespace (the modules are gone by now).
    pub async fn tear_down(&self, fleet: &Fleet) -> Result<()> {
        for spoke in &self.spokes {
            label_cluster(&fleet.hub, spoke, ZONE_LABEL, None).await?;
            for k in 0..SLOTS {
                label_cluster(&fleet.hub, spoke, &cluster_label(k), None).await?;
            }
        }
        for node in &self.nodes {
            let client = fleet.spoke(&node.cluster)?;
            label_node(client, &node.node, &slot_label(node.slot), false).await?;
            label_node(client, &node.node, NARROW_LABEL, false).await?;
        }
        if let Some(namespace) = &self.placement_namespace {
            let namespaces: Api<Namespace> = Api::all(fleet.hub.clone());
            retry("deleting the Placement's namespace", || async {
                match namespaces.delete(namespace, &DeleteParams::default()).await {
                    Err(kube::Error::Api(e)) if e.code == 404 => Ok(()),
                    other => other.map(drop),
                }
            })
            .await?;
        }
        Ok(())
    }
}

fn tag(alt: bool) -> &'static str {
    if alt { ALT_TAG } else { "" }
}

fn onoff(on: bool) -> &'static str {
    if on { "set" } else { "removed" }
}

/// Retries `write` until it succeeds or [`WRITE_DEADLINE`] passes.
async fn retry<F, Fut>(what: &str, mut write: F) -> Result<()>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = kube::Result<()>>,
{
    let failed = std::sync::atomic::AtomicBool::new(false);
    wait_until(what, WRITE_DEADLINE, || {
        let attempt = write();
        let failed = &failed;
        async move {
            attempt.await.map_err(|e| {
                // Once per write: an apiserver down under a fault fails every attempt.
                if !failed.swap(true, std::sync::atomic::Ordering::Relaxed) {
                    println!("chaos: {what} failed, retrying: {e}");
                }
                e.to_string()
            })
        }
    })
    .await?;
    Ok(())
}

pub async fn delete_module(hub: &Client, name: &str) -> Result<()> {
    let api = Api::<ManagedClusterModule>::all(hub.clone());
    retry(&format!("deleting module {name}"), || async {
        match api.delete(name, &DeleteParams::default()).await {
            Err(kube::Error::Api(e)) if e.code == 404 => Ok(()),
            other => other.map(drop),
        }
    })
    .await
}

async fn label_node(spoke: &Client, node: &str, key: &str, on: bool) -> Result<()> {
    let value = if on { json!("yes") } else { Value::Null };
    let patch = json!({ "metadata": { "labels": { key: value } } });
    let api = Api::<Node>::all(spoke.clone());
    retry(&format!("labelling Node {node}"), || async {
        api.patch(node, &PatchParams::default(), &Patch::Merge(&patch))
            .await
            .map(drop)
    })
    .await
}

async fn label_cluster(hub: &Client, cluster: &str, key: &str, value: Option<&str>) -> Result<()> {
    let patch = json!({ "metadata": { "labels": { key: value } } });
    let api = managed_clusters(hub);
    retry(&format!("labelling ManagedCluster {cluster}"), || async {
        api.patch(cluster, &PatchParams::default(), &Patch::Merge(&patch))
            .await
            .map(drop)
    })
    .await
}
