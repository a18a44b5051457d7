//! `imagePullPolicy` on the local fleet (issue 29, item 7): with `Always` the hub follows
//! a tag that moves and the new digest reaches the clusters wave by wave, through the
//! module's rollout strategy; with `IfNotPresent` the digest pinned first holds. The
//! fleet's hub resolves followed tags every 5 s (`hub_install::IMAGE_FOLLOW_INTERVAL`).

mod support;

use std::collections::BTreeMap;

use anyhow::{Context, Result, ensure};
use kmm_api::ManagedClusterModule;
use kmm_e2e::fixture::{Fleet, wait_until};
use kmm_e2e::fleet::kmm::Agent;
use kmm_e2e::kmod::{self, ImageFile, REPOSITORY};
use serde_json::{Value, json};
use support::*;

/// `module(name, selector_key, ...)` loading `<kernel>-<name>` tags of the sample image,
/// with `policy` and, when given, a rollout strategy.
fn pulled_module(
    fleet: &Fleet,
    name: &str,
    selector_key: &str,
    policy: &str,
    strategy: Option<Value>,
) -> Result<ManagedClusterModule> {
    let mapping = json!([{
        "regexp": "^.+$",
        "containerImage": format!(
            "{}/{REPOSITORY}:${{KERNEL_FULL_VERSION}}-{name}",
            fleet.state.node_registry
        ),
    }]);
    let mut doc = serde_json::to_value(module(name, selector_key, mapping)?)?;
    doc["spec"]["moduleSpec"]["moduleLoader"]["container"]["imagePullPolicy"] = json!(policy);
    if let Some(strategy) = strategy {
        doc["spec"]["rolloutStrategy"] = strategy;
    }
    Ok(serde_json::from_value(doc)?)
}

/// Tags the fleet's sample image of each kernel as `<kernel>-<name>`.
async fn tag_samples(fleet: &Fleet, kernels: &[String], name: &str) -> Result<()> {
    for kernel in kernels {
        kmod::retag(
            &fleet.state.registry,
            REPOSITORY,
            kernel,
            &format!("{kernel}-{name}"),
        )
        .await?;
    }
    Ok(())
}

/// Pushes other bytes under each kernel's `<kernel>-<name>` tag (the same modules and a
/// file naming the push): returns the new digest per kernel.
async fn push_over(
    fleet: &Fleet,
    kernels: &[String],
    name: &str,
) -> Result<BTreeMap<String, String>> {
    let mut digests = BTreeMap::new();
    for kernel in kernels {
        let pushed = kmod::push_root(
            &fleet.state.registry,
            REPOSITORY,
            kernel,
            &format!("{kernel}-{name}"),
            &kmod::build(kernel)?,
            &[ImageFile {
                path: "pushed-over".into(),
                contents: name.as_bytes().to_vec(),
            }],
        )
        .await?;
        digests.insert(kernel.clone(), pushed.digest);
    }
    Ok(digests)
}

/// The digest status shows for the image of `kernel`.
fn shown_digest(status: &Value, kernel: &str) -> Option<String> {
    status["images"].as_array()?.iter().find_map(|image| {
        let kernels = image["kernels"].as_array()?;
        kernels
            .iter()
            .any(|k| k == kernel)
            .then(|| image["digest"].as_str().map(str::to_owned))
            .flatten()
    })
}

