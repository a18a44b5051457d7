//! The `Degraded` condition the hub keeps on each cluster's ManagedClusterAddOn: whether
//! that cluster's proxy has a session with the hub, and whether its AddOnDeploymentConfig
//! sets what the proxy needs. OCM's own conditions (`Available` from the proxy's
//! readiness, ...) are OCM's. Pure: the caller passes the clock.

use std::time::Duration;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use k8s_openapi::jiff::Timestamp;

use super::addon_config::ConfigProblem;

/// The condition type the hub maintains.
pub const DEGRADED: &str = "Degraded";
/// Not degraded: the proxy has an open session.
pub const HUB_SESSION_OPEN: &str = "HubSessionOpen";
/// Degraded: the proxy has no open session.
pub const NO_HUB_SESSION: &str = "NoHubSession";
/// Degraded: a variable the proxy needs is not set.
pub const CONFIGURATION_INCOMPLETE: &str = "ConfigurationIncomplete";

/// Where a cluster's proxy stands with this hub.
#[derive(Clone, Debug, PartialEq)]
pub enum Session {
    Open,
    /// Its session closed at this time.
    ClosedAt(Time),
    /// None since this hub began serving at this time.
    NoneSince(Time),
    /// None yet, but the hub began serving too recently to tell: after a failover the
    /// proxies take a moment to reconnect.
    Unknown,
}

/// The cluster's session state from what this hub saw since it began serving.
pub fn session(
    open: bool,
    closed_at: Option<&Time>,
    serving_since: Timestamp,
    now: Timestamp,
    reconnect_grace: Duration,
) -> Session {
    if open {
        return Session::Open;
    }
    if let Some(closed_at) = closed_at {
        return Session::ClosedAt(closed_at.clone());
    }
    let serving_for = now.duration_since(serving_since);
    if serving_for.is_negative() || serving_for.unsigned_abs() < reconnect_grace {
        Session::Unknown
    } else {
        Session::NoneSince(Time(serving_since))
    }
}

/// The `Degraded` condition of `cluster`'s add-on; `None` while nothing can be said yet.
/// A configuration problem outranks the session: until fixed, the proxy cannot work. The
/// transition time is kept while the status holds, and so is the message of an earlier
/// hub that knew when the session closed.
pub fn degraded_condition(
    cluster: &str,
    session: &Session,
    problem: Option<&ConfigProblem>,
    generation: Option<i64>,
    previous: Option<&Condition>,
    now: Time,
) -> Option<Condition> {
    let session_message = match session {
        Session::Open => format!("the proxy of cluster {cluster} has an open session with the hub"),
        Session::ClosedAt(t) => format!(
            "the proxy of cluster {cluster} has had no session with the hub since {} (its \
             session closed)",
            seconds(t)
        ),
        Session::NoneSince(t) => match previous {
            Some(p) if p.reason == NO_HUB_SESSION => p.message.clone(),
            _ => format!(
                "the proxy of cluster {cluster} has had no session with the hub since at least \
                 {} (when this hub began serving)",
                seconds(t)
            ),
        },
        Session::Unknown => String::new(),
    };
    let (status, reason, message) = match (problem, session) {
        (Some(problem), Session::Unknown) => {
            ("True", CONFIGURATION_INCOMPLETE, problem.to_string())
        }
        (Some(problem), _) => (
            "True",
            CONFIGURATION_INCOMPLETE,
            format!("{problem}; {session_message}"),
        ),
        (None, Session::Unknown) => return None,
        (None, Session::Open) => ("False", HUB_SESSION_OPEN, session_message),
        (None, _) => ("True", NO_HUB_SESSION, session_message),
    };
    let last_transition_time = previous
        .filter(|p| p.status == status)
        .map_or(now, |p| p.last_transition_time.clone());
    Some(Condition {
        type_: DEGRADED.to_owned(),
        status: status.to_owned(),
        reason: reason.to_owned(),
        message,
        observed_generation: generation,
        last_transition_time,
    })
}

/// RFC 3339 to the second, as Kubernetes writes times.
fn seconds(t: &Time) -> impl std::fmt::Display + '_ {
    t.0.strftime("%Y-%m-%dT%H:%M:%SZ")
}

