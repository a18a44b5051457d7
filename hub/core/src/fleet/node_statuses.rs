//! What a cluster's spoke proxy last reported about every module on every node: a full
//! report replaces everything, a delta updates and removes entries. Pure.
//!
//! A hub holds one entry per module and node of the whole fleet (3,500 clusters of 20
//! nodes running 20 modules: 1.4 million), so an entry is kept small: the module is the
//! map's key, node names, kernels and versions are shared strings (a cluster has few of
//! each), and the error text exists only where there is one.
//!
//! What a proxy can make the hub hold is bounded three ways: entries
//! ([`MAX_ENTRIES`]), accounted bytes ([`MAX_BYTES`], each reason and message cut to
//! [`ERROR_TEXT`] bytes) and time ([`REPORT_DEADLINE`] for a report in parts). A report
//! breaking one is refused whole ([`ReportRefused`]) and what it staged forgotten.

use std::collections::btree_map::Entry;
use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kmm_proto::limits::{ERROR_TEXT, truncate};
use kmm_proto::v1::{ModuleKey, ModuleNodeStatus, ModuleState, NodeStatusReport};

use super::module_id::{ModuleId, module_id, module_key};

/// Node statuses one cluster may hold: a report that would go beyond is refused, so no
/// proxy can grow the hub's memory without bound (5,000 nodes with 50 modules fit).
pub const MAX_ENTRIES: usize = 250_000;

/// Bytes of node statuses one cluster may hold, as [`NodeStatuses::bytes`] accounts
/// them: what is kept, plus the report being received (a full report is held beside the
/// one it replaces until its last part). [`MAX_ENTRIES`] alone would let a proxy make
/// each entry's strings megabytes; 5,000 nodes of 50 modules take about 13 MiB of it
/// while a full report replaces them.
pub const MAX_BYTES: usize = 32 << 20;

/// How long the parts of one report may keep arriving: a proxy sends them back to back,
/// so a report unfinished for longer is broken, and its staged parts are not held for it.
/// Checked when its next part arrives; meanwhile [`MAX_BYTES`] bounds what it holds, and
/// a cluster has at most one report in parts (another one starting drops it).
pub const REPORT_DEADLINE: Duration = Duration::from_secs(120);

/// When a report's part arrived: the monotonic instant bounds a report in parts, the
/// wall-clock second stamps the statuses it changes ([`NodeStatus::since`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Arrival {
    pub at: Instant,
    pub unix_seconds: u32,
}

impl Arrival {
    pub fn now() -> Self {
        let unix_seconds = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| u32::try_from(d.as_secs()).unwrap_or(u32::MAX));
        Self {
            at: Instant::now(),
            unix_seconds,
        }
    }
}

/// What a held string, node or detail, and a module's entry in a map, cost beyond their
/// text: allocation headers, pointers and map slots (approximate, on the high side).
const STRING_OVERHEAD: usize = 32;
const NODE_OVERHEAD: usize = 64;
const DETAIL_OVERHEAD: usize = 96;
const MODULE_OVERHEAD: usize = 96;

/// A report refused: which limit it broke, and by how much.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum ReportRefused {
    #[error(
        "NodeStatusReport would leave {entries} node statuses, more than the {MAX_ENTRIES} a cluster may hold"
    )]
    TooManyStatuses { entries: usize },
    #[error(
        "NodeStatusReport would leave {bytes} bytes of node statuses, more than the {MAX_BYTES} a cluster may hold"
    )]
    TooManyBytes { bytes: usize },
    #[error(
        "NodeStatusReport.continued: the report's parts kept arriving for more than {}s",
        REPORT_DEADLINE.as_secs()
    )]
    Unfinished,
}

impl ReportRefused {
    /// The limit's name, for the metric counting refusals.
    pub fn limit(&self) -> &'static str {
        match self {
            Self::TooManyStatuses { .. } => "status_entries",
            Self::TooManyBytes { .. } => "status_bytes",
            Self::Unfinished => "report_deadline",
        }
    }
}

/// One node's status of one module, as held: 24 bytes, the rest shared. The version
/// loaded is not kept: a proxy reports `Loaded` only at the version its intent asks for,
/// and the intent revision it acknowledges says which that is.
#[derive(Clone, Debug)]
pub struct NodeStatus {
    /// The node and the kernel it reported, shared by the node's statuses.
    pub node: Arc<Node>,
    pub state: ModuleState,
    /// Why it failed or cannot load, when the proxy said; shared by the cluster's
    /// statuses that say the same (every node waiting for the same image, say).
    pub detail: Option<Arc<Detail>>,
    /// When this hub first held the status as it is (seconds since the Unix epoch; 0 for
    /// a status not yet applied). Lives in what would be padding, so it costs nothing.
    pub since: u32,
}

/// Statuses are equal when they say the same: `since` is when this hub heard it, not
/// part of what the proxy said.
impl PartialEq for NodeStatus {
    fn eq(&self, other: &Self) -> bool {
        (&self.node, self.state, &self.detail) == (&other.node, other.state, &other.detail)
    }
}

/// A node as its statuses name it.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Node {
    pub name: Arc<str>,
    pub kernel: Arc<str>,
}

/// A status's reason and message.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Detail {
    pub reason: String,
    pub message: String,
}

impl NodeStatus {
    /// Whether the module may be loaded on the node: a node proven without it (unloaded)
    /// or that it does not apply to (skipped, the proxy unloads first) holds nothing.
    pub fn may_be_loaded(&self) -> bool {
        !matches!(self.state, ModuleState::Unloaded | ModuleState::Skipped)
    }

    /// The reported status, what it shares taken from `strings`; its reason and message
    /// cut to [`ERROR_TEXT`] bytes.
    fn from_report(mut status: ModuleNodeStatus, node: &str, strings: &mut Strings) -> Self {
        truncate(&mut status.reason, ERROR_TEXT);
        truncate(&mut status.message, ERROR_TEXT);
        let detail = (!status.reason.is_empty() || !status.message.is_empty()).then(|| {
            strings.detail(Detail {
                reason: status.reason,
                message: status.message,
            })
        });
        Self {
            node: strings.node(node, &status.kernel),
            state: ModuleState::try_from(status.state).unwrap_or_default(),
            detail,
            since: 0,
        }
    }

