//! A cluster's own pull Secret (`CLUSTER_PULL_SECRET`) on the local fleet: a registry
//! that lets in only one user, a module that names no `imageRepoSecret` and whose kmod
//! image and device plugin image are only there. The cluster's AddOnDeploymentConfig names
//! a Secret in the add-on's namespace on the spoke; while it is missing, then malformed,
//! the node's status says so, naming it; once it is right, the real node's agent loads
//! the module with it, and the kubelet runs the plugin pulled with the proxy's copy of it
//! in the module's namespace, which goes with the plugin.
//!
//! The test changes the add-on's configuration of a whole spoke (its proxy restarts): run
//! it alone.

mod support;

use std::io::Read as _;
use std::net::IpAddr;
use std::path::PathBuf;

use anyhow::{Context, Result, ensure};
use k8s_openapi::ByteString;
use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::{Node, Secret};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kmm_e2e::fixture::{Fleet, wait_until};
use kmm_e2e::fleet::kmm::SPOKE_NAMESPACE;
use kmm_registry_fixture::RegistryServer;
use kube::api::{DeleteParams, PostParams};
use kube::{Api, Client};
use serde_json::json;
use support::*;

/// The copy of the cluster's pull Secret in a plugin's namespace
/// (`kmm_spoke_proxy::device_plugin_pull_secret::COPY`).
const COPY: &str = "kmm-device-plugin-pull-secret";
/// Pulling the plugin's image onto the node and its registration included.
const PLUGIN_WAIT: std::time::Duration = std::time::Duration::from_secs(180);

fn random_hex(bytes: usize) -> Result<String> {
    let mut buffer = vec![0u8; bytes];
    std::fs::File::open("/dev/urandom")?.read_exact(&mut buffer)?;
    Ok(buffer.iter().map(|b| format!("{b:02x}")).collect())
}

/// containerd's `hosts.toml` for `registry` on a real node: plain HTTP, as the node's
/// configuration has it for the fleet's registry. Removed on drop.
struct NodeRegistryHosts(PathBuf);

impl NodeRegistryHosts {
    fn write(node_dir: &std::path::Path, registry: &str) -> Result<Self> {
        let dir = node_dir.join("containerd/certs.d").join(registry);
        std::fs::create_dir_all(&dir)?;
        std::fs::write(
            dir.join("hosts.toml"),
            format!(
                "server = \"http://{registry}\"\n\n[host.\"http://{registry}\"]\n  capabilities = [\"pull\", \"resolve\"]\n"
            ),
        )?;
        Ok(Self(dir))
    }
}

