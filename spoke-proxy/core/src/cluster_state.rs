//! The proxy's whole view of its cluster (nodes, the hub's last intents, what each node
//! agent proved) and everything derived from it: each node's revisioned
//! DesiredModules, per module per node status, node label patches and the kernel
//! inventory. Pure: the I/O tasks feed it and read from it.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use kmm_proto::v1::{
    AgentHello, DesiredModules, DevicePlugin, DevicePluginCount, DevicePluginReport,
    IntentSnapshot, KernelInventory, ModuleEvent, ModuleIntent, ModuleLoad, ModuleState,
    PullCredential, Toleration, Unresolved,
};
use serde_json::Value;

use kmm_api::labels::{
    device_plugin_ready_label, device_plugin_scheduling_label, ready_label, version_module_label,
};

use crate::agent_view::{AgentView, UnknownModule};
use crate::cluster_pull_secret::ClusterPullSecret;
use crate::inventory::{Inventory, kernels};
use crate::labels::{
    LabelIntent, ModuleLabels, device_plugin_only_intent, label_intent, merge_patch,
};
use crate::module_id::ModuleId;
use crate::node_facts::NodeFacts;
use crate::node_status::{NodeStatuses, StatusKey, assess, assess_device_plugin_only, to_status};
use crate::node_upgrade::{self, Hold};
use crate::placement::{Held, Placement, check_agent_kernel, place};
use crate::spoke_images::{Request, SpokeImages};

mod given;
use given::{Given, SharedParts};

/// One node's current work.
#[derive(Clone, Default)]
struct NodeWork {
    /// Revision of `modules`: the value of the cluster-wide counter when they last changed.
    revision: u64,
    modules: Vec<Given>,
    placements: BTreeMap<ModuleId, Placement>,
    /// Per module, the revision at which what the agent must do for it last changed.
    since: BTreeMap<ModuleId, u64>,
    /// Modules that left `modules` while the agent still holds them, with their last
    /// task: one that comes back unchanged (a new hub leader's first snapshot leaves out
    /// a module whose images it has not checked yet) is still proved by the agent's
    /// earlier report, for the agent has nothing new to do or say.
    departed: BTreeMap<ModuleId, Given>,
}

/// See the module documentation. Its `Debug` shows counts only: the intents and the
/// nodes' work carry pull credentials, which are never printed.
pub struct ClusterState {
    nodes: BTreeMap<String, NodeFacts>,
    nodes_listed: bool,
    intents: Option<IntentSnapshot>,
    /// The identity of each module of `intents`, in its order: every node's work keys
    /// the module with a clone of it (sharing its text).
    module_ids: Vec<ModuleId>,
    agents: BTreeMap<String, AgentView>,
    /// (module, node) pairs where the module may be: placed there, or reported loaded.
    /// Deselecting such a node unloads explicitly; other nodes are left alone.
    may_have: BTreeSet<StatusKey>,
    work: BTreeMap<String, NodeWork>,
    /// Nodes with a module waiting for its upgrade turn, kept as they are placed so that
    /// an event looks at these rather than at every node.
    waiting: BTreeSet<String>,
    /// (module, node) pairs whose module left the snapshot while the node may still carry
    /// its labels: they go once the node's agent says the module is not loaded (the hub
    /// forgets a module as soon as every node reported it unloaded, which can come before
    /// the labels were patched), `device-plugin-ready` once the plugin's Pod is not Ready
    /// there (its DaemonSet goes with the module), and the pairs are forgotten once the
    /// labels are gone.
    unlabel: BTreeSet<StatusKey>,
    /// Nodes whose status or labels may have changed since the hub link, respectively
    /// the label patcher, last looked.
    status_dirty: BTreeSet<String>,
    label_dirty: BTreeSet<String>,
    next_revision: u64,
    inventory: Inventory,
    /// (module, node) pairs where a Pod of the module's device plugin exists, with whether
    /// one is Ready there: the module is not unloaded nor replaced there until it is gone,
    /// and `device-plugin-ready` follows its readiness. `None` until the Pods were listed:
    /// meanwhile every module that has a plugin counts as running it everywhere.
    device_plugin_pods: Option<BTreeMap<StatusKey, bool>>,
    /// Per module, its plugin DaemonSet's (desired, available) Pods, for the hub.
    device_plugin_counts: BTreeMap<ModuleId, (u32, u32)>,
    /// The cluster's own pull Secret, for the loads the hub sent without a credential.
    cluster_pull_secret: ClusterPullSecret,
    /// The images the hub asked this cluster to resolve, and the answers.
    spoke_images: SpokeImages,
    /// The loads and credentials of `work`, each held once.
    shared: SharedParts,
}

