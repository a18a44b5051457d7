//! Every module's resolution per kernel, computed once per module generation: resolving
//! validates the spec and compiles its mappings' regexps, which recomputing a snapshot for
//! each of thousands of clusters must not repeat. Pure.
//!
//! The kernels come from proxies, so what is cached for them is bounded: kernels no
//! cluster reports any more are forgotten ([`Resolutions::retain_kernels`]), and a
//! generation never holds more than [`MAX_KERNELS_PER_GENERATION`].

use std::collections::{BTreeSet, HashMap};

use kmm_api::ManagedClusterModule;
use kmm_resolver::{ModuleIdentity, Resolution, ResolveError, Resolver, validate};
use kube::ResourceExt;

/// What resolving one module gave, for the kernels asked so far.
#[derive(Debug, Default)]
pub struct ModuleResolutions {
    uid: Option<String>,
    generation: Option<i64>,
    /// Whether the spec was validated (it is, at the latest, when a kernel is resolved).
    validated: bool,
    /// The spec's validation errors: no kernel resolves.
    invalid: Option<String>,
    kernels: HashMap<String, Result<Resolution, ResolveError>>,
}

impl ModuleResolutions {
    /// Why the spec resolves for no kernel, when it is invalid.
    pub fn invalid(&self) -> Option<&str> {
        self.invalid.as_deref()
    }

    /// The resolution for `kernel`; `None` when it was never asked for.
    pub fn kernel(&self, kernel: &str) -> Option<&Result<Resolution, ResolveError>> {
        self.kernels.get(kernel)
    }

    fn is_for(&self, module: &ManagedClusterModule) -> bool {
        self.uid == module.metadata.uid && self.generation == module.metadata.generation
    }

    fn missing<'k>(&self, kernels: &'k BTreeSet<String>) -> Vec<&'k String> {
        if self.invalid.is_some() {
            return Vec::new();
        }
        kernels
            .iter()
            .filter(|k| !self.kernels.contains_key(k.as_str()))
            .collect()
    }
}

/// Generations of one module resolved side by side: a rollout serves the current spec to
/// some clusters and earlier ones to others, and alternating between them must not
/// resolve each afresh.
const GENERATIONS_KEPT: usize = 4;

/// The most kernels one module generation keeps resolutions for. A generation about to
/// hold more forgets those the current request does not ask for: a proxy cycling through
/// made-up kernels between two sweeps of [`Resolutions::retain_kernels`] cannot grow it,
/// while a fleet's real kernels (hundreds at most) always fit.
pub const MAX_KERNELS_PER_GENERATION: usize = 4_096;

/// The resolutions of every module, by name: the generations used last, most recent last.
#[derive(Debug, Default)]
pub struct Resolutions {
    modules: HashMap<String, Vec<ModuleResolutions>>,
}

impl Resolutions {
    /// The module's resolutions for at least `kernels`: a kernel is resolved once, and a
    /// module's spec validated and its mappings compiled at most once per generation.
    pub fn resolve(
        &mut self,
        module: &ManagedClusterModule,
        kernels: &BTreeSet<String>,
    ) -> &ModuleResolutions {
        let name = module.name_any();
        let entry = self.generation(module);
        let missing = entry.missing(kernels);
        if entry.kernels.len() + missing.len() > MAX_KERNELS_PER_GENERATION {
            entry.kernels.retain(|kernel, _| kernels.contains(kernel));
        }
        if !missing.is_empty() {
            match Resolver::new(&module.spec.module_spec, identity(&name, module)) {
                Err(errors) => entry.invalid = Some(errors.to_string()),
                Ok(resolver) => {
                    for kernel in missing {
                        entry
                            .kernels
                            .insert(kernel.clone(), resolver.resolve(kernel));
                    }
                }
            }
            entry.validated = true;
        }
        entry
    }

    /// Why the module's spec is invalid, when it is: validated once per generation, and
    /// shared with the resolutions (which an invalid spec has none of).
    pub fn invalid(&mut self, module: &ManagedClusterModule) -> Option<&str> {
        let name = module.name_any();
        let entry = self.generation(module);
        if !entry.validated {
            entry.invalid = validate(&module.spec.module_spec, identity(&name, module))
                .err()
                .map(|errors| errors.to_string());
            entry.validated = true;
        }
        entry.invalid.as_deref()
    }

