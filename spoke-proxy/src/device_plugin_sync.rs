//! Keeps one DaemonSet per module with a device plugin (see [`device_plugin`]) and feeds
//! where the plugins' Pods are back into the shared state, which holds a node's unload
//! or version change until its plugin Pod is gone. Keeps the copy of the cluster's pull
//! Secret in each namespace with a plugin (see [`device_plugin_pull_secret`]).
//!
//! [`device_plugin`]: crate::device_plugin
//! [`device_plugin_pull_secret`]: crate::device_plugin_pull_secret

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use futures::{FutureExt, StreamExt};
use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::{Namespace, Pod, Secret};
use kmm_proto::v1::PullCredential;
use kube::api::{DeleteParams, Patch, PatchParams, PostParams};
use kube::runtime::WatchStreamExt;
use kube::runtime::reflector::{self, Store};
use kube::runtime::watcher::{self, Event};
use kube::{Api, Client, ResourceExt};
use tokio_util::sync::CancellationToken;

use crate::device_plugin::{
    MANAGED_BY, MANAGED_BY_LABEL, MODULE_LABEL, counts, daemon_set, owned_by, pods_by_node,
};
use crate::device_plugin_pull_secret::{
    COPY, CopyAction, Owner, copy, copy_action, image_pull_secrets, with_image_pull_secrets,
};
use crate::module_id::ModuleId;
use crate::shared_state::SharedState;

/// Also applied on this period, so a failed write is retried without a new change.
const RESYNC: Duration = Duration::from_secs(30);
const FIELD_MANAGER: &str = "kmm-spoke-proxy";

/// Runs until `cancel` fires. `owner` is the proxy's namespace: it labels what this
/// proxy owns.
pub async fn run(client: Client, state: SharedState, owner: String, cancel: CancellationToken) {
    let selector = owned_by(&owner);
    let (owned, writer) = reflector::store();
    let watch_owned = {
        let (owned, state) = (owned.clone(), state.clone());
        reflector::reflector(
            writer,
            watcher::watcher(
                Api::<DaemonSet>::all(client.clone()),
                watcher::Config::default().labels(&selector),
            ),
        )
        .default_backoff()
        .for_each(move |event| {
            match event {
                Err(error) => {
                    tracing::warn!(%error, "watching device plugin DaemonSets failed; retrying");
                }
                // Their status: how many plugin Pods run where they should, for the hub.
                Ok(_) => {
                    let counted = counts(owned.state().iter().map(AsRef::as_ref));
                    state.update_if(|s| s.set_device_plugin_counts(counted));
                }
            }
            futures::future::ready(())
        })
    };
    tokio::select! {
        () = cancel.cancelled() => {}
        () = watch_owned => {}
        () = watch_pods(client.clone(), state.clone(), &selector) => {}
        () = keep_daemon_sets(client, state, owned, &owner) => {}
    }
}

async fn watch_pods(client: Client, state: SharedState, selector: &str) {
    let api: Api<Pod> = Api::all(client);
    let (store, writer) = reflector::store();
    let mut events = reflector::reflector(
        writer,
        watcher::watcher(api, watcher::Config::default().labels(selector)),
    )
    .default_backoff()
    .boxed();
    let mut listed = false;
    loop {
        match events.next().await {
            None => return,
            Some(Err(error)) => {
                tracing::warn!(%error, "watching device plugin Pods failed; retrying");
            }
            Some(Ok(Event::Init | Event::InitApply(_))) => {}
            Some(Ok(Event::InitDone)) => listed = true,
            Some(Ok(Event::Apply(_) | Event::Delete(_))) => {}
        }
        if listed {
            let pods = pods_by_node(store.state().iter().map(AsRef::as_ref));
            state.update_if(|s| s.set_device_plugin_pods(pods));
        }
    }
}

