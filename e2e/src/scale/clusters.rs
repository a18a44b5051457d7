//! The run's ManagedClusters on the fleet's hub: created accepted (`hubAcceptsClient`),
//! named and labelled after the run so that nothing else on the fleet selects them, and
//! deleted with whatever OCM's controllers made for them (a namespace per cluster).

use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::Namespace;
use kmm_api::ocm::MANAGED_CLUSTER;
use kube::api::{DeleteParams, DynamicObject, ListParams, PostParams};
use kube::{Api, Client, ResourceExt};
use serde_json::json;
use tokio::sync::Semaphore;
use tokio::task::JoinSet;

use super::{Error, Result, poll_until};
use crate::fleet::{condition_true, managed_clusters};

/// Label of everything a run creates on the fleet's hub; its value is the run's name.
pub const RUN_LABEL: &str = "scale.kmm-fleet.dev/run";
/// Requests in flight when creating or deleting clusters: enough to keep the apiserver
/// busy, few enough that OCM's controllers, which react to each, keep up.
const PARALLEL: usize = 16;
const POLL: Duration = Duration::from_millis(500);

/// The name of cluster `index` of `run`.
pub fn cluster_name(run: &str, index: usize) -> String {
    format!("{run}-c{index:05}")
}

/// Creates `count` accepted ManagedClusters of `run` (an existing one is kept).
pub async fn create(hub: &Client, run: &str, count: usize) -> Result<Vec<String>> {
    let names: Vec<String> = (0..count).map(|i| cluster_name(run, i)).collect();
    let api = managed_clusters(hub);
    for_each(&names, |name| {
        let api = api.clone();
        let object: Result<DynamicObject, _> = serde_json::from_value(json!({
            "apiVersion": MANAGED_CLUSTER.api_version(),
            "kind": MANAGED_CLUSTER.kind,
            "metadata": { "name": name, "labels": { RUN_LABEL: run } },
            "spec": { "hubAcceptsClient": true },
        }));
        async move {
            let object = object.map_err(|e| Error::Invalid(format!("ManagedCluster: {e}")))?;
            match api.create(&PostParams::default(), &object).await {
                Ok(_) => Ok(()),
                Err(kube::Error::Api(s)) if s.code == 409 => Ok(()),
                Err(e) => Err(e.into()),
            }
        }
    })
    .await?;
    Ok(names)
}

/// What OCM's registration controller has yet to do for the run's `count` clusters:
/// accept each (`HubAcceptedManagedCluster`, its finalizers) and make its namespace;
/// `None` once done.
pub async fn ocm_pending(hub: &Client, run: &str, count: usize) -> Result<Option<String>> {
    let selector = ListParams::default().labels(&format!("{RUN_LABEL}={run}"));
    let accepted = managed_clusters(hub)
        .list(&selector)
        .await?
        .items
        .iter()
        .filter(|c| {
            condition_true(&c.data, "HubAcceptedManagedCluster") && !c.finalizers().is_empty()
        })
        .count();
    let namespaces = namespaces(hub, run).await?.len();
    Ok((accepted < count || namespaces < count)
        .then(|| format!("{accepted} of {count} clusters accepted, {namespaces} namespaces made")))
}

/// Namespaces OCM's controllers made for the run's clusters (one per accepted cluster,
/// named after it).
pub async fn namespaces(hub: &Client, run: &str) -> Result<Vec<String>> {
    let prefix = format!("{run}-c");
    Ok(Api::<Namespace>::all(hub.clone())
        .list_metadata(&ListParams::default())
        .await?
        .items
        .into_iter()
        .map(|n| n.name_any())
        .filter(|n| n.starts_with(&prefix))
        .collect())
}

/// Deletes every ManagedCluster of `run`, then any namespace OCM left for them, and
/// waits until all are gone.
pub async fn delete(hub: &Client, run: &str, timeout: Duration) -> Result<()> {
    let api = managed_clusters(hub);
    let selector = ListParams::default().labels(&format!("{RUN_LABEL}={run}"));
    let names: Vec<String> = api
        .list_metadata(&selector)
        .await?
        .items
        .into_iter()
        .map(|c| c.name_any())
        .collect();
    for_each(&names, |name| {
        let api = api.clone();
        async move { gone_ok(api.delete(&name, &DeleteParams::background()).await) }
    })
    .await?;
    poll_until(
        "the run's ManagedClusters to be gone",
        timeout,
        POLL,
        || {
            let (api, selector) = (api.clone(), selector.clone());
            async move {
                let left = api.list_metadata(&selector).await?.items.len();
                Ok(if left == 0 {
                    Ok(())
                } else {
                    Err(format!("{left} left"))
                })
            }
        },
    )
    .await?;
    // OCM deletes a cluster's namespace itself when the cluster goes; one it has not
    // started on yet is deleted here.
    let namespaces_api: Api<Namespace> = Api::all(hub.clone());
    for_each(&namespaces(hub, run).await?, |name| {
        let api = namespaces_api.clone();
        async move { gone_ok(api.delete(&name, &DeleteParams::background()).await) }
    })
    .await?;
    poll_until(
        "the run's cluster namespaces to be gone",
        timeout,
        POLL,
        || async {
            let left = namespaces(hub, run).await?;
            Ok(if left.is_empty() {
                Ok(())
            } else {
                Err(format!("{} left, e.g. {}", left.len(), left[0]))
            })
        },
    )
    .await
}

fn gone_ok<T>(result: kube::Result<T>) -> Result<()> {
    match result {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(s)) if s.code == 404 => Ok(()),
        Err(e) => Err(e.into()),
    }
}

/// Runs `action` for every name, [`PARALLEL`] at a time; the first error wins.
async fn for_each<F, Fut>(names: &[String], action: F) -> Result<()>
where
    F: Fn(String) -> Fut,
    Fut: std::future::Future<Output = Result<()>> + Send + 'static,
{
    let permits = Arc::new(Semaphore::new(PARALLEL));
    let mut tasks = JoinSet::new();
    for name in names {
        let permit = permits
            .clone()
            .acquire_owned()
            .await
            .map_err(|e| Error::Invalid(e.to_string()))?;
        let work = action(name.clone());
        tasks.spawn(async move {
            let result = work.await;
            drop(permit);
            result
        });
        // Fail early rather than after every request was tried.
        while let Some(done) = tasks.try_join_next() {
            done.map_err(|e| Error::Invalid(format!("a request task failed: {e}")))??;
        }
    }
    while let Some(done) = tasks.join_next().await {
        done.map_err(|e| Error::Invalid(format!("a request task failed: {e}")))??;
    }
    Ok(())
}