    pub fn reason(&self) -> &str {
        self.detail.as_ref().map_or("", |d| d.reason.as_str())
    }

    pub fn message(&self) -> &str {
        self.detail.as_ref().map_or("", |d| d.message.as_str())
    }
}

impl From<&ModuleNodeStatus> for NodeStatus {
    /// A status on its own, its strings not shared (for tests and one-off reads).
    fn from(status: &ModuleNodeStatus) -> Self {
        let node = status
            .key
            .as_ref()
            .map_or("", |k| k.node.as_str())
            .to_owned();
        Self::from_report(status.clone(), &node, &mut Strings::default())
    }
}

/// What a cluster's statuses share: each distinct node name and kernel once, each node
/// once, and each distinct reason and message once.
#[derive(Clone, Debug, Default)]
struct Strings {
    set: HashSet<Arc<str>>,
    nodes: HashSet<Arc<Node>>,
    details: HashSet<Arc<Detail>>,
    /// Size after the last sweep: the next sweep waits until the sets doubled.
    swept: usize,
    /// What the sets hold, accounted as [`NodeStatuses::bytes`] says.
    bytes: usize,
}

impl Strings {
    fn get(&mut self, value: &str) -> Arc<str> {
        if let Some(shared) = self.set.get(value) {
            return shared.clone();
        }
        let shared: Arc<str> = Arc::from(value);
        self.bytes += value.len() + STRING_OVERHEAD;
        self.set.insert(shared.clone());
        shared
    }

    fn node(&mut self, name: &str, kernel: &str) -> Arc<Node> {
        let node = Node {
            name: self.get(name),
            kernel: self.get(kernel),
        };
        if let Some(shared) = self.nodes.get(&node) {
            return shared.clone();
        }
        let shared = Arc::new(node);
        self.bytes += NODE_OVERHEAD;
        self.nodes.insert(shared.clone());
        shared
    }

    fn detail(&mut self, detail: Detail) -> Arc<Detail> {
        if let Some(shared) = self.details.get(&detail) {
            return shared.clone();
        }
        self.bytes += detail_bytes(&detail);
        let shared = Arc::new(detail);
        self.details.insert(shared.clone());
        shared
    }

    fn len(&self) -> usize {
        self.set.len() + self.nodes.len() + self.details.len()
    }

    /// Forgets what no status uses any more, once the sets have doubled since the last
    /// time, so a cluster whose nodes and errors come and go keeps bounded sets.
    fn sweep(&mut self) {
        if self.len() > 64 && self.len() > 2 * self.swept {
            self.sweep_now();
        }
    }

    fn sweep_now(&mut self) {
        // Nodes first: a forgotten node releases its name and kernel.
        self.nodes.retain(|n| Arc::strong_count(n) > 1);
        self.details.retain(|d| Arc::strong_count(d) > 1);
        self.set.retain(|s| Arc::strong_count(s) > 1);
        self.swept = self.len();
        self.bytes = self
            .set
            .iter()
            .map(|s| s.len() + STRING_OVERHEAD)
            .chain(self.details.iter().map(|d| detail_bytes(d)))
            .sum::<usize>()
            + self.nodes.len() * NODE_OVERHEAD;
    }
}

fn detail_bytes(detail: &Detail) -> usize {
    detail.reason.len() + detail.message.len() + DETAIL_OVERHEAD
}

/// What a module's entry costs in a map, beside its statuses.
fn module_bytes((namespace, name): &ModuleId) -> usize {
    namespace.len() + name.len() + MODULE_OVERHEAD
}

/// A report being received: applied only once its last part arrived (`continued` is
/// false), so that its revision is never taken for statuses half applied. Its parts are
/// held as they will be kept (24 bytes a status, the module once) rather than as
/// received: in a burst, every cluster of the fleet can have one in flight.
#[derive(Clone, Debug)]
struct Staged {
    full: bool,
    intent_revision: u64,
    /// When its first part arrived.
    started: Instant,
    /// In arrival order; [`latest_per_node`] sorts them when the report is whole.
    updates: BTreeMap<ModuleId, Vec<NodeStatus>>,
    removals: BTreeMap<ModuleId, BTreeSet<Arc<str>>>,
    /// What it holds, accounted as [`NodeStatuses::bytes`] says.
    bytes: usize,
}

impl Staged {
    fn new(part: &NodeStatusReport, now: Arrival) -> Self {
        Self {
            full: part.full,
            intent_revision: part.intent_revision,
            started: now.at,
            updates: BTreeMap::new(),
            removals: BTreeMap::new(),
            bytes: 0,
        }
    }

    fn update(&mut self, module: ModuleId, status: NodeStatus) {
        self.bytes += std::mem::size_of::<NodeStatus>();
        // A proxy sends a module's statuses together: most go to the module of the one
        // before, which needs no search.
        if let Some(mut last) = self.updates.last_entry()
            && *last.key() == module
        {
            last.get_mut().push(status);
            return;
        }
        match self.updates.entry(module) {
            Entry::Occupied(held) => held.into_mut().push(status),
            Entry::Vacant(new) => {
                self.bytes += module_bytes(new.key());
                new.insert(vec![status]);
            }
        }
    }

    fn removal(&mut self, module: ModuleId, node: Arc<str>) {
        if !self.removals.contains_key(&module) {
            self.bytes += module_bytes(&module);
        }
        if self.removals.entry(module).or_default().insert(node) {
            self.bytes += STRING_OVERHEAD;
        }
    }

    fn entries(&self) -> usize {
        let updates: usize = self.updates.values().map(Vec::len).sum();
        let removals: usize = self.removals.values().map(BTreeSet::len).sum();
        updates.max(removals)
    }
}

