use kube::core::DynamicObject;
use kube::core::admission::{AdmissionRequest, AdmissionReview};
use serde_json::{Value, json};

use kmm_api::testing::ModuleBuilder;

use super::*;

fn module(image: &str) -> Value {
    ModuleBuilder::new("kmm-hello")
        .without("/metadata/generation")
        .spoke_namespace("kmm-demo")
        .selector(&[("kmm.fleet/demo", "true")])
        .with(
            "/spec/moduleSpec/moduleLoader/container/modprobe/moduleName",
            "kmm_hello",
        )
        .kernel_mappings(json!([{"regexp": "^.+$", "containerImage": image}]))
        .json()
}

const GOOD: &str = "registry.example.com/kmm-hello:${KERNEL_FULL_VERSION}";

fn request(
    operation: &str,
    object: Option<Value>,
    old: Option<Value>,
) -> AdmissionRequest<DynamicObject> {
    let review: AdmissionReview<DynamicObject> = serde_json::from_value(json!({
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": "0b7c3a4e-1d6b-4d8e-9b1a-3c2f5e6d7a8b",
            "kind": {"group": "hub.kmm.sigs.x-k8s.io", "version": "v1beta1", "kind": "ManagedClusterModule"},
            "resource": {"group": "hub.kmm.sigs.x-k8s.io", "version": "v1beta1", "resource": "managedclustermodules"},
            "name": "kmm-hello",
            "operation": operation,
            "userInfo": {"username": "admin"},
            "object": object,
            "oldObject": old,
        },
    }))
    .expect("a well-formed review");
    review.try_into().expect("the review has a request")
}

/// The review with no Placement looked up.
fn decide(request: &AdmissionRequest<DynamicObject>) -> AdmissionResponse {
    review(request, &BTreeMap::new())
}

fn placement(name: &str) -> PlacementRef {
    PlacementRef {
        namespace: "fleet".into(),
        name: name.into(),
    }
}

#[test]
fn a_valid_module_is_allowed() {
    let response = decide(&request("CREATE", Some(module(GOOD)), None));
    assert!(response.allowed, "{:?}", response.result);
    assert_eq!(response.uid, "0b7c3a4e-1d6b-4d8e-9b1a-3c2f5e6d7a8b");
}

#[test]
fn an_invalid_create_is_refused_with_every_problem_by_path() {
    let mut object = module("registry.example.com/kmm-hello:${NOT_A_VARIABLE}");
    object["spec"]["moduleSpec"]["moduleLoader"]["container"]["kernelMappings"][0]["regexp"] =
        json!("(");
    let response = decide(&request("CREATE", Some(object), None));
    assert!(!response.allowed);
    assert_eq!(
        (response.result.code, response.result.reason.as_str()),
        (422, "Invalid")
    );
    let m = "spec.moduleSpec.moduleLoader.container.kernelMappings[0]";
    let fields: Vec<&str> = response
        .result
        .details
        .as_ref()
        .expect("causes")
        .causes
        .iter()
        .map(|c| c.field.as_str())
        .collect();
    assert_eq!(
        fields,
        [format!("{m}.regexp"), format!("{m}.containerImage")]
    );
    assert!(
        response
            .result
            .message
            .starts_with("ManagedClusterModule is invalid (2 problems): "),
        "{}",
        response.result.message
    );
    assert!(
        response.result.message.contains("NOT_A_VARIABLE"),
        "{}",
        response.result.message
    );
}

#[test]
fn a_type_error_names_its_field() {
    let mut object = module(GOOD);
    object["spec"]["selector"] = json!(["not", "a", "map"]);
    let response = decide(&request("CREATE", Some(object), None));
    assert!(!response.allowed);
    assert!(
        response.result.message.contains("spec.selector"),
        "{}",
        response.result.message
    );
}

#[test]
fn an_update_that_keeps_the_spec_is_allowed_even_if_the_spec_is_invalid() {
    let invalid = module("registry.example.com/no-tag");
    let mut labelled = invalid.clone();
    labelled["metadata"]["finalizers"] = json!(["hub.kmm.sigs.x-k8s.io/unload"]);
    assert!(decide(&request("UPDATE", Some(labelled), Some(invalid.clone()))).allowed);
    assert!(!decide(&request("UPDATE", Some(invalid), Some(module(GOOD)))).allowed);
}