async fn keep_daemon_sets(
    client: Client,
    state: SharedState,
    owned: Store<DaemonSet>,
    owner: &str,
) {
    let namespaces: Api<Namespace> = Api::all(client.clone());
    let mut changes = state.subscribe();
    let mut resync = tokio::time::interval(RESYNC);
    let mut applied: BTreeMap<ModuleId, DaemonSet> = BTreeMap::new();
    // The applied DaemonSets as the API answered: what owns the pull Secret's copies.
    let mut owners: BTreeMap<ModuleId, Owner> = BTreeMap::new();
    // Per namespace, the copy last made to be (`None`: none); made again after a resync.
    let mut copies: BTreeMap<String, Option<Secret>> = BTreeMap::new();
    let mut known_namespaces: BTreeSet<String> = BTreeSet::new();
    loop {
        let resyncing = tokio::select! {
            _ = changes.changed() => false,
            _ = resync.tick() => true,
        };
        if resyncing {
            applied.clear();
            copies.clear();
        }
        // Before the first snapshot the proxy knows no module: it removes nothing.
        let (wanted, informed, cluster_secret) = state.read(|s| {
            let configured = s.cluster_pull_secret().is_configured();
            let wanted: Vec<_> = s
                .device_plugins()
                .into_iter()
                .map(|(id, plugin, tolerations)| {
                    let set = daemon_set(&id, plugin, tolerations, owner).map(|set| {
                        with_image_pull_secrets(set, image_pull_secrets(plugin, configured))
                    });
                    (id, set)
                })
                .collect();
            (
                wanted,
                s.applied_intent_revision() > 0,
                s.cluster_pull_secret().usable().cloned(),
            )
        });
        let mut desired = BTreeSet::new();
        for (id, set) in wanted {
            desired.insert(id.clone());
            let set = match set {
                Ok(set) => set,
                Err(error) => {
                    tracing::warn!(%error, "not running the device plugin");
                    continue;
                }
            };
            if applied.get(&id) == Some(&set) {
                continue;
            }
            if !known_namespaces.contains(&*id.namespace) {
                match ensure_namespace(&namespaces, &id.namespace).await {
                    Ok(()) => {
                        known_namespaces.insert(id.namespace.to_string());
                    }
                    Err(error) => {
                        tracing::warn!(namespace = &*id.namespace, %error, "cannot create the module's namespace; will retry");
                        continue;
                    }
                }
            }
            let api: Api<DaemonSet> = Api::namespaced(client.clone(), &id.namespace);
            let params = PatchParams::apply(FIELD_MANAGER).force();
            match api
                .patch(&set.name_any(), &params, &Patch::Apply(&set))
                .await
            {
                Ok(written) => {
                    tracing::info!(
                        namespace = &*id.namespace,
                        module = &*id.name,
                        "device plugin DaemonSet applied"
                    );
                    if let Some(uid) = written.metadata.uid {
                        let name = set.name_any();
                        owners.insert(id.clone(), Owner { name, uid });
                    }
                    applied.insert(id, set);
                }
                Err(error) => tracing::warn!(
                    namespace = &*id.namespace,
                    module = &*id.name,
                    %error,
                    "applying the device plugin DaemonSet failed; will retry"
                ),
            }
        }
        applied.retain(|id, _| desired.contains(id));
        owners.retain(|id, _| desired.contains(id));
        keep_copies(
            &client,
            cluster_secret.as_ref(),
            &owners,
            &desired,
            owner,
            &mut copies,
        )
        .await;
        if informed
            && owned
                .wait_until_ready()
                .now_or_never()
                .is_some_and(|r| r.is_ok())
        {
            remove_unwanted(&owned, &client, &desired).await;
        }
    }
}

/// Makes the copy of the cluster's pull Secret what it is to be in each namespace with a
/// plugin: there, owned by the namespace's plugin DaemonSets, while the Secret is usable;
/// gone otherwise. Namespaces without a plugin any more lose theirs with the last
/// DaemonSet (their owners). `copies` remembers what each namespace was last given.
async fn keep_copies(
    client: &Client,
    cluster_secret: Option<&PullCredential>,
    owners: &BTreeMap<ModuleId, Owner>,
    desired: &BTreeSet<ModuleId>,
    proxy_namespace: &str,
    copies: &mut BTreeMap<String, Option<Secret>>,
) {
    let namespaces: BTreeSet<&str> = desired.iter().map(|id| &*id.namespace).collect();
    copies.retain(|namespace, _| namespaces.contains(namespace.as_str()));
    for namespace in namespaces {
        let wanted = match cluster_secret {
            None => None,
            Some(credential) => {
                let mut of_namespace: Vec<Owner> = owners
                    .iter()
                    .filter(|(id, _)| &*id.namespace == namespace)
                    .map(|(_, owner)| owner.clone())
                    .collect();
                // No DaemonSet written yet: a copy without owners would never go.
                if of_namespace.is_empty() {
                    continue;
                }
                of_namespace.sort();
                Some(copy(namespace, credential, &of_namespace, proxy_namespace))
            }
        };
        if copies.get(namespace) == Some(&wanted) {
            continue;
        }
        let api: Api<Secret> = Api::namespaced(client.clone(), namespace);
        match keep_copy(&api, namespace, wanted.clone(), proxy_namespace).await {
            Ok(()) => {
                copies.insert(namespace.to_owned(), wanted);
            }
            // Never the Secret itself: kube's errors carry the API's answer only.
            Err(error) => tracing::warn!(
                namespace,
                secret = COPY,
                %error,
                "keeping the device plugins' pull Secret failed; will retry"
            ),
        }
    }
}