/// A whole report, applied.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Applied {
    /// The modules whose statuses it changed.
    pub changed: BTreeSet<ModuleId>,
    pub full: bool,
    /// The intent revision the proxy had applied when it made the report.
    pub intent_revision: u64,
}

/// The per-module per-node status of one cluster. Kept per module, each module's nodes
/// sorted by name, so that one module's statuses are read without scanning the others'.
#[derive(Clone, Debug, Default)]
pub struct NodeStatuses {
    modules: BTreeMap<ModuleId, Vec<NodeStatus>>,
    entries: usize,
    /// What `modules` holds, accounted as [`NodeStatuses::bytes`] says.
    held_bytes: usize,
    strings: Strings,
    /// The report whose parts are still arriving.
    receiving: Option<Staged>,
}

impl PartialEq for NodeStatuses {
    fn eq(&self, other: &Self) -> bool {
        self.modules == other.modules
    }
}

impl NodeStatuses {
    /// Receives one part of a report (a report that fits in one is its own part) and,
    /// once its last part arrived, applies the whole: a full report replaces everything,
    /// a delta updates and removes entries. A part that does not continue the report
    /// being received (another `full` or revision) starts a new one. Entries without a
    /// complete key are ignored (they cannot be attributed to a module and node), and so
    /// are entries of modules `known` denies (modules the hub never sent the cluster) and
    /// removals of modules neither known nor held. A report that would leave more than
    /// [`MAX_ENTRIES`] or [`MAX_BYTES`], grows beyond them while arriving, or whose parts
    /// keep arriving past [`REPORT_DEADLINE`] (`now` is the part's arrival) is refused
    /// whole and forgotten.
    pub fn receive(
        &mut self,
        part: NodeStatusReport,
        known: impl Fn(&str, &str) -> bool,
        now: Arrival,
    ) -> Result<Option<Applied>, ReportRefused> {
        let result = self.stage(part, known, now);
        if result.is_err() {
            // What the refused report interned goes at once: a proxy refused again and
            // again must not grow the sets between two regular sweeps.
            self.receiving = None;
            self.strings.sweep_now();
        }
        result
    }

    fn stage(
        &mut self,
        part: NodeStatusReport,
        known: impl Fn(&str, &str) -> bool,
        now: Arrival,
    ) -> Result<Option<Applied>, ReportRefused> {
        let mut staged = match self.receiving.take() {
            Some(staged)
                if staged.full == part.full && staged.intent_revision == part.intent_revision =>
            {
                if now.at.saturating_duration_since(staged.started) > REPORT_DEADLINE {
                    return Err(ReportRefused::Unfinished);
                }
                staged
            }
            _ => Staged::new(&part, now),
        };
        // What an unfinished report dropped above had interned goes too, so that parts
        // that never finish cannot grow the sets.
        self.strings.sweep();
        // A module's statuses come together: it is looked up once for them.
        let mut last_known: Option<(ModuleId, bool)> = None;
        for mut status in part.statuses {
            let Some(key) = status.key.take() else {
                continue;
            };
            let Some(module) = entry_module(key.module.as_ref(), &key.node) else {
                continue;
            };
            let is_known = match &last_known {
                Some((last, is_known)) if *last == module => *is_known,
                _ => {
                    let is_known = known(&module.0, &module.1);
                    last_known = Some((module.clone(), is_known));
                    is_known
                }
            };
            if is_known {
                let status = NodeStatus::from_report(status, &key.node, &mut self.strings);
                staged.update(module, status);
            }
        }
        for removed in &part.removed {
            if let Some(module) = entry_module(removed.module.as_ref(), &removed.node)
                && (known(&module.0, &module.1) || self.modules.contains_key(&module))
            {
                let node = self.strings.get(&removed.node);
                staged.removal(module, node);
            }
        }
        let entries = staged.entries();
        if entries > MAX_ENTRIES {
            return Err(ReportRefused::TooManyStatuses { entries });
        }
        let bytes = self.held_bytes + self.strings.bytes + staged.bytes;
        if bytes > MAX_BYTES {
            return Err(ReportRefused::TooManyBytes { bytes });
        }
        if part.continued {
            self.receiving = Some(staged);
            return Ok(None);
        }
        let (full, intent_revision) = (staged.full, staged.intent_revision);
        let changed = self.commit(staged, now.unix_seconds)?;
        Ok(Some(Applied {
            changed,
            full,
            intent_revision,
        }))
    }

    /// Receives a report in one part; what it changed.
    #[cfg(test)]
    pub(crate) fn apply(
        &mut self,
        report: NodeStatusReport,
        known: impl Fn(&str, &str) -> bool,
    ) -> Result<BTreeSet<ModuleId>, ReportRefused> {
        assert!(!report.continued, "a report in one part");
        Ok(self
            .receive(report, known, Arrival::now())?
            .expect("a whole report")
            .changed)
    }

    /// The statuses of one full report of (module, node, state) entries, modules in
    /// namespace `drivers`.
    #[cfg(test)]
    pub(crate) fn reported(entries: &[(&str, &str, ModuleState)]) -> Self {
        let mut statuses = Self::default();
        statuses
            .apply(full_report(entries), |_, _| true)
            .expect("within bounds");
        statuses
    }

    /// Forgets a report whose parts were still arriving (its stream ended).
    pub fn forget_partial(&mut self) {
        self.receiving = None;
    }

