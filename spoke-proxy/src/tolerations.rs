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

/// `NoSchedule` taints every module tolerates: cordoning a node for maintenance
/// (`unschedulable`) or the kubelet reporting pressure must not unload the modules its
/// running workloads use. Upstream KMM tolerates the pressure taints the same way; a
/// DaemonSet tolerates all four by default.
const BUILT_IN: &[&str] = &[
    "node.kubernetes.io/unschedulable",
    "node.kubernetes.io/disk-pressure",
    "node.kubernetes.io/memory-pressure",
    "node.kubernetes.io/pid-pressure",
];

/// The first taint that keeps the module off the node: a `NoSchedule` or `NoExecute`
/// taint no toleration tolerates (`PreferNoSchedule` never does, as upstream KMM), the
/// built-in `NoSchedule` tolerations aside.
pub fn blocking_taint<'a>(tolerations: &[Toleration], taints: &'a [Taint]) -> Option<&'a Taint> {
    taints.iter().find(|taint| {
        let built_in = taint.effect == "NoSchedule" && BUILT_IN.contains(&taint.key.as_str());
        matches!(taint.effect.as_str(), "NoSchedule" | "NoExecute")
            && !built_in
            && !tolerations.iter().any(|t| tolerates(t, taint))
    })
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
    fn cordoned_or_pressured_nodes_keep_their_modules_but_not_when_evicting() {
        for key in BUILT_IN {
            assert_eq!(
                blocking_taint(&[], &[taint(key, "", "NoSchedule")]),
                None,
                "{key}"
            );
            let evicting = [taint(key, "", "NoExecute")];
            assert_eq!(blocking_taint(&[], &evicting), evicting.first(), "{key}");
        }
        let other = [taint("node.kubernetes.io/not-ready", "", "NoSchedule")];
        assert_eq!(blocking_taint(&[], &other), other.first());
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
    fn only_noschedule_and_noexecute_block() {
        let prefer = [taint("k", "v", "PreferNoSchedule")];
        assert_eq!(blocking_taint(&[], &prefer), None);
        let hard = [
            taint("a", "", "PreferNoSchedule"),
            taint("k", "v", "NoExecute"),
        ];
        assert_eq!(blocking_taint(&[], &hard), Some(&hard[1]));
    }

    #[test]
    fn every_blocking_taint_must_be_tolerated() {
        let taints = [taint("a", "1", "NoSchedule"), taint("b", "2", "NoExecute")];
        let only_a = [tol("a", "Equal", "1", "NoSchedule")];
        assert_eq!(blocking_taint(&only_a, &taints), Some(&taints[1]));
        let both = [
            tol("a", "Equal", "1", "NoSchedule"),
            tol("b", "Exists", "", ""),
        ];
        assert_eq!(blocking_taint(&both, &taints), None);
        let everything = [tol("", "Exists", "", "")];
        assert_eq!(blocking_taint(&everything, &taints), None);
        assert_eq!(blocking_taint(&[], &[]), None);
    }
}
