//! The validating webhook behind the real hub apiserver: a ValidatingWebhookConfiguration
//! scoped to this test's modules (objectSelector) points at the test hub, which injects
//! its CA; every invalid spec is refused at create with its field path, nothing is stored,
//! valid upstream examples pass, and with the hub down writes fail closed.

use k8s_openapi::api::admissionregistration::v1::ValidatingWebhookConfiguration;
use kmm_api::ManagedClusterModule;
use kmm_api::testing::ModuleBuilder;
use kube::api::{ApiResource, DeleteParams, DynamicObject, PostParams};
use kube::{Api, Client};
use serde_json::{Value, json};

use crate::support::*;

/// A valid module spec every table row breaks in one way.
fn valid_spec() -> Value {
    json!({
        "selector": {},
        "moduleLoader": {"container": {
            "modprobe": {"moduleName": "m", "dirName": "/opt"},
            "kernelMappings": [{"regexp": "^.+$", "containerImage": "r.example/m:${KERNEL_FULL_VERSION}"}],
        }},
    })
}

type Breakage = fn(&mut Value);

const C: &str = "spec.moduleSpec.moduleLoader.container";
fn no_cluster() -> Value {
    json!({"test.kmm.sigs.x-k8s.io/no-cluster": "x"})
}

/// (what is wrong, how, the field path the refusal must name).
fn invalid_specs() -> Vec<(&'static str, Breakage, String)> {
    fn container(m: &mut Value) -> &mut Value {
        &mut m["spec"]["moduleSpec"]["moduleLoader"]["container"]
    }
    fn mapping(m: &mut Value) -> &mut Value {
        &mut container(m)["kernelMappings"][0]
    }
    let km = format!("{C}.kernelMappings[0]");
    let mp = format!("{C}.modprobe");
    vec![
        (
            "regexp does not compile",
            |m| mapping(m)["regexp"] = json!("("),
            format!("{km}.regexp"),
        ),
        (
            "regexp uses syntax Go lacks",
            |m| mapping(m)["regexp"] = json!("^6(?=\\.1)"),
            format!("{km}.regexp"),
        ),
        (
            "literal and regexp together",
            |m| mapping(m)["literal"] = json!("6.1.0"),
            km.clone(),
        ),
        (
            "neither literal nor regexp",
            |m| {
                mapping(m).as_object_mut().unwrap().remove("regexp");
            },
            km.clone(),
        ),
        (
            "image neither tagged nor pinned",
            |m| mapping(m)["containerImage"] = json!("r.example/m"),
            format!("{km}.containerImage"),
        ),
        (
            "unknown variable",
            |m| mapping(m)["containerImage"] = json!("r.example/m:${NOT_A_VARIABLE}"),
            format!("{km}.containerImage"),
        ),
        (
            "unterminated variable",
            |m| mapping(m)["containerImage"] = json!("r.example/m:${KERNEL_X"),
            format!("{km}.containerImage"),
        ),
        (
            "not an image reference",
            |m| mapping(m)["containerImage"] = json!("r.example/UPPER:v1"),
            format!("{km}.containerImage"),
        ),
        (
            "no image at all",
            |m| {
                mapping(m).as_object_mut().unwrap().remove("containerImage");
            },
            format!("{km}.containerImage"),
        ),
        (
            "rawArgs beside moduleName",
            |m| container(m)["modprobe"]["rawArgs"] = json!({"load": ["x"]}),
            // The CRD's own rule refuses it before the webhook, naming the parent.
            mp.clone(),
        ),
        (
            "no moduleName and half rawArgs",
            |m| container(m)["modprobe"] = json!({"rawArgs": {"load": ["x"]}}),
            mp.clone(),
        ),
        (
            "loading order not led by moduleName",
            |m| container(m)["modprobe"]["modulesLoadingOrder"] = json!(["dep", "m"]),
            mp.clone(),
        ),
        (
            "loading order repeats a module",
            |m| container(m)["modprobe"]["modulesLoadingOrder"] = json!(["m", "dep", "dep"]),
            format!("{mp}.modulesLoadingOrder[2]"),
        ),
        (
            "loading order of one module",
            |m| container(m)["modprobe"]["modulesLoadingOrder"] = json!(["m"]),
            format!("{mp}.modulesLoadingOrder"),
        ),
        (
            "file to sign outside dirName",
            |m| container(m)["sign"] = json!({"keySecret": {"name": "k"}, "certSecret": {"name": "c"}, "filesToSign": ["/etc/evil.ko"]}),
            format!("{C}.sign.filesToSign[0]"),
        ),
        (
            "file to sign escaping dirName",
            |m| container(m)["sign"] = json!({"keySecret": {"name": "k"}, "certSecret": {"name": "c"}, "filesToSign": ["/opt/../etc/evil.ko"]}),
            format!("{C}.sign.filesToSign[0]"),
        ),
        (
            "both in-tree removal fields",
            |m| {
                container(m)["inTreeModuleToRemove"] = json!("a");
                container(m)["inTreeModulesToRemove"] = json!(["b"]);
            },
            C.to_owned(),
        ),
        (
            "version not a label value",
            |m| container(m)["version"] = json!("not a label value!"),
            format!("{C}.version"),
        ),
        (
            "toleration without key not Exists",
            |m| {
                m["spec"]["moduleSpec"]["tolerations"] =
                    json!([{"operator": "Equal", "value": "x"}])
            },
            "spec.moduleSpec.tolerations[0].operator".into(),
        ),
        (
            "tolerationSeconds without NoExecute",
            |m| {
                m["spec"]["moduleSpec"]["tolerations"] =
                    json!([{"key": "k", "operator": "Exists", "tolerationSeconds": 5}])
            },
            "spec.moduleSpec.tolerations[0].tolerationSeconds".into(),
        ),
        (
            "name and namespace too long for node labels",
            |m| {
                m["spec"]["spokeNamespace"] =
                    json!("a-spoke-namespace-far-too-long-for-labels-of-nodes")
            },
            "metadata.name".into(),
        ),
        (
            "spoke namespace not a DNS label",
            |m| m["spec"]["spokeNamespace"] = json!("Bad_NS"),
            "spec.spokeNamespace".into(),
        ),
        (
            "unknown rollout strategy type",
            |m| m["spec"]["rolloutStrategy"] = json!({"type": "Sometimes"}),
            "spec.rolloutStrategy.type".into(),
        ),
        (
            "maxFailures over 100%",
            |m| {
                m["spec"]["rolloutStrategy"] =
                    json!({"type": "Progressive", "progressive": {"maxFailures": "150%"}})
            },
            "spec.rolloutStrategy.progressive.maxFailures".into(),
        ),
        (
            "negative maxUnavailable",
            |m| m["spec"]["nodeUpgrade"] = json!({"maxUnavailable": -1}),
            "spec.nodeUpgrade.maxUnavailable".into(),
        ),
        (
            "a Placement that does not exist",
            |m| {
                m["spec"]["placementRefs"] =
                    json!([{"namespace": "default", "name": "kmm-no-such-placement"}])
            },
            "spec.placementRefs[0]".into(),
        ),
        (
            "decision groups without a Placement",
            |m| m["spec"]["rolloutStrategy"] = json!({"type": "ProgressivePerGroup"}),
            "spec.rolloutStrategy.type".into(),
        ),
    ]
}