    /// Applies a whole report; a status it changes, or a node's first, is stamped `since`,
    /// one it repeats keeps its stamp.
    fn commit(&mut self, staged: Staged, since: u32) -> Result<BTreeSet<ModuleId>, ReportRefused> {
        let Staged {
            full,
            updates,
            removals,
            ..
        } = staged;
        let updates: BTreeMap<ModuleId, Vec<NodeStatus>> = updates
            .into_iter()
            .map(|(module, nodes)| (module, latest_per_node(nodes)))
            .collect();
        let entries = if full {
            updates.values().map(Vec::len).sum()
        } else {
            let removed = removals
                .iter()
                .map(|(module, nodes)| nodes.iter().filter(|n| self.has(module, n)).count())
                .sum::<usize>();
            let added = updates
                .iter()
                .map(|(module, nodes)| {
                    let gone = removals.get(module);
                    nodes
                        .iter()
                        .map(|s| &s.node.name)
                        .filter(|n| gone.is_some_and(|g| g.contains(*n)) || !self.has(module, n))
                        .count()
                })
                .sum::<usize>();
            self.entries - removed + added
        };
        if entries > MAX_ENTRIES {
            return Err(ReportRefused::TooManyStatuses { entries });
        }
        let mut changed = BTreeSet::new();
        if full {
            let before = std::mem::take(&mut self.modules);
            for (module, mut nodes) in updates {
                let held = before.get(&module).map_or(&[][..], Vec::as_slice);
                if held != nodes.as_slice() {
                    changed.insert(module.clone());
                }
                for status in &mut nodes {
                    status.since =
                        match held.binary_search_by(|s| s.node.name.cmp(&status.node.name)) {
                            Ok(i) if held[i] == *status => held[i].since,
                            _ => since,
                        };
                }
                self.modules.insert(module, nodes);
            }
            changed.extend(
                before
                    .into_keys()
                    .filter(|module| !self.modules.contains_key(module)),
            );
        } else {
            for (module, nodes) in removals {
                let Some(statuses) = self.modules.get_mut(&module) else {
                    continue;
                };
                let before = statuses.len();
                statuses.retain(|s| !nodes.contains(&s.node.name));
                if statuses.len() != before {
                    changed.insert(module.clone());
                }
                if statuses.is_empty() {
                    self.modules.remove(&module);
                }
            }
            for (module, nodes) in updates {
                let statuses = self.modules.entry(module.clone()).or_default();
                reserve_for(statuses, &nodes);
                for mut status in nodes {
                    status.since = since;
                    match statuses.binary_search_by(|s| s.node.name.cmp(&status.node.name)) {
                        Ok(i) if statuses[i] == status => {}
                        Ok(i) => {
                            statuses[i] = status;
                            changed.insert(module.clone());
                        }
                        Err(i) => {
                            statuses.insert(i, status);
                            changed.insert(module.clone());
                        }
                    }
                }
            }
        }
        self.entries = entries;
        self.held_bytes = self
            .modules
            .iter()
            .map(|(module, statuses)| {
                module_bytes(module) + statuses.capacity() * std::mem::size_of::<NodeStatus>()
            })
            .sum();
        self.strings.sweep();
        Ok(changed)
    }
    fn has(&self, module: &ModuleId, node: &str) -> bool {
        self.modules
            .get(module)
            .is_some_and(|s| s.binary_search_by(|s| (*s.node.name).cmp(node)).is_ok())
    }

    /// How many node statuses are held.
    pub fn len(&self) -> usize {
        self.entries
    }

    pub fn is_empty(&self) -> bool {
        self.entries == 0
    }

    /// The bytes held, accounted (each status, each module's entry, each shared string,
    /// node and detail, and what the report being received staged): what [`MAX_BYTES`]
    /// bounds.
    pub fn bytes(&self) -> usize {
        self.held_bytes + self.strings.bytes + self.receiving.as_ref().map_or(0, |s| s.bytes)
    }

    /// Every node's status for one module, ordered by node name.
    pub fn module(&self, namespace: &str, name: &str) -> &[NodeStatus] {
        self.modules
            .get(module_key(&(namespace, name)))
            .map_or(&[], Vec::as_slice)
    }

    /// Every node a status names, with the kernel it reported, each once (a report still
    /// arriving may add its own): without going through every status.
    pub fn nodes(&self) -> impl Iterator<Item = &Node> {
        // The set holds one reference of its own: a node nothing else holds is no longer
        // named, and goes at the next sweep.
        self.strings
            .nodes
            .iter()
            .filter(|node| Arc::strong_count(node) > 1)
            .map(AsRef::as_ref)
    }

    /// Every module's node statuses, by module.
    pub fn modules(&self) -> impl Iterator<Item = (&ModuleId, &[NodeStatus])> {
        self.modules
            .iter()
            .map(|(module, statuses)| (module, statuses.as_slice()))
    }

    /// Nodes on which the module may still be loaded: any reported state but UNLOADED or
    /// SKIPPED.
    pub fn not_unloaded(&self, namespace: &str, name: &str) -> impl Iterator<Item = &str> {
        self.module(namespace, name)
            .iter()
            .filter(|status| status.may_be_loaded())
            .map(|status| &*status.node.name)
    }

    /// Whether any node may still have the module loaded.
    pub fn lingers(&self, namespace: &str, name: &str) -> bool {
        self.module(namespace, name)
            .iter()
            .any(NodeStatus::may_be_loaded)
    }
}

/// A full report of (module, node, state) entries, modules in namespace `drivers`.
#[cfg(any(test, feature = "testing"))]
pub fn full_report(entries: &[(&str, &str, ModuleState)]) -> NodeStatusReport {
    use kmm_proto::v1::ModuleNodeKey;
    NodeStatusReport {
        full: true,
        statuses: entries
            .iter()
            .map(|(module, node, state)| ModuleNodeStatus {
                key: Some(ModuleNodeKey {
                    module: Some(ModuleKey {
                        namespace: "drivers".into(),
                        name: (*module).into(),
                    }),
                    node: (*node).into(),
                }),
                state: (*state).into(),
                ..ModuleNodeStatus::default()
            })
            .collect(),
        ..NodeStatusReport::default()
    }
}

