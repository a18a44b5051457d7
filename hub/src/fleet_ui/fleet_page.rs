//! The fleet page: every module with its rollout progress, the clusters connected, and
//! the fleet's kernels (how many nodes run each, which modules resolve for it, which
//! lack an image).

use std::collections::BTreeMap;

use kmm_api::NodeCounts;
use kmm_proto::v1::kernel_target::Target;
use kmm_resolver::ResolveErrorKind;
use kube::ResourceExt;

use crate::serve::fleet_view::{ClusterReadout, FleetView};

use super::cluster_grid::{Segment, segments};
use crate::fleet::cluster_states::StateCounts;

/// Width of the bars, in SVG user units.
pub const BAR_WIDTH: u32 = 1_000;

#[derive(Clone, Debug, PartialEq)]
pub struct FleetPage {
    pub modules: Vec<ModuleRow>,
    /// ManagedClusters the hub knows.
    pub clusters: usize,
    /// Clusters whose proxy is connected.
    pub connected: usize,
    pub kernels: Vec<KernelRow>,
}

/// One module's rollout progress: its selected clusters by state.
#[derive(Clone, Debug, PartialEq)]
pub struct ModuleRow {
    pub name: String,
    pub counts: StateCounts,
    pub bar: Vec<Segment>,
    /// The rollout's state (`Progressing`, `Succeeded`, `Halted`), as last written.
    pub rollout: Option<String>,
    pub deleting: bool,
    /// Why its spec is invalid, when it is.
    pub invalid: Option<String>,
    /// Its matching nodes and those loaded, as its status last said.
    pub nodes: Option<NodeCounts>,
}

/// One kernel release of the fleet.
#[derive(Clone, Debug, PartialEq)]
pub struct KernelRow {
    pub release: String,
    /// Nodes reporting a module status on this kernel.
    pub nodes: usize,
    /// The bar's width, relative to the kernel most nodes run.
    pub width: String,
    /// Modules an image resolves for on this kernel.
    pub resolving: Vec<String>,
    /// Modules meant for it (a kernel mapping matches) without an image, with the first
    /// reason a cluster was given.
    pub lacking: Vec<(String, String)>,
}

/// What the clusters' sessions say of the fleet's kernels, one cluster at a time.
#[derive(Debug, Default)]
pub struct KernelChart {
    nodes: BTreeMap<String, usize>,
    /// Per kernel, the modules resolving (with no reason) and lacking (with the first).
    resolving: BTreeMap<String, BTreeMap<String, String>>,
    lacking: BTreeMap<String, BTreeMap<String, String>>,
}

impl KernelChart {
    /// Counts one cluster: its nodes by kernel, and each module's resolution for each of
    /// its kernels. `modules` are (spoke namespace, name).
    pub fn add(&mut self, cluster: ClusterReadout<'_>, modules: &[(String, String)]) {
        for node in cluster.statuses().nodes() {
            // The kernel's name is copied only the first time.
            match self.nodes.get_mut(&*node.kernel) {
                Some(count) => *count += 1,
                None => {
                    self.nodes.insert(node.kernel.to_string(), 1);
                }
            }
        }
        for kernel in cluster.kernels().into_iter().flatten() {
            self.nodes.entry(kernel.clone()).or_default();
        }
        for (namespace, name) in modules {
            for target in cluster.resolutions(namespace, name) {
                let by_kernel = match &target.target {
                    // An image the cluster resolves for the hub resolves too, until its
                    // resolution fails.
                    Some(Target::Load(_)) => &mut self.resolving,
                    Some(Target::Resolve(resolution)) if resolution.failed.is_none() => {
                        &mut self.resolving
                    }
                    // No mapping: the module does not apply to the kernel, no image lacks.
                    Some(Target::Unresolved(unresolved))
                        if unresolved.reason == ResolveErrorKind::NoMatchingMapping.reason() =>
                    {
                        continue;
                    }
                    Some(Target::Unresolved(_) | Target::Resolve(_)) => &mut self.lacking,
                    None => continue,
                };
                let modules = match by_kernel.get_mut(target.kernel.as_str()) {
                    Some(modules) => modules,
                    None => by_kernel.entry(target.kernel.clone()).or_default(),
                };
                if modules.get(name.as_str()).is_none() {
                    let reason = match &target.target {
                        Some(Target::Unresolved(unresolved)) => unresolved.reason.clone(),
                        _ => String::new(),
                    };
                    modules.insert(name.clone(), reason);
                }
            }
        }
    }

    /// The rows, by release.
    pub fn finish(mut self) -> Vec<KernelRow> {
        let most = self.nodes.values().copied().max().unwrap_or(0).max(1) as f64;
        self.nodes
            .into_iter()
            .map(|(release, nodes)| KernelRow {
                width: format!("{:.1}", nodes as f64 / most * f64::from(BAR_WIDTH)),
                resolving: self
                    .resolving
                    .remove(&release)
                    .unwrap_or_default()
                    .into_keys()
                    .collect(),
                lacking: self
                    .lacking
                    .remove(&release)
                    .unwrap_or_default()
                    .into_iter()
                    .collect(),
                release,
                nodes,
            })
            .collect()
    }
}

/// The fleet page from the view as it is now.
pub fn fleet_page(view: &FleetView) -> FleetPage {
    let connected = view.connected_clusters();
    let mut modules = view.known_modules();
    modules.sort_by_key(|m| m.name_any());
    let rows = modules
        .iter()
        .map(|module| {
            // As last counted: counting each module's clusters anew for every page would
            // take most of a second at 3,500 clusters; the counts follow each change
            // within the controller's pacing.
            let counts = view.state_counts(module);
            ModuleRow {
                name: module.name_any(),
                counts,
                bar: segments(counts, BAR_WIDTH),
                rollout: module
                    .status
                    .as_ref()
                    .and_then(|s| s.rollout.as_ref())
                    .map(|r| r.state.clone()),
                deleting: module.metadata.deletion_timestamp.is_some(),
                invalid: view.invalid(module),
                nodes: module.status.as_ref().map(|s| s.nodes.clone()),
            }
        })
        .collect();
    let keys: Vec<(String, String)> = modules
        .iter()
        .map(|m| (m.spec.spoke_namespace.clone(), m.name_any()))
        .collect();
    let mut chart = KernelChart::default();
    view.each_cluster(|_, cluster| chart.add(cluster, &keys));
    FleetPage {
        modules: rows,
        clusters: view.cluster_names().len(),
        connected: connected.len(),
        kernels: chart.finish(),
    }
}