fn module(name: &str, hub_label: &str, spec: Value) -> Value {
    ModuleBuilder::new(name)
        .without("/metadata/generation")
        .labels(&[("test.kmm.sigs.x-k8s.io/hub", hub_label)])
        .spoke_namespace("kmm-test")
        // Selecting no cluster: a deletion needs no unload.
        .with("/spec/selector", no_cluster())
        .module_spec(spec)
        .json()
}

/// Creates the object as written: some rows break the types themselves.
async fn create(
    api: &Api<ManagedClusterModule>,
    object: Value,
) -> Result<DynamicObject, kube::Error> {
    let raw: Api<DynamicObject> = Api::all_with(
        api.clone().into_client(),
        &ApiResource::erase::<ManagedClusterModule>(&()),
    );
    let object: DynamicObject = serde_json::from_value(object).expect("an object");
    raw.create(&PostParams::default(), &object).await
}

/// The webhook configuration of one test: only modules labelled for its hub go through it.
async fn register_webhook(
    client: &Client,
    name: &str,
    hub: &TestHub,
) -> Api<ValidatingWebhookConfiguration> {
    let api: Api<ValidatingWebhookConfiguration> = Api::all(client.clone());
    let addr = hub.webhook_addr.expect("the hub serves the webhook");
    let configuration: ValidatingWebhookConfiguration = serde_json::from_value(json!({
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingWebhookConfiguration",
        "metadata": {"name": name},
        "webhooks": [{
            "name": "validate.managedclustermodules.hub.kmm.sigs.x-k8s.io",
            "admissionReviewVersions": ["v1"],
            "sideEffects": "None",
            "failurePolicy": "Fail",
            "timeoutSeconds": 5,
            "clientConfig": {"url": format!("https://{addr}/validate-managedclustermodule")},
            "objectSelector": {"matchLabels": {"test.kmm.sigs.x-k8s.io/hub": hub.namespace}},
            "rules": [{
                "apiGroups": ["hub.kmm.sigs.x-k8s.io"],
                "apiVersions": ["*"],
                "operations": ["CREATE", "UPDATE"],
                "resources": ["managedclustermodules"],
                "scope": "Cluster",
            }],
        }],
    }))
    .unwrap();
    api.create(&PostParams::default(), &configuration)
        .await
        .expect("the webhook configuration is created");
    api
}