/// Room in `statuses` for the nodes of `updates` it lacks, grown by an eighth at least:
/// a Vec left to grow by doubling carries up to as much slack as content, and there is
/// one per module and cluster (1.4 million statuses at 3,500 x 20 x 20); an eighth
/// still keeps nodes arriving one report at a time amortised.
fn reserve_for(statuses: &mut Vec<NodeStatus>, updates: &[NodeStatus]) {
    let new = updates
        .iter()
        .filter(|u| {
            statuses
                .binary_search_by(|s| s.node.name.cmp(&u.node.name))
                .is_err()
        })
        .count();
    if statuses.len() + new > statuses.capacity() {
        statuses.reserve_exact(new.max(statuses.len() / 8));
    }
}

/// A module's statuses as staged, sorted by node, the last one reported of each node
/// kept; exactly as large as that, since a full report's become the held ones.
fn latest_per_node(mut nodes: Vec<NodeStatus>) -> Vec<NodeStatus> {
    // Stable, so that of a node reported twice the later status comes second.
    nodes.sort_by(|a, b| a.node.name.cmp(&b.node.name));
    nodes.dedup_by(|later, kept| {
        let same = later.node.name == kept.node.name;
        if same {
            std::mem::swap(later, kept);
        }
        same
    });
    nodes.shrink_to_fit();
    nodes
}

/// The module of an entry naming `node`, when the entry names both.
fn entry_module(module: Option<&ModuleKey>, node: &str) -> Option<ModuleId> {
    let module = module?;
    if module.name.is_empty() || node.is_empty() {
        return None;
    }
    Some(module_id(&module.namespace, &module.name))
}

#[cfg(test)]
mod tests {
    use kmm_proto::v1::ModuleNodeKey;

    use super::*;

    fn key(name: &str, node: &str) -> ModuleNodeKey {
        ModuleNodeKey {
            module: Some(ModuleKey {
                namespace: "drivers".into(),
                name: name.into(),
            }),
            node: node.into(),
        }
    }

    fn status(name: &str, node: &str, state: ModuleState) -> ModuleNodeStatus {
        ModuleNodeStatus {
            key: Some(key(name, node)),
            state: state.into(),
            ..ModuleNodeStatus::default()
        }
    }

    fn nodes(list: &[NodeStatus]) -> Vec<String> {
        list.iter().map(|s| s.node.name.to_string()).collect()
    }

    #[test]
    fn the_nodes_are_those_a_status_names_each_once() {
        let mut statuses = NodeStatuses::reported(&[
            ("a", "n1", ModuleState::Loaded),
            ("b", "n1", ModuleState::Loaded),
            ("a", "n2", ModuleState::Failed),
        ]);
        let names = |statuses: &NodeStatuses| {
            let mut names: Vec<String> = statuses.nodes().map(|n| n.name.to_string()).collect();
            names.sort();
            names
        };
        assert_eq!(names(&statuses), ["n1", "n2"]);
        statuses
            .apply(full_report(&[("a", "n2", ModuleState::Loaded)]), |_, _| {
                true
            })
            .unwrap();
        assert_eq!(names(&statuses), ["n2"], "n1 is named no more");
    }

    #[test]
    fn nodes_reported_one_at_a_time_leave_little_slack() {
        let mut statuses = NodeStatuses::default();
        for n in 0..200 {
            let report = NodeStatusReport {
                statuses: vec![status("a", &format!("n{n:03}"), ModuleState::Loaded)],
                ..NodeStatusReport::default()
            };
            statuses.apply(report, |_, _| true).unwrap();
            let held = &statuses.modules[&module_id("drivers", "a")];
            assert_eq!(held.len(), n + 1);
            assert!(
                held.capacity() <= held.len() + held.len() / 8 + 1,
                "{} statuses in room for {}",
                held.len(),
                held.capacity()
            );
        }
        let batch = NodeStatusReport {
            statuses: (0..20)
                .map(|n| status("b", &format!("n{n:02}"), ModuleState::Loaded))
                .collect(),
            ..NodeStatusReport::default()
        };
        statuses.apply(batch, |_, _| true).unwrap();
        assert_eq!(statuses.modules[&module_id("drivers", "b")].capacity(), 20);
    }

    #[test]
    fn full_report_replaces_and_delta_updates_and_removes() {
        let mut statuses = NodeStatuses::default();
        statuses
            .apply(
                NodeStatusReport {
                    full: true,
                    statuses: vec![
                        status("a", "n1", ModuleState::Loaded),
                        status("a", "n2", ModuleState::Pending),
                        status("b", "n1", ModuleState::Loaded),
                    ],
                    removed: vec![],
                    ..NodeStatusReport::default()
                },
                |_, _| true,
            )
            .unwrap();
        assert_eq!(nodes(statuses.module("drivers", "a")), ["n1", "n2"]);
        statuses
            .apply(
                NodeStatusReport {
                    full: false,
                    statuses: vec![status("a", "n2", ModuleState::Unloaded)],
                    removed: vec![key("a", "n1")],
                    ..NodeStatusReport::default()
                },
                |_, _| true,
            )
            .unwrap();
        let a = statuses.module("drivers", "a");
        assert_eq!(nodes(a), ["n2"]);
        assert_eq!(a[0].state, ModuleState::Unloaded);
        assert_eq!(statuses.not_unloaded("drivers", "a").count(), 0);
        assert_eq!(
            statuses.not_unloaded("drivers", "b").collect::<Vec<_>>(),
            ["n1"]
        );
        statuses
            .apply(
                NodeStatusReport {
                    full: true,
                    statuses: vec![status("c", "n9", ModuleState::Failed)],
                    removed: vec![],
                    ..NodeStatusReport::default()
                },
                |_, _| true,
            )
            .unwrap();
        assert!(statuses.module("drivers", "b").is_empty(), "full replaces");
        assert_eq!(
            statuses.not_unloaded("drivers", "c").collect::<Vec<_>>(),
            ["n9"]
        );
        assert!(
            statuses.module("other", "c").is_empty(),
            "namespace is part of the key"
        );
    }