#[test]
fn a_module_being_deleted_can_always_be_updated() {
    let mut deleting = module("registry.example.com/no-tag");
    deleting["metadata"]["deletionTimestamp"] = json!("2026-11-23T12:00:00Z");
    assert!(decide(&request("UPDATE", Some(deleting), Some(module(GOOD)))).allowed);
}

#[test]
fn deletes_are_never_refused() {
    assert!(
        decide(&request(
            "DELETE",
            None,
            Some(module("registry.example.com/no-tag"))
        ))
        .allowed
    );
}

#[test]
fn a_max_unavailable_below_one_node_or_out_of_percent_range_is_refused_by_field() {
    for (value, shown) in [
        (json!(-1), "-1"),
        (json!(0), "0"),
        (json!("0%"), "0%"),
        (json!("150%"), "150%"),
        (json!("two"), "two"),
    ] {
        let mut object = module(GOOD);
        object["spec"]["nodeUpgrade"] = json!({"maxUnavailable": value});
        let response = decide(&request("CREATE", Some(object), None));
        assert!(!response.allowed, "{shown} was allowed");
        let causes = response.result.details.expect("details").causes;
        assert_eq!(causes.len(), 1, "{causes:?}");
        assert_eq!(causes[0].field, "spec.nodeUpgrade.maxUnavailable");
        assert!(
            causes[0].message.starts_with(&format!("{shown:?}: ")),
            "{}",
            causes[0].message
        );
    }
    for good in [json!(1), json!(3), json!("1%"), json!("100%")] {
        let mut object = module(GOOD);
        object["spec"]["nodeUpgrade"] = json!({"maxUnavailable": good});
        let response = decide(&request("CREATE", Some(object), None));
        assert!(response.allowed, "{good} refused: {:?}", response.result);
    }
}

#[test]
fn a_bad_rollout_strategy_is_refused_by_field() {
    for (strategy, field, shown) in [
        (
            json!({"type": "Progressive", "progressive": {"maxFailures": "150%"}}),
            "spec.rolloutStrategy.progressive.maxFailures",
            "150%",
        ),
        (
            json!({"type": "Progressive", "progressive": {"maxConcurrency": 0}}),
            "spec.rolloutStrategy.progressive.maxConcurrency",
            "0",
        ),
        (
            json!({"type": "Progressive", "progressive": {"progressDeadline": "ten minutes"}}),
            "spec.rolloutStrategy.progressive.progressDeadline",
            "ten minutes",
        ),
    ] {
        let mut object = module(GOOD);
        object["spec"]["rolloutStrategy"] = strategy;
        let response = decide(&request("CREATE", Some(object), None));
        assert!(!response.allowed, "{shown} was allowed");
        let causes = response.result.details.expect("details").causes;
        assert_eq!(causes.len(), 1, "{causes:?}");
        assert_eq!(causes[0].field, field);
        assert!(
            causes[0].message.starts_with(&format!("{shown:?}: ")),
            "{}",
            causes[0].message
        );
    }
    let mut unknown = module(GOOD);
    unknown["spec"]["rolloutStrategy"] = json!({"type": "Sometimes"});
    let response = decide(&request("CREATE", Some(unknown), None));
    assert!(!response.allowed);
    let causes = response.result.details.expect("details").causes;
    assert_eq!(causes[0].field, "spec.rolloutStrategy.type", "{causes:?}");
    assert!(causes[0].message.contains("Sometimes"), "{causes:?}");
    let mut good = module(GOOD);
    good["spec"]["rolloutStrategy"] = json!({"type": "Progressive", "progressive": {
        "maxConcurrency": "25%", "maxFailures": 1, "minSuccessTime": "1m30s",
        "progressDeadline": "None"}});
    let response = decide(&request("CREATE", Some(good), None));
    assert!(response.allowed, "{:?}", response.result);
}