/// One image to resolve now, with what to resolve it with.
#[derive(Clone)]
pub struct SpokeResolution {
    pub request: Request,
    pub tls: Option<kmm_proto::v1::RegistryTls>,
    /// The credential to ask with (the module's from the hub, else the cluster's own),
    /// or why the cluster's own cannot be used.
    pub credential: Result<Option<PullCredential>, Unresolved>,
}

impl std::fmt::Debug for SpokeResolution {
    /// Without the credential's content.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SpokeResolution")
            .field("request", &self.request)
            .field("tls", &self.tls)
            .finish_non_exhaustive()
    }
}

/// What the agent must do for a module, without what it needs to do it (credentials,
/// registry TLS): a change of those alone changes no outcome, so it must not make the
/// module pending again while the agent has nothing to report.
fn same_task(a: Option<&Given>, b: &Given) -> bool {
    let task = |m: &Given| {
        (
            m.unload,
            m.load.as_deref().map(|l: &ModuleLoad| {
                (
                    // The bytes, not their name: a retag of the pinned digest is no task.
                    crate::node_status::load_bytes(l).to_owned(),
                    l.version.clone(),
                    l.modprobe.clone(),
                    l.in_tree_modules_to_remove.clone(),
                )
            }),
        )
    };
    a.is_some_and(|a| task(a) == task(b))
}

/// Whether the node carries the scheduling label or `device-plugin-ready` of the module's
/// device plugin.
fn carries_plugin_labels(node: &NodeFacts, id: &ModuleId) -> bool {
    node.labels
        .contains_key(&device_plugin_scheduling_label(&id.namespace, &id.name))
        || node
            .labels
            .contains_key(&device_plugin_ready_label(&id.namespace, &id.name))
}

/// Whether the placement waits for the module's upgrade turn.
fn is_waiting(placement: &Placement) -> bool {
    matches!(placement, Placement::Held(h) if matches!(h.hold, Hold::Waiting { .. }))
}

impl NodeWork {
    /// The revision from which the agent's reports speak for `id`'s current task.
    fn since_of(&self, id: &ModuleId) -> u64 {
        self.since.get(id).copied().unwrap_or(self.revision)
    }
}

impl std::fmt::Debug for ClusterState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClusterState")
            .field("nodes", &self.nodes.len())
            .field("intent_revision", &self.applied_intent_revision())
            .field("agents", &self.agents.len())
            .field("next_revision", &self.next_revision)
            .finish_non_exhaustive()
    }
}

impl ClusterState {
    /// `revision_base` starts every revision counter; the caller takes it from the clock
    /// so revisions of a restarted proxy are above those of the previous one.
    pub fn new(revision_base: u64) -> Self {
        Self {
            nodes: BTreeMap::new(),
            nodes_listed: false,
            intents: None,
            module_ids: Vec::new(),
            agents: BTreeMap::new(),
            may_have: BTreeSet::new(),
            work: BTreeMap::new(),
            waiting: BTreeSet::new(),
            unlabel: BTreeSet::new(),
            status_dirty: BTreeSet::new(),
            label_dirty: BTreeSet::new(),
            next_revision: revision_base,
            inventory: Inventory::new(revision_base),
            device_plugin_pods: None,
            device_plugin_counts: BTreeMap::new(),
            cluster_pull_secret: ClusterPullSecret::NotConfigured,
            spoke_images: SpokeImages::default(),
            shared: SharedParts::default(),
        }
    }

