//! Kubernetes toleration semantics, evaluated by the proxy instead of the scheduler
//! because the node agent is one DaemonSet that runs everywhere. Pure.

use kmm_proto::v1::Toleration;

use crate::node_facts::Taint;

/// Whether `toleration` tolerates `taint`, exactly as Kubernetes' `ToleratesTaint`: an
/// empty effect matches every effect, an empty key (with `Exists`) every key, operator
/// `Exists` ignores the value, `Equal` (or empty) compares it. Unknown operators
/// tolerate nothing.
pub fn tolerates(toleration: &Toleration, taint: &Taint) -> bool {
    if !toleration.effect.is_empty() && toleration.effect != taint.effect {
        return false;
    }
    if !toleration.key.is_empty() && toleration.key != taint.key {
        return false;
    }
    match toleration.operator.as_str() {
        "Exists" => true,
        "" | "Equal" => toleration.value == taint.value,
        _ => false,
    }
}

/// `NoSchedule` taints a new load tolerates, as a DaemonSet does by default: cordoning a
/// node for maintenance (`unschedulable`) or the kubelet reporting pressure must not keep
/// the modules its workloads use off it. Upstream KMM tolerates the pressure taints the
/// same way.
const BUILT_IN: &[&str] = &[
    "node.kubernetes.io/unschedulable",
    "node.kubernetes.io/disk-pressure",
    "node.kubernetes.io/memory-pressure",
    "node.kubernetes.io/pid-pressure",
];

/// Taints that say what a node is going through, not what a user wants: those Kubernetes
/// sets from a node's conditions and cordoning, and those the common node lifecycle tools
/// set while they drain, replace or shut a node down (the cluster autoscaler, Karpenter,
/// cloud providers' node controllers, Cluster API, the non-graceful shutdown an admin
/// declares). They may hold back a new load, but never unload a module already there: a
/// node that is briefly NotReady, or being drained for deletion, keeps its driver until
/// it is gone. Only a user's change unloads.
const NODE_LIFECYCLE: &[&str] = &[
    "node.kubernetes.io/not-ready",
    "node.kubernetes.io/unreachable",
    "node.kubernetes.io/network-unavailable",
    "node.kubernetes.io/unschedulable",
    "node.kubernetes.io/disk-pressure",
    "node.kubernetes.io/memory-pressure",
    "node.kubernetes.io/pid-pressure",
    "node.kubernetes.io/out-of-service",
    "node.cloudprovider.kubernetes.io/shutdown",
    "node.cloudprovider.kubernetes.io/uninitialized",
    "ToBeDeletedByClusterAutoscaler",
    "karpenter.sh/disrupted",
    "karpenter.sh/disruption",
    "node.cluster.x-k8s.io/uninitialized",
];

