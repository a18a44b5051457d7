//! The hub's side of its OCM add-on against the fleet's real OCM hub: each test has an
//! add-on of its own (`--addon-name`), so OCM's addon-manager resolves its configs but
//! deploys nothing: a ClusterManagementAddOn with only an AddOnDeploymentConfig as default
//! config (`installStrategy: Manual`), that config in the test's namespace, and a
//! ManagedClusterAddOn in spoke1's namespace. The hub publishes its CA into the config
//! next to the users' variables, and keeps the add-on's `Degraded` condition.

use std::time::{Duration, Instant};

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use k8s_openapi::jiff::Timestamp;
use kmm_api::ocm::{ADD_ON_DEPLOYMENT_CONFIG, CLUSTER_MANAGEMENT_ADD_ON, MANAGED_CLUSTER_ADD_ON};
use kmm_e2e::fixture::{Fleet, TempNamespace, wait_until};
use kube::api::{DeleteParams, Patch, PatchParams, PostParams};
use kube::core::DynamicObject;
use kube::{Api, ResourceExt};
use serde_json::{Value, json};

use crate::support::*;

const CLUSTER: &str = "spoke1";
const CONFIG: &str = "defaults";
/// How soon a session opening or closing shows in the condition.
const PROMPT: Duration = Duration::from_secs(5);

/// A test's add-on, its objects and its hub.
struct AddOn {
    hub: TestHub,
    namespace: TempNamespace,
    name: String,
    configs: Api<DynamicObject>,
    addons: Api<DynamicObject>,
    managements: Api<DynamicObject>,
}

impl AddOn {
    /// Creates the add-on's objects, its default config holding `variables`, and starts
    /// a hub serving it.
    async fn start(fleet: &Fleet, variables: Value) -> Self {
        let namespace = TempNamespace::create(&fleet.hub, "kmm-hub-test")
            .await
            .expect("a test namespace");
        let name = format!("kmm-test-{}", &namespace.name[namespace.name.len() - 5..]);
        let client = fleet.hub.clone();
        let configs = Api::namespaced_with(
            client.clone(),
            &namespace.name,
            &ADD_ON_DEPLOYMENT_CONFIG.api_resource(),
        );
        let addons = Api::namespaced_with(
            client.clone(),
            CLUSTER,
            &MANAGED_CLUSTER_ADD_ON.api_resource(),
        );
        let managements = Api::all_with(client.clone(), &CLUSTER_MANAGEMENT_ADD_ON.api_resource());
        let object = |value: Value| -> DynamicObject {
            serde_json::from_value(value).expect("a valid object")
        };
        configs
            .create(
                &PostParams::default(),
                &object(json!({
                    "apiVersion": ADD_ON_DEPLOYMENT_CONFIG.api_version(),
                    "kind": ADD_ON_DEPLOYMENT_CONFIG.kind,
                    "metadata": {"name": CONFIG, "namespace": namespace.name},
                    "spec": {"customizedVariables": variables},
                })),
            )
            .await
            .expect("the AddOnDeploymentConfig is created");
        managements
            .create(
                &PostParams::default(),
                &object(json!({
                    "apiVersion": CLUSTER_MANAGEMENT_ADD_ON.api_version(),
                    "kind": CLUSTER_MANAGEMENT_ADD_ON.kind,
                    "metadata": {"name": name},
                    "spec": {
                        "addOnMeta": {"displayName": "kmm-hub test add-on"},
                        "supportedConfigs": [{
                            "group": ADD_ON_DEPLOYMENT_CONFIG.group,
                            "resource": ADD_ON_DEPLOYMENT_CONFIG.plural,
                            "defaultConfig": {"name": CONFIG, "namespace": namespace.name},
                        }],
                        "installStrategy": {"type": "Manual"},
                    },
                })),
            )
            .await
            .expect("the ClusterManagementAddOn is created");
        addons
            .create(
                &PostParams::default(),
                &object(json!({
                    "apiVersion": MANAGED_CLUSTER_ADD_ON.api_version(),
                    "kind": MANAGED_CLUSTER_ADD_ON.kind,
                    "metadata": {"name": name, "namespace": CLUSTER},
                    "spec": {},
                })),
            )
            .await
            .expect("the ManagedClusterAddOn is created");
        let hub = TestHub::start_with(
            fleet,
            &namespace.name,
            WAIT,
            HubOptions {
                addon_name: Some(name.clone()),
                ..HubOptions::default()
            },
        )
        .await;
        Self {
            hub,
            namespace,
            name,
            configs,
            addons,
            managements,
        }
    }

