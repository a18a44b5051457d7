//! A ManagedClusterModule's status from what its clusters report: counts over the whole
//! fleet, a bounded, deterministic sample of failures, and the nodes where it shares a
//! kernel module with another module. Pure.

use std::collections::BTreeSet;

use kmm_api::{
    ClusterCounts, FailureSample, HeldCluster, KernelCounts, MAX_FAILURE_SAMPLES,
    MAX_SHARED_KERNEL_MODULES, ManagedClusterModuleStatus, NodeCounts, PlacementRef,
    SharedKernelModule,
};
use kmm_proto::REASON_KERNEL_MODULE_SHARED;
use kmm_proto::v1::{KernelTarget, ModuleState, kernel_target::Target};

use super::node_statuses::NodeStatus;
use super::placements::HoldReason;
use super::rollout::Observation;

/// What one selected cluster says about one module.
#[derive(Clone, Copy, Debug)]
pub struct ClusterReport<'a> {
    pub cluster: &'a str,
    /// Whether the cluster's spoke proxy is connected now.
    pub connected: bool,
    /// Whether its node statuses were made with the module's current revision applied:
    /// until then the cluster cannot have converged, whatever its nodes said before.
    pub reflects_revision: bool,
    /// The module's per-kernel resolution for this cluster.
    pub kernels: &'a [KernelTarget],
    /// The module's per-node status in this cluster.
    pub nodes: &'a [NodeStatus],
    /// The module loads nothing, it only runs a device plugin: its node statuses say only
    /// where the plugin stops, and the cluster converges once `device_plugin` shows the
    /// plugin available on every node the module selects.
    pub device_plugin_only: bool,
    /// The module's device plugin Pods in this cluster, (desired, available), once its
    /// proxy reported them.
    pub device_plugin: Option<(u32, u32)>,
}