    #[test]
    fn statuses_interleaved_across_modules_each_reach_their_module() {
        // Proxies send a module's statuses together, which staging and the known check
        // take a shortcut for; a report that does not is held all the same.
        let mut statuses = NodeStatuses::default();
        let asked = std::cell::RefCell::new(Vec::new());
        let changed = statuses
            .apply(
                NodeStatusReport {
                    full: true,
                    statuses: vec![
                        status("b", "n2", ModuleState::Loaded),
                        status("b", "n1", ModuleState::Pending),
                        status("a", "n1", ModuleState::Loaded),
                        status("x", "n1", ModuleState::Loaded),
                        status("b", "n3", ModuleState::Failed),
                        status("a", "n2", ModuleState::Pending),
                        status("x", "n2", ModuleState::Loaded),
                        status("a", "n1", ModuleState::Failed),
                    ],
                    ..NodeStatusReport::default()
                },
                |namespace, name| {
                    asked.borrow_mut().push(name.to_owned());
                    namespace == "drivers" && name != "x"
                },
            )
            .unwrap();
        assert_eq!(
            changed,
            [module_id("drivers", "a"), module_id("drivers", "b")].into()
        );
        assert_eq!(nodes(statuses.module("drivers", "b")), ["n1", "n2", "n3"]);
        let a = statuses.module("drivers", "a");
        assert_eq!(nodes(a), ["n1", "n2"]);
        assert_eq!(
            a[0].state,
            ModuleState::Failed,
            "the later status of a node wins"
        );
        assert!(
            statuses.module("drivers", "x").is_empty(),
            "unknown, dropped"
        );
        assert_eq!(statuses.len(), 5);
        // Asked once per run of one module's statuses.
        assert_eq!(asked.into_inner(), ["b", "a", "x", "b", "a", "x", "a"]);
    }

    #[test]
    fn the_modules_a_report_changed_are_named() {
        let mut statuses = NodeStatuses::default();
        let full = |list| NodeStatusReport {
            full: true,
            statuses: list,
            ..NodeStatusReport::default()
        };
        let changed = statuses
            .apply(
                full(vec![
                    status("a", "n1", ModuleState::Loaded),
                    status("b", "n1", ModuleState::Pending),
                ]),
                |_, _| true,
            )
            .unwrap();
        let names = |set: BTreeSet<ModuleId>| set.into_iter().map(|(_, n)| n).collect::<Vec<_>>();
        assert_eq!(names(changed), ["a", "b"]);
        let same = statuses
            .apply(
                NodeStatusReport {
                    statuses: vec![status("a", "n1", ModuleState::Loaded)],
                    ..NodeStatusReport::default()
                },
                |_, _| true,
            )
            .unwrap();
        assert!(same.is_empty(), "a status reported again changes nothing");
        let changed = statuses
            .apply(
                NodeStatusReport {
                    statuses: vec![status("b", "n1", ModuleState::Loaded)],
                    removed: vec![key("a", "n1"), key("a", "gone")],
                    ..NodeStatusReport::default()
                },
                |_, _| true,
            )
            .unwrap();
        assert_eq!(names(changed), ["a", "b"]);
        assert_eq!(statuses.len(), 1);
        let changed = statuses
            .apply(
                full(vec![status("b", "n1", ModuleState::Loaded)]),
                |_, _| true,
            )
            .unwrap();
        assert!(
            changed.is_empty(),
            "a full report equal to what is held changes nothing"
        );
        let changed = statuses.apply(full(vec![]), |_, _| true).unwrap();
        assert_eq!(names(changed), ["b"], "a full report drops what it lacks");
        assert!(statuses.is_empty());
    }

    #[test]
    fn a_report_in_parts_is_applied_only_whole() {
        let mut statuses = NodeStatuses::default();
        let part = |node: &str, revision, continued| NodeStatusReport {
            full: true,
            statuses: vec![status("a", node, ModuleState::Loaded)],
            intent_revision: revision,
            continued,
            ..NodeStatusReport::default()
        };
        let all = |_: &str, _: &str| true;
        assert_eq!(
            statuses
                .receive(part("n1", 3, true), all, Arrival::now())
                .unwrap(),
            None
        );
        assert_eq!(
            statuses
                .receive(part("n2", 3, true), all, Arrival::now())
                .unwrap(),
            None
        );
        assert!(
            statuses.is_empty(),
            "nothing is applied before the last part"
        );
        let whole = statuses
            .receive(part("n3", 3, false), all, Arrival::now())
            .unwrap()
            .unwrap();
        assert_eq!(nodes(statuses.module("drivers", "a")), ["n1", "n2", "n3"]);
        assert_eq!(
            whole,
            Applied {
                changed: [module_id("drivers", "a")].into(),
                full: true,
                intent_revision: 3,
            }
        );

        // A report left unfinished is dropped when another starts.
        assert_eq!(
            statuses
                .receive(part("n1", 4, true), all, Arrival::now())
                .unwrap(),
            None
        );
        let other = statuses
            .receive(part("n9", 5, false), all, Arrival::now())
            .unwrap()
            .unwrap();
        assert_eq!(other.intent_revision, 5);
        assert_eq!(nodes(statuses.module("drivers", "a")), ["n9"]);

        // And when its stream ended.
        assert_eq!(
            statuses
                .receive(part("n1", 6, true), all, Arrival::now())
                .unwrap(),
            None
        );
        statuses.forget_partial();
        let delta = NodeStatusReport {
            statuses: vec![status("a", "n2", ModuleState::Loaded)],
            intent_revision: 6,
            ..NodeStatusReport::default()
        };
        statuses
            .receive(delta, all, Arrival::now())
            .unwrap()
            .unwrap();
        assert_eq!(nodes(statuses.module("drivers", "a")), ["n2", "n9"]);

        let huge = NodeStatusReport {
            removed: (0..=MAX_ENTRIES)
                .map(|i| key("a", &format!("n{i}")))
                .collect(),
            continued: true,
            ..NodeStatusReport::default()
        };
        assert!(
            statuses.receive(huge, all, Arrival::now()).is_err(),
            "parts cannot pile up without bound"
        );
        let next = statuses
            .receive(part("n1", 7, false), all, Arrival::now())
            .unwrap()
            .unwrap();
        assert_eq!(next.intent_revision, 7);
    }

