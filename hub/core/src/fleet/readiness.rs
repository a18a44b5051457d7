//! The `Ready` condition of a ManagedClusterModule and the transitions worth an Event,
//! from its counts. Pure: the caller passes the clock.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use kmm_api::ManagedClusterModuleStatus;

/// The condition type kmm-hub maintains.
pub const READY: &str = "Ready";

/// Where a module stands, most urgent first. Each is a condition reason and an Event
/// reason.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    /// The spec does not validate; nothing resolves.
    InvalidSpec,
    /// Deleted; waiting for the unload to be confirmed.
    Unloading,
    /// An agent failed to load the module on some node.
    LoadFailed,
    /// Some matching node's kernel has no image (no mapping, missing pull secret, ...).
    KernelUnresolved,
    /// A selected cluster's proxy is not connected.
    ClusterDisconnected,
    /// Nodes are still pending.
    Progressing,
    /// Every matching node of every selected cluster runs the module.
    Converged,
    /// No managed cluster matches the selector.
    NoClusterSelected,
}

impl Phase {
    pub fn reason(self) -> &'static str {
        match self {
            Self::InvalidSpec => "InvalidSpec",
            Self::Unloading => "Unloading",
            Self::LoadFailed => "LoadFailed",
            Self::KernelUnresolved => "KernelUnresolved",
            Self::ClusterDisconnected => "ClusterDisconnected",
            Self::Progressing => "Progressing",
            Self::Converged => "Converged",
            Self::NoClusterSelected => "NoClusterSelected",
        }
    }

    /// Whether an Event for entering this phase is a Warning.
    pub fn is_warning(self) -> bool {
        matches!(
            self,
            Self::InvalidSpec
                | Self::LoadFailed
                | Self::KernelUnresolved
                | Self::ClusterDisconnected
        )
    }
}

/// The module's phase from its freshly computed counts.
pub fn phase(status: &ManagedClusterModuleStatus, invalid: bool, deleting: bool) -> Phase {
    let (clusters, nodes) = (&status.clusters, &status.nodes);
    if invalid {
        Phase::InvalidSpec
    } else if deleting {
        Phase::Unloading
    } else if nodes.failed > 0 {
        if status.failures.iter().any(|f| f.reason == "LoadFailed") {
            Phase::LoadFailed
        } else {
            Phase::KernelUnresolved
        }
    } else if clusters.selected == 0 {
        Phase::NoClusterSelected
    } else if clusters.connected < clusters.selected {
        Phase::ClusterDisconnected
    } else if clusters.converged < clusters.selected {
        Phase::Progressing
    } else {
        Phase::Converged
    }
}

/// A one-line summary of the counts, the condition's message (the spec's errors when it
/// is invalid).
pub fn summary(status: &ManagedClusterModuleStatus, phase: Phase, detail: &str) -> String {
    let (c, n) = (&status.clusters, &status.nodes);
    let mut counts = format!(
        "clusters: {} selected, {} connected, {} converged; nodes: {} matching, {} loaded, {} failed",
        c.selected, c.connected, c.converged, n.matching, n.loaded, n.failed
    );
    // A module that loads nothing converges on these alone.
    if let Some(plugins) = &status.device_plugins {
        counts.push_str(&format!(
            "; device plugin Pods: {} desired, {} available",
            plugins.desired, plugins.available
        ));
    }
    match (phase, status.failures.first()) {
        (Phase::InvalidSpec | Phase::Unloading, _) if !detail.is_empty() => detail.to_owned(),
        (Phase::LoadFailed | Phase::KernelUnresolved, Some(f)) => format!(
            "{counts}; first failure: cluster {} node {} kernel {}: {}: {}",
            f.cluster,
            f.node.as_deref().unwrap_or("-"),
            f.kernel,
            f.reason,
            f.message
        ),
        _ => counts,
    }
}

/// The `Ready` condition, keeping the previous transition time while its status holds.
pub fn ready_condition(
    phase: Phase,
    message: String,
    generation: Option<i64>,
    previous: Option<&Condition>,
    now: Time,
) -> Condition {
    let status = if phase == Phase::Converged {
        "True"
    } else {
        "False"
    };
    let last_transition_time = previous
        .filter(|p| p.status == status)
        .map_or(now, |p| p.last_transition_time.clone());
    Condition {
        type_: READY.to_owned(),
        status: status.to_owned(),
        reason: phase.reason().to_owned(),
        message,
        observed_generation: generation,
        last_transition_time,
    }
}

