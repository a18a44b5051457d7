//! A PreflightValidation's answer for one module: would nodes on kernel K load it? Pure.
//!
//! The kernel is resolved with the module's current spec; each image it needs is what the
//! hub's image worker makes of it, as for a kernel a cluster reported: found (and pinned),
//! missing, or, with `pushBuiltImage`, built and signed now. Without `pushBuiltImage` the
//! worker only looks: the need it gets carries no build or sign recipe, so nothing is
//! pushed. The preflight's needs never reach a cluster's snapshot.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kmm_api::{ManagedClusterModule, PreflightModuleStatus, PreflightValidation};
use kmm_resolver::ResolveErrorKind;
use kube::ResourceExt;

use super::assignment::is_deleting;
use crate::images::record::{ImageRecord, ImageState};
use crate::images::{ImageKey, ImageNeed, module_needs};
use crate::resolutions::{ModuleResolutions, Resolutions};

/// The image needs a preflight for `kernel` adds for `module` (`resolved`: its cached
/// resolutions, holding the kernel); with `push` false, without their recipes, so that
/// the worker checks and never builds or signs.
pub fn preflight_needs(
    module: &ManagedClusterModule,
    resolved: &ModuleResolutions,
    kernel: &str,
    push: bool,
) -> BTreeMap<ImageKey, ImageNeed> {
    // A kernel no cluster runs yet: checked (and built) ahead, not followed.
    let mut needs = module_needs(module, resolved, &BTreeSet::from([kernel.to_owned()]), None);
    if !push {
        for need in needs.values_mut() {
            need.build = None;
            need.sign = None;
        }
    }
    needs
}

/// What the hub knows of one module for the kernel.
#[derive(Clone, Debug, PartialEq)]
pub enum Finding<'a> {
    /// The spec gives the kernel no image: the resolver's reason and message.
    Unresolved(String),
    /// The images the kernel needs, each with whether the module could make it (a build
    /// or sign recipe) and the worker's record so far.
    Images(Vec<(&'a ImageKey, bool, Option<&'a ImageRecord>)>),
}

/// The verdict: (verified, reason, stage).
pub fn verdict(finding: &Finding<'_>, push: bool) -> (bool, String, &'static str) {
    let images = match finding {
        Finding::Unresolved(why) => return (false, why.clone(), "Done"),
        Finding::Images(images) => images,
    };
    let verdicts = images
        .iter()
        .map(|(key, recipe, record)| {
            let image = &key.image;
            let Some(record) = record else {
                return (false, format!("checking {image}"), "Image");
            };
            let detail = |record: &ImageRecord| {
                if record.message.is_empty() {
                    record.reason.clone()
                } else {
                    format!("{}: {}", record.reason, record.message)
                }
            };
            match record.state {
                ImageState::Exists => (true, format!("{image} exists"), "Done"),
                ImageState::NeedsBuild | ImageState::Building => {
                    (false, format!("building {image}"), "Build")
                }
                ImageState::NeedsSign | ImageState::Signing => {
                    (false, format!("signing {image}"), "Sign")
                }
                ImageState::NotFound if *recipe && !push => (
                    false,
                    format!(
                        "{image} is missing; the module would build or sign it once a node runs \
                     the kernel (pushBuiltImage makes it now)"
                    ),
                    "Done",
                ),
                ImageState::NotFound => (false, detail(record), "Done"),
                // Only the clusters, each with its own credentials and CAs, can tell.
                ImageState::SpokeResolved => (false, detail(record), "Done"),
                // The worker retries after its backoff.
                ImageState::Failed => (false, detail(record), "Requeued"),
            }
        })
        .collect::<Vec<_>>();
    if verdicts.is_empty() {
        return (true, "the kernel needs no image".to_owned(), "Done");
    }
    let verified = verdicts.iter().all(|(ok, ..)| *ok);
    let stage = verdicts
        .iter()
        .filter(|(ok, ..)| !ok)
        .map(|(.., stage)| *stage)
        .find(|stage| *stage != "Done")
        .unwrap_or("Done");
    let reasons: Vec<String> = verdicts.into_iter().map(|(_, reason, _)| reason).collect();
    (verified, reasons.join("; "), stage)
}

