//! The fleet view in a real browser against the local fleet (needs the fleet): Debian's
//! headless Chromium opens the leading kmm-hub's pages through a `kubectl
//! port-forward` (the one `cargo xtask env ui` starts, `kmm_e2e::fleet::ui`) while the
//! README's example rolls out:
//!
//! * the fleet page, open before the module exists, shows its row rise until its
//!   cluster is loaded, and the module's page counts every node of spoke1 loaded;
//! * a version change shows the rollout moving to the new revision, without a reload;
//! * the cluster page lists the real node with its module loaded (its node page names it);
//! * a failure's reason, as the module's status gives it, appears on the module page.
//!
//! Screenshots go to `<target>/tmp/fleet-view/`; `KMM_REFRESH_DOCS_IMAGES=1` also
//! writes them over `docs/images/fleet-view-*.png`.

mod support;

use std::path::Path;

use anyhow::{Context, Result, ensure};
use kmm_api::ManagedClusterModule;
use kmm_e2e::browser::{Browser, Page, Screenshots};
use kmm_e2e::fixture::{Fleet, wait_until};
use kmm_e2e::fleet::ui::UiForward;
use kube::api::{Patch, PatchParams};
use kube::{Api, ResourceExt};
use serde_json::json;
use support::*;

/// The README example's version, and the one the test moves it to.
const FIRST: &str = "1.0";
const SECOND: &str = "2.0";

/// The test's own port-forward, stopped by its PID when the test ends.
struct Forward(UiForward);

impl Drop for Forward {
    fn drop(&mut self) {
        self.0.stop();
    }
}

impl Forward {
    fn url(&self, path: &str) -> String {
        format!("{}{path}", self.0.url)
    }
}

/// A table row's cells, as the browser renders them.
fn cells(row: &str) -> Vec<&str> {
    row.split('\t').map(str::trim).collect()
}

/// The fleet page's (loaded, pending, failed) clusters of a module's row.
fn counts(row: &str) -> Option<[&str; 3]> {
    match cells(row).get(2..5)? {
        [loaded, pending, failed] => Some([*loaded, *pending, *failed]),
        _ => None,
    }
}

/// The fleet page's "Nodes loaded" of a module's row (`L of M`), its last cell.
fn nodes_loaded(row: &str) -> Option<&str> {
    cells(row).get(8).copied()
}

/// The rollout's state and revision from the module page (`Succeeded ... (revision R)`).
fn rollout(text: &str) -> Option<(&str, &str)> {
    let state = text.split_whitespace().next()?;
    let (_, revision) = text.rsplit_once("(revision ")?;
    Some((state, revision.trim_end_matches(')')))
}

/// Fails unless `page` is the document it was when `loaded_at` was read.
async fn not_reloaded(page: &Page, loaded_at: f64, what: &str) -> Result<()> {
    ensure!(
        page.loaded_at().await? == loaded_at,
        "{}: the page was reloaded to show {what}",
        page.url()
    );
    Ok(())
}

