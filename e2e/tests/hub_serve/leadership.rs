//! Two replicas and one Lease: one leads (reconciles, writes status), the other stands by
//! ready and says so; when the leader stops, the standby takes over within the lease
//! duration and a spec change made meanwhile converges.

use std::time::Instant;

use k8s_openapi::api::coordination::v1::Lease;
use kube::Api;
use kube::api::{Patch, PatchParams};
use serde_json::json;

use crate::support::*;

fn options(identity: &str) -> HubOptions {
    HubOptions {
        leader_identity: Some(identity.to_owned()),
        ..HubOptions::default()
    }
}

async fn holder(leases: &Api<Lease>) -> Result<String, String> {
    leases
        .get_opt("kmm-hub")
        .await
        .map_err(|e| e.to_string())?
        .and_then(|l| l.spec?.holder_identity)
        .ok_or_else(|| "no holder".to_owned())
}

#[tokio::test]
async fn one_replica_leads_and_the_other_takes_over_when_it_stops() {
    let fleet = fleet().await;
    let namespace = kmm_e2e::fixture::TempNamespace::create(&fleet.hub, "kmm-hub-test")
        .await
        .unwrap();
    let (first, second) = tokio::join!(
        TestHub::start_with(&fleet, &namespace.name, WAIT, options("replica-a")),
        TestHub::start_with(&fleet, &namespace.name, WAIT, options("replica-b")),
    );
    let leases: Api<Lease> = Api::namespaced(fleet.hub.clone(), &namespace.name);
    let leader_identity =
        kmm_e2e::fixture::wait_until("a replica holds the Lease", WAIT, || holder(&leases))
            .await
            .unwrap();
    let (leader, standby) = if leader_identity == "replica-a" {
        (first, second)
    } else {
        (second, first)
    };
    kmm_e2e::fixture::wait_until(
        "the leader is ready and the standby says it stands by",
        WAIT,
        || async {
            let states = (
                leader.metrics.leader.get(),
                standby.metrics.leader.get(),
                standby.health.is_ready(),
            );
            let ended = (leader.ended(), standby.ended());
            (states == (1, 0, true)).then_some(()).ok_or(format!(
                "leader, standby, standby ready: {states:?}; runs ended: {ended:?}"
            ))
        },
    )
    .await
    .unwrap();

    // Only the leader reconciles: the module gets its status.
    let name = format!("lead-{}", &namespace.name[namespace.name.len() - 5..]);
    leader.create_module(&name, module("1", None)).await;
    leader
        .wait_module(&name, "status for generation 1", WAIT, |m| {
            let observed = m.and_then(|m| m.status?.observed_generation);
            (observed == Some(1))
                .then_some(())
                .ok_or(format!("observedGeneration {observed:?}"))
        })
        .await;

    // The leader goes; the standby takes over at once (the Lease is released, not left
    // to expire), and a spec change made during the handover converges.
    let stopped = Instant::now();
    leader.stop().await;
    standby.set_version(&name, "2").await;
    kmm_e2e::fixture::wait_until("the standby leads", LEASE_DURATION, || async {
        let holder = holder(&leases).await?;
        (standby.metrics.leader.get() == 1 && holder != leader_identity)
            .then_some(())
            .ok_or(format!("holder {holder}"))
    })
    .await
    .unwrap();
    println!(
        "leadership: handover after a graceful stop took {:?}",
        stopped.elapsed()
    );
    standby
        .wait_module(&name, "status for generation 2", WAIT, |m| {
            let observed = m.and_then(|m| m.status?.observed_generation);
            (observed == Some(2))
                .then_some(())
                .ok_or(format!("observedGeneration {observed:?}"))
        })
        .await;
    standby.clean_up(namespace, &[&name], &[]).await;
}