#[tokio::test]
async fn always_follows_a_moved_tag_wave_by_wave_and_if_not_present_holds_the_pin() -> Result<()> {
    let fleet = Fleet::get().await?;
    let kmm = kmm(&fleet)?;
    let (follow, follow_key) = (unique("follow"), unique("kmm-e2e.dev/follow"));
    let (hold, hold_key) = (unique("hold"), unique("kmm-e2e.dev/hold"));
    // Per spoke, one KWOK node with a sample image follows the tag; one more on the first
    // spoke holds its pin. Their kernel logs are the record of what each loaded when.
    let mut followers: Vec<Agent> = Vec::new();
    let mut holder: Option<Agent> = None;
    let mut spokes = fleet.spoke_names().to_vec();
    spokes.sort();
    for spoke in &spokes {
        let with_images: BTreeMap<String, String> =
            nodes_with_images(&fleet, spoke)?.into_iter().collect();
        let mut candidates = kmm
            .agents
            .iter()
            .filter(|a| &a.cluster == spoke && a.simulated && with_images.contains_key(&a.node));
        let agent = candidates
            .next()
            .with_context(|| format!("{spoke} has no KWOK node with a sample image"))?;
        followers.push(agent.clone());
        if holder.is_none() {
            holder = candidates.next().cloned();
        }
    }
    let holder = holder.context("the first spoke needs two KWOK nodes with a sample image")?;
    let kernel_of = |agent: &Agent| -> Result<String> {
        nodes_with_images(&fleet, &agent.cluster)?
            .into_iter()
            .find(|(node, _)| *node == agent.node)
            .map(|(_, kernel)| kernel)
            .context("a node with a sample image")
    };
    let follow_kernels: Vec<String> = followers
        .iter()
        .map(kernel_of)
        .collect::<Result<std::collections::BTreeSet<_>>>()?
        .into_iter()
        .collect();
    let hold_kernels = vec![kernel_of(&holder)?];
    tag_samples(&fleet, &follow_kernels, &follow).await?;
    tag_samples(&fleet, &hold_kernels, &hold).await?;

    for agent in &followers {
        label_cluster(&fleet.hub, &agent.cluster, &follow_key, true).await?;
        label_node(fleet.spoke(&agent.cluster)?, &agent.node, &follow_key, true).await?;
    }
    label_cluster(&fleet.hub, &holder.cluster, &hold_key, true).await?;
    label_node(fleet.spoke(&holder.cluster)?, &holder.node, &hold_key, true).await?;
    let waves = json!({"type": "Progressive", "progressive": {"maxConcurrency": 1}});
    create(
        &fleet.hub,
        &pulled_module(&fleet, &follow, &follow_key, "Always", Some(waves))?,
    )
    .await?;
    create(
        &fleet.hub,
        &pulled_module(&fleet, &hold, &hold_key, "IfNotPresent", None)?,
    )
    .await?;
    let follow_targets: Vec<(String, String)> = followers
        .iter()
        .map(|a| (a.cluster.clone(), a.node.clone()))
        .collect();
    wait_labelled(&fleet, &follow, &follow_targets).await?;
    wait_labelled(
        &fleet,
        &hold,
        &[(holder.cluster.clone(), holder.node.clone())],
    )
    .await?;
    let before = wait_until("the rollout to succeed on the first pins", WAIT, || async {
        let status = status(&fleet.hub, &follow)
            .await
            .map_err(|e| e.to_string())?;
        (status["rollout"]["state"] == "Succeeded"
            && shown_digest(&status, &follow_kernels[0]).is_some())
        .then(|| status.clone())
        .ok_or_else(|| status.to_string())
    })
    .await?;
    let first_revision = before["rollout"]["revision"].clone();
    let held_before = status(&fleet.hub, &hold).await?;
    let held_digest = shown_digest(&held_before, &hold_kernels[0]).context("the held pin")?;

    // Both tags move at the same moment.
    let offsets: Vec<usize> = followers.iter().map(log_len).collect();
    let hold_offset = log_len(&holder);
    let moved = push_over(&fleet, &follow_kernels, &follow).await?;
    push_over(&fleet, &hold_kernels, &hold).await?;

    let after = wait_until("the followed digests rolled out", WAIT, || async {
        let status = status(&fleet.hub, &follow)
            .await
            .map_err(|e| e.to_string())?;
        let shown = moved
            .iter()
            .all(|(kernel, digest)| shown_digest(&status, kernel).as_ref() == Some(digest));
        let rolled = status["rollout"]["state"] == "Succeeded"
            && status["rollout"]["revision"] != first_revision;
        (shown && rolled)
            .then(|| status.clone())
            .ok_or_else(|| status.to_string())
    })
    .await?;
    ensure!(
        after["pinGeneration"].as_i64().is_some_and(|g| g >= 1),
        "status records the move: {after}"
    );
    let earlier: Vec<&Value> = after["images"]
        .as_array()
        .into_iter()
        .flatten()
        .flat_map(|image| image["earlierPins"].as_array().into_iter().flatten())
        .collect();
    ensure!(
        !earlier.is_empty(),
        "the digests pinned before stay listed: {after}"
    );

    // Every following node reloaded, one cluster after the other.
    let mut reloads = Vec::new();
    for (agent, offset) in followers.iter().zip(&offsets) {
        let removed = first_event(agent, *offset, false)?
            .with_context(|| format!("{} never unloaded the old bytes", agent.node))?;
        let inserted = first_event(agent, *offset, true)?
            .with_context(|| format!("{} never loaded the new bytes", agent.node))?;
        reloads.push((agent.cluster.clone(), removed, inserted));
    }
    for pair in reloads.windows(2) {
        let ((first, _, first_loaded), (next, next_removed, _)) = (&pair[0], &pair[1]);
        ensure!(
            next_removed > first_loaded,
            "{next} moved before {first} had loaded the new digest: {reloads:?}"
        );
    }

    // The same push, under IfNotPresent, moved nothing: the hub followed the other tag
    // past it, and this one keeps its first pin, on record and on the node.
    let held_after = status(&fleet.hub, &hold).await?;
    ensure!(
        shown_digest(&held_after, &hold_kernels[0]).as_deref() == Some(held_digest.as_str()),
        "the held pin moved: {held_after}"
    );
    ensure!(
        held_after.get("pinGeneration").is_none_or(Value::is_null),
        "{held_after}"
    );
    ensure!(
        first_event(&holder, hold_offset, false)?.is_none(),
        "{} reloaded its module",
        holder.node
    );

    for name in [&follow, &hold] {
        delete(&fleet.hub, name).await?;
        wait_labelled(&fleet, name, &[]).await?;
    }
    for agent in &followers {
        label_node(
            fleet.spoke(&agent.cluster)?,
            &agent.node,
            &follow_key,
            false,
        )
        .await?;
        label_cluster(&fleet.hub, &agent.cluster, &follow_key, false).await?;
    }
    label_node(
        fleet.spoke(&holder.cluster)?,
        &holder.node,
        &hold_key,
        false,
    )
    .await?;
    label_cluster(&fleet.hub, &holder.cluster, &hold_key, false).await?;
    Ok(())
}
