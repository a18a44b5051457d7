//! The registries of real fleets on the local fleet, with its second registry
//! (`kmm_e2e::fleet::spoke_registry`): HTTPS behind a CA of its own, basic auth, reachable
//! from the spokes and not from the hub.
//!
//! A module whose image is only there: the hub cannot check it, so the spoke's proxy
//! resolves the tag with the cluster's own pull Secret (`CLUSTER_PULL_SECRET`, item 14)
//! and CA (`REGISTRY_CA_BUNDLE_1`, item 13: no insecureSkipTLSVerify anywhere), the hub
//! pins that digest for the cluster (item 15), the real node's agent loads exactly it,
//! and moving the tag afterwards moves nothing. And a cluster's mirror (OCM's `registries`,
//! item 12), that same registry, serves the digest the hub pinned at a source behind a CA
//! only the hub trusts (`kmm-hub-registry-ca`, item 13's hub half), once the source is
//! gone.
//!
//! The test changes the add-on's configuration of a whole spoke (its proxy restarts): run
//! it alone.

mod support;

use anyhow::{Context, Result, ensure};
use base64::Engine;
use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::{ConfigMap, Pod, Secret};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kmm_api::ManagedClusterModule;
use kmm_e2e::fixture::{Fleet, wait_until};
use kmm_e2e::fleet::kmm::{self as fleet_kmm, PROXY_LABEL, SPOKE_NAMESPACE};
use kmm_e2e::fleet::nodes::RealNode;
use kmm_e2e::fleet::spoke_registry::SpokeRegistry;
use kube::api::{DeleteParams, ListParams, PostParams};
use kube::{Api, Client, ResourceExt};
use serde_json::{Value, json};
use support::*;

/// How long the kubelet may take to show a changed ConfigMap in the Pods that mount it
/// (its sync period, a minute, and its cache's).
const CONFIG_MAP_REFRESH: std::time::Duration = std::time::Duration::from_secs(90);

/// OCM caps a variable's value at 1024 characters: the CA in `REGISTRY_CA_BUNDLE_n`
/// parts.
const BUNDLE_PART: usize = 1024;

/// The spoke's add-on configured for the second registry: its CA and a pull Secret.
struct SpokeConfig {
    own: String,
    secret: String,
}

/// The `REGISTRY_CA_BUNDLE_n` variables carrying `ca_pem`.
fn ca_bundle_variables(ca_pem: &str) -> Result<Vec<(String, String)>> {
    let encoded = base64::engine::general_purpose::STANDARD.encode(ca_pem);
    let parts: Vec<String> = encoded
        .as_bytes()
        .chunks(BUNDLE_PART)
        .map(|c| String::from_utf8_lossy(c).into_owned())
        .collect();
    ensure!(parts.len() <= 4, "the CA needs {} parts", parts.len());
    Ok(parts
        .into_iter()
        .enumerate()
        .map(|(i, part)| (format!("REGISTRY_CA_BUNDLE_{}", i + 1), part))
        .collect())
}

/// Gives `spoke` the registry's CA, a pull Secret for it and the image mirrors
/// `registries` (OCM's `registries`; `null`: none), and waits until the proxy runs with
/// them and the CA reached the spoke.
async fn configure_spoke(
    fleet: &Fleet,
    spoke: &str,
    registry: &SpokeRegistry,
    registries: Value,
) -> Result<SpokeConfig> {
    let client = fleet.spoke(spoke)?.clone();
    let secret = unique("spoke-registry-pull");
    let secrets = Api::<Secret>::namespaced(client.clone(), SPOKE_NAMESPACE);
    secrets
        .create(
            &PostParams::default(),
            &Secret {
                metadata: ObjectMeta {
                    name: Some(secret.clone()),
                    ..ObjectMeta::default()
                },
                type_: Some("kubernetes.io/dockerconfigjson".into()),
                data: Some(
                    [(
                        ".dockerconfigjson".to_owned(),
                        ByteString(registry.docker_config_json().into_bytes()),
                    )]
                    .into(),
                ),
                ..Secret::default()
            },
        )
        .await?;
    let mut variables = vec![("CLUSTER_PULL_SECRET".to_owned(), secret.clone())];
    variables.extend(ca_bundle_variables(&registry.ca_pem)?);
    let settings: Vec<(&str, &str)> = variables
        .iter()
        .map(|(n, v)| (n.as_str(), v.as_str()))
        .collect();
    let own = addon_config::use_own_config_full(fleet, spoke, &settings, registries).await?;
    addon_config::wait_proxy_pull_secret(&client, &secret).await?;
    // The agents and the proxy read the bundle from this ConfigMap's volume.
    let config_maps = Api::<ConfigMap>::namespaced(client.clone(), SPOKE_NAMESPACE);
    wait_until("the registry CA on the spoke", WAIT, || async {
        let found = config_maps
            .get_opt("kmm-registry-ca")
            .await
            .map_err(|e| e.to_string())?;
        let ca = found
            .and_then(|c| c.binary_data)
            .and_then(|d| d.get("ca.crt").cloned())
            .map(|b| b.0);
        if ca.as_deref() == Some(registry.ca_pem.as_bytes()) {
            Ok(())
        } else {
            Err("kmm-registry-ca does not hold the registry's CA yet".to_owned())
        }
    })
    .await?;
    Ok(SpokeConfig { own, secret })
}