    #[test]
    fn reports_that_never_finish_do_not_grow_what_is_shared() {
        let mut statuses = NodeStatuses::default();
        for revision in 0..1_000 {
            let part = NodeStatusReport {
                full: true,
                statuses: vec![status("a", &format!("n{revision}"), ModuleState::Pending)],
                intent_revision: revision,
                continued: true,
                ..NodeStatusReport::default()
            };
            assert_eq!(
                statuses.receive(part, |_, _| true, Arrival::now()).unwrap(),
                None
            );
        }
        assert!(statuses.strings.len() < 200, "{}", statuses.strings.len());
    }

    #[test]
    fn a_status_keeps_at_most_the_error_text_limit_of_its_reason_and_message() {
        let mut statuses = NodeStatuses::default();
        let huge = ModuleNodeStatus {
            reason: "R".repeat(1 << 20),
            message: "é".repeat(1 << 20),
            ..status("a", "n1", ModuleState::Failed)
        };
        statuses
            .apply(
                NodeStatusReport {
                    full: true,
                    statuses: vec![huge],
                    ..NodeStatusReport::default()
                },
                |_, _| true,
            )
            .unwrap();
        let held = &statuses.module("drivers", "a")[0];
        assert_eq!(held.reason().len(), ERROR_TEXT);
        assert!(held.message().len() <= ERROR_TEXT && held.message().len() > ERROR_TEXT - 2);
        assert!(statuses.bytes() < 4 * ERROR_TEXT, "{}", statuses.bytes());
    }

    #[test]
    fn statuses_whose_texts_outgrow_the_byte_limit_are_refused_and_forgotten() {
        let mut statuses = NodeStatuses::default();
        let all = |_: &str, _: &str| true;
        // Each entry distinct, each text as long as kept: few entries, many bytes.
        let part = |first: usize| NodeStatusReport {
            full: true,
            statuses: (first..first + 1_000)
                .map(|n| ModuleNodeStatus {
                    message: format!("{n:0>width$}", width = ERROR_TEXT),
                    ..status("a", &format!("n{n}"), ModuleState::Failed)
                })
                .collect(),
            intent_revision: 1,
            continued: true,
            ..NodeStatusReport::default()
        };
        let mut refused = None;
        for first in (0..MAX_BYTES / ERROR_TEXT).step_by(1_000) {
            match statuses.receive(part(first), all, Arrival::now()) {
                Ok(None) => assert!(statuses.bytes() <= MAX_BYTES, "{}", statuses.bytes()),
                Ok(Some(_)) => unreachable!("every part continues"),
                Err(error) => {
                    refused = Some(error);
                    break;
                }
            }
        }
        let refused = refused.expect("refused before the last part");
        assert!(
            matches!(refused, ReportRefused::TooManyBytes { bytes } if bytes > MAX_BYTES),
            "{refused}"
        );
        assert!(
            statuses.bytes() < 1 << 10,
            "the refused report is forgotten: {}",
            statuses.bytes()
        );
        assert!(refused.to_string().contains("NodeStatusReport"));
    }

    #[test]
    fn removals_of_modules_neither_known_nor_held_are_not_staged() {
        let mut statuses = NodeStatuses::default();
        let strangers = NodeStatusReport {
            removed: (0..10_000)
                .map(|i| ModuleNodeKey {
                    module: Some(ModuleKey {
                        namespace: "drivers".into(),
                        name: format!("stranger{i}"),
                    }),
                    node: format!("n{i}"),
                })
                .collect(),
            continued: true,
            ..NodeStatusReport::default()
        };
        let known = |_: &str, name: &str| name == "a";
        assert_eq!(
            statuses.receive(strangers, known, Arrival::now()).unwrap(),
            None
        );
        assert!(statuses.bytes() < 1 << 10, "{}", statuses.bytes());
    }

    #[test]
    fn a_report_whose_parts_keep_arriving_past_the_deadline_is_refused() {
        let mut statuses = NodeStatuses::default();
        let all = |_: &str, _: &str| true;
        let part = |node: &str, continued| NodeStatusReport {
            full: true,
            statuses: vec![status("a", node, ModuleState::Loaded)],
            intent_revision: 3,
            continued,
            ..NodeStatusReport::default()
        };
        let start = Arrival::now();
        let at = |instant| Arrival {
            at: instant,
            ..start
        };
        assert_eq!(
            statuses.receive(part("n1", true), all, start).unwrap(),
            None
        );
        let within = at(start.at + REPORT_DEADLINE);
        assert_eq!(
            statuses.receive(part("n2", true), all, within).unwrap(),
            None
        );
        let late = at(within.at + Duration::from_secs(1));
        assert_eq!(
            statuses.receive(part("n3", true), all, late),
            Err(ReportRefused::Unfinished)
        );
        assert_eq!(statuses.bytes(), 0, "its parts are forgotten");
        // The proxy's next report starts afresh.
        assert_eq!(statuses.receive(part("n1", true), all, late).unwrap(), None);
        statuses
            .receive(part("n2", false), all, late)
            .unwrap()
            .unwrap();
        assert_eq!(nodes(statuses.module("drivers", "a")), ["n1", "n2"]);
    }

    #[test]
    fn of_a_node_reported_twice_the_later_status_counts() {
        let mut statuses = NodeStatuses::default();
        let part = |state, continued| NodeStatusReport {
            full: true,
            statuses: vec![
                status("a", "n2", state),
                status("a", "n1", ModuleState::Pending),
            ],
            intent_revision: 1,
            continued,
            ..NodeStatusReport::default()
        };
        let all = |_: &str, _: &str| true;
        statuses
            .receive(part(ModuleState::Pending, true), all, Arrival::now())
            .unwrap();
        statuses
            .receive(part(ModuleState::Loaded, false), all, Arrival::now())
            .unwrap();
        let held = statuses.module("drivers", "a");
        assert_eq!(nodes(held), ["n1", "n2"]);
        assert_eq!(held[1].state, ModuleState::Loaded);
        assert_eq!(statuses.len(), 2);
    }