/// Aggregates the reports of every selected cluster.
pub fn module_status(
    generation: Option<i64>,
    reports: &[ClusterReport<'_>],
) -> ManagedClusterModuleStatus {
    let mut tally = StatusTally::default();
    for report in reports {
        tally.add(report);
    }
    tally.finish(generation)
}

/// A module's status counted one cluster at a time, so that no more than one cluster's
/// statuses need be at hand at once.
#[derive(Debug, Default)]
pub struct StatusTally {
    clusters: ClusterCounts,
    nodes: NodeCounts,
    resolved: BTreeSet<String>,
    unresolved: BTreeSet<String>,
    /// The smallest failures by (cluster, node, kernel), at most [`MAX_FAILURE_SAMPLES`].
    failures: Vec<FailureSample>,
    /// The held clusters with the smallest names, at most [`MAX_FAILURE_SAMPLES`].
    held: Vec<HeldCluster>,
    /// The nodes sharing a kernel module by (cluster, node), at most
    /// [`MAX_SHARED_KERNEL_MODULES`].
    shared: Vec<SharedKernelModule>,
    /// Clusters with a failed node.
    degraded: i32,
}

impl StatusTally {
    /// Notes that a counted cluster is held (see `placements::held`).
    pub fn hold(&mut self, cluster: &str, placement: &PlacementRef, reason: HoldReason) {
        self.clusters.held += 1;
        self.held.push(HeldCluster {
            cluster: cluster.to_owned(),
            placement: placement.to_string(),
            reason: reason.as_str().to_owned(),
            message: reason.message(placement),
        });
        if self.held.len() > 4 * MAX_FAILURE_SAMPLES {
            self.trim_held();
        }
    }

    fn trim_held(&mut self) {
        self.held.sort_by(|a, b| a.cluster.cmp(&b.cluster));
        self.held.truncate(MAX_FAILURE_SAMPLES);
    }

    /// Counts one cluster, and says what it shows for a rollout.
    pub fn add(&mut self, report: &ClusterReport<'_>) -> Observation {
        self.clusters.selected += 1;
        let (in_place, failure) = if report.device_plugin_only {
            // Nothing is loaded, so no node counts as matching, loaded or failed.
            let everywhere = report
                .device_plugin
                .is_some_and(|(desired, available)| available >= desired);
            (everywhere, None)
        } else {
            self.count_nodes(report)
        };
        let converged = report.connected && report.reflects_revision && in_place;
        if report.connected {
            self.clusters.connected += 1;
        }
        if converged {
            self.clusters.converged += 1;
        }
        if failure.is_some() {
            self.degraded += 1;
        }
        for target in report.kernels {
            let kernels = match &target.target {
                // The kernel has an image, which the cluster resolves for the hub (until
                // its resolution fails).
                Some(Target::Load(_)) => &mut self.resolved,
                Some(Target::Resolve(resolution)) if resolution.failed.is_none() => {
                    &mut self.resolved
                }
                _ => &mut self.unresolved,
            };
            // Most clusters run kernels counted already: look before copying.
            if !kernels.contains(&target.kernel) {
                kernels.insert(target.kernel.clone());
            }
        }
        // Keep the sample bounded however many clusters fail.
        if self.failures.len() > 4 * MAX_FAILURE_SAMPLES {
            self.trim_failures();
        }
        Observation {
            converged,
            failure,
            wave: None,
            connected: report.connected,
        }
    }

    /// Counts the cluster's nodes: whether every matching one runs the module, and its
    /// first failure.
    fn count_nodes(&mut self, report: &ClusterReport<'_>) -> (bool, Option<String>) {
        let mut matching = 0;
        let mut loaded = 0;
        let mut failure = None;
        self.note_shared(report.cluster, report.nodes);
        for status in report.nodes {
            match status.state {
                ModuleState::Loaded => loaded += 1,
                ModuleState::Failed => {
                    failure.get_or_insert_with(|| {
                        format!(
                            "{}: {}: {}",
                            status.node.name,
                            status.reason(),
                            status.message()
                        )
                    });
                    self.nodes.failed += 1;
                    self.failures.push(FailureSample {
                        cluster: report.cluster.to_owned(),
                        node: Some(status.node.name.to_string()),
                        kernel: status.node.kernel.to_string(),
                        reason: status.reason().to_owned(),
                        message: status.message().to_owned(),
                    });
                }
                ModuleState::Pending => {}
                ModuleState::Skipped => {
                    self.nodes.skipped += 1;
                    continue;
                }
                ModuleState::Unloaded | ModuleState::Unspecified => continue,
            }
            matching += 1;
        }
        self.nodes.matching += count(matching);
        self.nodes.loaded += count(loaded);
        (loaded == matching, failure)
    }

    /// Notes the nodes of `cluster` where the module shares a kernel module with another
    /// module (whatever their state: loaded stays loaded, unloaded stays unloaded).
    pub fn note_shared(&mut self, cluster: &str, nodes: &[NodeStatus]) {
        self.shared.extend(
            nodes
                .iter()
                .filter(|status| status.reason() == REASON_KERNEL_MODULE_SHARED)
                .map(|status| SharedKernelModule {
                    cluster: cluster.to_owned(),
                    node: status.node.name.to_string(),
                    message: status.message().to_owned(),
                }),
        );
        if self.shared.len() > 4 * MAX_SHARED_KERNEL_MODULES {
            self.trim_shared();
        }
    }

    fn trim_shared(&mut self) {
        self.shared.sort();
        self.shared.truncate(MAX_SHARED_KERNEL_MODULES);
    }

    fn trim_failures(&mut self) {
        self.failures.sort_by(|a, b| {
            (&a.cluster, &a.node, &a.kernel).cmp(&(&b.cluster, &b.node, &b.kernel))
        });
        self.failures.truncate(MAX_FAILURE_SAMPLES);
    }

    pub fn finish(mut self, generation: Option<i64>) -> ManagedClusterModuleStatus {
        self.trim_failures();
        self.trim_held();
        self.trim_shared();
        let (selected, converged) = (self.clusters.selected, self.clusters.converged);
        ManagedClusterModuleStatus {
            observed_generation: generation,
            clusters: self.clusters,
            nodes: self.nodes,
            kernels: KernelCounts {
                resolved: count(self.resolved.len()),
                unresolved: count(self.unresolved.len()),
            },
            held: self.held,
            number_desired: selected,
            number_applied: converged,
            number_degraded: self.degraded,
            failures: self.failures,
            shared_kernel_modules: self.shared,
            images: Vec::new(),
            rollout: None,
            pin_generation: None,
            device_plugins: None,
            conditions: Vec::new(),
        }
    }
}

/// The shared kernel modules `next` lists that `previous` (the status on record) did not:
/// each is announced once, when it first shows, however often the module is reconciled.
pub fn newly_shared<'a>(
    previous: Option<&ManagedClusterModuleStatus>,
    next: &'a ManagedClusterModuleStatus,
) -> Vec<&'a SharedKernelModule> {
    let known = previous.map_or(&[][..], |p| &p.shared_kernel_modules[..]);
    next.shared_kernel_modules
        .iter()
        .filter(|shared| !known.contains(shared))
        .collect()
}

fn count(n: usize) -> i32 {
    i32::try_from(n).unwrap_or(i32::MAX)
}

#[cfg(test)]
mod tests {
    use kmm_proto::v1::{ModuleKey, ModuleLoad, ModuleNodeKey, ModuleNodeStatus, Unresolved};

    use super::*;