/// Back to the fleet's configuration.
async fn restore_spoke(fleet: &Fleet, spoke: &str, config: &SpokeConfig) -> Result<()> {
    let client = fleet.spoke(spoke)?.clone();
    addon_config::use_fleet_config(&fleet.hub, spoke).await?;
    addon_config::wait_proxy_pull_secret(&client, "").await?;
    addon_config::delete_own_config(&fleet.hub, spoke, &config.own).await?;
    Api::<Secret>::namespaced(client, SPOKE_NAMESPACE)
        .delete(&config.secret, &DeleteParams::default())
        .await?;
    Ok(())
}

/// The module's status entry for `image`, once `check` accepts it.
async fn image_status(
    hub: &Client,
    name: &str,
    image: &str,
    what: &str,
    check: impl Fn(&Value) -> bool,
) -> Result<Value> {
    image_status_within(hub, name, image, what, WAIT, check).await
}

/// [`image_status`], waiting `within`.
async fn image_status_within(
    hub: &Client,
    name: &str,
    image: &str,
    what: &str,
    within: std::time::Duration,
    check: impl Fn(&Value) -> bool,
) -> Result<Value> {
    Ok(wait_until(what, within, || async {
        let status = status(hub, name).await.map_err(|e| e.to_string())?;
        status["images"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|i| i["image"] == image && check(i))
            .cloned()
            .ok_or_else(|| format!("images: {}", status["images"]))
    })
    .await?)
}

/// `spoke`'s entry in a SpokeResolved image's `clusters`.
fn cluster_entry<'a>(image: &'a Value, spoke: &str) -> Option<&'a Value> {
    image["clusters"]
        .as_array()?
        .iter()
        .find(|c| c["cluster"] == spoke)
}

#[tokio::test]
async fn an_image_only_the_spokes_reach_loads_pinned_to_the_digest_the_spoke_resolved() -> Result<()>
{
    let fleet = Fleet::get().await?;
    let kmm = kmm(&fleet)?;
    let spoke = fleet.spoke_names()[0].clone();
    let real = real_node(&fleet, &spoke)?;
    ensure!(
        kmm.agents.iter().any(|a| a.node == real.name),
        "no agent on {}",
        real.name
    );
    ensure!(
        fleet.state.images.iter().any(|i| i.kernel == real.kernel),
        "no sample image for {}'s kernel {}",
        real.name,
        real.kernel
    );
    let registry = fleet.spoke_registry().await?;
    let config = configure_spoke(&fleet, &spoke, &registry, Value::Null).await?;
    let (id, name) = (unique("kmm-e2e.dev/registries"), unique("spoke-only"));
    let checked = loads_pinned(&fleet, &spoke, &registry, &real, &id, &name).await;
    // Whatever happened, the fleet as it was for the next tests.
    clean_up(&fleet, &spoke, &real, &id, &name, &config).await?;
    checked
}

/// Deletes module `name`, takes label `id` off the spoke and its real node, and gives
/// the spoke the fleet's add-on configuration back.
async fn clean_up(
    fleet: &Fleet,
    spoke: &str,
    real: &RealNode,
    id: &str,
    name: &str,
    config: &SpokeConfig,
) -> Result<()> {
    let client = fleet.spoke(spoke)?.clone();
    let _ = delete(&fleet.hub, name).await;
    let _ = wait_labelled(fleet, name, &[]).await;
    let _ = label_node(&client, &real.name, id, false).await;
    let _ = label_cluster(&fleet.hub, spoke, id, false).await;
    restore_spoke(fleet, spoke, config).await
}