/// Whether going from `previous` to `next` is a transition worth an Event.
pub fn is_transition(previous: Option<&Condition>, next: &Condition) -> bool {
    previous.is_none_or(|p| p.reason != next.reason)
}

#[cfg(test)]
mod tests {
    use k8s_openapi::jiff::Timestamp;
    use kmm_api::{ClusterCounts, FailureSample, NodeCounts};

    use super::*;

    fn status(
        selected: i32,
        connected: i32,
        converged: i32,
        failed: &[&str],
    ) -> ManagedClusterModuleStatus {
        ManagedClusterModuleStatus {
            clusters: ClusterCounts {
                selected,
                connected,
                converged,
                held: 0,
            },
            nodes: NodeCounts {
                matching: 4,
                loaded: 2,
                failed: failed.len() as i32,
                skipped: 0,
            },
            failures: failed
                .iter()
                .map(|reason| FailureSample {
                    cluster: "spoke1".into(),
                    node: Some("n1".into()),
                    kernel: "6.1".into(),
                    reason: (*reason).into(),
                    message: "why".into(),
                })
                .collect(),
            ..ManagedClusterModuleStatus::default()
        }
    }

    #[test]
    fn phases_in_order_of_urgency() {
        let cases = [
            (status(1, 1, 1, &[]), true, false, Phase::InvalidSpec),
            (
                status(1, 1, 0, &["LoadFailed"]),
                false,
                true,
                Phase::Unloading,
            ),
            (
                status(1, 1, 0, &["NoKernelMapping", "LoadFailed"]),
                false,
                false,
                Phase::LoadFailed,
            ),
            (
                status(1, 1, 0, &["NoKernelMapping"]),
                false,
                false,
                Phase::KernelUnresolved,
            ),
            (status(0, 0, 0, &[]), false, false, Phase::NoClusterSelected),
            (
                status(2, 1, 1, &[]),
                false,
                false,
                Phase::ClusterDisconnected,
            ),
            (status(2, 2, 1, &[]), false, false, Phase::Progressing),
            (status(2, 2, 2, &[]), false, false, Phase::Converged),
        ];
        for (s, invalid, deleting, expected) in cases {
            assert_eq!(phase(&s, invalid, deleting), expected);
        }
        assert!(Phase::LoadFailed.is_warning());
        assert!(!Phase::Converged.is_warning());
    }

    #[test]
    fn summary_names_counts_and_the_first_failure() {
        let s = status(1, 1, 0, &["NoKernelMapping"]);
        let text = summary(&s, Phase::KernelUnresolved, "");
        assert!(
            text.contains("clusters: 1 selected, 1 connected, 0 converged"),
            "{text}"
        );
        assert!(
            text.contains("node n1 kernel 6.1: NoKernelMapping: why"),
            "{text}"
        );
        assert_eq!(
            summary(&s, Phase::InvalidSpec, "spec.x: bad"),
            "spec.x: bad"
        );
        assert!(!text.contains("device plugin"), "{text}");
    }

    #[test]
    fn summary_counts_the_device_plugin_pods_of_a_module_with_a_plugin() {
        let mut s = status(1, 1, 0, &[]);
        s.device_plugins = Some(kmm_api::DevicePluginCounts {
            desired: 3,
            available: 2,
            short: Vec::new(),
        });
        let text = summary(&s, Phase::Progressing, "");
        assert!(
            text.ends_with("; device plugin Pods: 3 desired, 2 available"),
            "{text}"
        );
    }

    #[test]
    fn transition_time_holds_while_the_status_holds() {
        let t0 = Time(Timestamp::UNIX_EPOCH);
        let t1 = Time(Timestamp::from_second(60).unwrap());
        let first = ready_condition(Phase::Progressing, "m".into(), Some(1), None, t0.clone());
        assert_eq!(first.status, "False");
        assert!(is_transition(None, &first));
        let still = ready_condition(
            Phase::ClusterDisconnected,
            "m".into(),
            Some(1),
            Some(&first),
            t1.clone(),
        );
        assert_eq!(
            still.last_transition_time, t0,
            "False to False keeps the time"
        );
        assert!(
            is_transition(Some(&first), &still),
            "a new reason is an Event"
        );
        let ready = ready_condition(
            Phase::Converged,
            "m".into(),
            Some(2),
            Some(&still),
            t1.clone(),
        );
        assert_eq!(
            (ready.status.as_str(), &ready.last_transition_time),
            ("True", &t1)
        );
        let again = ready_condition(Phase::Converged, "m".into(), Some(2), Some(&ready), t0);
        assert!(!is_transition(Some(&ready), &again));
    }
}