    fn node(name: &str, state: ModuleState, reason: &str) -> NodeStatus {
        NodeStatus::from(&ModuleNodeStatus {
            key: Some(ModuleNodeKey {
                module: Some(ModuleKey::default()),
                node: name.into(),
            }),
            kernel: "6.1.0-13-amd64".into(),
            state: state.into(),
            reason: reason.into(),
            message: format!("{reason} on {name}"),
            ..ModuleNodeStatus::default()
        })
    }

    fn targets() -> Vec<KernelTarget> {
        vec![
            KernelTarget {
                kernel: "6.1.0-13-amd64".into(),
                target: Some(Target::Load(ModuleLoad::default())),
            },
            KernelTarget {
                kernel: "6.6.54-flatcar".into(),
                target: Some(Target::Unresolved(Unresolved::default())),
            },
        ]
    }

    #[test]
    fn counts_cover_every_cluster_and_node() {
        let kernels = targets();
        let a = [
            node("a1", ModuleState::Loaded, ""),
            node("a2", ModuleState::Loaded, ""),
            node("a3", ModuleState::Unloaded, ""),
        ];
        let b = [
            node("b1", ModuleState::Loaded, ""),
            node("b2", ModuleState::Failed, "LoadFailed"),
            node("b3", ModuleState::Pending, ""),
        ];
        let c: [NodeStatus; 0] = [];
        let status = module_status(
            Some(5),
            &[
                ClusterReport {
                    cluster: "a",
                    connected: true,
                    reflects_revision: true,
                    kernels: &kernels,
                    nodes: &a,
                    device_plugin_only: false,
                    device_plugin: None,
                },
                ClusterReport {
                    cluster: "b",
                    connected: true,
                    reflects_revision: true,
                    kernels: &kernels,
                    nodes: &b,
                    device_plugin_only: false,
                    device_plugin: None,
                },
                ClusterReport {
                    cluster: "c",
                    connected: false,
                    reflects_revision: false,
                    kernels: &[],
                    nodes: &c,
                    device_plugin_only: false,
                    device_plugin: None,
                },
            ],
        );
        assert_eq!(status.observed_generation, Some(5));
        assert_eq!(
            status.clusters,
            ClusterCounts {
                selected: 3,
                connected: 2,
                converged: 1,
                held: 0,
            }
        );
        assert_eq!(
            status.nodes,
            NodeCounts {
                matching: 5,
                loaded: 3,
                failed: 1,
                skipped: 0,
            }
        );
        assert_eq!(
            status.kernels,
            KernelCounts {
                resolved: 1,
                unresolved: 1
            }
        );
        assert_eq!(status.failures.len(), 1);
        assert_eq!(status.failures[0].node.as_deref(), Some("b2"));
        assert_eq!(status.failures[0].reason, "LoadFailed");
        assert_eq!(
            (
                status.number_desired,
                status.number_applied,
                status.number_degraded
            ),
            (3, 1, 1),
            "upstream's counters: selected, converged, with a failed node"
        );
    }

    #[test]
    fn nodes_no_mapping_applies_to_are_counted_apart_and_never_waited_for() {
        let kernels = targets();
        let nodes = [
            node("a1", ModuleState::Loaded, ""),
            node("a2", ModuleState::Skipped, "NoKernelMapping"),
        ];
        let status = module_status(
            Some(1),
            &[ClusterReport {
                cluster: "mixed",
                connected: true,
                reflects_revision: true,
                kernels: &kernels,
                nodes: &nodes,
                device_plugin_only: false,
                device_plugin: None,
            }],
        );
        assert_eq!((status.nodes.matching, status.nodes.loaded), (1, 1));
        assert_eq!(status.nodes.skipped, 1);
        assert_eq!(
            status.clusters.converged, 1,
            "the skipped node is not waited for"
        );
        assert!(status.failures.is_empty());
    }

    #[test]
    fn failure_samples_stay_bounded_and_deterministic() {
        let many: Vec<NodeStatus> = (0..500)
            .rev()
            .map(|i| node(&format!("n{i:03}"), ModuleState::Failed, "NoKernelMapping"))
            .collect();
        let report = [ClusterReport {
            cluster: "big",
            connected: true,
            reflects_revision: true,
            kernels: &[],
            nodes: &many,
            device_plugin_only: false,
            device_plugin: None,
        }];
        let status = module_status(None, &report);
        assert_eq!(status.nodes.failed, 500);
        assert_eq!(status.failures.len(), MAX_FAILURE_SAMPLES);
        assert_eq!(status.failures[0].node.as_deref(), Some("n000"));
        assert_eq!(
            status,
            module_status(None, &report),
            "same input, same status: no churn"
        );
        assert_eq!(status.clusters.converged, 0);
    }

