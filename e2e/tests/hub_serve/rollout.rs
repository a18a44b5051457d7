//! Progressive rollouts: the hub gives one cluster a new spec at a time, and a restarted
//! hub serves every cluster exactly the revision its record says.

use kmm_proto::v1::{IntentSnapshot, ModuleState};
use kube::api::{Patch, PatchParams};
use serde_json::json;

use super::support::*;

const NAME: &str = "hello-waves";

fn generation(snapshot: &IntentSnapshot) -> Option<i64> {
    intent(snapshot, NAME).map(|i| i.generation)
}

#[tokio::test]
async fn a_progressive_rollout_moves_one_cluster_at_a_time_and_a_restart_moves_none() {
    let fleet = fleet().await;
    let (hub, namespace) = TestHub::start(&fleet, WAIT).await;
    for cluster in ["spoke1", "spoke2"] {
        hub.label_cluster(cluster, true).await;
    }
    let created = hub.create_module(NAME, module("1", None)).await;
    let mut one = hub.proxy("spoke1", &[MAPPED_KERNEL]).await;
    let mut two = hub.proxy("spoke2", &[MAPPED_KERNEL]).await;
    let first = created.metadata.generation;
    for (proxy, node) in [(&mut one, "spoke1-node1"), (&mut two, "spoke2-node1")] {
        proxy
            .snapshot_where("the first spec", |s| generation(s) == first)
            .await;
        proxy
            .send_status(true, vec![node_status(NAME, node, ModuleState::Loaded, "")])
            .await;
    }

    // The record of where every cluster is, written under the default strategy (All).
    hub.wait_module(NAME, "a rollout record", WAIT, |m| {
        let rollout = m.and_then(|m| m.status?.rollout).ok_or("no record")?;
        rollout
            .base_revision
            .is_some()
            .then_some(())
            .ok_or_else(|| format!("{rollout:?}"))
    })
    .await;
    let patch = json!({"spec": {
        "moduleSpec": module("2", None),
        "rolloutStrategy": {"type": "Progressive", "progressive": {"maxConcurrency": 1}},
    }});
    let changed = hub
        .modules()
        .patch(NAME, &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .expect("the spec changes");
    let second = changed.metadata.generation;
    one.snapshot_where("the new spec on the first cluster", |s| {
        generation(s) == second
    })
    .await;
    let record = hub
        .wait_module(NAME, "spoke1 released, spoke2 not", WAIT, |m| {
            let rollout = m.and_then(|m| m.status?.rollout).ok_or("no record")?;
            let released: Vec<&str> = rollout
                .clusters
                .iter()
                .map(|c| c.cluster.as_str())
                .collect();
            (released == ["spoke1"] && rollout.counts.to_apply == 1)
                .then(|| rollout.clone())
                .ok_or_else(|| format!("{rollout:?}"))
        })
        .await;
    assert_eq!(record.state, "Progressing");
    assert_eq!(record.summary, "Progressing 0/2 clusters");

    // A new hub (the old one stopped mid-rollout) serves each cluster what the record says.
    hub.stop().await;
    let hub = TestHub::start_in(&fleet, &namespace.name, WAIT).await;
    let mut two = hub.proxy("spoke2", &[MAPPED_KERNEL]).await;
    let mut one = hub.proxy("spoke1", &[MAPPED_KERNEL]).await;
    // A proxy that reported nothing yet may first get a snapshot without the module,
    // whose image the new hub has not looked at yet; the first that carries it must
    // be at the revision the record holds.
    let carries = |s: &IntentSnapshot| generation(s).is_some();
    let held = two.snapshot_where("spoke2's module", carries).await;
    assert_eq!(generation(&held), first, "spoke2 jumped ahead: {held:?}");
    let kept = one.snapshot_where("spoke1's module", carries).await;
    assert_eq!(generation(&kept), second, "spoke1 went back: {kept:?}");

    // spoke1 runs the new spec: the rollout reaches spoke2, then completes.
    two.send_status(
        true,
        vec![node_status(NAME, "spoke2-node1", ModuleState::Loaded, "")],
    )
    .await;
    one.send_status(
        true,
        vec![node_status(NAME, "spoke1-node1", ModuleState::Loaded, "")],
    )
    .await;
    two.snapshot_where("the new spec on the second cluster", |s| {
        generation(s) == second
    })
    .await;
    two.send_status(
        true,
        vec![node_status(NAME, "spoke2-node1", ModuleState::Loaded, "")],
    )
    .await;
    let done = hub
        .wait_module(NAME, "the rollout to succeed", WAIT, |m| {
            let rollout = m.and_then(|m| m.status?.rollout).ok_or("no record")?;
            (rollout.state == "Succeeded")
                .then(|| rollout.clone())
                .ok_or_else(|| format!("{rollout:?}"))
        })
        .await;
    assert!(done.clusters.is_empty(), "{done:?}");
    assert_eq!(done.base_revision.as_deref(), Some(done.revision.as_str()));
    let released = event_note(&hub.client, NAME, "RolloutReleased").await;
    assert!(released.contains("spoke"), "{released}");
    event_note(&hub.client, NAME, "RolloutSucceeded").await;
    hub.clean_up(namespace, &[NAME], &["spoke1", "spoke2"])
        .await;
}