/// The module `name` (selecting `spoke` and its real node by label `id`), its image only
/// in `registry` under a tag of its own: first missing, which the spoke reports; then
/// there, resolved by the spoke, pinned for it, loaded by that digest; then moved, which
/// changes nothing, not even after the proxy restarts.
async fn loads_pinned(
    fleet: &Fleet,
    spoke: &str,
    registry: &SpokeRegistry,
    real: &RealNode,
    id: &str,
    name: &str,
) -> Result<()> {
    let client = fleet.spoke(spoke)?.clone();
    let kmm = kmm(fleet)?;
    let kernel = &real.kernel;
    let tag = unique("t");
    let repository = format!("kmm-e2e/spoke-only:{tag}-${{KERNEL_FULL_VERSION}}");
    let image = registry.image(&format!("kmm-e2e/spoke-only:{tag}-{kernel}"));
    label_cluster(&fleet.hub, spoke, id, true).await?;
    label_node(&client, &real.name, id, true).await?;
    // HTTPS verified against the cluster's CA: no credentials of the module's.
    let module = verified_module(name, id, kernel, &registry.image(&repository))?;
    ensure!(module.spec.module_spec.image_repo_secret.is_none());
    create(&fleet.hub, &module).await?;

    // The hub cannot reach the registry: the spoke resolves, and says the tag is missing.
    let resolving = image_status(&fleet.hub, name, &image, "the image SpokeResolved", |i| {
        i["state"] == "SpokeResolved" && i["reason"] == "ImageResolvedBySpokes"
    })
    .await?;
    ensure!(
        resolving["digest"].is_null(),
        "no fleet-wide digest: {resolving}"
    );
    let missing = wait_failure(&fleet.hub, name, &real.name, "ImageNotFound").await?;
    ensure!(
        missing.contains(&image) && !missing.contains(&registry.password),
        "the failure names the image and no secret: {missing}"
    );
    ensure!(
        labelled(fleet, name).await?.is_empty(),
        "loaded before the tag exists"
    );

    // The tag appears: the spoke's retry resolves it, the hub pins it for the spoke.
    let sample = format!("{}/samples/kmm-hello:{kernel}", fleet.state.registry);
    let pushed = registry
        .copy_from_fleet(&sample, &format!("kmm-e2e/spoke-only:{tag}-{kernel}"))
        .await?;
    let pinned = image_status(
        &fleet.hub,
        name,
        &image,
        "the spoke's digest in status",
        |i| cluster_entry(i, spoke).is_some_and(|c| c["digest"].is_string()),
    )
    .await?;
    let listed = cluster_entry(&pinned, spoke).context("the spoke's entry")?["digest"]
        .as_str()
        .context("a digest")?
        .to_owned();
    ensure!(
        listed == pushed,
        "status pins {listed} for {spoke}, the registry serves {pushed}"
    );
    wait_labelled(fleet, name, &[(spoke.to_owned(), real.name.clone())]).await?;
    let agent = kmm
        .agents
        .iter()
        .find(|a| a.cluster == spoke && a.node == real.name)
        .context("the real node's agent")?;
    let key = format!("{NAMESPACE}/{name}");
    let loaded = loaded_digest(agent, &key).await?;
    ensure!(
        loaded == pushed,
        "the agent loaded {loaded}, the spoke pinned {pushed}"
    );

    // The tag moves to other bytes; the proxy restarts (losing what it resolved) and
    // reconnects: the cluster keeps its pin and the node what it loaded.
    let other = fleet
        .state
        .images
        .iter()
        .find(|i| i.kernel != *kernel)
        .context("a sample image of another kernel, to move the tag to")?;
    let moved = registry
        .copy_from_fleet(
            &format!(
                "{}/samples/kmm-hello:{}",
                fleet.state.registry, other.kernel
            ),
            &format!("kmm-e2e/spoke-only:{tag}-{kernel}"),
        )
        .await?;
    ensure!(moved != pushed, "the tag did not move");
    ensure!(
        registry
            .digest(&format!("kmm-e2e/spoke-only:{tag}-{kernel}"))
            .await?
            == moved
    );
    restart_proxy(&client).await?;
    wait_labelled(fleet, name, &[(spoke.to_owned(), real.name.clone())]).await?;
    let after = status(&fleet.hub, name).await?;
    let entry = after["images"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|i| i["image"] == image.as_str())
        .and_then(|i| cluster_entry(i, spoke))
        .cloned()
        .context("the image's entry after the move")?;
    ensure!(
        entry["digest"] == pushed.as_str(),
        "the pin moved with the tag: {entry}"
    );
    let loaded = loaded_digest(agent, &key).await?;
    ensure!(loaded == pushed, "the node loaded {loaded} after the move");
    Ok(())
}