#[test]
fn a_missing_or_unreadable_placement_is_refused_by_field_and_only_new_ones_are_looked_up() {
    let mut object = module(GOOD);
    object["spec"]["placementRefs"] = json!([
        {"namespace": "fleet", "name": "gpu"},
        {"namespace": "fleet", "name": "gone"},
        {"namespace": "fleet", "name": "denied"},
        {"namespace": "fleet", "name": "gpu"},
    ]);
    let create = request("CREATE", Some(object.clone()), None);
    assert_eq!(
        placements_to_check(&create),
        [placement("denied"), placement("gone"), placement("gpu")]
    );
    let found = BTreeMap::from([
        (placement("gpu"), Lookup::Exists),
        (placement("gone"), Lookup::Missing),
        (placement("denied"), Lookup::Failed("forbidden".into())),
    ]);
    let response = review(&create, &found);
    assert!(!response.allowed);
    let causes = response.result.details.expect("details").causes;
    let fields: Vec<&str> = causes.iter().map(|c| c.field.as_str()).collect();
    assert_eq!(
        fields,
        [
            "spec.placementRefs[1]",
            "spec.placementRefs[2]",
            "spec.placementRefs[3]"
        ]
    );
    assert!(
        causes[0]
            .message
            .starts_with("\"fleet/gone\": no such Placement"),
        "{causes:?}"
    );
    assert!(causes[1].message.contains("forbidden"), "{causes:?}");
    assert!(causes[2].message.contains("named twice"), "{causes:?}");

    let mut before = module(GOOD);
    before["spec"]["placementRefs"] = json!([{"namespace": "fleet", "name": "gone"}]);
    let mut after = before.clone();
    after["spec"]["placementRefs"] = json!([
        {"namespace": "fleet", "name": "gone"},
        {"namespace": "fleet", "name": "gpu"},
    ]);
    let update = request("UPDATE", Some(after), Some(before));
    assert_eq!(placements_to_check(&update), [placement("gpu")]);
    let found = BTreeMap::from([(placement("gpu"), Lookup::Exists)]);
    assert!(
        review(&update, &found).allowed,
        "a Placement named before is not looked up"
    );
}

#[test]
fn decision_groups_without_placements_are_refused_by_field() {
    for (strategy, field) in [
        (
            json!({"type": "ProgressivePerGroup"}),
            "spec.rolloutStrategy.type",
        ),
        (
            json!({"type": "Progressive", "progressive": {
                "mandatoryDecisionGroups": [{"groupName": "canary"}]}}),
            "spec.rolloutStrategy.progressive.mandatoryDecisionGroups",
        ),
    ] {
        let mut object = module(GOOD);
        object["spec"]["rolloutStrategy"] = strategy.clone();
        let response = decide(&request("CREATE", Some(object.clone()), None));
        assert!(!response.allowed, "{strategy} was allowed");
        let causes = response.result.details.expect("details").causes;
        assert_eq!(causes.len(), 1, "{causes:?}");
        assert_eq!(causes[0].field, field);
        assert!(
            causes[0].message.contains("needs spec.placementRefs"),
            "{causes:?}"
        );
        object["spec"]["placementRefs"] = json!([{"namespace": "fleet", "name": "gpu"}]);
        let found = BTreeMap::from([(placement("gpu"), Lookup::Exists)]);
        let response = review(&request("CREATE", Some(object), None), &found);
        assert!(response.allowed, "{:?}", response.result);
    }
}

#[test]
fn a_module_the_types_cannot_read_can_still_be_released_once_deleted() {
    // Stored before a change of the types, it no longer parses.
    let mut unreadable = module(GOOD);
    unreadable["spec"]["selector"] = json!(["not", "a", "map"]);
    let mut released = unreadable.clone();
    released["metadata"]["deletionTimestamp"] = json!("2026-11-23T12:00:00Z");
    released["metadata"]["finalizers"] = json!([]);
    assert!(decide(&request("UPDATE", Some(released), Some(unreadable.clone()))).allowed);
    // Labelled without a spec change, likewise.
    let mut labelled = unreadable.clone();
    labelled["metadata"]["labels"] = json!({"team": "a"});
    assert!(decide(&request("UPDATE", Some(labelled), Some(unreadable))).allowed);
}

#[test]
fn a_refusal_names_the_object() {
    let response = decide(&request(
        "CREATE",
        Some(module("registry.example.com/no-tag")),
        None,
    ));
    assert!(!response.allowed);
    assert_eq!(response.result.details.expect("details").name, "kmm-hello");
}

fn with_version(version: Option<&str>) -> Value {
    let mut object = module(GOOD);
    if let Some(version) = version {
        object["spec"]["moduleSpec"]["moduleLoader"]["container"]["version"] = json!(version);
    }
    object
}

