//! A spoke's own AddOnDeploymentConfig for a test: the fleet's variables with some of
//! them changed, and back to the fleet's config afterwards.

use anyhow::{Context, Result};
use k8s_openapi::api::apps::v1::Deployment;
use kmm_api::ocm::ADD_ON_DEPLOYMENT_CONFIG;
use kmm_e2e::fixture::{Fleet, wait_until};
use kmm_e2e::fleet::kmm::{self as fleet_kmm, ADDON, SPOKE_NAMESPACE};
use kube::api::{DeleteParams, DynamicObject, Patch, PatchParams, PostParams};
use kube::{Api, Client};
use serde_json::{Value, json};

use super::{HUB_NAMESPACE, WAIT, unique};

/// Creates a config in `spoke`'s namespace on the hub holding the fleet's variables with
/// `variable` set to `value`, and makes the spoke's add-on use it. Returns its name.
pub async fn use_own_config(
    fleet: &Fleet,
    spoke: &str,
    variable: &str,
    value: &str,
) -> Result<String> {
    use_own_config_with(fleet, spoke, &[(variable, value)]).await
}

/// [`use_own_config`] with each of `settings` (variable, value) set; named after the
/// first variable.
pub async fn use_own_config_with(
    fleet: &Fleet,
    spoke: &str,
    settings: &[(&str, &str)],
) -> Result<String> {
    use_own_config_full(fleet, spoke, settings, Value::Null).await
}

/// [`use_own_config_with`], with OCM's image mirrors `registries` too (`null`: none).
pub async fn use_own_config_full(
    fleet: &Fleet,
    spoke: &str,
    settings: &[(&str, &str)],
    registries: Value,
) -> Result<String> {
    let variable = settings.first().map_or("registries", |(name, _)| name);
    let resource = ADD_ON_DEPLOYMENT_CONFIG.api_resource();
    let default =
        Api::<DynamicObject>::namespaced_with(fleet.hub.clone(), HUB_NAMESPACE, &resource)
            .get(ADDON)
            .await?;
    let variables: Vec<Value> = default.data["spec"]["customizedVariables"]
        .as_array()
        .context("the default config's variables")?
        .iter()
        .filter(|v| !settings.iter().any(|(name, _)| v["name"] == *name))
        .cloned()
        .chain(
            settings
                .iter()
                .map(|(name, value)| json!({"name": name, "value": value})),
        )
        .collect();
    let own = unique(&format!(
        "kmm-{}",
        variable.to_lowercase().replace('_', "-")
    ));
    Api::<DynamicObject>::namespaced_with(fleet.hub.clone(), spoke, &resource)
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({
                "apiVersion": ADD_ON_DEPLOYMENT_CONFIG.api_version(),
                "kind": ADD_ON_DEPLOYMENT_CONFIG.kind,
                "metadata": {"name": own, "namespace": spoke},
                "spec": {
                    "agentInstallNamespace": default.data["spec"]["agentInstallNamespace"],
                    "customizedVariables": variables,
                    "registries": registries,
                },
            }))?,
        )
        .await?;
    set_configs(
        &fleet.hub,
        spoke,
        json!([{
            "group": ADD_ON_DEPLOYMENT_CONFIG.group,
            "resource": ADD_ON_DEPLOYMENT_CONFIG.plural,
            "namespace": spoke,
            "name": own,
        }]),
    )
    .await?;
    Ok(own)
}

/// Makes `spoke`'s add-on use the fleet's config again.
pub async fn use_fleet_config(hub: &Client, spoke: &str) -> Result<()> {
    set_configs(hub, spoke, Value::Null).await
}

/// Deletes a config [`use_own_config`] made, once the add-on no longer uses it.
pub async fn delete_own_config(hub: &Client, spoke: &str, name: &str) -> Result<()> {
    Api::<DynamicObject>::namespaced_with(
        hub.clone(),
        spoke,
        &ADD_ON_DEPLOYMENT_CONFIG.api_resource(),
    )
    .delete(name, &DeleteParams::default())
    .await?;
    Ok(())
}

async fn set_configs(hub: &Client, spoke: &str, configs: Value) -> Result<()> {
    fleet_kmm::addons(hub, spoke)
        .patch(
            ADDON,
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"configs": configs}})),
        )
        .await?;
    Ok(())
}

/// Waits until the spoke's proxy runs with `--cluster-pull-secret=<secret>` (empty:
/// none), rolled out and ready.
pub async fn wait_proxy_pull_secret(spoke: &Client, secret: &str) -> Result<()> {
    let wanted = format!("--cluster-pull-secret={secret}");
    let deployments = Api::<Deployment>::namespaced(spoke.clone(), SPOKE_NAMESPACE);
    wait_until(&format!("the proxy with {wanted}"), WAIT, || async {
        let deployment = deployments
            .get("kmm-spoke-proxy")
            .await
            .map_err(|e| e.to_string())?;
        let args = deployment
            .spec
            .as_ref()
            .and_then(|s| s.template.spec.as_ref())
            .and_then(|p| p.containers[0].args.clone())
            .unwrap_or_default();
        let status = deployment.status.clone().unwrap_or_default();
        let rolled = status.observed_generation == deployment.metadata.generation
            && status.updated_replicas == Some(1)
            && status.ready_replicas == Some(1)
            && status.replicas == Some(1);
        if args.contains(&wanted) && rolled {
            Ok(())
        } else {
            Err(format!("args {args:?}; {status:?}"))
        }
    })
    .await?;
    fleet_kmm::wait_proxy_ready(spoke, WAIT).await?;
    Ok(())
}