    #[test]
    fn a_status_keeps_when_it_was_first_heard_until_it_changes() {
        let mut statuses = NodeStatuses::default();
        let all = |_: &str, _: &str| true;
        let at = |unix_seconds| Arrival {
            at: Instant::now(),
            unix_seconds,
        };
        let report = |full, entries: &[(&str, ModuleState)]| NodeStatusReport {
            full,
            statuses: entries
                .iter()
                .map(|(node, state)| status("a", node, *state))
                .collect(),
            ..NodeStatusReport::default()
        };
        let since = |statuses: &NodeStatuses| -> Vec<(String, u32)> {
            statuses
                .module("drivers", "a")
                .iter()
                .map(|s| (s.node.name.to_string(), s.since))
                .collect()
        };
        let pending = ModuleState::Pending;
        let loaded = ModuleState::Loaded;
        statuses
            .receive(
                report(true, &[("n1", pending), ("n2", pending)]),
                all,
                at(100),
            )
            .unwrap();
        assert_eq!(since(&statuses), [("n1".into(), 100), ("n2".into(), 100)]);
        // A delta: n1 changes, n2 is repeated as it was.
        statuses
            .receive(
                report(false, &[("n1", loaded), ("n2", pending)]),
                all,
                at(200),
            )
            .unwrap();
        assert_eq!(since(&statuses), [("n1".into(), 200), ("n2".into(), 100)]);
        // A full report after a reconnect: what it repeats keeps its time, what changed
        // and what is new get the report's.
        statuses
            .receive(
                report(true, &[("n1", loaded), ("n2", loaded), ("n3", pending)]),
                all,
                at(300),
            )
            .unwrap();
        assert_eq!(
            since(&statuses),
            [("n1".into(), 200), ("n2".into(), 300), ("n3".into(), 300)]
        );
    }

    #[test]
    fn a_status_is_small_and_shares_the_rest() {
        // 1.4 million of them at 3,500 clusters x 20 nodes x 20 modules.
        assert_eq!(std::mem::size_of::<NodeStatus>(), 24);
        let mut statuses = NodeStatuses::default();
        let report = NodeStatusReport {
            full: true,
            statuses: vec![
                status("a", "n1", ModuleState::Loaded),
                status("b", "n1", ModuleState::Loaded),
            ],
            ..NodeStatusReport::default()
        };
        statuses.apply(report, |_, _| true).unwrap();
        let (a, b) = (
            statuses.module("drivers", "a"),
            statuses.module("drivers", "b"),
        );
        assert!(Arc::ptr_eq(&a[0].node, &b[0].node));
    }

    #[test]
    fn statuses_saying_the_same_share_their_detail() {
        let mut statuses = NodeStatuses::default();
        let waiting = |node: &str| ModuleNodeStatus {
            message: "waiting for the node agent to load registry/kmod:1".into(),
            ..status("a", node, ModuleState::Pending)
        };
        statuses
            .apply(
                NodeStatusReport {
                    full: true,
                    statuses: vec![waiting("n1"), waiting("n2")],
                    ..NodeStatusReport::default()
                },
                |_, _| true,
            )
            .unwrap();
        let held = statuses.module("drivers", "a");
        let (first, second) = (held[0].detail.as_ref(), held[1].detail.as_ref());
        assert!(Arc::ptr_eq(first.unwrap(), second.unwrap()));
        assert_eq!(
            held[0].message(),
            "waiting for the node agent to load registry/kmod:1"
        );
    }

    #[test]
    fn entries_without_a_complete_key_are_ignored() {
        let mut statuses = NodeStatuses::default();
        statuses
            .apply(
                NodeStatusReport {
                    full: false,
                    statuses: vec![
                        ModuleNodeStatus::default(),
                        status("", "n1", ModuleState::Loaded),
                        status("a", "", ModuleState::Loaded),
                    ],
                    removed: vec![ModuleNodeKey::default()],
                    ..NodeStatusReport::default()
                },
                |_, _| true,
            )
            .unwrap();
        assert_eq!(statuses, NodeStatuses::default());
    }

    #[test]
    fn statuses_of_modules_never_sent_are_ignored_and_the_total_is_bounded() {
        let mut statuses = NodeStatuses::default();
        statuses
            .apply(
                NodeStatusReport {
                    full: true,
                    statuses: vec![
                        status("a", "n1", ModuleState::Loaded),
                        status("stranger", "n1", ModuleState::Loaded),
                    ],
                    ..NodeStatusReport::default()
                },
                |_, name| name == "a",
            )
            .unwrap();
        assert_eq!(statuses.len(), 1);
        assert!(statuses.module("drivers", "stranger").is_empty());

        let flood = |n: usize, full: bool| NodeStatusReport {
            full,
            statuses: (0..n)
                .map(|i| status("a", &format!("n{i}"), ModuleState::Pending))
                .collect(),
            ..NodeStatusReport::default()
        };
        let before = statuses.clone();
        let refused = statuses
            .apply(flood(MAX_ENTRIES + 1, true), |_, _| true)
            .unwrap_err();
        assert_eq!(
            refused,
            ReportRefused::TooManyStatuses {
                entries: MAX_ENTRIES + 1
            }
        );
        assert_eq!(statuses, before, "a refused report changes nothing");
        statuses
            .apply(flood(MAX_ENTRIES, true), |_, _| true)
            .unwrap();
        assert_eq!(statuses.len(), MAX_ENTRIES);
        // Updating existing entries is fine; one new node is one too many.
        statuses.apply(flood(10, false), |_, _| true).unwrap();
        let one_more = NodeStatusReport {
            statuses: vec![status("a", "new", ModuleState::Pending)],
            ..NodeStatusReport::default()
        };
        assert!(statuses.apply(one_more, |_, _| true).is_err());
    }
}