impl Drop for NodeRegistryHosts {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

async fn put_secret(
    secrets: &Api<Secret>,
    name: &str,
    type_: &str,
    key: &str,
    value: &str,
) -> Result<()> {
    let secret = Secret {
        metadata: ObjectMeta {
            name: Some(name.to_owned()),
            ..ObjectMeta::default()
        },
        type_: Some(type_.to_owned()),
        data: Some([(key.to_owned(), ByteString(value.as_bytes().to_vec()))].into()),
        ..Secret::default()
    };
    secrets.create(&PostParams::default(), &secret).await?;
    Ok(())
}

async fn delete_secret(secrets: &Api<Secret>, name: &str) -> Result<()> {
    secrets.delete(name, &DeleteParams::default()).await?;
    wait_until(&format!("Secret {name} gone"), WAIT, || async {
        match secrets.get_opt(name).await {
            Ok(None) => Ok(()),
            other => Err(format!("{:?}", other.map(|s| s.map(|s| s.metadata.name)))),
        }
    })
    .await?;
    Ok(())
}

/// The node's allocatable count of `resource`, if it advertises it.
async fn allocatable(spoke: &Client, node: &str, resource: &str) -> Result<Option<String>> {
    let node = Api::<Node>::all(spoke.clone()).get(node).await?;
    Ok(node
        .status
        .and_then(|s| s.allocatable)
        .and_then(|a| a.get(resource).map(|q| q.0.clone())))
}

#[tokio::test]
async fn a_clusters_pull_secret_loads_a_module_and_runs_its_plugin_from_a_registry_behind_a_password()
-> Result<()> {
    let fleet = Fleet::get().await?;
    let kmm = kmm(&fleet)?;
    let spoke = fleet.spoke_names()[0].clone();
    let client = fleet.spoke(&spoke)?.clone();
    let real = real_node(&fleet, &spoke)?;
    ensure!(
        kmm.agents.iter().any(|a| a.node == real.name),
        "no agent on {}",
        real.name
    );
    ensure!(
        nodes_with_images(&fleet, &spoke)?
            .iter()
            .any(|(node, _)| *node == real.name),
        "no sample image for {}'s kernel {}",
        real.name,
        real.kernel
    );
    let gateway = fleet
        .state
        .network
        .as_ref()
        .context("the fleet has no bridge")?
        .gateway;
    let (user, password) = ("kmm-e2e-cluster", random_hex(16)?);
    let registry = RegistryServer::plain_with_auth_on(IpAddr::V4(gateway), user, &password)?;
    let _hosts = NodeRegistryHosts::write(&real.dir, &registry.address)?;

    // The sample kmod image for the real node's kernel and the sample plugin, only behind
    // the password.
    let kernel = real.kernel.clone();
    let plugin_repository = format!("{}/kmm-sample-device-plugin", kmm_images::NAMESPACE);
    copy_image(
        &format!("{}/samples/kmm-hello:{kernel}", fleet.state.registry),
        &registry,
        &format!("kmm-e2e/cluster-pull:{kernel}"),
    )
    .await?;
    copy_image(
        &format!(
            "{}/{plugin_repository}:{}",
            fleet.state.registry,
            kmm_images::VERSION
        ),
        &registry,
        &format!("{plugin_repository}:{}", kmm_images::VERSION),
    )
    .await?;

    // The cluster names a Secret that does not exist yet.
    let secret_name = unique("cluster-pull");
    let own =
        addon_config::use_own_config(&fleet, &spoke, "CLUSTER_PULL_SECRET", &secret_name).await?;
    let (id, name) = (unique("kmm-e2e.dev/cluster-pull"), unique("cluster-pull"));
    let secrets = Api::<Secret>::namespaced(client.clone(), SPOKE_NAMESPACE);
    let checked = async {
        addon_config::wait_proxy_pull_secret(&client, &secret_name).await?;
        loads_and_runs_its_plugin(&fleet, &spoke, &registry, &real, &id, &name, &secret_name).await
    }
    .await;
    // Back to the fleet's configuration whatever happened, so that other tests find it
    // (the module is gone already when all went well).
    let _ = delete(&fleet.hub, &name).await;
    let _ = label_node(&client, &real.name, &id, false).await;
    let _ = label_cluster(&fleet.hub, &spoke, &id, false).await;
    addon_config::use_fleet_config(&fleet.hub, &spoke).await?;
    addon_config::wait_proxy_pull_secret(&client, "").await?;
    addon_config::delete_own_config(&fleet.hub, &spoke, &own).await?;
    if secrets.get_opt(&secret_name).await?.is_some() {
        delete_secret(&secrets, &secret_name).await?;
    }
    checked
}

/// The module `name` (selecting `spoke` and its real node by label `id`) with no
/// `imageRepoSecret`, its kmod and plugin images in `registry`: it fails naming the
/// cluster's pull Secret `secret_name` while that is missing, then malformed, loads once
/// it is right, runs its plugin with the copy, and takes the copy with it when deleted.
async fn loads_and_runs_its_plugin(
    fleet: &Fleet,
    spoke: &str,
    registry: &RegistryServer,
    real: &kmm_e2e::fleet::nodes::RealNode,
    id: &str,
    name: &str,
    secret_name: &str,
) -> Result<()> {
    let client = fleet.spoke(spoke)?.clone();
    let kernel = &real.kernel;
    let plugin_repository = format!("{}/kmm-sample-device-plugin", kmm_images::NAMESPACE);
    let (user, password) = registry.user.clone().context("a registry with a user")?;
    let resource = format!("kmm-e2e.dev/{name}");
    label_cluster(&fleet.hub, spoke, id, true).await?;
    label_node(&client, &real.name, id, true).await?;
    let mut module = module(
        name,
        id,
        json!([{
            "literal": kernel,
            "containerImage": registry.image("kmm-e2e/cluster-pull:${KERNEL_FULL_VERSION}"),
        }]),
    )?;
    module.spec.module_spec.device_plugin = Some(serde_json::from_value(json!({
        "container": {
            "image": registry.image(&format!("{plugin_repository}:{}", kmm_images::VERSION)),
            "args": ["--resource", resource, "--devices", "2"],
        },
    }))?);
    ensure!(module.spec.module_spec.image_repo_secret.is_none());
    create(&fleet.hub, &module).await?;

    // The hub cannot look at the image: the cluster resolves it, with its own Secret.
    wait_until("the image SpokeResolved in status", WAIT, || async {
        let status = status(&fleet.hub, name).await.map_err(|e| e.to_string())?;
        let images = status["images"].clone();
        images
            .as_array()
            .into_iter()
            .flatten()
            .find(|i| i["state"] == "SpokeResolved" && i["reason"] == "ImageResolvedBySpokes")
            .map(|_| ())
            .ok_or_else(|| format!("images: {images}"))
    })
    .await?;
    let qualified = format!("{SPOKE_NAMESPACE}/{secret_name}");
    let missing = wait_failure(&fleet.hub, name, &real.name, "ClusterPullSecretNotFound").await?;
    ensure!(
        missing.contains(&qualified) && missing.contains("CLUSTER_PULL_SECRET"),
        "{missing}"
    );

    // A Secret without a Docker configuration is named with what it holds instead.
    let secrets = Api::<Secret>::namespaced(client.clone(), SPOKE_NAMESPACE);
    put_secret(&secrets, secret_name, "Opaque", "token", &password).await?;
    let malformed = wait_failure(&fleet.hub, name, &real.name, "ClusterPullSecretInvalid").await?;
    ensure!(
        malformed.contains(&qualified)
            && malformed.contains("neither .dockerconfigjson nor .dockercfg")
            && !malformed.contains(&password),
        "{malformed}"
    );
    ensure!(
        labelled(fleet, name).await?.is_empty(),
        "loaded without the cluster's credentials"
    );

    // The right Secret: the agent pulls with it and loads.
    delete_secret(&secrets, secret_name).await?;
    let docker_config = registry.docker_config_json(&user, &password);
    put_secret(
        &secrets,
        secret_name,
        "kubernetes.io/dockerconfigjson",
        ".dockerconfigjson",
        &docker_config,
    )
    .await?;
    wait_labelled(fleet, name, &[(spoke.to_owned(), real.name.clone())]).await?;

    // The plugin's Pods pull with the proxy's copy, in the module's namespace, owned by
    // the plugin's DaemonSet; the kubelet pulled and ran the plugin with it.
    let daemon_sets = Api::<DaemonSet>::namespaced(client.clone(), NAMESPACE);
    let plugin = daemon_sets.get(&format!("{name}-device-plugin")).await?;
    let pulls: Vec<String> = plugin
        .spec
        .as_ref()
        .and_then(|s| s.template.spec.as_ref())
        .and_then(|p| p.image_pull_secrets.clone())
        .unwrap_or_default()
        .into_iter()
        .map(|s| s.name)
        .collect();
    ensure!(pulls == [COPY], "imagePullSecrets {pulls:?}");
    let copies = Api::<Secret>::namespaced(client.clone(), NAMESPACE);
    let copy = wait_until("the pull Secret's copy", WAIT, || async {
        match copies.get_opt(COPY).await {
            Ok(Some(copy)) => Ok(copy),
            other => Err(format!("{:?}", other.map(|s| s.map(|s| s.metadata.name)))),
        }
    })
    .await?;
    ensure!(
        copy.type_.as_deref() == Some("kubernetes.io/dockerconfigjson")
            && copy.data.as_ref().and_then(|d| d.get(".dockerconfigjson"))
                == Some(&ByteString(docker_config.clone().into_bytes())),
        "the copy differs from the cluster's Secret"
    );
    let owners: Vec<(String, Option<String>)> = copy
        .metadata
        .owner_references
        .iter()
        .flatten()
        .map(|o| (o.kind.clone(), Some(o.uid.clone())))
        .collect();
    ensure!(
        owners == [("DaemonSet".to_owned(), plugin.metadata.uid.clone())],
        "owners {owners:?}"
    );
    wait_until(
        "the node to advertise the plugin's devices",
        PLUGIN_WAIT,
        || async {
            match allocatable(&client, &real.name, &resource).await {
                Ok(Some(count)) if count == "2" => Ok(()),
                other => Err(format!("{other:?}")),
            }
        },
    )
    .await?;

    // The module goes, its plugin goes, and the copy with it.
    delete(&fleet.hub, name).await?;
    wait_until("the plugin and the copy to go", WAIT, || async {
        let plugin = daemon_sets
            .get_opt(&format!("{name}-device-plugin"))
            .await
            .map_err(|e| e.to_string())?;
        let copy = copies.get_opt(COPY).await.map_err(|e| e.to_string())?;
        match (plugin, copy) {
            (None, None) => Ok(()),
            (plugin, copy) => Err(format!(
                "DaemonSet there: {}, copy there: {}",
                plugin.is_some(),
                copy.is_some()
            )),
        }
    })
    .await?;
    Ok(())
}
