//! The figures of a run and their `fleet-scale:` lines. One `scenario=` line per
//! scenario in the exact format of issue 14; every other line has another first word.

use std::collections::BTreeMap;

use super::Shape;
use super::hub_process::cpu_seconds;
use super::proxy::LoadKey;
use crate::fleet::State;

const MIB: f64 = 1024.0 * 1024.0;

/// CPU seconds of the fleet's hub-side processes: the work the hub's writes and the
/// run's ManagedClusters cause outside kmm-hub.
#[derive(Clone, Copy, Debug, Default)]
pub struct FleetCpu {
    pub apiserver: f64,
    pub etcd: f64,
    /// OCM's hub controllers (registration, add-on manager, placement, webhook).
    pub ocm: f64,
    pub controller_manager: f64,
    /// This process: the simulated proxies and the harness.
    pub harness: f64,
}

impl FleetCpu {
    pub fn sample(state: &State) -> Self {
        let mut cpu = Self {
            harness: cpu_seconds(std::process::id() as i32).unwrap_or_default(),
            ..Self::default()
        };
        for p in &state.processes {
            let slot = match p.name.as_str() {
                "hub/kube-apiserver" => &mut cpu.apiserver,
                "etcd" => &mut cpu.etcd,
                "hub/kube-controller-manager" => &mut cpu.controller_manager,
                name if name.starts_with("hub/ocm-") => &mut cpu.ocm,
                _ => continue,
            };
            *slot += cpu_seconds(p.pid).unwrap_or_default();
        }
        cpu
    }

    pub fn since(&self, before: &Self) -> Self {
        Self {
            apiserver: self.apiserver - before.apiserver,
            etcd: self.etcd - before.etcd,
            ocm: self.ocm - before.ocm,
            controller_manager: self.controller_manager - before.controller_manager,
            harness: self.harness - before.harness,
        }
    }

    fn fields(&self) -> String {
        format!(
            "apiserver_cpu_s={:.2} etcd_cpu_s={:.2} ocm_cpu_s={:.2} kcm_cpu_s={:.2} harness_cpu_s={:.2}",
            self.apiserver, self.etcd, self.ocm, self.controller_manager, self.harness
        )
    }
}

/// One scenario's figures: deltas over the scenario, memory at its end.
#[derive(Clone, Debug)]
pub struct ScenarioFigures {
    pub scenario: &'static str,
    pub shape: Shape,
    pub converge_s: f64,
    pub hub_rss_kib: u64,
    pub hub_cpu_s: f64,
    pub sent_bytes: u64,
    pub status_writes: u64,
    pub snapshots_sent: u64,
    /// Streams whose proxy held its intents already, sent none.
    pub snapshots_resumed: u64,
    pub fleet: FleetCpu,
}

impl ScenarioFigures {
    /// `fleet-scale: scenario=<name> clusters=N nodes=<N*M> modules=K converge_s=<s>
    /// hub_rss_mib=<MiB> hub_cpu_s=<s> sent_mib=<MiB> status_writes=<n>`
    pub fn line(&self) -> String {
        format!(
            "fleet-scale: scenario={} clusters={} nodes={} modules={} converge_s={:.2} \
             hub_rss_mib={:.1} hub_cpu_s={:.2} sent_mib={:.3} status_writes={}",
            self.scenario,
            self.shape.clusters,
            self.shape.nodes(),
            self.shape.modules,
            self.converge_s,
            self.hub_rss_kib as f64 / 1024.0,
            self.hub_cpu_s,
            self.sent_bytes as f64 / MIB,
            self.status_writes
        )
    }

    /// What else the scenario cost: snapshots the hub sent (and streams it resumed
    /// without one), the fleet's processes.
    pub fn detail_line(&self) -> String {
        format!(
            "fleet-scale: detail scenario={} snapshots_sent={} snapshots_resumed={} {}",
            self.scenario,
            self.snapshots_sent,
            self.snapshots_resumed,
            self.fleet.fields()
        )
    }
}

/// Creating the run's ManagedClusters, before the hub starts: OCM's own work.
#[derive(Clone, Debug)]
pub struct SetupFigures {
    pub clusters: usize,
    pub create_s: f64,
    /// From the first create until OCM's registration controller had accepted every
    /// cluster and made its namespace.
    pub ocm_settled_s: f64,
    pub fleet: FleetCpu,
}

impl SetupFigures {
    pub fn line(&self) -> String {
        format!(
            "fleet-scale: setup clusters={} create_s={:.2} ocm_settled_s={:.2} {}",
            self.clusters,
            self.create_s,
            self.ocm_settled_s,
            self.fleet.fields()
        )
    }
}

pub fn peak_line(shape: &Shape, peak_rss_kib: u64) -> String {
    format!(
        "fleet-scale: peak clusters={} nodes={} modules={} hub_peak_rss_mib={:.1}",
        shape.clusters,
        shape.nodes(),
        shape.modules,
        peak_rss_kib as f64 / 1024.0
    )
}

