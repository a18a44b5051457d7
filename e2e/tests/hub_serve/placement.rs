//! `spec.placementRefs` against OCM's real placement controller: a Placement's
//! PlacementDecisions choose the module's clusters, and their decision groups are the
//! waves of a `ProgressivePerGroup` rollout.

use kmm_api::ocm::{MANAGED_CLUSTER_SET_BINDING, PLACEMENT};
use kmm_proto::v1::ModuleState;
use kube::Api;
use kube::api::{Patch, PatchParams, PostParams};
use kube::core::DynamicObject;
use serde_json::json;

use super::support::*;

const NAME: &str = "hello-placed";

async fn create(api: &Api<DynamicObject>, object: serde_json::Value) {
    let object: DynamicObject = serde_json::from_value(object).expect("an OCM object");
    api.create(&PostParams::default(), &object)
        .await
        .expect("the OCM object is created");
}

#[tokio::test]
async fn placement_decision_groups_are_waves_and_decisions_choose_the_clusters() {
    let fleet = fleet().await;
    let (hub, namespace) = TestHub::start(&fleet, WAIT).await;
    let ns = namespace.name.clone();
    // Both clusters match the module's selector; the Placement decides which are placed,
    // and puts spoke2 alone in the group `canary`.
    let placed = format!("test.kmm.sigs.x-k8s.io/{ns}-placed");
    let canary = format!("test.kmm.sigs.x-k8s.io/{ns}-canary");
    let clusters = kmm_e2e::fleet::managed_clusters(&hub.client);
    let label = |cluster: &'static str, labels: serde_json::Value| {
        let clusters = clusters.clone();
        async move {
            let patch = json!({"metadata": {"labels": labels}});
            clusters
                .patch(cluster, &PatchParams::default(), &Patch::Merge(&patch))
                .await
                .expect("the ManagedCluster is labelled");
        }
    };
    for cluster in ["spoke1", "spoke2"] {
        hub.label_cluster(cluster, true).await;
        label(cluster, json!({&placed: "yes"})).await;
    }
    label("spoke2", json!({&canary: "yes"})).await;
    let bindings: Api<DynamicObject> = Api::namespaced_with(
        hub.client.clone(),
        &ns,
        &MANAGED_CLUSTER_SET_BINDING.api_resource(),
    );
    create(
        &bindings,
        json!({
            "apiVersion": MANAGED_CLUSTER_SET_BINDING.api_version(),
            "kind": MANAGED_CLUSTER_SET_BINDING.kind,
            "metadata": {"name": "default"},
            "spec": {"clusterSet": "default"},
        }),
    )
    .await;
    let placements: Api<DynamicObject> =
        Api::namespaced_with(hub.client.clone(), &ns, &PLACEMENT.api_resource());
    create(
        &placements,
        json!({
            "apiVersion": PLACEMENT.api_version(),
            "kind": PLACEMENT.kind,
            "metadata": {"name": "waves"},
            "spec": {
                "clusterSets": ["default"],
                "predicates": [{"requiredClusterSelector": {
                    "labelSelector": {"matchLabels": {&placed: "yes"}}}}],
                "decisionStrategy": {"groupStrategy": {
                    "decisionGroups": [{
                        "groupName": "canary",
                        "groupClusterSelector": {
                            "labelSelector": {"matchLabels": {&canary: "yes"}}},
                    }],
                }},
            },
        }),
    )
    .await;

    hub.create_module_with(
        NAME,
        module("1", None),
        json!({
            "placementRefs": [{"namespace": ns, "name": "waves"}],
            "rolloutStrategy": {"type": "ProgressivePerGroup"},
        }),
    )
    .await;
    let mut one = hub.proxy("spoke1", &[MAPPED_KERNEL]).await;
    let mut two = hub.proxy("spoke2", &[MAPPED_KERNEL]).await;
    two.snapshot_where("the canary group gets the module first", |s| {
        intent(s, NAME).is_some()
    })
    .await;
    let record = hub
        .wait_module(NAME, "only the canary group released", WAIT, |m| {
            let rollout = m.and_then(|m| m.status?.rollout).ok_or("no record")?;
            (rollout.counts.total == 2 && !rollout.clusters.is_empty())
                .then(|| rollout.clone())
                .ok_or_else(|| format!("{rollout:?}"))
        })
        .await;
    let released: Vec<(&str, Option<&str>)> = record
        .clusters
        .iter()
        .map(|c| (c.cluster.as_str(), c.group.as_deref()))
        .collect();
    let canary_group = format!("{ns}/waves/canary");
    assert_eq!(released, [("spoke2", Some(canary_group.as_str()))]);
    assert_eq!(record.counts.to_apply, 1, "{record:?}");

    // The canary runs it: the next group (spoke1, group 1) follows.
    two.send_status(
        true,
        vec![node_status(NAME, "spoke2-node1", ModuleState::Loaded, "")],
    )
    .await;
    let first = one
        .snapshot_where("the second group gets the module", |s| {
            intent(s, NAME).is_some()
        })
        .await;
    assert!(!intent(&first, NAME).unwrap().unload);
    one.send_status(
        true,
        vec![node_status(NAME, "spoke1-node1", ModuleState::Loaded, "")],
    )
    .await;
    hub.wait_module(NAME, "the rollout to succeed", WAIT, |m| {
        let rollout = m.and_then(|m| m.status?.rollout).ok_or("no record")?;
        (rollout.state == "Succeeded")
            .then_some(())
            .ok_or_else(|| format!("{rollout:?}"))
    })
    .await;

    // The Placement drops spoke1 (its selector still matches): the module leaves it,
    // by an explicit unload, not by omission.
    label("spoke1", json!({&placed: null})).await;
    one.snapshot_where("spoke1 unloads once no Placement decides it", |s| {
        intent(s, NAME).is_some_and(|i| i.unload)
    })
    .await;
    hub.wait_module(NAME, "one selected cluster", WAIT, |m| {
        let status = m.and_then(|m| m.status).ok_or("no status")?;
        (status.clusters.selected == 1)
            .then_some(())
            .ok_or_else(|| format!("{:?}", status.clusters))
    })
    .await;

    label("spoke2", json!({&placed: null, &canary: null})).await;
    hub.clean_up(namespace, &[NAME], &["spoke1", "spoke2"])
        .await;
}