    /// Takes the cluster pull Secret as last read; `false` when nothing changed. Every
    /// node is placed again: its loads may now get, change or lack the credential.
    pub fn set_cluster_pull_secret(&mut self, secret: ClusterPullSecret) -> bool {
        if secret == self.cluster_pull_secret {
            return false;
        }
        self.cluster_pull_secret = secret;
        // Resolutions for the hub that failed may succeed with it now.
        self.spoke_images
            .retry_failed_now(std::time::Instant::now());
        self.refresh();
        true
    }

    pub fn cluster_pull_secret(&self) -> &ClusterPullSecret {
        &self.cluster_pull_secret
    }

    /// Replaces every node (after a full list of the Nodes).
    pub fn replace_nodes(&mut self, nodes: Vec<NodeFacts>) {
        self.nodes = nodes.into_iter().map(|n| (n.name.clone(), n)).collect();
        self.nodes_listed = true;
        self.refresh();
    }

    /// Whether the Nodes were listed at least once: before that, the inventory would
    /// tell the hub the cluster has no kernels.
    pub fn nodes_listed(&self) -> bool {
        self.nodes_listed
    }

    /// Records a Node's facts; false when they are unchanged (kubelet heartbeats touch
    /// none of them), so that nobody is woken for nothing.
    pub fn upsert_node(&mut self, node: NodeFacts) -> bool {
        let old = self.nodes.get(&node.name);
        if old == Some(&node) {
            return false;
        }
        let kernel_changed = old.is_none_or(|o| o.kernel != node.kernel);
        let name = node.name.clone();
        self.nodes.insert(name.clone(), node);
        if kernel_changed {
            self.inventory.update(kernels(self.nodes.values()));
        }
        self.place_node(&name);
        self.place_waiting();
        if kernel_changed {
            // The loads of the kernel the node left may be nobody's now.
            self.shared.prune();
        }
        true
    }

    /// Forgets a deleted Node; false when it was not known.
    pub fn remove_node(&mut self, name: &str) -> bool {
        if self.nodes.remove(name).is_none() {
            return false;
        }
        self.work.remove(name);
        self.waiting.remove(name);
        self.agents.remove(name);
        self.touch(name);
        self.may_have.retain(|(_, node)| node != name);
        self.inventory.update(kernels(self.nodes.values()));
        self.place_waiting();
        true
    }

    pub fn node_count(&self) -> usize {
        self.nodes.len()
    }

    pub fn node(&self, name: &str) -> Option<&NodeFacts> {
        self.nodes.get(name)
    }

    /// Applies the hub's complete snapshot. Modules absent from it are forgotten (their
    /// status entries disappear) but never unloaded.
    /// Applies a snapshot from the hub: a complete one as it is, a delta onto the one
    /// applied before.
    pub fn set_intents(&mut self, snapshot: IntentSnapshot) {
        let snapshot = kmm_proto::apply_snapshot(self.intents.as_ref(), snapshot);
        self.spoke_images.set_requests(&snapshot);
        self.module_ids = snapshot
            .modules
            .iter()
            .map(|m| ModuleId::from_key(m.key.as_ref()))
            .collect();
        self.intents = Some(snapshot);
        self.refresh();
    }

    /// The images to resolve for the hub at `now`, each with its credential.
    pub fn spoke_images_due(&self, now: std::time::Instant) -> Vec<SpokeResolution> {
        let credentials = self.intents.iter().flat_map(|s| &s.credentials);
        self.spoke_images
            .due(now)
            .into_iter()
            .map(|(request, mut load)| {
                let credential = self.cluster_pull_secret.supply(&mut load).map(|()| {
                    credentials
                        .clone()
                        .find(|c| {
                            !load.pull_credential_id.is_empty() && c.id == load.pull_credential_id
                        })
                        .or_else(|| {
                            self.cluster_pull_secret
                                .credential(&load.pull_credential_id)
                        })
                        .cloned()
                });
                SpokeResolution {
                    request,
                    tls: load.registry_tls,
                    credential,
                }
            })
            .collect()
    }

    /// When a failed resolution is due again.
    pub fn spoke_images_next_retry(&self) -> Option<std::time::Instant> {
        self.spoke_images.next_retry()
    }

    /// What resolving `request` found; `true` when the report to the hub changed.
    pub fn spoke_image_answered(
        &mut self,
        request: Request,
        found: Result<String, Unresolved>,
        now: std::time::Instant,
    ) -> bool {
        self.spoke_images.answered(request, found, now)
    }