    /// The cache of the module's generation, made the most recently used.
    fn generation(&mut self, module: &ManagedClusterModule) -> &mut ModuleResolutions {
        let generations = self.modules.entry(module.name_any()).or_default();
        let used = match generations.iter().position(|r| r.is_for(module)) {
            Some(i) => generations.remove(i),
            None => ModuleResolutions {
                uid: module.metadata.uid.clone(),
                generation: module.metadata.generation,
                ..ModuleResolutions::default()
            },
        };
        if generations.len() >= GENERATIONS_KEPT {
            generations.remove(0);
        }
        generations.push(used);
        generations.last_mut().expect("just pushed")
    }

    /// Forgets every module `keep` refuses (deleted modules).
    pub fn retain(&mut self, keep: impl Fn(&str) -> bool) {
        self.modules.retain(|name, _| keep(name));
    }

    /// Forgets the resolutions of every kernel `keep` refuses (kernels no cluster
    /// reports any more), of every module and generation.
    pub fn retain_kernels(&mut self, keep: impl Fn(&str) -> bool) {
        for generation in self.modules.values_mut().flatten() {
            generation.kernels.retain(|kernel, _| keep(kernel));
        }
    }

    /// How many kernel resolutions are cached, over every module and generation.
    pub fn cached_kernels(&self) -> usize {
        self.modules
            .values()
            .flatten()
            .map(|generation| generation.kernels.len())
            .sum()
    }

    /// What the cache holds for the module's current generation.
    #[cfg(test)]
    fn cached(&self, module: &ManagedClusterModule) -> Option<&ModuleResolutions> {
        self.modules
            .get(&module.name_any())?
            .iter()
            .find(|r| r.is_for(module))
    }
}

fn identity<'a>(name: &'a str, module: &'a ManagedClusterModule) -> ModuleIdentity<'a> {
    ModuleIdentity {
        name,
        namespace: &module.spec.spoke_namespace,
        spec_path: "spec.moduleSpec",
    }
}

#[cfg(test)]
mod tests {
    use kmm_api::testing::ModuleBuilder;

    use super::*;

    fn mcm(generation: i64, mapping: &str) -> ManagedClusterModule {
        let mapping: serde_json::Value =
            serde_yaml_ng::from_str(mapping).expect("the test's mapping is YAML");
        ModuleBuilder::new("hello")
            .uid("u1")
            .generation(generation)
            .kernel_mappings(serde_json::json!([mapping]))
            .build()
    }

    fn kernels(list: &[&str]) -> BTreeSet<String> {
        list.iter().map(|k| (*k).to_owned()).collect()
    }

    fn image(r: &mut Resolutions, module: &ManagedClusterModule, kernel: &str) -> String {
        let all = kernels(&[kernel]);
        match r.resolve(module, &all).kernel(kernel).unwrap() {
            Ok(resolution) => resolution.container_image.clone(),
            Err(e) => e.kind.reason().to_owned(),
        }
    }