/// The hub with every stream open and nothing changing.
#[derive(Clone, Debug)]
pub struct IdleFigures {
    pub shape: Shape,
    pub connected: u64,
    pub seconds: f64,
    pub hub_cpu_s: f64,
    pub status_writes: u64,
}

impl IdleFigures {
    pub fn line(&self) -> String {
        format!(
            "fleet-scale: idle clusters={} nodes={} modules={} connected={} seconds={:.0} \
             hub_cpu_pct={:.2} status_writes={}",
            self.shape.clusters,
            self.shape.nodes(),
            self.shape.modules,
            self.connected,
            self.seconds,
            100.0 * self.hub_cpu_s / self.seconds,
            self.status_writes
        )
    }
}

/// Unloads the simulated nodes did, against one per (cluster, node, module) that had the
/// module loaded when the modules were deleted.
#[derive(Clone, Debug, Default)]
pub struct UnloadAudit {
    pub expected: usize,
    pub recorded: u64,
    /// Had the module and got no unload, or still run it.
    pub lost: Vec<LoadKey>,
    /// Unloaded more than once.
    pub duplicated: Vec<(LoadKey, u32)>,
    /// Unloads of a module the audit did not expect on that node.
    pub unexpected: Vec<LoadKey>,
}

impl UnloadAudit {
    pub fn new(
        expected: &[LoadKey],
        unloads: &BTreeMap<LoadKey, u32>,
        still_loaded: &std::collections::BTreeSet<LoadKey>,
    ) -> Self {
        let mut audit = Self {
            expected: expected.len(),
            recorded: unloads.values().map(|n| u64::from(*n)).sum(),
            ..Self::default()
        };
        for key in expected {
            match unloads.get(key).copied().unwrap_or(0) {
                0 => audit.lost.push(key.clone()),
                1 if still_loaded.contains(key) => audit.lost.push(key.clone()),
                1 => {}
                n => audit.duplicated.push((key.clone(), n)),
            }
        }
        let expected: std::collections::BTreeSet<&LoadKey> = expected.iter().collect();
        audit.unexpected = unloads
            .keys()
            .filter(|k| !expected.contains(k))
            .cloned()
            .collect();
        audit
    }

    pub fn is_clean(&self) -> bool {
        self.lost.is_empty() && self.duplicated.is_empty() && self.unexpected.is_empty()
    }

    pub fn line(&self) -> String {
        let first = |keys: &[LoadKey]| {
            keys.first()
                .map(|(c, n, m)| format!(" (first: {c}/{n}/{m})"))
                .unwrap_or_default()
        };
        format!(
            "fleet-scale: unloads expected={} recorded={} lost={}{} duplicated={}{} unexpected={}{}",
            self.expected,
            self.recorded,
            self.lost.len(),
            first(&self.lost),
            self.duplicated.len(),
            first(
                &self
                    .duplicated
                    .iter()
                    .map(|(k, _)| k.clone())
                    .collect::<Vec<_>>()
            ),
            self.unexpected.len(),
            first(&self.unexpected),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape() -> Shape {
        Shape {
            clusters: 1000,
            nodes_per_cluster: 10,
            modules: 1,
        }
    }

    #[test]
    fn the_scenario_line_is_the_issue_s_format() {
        let figures = ScenarioFigures {
            scenario: "create",
            shape: shape(),
            converge_s: 8.256,
            hub_rss_kib: 100 * 1024 + 512,
            hub_cpu_s: 3.5,
            sent_bytes: 3 * 1024 * 1024 / 2,
            status_writes: 7,
            snapshots_sent: 1000,
            snapshots_resumed: 0,
            fleet: FleetCpu::default(),
        };
        assert_eq!(
            figures.line(),
            "fleet-scale: scenario=create clusters=1000 nodes=10000 modules=1 converge_s=8.26 \
             hub_rss_mib=100.5 hub_cpu_s=3.50 sent_mib=1.500 status_writes=7"
        );
    }

    #[test]
    fn the_audit_finds_lost_duplicated_and_unexpected_unloads() {
        let key = |n: &str| ("c".to_owned(), n.to_owned(), "m".to_owned());
        let expected = [key("a"), key("b"), key("c"), key("d")];
        let unloads = BTreeMap::from([(key("a"), 1), (key("b"), 2), (key("d"), 1), (key("x"), 1)]);
        let still = std::collections::BTreeSet::from([key("d")]);
        let audit = UnloadAudit::new(&expected, &unloads, &still);
        assert_eq!(audit.lost, vec![key("c"), key("d")]);
        assert_eq!(audit.duplicated, vec![(key("b"), 2)]);
        assert_eq!(audit.unexpected, vec![key("x")]);
        assert_eq!(audit.recorded, 5);
        assert!(!audit.is_clean());
    }
}