/// Whether `previous` already says what `next` says (the transition time aside).
pub fn is_current(previous: Option<&Condition>, next: &Condition) -> bool {
    previous.is_some_and(|p| {
        p.status == next.status
            && p.reason == next.reason
            && p.message == next.message
            && p.observed_generation == next.observed_generation
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fleet::addon_config::ConfigName;

    const GRACE: Duration = Duration::from_secs(10);

    fn at(second: i64) -> Time {
        Time(Timestamp::from_second(second).unwrap())
    }

    #[test]
    fn times_in_messages_are_to_the_second() {
        let t = Time(Timestamp::new(20, 123_456_789).unwrap());
        let condition =
            degraded_condition("spoke1", &Session::ClosedAt(t), None, None, None, at(21)).unwrap();
        assert!(
            condition.message.contains("since 1970-01-01T00:00:20Z "),
            "{}",
            condition.message
        );
    }

    fn missing() -> ConfigProblem {
        ConfigProblem::Missing {
            config: ConfigName::new("kmm", "defaults"),
            variables: vec!["HUB_ADDRESS"],
        }
    }

    #[test]
    fn the_session_state_waits_out_the_reconnect_grace() {
        let start = at(1000).0;
        let seen = |open, closed: Option<Time>, now: i64| {
            session(open, closed.as_ref(), start, at(now).0, GRACE)
        };
        assert_eq!(seen(true, None, 1001), Session::Open);
        assert_eq!(seen(false, None, 1005), Session::Unknown);
        assert_eq!(seen(false, None, 1010), Session::NoneSince(at(1000)));
        assert_eq!(
            seen(false, Some(at(1003)), 1004),
            Session::ClosedAt(at(1003)),
            "a close seen is known at once"
        );
    }

    #[test]
    fn an_open_session_is_not_degraded_and_a_closed_one_is_with_its_time() {
        let open =
            degraded_condition("spoke1", &Session::Open, None, Some(3), None, at(10)).unwrap();
        assert_eq!(
            (
                open.type_.as_str(),
                open.status.as_str(),
                open.reason.as_str()
            ),
            (DEGRADED, "False", HUB_SESSION_OPEN)
        );
        assert_eq!(open.observed_generation, Some(3));
        assert_eq!(open.last_transition_time, at(10));

        let closed = degraded_condition(
            "spoke1",
            &Session::ClosedAt(at(20)),
            None,
            Some(3),
            Some(&open),
            at(21),
        )
        .unwrap();
        assert_eq!(
            (closed.status.as_str(), closed.reason.as_str()),
            ("True", NO_HUB_SESSION)
        );
        assert!(
            closed.message.contains("since 1970-01-01T00:00:20Z"),
            "{}",
            closed.message
        );
        assert_eq!(closed.last_transition_time, at(21), "the status flipped");
    }

    #[test]
    fn the_transition_time_holds_while_the_status_does() {
        let first = degraded_condition(
            "spoke1",
            &Session::NoneSince(at(0)),
            None,
            Some(1),
            None,
            at(30),
        )
        .unwrap();
        assert!(
            first
                .message
                .contains("since at least 1970-01-01T00:00:00Z"),
            "{}",
            first.message
        );
        let incomplete = degraded_condition(
            "spoke1",
            &Session::ClosedAt(at(40)),
            Some(&missing()),
            Some(2),
            Some(&first),
            at(50),
        )
        .unwrap();
        assert_eq!(incomplete.reason, CONFIGURATION_INCOMPLETE);
        assert_eq!(incomplete.last_transition_time, at(30), "still True");
        assert!(!is_current(Some(&first), &incomplete));
        let again = degraded_condition(
            "spoke1",
            &Session::ClosedAt(at(40)),
            Some(&missing()),
            Some(2),
            Some(&incomplete),
            at(60),
        )
        .unwrap();
        assert_eq!(again, incomplete);
        assert!(is_current(Some(&incomplete), &again));
    }

    #[test]
    fn a_configuration_problem_outranks_the_session_and_names_the_adc_and_variable() {
        let condition = degraded_condition(
            "spoke1",
            &Session::Open,
            Some(&missing()),
            None,
            None,
            at(0),
        )
        .unwrap();
        assert_eq!(
            (condition.status.as_str(), condition.reason.as_str()),
            ("True", CONFIGURATION_INCOMPLETE)
        );
        assert!(
            condition
                .message
                .starts_with("AddOnDeploymentConfig kmm/defaults does not set HUB_ADDRESS"),
            "{}",
            condition.message
        );
        assert!(condition.message.contains("has an open session"));
        let early = degraded_condition(
            "spoke1",
            &Session::Unknown,
            Some(&missing()),
            None,
            None,
            at(0),
        )
        .unwrap();
        assert_eq!(early.reason, CONFIGURATION_INCOMPLETE);
    }

    #[test]
    fn nothing_is_said_before_the_hub_can_tell_and_an_earlier_hubs_knowledge_is_kept() {
        assert_eq!(
            degraded_condition("spoke1", &Session::Unknown, None, None, None, at(0)),
            None
        );
        let earlier =
            degraded_condition("spoke1", &Session::ClosedAt(at(5)), None, None, None, at(6))
                .unwrap();
        let now = degraded_condition(
            "spoke1",
            &Session::NoneSince(at(100)),
            None,
            None,
            Some(&earlier),
            at(200),
        )
        .unwrap();
        assert_eq!(now.message, earlier.message);
        assert_eq!(now.last_transition_time, at(6));
        assert!(is_current(Some(&earlier), &now));
    }
}