/// Replicas that start together race for a Lease nobody holds. Server-side apply must
/// refuse all but one: when each replica wrote as the same field manager, the last write
/// won and both led for a renewal period. One race shows it rarely, so many run at once.
#[tokio::test]
async fn replicas_racing_for_a_free_lease_never_both_lead() {
    use kmm_hub::serve::leadership::{Election, LeaderElection};

    const LEASES: usize = 20;
    const REPLICAS: usize = 3;
    let fleet = fleet().await;
    let namespace = kmm_e2e::fixture::TempNamespace::create(&fleet.hub, "kmm-hub-test")
        .await
        .unwrap();
    let leases: Api<Lease> = Api::namespaced(fleet.hub.clone(), &namespace.name);
    let mut contenders = Vec::new();
    for lease in 0..LEASES {
        // An existing, free Lease: the replicas reach their first claim at once.
        let name = format!("race-{lease}");
        let free: Lease = serde_json::from_value(json!({"metadata": {"name": name}})).unwrap();
        leases.create(&Default::default(), &free).await.unwrap();
        contenders.extend((0..REPLICAS).map(|replica| LeaderElection {
            lease: name.clone(),
            identity: format!("replica-{replica}"),
            duration: LEASE_DURATION,
            renew_before: LEASE_DURATION * 2 / 3,
            pod: None,
        }));
    }
    let elections = futures::future::join_all(
        contenders
            .iter()
            .map(|settings| Election::join(&fleet.hub, &namespace.name, settings)),
    )
    .await;
    // A loser may only win once the winner's Lease lapses, a full duration away; a
    // doubly granted Lease shows within milliseconds.
    let outcomes = futures::future::join_all(elections.into_iter().map(|election| async {
        let mut election = election.unwrap();
        let won = tokio::time::timeout(LEASE_DURATION / 6, election.won()).await;
        (won.is_ok_and(|won| won.is_ok()), election)
    }))
    .await;
    let mut winners = vec![Vec::new(); LEASES];
    for ((won, _), settings) in outcomes.iter().zip(&contenders) {
        if *won {
            let lease: usize = settings.lease["race-".len()..].parse().unwrap();
            winners[lease].push(settings.identity.clone());
        }
    }
    for (lease, winners) in winners.iter().enumerate() {
        assert_eq!(winners.len(), 1, "Lease race-{lease} is led by {winners:?}");
    }
    futures::future::join_all(outcomes.into_iter().map(|(_, election)| election.resign())).await;
    namespace.delete().await.unwrap();
}

/// A leader that lost its Lease while cut off (another replica took it) and then resigns
/// must leave the new holder alone: its view still says it holds the Lease, and an
/// unconditional release would hand the fleet to nobody or, with a third replica, to two.
#[tokio::test]
async fn a_late_release_leaves_the_new_holder_alone() {
    use kmm_hub::serve::leadership::{Election, LeaderElection, Released, release};

    let fleet = fleet().await;
    let namespace = kmm_e2e::fixture::TempNamespace::create(&fleet.hub, "kmm-hub-test")
        .await
        .unwrap();
    let leases: Api<Lease> = Api::namespaced(fleet.hub.clone(), &namespace.name);
    let settings = LeaderElection {
        lease: "kmm-hub".into(),
        identity: "replica-a".into(),
        duration: LEASE_DURATION,
        renew_before: LEASE_DURATION * 2 / 3,
        pod: None,
    };
    let mut election = Election::join(&fleet.hub, &namespace.name, &settings)
        .await
        .unwrap();
    election.won().await.unwrap();
    // Another replica takes the Lease behind the leader's back, as after a cut.
    let taken = json!({"spec": {"holderIdentity": "replica-b"}});
    leases
        .patch("kmm-hub", &PatchParams::default(), &Patch::Merge(&taken))
        .await
        .unwrap();
    election.resign().await;
    assert_eq!(holder(&leases).await.as_deref(), Ok("replica-b"));
    assert_eq!(
        release(&leases, "kmm-hub", "replica-a").await.unwrap(),
        Released::HeldByOther
    );
    assert_eq!(
        release(&leases, "kmm-hub", "replica-b").await.unwrap(),
        Released::Yes
    );
    assert_eq!(holder(&leases).await, Err("no holder".to_owned()));
    namespace.delete().await.unwrap();
}