/// Module `name` selecting by label `id`, loading `image` on `kernel` over verified
/// HTTPS: no `registryTLS`.
fn verified_module(
    name: &str,
    id: &str,
    kernel: &str,
    image: &str,
) -> Result<ManagedClusterModule> {
    let mut module = module(
        name,
        id,
        json!([{"literal": kernel, "containerImage": image}]),
    )?;
    module
        .spec
        .module_spec
        .module_loader
        .as_mut()
        .context("a loader")?
        .container
        .registry_tls = None;
    Ok(module)
}

/// Deletes the spoke's proxy Pod and waits for its replacement, connected to the hub.
async fn restart_proxy(spoke: &Client) -> Result<()> {
    let pods = Api::<Pod>::namespaced(spoke.clone(), SPOKE_NAMESPACE);
    let old = fleet_kmm::proxy_pod(spoke).await?;
    pods.delete(&old.name_any(), &DeleteParams::default())
        .await?;
    wait_until("a new proxy Pod", WAIT, || async {
        let listed = pods
            .list(&ListParams::default().labels(PROXY_LABEL))
            .await
            .map_err(|e| e.to_string())?;
        listed
            .items
            .iter()
            .find(|p| p.uid() != old.uid() && p.metadata.deletion_timestamp.is_none())
            .map(|_| ())
            .ok_or_else(|| "the old proxy Pod only".to_owned())
    })
    .await?;
    fleet_kmm::wait_proxy_ready(spoke, WAIT).await?;
    Ok(())
}

/// Waits until OCM renders `spoke`'s add-on with the config `own` (the hub reads a
/// cluster's mirrors from that config).
async fn wait_config_in_use(hub: &Client, spoke: &str, own: &str) -> Result<()> {
    let addons = fleet_kmm::addons(hub, spoke);
    wait_until(&format!("{spoke}'s add-on to use {own}"), WAIT, || async {
        let addon = addons
            .get(fleet_kmm::ADDON)
            .await
            .map_err(|e| e.to_string())?;
        let references = addon.data["status"]["configReferences"].clone();
        references
            .as_array()
            .into_iter()
            .flatten()
            .any(|r| r["desiredConfig"]["name"] == own || r["name"] == own)
            .then_some(())
            .ok_or_else(|| format!("configReferences: {references}"))
    })
    .await?;
    Ok(())
}