/// One namespace's copy, from what the API has to `wanted`.
async fn keep_copy(
    api: &Api<Secret>,
    namespace: &str,
    wanted: Option<Secret>,
    proxy_namespace: &str,
) -> Result<(), kube::Error> {
    let existing = api.get_opt(COPY).await?;
    match copy_action(existing.as_ref(), wanted, proxy_namespace) {
        CopyAction::Nothing => {}
        CopyAction::Create(copy) => {
            api.create(&PostParams::default(), &copy).await?;
            tracing::info!(
                namespace,
                secret = COPY,
                "device plugins' pull Secret created"
            );
        }
        CopyAction::Update(copy) => {
            api.replace(COPY, &PostParams::default(), &copy).await?;
            tracing::info!(
                namespace,
                secret = COPY,
                "device plugins' pull Secret updated"
            );
        }
        CopyAction::Recreate(copy) => {
            api.delete(COPY, &DeleteParams::default()).await?;
            api.create(&PostParams::default(), &copy).await?;
            tracing::info!(
                namespace,
                secret = COPY,
                "device plugins' pull Secret recreated"
            );
        }
        CopyAction::Delete => {
            match api.delete(COPY, &DeleteParams::default()).await {
                Ok(_) => {}
                Err(kube::Error::Api(status)) if status.code == 404 => {}
                Err(error) => return Err(error),
            }
            tracing::info!(
                namespace,
                secret = COPY,
                "device plugins' pull Secret deleted"
            );
        }
        CopyAction::Foreign => tracing::warn!(
            namespace,
            secret = COPY,
            "a Secret of this name exists and was not made by this proxy: left alone, the \
             plugin's Pods use it as it is"
        ),
    }
    Ok(())
}

/// Deletes the proxy's DaemonSets of modules that no longer run a plugin.
async fn remove_unwanted(owned: &Store<DaemonSet>, client: &Client, desired: &BTreeSet<ModuleId>) {
    for set in owned.state() {
        let (Some(namespace), Some(module)) = (set.namespace(), set.labels().get(MODULE_LABEL))
        else {
            continue;
        };
        let id = ModuleId {
            namespace: namespace.as_str().into(),
            name: module.as_str().into(),
        };
        if desired.contains(&id) {
            continue;
        }
        let api: Api<DaemonSet> = Api::namespaced(client.clone(), &namespace);
        match api
            .delete(&set.name_any(), &DeleteParams::background())
            .await
        {
            Ok(_) => tracing::info!(namespace, module, "device plugin DaemonSet deleted"),
            Err(kube::Error::Api(status)) if status.code == 404 => {}
            Err(error) => {
                tracing::warn!(namespace, module, %error, "deleting the device plugin DaemonSet failed; will retry")
            }
        }
    }
}

/// The module's namespace, created when missing (and never deleted: other things may
/// live there).
async fn ensure_namespace(api: &Api<Namespace>, name: &str) -> Result<(), kube::Error> {
    if api.get_opt(name).await?.is_some() {
        return Ok(());
    }
    let namespace = Namespace {
        metadata: kube::api::ObjectMeta {
            name: Some(name.to_owned()),
            // The plugin runs privileged with the kubelet's socket directory mounted.
            labels: Some(
                [
                    (MANAGED_BY_LABEL.to_owned(), MANAGED_BY.to_owned()),
                    (
                        "pod-security.kubernetes.io/enforce".to_owned(),
                        "privileged".to_owned(),
                    ),
                ]
                .into(),
            ),
            ..kube::api::ObjectMeta::default()
        },
        ..Namespace::default()
    };
    match api.create(&PostParams::default(), &namespace).await {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(status)) if status.code == 409 => Ok(()),
        Err(error) => Err(error),
    }
}