/// What a node's taints mean for one module.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TaintVerdict<'a> {
    /// Nothing keeps the module off the node.
    Allowed,
    /// Only condition and lifecycle taints: no new load starts, a module already on the
    /// node stays.
    HoldsNewLoads(&'a Taint),
    /// A `NoSchedule` or `NoExecute` taint of a user's that no toleration tolerates
    /// (`PreferNoSchedule` never counts, as upstream KMM): the module leaves the node.
    Excludes(&'a Taint),
}

/// Judges `taints` against a module's `tolerations`. A user's taint decides over a
/// condition taint; the built-in `NoSchedule` tolerations hold back nothing.
pub fn verdict<'a>(tolerations: &[Toleration], taints: &'a [Taint]) -> TaintVerdict<'a> {
    let mut untolerated = taints.iter().filter(|taint| {
        matches!(taint.effect.as_str(), "NoSchedule" | "NoExecute")
            && !tolerations.iter().any(|t| tolerates(t, taint))
    });
    let (mut user, mut condition) = (None, None);
    for taint in untolerated.by_ref() {
        let key = taint.key.as_str();
        if !NODE_LIFECYCLE.contains(&key) {
            user = user.or(Some(taint));
        } else if !(taint.effect == "NoSchedule" && BUILT_IN.contains(&key)) {
            condition = condition.or(Some(taint));
        }
    }
    match (user, condition) {
        (Some(taint), _) => TaintVerdict::Excludes(taint),
        (None, Some(taint)) => TaintVerdict::HoldsNewLoads(taint),
        (None, None) => TaintVerdict::Allowed,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn taint(key: &str, value: &str, effect: &str) -> Taint {
        Taint {
            key: key.into(),
            value: value.into(),
            effect: effect.into(),
        }
    }

    fn tol(key: &str, operator: &str, value: &str, effect: &str) -> Toleration {
        Toleration {
            key: key.into(),
            operator: operator.into(),
            value: value.into(),
            effect: effect.into(),
        }
    }

    #[test]
    fn cordoned_or_pressured_nodes_take_new_loads() {
        for key in BUILT_IN {
            assert_eq!(
                verdict(&[], &[taint(key, "", "NoSchedule")]),
                TaintVerdict::Allowed,
                "{key}"
            );
        }
    }

    #[test]
    fn kubernetes_condition_taints_hold_new_loads_whatever_their_effect() {
        for key in NODE_LIFECYCLE {
            for effect in ["NoSchedule", "NoExecute"] {
                let taints = [taint(key, "", effect)];
                if effect == "NoSchedule" && BUILT_IN.contains(key) {
                    continue;
                }
                assert_eq!(
                    verdict(&[], &taints),
                    TaintVerdict::HoldsNewLoads(&taints[0]),
                    "{key}:{effect}"
                );
            }
        }
    }

    #[test]
    fn a_users_taint_excludes_even_beside_a_condition_taint() {
        let taints = [
            taint("node.kubernetes.io/unreachable", "", "NoExecute"),
            taint("example.com/drain", "", "NoExecute"),
        ];
        assert_eq!(verdict(&[], &taints), TaintVerdict::Excludes(&taints[1]));
        let tolerated = [tol("example.com/drain", "Exists", "", "")];
        assert_eq!(
            verdict(&tolerated, &taints),
            TaintVerdict::HoldsNewLoads(&taints[0])
        );
        let everything = [tol("", "Exists", "", "")];
        assert_eq!(verdict(&everything, &taints), TaintVerdict::Allowed);
    }

    #[test]
    fn toleration_table() {
        let cases = [
            // (toleration, taint, tolerated)
            (
                tol("k", "Equal", "v", "NoSchedule"),
                taint("k", "v", "NoSchedule"),
                true,
            ),
            (
                tol("k", "", "v", "NoSchedule"),
                taint("k", "v", "NoSchedule"),
                true,
            ),
            (
                tol("k", "Equal", "v", "NoSchedule"),
                taint("k", "w", "NoSchedule"),
                false,
            ),
            (
                tol("k", "Equal", "v", "NoSchedule"),
                taint("other", "v", "NoSchedule"),
                false,
            ),
            (
                tol("k", "Equal", "v", "NoSchedule"),
                taint("k", "v", "NoExecute"),
                false,
            ),
            (
                tol("k", "Equal", "v", ""),
                taint("k", "v", "NoExecute"),
                true,
            ),
            (
                tol("k", "Exists", "", "NoSchedule"),
                taint("k", "anything", "NoSchedule"),
                true,
            ),
            (
                tol("k", "Exists", "", ""),
                taint("k", "x", "NoExecute"),
                true,
            ),
            (
                tol("k", "Exists", "", "NoExecute"),
                taint("k", "x", "NoSchedule"),
                false,
            ),
            (
                tol("", "Exists", "", ""),
                taint("any", "x", "NoExecute"),
                true,
            ),
            (
                tol("", "Exists", "", "NoSchedule"),
                taint("any", "x", "NoSchedule"),
                true,
            ),
            (
                tol("", "Exists", "", "NoSchedule"),
                taint("any", "x", "NoExecute"),
                false,
            ),
            (
                tol("k", "Equal", "", ""),
                taint("k", "", "NoSchedule"),
                true,
            ),
            (
                tol("k", "Equal", "", ""),
                taint("k", "v", "NoSchedule"),
                false,
            ),
            (
                tol("k", "Lt", "1", ""),
                taint("k", "1", "NoSchedule"),
                false,
            ),
        ];
        for (toleration, taint, expected) in cases {
            assert_eq!(
                tolerates(&toleration, &taint),
                expected,
                "{toleration:?} vs {taint:?}"
            );
        }
    }

    #[test]
    fn only_noschedule_and_noexecute_exclude() {
        let prefer = [taint("k", "v", "PreferNoSchedule")];
        assert_eq!(verdict(&[], &prefer), TaintVerdict::Allowed);
        let hard = [
            taint("a", "", "PreferNoSchedule"),
            taint("k", "v", "NoExecute"),
        ];
        assert_eq!(verdict(&[], &hard), TaintVerdict::Excludes(&hard[1]));
    }

    #[test]
    fn every_excluding_taint_must_be_tolerated() {
        let taints = [taint("a", "1", "NoSchedule"), taint("b", "2", "NoExecute")];
        let only_a = [tol("a", "Equal", "1", "NoSchedule")];
        assert_eq!(
            verdict(&only_a, &taints),
            TaintVerdict::Excludes(&taints[1])
        );
        let both = [
            tol("a", "Equal", "1", "NoSchedule"),
            tol("b", "Exists", "", ""),
        ];
        assert_eq!(verdict(&both, &taints), TaintVerdict::Allowed);
        let everything = [tol("", "Exists", "", "")];
        assert_eq!(verdict(&everything, &taints), TaintVerdict::Allowed);
        assert_eq!(verdict(&[], &[]), TaintVerdict::Allowed);
    }

    #[test]
    fn drains_and_shutdowns_of_lifecycle_tools_never_unload() {
        for key in [
            "ToBeDeletedByClusterAutoscaler",
            "karpenter.sh/disrupted",
            "karpenter.sh/disruption",
            "node.cloudprovider.kubernetes.io/shutdown",
            "node.kubernetes.io/out-of-service",
        ] {
            for effect in ["NoSchedule", "NoExecute"] {
                let taints = [taint(key, "", effect)];
                assert_eq!(
                    verdict(&[], &taints),
                    TaintVerdict::HoldsNewLoads(&taints[0]),
                    "{key}:{effect}"
                );
            }
        }
        // A user's own taint beside them still decides.
        let taints = [
            taint("ToBeDeletedByClusterAutoscaler", "", "NoSchedule"),
            taint("team", "gpu", "NoSchedule"),
        ];
        assert_eq!(verdict(&[], &taints), TaintVerdict::Excludes(&taints[1]));
    }
}
