//! A refused finalizer patch is never taken for done: the hub logs it, reports it as a
//! Warning Event, keeps the module in its view and retries until the patch is accepted.

use kmm_e2e::fixture::wait_until;
use kube::api::{
    Api, ApiResource, DeleteParams, DynamicObject, GroupVersionKind, Patch, PatchParams, PostParams,
};
use serde_json::json;

use crate::support::*;

fn admission_api(kind: &str, plural: &str, client: &kube::Client) -> Api<DynamicObject> {
    let gvk = GroupVersionKind::gvk("admissionregistration.k8s.io", "v1", kind);
    Api::all_with(
        client.clone(),
        &ApiResource::from_gvk_with_plural(&gvk, plural),
    )
}

#[tokio::test]
async fn a_refused_finalizer_removal_is_reported_and_retried_until_it_succeeds() {
    let fleet = fleet().await;
    let (hub, namespace) = TestHub::start(&fleet, WAIT).await;
    let module = hub.create_module("hello-keep", module("1", None)).await;
    let label = module
        .metadata
        .labels
        .clone()
        .unwrap_or_default()
        .into_iter()
        .next()
        .expect("the test hub's label");
    hub.wait_module("hello-keep", "the finalizer is set", WAIT, |m| {
        let m = m.ok_or("absent")?;
        m.metadata
            .finalizers
            .is_some_and(|f| f.iter().any(|f| f == "hub.kmm.sigs.x-k8s.io/unload"))
            .then_some(())
            .ok_or_else(|| "no finalizer".to_owned())
    })
    .await;

    // An admission policy refuses any update of this test's modules that drops the
    // hub's finalizer.
    let name = format!("keep-finalizer-{}", namespace.name);
    let policies = admission_api(
        "ValidatingAdmissionPolicy",
        "validatingadmissionpolicies",
        &fleet.hub,
    );
    let bindings = admission_api(
        "ValidatingAdmissionPolicyBinding",
        "validatingadmissionpolicybindings",
        &fleet.hub,
    );
    let keeps = "'hub.kmm.sigs.x-k8s.io/unload' in";
    let policy: DynamicObject = serde_json::from_value(json!({
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingAdmissionPolicy",
        "metadata": {"name": name},
        "spec": {
            "failurePolicy": "Fail",
            "matchConstraints": {"resourceRules": [{
                "apiGroups": ["hub.kmm.sigs.x-k8s.io"],
                "apiVersions": ["*"],
                "operations": ["UPDATE"],
                "resources": ["managedclustermodules"],
            }]},
            "validations": [{
                "expression": format!(
                    "!({keeps} oldObject.metadata.finalizers) || \
                     (has(object.metadata.finalizers) && {keeps} object.metadata.finalizers)"
                ),
                "message": "the test keeps the kmm finalizer",
            }],
        },
    }))
    .unwrap();
    policies
        .create(&PostParams::default(), &policy)
        .await
        .expect("the policy");
    let binding: DynamicObject = serde_json::from_value(json!({
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingAdmissionPolicyBinding",
        "metadata": {"name": name},
        "spec": {
            "policyName": name,
            "validationActions": ["Deny"],
            "matchResources": {"objectSelector": {"matchLabels": {label.0: label.1}}},
        },
    }))
    .unwrap();
    bindings
        .create(&PostParams::default(), &binding)
        .await
        .expect("the binding");
    // In force once a dry-run removal is refused.
    let remove = json!([{"op": "remove", "path": "/metadata/finalizers"}]);
    let remove: json_patch::Patch = serde_json::from_value(remove).unwrap();
    wait_until("the policy to be in force", WAIT, || async {
        let dry_run = PatchParams {
            dry_run: true,
            ..PatchParams::default()
        };
        match hub
            .modules()
            .patch("hello-keep", &dry_run, &Patch::<()>::Json(remove.clone()))
            .await
        {
            Err(e) if e.to_string().contains("keeps the kmm finalizer") => Ok(()),
            other => Err(format!("{other:?}")),
        }
    })
    .await
    .expect("the policy takes effect");

    // Nothing to unload: the hub wants the finalizer gone at once, and is refused.
    hub.modules()
        .delete("hello-keep", &DeleteParams::default())
        .await
        .unwrap();
    let note = event_note(&fleet.hub, "hello-keep", "FinalizerPatchFailed").await;
    assert!(
        note.contains("removing the finalizer") && note.contains("keeps the kmm finalizer"),
        "{note}"
    );
    assert!(
        hub.modules().get_opt("hello-keep").await.unwrap().is_some(),
        "the module went despite the refusal"
    );

    // The policy goes: the hub's next try succeeds.
    bindings
        .delete(&name, &DeleteParams::default())
        .await
        .unwrap();
    hub.wait_module("hello-keep", "the module is gone", WAIT, |m| match m {
        None => Ok(()),
        Some(m) => Err(format!("still there: {:?}", m.metadata.finalizers)),
    })
    .await;
    policies
        .delete(&name, &DeleteParams::default())
        .await
        .unwrap();
    hub.clean_up(namespace, &[], &[]).await;
}
