//! Issue 12's image checks on the fleet: the installed kmm-hub asks the registry for
//! every image the fleet needs, pins each to the digest it found, and sends that digest
//! to every node; an image the registry lacks never reaches a node as a pull error but as
//! the hub's reason, and status lists every image with its state.

mod support;

use anyhow::{Context, Result, ensure};
use kmm_e2e::fixture::{Fleet, wait_until};
use kmm_e2e::versions::Versions;
use serde_json::Value;
use support::*;

#[tokio::test]
async fn every_node_loads_the_digest_the_hub_pinned_and_a_missing_image_is_the_hubs_reason()
-> Result<()> {
    let fleet = Fleet::get().await?;
    let kmm = kmm(&fleet)?;
    let missing_kernel = Versions::pinned().kernels.without_image;
    // A cluster with a node whose kernel has a sample image and one whose kernel has none.
    let (spoke, with_image, without_image) = fleet
        .spoke_names()
        .into_iter()
        .find_map(|spoke| {
            let nodes = fleet.state.cluster(&spoke).ok()?.nodes.clone();
            let missing = nodes.iter().find(|n| n.kernel == missing_kernel)?.clone();
            let present = nodes_with_images(&fleet, &spoke).ok()?.into_iter().next()?;
            Some((spoke, present, missing))
        })
        .context("a spoke with a node of the kernel without a sample image")?;
    let (id, name) = (unique("kmm-e2e.dev/images"), unique("images"));
    label_cluster(&fleet.hub, &spoke, &id, true).await?;
    for node in [&with_image.0, &without_image.name] {
        label_node(fleet.spoke(&spoke)?, node, &id, true).await?;
    }
    create(&fleet.hub, &module(&name, &id, sample_mapping(&fleet))?).await?;

    let image = format!(
        "{}/samples/kmm-hello:{}",
        fleet.state.node_registry, with_image.1
    );
    let absent = format!(
        "{}/samples/kmm-hello:{missing_kernel}",
        fleet.state.node_registry
    );
    let images = wait_until("both images in the module's status", WAIT, || async {
        let status = status(&fleet.hub, &name).await.map_err(|e| e.to_string())?;
        let find = |image: &str| -> Option<Value> {
            status["images"]
                .as_array()?
                .iter()
                .find(|i| i["image"] == image)
                .cloned()
        };
        match (find(&image), find(&absent)) {
            (Some(found), Some(lost))
                if found["state"] == "Exists" && lost["state"] == "NotFound" =>
            {
                Ok((found, lost))
            }
            _ => Err(status.to_string()),
        }
    })
    .await?;
    let (found, lost) = images;
    let pinned = found["digest"].as_str().context("a digest")?.to_owned();
    let registry_digest = registry_digest(&format!(
        "{}/samples/kmm-hello:{}",
        fleet.state.registry, with_image.1
    ))
    .await?;
    ensure!(
        pinned == registry_digest,
        "status pins {pinned}, the registry has {registry_digest}"
    );
    ensure!(
        lost["reason"] == "ImageNotFound" && lost["kernels"][0] == missing_kernel.as_str(),
        "the missing image names its kernel and reason: {lost}"
    );

    // The node loads exactly the pinned bytes (the agent's own record) ...
    let agent = kmm
        .agents
        .iter()
        .find(|a| a.cluster == spoke && a.node == with_image.0)
        .context("the agent of the node with an image")?;
    let recorded = wait_until("the agent to record the load", WAIT, || async {
        let state: Value = std::fs::read(agent.state_file())
            .ok()
            .and_then(|b| serde_json::from_slice(&b).ok())
            .ok_or("no state yet")?;
        state["modules"][format!("{NAMESPACE}/{name}")]["digest"]
            .as_str()
            .map(str::to_owned)
            .ok_or_else(|| state.to_string())
    })
    .await?;
    ensure!(
        recorded == pinned,
        "the agent loaded {recorded}, the hub pinned {pinned}"
    );

    // ... and the node without an image reports the hub's reason, not a pull error.
    let failure = wait_until(
        "the hub's reason for the node without image",
        WAIT,
        || async {
            let status = status(&fleet.hub, &name).await.map_err(|e| e.to_string())?;
            status["failures"]
                .as_array()
                .and_then(|f| {
                    f.iter()
                        .find(|f| f["node"] == without_image.name.as_str())
                        .cloned()
                })
                .ok_or_else(|| status.to_string())
        },
    )
    .await?;
    ensure!(
        failure["reason"] == "ImageNotFound"
            && failure["message"]
                .as_str()
                .is_some_and(|m| m.contains(&absent)),
        "{failure}"
    );

    delete(&fleet.hub, &name).await?;
    wait_labelled(&fleet, &name, &[]).await?;
    label_cluster(&fleet.hub, &spoke, &id, false).await?;
    Ok(())
}

/// The digest the registry serves for `image` now (plain HTTP, as the fleet's is).
async fn registry_digest(image: &str) -> Result<String> {
    let client = kmm_registry::client(kmm_registry::RegistryTls {
        insecure: true,
        insecure_skip_tls_verify: false,
    });
    Ok(kmm_registry::resolve_digest(&client, image, None).await?)
}