    #[test]
    fn a_cluster_converges_only_once_its_statuses_reflect_the_current_generation() {
        let loaded = [node("n1", ModuleState::Loaded, "")];
        let none: [NodeStatus; 0] = [];
        for nodes in [&loaded[..], &none[..]] {
            let report = |reflects_revision| ClusterReport {
                cluster: "a",
                connected: true,
                reflects_revision,
                kernels: &[],
                nodes,
                device_plugin_only: false,
                device_plugin: None,
            };
            assert_eq!(
                module_status(Some(2), &[report(false)]).clusters.converged,
                0,
                "statuses of an older generation, or none yet, prove nothing: {nodes:?}"
            );
            assert_eq!(
                module_status(Some(2), &[report(true)]).clusters.converged,
                1
            );
        }
    }

    fn shared_on(cluster: &str, nodes: &[NodeStatus]) -> ManagedClusterModuleStatus {
        module_status(
            Some(1),
            &[ClusterReport {
                cluster,
                connected: true,
                reflects_revision: true,
                kernels: &[],
                nodes,
                device_plugin_only: false,
                device_plugin: None,
            }],
        )
    }

    fn shared(cluster: &str, node: &str) -> SharedKernelModule {
        SharedKernelModule {
            cluster: cluster.into(),
            node: node.into(),
            message: format!("{REASON_KERNEL_MODULE_SHARED} on {node}"),
        }
    }

    #[test]
    fn a_shared_kernel_module_is_listed_and_fails_nothing() {
        let nodes = [
            node("a1", ModuleState::Loaded, REASON_KERNEL_MODULE_SHARED),
            node("a2", ModuleState::Unloaded, REASON_KERNEL_MODULE_SHARED),
            node("a3", ModuleState::Loaded, ""),
        ];
        let status = shared_on("a", &nodes);
        assert_eq!(
            (
                status.nodes.matching,
                status.nodes.loaded,
                status.nodes.failed
            ),
            (2, 2, 0),
            "loaded is loaded, unloaded is not matching"
        );
        assert_eq!(status.clusters.converged, 1);
        assert!(status.failures.is_empty());
        assert_eq!(
            status.shared_kernel_modules,
            [shared("a", "a1"), shared("a", "a2")]
        );
    }

    #[test]
    fn shared_kernel_modules_stay_bounded_and_deterministic() {
        let many: Vec<NodeStatus> = (0..500)
            .rev()
            .map(|i| {
                node(
                    &format!("n{i:03}"),
                    ModuleState::Loaded,
                    REASON_KERNEL_MODULE_SHARED,
                )
            })
            .collect();
        let status = shared_on("big", &many);
        assert_eq!(status.nodes.loaded, 500);
        assert_eq!(
            status.shared_kernel_modules.len(),
            MAX_SHARED_KERNEL_MODULES
        );
        assert_eq!(status.shared_kernel_modules[0], shared("big", "n000"));
    }

    #[test]
    fn each_shared_kernel_module_is_announced_once() {
        let before = shared_on(
            "a",
            &[node("a1", ModuleState::Loaded, REASON_KERNEL_MODULE_SHARED)],
        );
        assert_eq!(newly_shared(None, &before), [&shared("a", "a1")]);
        assert!(newly_shared(Some(&before), &before).is_empty());
        let after = shared_on(
            "a",
            &[
                node("a1", ModuleState::Loaded, REASON_KERNEL_MODULE_SHARED),
                node("a2", ModuleState::Unloaded, REASON_KERNEL_MODULE_SHARED),
            ],
        );
        assert_eq!(newly_shared(Some(&before), &after), [&shared("a", "a2")]);
    }

    #[test]
    fn a_module_that_loads_nothing_converges_once_its_plugin_runs_on_every_selected_node() {
        let stopping = [
            node("n1", ModuleState::Pending, "DevicePluginStopping"),
            node("n2", ModuleState::Unloaded, ""),
        ];
        let report = |device_plugin, reflects_revision| ClusterReport {
            cluster: "a",
            connected: true,
            reflects_revision,
            kernels: &[],
            nodes: &stopping,
            device_plugin_only: true,
            device_plugin,
        };
        let status = module_status(Some(1), &[report(Some((2, 2)), true)]);
        assert_eq!(status.clusters.converged, 1);
        assert_eq!(
            status.nodes,
            NodeCounts::default(),
            "nothing is loaded: no node is matching, loaded or failed"
        );
        assert_eq!(status.number_degraded, 0);
        for (counts, reflects) in [(Some((2, 1)), true), (None, true), (Some((2, 2)), false)] {
            assert_eq!(
                module_status(Some(1), &[report(counts, reflects)])
                    .clusters
                    .converged,
                0,
                "{counts:?}, reflects the generation: {reflects}"
            );
        }
        assert_eq!(
            module_status(Some(1), &[report(Some((0, 0)), true)])
                .clusters
                .converged,
            1,
            "no node selected: nothing to wait for"
        );
    }
}