#[tokio::test]
async fn invalid_modules_are_refused_at_admission_naming_the_field() {
    let fleet = fleet().await;
    let namespace = kmm_e2e::fixture::TempNamespace::create(&fleet.hub, "kmm-hub-test")
        .await
        .unwrap();
    let configuration_name = format!("{}-webhook", namespace.name);
    let hub = TestHub::start_with(
        &fleet,
        &namespace.name,
        WAIT,
        HubOptions {
            webhook_configuration: Some(configuration_name.clone()),
            ..HubOptions::default()
        },
    )
    .await;
    let configurations = register_webhook(&fleet.hub, &configuration_name, &hub).await;
    let ca = hub.ca_secret().await.data.unwrap()["tls.crt"].0.clone();
    kmm_e2e::fixture::wait_until("the hub injects its CA into caBundle", WAIT, || async {
        let c = configurations
            .get(&configuration_name)
            .await
            .map_err(|e| e.to_string())?;
        let bundle = c.webhooks.unwrap()[0].client_config.ca_bundle.clone();
        (bundle.as_ref().map(|b| &b.0) == Some(&ca))
            .then_some(())
            .ok_or(format!("{bundle:?}"))
    })
    .await
    .unwrap();

    let api = hub.modules();
    let suffix = &namespace.name[namespace.name.len() - 5..];
    let table = invalid_specs();
    assert!(table.len() >= 15);
    // Rules the CRD's schema also states are refused by the apiserver before the webhook.
    let mut by_webhook = 0;
    for (i, (what, breakage, field)) in table.into_iter().enumerate() {
        let name = format!("adm-{suffix}-{i}");
        let mut object = module(&name, &namespace.name, valid_spec());
        breakage(&mut object);
        match create(&api, object).await {
            Err(kube::Error::Api(status)) => {
                assert!(
                    status.message.contains(&field),
                    "{what}: the refusal names {field}: {}",
                    status.message
                );
                assert!(
                    status.code == 422 || status.code == 400,
                    "{what}: {status:?}"
                );
                if status.message.contains("denied the request") {
                    by_webhook += 1;
                }
            }
            other => panic!("{what}: expected a refusal naming {field}, got {other:?}"),
        }
        assert!(
            api.get_opt(&name).await.unwrap().is_none(),
            "{what}: nothing is stored"
        );
    }

    // Every problem at once, in one refusal.
    let mut object = module(&format!("adm-{suffix}-many"), &namespace.name, valid_spec());
    object["spec"]["moduleSpec"]["moduleLoader"]["container"]["kernelMappings"][0] =
        json!({"regexp": "(", "containerImage": "r.example/m"});
    let Err(kube::Error::Api(status)) = create(&api, object).await else {
        panic!("two problems are refused")
    };
    assert!(
        status.message.contains("(2 problems)"),
        "{}",
        status.message
    );

    // Valid modules, including the upstream-shaped examples, pass; an update that breaks
    // one is refused and leaves it as it was.
    let mut valid = Vec::new();
    for example in [
        "docs/examples/kmm-hello.yaml",
        "docs/examples/local-fleet.yaml",
    ] {
        let text = std::fs::read_to_string(format!("{}/../{example}", env!("CARGO_MANIFEST_DIR")))
            .unwrap();
        let mut object: Value = serde_yaml_ng::from_str(&text).unwrap();
        let name = format!("adm-{suffix}-{}", valid.len());
        object["metadata"] =
            json!({"name": name, "labels": {"test.kmm.sigs.x-k8s.io/hub": namespace.name}});
        object["spec"]["selector"] = no_cluster();
        create(&api, object)
            .await
            .unwrap_or_else(|e| panic!("{example} is admitted: {e}"));
        valid.push(name);
    }
    // The hub adds its finalizer and writes status meanwhile: an update made on an older
    // version is refused as a conflict before admission sees it, so update the latest.
    let (before, refused) =
        kmm_e2e::fixture::wait_until("an update that reaches admission", WAIT, || async {
            let mut stored = api.get(&valid[0]).await.map_err(|e| e.to_string())?;
            let before = stored.spec.clone();
            stored.spec.spoke_namespace = "Bad_NS".into();
            match api
                .replace(&valid[0], &PostParams::default(), &stored)
                .await
            {
                Err(kube::Error::Api(s)) if s.code == 409 => Err(s.message),
                refused => Ok((before, refused)),
            }
        })
        .await
        .unwrap();
    assert!(
        matches!(refused, Err(kube::Error::Api(ref s)) if s.message.contains("spec.spokeNamespace")),
        "{refused:?}"
    );
    assert_eq!(api.get(&valid[0]).await.unwrap().spec, before);

    let reviews = hub.metrics.admission_reviews.clone();
    let refused = reviews
        .get_or_create(&kmm_hub::serve::metrics::AdmissionLabels {
            decision: "refused",
        })
        .get();
    // The table's and the two-problem create's (the update breaks a rule the CRD's
    // pattern states too).
    assert_eq!(refused, by_webhook + 1, "refusals counted by the hub");
    assert!(by_webhook >= 10, "the webhook itself refused {by_webhook}");

    for name in &valid {
        api.delete(name, &DeleteParams::default()).await.unwrap();
    }
    kmm_e2e::fixture::wait_until("the valid modules are gone", WAIT, || async {
        for name in &valid {
            if api
                .get_opt(name)
                .await
                .map_err(|e| e.to_string())?
                .is_some()
            {
                return Err(format!("{name} is still there"));
            }
        }
        Ok(())
    })
    .await
    .unwrap();

    // With no hub answering, writes fail closed.
    hub.stop().await;
    let object = module(
        &format!("adm-{suffix}-closed"),
        &namespace.name,
        valid_spec(),
    );
    match create(&api, object).await {
        Err(kube::Error::Api(status)) => assert!(
            status.message.contains("failed calling webhook"),
            "the apiserver says why: {}",
            status.message
        ),
        other => panic!("a create with the webhook down fails closed, got {other:?}"),
    }

    configurations
        .delete(&configuration_name, &DeleteParams::default())
        .await
        .unwrap();
}