#[test]
fn an_update_may_not_switch_version_between_empty_and_set() {
    for (old, new) in [(None, Some("1")), (Some("1"), None), (Some("1"), Some(""))] {
        let response = decide(&request(
            "UPDATE",
            Some(with_version(new)),
            Some(with_version(old)),
        ));
        assert!(!response.allowed, "{old:?} -> {new:?}");
        let causes = response.result.details.unwrap().causes;
        assert_eq!(
            causes[0].field, "spec.moduleSpec.moduleLoader.container.version",
            "{old:?} -> {new:?}"
        );
    }
    for (old, new) in [(Some("1"), Some("2")), (None, None)] {
        let mut object = with_version(new);
        object["spec"]["selector"] = json!({"changed": "yes"});
        let response = decide(&request("UPDATE", Some(object), Some(with_version(old))));
        assert!(
            response.allowed,
            "{old:?} -> {new:?}: {:?}",
            response.result
        );
    }
    let created = decide(&request("CREATE", Some(with_version(Some("1"))), None));
    assert!(created.allowed);
}

#[test]
fn fields_that_do_nothing_here_are_allowed_with_a_warning_naming_them() {
    let mut object = module(GOOD);
    let spec = &mut object["spec"]["moduleSpec"];
    spec["dra"] = json!({"driver": "x"});
    spec["moduleLoader"]["serviceAccountName"] = json!("loader");
    spec["moduleLoader"]["container"]["kernelMappings"][0]["build"] = json!({
        "dockerfileConfigMap": {"name": "dockerfile"},
        "kanikoParams": {"tag": "v1"},
    });
    let response = decide(&request("CREATE", Some(object), None));
    assert!(response.allowed, "{:?}", response.result);
    let warnings = response.warnings.unwrap_or_default();
    let fields: Vec<&str> = warnings
        .iter()
        .map(|w| w.split_once(' ').unwrap().0)
        .collect();
    assert_eq!(
        fields,
        [
            "spec.moduleSpec.dra",
            "spec.moduleSpec.moduleLoader.serviceAccountName",
            "spec.moduleSpec.moduleLoader.container.kernelMappings[0].build.kanikoParams",
        ]
    );
    assert!(
        decide(&request("CREATE", Some(module(GOOD)), None))
            .warnings
            .is_none()
    );
}

/// `module(GOOD)` without its loader, running a device plugin instead.
fn plugin_only() -> Value {
    let mut object = module(GOOD);
    let spec = object["spec"]["moduleSpec"].as_object_mut().unwrap();
    spec.remove("moduleLoader");
    spec.insert(
        "devicePlugin".into(),
        json!({"container": {"image": "registry.example.com/plugin:1"}}),
    );
    object
}

#[test]
fn a_module_with_only_a_device_plugin_is_allowed_and_one_with_neither_is_refused() {
    let created = decide(&request("CREATE", Some(plugin_only()), None));
    assert!(created.allowed, "{:?}", created.result);
    let mut neither = plugin_only();
    neither["spec"]["moduleSpec"]
        .as_object_mut()
        .unwrap()
        .remove("devicePlugin");
    let refused = decide(&request("CREATE", Some(neither), None));
    assert!(!refused.allowed);
    let causes = refused.result.details.unwrap().causes;
    assert_eq!(causes.len(), 1, "{causes:?}");
    assert_eq!(causes[0].field, "spec.moduleSpec.moduleLoader");
    assert!(causes[0].message.contains("devicePlugin"), "{causes:?}");
}

#[test]
fn an_update_may_not_add_or_remove_the_loader() {
    let mut with_both = module(GOOD);
    with_both["spec"]["moduleSpec"]["devicePlugin"] =
        json!({"container": {"image": "registry.example.com/plugin:1"}});
    for (old, new, what) in [
        (with_both.clone(), plugin_only(), "removed"),
        (plugin_only(), with_both.clone(), "added"),
    ] {
        let response = decide(&request("UPDATE", Some(new), Some(old)));
        assert!(!response.allowed, "{what}");
        let causes = response.result.details.unwrap().causes;
        assert_eq!(causes.len(), 1, "{what}: {causes:?}");
        assert_eq!(causes[0].field, "spec.moduleSpec.moduleLoader", "{what}");
        assert!(causes[0].message.contains(what), "{causes:?}");
    }
    let mut moved = plugin_only();
    moved["spec"]["moduleSpec"]["devicePlugin"]["container"]["image"] =
        json!("registry.example.com/plugin:2");
    let response = decide(&request("UPDATE", Some(moved), Some(plugin_only())));
    assert!(response.allowed, "{:?}", response.result);
}