    #[test]
    fn resolves_each_kernel_once_per_generation() {
        let one = mcm(
            1,
            "{regexp: 'amd64$', containerImage: 'r/x:${KERNEL_FULL_VERSION}'}",
        );
        let mut r = Resolutions::default();
        let first = kernels(&["6.1.0-13-amd64", "5.14.0-1.el9.aarch64"]);
        assert!(r.cached(&one).is_none());
        r.resolve(&one, &first);
        let cached = r.cached(&one).unwrap();
        assert_eq!(cached.kernels.len(), 2);
        assert!(
            cached.kernel("6.6.0-1-amd64").is_none(),
            "only what was asked"
        );
        assert_eq!(image(&mut r, &one, "6.1.0-13-amd64"), "r/x:6.1.0-13-amd64");
        assert_eq!(
            image(&mut r, &one, "5.14.0-1.el9.aarch64"),
            "NoKernelMapping"
        );
        assert_eq!(image(&mut r, &one, "6.6.0-1-amd64"), "r/x:6.6.0-1-amd64");
        assert_eq!(
            r.cached(&one).unwrap().kernels.len(),
            3,
            "a new kernel is added"
        );

        let two = mcm(2, "{literal: '6.6.0-1-amd64', containerImage: 'r/y:1'}");
        assert!(
            r.cached(&two).is_none(),
            "another generation is not this one's"
        );
        assert_eq!(image(&mut r, &two, "6.6.0-1-amd64"), "r/y:1");
        assert_eq!(image(&mut r, &two, "6.1.0-13-amd64"), "NoKernelMapping");
        assert_eq!(
            r.cached(&one).unwrap().kernels.len(),
            3,
            "the earlier generation is kept: a rollout may serve both"
        );
        assert_eq!(r.cached(&two).unwrap().kernels.len(), 2);
        for generation in 3..=5 {
            r.resolve(
                &mcm(generation, "{literal: '6.1', containerImage: 'r/z:1'}"),
                &first,
            );
        }
        assert!(
            r.cached(&one).is_none(),
            "at most {GENERATIONS_KEPT} generations: the least recently used goes"
        );
        assert!(r.cached(&two).is_some());

        r.retain(|_| false);
        assert!(r.cached(&two).is_none());
    }

    #[test]
    fn kernels_no_cluster_reports_any_more_are_forgotten() {
        let one = mcm(
            1,
            "{regexp: '.*', containerImage: 'r/x:${KERNEL_FULL_VERSION}'}",
        );
        let mut r = Resolutions::default();
        r.resolve(&one, &kernels(&["6.1", "6.2", "junk1", "junk2"]));
        assert_eq!(r.cached_kernels(), 4);
        r.retain_kernels(|kernel| kernel.starts_with("6."));
        assert_eq!(r.cached_kernels(), 2);
        assert!(r.cached(&one).unwrap().kernel("junk1").is_none());
        assert_eq!(image(&mut r, &one, "6.2"), "r/x:6.2", "the rest stay");
    }

    #[test]
    fn a_generation_never_caches_more_than_its_bound_of_kernels() {
        let one = mcm(
            1,
            "{regexp: '.*', containerImage: 'r/x:${KERNEL_FULL_VERSION}'}",
        );
        let mut r = Resolutions::default();
        // A proxy sending a new batch of made-up kernels each time.
        for batch in 0..10 {
            let junk: BTreeSet<String> = (0..1_000).map(|i| format!("6.{batch}.{i}")).collect();
            let resolved = r.resolve(&one, &junk);
            assert!(junk.iter().all(|k| resolved.kernel(k).is_some()));
            assert!(
                r.cached_kernels() <= MAX_KERNELS_PER_GENERATION,
                "{}",
                r.cached_kernels()
            );
        }
    }

    #[test]
    fn an_invalid_spec_is_validated_once_and_resolves_nothing() {
        let invalid = mcm(1, "{regexp: '(', containerImage: 'r/x:1'}");
        let mut r = Resolutions::default();
        let resolutions = r.resolve(&invalid, &kernels(&["6.1.0-13-amd64"]));
        assert!(resolutions.invalid().unwrap().contains("regexp"));
        assert!(resolutions.kernel("6.1.0-13-amd64").is_none());
    }

    #[test]
    fn a_generation_is_validated_once_and_its_errors_are_those_a_kernel_would_get() {
        let broken = mcm(1, "{regexp: '(', containerImage: 'r/x:1'}");
        let mut r = Resolutions::default();
        let why = r
            .invalid(&broken)
            .expect("an unparsable regexp is invalid")
            .to_owned();
        assert!(why.contains("regexp"), "{why}");
        assert!(r.cached(&broken).unwrap().validated);
        // Resolving later shares the verdict rather than validating again.
        let resolved = r.resolve(&broken, &kernels(&["6.1"]));
        assert_eq!(resolved.invalid(), Some(why.as_str()));
        let fine = mcm(2, "{literal: '6.1', containerImage: 'r/x:1'}");
        assert_eq!(r.invalid(&fine), None);
        assert!(
            r.cached(&fine).unwrap().kernels.is_empty(),
            "validating resolves nothing"
        );
    }
}