    /// The answers for the hub.
    pub fn spoke_image_report(&self) -> kmm_proto::v1::SpokeImageReport {
        self.spoke_images.report()
    }

    /// Revision of the last applied IntentSnapshot, 0 if none.
    pub fn applied_intent_revision(&self) -> u64 {
        self.intents.as_ref().map_or(0, |s| s.revision)
    }

    /// The digest of the intents held (`kmm_proto::snapshot_digest`), empty if none: a hub
    /// whose snapshot has it sends none.
    pub fn applied_intent_digest(&self) -> Vec<u8> {
        self.intents.as_ref().map_or_else(Vec::new, |s| {
            kmm_proto::snapshot_digest(&s.modules, &s.credentials).to_vec()
        })
    }

    pub fn agent_hello(&mut self, node: &str, hello: &AgentHello) {
        let view = AgentView::from_hello(hello);
        for id in view.loaded.keys() {
            self.may_have.insert((id.clone(), node.to_owned()));
        }
        self.agents.insert(node.to_owned(), view);
        self.place_node(node);
        self.place_waiting();
    }

    /// One event of `node`'s agent. An event of a module the node's DesiredModules do
    /// not carry (and the agent does not hold loaded) is refused and changes nothing: an
    /// agent cannot make the proxy keep modules of its own naming.
    pub fn agent_event(&mut self, node: &str, event: &ModuleEvent) -> Result<(), UnknownModule> {
        let work = self.work.get(node);
        let sent = |id: &ModuleId| work.is_some_and(|w| w.modules.iter().any(|m| m.id == *id));
        let view = self.agents.entry(node.to_owned()).or_default();
        view.record(node, event, sent)?;
        for id in view.loaded.keys() {
            self.may_have.insert((id.clone(), node.to_owned()));
        }
        self.place_node(node);
        self.place_waiting();
        Ok(())
    }

    /// The bytes the agents' views hold (see `AgentView::bytes`).
    pub fn agent_bytes(&self) -> usize {
        self.agents
            .iter()
            .map(|(node, view)| node.len() + view.bytes())
            .sum()
    }

    /// Every device plugin Pod there is, by module and node, with whether one is Ready
    /// there; `false` when nothing changed. A node whose plugin Pod went may now unload or
    /// replace its module, and one whose Pod became Ready or stopped being so is labelled
    /// accordingly.
    pub fn set_device_plugin_pods(&mut self, pods: BTreeMap<StatusKey, bool>) -> bool {
        if self.device_plugin_pods.as_ref() == Some(&pods) {
            return false;
        }
        let changed: BTreeSet<String> = match &self.device_plugin_pods {
            Some(before) => pods
                .iter()
                .filter(|(key, ready)| before.get(*key) != Some(ready))
                .chain(before.iter().filter(|(key, _)| !pods.contains_key(*key)))
                .map(|((_, node), _)| node.clone())
                .filter(|node| self.nodes.contains_key(node))
                .collect(),
            None => self.nodes.keys().cloned().collect(),
        };
        self.device_plugin_pods = Some(pods);
        for node in &changed {
            self.place_node(node);
        }
        self.place_waiting();
        true
    }

    /// The plugin DaemonSets' Pod counts; `false` when nothing changed.
    pub fn set_device_plugin_counts(&mut self, counts: BTreeMap<ModuleId, (u32, u32)>) -> bool {
        if counts == self.device_plugin_counts {
            return false;
        }
        self.device_plugin_counts = counts;
        true
    }