#[tokio::test]
async fn the_fleet_view_follows_the_readme_example_in_a_browser() -> Result<()> {
    let fleet = Fleet::get().await?;
    kmm(&fleet)?;
    let settings = settings()?;
    let forward = Forward(
        UiForward::start(
            &settings.state_dir,
            settings.bin_dir.as_deref(),
            &fleet.state,
            0,
            "hub-ui-forward-test",
        )
        .await?,
    );
    let browser = Browser::start()
        .await
        .context("this test needs Debian's headless Chromium")?;
    let shots = Screenshots::new(Path::new(env!("CARGO_TARGET_TMPDIR")), "fleet-view");

    let ReadmeExample {
        module,
        spoke,
        nodes: expected,
    } = readme_example(&fleet)?;
    let (namespace, name) = (module.spec.spoke_namespace.clone(), module.name_any());
    let version = &serde_json::to_value(&module)?["spec"]["moduleSpec"]["moduleLoader"]["container"]
        ["version"];
    ensure!(
        version == FIRST && VERSION == FIRST,
        "the example loads version {version}, the test expects {FIRST}"
    );
    let every = expected.len();
    let cluster = fleet.state.cluster(&spoke)?;

    // 1. The fleet page, open before the module exists, follows it to every node.
    let fleet_page = browser.open(&forward.url("/")).await?;
    fleet_page
        .wait_for_text("the fleet page", "main h1", WAIT, |t| t == "Fleet")
        .await?;
    let loaded_at = fleet_page.loaded_at().await?;
    label_cluster_with(&fleet.hub, &spoke, "kmm.fleet/demo", Some("true")).await?;
    create(&fleet.hub, &module).await?;
    let row = format!("table.modules tbody tr:has(a[href=\"/modules/{name}\"])");
    let mut seen: Vec<String> = Vec::new();
    let every_node = format!("{every} of {every}");
    fleet_page
        .wait_for_text(
            &format!("{name}'s row: its one cluster and its {every} nodes loaded"),
            &row,
            WAIT,
            |r| {
                if seen.last().is_none_or(|last| last != r) {
                    seen.push(r.to_owned());
                }
                counts(r) == Some(["1", "0", "0"]) && nodes_loaded(r) == Some(every_node.as_str())
            },
        )
        .await?;
    not_reloaded(&fleet_page, loaded_at, "the new module").await?;
    ensure!(
        seen.len() >= 2
            && seen
                .first()
                .and_then(|r| counts(r))
                .is_some_and(|c| c[0] == "0"),
        "the row rose from no cluster loaded to its cluster loaded on the open page: {seen:?}"
    );
    let module_page = browser
        .open(&forward.url(&format!("/modules/{name}")))
        .await?;
    let nodes = format!("Nodes: {every} of {every} loaded");
    module_page
        .wait_for_text(&nodes, "p.counts", WAIT, |t| t.contains(&nodes))
        .await?;
    wait_labelled_in(&fleet, &namespace, &name, &expected).await?;
    shots.take(&fleet_page, "fleet").await?;

    // 2. A version change: the rollout moves to a new revision on the open page.
    let first = module_page
        .wait_for_text("the first rollout succeeded", "p.rollout", WAIT, |t| {
            rollout(t).is_some_and(|(state, _)| state == "Succeeded")
        })
        .await?;
    let (_, first_revision) = rollout(&first).context("a revision")?;
    let first_revision = first_revision.to_owned();
    let loaded_at = module_page.loaded_at().await?;
    Api::<ManagedClusterModule>::all(fleet.hub.clone())
        .patch(
            &name,
            &PatchParams::default(),
            &Patch::Merge(json!({ "spec": { "moduleSpec": { "moduleLoader": {
                "container": { "version": SECOND } } } } })),
        )
        .await?;
    let mut states: Vec<String> = Vec::new();
    module_page
        .wait_for_text(
            &format!("the rollout from revision {first_revision} succeeded anew"),
            "p.rollout",
            WAIT,
            |t| match rollout(t) {
                Some((state, revision)) if revision != first_revision => {
                    if states.last().is_none_or(|s| s != state) {
                        states.push(state.to_owned());
                    }
                    state == "Succeeded"
                }
                _ => false,
            },
        )
        .await?;
    not_reloaded(&module_page, loaded_at, "the rollout of the new version").await?;
    eprintln!("the rollout of {SECOND}, as the open page showed it: {states:?}");
    wait_labelled_at(&fleet, &namespace, &name, &expected, SECOND).await?;

    // 3. The cluster page lists the real node with its module.
    let real = &cluster.real_nodes.first().context("a real node")?.name;
    let cluster_page = browser
        .open(&forward.url(&format!("/clusters/{spoke}")))
        .await?;
    let real_row = format!("main table tbody tr:has(a[href$=\"/nodes/{real}\"])");
    cluster_page
        .wait_for_text(
            &format!("{real} with a module loaded"),
            &real_row,
            WAIT,
            |r| {
                let cells = cells(r);
                cells.first() == Some(&real.as_str())
                    && cells.get(2).and_then(|n| n.parse::<u32>().ok()) >= Some(1)
            },
        )
        .await?;
    shots.take(&cluster_page, "cluster").await?;
    let node_page = browser
        .open(&forward.url(&format!("/clusters/{spoke}/nodes/{real}")))
        .await?;
    let module_row = format!("main table tbody tr:has(a[href=\"/modules/{name}\"])");
    node_page
        .wait_for_text(
            &format!("{name} loaded at {SECOND} on {real}"),
            &module_row,
            WAIT,
            |r| {
                let cells = cells(r);
                cells.first() == Some(&name.as_str())
                    && cells.get(2) == Some(&"loaded")
                    && cells.get(3) == Some(&SECOND)
            },
        )
        .await?;
    shots.take(&node_page, "node").await?;

    // 4. A failure's reason on the module page: a node whose kernel has no image.
    let (failing, (failing_spoke, failing_node)) = failing_module(&fleet).await?;
    let failure = wait_until(
        "the node's failure in the module's status",
        WAIT,
        || async {
            let status = status(&fleet.hub, &failing)
                .await
                .map_err(|e| e.to_string())?;
            status["failures"]
                .as_array()
                .and_then(|f| {
                    f.iter()
                        .find(|f| f["node"] == failing_node.as_str())
                        .cloned()
                })
                .ok_or_else(|| status.to_string())
        },
    )
    .await?;
    let reason = failure["reason"]
        .as_str()
        .filter(|r| !r.is_empty())
        .with_context(|| format!("a reason in {failure}"))?;
    let failing_page = browser
        .open(&forward.url(&format!("/modules/{failing}")))
        .await?;
    failing_page
        .wait_for_text(
            &format!("{failing_node}'s failure, {reason}"),
            "table.failures tbody tr",
            WAIT,
            |r| {
                let cells = cells(r);
                cells.first() == Some(&failing_spoke.as_str())
                    && cells.get(1) == Some(&failing_node.as_str())
                    && cells.get(3) == Some(&reason)
            },
        )
        .await?;
    shots.take(&failing_page, "module").await?;

    drop(browser);
    delete(&fleet.hub, &failing).await?;
    let label = failing_label(&failing);
    label_node(fleet.spoke(&failing_spoke)?, &failing_node, &label, false).await?;
    label_cluster(&fleet.hub, &failing_spoke, &label, false).await?;
    delete(&fleet.hub, &name).await?;
    wait_labelled_in(&fleet, &namespace, &name, &[]).await?;
    label_cluster_with(&fleet.hub, &spoke, "kmm.fleet/demo", None).await?;
    Ok(())
}

/// The label selecting the failing module's cluster and node.
fn failing_label(name: &str) -> String {
    format!("kmm-e2e.dev/{name}")
}

/// Creates a module selecting one node whose kernel has no sample image: its name, and
/// the node's (cluster, name).
async fn failing_module(fleet: &Fleet) -> Result<(String, (String, String))> {
    let name = unique("view-failure");
    let id = failing_label(&name);
    let (spoke, node) = node_without_image(fleet)?;
    let node = node.name;
    label_cluster(&fleet.hub, &spoke, &id, true).await?;
    label_node(fleet.spoke(&spoke)?, &node, &id, true).await?;
    create(&fleet.hub, &module(&name, &id, sample_mapping(fleet))?).await?;
    Ok((name, (spoke, node)))
}