    async fn variables(&self) -> Result<Vec<(String, String)>, String> {
        let config = self.configs.get(CONFIG).await.map_err(|e| e.to_string())?;
        let list = config.data["spec"]["customizedVariables"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        Ok(list
            .iter()
            .map(|v| {
                let text = |key: &str| v[key].as_str().unwrap_or_default().to_owned();
                (text("name"), text("value"))
            })
            .collect())
    }

    /// Waits until the config holds the hub's CA and the variables `check` wants.
    async fn wait_bundle(&self, what: &str, check: impl Fn(&[(String, String)]) -> bool) {
        let ca_pem = self.hub.ca().await.cert_pem().to_owned();
        wait_until(what, WAIT, || async {
            let variables = self.variables().await?;
            let bundle: String = (1..=4)
                .filter_map(|i| {
                    let name = format!("HUB_CA_BUNDLE_{i}");
                    variables
                        .iter()
                        .find(|(n, _)| *n == name)
                        .map(|(_, v)| v.clone())
                })
                .collect();
            let decoded = STANDARD.decode(&bundle).unwrap_or_default();
            (decoded == ca_pem.as_bytes() && check(&variables))
                .then_some(())
                .ok_or(format!("{variables:?}"))
        })
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    }

    async fn add_on(&self) -> DynamicObject {
        self.addons
            .get(&self.name)
            .await
            .expect("the ManagedClusterAddOn")
    }

    /// Waits until the add-on's `Degraded` condition satisfies `check`.
    async fn wait_degraded(
        &self,
        what: &str,
        timeout: Duration,
        check: impl Fn(&Condition) -> bool,
    ) -> Condition {
        wait_until(what, timeout, || async {
            let addon = self
                .addons
                .get(&self.name)
                .await
                .map_err(|e| e.to_string())?;
            let degraded = conditions(&addon)
                .into_iter()
                .find(|c| c.type_ == "Degraded")
                .ok_or("no Degraded condition")?;
            if check(&degraded) {
                Ok(degraded)
            } else {
                Err(format!("{degraded:?}"))
            }
        })
        .await
        .unwrap_or_else(|e| panic!("{e}"))
    }

    /// Applies `variables` as a user would, with a field manager of their own.
    async fn user_applies(&self, variables: Value) {
        let patch = json!({
            "apiVersion": ADD_ON_DEPLOYMENT_CONFIG.api_version(),
            "kind": ADD_ON_DEPLOYMENT_CONFIG.kind,
            "metadata": {"name": CONFIG, "namespace": self.namespace.name},
            "spec": {"customizedVariables": variables},
        });
        self.configs
            .patch(
                CONFIG,
                &PatchParams::apply("kmm-hub-test-user").force(),
                &Patch::Apply(&patch),
            )
            .await
            .expect("the user's apply");
    }

    /// Removes the add-on's objects and stops the hub.
    async fn clean_up(self) {
        self.hub.stop().await;
        let _ = self
            .addons
            .delete(&self.name, &DeleteParams::default())
            .await;
        // Whatever OCM's controllers added must not keep it on the shared fleet.
        if self
            .addons
            .get_opt(&self.name)
            .await
            .ok()
            .flatten()
            .is_some()
        {
            let patch = json!({"metadata": {"finalizers": null}});
            let _ = self
                .addons
                .patch(&self.name, &PatchParams::default(), &Patch::Merge(&patch))
                .await;
        }
        let _ = self
            .managements
            .delete(&self.name, &DeleteParams::default())
            .await;
        self.namespace
            .delete()
            .await
            .expect("the test namespace is deleted");
    }
}

fn conditions(addon: &DynamicObject) -> Vec<Condition> {
    serde_json::from_value(addon.data["status"]["conditions"].clone()).unwrap_or_default()
}

fn variable(name: &str, value: &str) -> Value {
    json!({"name": name, "value": value})
}

fn has(variables: &[(String, String)], name: &str, value: &str) -> bool {
    variables.iter().any(|(n, v)| n == name && v == value)
}

#[tokio::test]
async fn the_hub_ca_is_published_next_to_the_users_variables() {
    let fleet = fleet().await;
    let addon = AddOn::start(
        &fleet,
        json!([
            variable("HUB_ADDRESS", "https://kmm-hub.example:7443"),
            variable("LOG_LEVEL", "info"),
            variable("FIRMWARE_DIR", "/lib/firmware"),
            variable("USER_NOTE", "kept"),
        ]),
    )
    .await;
    addon
        .wait_bundle("the hub CA next to the user's variables", |v| {
            has(v, "USER_NOTE", "kept") && has(v, "HUB_ADDRESS", "https://kmm-hub.example:7443")
        })
        .await;
    // The hub owns its entries only.
    let config = addon.configs.get(CONFIG).await.unwrap();
    let hub_fields = config
        .managed_fields()
        .iter()
        .filter(|m| m.manager.as_deref() == Some("kmm-hub"))
        .map(|m| serde_json::to_string(&m.fields_v1).unwrap())
        .collect::<Vec<_>>()
        .join(" ");
    assert!(hub_fields.contains("HUB_CA_BUNDLE_1"), "{hub_fields}");
    assert!(!hub_fields.contains("USER_NOTE"), "{hub_fields}");
    assert!(!hub_fields.contains("HUB_ADDRESS"), "{hub_fields}");

    // A user applying their own list changes their entries and leaves the hub's.
    addon
        .user_applies(json!([
            variable("HUB_ADDRESS", "https://kmm-hub.example:7443"),
            variable("LOG_LEVEL", "debug"),
            variable("FIRMWARE_DIR", "/lib/firmware"),
            variable("USER_NOTE", "changed"),
        ]))
        .await;
    let variables = addon.variables().await.unwrap();
    assert!(has(&variables, "LOG_LEVEL", "debug"), "{variables:?}");
    assert!(
        variables.iter().any(|(n, _)| n == "HUB_CA_BUNDLE_1"),
        "{variables:?}"
    );

    // Replacing the whole list drops the hub's entries: the hub puts them back.
    let patch = json!({"spec": {"customizedVariables": [
        variable("HUB_ADDRESS", "https://kmm-hub.example:7443"),
        variable("LOG_LEVEL", "debug"),
        variable("FIRMWARE_DIR", "/lib/firmware"),
        variable("USER_NOTE", "replaced"),
    ]}});
    addon
        .configs
        .patch(CONFIG, &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .unwrap();
    addon
        .wait_bundle("the hub CA back after the list was replaced", |v| {
            has(v, "USER_NOTE", "replaced")
        })
        .await;
    addon.clean_up().await;
}

#[tokio::test]
async fn a_missing_hub_address_degrades_the_add_on_naming_the_config_and_variable() {
    let fleet = fleet().await;
    let addon = AddOn::start(&fleet, json!([variable("LOG_LEVEL", "info")])).await;
    // A condition of someone else's, which the hub's must leave alone.
    let other = json!({
        "apiVersion": MANAGED_CLUSTER_ADD_ON.api_version(),
        "kind": MANAGED_CLUSTER_ADD_ON.kind,
        "metadata": {"name": addon.name, "namespace": CLUSTER},
        "status": {"conditions": [{
            "type": "KmmHubTestOther", "status": "True", "reason": "Test", "message": "kept",
            "lastTransitionTime": Time(Timestamp::now()),
        }]},
    });
    addon
        .addons
        .patch_status(
            &addon.name,
            &PatchParams::apply("kmm-hub-test-other").force(),
            &Patch::Apply(&other),
        )
        .await
        .expect("another manager's condition");

    let incomplete = addon
        .wait_degraded("Degraded for the missing HUB_ADDRESS", WAIT, |c| {
            c.reason == "ConfigurationIncomplete"
        })
        .await;
    assert_eq!(incomplete.status, "True");
    let config = format!("{}/{CONFIG}", addon.namespace.name);
    assert!(
        incomplete.message.contains(&config),
        "{}",
        incomplete.message
    );
    assert!(
        incomplete.message.contains("HUB_ADDRESS"),
        "{}",
        incomplete.message
    );
    assert!(
        !incomplete.message.contains("LOG_LEVEL"),
        "{}",
        incomplete.message
    );
    let current = addon.add_on().await;
    assert_eq!(
        incomplete.observed_generation, current.metadata.generation,
        "{incomplete:?}"
    );
    assert!(
        conditions(&current)
            .iter()
            .any(|c| c.type_ == "KmmHubTestOther" && c.message == "kept"),
        "{:?}",
        conditions(&current)
    );

    // A firmware directory that is not a plain absolute path is named with its value.
    addon
        .user_applies(json!([
            variable("HUB_ADDRESS", "https://kmm-hub.example:7443"),
            variable("LOG_LEVEL", "info"),
            variable("FIRMWARE_DIR", "var/lib/firmware"),
        ]))
        .await;
    let invalid = addon
        .wait_degraded("Degraded for the relative FIRMWARE_DIR", WAIT, |c| {
            c.reason == "ConfigurationIncomplete" && c.message.contains("var/lib/firmware")
        })
        .await;
    assert!(
        invalid
            .message
            .contains("FIRMWARE_DIR \"var/lib/firmware\" must be an absolute path"),
        "{}",
        invalid.message
    );

    // Once set, the add-on is still degraded (no proxy), for another reason: the
    // condition's status holds, so does its transition time.
    addon
        .user_applies(json!([
            variable("HUB_ADDRESS", "https://kmm-hub.example:7443"),
            variable("LOG_LEVEL", "info"),
            variable("FIRMWARE_DIR", "/lib/firmware"),
        ]))
        .await;
    let no_session = addon
        .wait_degraded("Degraded for the missing session only", WAIT, |c| {
            c.reason == "NoHubSession"
        })
        .await;
    assert_eq!(no_session.status, "True");
    assert_eq!(
        no_session.last_transition_time,
        incomplete.last_transition_time
    );
    addon.clean_up().await;
}

#[tokio::test]
async fn a_proxy_session_clears_degraded_until_it_closes() {
    let fleet = fleet().await;
    let addon = AddOn::start(
        &fleet,
        json!([
            variable("HUB_ADDRESS", "https://kmm-hub.example:7443"),
            variable("LOG_LEVEL", "info"),
            variable("FIRMWARE_DIR", "/lib/firmware"),
        ]),
    )
    .await;
    let before = addon
        .wait_degraded("Degraded without a session", WAIT, |c| {
            c.status == "True" && c.reason == "NoHubSession"
        })
        .await;

    let opened = Instant::now();
    let mut proxy = addon.hub.proxy(CLUSTER, &[MAPPED_KERNEL]).await;
    proxy.next_snapshot().await;
    let open = addon
        .wait_degraded("not Degraded with a session", PROMPT, |c| {
            c.status == "False" && c.reason == "HubSessionOpen"
        })
        .await;
    println!(
        "add-on status: HubSessionOpen {:?} after the stream opened",
        opened.elapsed()
    );
    assert!(
        open.last_transition_time.0 >= before.last_transition_time.0,
        "{open:?} after {before:?}"
    );
    assert_eq!(
        open.observed_generation,
        addon.add_on().await.metadata.generation
    );

    let closed = Instant::now();
    drop(proxy);
    let after = addon
        .wait_degraded("Degraded again once the session closed", PROMPT, |c| {
            c.status == "True" && c.reason == "NoHubSession"
        })
        .await;
    println!(
        "add-on status: NoHubSession {:?} after the stream closed",
        closed.elapsed()
    );
    assert!(after.message.contains("since"), "{}", after.message);
    assert!(
        after.last_transition_time.0 >= open.last_transition_time.0,
        "{after:?} after {open:?}"
    );
    addon.clean_up().await;
}