#[tokio::test]
async fn a_clusters_mirror_behind_its_own_ca_serves_the_digest_the_hub_pinned_at_the_source()
-> Result<()> {
    let fleet = Fleet::get().await?;
    // Another spoke than the other test's: both change their spoke's add-on config.
    let spoke = fleet
        .spoke_names()
        .last()
        .cloned()
        .context("the fleet has no spoke")?;
    ensure!(
        fleet.spoke_names().len() > 1,
        "this test needs a second spoke (the other test of this binary changes the first)"
    );
    let real = real_node(&fleet, &spoke)?;
    let gateway = fleet
        .state
        .network
        .as_ref()
        .context("the fleet has no bridge")?
        .gateway;
    // The source: HTTPS behind a CA of the test's own, on the bridge, which the hub
    // reaches and trusts through its registry CA bundle (item 13's hub half).
    let (ca_cert, ca_key) = kmm_registry_fixture::internal_ca("kmm-e2e source registry CA");
    let source = kmm_registry_fixture::RegistryServer::tls_issued_by_on(
        std::net::IpAddr::V4(gateway),
        &ca_cert,
        &ca_key,
    )?;
    trust_on_the_hub(&fleet.hub, Some(&ca_cert)).await?;
    let checked = async {
        let tag = unique("t");
        let path = format!("kmm-e2e/mirrored:{tag}-{}", real.kernel);
        let sample = format!("{}/samples/kmm-hello:{}", fleet.state.registry, real.kernel);
        copy_image(&sample, &source, &path).await?;
        // The mirror: the fleet's second registry, HTTPS behind a CA of its own with basic
        // auth, which only the spokes reach; the cluster trusts its CA and pulls from it
        // with the cluster's pull Secret.
        let registry = fleet.spoke_registry().await?;
        let mirrored = registry.copy_from_fleet(&sample, &path).await?;
        let registries = json!([{
            "source": format!("{}/kmm-e2e", source.address),
            "mirror": format!("{}/kmm-e2e", registry.address),
        }]);
        let config = configure_spoke(&fleet, &spoke, &registry, registries).await?;
        let (id, name) = (unique("kmm-e2e.dev/mirror"), unique("mirrored"));
        let pulled = async {
            wait_config_in_use(&fleet.hub, &spoke, &config.own).await?;
            let source = Source {
                image: source.image(&path),
                server: source,
                mirrored,
            };
            pulls_from_the_mirror(&fleet, &spoke, &real, source, &id, &name).await
        }
        .await;
        clean_up(&fleet, &spoke, &real, &id, &name, &config).await?;
        pulled
    }
    .await;
    trust_on_the_hub(&fleet.hub, None).await?;
    checked
}

/// Sets (or, with `None`, removes) the hub's registry CA bundle, the optional ConfigMap
/// `kmm-hub-registry-ca` its Pods mount.
async fn trust_on_the_hub(hub: &Client, ca_pem: Option<&str>) -> Result<()> {
    let config_maps = Api::<ConfigMap>::namespaced(hub.clone(), HUB_NAMESPACE);
    let name = "kmm-hub-registry-ca";
    let _ = config_maps.delete(name, &DeleteParams::default()).await;
    if let Some(ca_pem) = ca_pem {
        let bundle = ConfigMap {
            metadata: ObjectMeta {
                name: Some(name.to_owned()),
                ..ObjectMeta::default()
            },
            data: Some([("ca.crt".to_owned(), ca_pem.to_owned())].into()),
            ..ConfigMap::default()
        };
        config_maps.create(&PostParams::default(), &bundle).await?;
    }
    Ok(())
}

/// An image at its source registry, and the digest its mirror holds.
struct Source {
    server: kmm_registry_fixture::RegistryServer,
    image: String,
    mirrored: String,
}

/// The module `name` maps the real node's kernel to the source's image: the hub pins its
/// digest there (once its Pods see the CA: the kubelet refreshes a mounted ConfigMap
/// within about a minute), the digest the mirror holds. Then the source stops, and only
/// then is the node selected: it loads the pinned digest, which only the mirror can have
/// served.
async fn pulls_from_the_mirror(
    fleet: &Fleet,
    spoke: &str,
    real: &RealNode,
    source: Source,
    id: &str,
    name: &str,
) -> Result<()> {
    let client = fleet.spoke(spoke)?.clone();
    let Source {
        server,
        image,
        mirrored,
    } = source;
    label_cluster(&fleet.hub, spoke, id, true).await?;
    // Verified HTTPS on both sides.
    let module = verified_module(name, id, &real.kernel, &image)?;
    create(&fleet.hub, &module).await?;
    let pinned = image_status_within(
        &fleet.hub,
        name,
        &image,
        "the image pinned by the hub",
        WAIT + CONFIG_MAP_REFRESH,
        |i| i["state"] == "Exists" && i["digest"].is_string(),
    )
    .await?;
    let digest = pinned["digest"].as_str().context("a digest")?.to_owned();
    ensure!(
        digest == mirrored,
        "the hub pinned {digest}, the mirror holds {mirrored}"
    );
    drop(server);
    label_node(&client, &real.name, id, true).await?;
    wait_labelled(fleet, name, &[(spoke.to_owned(), real.name.clone())]).await?;
    let agent = kmm(fleet)?
        .agents
        .iter()
        .find(|a| a.cluster == spoke && a.node == real.name)
        .context("the real node's agent")?;
    let loaded = loaded_digest(agent, &format!("{NAMESPACE}/{name}")).await?;
    ensure!(
        loaded == digest,
        "the node loaded {loaded}, the hub pinned {digest} at the source, which is gone"
    );
    Ok(())
}
