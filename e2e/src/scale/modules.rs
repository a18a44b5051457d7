//! The run's ManagedClusterModules, the kmod images they name, and convergence as the
//! hub reports it: a watch of the modules' status, never the simulated proxies' view.

use std::collections::{BTreeMap, BTreeSet};

use kmm_api::ManagedClusterModule;
use kube::api::{DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::runtime::watcher;
use kube::{Api, Client, ResourceExt};
use serde_json::json;

use super::{Error, Result, io};
use crate::fleet::kmm::TEST_HUB_LABEL;
use crate::kmod;
use crate::watched::Watched;

/// The modules' `spokeNamespace`.
pub const SPOKE_NAMESPACE: &str = "kmm-scale";
/// Where the run's kmod images are, one tag per kernel.
pub const REPOSITORY: &str = "kmm-scale/kmod";
/// The node label every module's node selector names (every simulated node has it).
pub const NODE_SELECTOR: (&str, &str) = ("kubernetes.io/os", "linux");
/// The kernels the mapping matches: Debian's release scheme.
const KERNEL_REGEXP: &str = r"^6\.1\.0-[0-9]+-amd64$";

/// The name of module `index` of `run`.
pub fn module_name(run: &str, index: usize) -> String {
    format!("{run}-m{index:02}")
}

/// Module `name` of `run`: selects the run's clusters and every node; one regexp
/// mapping to the run's image for the node's kernel. The label keeps the fleet's own
/// hub (if it runs) away from it and lets the run's hub (`--module-selector`) find it.
pub fn module(
    run: &str,
    name: &str,
    registry: &str,
    version: &str,
) -> Result<ManagedClusterModule> {
    serde_json::from_value(json!({
        "apiVersion": "hub.kmm.sigs.x-k8s.io/v1beta1",
        "kind": "ManagedClusterModule",
        "metadata": { "name": name, "labels": { TEST_HUB_LABEL: run } },
        "spec": {
            "spokeNamespace": SPOKE_NAMESPACE,
            "selector": { super::clusters::RUN_LABEL: run },
            "moduleSpec": {
                "selector": { NODE_SELECTOR.0: NODE_SELECTOR.1 },
                "moduleLoader": { "container": {
                    "version": version,
                    "modprobe": { "moduleName": "kmm_scale" },
                    "registryTLS": { "insecure": true },
                    "kernelMappings": [{
                        "regexp": KERNEL_REGEXP,
                        "containerImage": format!("{registry}/{REPOSITORY}:${{KERNEL_FULL_VERSION}}"),
                    }],
                }},
            },
        },
    }))
    .map_err(|e| Error::Invalid(format!("module {name}: {e}")))
}

/// The module selector of the run's hub.
pub fn module_selector(run: &str) -> String {
    format!("{TEST_HUB_LABEL}={run}")
}

/// Applies the hub's CRDs (a fleet started with `--no-kmm` lacks them).
pub async fn apply_crds(hub: &Client) -> Result<()> {
    for yaml in [
        kmm_api::managed_cluster_module_crd_yaml(),
        kmm_api::preflight_validation_crd_yaml(),
    ] {
        let crd: serde_json::Value = serde_yaml_ng::from_str(&yaml)
            .map_err(|e| Error::Invalid(format!("a hub CRD: {e}")))?;
        crate::fleet::apply_crd(hub, &crd).await?;
    }
    Ok(())
}

/// Pushes a small image for each kernel (the hub checks every image exists before it
/// sends a load): `<registry>/kmm-scale/kmod:<kernel>`.
pub async fn push_images(registry: &str, kernels: &BTreeSet<String>) -> Result<()> {
    let dir = tempfile::tempdir().map_err(io("making a temporary directory"))?;
    for kernel in kernels {
        let root = dir.path().join(kernel);
        let modules = root.join("opt/lib/modules").join(kernel);
        std::fs::create_dir_all(&modules).map_err(io(format!("creating {}", modules.display())))?;
        // Never loaded by anything: the nodes are simulated.
        std::fs::write(modules.join("modules.dep"), b"")
            .map_err(io(format!("writing into {}", modules.display())))?;
        kmod::push_root(registry, REPOSITORY, kernel, kernel, &root, &[]).await?;
    }
    Ok(())
}

/// Creates the module; its generation.
pub async fn create(hub: &Client, module: &ManagedClusterModule) -> Result<i64> {
    let created = Api::<ManagedClusterModule>::all(hub.clone())
        .create(&PostParams::default(), module)
        .await?;
    generation(&created)
}

/// Sets the module's `version`: a new generation every node must reach; that generation.
pub async fn set_version(hub: &Client, name: &str, version: &str) -> Result<i64> {
    let patch =
        json!({"spec": {"moduleSpec": {"moduleLoader": {"container": {"version": version}}}}});
    let patched = Api::<ManagedClusterModule>::all(hub.clone())
        .patch(name, &PatchParams::default(), &Patch::Merge(&patch))
        .await?;
    generation(&patched)
}

fn generation(module: &ManagedClusterModule) -> Result<i64> {
    module
        .metadata
        .generation
        .ok_or_else(|| Error::Invalid(format!("module {} has no generation", module.name_any())))
}

/// Deletes the run's modules, all at once as a `kubectl delete -f` of them would reach a
/// hub that is not busy: one after the other, each request waited behind the fleet's
/// reaction to the previous deletions on a machine the simulated proxies saturate, which
/// spread the deletions over seconds (and the hub's snapshots with them). The hub
/// releases each once every node confirmed the unload.
pub async fn delete_all(hub: &Client, run: &str) -> Result<()> {
    let api = Api::<ManagedClusterModule>::all(hub.clone());
    let listed = api
        .list_metadata(&ListParams::default().labels(&module_selector(run)))
        .await?;
    let deletions = listed.iter().map(|module| {
        let api = api.clone();
        async move {
            match api
                .delete(&module.name_any(), &DeleteParams::background())
                .await
            {
                Ok(_) => Ok(()),
                Err(kube::Error::Api(s)) if s.code == 404 => Ok(()),
                Err(e) => Err(Error::from(e)),
            }
        }
    });
    futures::future::try_join_all(deletions).await?;
    Ok(())
}

/// Removes the hub's finalizer from the run's modules left behind (cleanup after the
/// hub is gone: nothing else would release them).
pub async fn release_leftovers(hub: &Client, run: &str) -> Result<()> {
    let api = Api::<ManagedClusterModule>::all(hub.clone());
    for module in api
        .list_metadata(&ListParams::default().labels(&module_selector(run)))
        .await?
    {
        let patch = json!({"metadata": {"finalizers": null}});
        match api
            .patch(
                &module.name_any(),
                &PatchParams::default(),
                &Patch::Merge(&patch),
            )
            .await
        {
            Ok(_) => {}
            Err(kube::Error::Api(s)) if s.code == 404 => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}

/// What converged means for a scenario.
#[derive(Clone, Debug)]
pub struct Expected {
    /// Each module and the generation it must have at least: the watch may not have
    /// seen the latest write yet, and the previous generation's status converged.
    pub modules: BTreeMap<String, i64>,
    pub clusters: i32,
    pub nodes: i32,
    /// The kernels the module's images must be listed for (exactly), when the scenario
    /// changed kernels without changing the module.
    pub kernels: Option<BTreeSet<String>>,
}

/// `Ok` when the hub's status of every expected module says: this generation observed,
/// every cluster selected, connected and converged, every node matching and loaded,
/// nothing failed, Ready; else what is missing.
pub fn converged(
    modules: &BTreeMap<String, ManagedClusterModule>,
    expected: &Expected,
) -> Result<(), String> {
    let mut waiting = vec![];
    for (name, generation) in &expected.modules {
        if let Err(why) = module_converged(modules.get(name), *generation, expected) {
            waiting.push(format!("{name}: {why}"));
        }
    }
    match waiting.first() {
        None => Ok(()),
        Some(first) => Err(format!(
            "{} of {} modules not converged; {first}",
            waiting.len(),
            expected.modules.len()
        )),
    }
}

fn module_converged(
    module: Option<&ManagedClusterModule>,
    generation: i64,
    e: &Expected,
) -> Result<(), String> {
    let module = module.ok_or("absent")?;
    if module.metadata.generation < Some(generation) {
        return Err(format!(
            "generation {:?} seen, {generation} written",
            module.metadata.generation
        ));
    }
    let status = module.status.as_ref().ok_or("no status yet")?;
    let (c, n) = (&status.clusters, &status.nodes);
    let summary = || {
        format!(
            "generation {:?} observed {:?}; clusters {}/{}/{} (selected/connected/converged), \
             nodes {}/{}/{} (matching/loaded/failed); want {} clusters, {} nodes",
            module.metadata.generation,
            status.observed_generation,
            c.selected,
            c.connected,
            c.converged,
            n.matching,
            n.loaded,
            n.failed,
            e.clusters,
            e.nodes
        )
    };
    let counts_ok = status.observed_generation == module.metadata.generation
        && (c.selected, c.connected, c.converged) == (e.clusters, e.clusters, e.clusters)
        && (n.matching, n.loaded, n.failed) == (e.nodes, e.nodes, 0);
    if !counts_ok {
        return Err(summary());
    }
    let ready = status
        .conditions
        .iter()
        .any(|c| c.type_ == "Ready" && c.status == "True");
    if !ready {
        return Err(format!("not Ready; {}", summary()));
    }
    if let Some(kernels) = &e.kernels {
        let named: BTreeSet<String> = status
            .images
            .iter()
            .filter(|i| i.state == "Exists")
            .flat_map(|i| i.kernels.iter().cloned())
            .collect();
        if &named != kernels {
            return Err(format!(
                "images exist for kernels {named:?}, want exactly {kernels:?}"
            ));
        }
    }
    Ok(())
}

/// The run's modules as the apiserver has them, kept current by a watch.
pub fn watch(hub: &Client, run: &str) -> Watched<ManagedClusterModule> {
    let config = watcher::Config::default().labels(&module_selector(run));
    Watched::start(Api::all(hub.clone()), config)
}