    /// The plugins' Pod counts, as the hub is told them: a module's DaemonSet's, but for a
    /// module that loads nothing, whose counts are the nodes it selects and those where
    /// its plugin Pod is Ready, from the placements of this very state (the DaemonSet's
    /// status lags behind the labels that schedule it, and would show a new module's
    /// plugin available everywhere before any node was labelled). Those are left out until
    /// the Pods were listed.
    pub fn device_plugin_report(&self) -> DevicePluginReport {
        let only = self.device_plugin_only();
        let mut counts: BTreeMap<&ModuleId, (u32, u32)> = self
            .device_plugin_counts
            .iter()
            .filter(|(id, _)| !only.contains(*id))
            .map(|(id, &counts)| (id, counts))
            .collect();
        if let Some(pods) = &self.device_plugin_pods {
            for (id, _, _) in self.device_plugins() {
                let Some(id) = only.get(&id) else { continue };
                let entry = counts.entry(id).or_default();
                for (node, work) in &self.work {
                    if work.placements.get(id) == Some(&Placement::DevicePluginOnly) {
                        entry.0 += 1;
                        let ready = pods.get(&(id.clone(), node.clone())) == Some(&true);
                        entry.1 += u32::from(ready);
                    }
                }
            }
        }
        DevicePluginReport {
            plugins: counts
                .into_iter()
                .map(|(id, (desired, available))| DevicePluginCount {
                    module: Some(id.key()),
                    desired,
                    available,
                })
                .collect(),
        }
    }

    /// The modules of the snapshot that load nothing, only run a device plugin.
    fn device_plugin_only(&self) -> BTreeSet<ModuleId> {
        self.intents
            .iter()
            .flat_map(|s| &s.modules)
            .filter(|m| m.device_plugin_only)
            .map(|m| ModuleId::from_key(m.key.as_ref()))
            .collect()
    }

    /// The device plugins to run: each module of the snapshot that has one and is not
    /// being unloaded, with its tolerations (the plugin's Pods go where the module goes).
    pub fn device_plugins(&self) -> Vec<(ModuleId, &DevicePlugin, &[Toleration])> {
        self.intents
            .iter()
            .flat_map(|s| &s.modules)
            .filter(|m| !m.unload)
            .filter_map(|m| {
                let plugin = m.device_plugin.as_ref()?;
                Some((
                    ModuleId::from_key(m.key.as_ref()),
                    plugin,
                    m.tolerations.as_slice(),
                ))
            })
            .collect()
    }

    /// Revision of the node's DesiredModules, cheap to compare before cloning them.
    pub fn desired_revision(&self, node: &str) -> u64 {
        self.work.get(node).map_or(0, |w| w.revision)
    }

    /// The node's DesiredModules (revision 0 and no modules before any intent).
    pub fn desired_modules(&self, node: &str) -> DesiredModules {
        self.work
            .get(node)
            .map(|w| DesiredModules {
                revision: w.revision,
                modules: w.modules.iter().map(Given::message).collect(),
            })
            .unwrap_or_default()
    }

