//! Every image the fleet needs now: each module (not being unloaded) resolved for the
//! kernels of the connected clusters that select it, plus what PreflightValidations ask.
//! Pure.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use kmm_api::{ManagedClusterModule, PreflightValidation};
use kube::ResourceExt;

use super::assignment::{ClusterFacts, cluster_modules, is_deleting};
use super::node_statuses::NodeStatuses;
use super::preflight::preflight_needs;
use crate::images::{ImageKey, ImageNeed, module_needs};
use crate::resolutions::Resolutions;

/// A module as served, and the kernels it is served for.
type Served = (Arc<ManagedClusterModule>, BTreeSet<String>);

/// The kernels each module is served for, per generation (a rollout serves several at
/// once), gathered one cluster at a time.
#[derive(Debug, Default)]
pub struct ServedKernels {
    served: BTreeMap<(String, Option<i64>), Served>,
}

impl ServedKernels {
    /// One cluster: `modules` as it is served them (at their revisions), its kernels and
    /// node statuses.
    pub fn add_cluster(
        &mut self,
        modules: &[Arc<ManagedClusterModule>],
        facts: Option<ClusterFacts<'_>>,
        statuses: &NodeStatuses,
        kernels: &BTreeSet<String>,
    ) {
        // Modules only waiting for an unload's confirmation are unloads: they need no image.
        for input in cluster_modules(modules, facts, statuses, &|_, _| false) {
            if input.unload {
                continue;
            }
            let key = (input.module.name_any(), input.module.metadata.generation);
            let served = &mut self
                .served
                .entry(key)
                .or_insert_with(|| (input.module.clone(), BTreeSet::new()))
                .1;
            // Most clusters run kernels seen already: look before copying.
            for kernel in kernels {
                if !served.contains(kernel) {
                    served.insert(kernel.clone());
                }
            }
        }
    }

    /// The images needed: every served module for its kernels, then what the preflights
    /// ask of the (current) `modules` that no cluster needs yet. Resolutions come from the
    /// cache, compiled once per generation.
    pub fn needs<'p>(
        self,
        modules: &[Arc<ManagedClusterModule>],
        preflights: impl IntoIterator<Item = &'p PreflightValidation>,
        resolutions: &mut Resolutions,
        follow: Option<Duration>,
    ) -> BTreeMap<ImageKey, ImageNeed> {
        let mut needs: BTreeMap<ImageKey, ImageNeed> = self
            .served
            .values()
            .flat_map(|(module, kernels)| {
                module_needs(
                    module,
                    resolutions.resolve(module, kernels),
                    kernels,
                    follow,
                )
            })
            .collect();
        // A kernel clusters run keeps its needs.
        for preflight in preflights {
            let spec = &preflight.spec;
            let kernel = BTreeSet::from([spec.kernel_version.clone()]);
            for module in modules.iter().filter(|m| !is_deleting(m)) {
                let resolved = resolutions.resolve(module, &kernel);
                for (key, need) in preflight_needs(
                    module,
                    resolved,
                    &spec.kernel_version,
                    spec.push_built_image,
                ) {
                    needs.entry(key).or_insert(need);
                }
            }
        }
        needs
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use kmm_api::testing::ModuleBuilder;

    use super::*;
    use crate::fleet::assignment::FINALIZER;
    use crate::fleet::placements::Placed;

    fn mcm(name: &str, generation: i64, env: &str) -> Arc<ManagedClusterModule> {
        Arc::new(
            ModuleBuilder::new(name)
                .uid(name)
                .generation(generation)
                .finalizers(&[FINALIZER])
                .selector(&[("env", env)])
                .kernel_mappings(serde_json::json!([{
                    "regexp": ".*",
                    "containerImage": format!("r/{name}:$KERNEL_FULL_VERSION"),
                }]))
                .build(),
        )
    }

    fn kernels(releases: &[&str]) -> BTreeSet<String> {
        releases.iter().map(|k| (*k).to_owned()).collect()
    }

    fn needed(needs: &BTreeMap<ImageKey, ImageNeed>) -> Vec<(String, Vec<String>)> {
        needs
            .iter()
            .map(|(key, need)| (key.image.clone(), need.kernels.iter().cloned().collect()))
            .collect()
    }

    #[test]
    fn each_selected_module_needs_an_image_per_kernel_its_clusters_run() {
        let prod = BTreeMap::from([("env".to_owned(), "prod".to_owned())]);
        let placed = Placed::new();
        let facts = Some(ClusterFacts {
            labels: &prod,
            placed: &placed,
            excuses: &Default::default(),
        });
        let modules = [mcm("a", 1, "prod"), mcm("b", 1, "test")];
        let mut served = ServedKernels::default();
        let none = NodeStatuses::default();
        served.add_cluster(&modules, facts, &none, &kernels(&["6.1", "6.2"]));
        served.add_cluster(&modules, facts, &none, &kernels(&["6.2", "6.3"]));
        let needs = served.needs(&modules, [], &mut Resolutions::default(), None);
        // `b` selects no cluster: it is unloaded, or not sent at all, and needs nothing.
        assert_eq!(
            needed(&needs),
            [
                ("r/a:6.1".to_owned(), vec!["6.1".to_owned()]),
                ("r/a:6.2".to_owned(), vec!["6.2".to_owned()]),
                ("r/a:6.3".to_owned(), vec!["6.3".to_owned()]),
            ]
        );
    }

    #[test]
    fn a_preflight_adds_its_kernel_for_every_module_not_being_deleted() {
        let modules = [mcm("a", 1, "prod")];
        let preflight: PreflightValidation = serde_json::from_value(serde_json::json!({
            "apiVersion": "hub.kmm.sigs.x-k8s.io/v1beta1",
            "kind": "PreflightValidation",
            "metadata": {"name": "next"},
            "spec": {"kernelVersion": "6.9"},
        }))
        .unwrap();
        let needs = ServedKernels::default().needs(
            &modules,
            [&preflight],
            &mut Resolutions::default(),
            None,
        );
        assert_eq!(
            needed(&needs),
            [("r/a:6.9".to_owned(), vec!["6.9".to_owned()])]
        );
    }
}