/// One module's status entry; its transition time moves only when the verdict does.
pub fn module_status(
    module: &ManagedClusterModule,
    finding: &Finding<'_>,
    push: bool,
    previous: Option<&PreflightModuleStatus>,
    now: Timestamp,
) -> PreflightModuleStatus {
    let (ok, reason, stage) = verdict(finding, push);
    let verification_status = if ok { "True" } else { "False" }.to_owned();
    let unchanged = previous.filter(|p| {
        p.verification_status == verification_status
            && p.status_reason == reason
            && p.verification_stage == stage
    });
    PreflightModuleStatus {
        name: module.metadata.name.clone().unwrap_or_default(),
        namespace: module.spec.spoke_namespace.clone(),
        verification_status,
        status_reason: reason,
        verification_stage: stage.to_owned(),
        last_transition_time: unchanged.map_or(Time(now), |p| p.last_transition_time.clone()),
    }
}

/// Every module's answer for `preflight`, in the order of `modules`; a module being
/// deleted has none. `records` are the image worker's.
pub fn preflight_statuses(
    preflight: &PreflightValidation,
    modules: &[Arc<ManagedClusterModule>],
    records: &BTreeMap<ImageKey, ImageRecord>,
    resolutions: &mut Resolutions,
    now: Timestamp,
) -> Vec<PreflightModuleStatus> {
    let kernel = preflight.spec.kernel_version.as_str();
    let push = preflight.spec.push_built_image;
    let kernels = BTreeSet::from([kernel.to_owned()]);
    let previous = preflight
        .status
        .as_ref()
        .map_or(&[][..], |s| &s.modules[..]);
    modules
        .iter()
        .filter(|m| !is_deleting(m))
        .map(|module| {
            let name = module.name_any();
            let resolved = resolutions.resolve(module, &kernels);
            let unresolved = match (resolved.invalid(), resolved.kernel(kernel)) {
                (Some(errors), _) => Some(format!("InvalidSpec: {errors}")),
                // A module with only a device plugin loads nothing, on any kernel.
                (None, Some(Err(e))) if e.kind == ResolveErrorKind::NoModuleLoader => None,
                (None, Some(Err(e))) => Some(format!("{}: {e}", e.kind.reason())),
                _ => None,
            };
            let recipes = preflight_needs(module, resolved, kernel, true);
            let finding = match unresolved {
                Some(why) => Finding::Unresolved(why),
                None => Finding::Images(
                    recipes
                        .iter()
                        .map(|(key, need)| {
                            let recipe = need.build.is_some() || need.sign.is_some();
                            (key, recipe, records.get(key))
                        })
                        .collect(),
                ),
            };
            let before = previous.iter().find(|p| p.name == name);
            module_status(module, &finding, push, before, now)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use kmm_api::testing::ModuleBuilder;

    use super::*;
    use crate::images::Next;
    use crate::resolutions::Resolutions;

    const KERNEL: &str = "6.1.0-9-amd64";

    fn mcm() -> ManagedClusterModule {
        ModuleBuilder::new("hello")
            .uid("u-1")
            .without("/metadata/generation")
            .kernel_mappings(serde_json::json!([{
                "regexp": "^6\\.1\\.",
                "containerImage": "r.example/hello:${KERNEL_FULL_VERSION}",
                "build": {"dockerfileConfigMap": {"name": "dockerfile"}},
            }]))
            .build()
    }

    fn record(need: &ImageNeed, state: ImageState, reason: &str) -> ImageRecord {
        ImageRecord {
            state,
            digest: None,
            reason: reason.into(),
            message: String::new(),
            need: need.clone(),
            failures: 0,
            then: Next::Check,
            next_at: Timestamp::UNIX_EPOCH,
            since: Timestamp::UNIX_EPOCH,
            pinned_at: 0,
            earlier: Vec::new(),
        }
    }

    /// The sample module's preflight needs for `kernel`, resolved afresh.
    fn preflight(kernel: &str, push: bool) -> BTreeMap<ImageKey, ImageNeed> {
        let module = mcm();
        let mut resolutions = Resolutions::default();
        let resolved = resolutions.resolve(&module, &BTreeSet::from([kernel.to_owned()]));
        preflight_needs(&module, resolved, kernel, push)
    }

    #[test]
    fn without_push_the_worker_gets_no_recipe_and_builds_nothing() {
        let checked = preflight(KERNEL, false);
        let need = checked.values().next().expect("one image");
        assert!(need.build.is_none() && need.sign.is_none());
        assert_eq!(need.kernels, BTreeSet::from([KERNEL.to_owned()]));
        let pushed = preflight(KERNEL, true);
        assert!(pushed.values().next().unwrap().build.is_some());
        assert!(preflight("5.14.0", true).is_empty());
    }

    #[test]
    fn each_image_state_gives_a_verdict_and_a_stage() {
        let needs = preflight(KERNEL, true);
        let (key, need) = needs.iter().next().unwrap();
        let with = |record: Option<&ImageRecord>, push: bool| {
            verdict(&Finding::Images(vec![(key, true, record)]), push)
        };
        assert_eq!(
            with(None, true),
            (false, format!("checking {}", key.image), "Image")
        );
        let exists = ImageRecord::seeded(need, "sha256:1".into(), Timestamp::UNIX_EPOCH);
        assert_eq!(
            with(Some(&exists), true),
            (true, format!("{} exists", key.image), "Done")
        );
        let building = record(need, ImageState::Building, "Building");
        assert_eq!(with(Some(&building), true).2, "Build");
        let signing = record(need, ImageState::NeedsSign, "NeedsSign");
        assert_eq!(with(Some(&signing), true).2, "Sign");
        let failed = record(need, ImageState::Failed, "BuildFailed");
        assert_eq!(
            with(Some(&failed), true),
            (false, "BuildFailed".into(), "Requeued")
        );
        let missing = record(need, ImageState::NotFound, "ImageNotFound");
        let (ok, reason, stage) = with(Some(&missing), false);
        assert!(!ok && stage == "Done");
        assert!(reason.contains("pushBuiltImage makes it now"), "{reason}");
        assert_eq!(
            verdict(
                &Finding::Unresolved("NoKernelMapping: no mapping".into()),
                true
            ),
            (false, "NoKernelMapping: no mapping".into(), "Done")
        );
    }

    #[test]
    fn the_transition_time_moves_only_with_the_verdict() {
        let module = mcm();
        let unresolved = Finding::Unresolved("NoKernelMapping".into());
        let then = Timestamp::from_second(1_800_000_000).unwrap();
        let first = module_status(&module, &unresolved, false, None, then);
        assert_eq!(
            (first.name.as_str(), first.namespace.as_str()),
            ("hello", "drivers")
        );
        assert_eq!(first.verification_status, "False");
        let later = then + std::time::Duration::from_secs(60);
        let same = module_status(&module, &unresolved, false, Some(&first), later);
        assert_eq!(same, first);
        let other = Finding::Unresolved("InvalidSpec".into());
        let moved = module_status(&module, &other, false, Some(&first), later);
        assert_eq!(moved.last_transition_time, Time(later));
    }

    #[test]
    fn a_module_with_only_a_device_plugin_is_verified_on_any_kernel() {
        let plugin_only = ModuleBuilder::new("plugin")
            .without("/spec/moduleSpec/moduleLoader")
            .with(
                "/spec/moduleSpec/devicePlugin/container/image",
                "r.example/plugin:1",
            )
            .build();
        let preflight = PreflightValidation::new(
            "to-6.1.0-99",
            kmm_api::PreflightValidationSpec {
                kernel_version: "6.1.0-99-amd64".into(),
                push_built_image: true,
            },
        );
        let statuses = preflight_statuses(
            &preflight,
            &[Arc::new(plugin_only), Arc::new(mcm())],
            &BTreeMap::new(),
            &mut Resolutions::default(),
            Timestamp::UNIX_EPOCH,
        );
        let plugin = &statuses[0];
        assert_eq!(
            (
                plugin.verification_status.as_str(),
                plugin.status_reason.as_str(),
                plugin.verification_stage.as_str()
            ),
            ("True", "the kernel needs no image", "Done")
        );
        assert_eq!(
            statuses[1].verification_status, "False",
            "{:?}",
            statuses[1]
        );
    }
}