    /// The statuses of each of `nodes` (an empty map for a node without any).
    pub fn statuses_of<'a>(
        &self,
        nodes: impl IntoIterator<Item = &'a String>,
    ) -> BTreeMap<String, NodeStatuses> {
        nodes
            .into_iter()
            .map(|node| (node.clone(), self.node_statuses(node)))
            .collect()
    }

    /// Every node's statuses.
    pub fn all_statuses(&self) -> BTreeMap<String, NodeStatuses> {
        self.statuses_of(self.nodes.keys())
    }

    fn node_statuses(&self, node: &str) -> NodeStatuses {
        let Some(work) = self.work.get(node) else {
            return NodeStatuses::new();
        };
        let facts = self.nodes.get(node);
        let kernel = facts.map_or("", |n| n.kernel.as_str());
        let only = self.device_plugin_only();
        work.placements
            .iter()
            .filter_map(|(id, placement)| {
                let a = if only.contains(id) {
                    let labelled = facts.is_some_and(|f| carries_plugin_labels(f, id));
                    assess_device_plugin_only(placement, labelled)?
                } else {
                    let since = work.since_of(id);
                    assess(placement, self.agents.get(node), id, kernel, since)?
                };
                Some((
                    id.clone(),
                    to_status(&(id.clone(), node.to_owned()), kernel, a),
                ))
            })
            .collect()
    }

    /// Nodes whose statuses may have changed since the last call.
    pub fn take_status_dirty(&mut self) -> BTreeSet<String> {
        std::mem::take(&mut self.status_dirty)
    }

    /// Nodes whose labels may need a patch since the last call.
    pub fn take_label_dirty(&mut self) -> BTreeSet<String> {
        std::mem::take(&mut self.label_dirty)
    }

    fn touch(&mut self, node: &str) {
        self.status_dirty.insert(node.to_owned());
        self.label_dirty.insert(node.to_owned());
    }

    /// The label patch the node needs, if any.
    pub fn label_patch(&self, node: &str) -> Option<Value> {
        let facts = self.nodes.get(node)?;
        let work = self.work.get(node)?;
        let view = self.agents.get(node);
        let with_plugin: BTreeSet<ModuleId> = self
            .device_plugins()
            .into_iter()
            .map(|(id, _, _)| id)
            .collect();
        let plugin_ready = |id: &ModuleId| {
            self.device_plugin_pods.as_ref().map(|pods| {
                pods.get(&(id.clone(), node.to_owned()))
                    .copied()
                    .unwrap_or(false)
            })
        };
        let only = self.device_plugin_only();
        let mut modules: Vec<ModuleLabels> = work
            .placements
            .iter()
            .map(|(id, placement)| {
                let intent = if only.contains(id) {
                    device_plugin_only_intent(placement, with_plugin.contains(id))
                } else {
                    let since = work.since_of(id);
                    let a = assess(placement, view, id, &facts.kernel, since);
                    label_intent(placement, a.as_ref(), view, id, with_plugin.contains(id))
                };
                ModuleLabels {
                    id: id.clone(),
                    intent,
                    plugin_ready: plugin_ready(id),
                }
            })
            .collect();
        modules.extend(
            self.unlabel
                .iter()
                .filter(|(id, n)| n == node && !work.placements.contains_key(id))
                .map(|(id, _)| ModuleLabels {
                    id: id.clone(),
                    intent: view
                        .is_some_and(|v| !v.loaded.contains_key(id))
                        .then_some(LabelIntent::Remove),
                    plugin_ready: plugin_ready(id),
                }),
        );
        merge_patch(&facts.labels, &modules)
    }

    pub fn node_names(&self) -> Vec<String> {
        self.nodes.keys().cloned().collect()
    }

    pub fn inventory(&self) -> KernelInventory {
        self.inventory.message()
    }

    /// Recomputes every node: after a new snapshot or a full list of Nodes.
    fn refresh(&mut self) {
        self.inventory.update(kernels(self.nodes.values()));
        let gone: Vec<String> = self
            .work
            .keys()
            .filter(|node| !self.nodes.contains_key(*node))
            .cloned()
            .collect();
        for node in gone {
            self.touch(&node);
        }
        let Some(snapshot) = &self.intents else {
            return;
        };
        let known: BTreeSet<ModuleId> = snapshot
            .modules
            .iter()
            .map(|m| ModuleId::from_key(m.key.as_ref()))
            .collect();
        for (node, work) in &self.work {
            self.unlabel.extend(
                work.placements
                    .keys()
                    .filter(|id| !known.contains(*id))
                    .map(|id| (id.clone(), node.clone())),
            );
        }
        let nodes = &self.nodes;
        self.unlabel.retain(|(id, node)| {
            nodes.get(node).is_some_and(|f| {
                f.labels.contains_key(&ready_label(&id.namespace, &id.name))
                    || carries_plugin_labels(f, id)
            })
        });
        self.may_have
            .retain(|(id, node)| known.contains(id) && self.nodes.contains_key(node));
        self.work.retain(|node, _| self.nodes.contains_key(node));
        self.waiting.retain(|node| self.nodes.contains_key(node));
        self.agents.retain(|node, _| self.nodes.contains_key(node));
        let names: Vec<String> = self.nodes.keys().cloned().collect();
        for name in names {
            self.place_node(&name);
        }
        self.shared.prune();
    }

    /// Whether the node must keep the version it runs instead of `load`'s (see
    /// [`node_upgrade`](crate::node_upgrade)).
    fn held(
        &self,
        node: &str,
        id: &ModuleId,
        intent: &ModuleIntent,
        load: &ModuleLoad,
        facts: &NodeFacts,
    ) -> Option<Held> {
        let running = self
            .agents
            .get(node)
            .and_then(|v| v.loaded.get(id))
            .map(|p| p.version.as_str());
        let pinned = facts
            .labels
            .get(&version_module_label(&id.namespace, &id.name))
            .map(String::as_str);
        let given = self.given(node, id);
        let hold = node_upgrade::hold(
            &node_upgrade::Node {
                target: &load.version,
                running,
                pinned,
            },
            node_upgrade::limit(intent),
            || self.upgrade_cluster(node, id),
        )?;
        Some(Held {
            hold,
            running: running.map(str::to_owned),
            target: load.version.clone(),
            keep: given
                .filter(|g| Some(g.version.as_str()) == running)
                .cloned(),
        })
    }

    /// The load this proxy last gave `node` for the module, if any.
    fn given(&self, node: &str, id: &ModuleId) -> Option<&Arc<ModuleLoad>> {
        self.work
            .get(node)?
            .modules
            .iter()
            .find(|m| m.id == *id)?
            .load
            .as_ref()
    }

    /// `placement`, unless it unloads or replaces the module on a node where the module's
    /// device plugin Pod still is: then the node keeps what it runs until the Pod went
    /// (its scheduling label is removed meanwhile, so the DaemonSet lets go).
    fn device_plugin_first(
        &self,
        node: &str,
        id: &ModuleId,
        intent: &ModuleIntent,
        placement: Placement,
    ) -> Placement {
        let present = match &self.device_plugin_pods {
            Some(pods) => pods.contains_key(&(id.clone(), node.to_owned())),
            None => intent.device_plugin.is_some(),
        };
        if !present {
            return placement;
        }
        let running = self
            .agents
            .get(node)
            .and_then(|v| v.loaded.get(id))
            .map(|p| p.version.clone());
        let (unload, target) = match &placement {
            Placement::Unload => (true, String::new()),
            Placement::Load(load) if running.as_ref().is_some_and(|r| *r != load.version) => {
                (false, load.version.clone())
            }
            _ => return placement,
        };
        let keep = self
            .given(node, id)
            .filter(|given| Some(&given.version) == running.as_ref())
            .cloned();
        Placement::Held(Box::new(Held {
            hold: Hold::DevicePluginStopping { unload },
            running,
            target,
            keep,
        }))
    }

    /// The module's matching nodes, and how many besides `node` lack it at their target.
    fn upgrade_cluster(&self, node: &str, id: &ModuleId) -> node_upgrade::Cluster {
        let mut cluster = node_upgrade::Cluster {
            matching: 1,
            unavailable: 0,
        };
        for (name, work) in self.work.iter().filter(|(name, _)| *name != node) {
            let Some(placement) = work.placements.get(id).filter(|p| p.is_selected()) else {
                continue;
            };
            cluster.matching += 1;
            let kernel = self.nodes.get(name).map_or("", |n| n.kernel.as_str());
            let since = work.since_of(id);
            let loaded = matches!(placement, Placement::Held(_))
                || assess(placement, self.agents.get(name), id, kernel, since)
                    .is_some_and(|a| a.state == ModuleState::Loaded);
            cluster.unavailable += usize::from(!loaded);
        }
        cluster
    }

    /// Places again the nodes waiting for their upgrade turn: a node that finished, left
    /// or lost the module may have made room. Once one node of a module still waits, so
    /// do the others (held nodes count as having the module), which keeps an event's cost
    /// to the nodes that move plus one per module.
    fn place_waiting(&mut self) {
        let waiting_for = |work: &NodeWork| -> BTreeSet<ModuleId> {
            work.placements
                .iter()
                .filter(|(_, p)| is_waiting(p))
                .map(|(id, _)| id.clone())
                .collect()
        };
        let waiting: Vec<String> = self.waiting.iter().cloned().collect();
        let mut full: BTreeSet<ModuleId> = BTreeSet::new();
        for node in waiting {
            let Some(before) = self.work.get(&node).map(waiting_for) else {
                continue;
            };
            if before.is_subset(&full) {
                continue;
            }
            self.place_node(&node);
            if let Some(work) = self.work.get(&node) {
                full.extend(waiting_for(work));
            }
        }
    }

    /// Recomputes one node's work: what changes with one Node or one agent touches no
    /// other node, which keeps a change O(modules) rather than O(nodes x modules).
    fn place_node(&mut self, name: &str) {
        self.touch(name);
        let (Some(snapshot), Some(facts)) = (&self.intents, self.nodes.get(name)) else {
            return;
        };
        // A hello from another boot than the kubelet reports is stale (the node rebooted
        // and its agent has not said hello since): its kernel says nothing of this boot,
        // and a reboot into a new kernel must not show as a mismatch meanwhile.
        let agent_kernel = self
            .agents
            .get(name)
            .filter(|view| !view.boot_id.is_empty() && view.boot_id == facts.boot_id)
            .map_or("", |view| view.kernel_release.as_str());
        let mut placements = BTreeMap::new();
        let mut modules = Vec::new();
        for (intent, id) in snapshot.modules.iter().zip(&self.module_ids) {
            let id = id.clone();
            let key = (id.clone(), name.to_owned());
            // What the agent says it has loaded counts even after the module left a
            // snapshot (and `may_have` forgot it): it came back, maybe narrowed.
            let agent_has_it = self
                .agents
                .get(name)
                .is_some_and(|view| view.loaded.contains_key(&id));
            let placement = match place(intent, facts, agent_has_it || self.may_have.contains(&key))
            {
                Placement::Load(mut load) => {
                    match self.cluster_pull_secret.supply(Arc::make_mut(&mut load)) {
                        Ok(()) => Placement::Load(self.shared.load(&id, &load)),
                        // Like a kernel the hub gives no image: what the node runs stays.
                        Err(unresolved) => Placement::Unresolved(unresolved),
                    }
                }
                other => other,
            };
            let placement = match check_agent_kernel(placement, &facts.kernel, agent_kernel) {
                Placement::Load(load) => self
                    .held(name, &id, intent, &load, facts)
                    .map_or(Placement::Load(load), |held| {
                        Placement::Held(Box::new(held))
                    }),
                other => other,
            };
            let placement = self.device_plugin_first(name, &id, intent, placement);
            if placement.is_selected() {
                self.may_have.insert(key);
            }
            let load = match &placement {
                Placement::Load(load) => Some(load),
                Placement::Held(held) => held.keep.as_ref(),
                _ => None,
            };
            match (&placement, load) {
                (_, Some(load)) => modules.push(Given {
                    id: id.clone(),
                    load: Some(Arc::clone(load)),
                    credential: snapshot
                        .credentials
                        .iter()
                        .find(|c| {
                            !load.pull_credential_id.is_empty() && c.id == load.pull_credential_id
                        })
                        .or_else(|| {
                            self.cluster_pull_secret
                                .credential(&load.pull_credential_id)
                        })
                        .map(|credential| self.shared.credential(credential)),
                    unload: false,
                }),
                // A module that loads nothing is none of the agent's business.
                (Placement::Unload, None) if !intent.device_plugin_only => modules.push(Given {
                    id: id.clone(),
                    load: None,
                    credential: None,
                    unload: true,
                }),
                _ => {}
            }
            placements.insert(id, placement);
        }
        let work = self.work.entry(name.to_owned()).or_default();
        if work.modules != modules || work.revision == 0 {
            self.next_revision += 1;
            let revision = self.next_revision;
            for module in &modules {
                let old = work
                    .modules
                    .iter()
                    .find(|m| m.id == module.id)
                    .or_else(|| work.departed.get(&module.id));
                if !same_task(old, module) {
                    work.since.insert(module.id.clone(), revision);
                }
            }
            let staying: BTreeSet<ModuleId> = modules.iter().map(|m| m.id.clone()).collect();
            for old in std::mem::take(&mut work.modules) {
                if !staying.contains(&old.id) {
                    work.departed.insert(old.id.clone(), old);
                }
            }
            work.departed.retain(|id, _| !staying.contains(id));
            work.revision = revision;
            work.modules = modules;
        }
        let held = self.agents.get(name).map(|view| &view.loaded);
        work.departed
            .retain(|id, _| held.is_some_and(|loaded| loaded.contains_key(id)));
        let departed = &work.departed;
        work.since
            .retain(|id, _| placements.contains_key(id) || departed.contains_key(id));
        if placements.values().any(is_waiting) {
            self.waiting.insert(name.to_owned());
        } else {
            self.waiting.remove(name);
        }
        work.placements = placements;
    }
}

#[cfg(test)]
mod tests;
