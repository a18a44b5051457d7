//! Which pods the runner runs, and how long a stopping one may take. Pure.

use std::time::Duration;

use k8s_openapi::api::core::v1::{Node, Pod};

/// The kubelet's default `terminationGracePeriodSeconds`, and the runner's cap.
const MAX_GRACE: Duration = Duration::from_secs(30);

/// Whether `pod` (already matched by namespace and label selector) is the runner's to
/// run: bound to `node`, which carries the annotation `key=value`, not terminating,
/// not finished, and given an IP by KWOK.
pub(super) fn selected(pod: &Pod, node: Option<&Node>, (key, value): (&str, &str)) -> bool {
    let bound = pod.spec.as_ref().and_then(|s| s.node_name.as_deref());
    let simulated = node.is_some_and(|n| {
        n.metadata.name.as_deref() == bound
            && n.metadata
                .annotations
                .as_ref()
                .and_then(|a| a.get(key))
                .is_some_and(|v| v == value)
    });
    let status = pod.status.as_ref();
    let finished = status
        .and_then(|s| s.phase.as_deref())
        .is_some_and(|p| p == "Succeeded" || p == "Failed");
    let has_ip = status
        .and_then(|s| s.pod_ip.as_deref())
        .is_some_and(|ip| !ip.is_empty());
    bound.is_some() && simulated && pod.metadata.deletion_timestamp.is_none() && !finished && has_ip
}

/// How long a stopping pod's processes get between SIGTERM and SIGKILL: its
/// `terminationGracePeriodSeconds`, at most 30 s. Not the deletion's grace period:
/// KWOK deletes every terminating pod again with a grace period of 0, so what the
/// runner sees would depend on which of the two updates it saw last.
pub(super) fn grace_period(pod: &Pod) -> Duration {
    let seconds = pod
        .spec
        .as_ref()
        .and_then(|s| s.termination_grace_period_seconds);
    seconds.map_or(MAX_GRACE, |s| {
        Duration::from_secs(u64::try_from(s).unwrap_or(0)).min(MAX_GRACE)
    })
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
    use kube::api::ObjectMeta;

    use super::super::fields::tests::agent_pod;
    use super::*;

    const FAKE: (&str, &str) = ("kwok.x-k8s.io/node", "fake");

    fn node(name: &str, annotation: Option<&str>) -> Node {
        Node {
            metadata: ObjectMeta {
                name: Some(name.into()),
                annotations: annotation.map(|v| BTreeMap::from([(FAKE.0.into(), v.into())])),
                ..Default::default()
            },
            ..Default::default()
        }
    }

    #[test]
    fn a_running_pod_on_a_kwok_node() {
        let kwok = node("spoke1-kwok-1", Some("fake"));
        assert!(selected(&agent_pod(), Some(&kwok), FAKE));
    }

    #[test]
    fn not_on_real_unknown_or_other_nodes() {
        let pod = agent_pod();
        assert!(!selected(&pod, None, FAKE));
        assert!(!selected(&pod, Some(&node("spoke1-kwok-1", None)), FAKE));
        assert!(!selected(
            &pod,
            Some(&node("spoke1-kwok-1", Some("real"))),
            FAKE
        ));
        assert!(!selected(
            &pod,
            Some(&node("spoke1-kwok-2", Some("fake"))),
            FAKE
        ));
        let mut unscheduled = agent_pod();
        unscheduled.spec.as_mut().unwrap().node_name = None;
        assert!(!selected(
            &unscheduled,
            Some(&node("spoke1-kwok-1", Some("fake"))),
            FAKE
        ));
    }

    #[test]
    fn not_terminating_finished_or_without_an_ip() {
        let kwok = node("spoke1-kwok-1", Some("fake"));
        let mut terminating = agent_pod();
        terminating.metadata.deletion_timestamp = Some(Time(Default::default()));
        assert!(!selected(&terminating, Some(&kwok), FAKE));
        for phase in ["Succeeded", "Failed"] {
            let mut done = agent_pod();
            done.status.as_mut().unwrap().phase = Some(phase.into());
            assert!(!selected(&done, Some(&kwok), FAKE), "{phase}");
        }
        let mut pending = agent_pod();
        pending.status.as_mut().unwrap().phase = Some("Pending".into());
        assert!(selected(&pending, Some(&kwok), FAKE));
        for ip in [None, Some(String::new())] {
            let mut no_ip = agent_pod();
            no_ip.status.as_mut().unwrap().pod_ip = ip;
            assert!(!selected(&no_ip, Some(&kwok), FAKE));
        }
        let mut no_status = agent_pod();
        no_status.status = None;
        assert!(!selected(&no_status, Some(&kwok), FAKE));
    }

    #[test]
    fn grace_from_the_spec_capped_at_30s() {
        let secs = Duration::from_secs;
        let mut pod = agent_pod();
        assert_eq!(grace_period(&pod), secs(30));
        pod.spec.as_mut().unwrap().termination_grace_period_seconds = Some(5);
        assert_eq!(grace_period(&pod), secs(5));
        // KWOK's own deletion does not cut it short.
        pod.metadata.deletion_grace_period_seconds = Some(0);
        assert_eq!(grace_period(&pod), secs(5));
        pod.spec.as_mut().unwrap().termination_grace_period_seconds = Some(600);
        assert_eq!(grace_period(&pod), secs(30));
        pod.spec.as_mut().unwrap().termination_grace_period_seconds = Some(0);
        assert_eq!(grace_period(&pod), Duration::ZERO);
        pod.spec.as_mut().unwrap().termination_grace_period_seconds = Some(-1);
        assert_eq!(grace_period(&pod), Duration::ZERO);
    }
}
