//! Which kmod images the fleet needs: every selected module resolved for every kernel
//! its clusters reported, one entry per (module, image), with what it takes to produce
//! the image when the registry does not have it. Pure.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use kmm_api::{Build, ManagedClusterModule, TlsOptions};
use kmm_registry::RegistryTls;
use kube::ResourceExt;
use sha2::{Digest, Sha256};

use crate::resolutions::ModuleResolutions;

/// One image of one module. Two modules naming the same image are tracked apart: their
/// build and sign settings, and their pull secrets, may differ.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ImageKey {
    /// The ManagedClusterModule's name.
    pub module: String,
    /// The resolved image reference nodes load.
    pub image: String,
}

/// What the fleet needs of one image.
#[derive(Clone, Debug, PartialEq)]
pub struct ImageNeed {
    pub module_uid: String,
    /// `MOD_NAMESPACE`.
    pub spoke_namespace: String,
    /// The kernels whose nodes load this image, sorted; a build targets the first.
    pub kernels: BTreeSet<String>,
    pub tls: RegistryTls,
    /// The module's `imageRepoSecret`: pulls, checks and pushes use it.
    pub pull_secret: Option<String>,
    /// How to build the image (or, when signing too, the unsigned image) when missing.
    pub build: Option<Build>,
    /// How to sign the image when missing.
    pub sign: Option<SignPlan>,
    /// `imageRebuildTriggerGeneration`.
    pub rebuild_generation: i64,
    /// How often the tag is resolved again, to follow it when it moves: set for a module
    /// whose `imagePullPolicy` is `Always`.
    pub follow_interval: Option<Duration>,
    /// The module's pin generation now (see `record::ImageRecord::pinned_at`): a moved
    /// tag's new digest is pinned at the next one.
    pub pin_generation: i64,
    /// A fingerprint of what the hub reaches the registry with besides the spec: its
    /// extra CAs and the contents of the Secrets the image names ([`ImageNeed::secrets`]).
    /// Filled in by the image worker, which reads them; 0 until then. A new one is worth
    /// a look at once, whatever the backoff: a CA or a Secret added is what fixes a
    /// failing check.
    pub access: u64,
}

#[cfg(any(test, feature = "testing"))]
impl ImageNeed {
    /// Module `u` in `drivers` needing the image for `kernels`, with nothing to build,
    /// sign or follow: what tests start from.
    pub fn for_kernels<'a>(kernels: impl IntoIterator<Item = &'a str>) -> Self {
        Self {
            module_uid: "u".into(),
            spoke_namespace: "drivers".into(),
            kernels: kernels.into_iter().map(str::to_owned).collect(),
            tls: Default::default(),
            pull_secret: None,
            build: None,
            sign: None,
            rebuild_generation: 0,
            follow_interval: None,
            pin_generation: 0,
            access: 0,
        }
    }
}

impl ImageNeed {
    /// The Secrets (hub namespace) the hub's work on the image reads: the pull secret,
    /// and the signing key and certificate.
    pub fn secrets(&self) -> impl Iterator<Item = &str> {
        let signing = self
            .sign
            .iter()
            .flat_map(|s| [s.key_secret.as_str(), s.cert_secret.as_str()]);
        self.pull_secret.as_deref().into_iter().chain(signing)
    }

    /// The kernel a build of this image targets.
    pub fn build_kernel(&self) -> &str {
        self.kernels.first().map(String::as_str).unwrap_or_default()
    }

    /// Where a build pushes: the unsigned image when the result is signed afterwards.
    pub fn build_target<'a>(&'a self, image: &'a str) -> &'a str {
        self.sign
            .as_ref()
            .map_or(image, |sign| sign.unsigned_image.as_str())
    }
}

/// How to produce the signed image from an unsigned one.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SignPlan {
    /// The image whose modules are signed: `unsignedImage`, or the build's output.
    pub unsigned_image: String,
    pub unsigned_tls: RegistryTls,
    /// Secret (hub namespace) with the private key under `key`.
    pub key_secret: String,
    /// Secret (hub namespace) with the certificate under `cert`.
    pub cert_secret: String,
    /// Absolute paths in the image, variables substituted.
    pub files: Vec<String>,
}

/// The images `module` needs for `kernels`, from its cached resolutions (`resolved`,
/// which must hold those kernels). Kernels that do not resolve need nothing: their nodes
/// report the resolver's reason instead. `follow` is how often the hub resolves the tags
/// of `imagePullPolicy: Always` images again (`None`: never).
pub fn module_needs(
    module: &ManagedClusterModule,
    resolved: &ModuleResolutions,
    kernels: &BTreeSet<String>,
    follow: Option<Duration>,
) -> BTreeMap<ImageKey, ImageNeed> {
    let name = module.name_any();
    let spec = &module.spec.module_spec;
    if resolved.invalid().is_some() {
        return BTreeMap::new();
    }
    let follow_interval = follow.filter(|_| follows_tags(module));
    let pull_secret = spec
        .image_repo_secret
        .as_ref()
        .map(|s| s.name.clone())
        .filter(|n| !n.is_empty());
    let mut needs: BTreeMap<ImageKey, ImageNeed> = BTreeMap::new();
    for kernel in kernels {
        let Some(Ok(resolution)) = resolved.kernel(kernel) else {
            continue;
        };
        let key = ImageKey {
            module: name.clone(),
            image: resolution.container_image.clone(),
        };
        if let Some(need) = needs.get_mut(&key) {
            need.kernels.insert(kernel.clone());
            continue;
        }
        let sign = resolution.sign.as_ref().map(|sign| SignPlan {
            unsigned_image: match (&resolution.build, &sign.unsigned_image) {
                // Build then sign: the build's output is an intermediate image.
                (Some(_), _) | (None, None) => unsigned_image_name(
                    &resolution.container_image,
                    &module.spec.spoke_namespace,
                    &name,
                ),
                (None, Some(image)) => image.clone(),
            },
            unsigned_tls: tls(sign.unsigned_image_registry_tls.as_ref()),
            key_secret: sign.key_secret.name.clone(),
            cert_secret: sign.cert_secret.name.clone(),
            files: sign.files_to_sign.clone().unwrap_or_default(),
        });
        needs.insert(
            key,
            ImageNeed {
                module_uid: module.uid().unwrap_or_default(),
                spoke_namespace: module.spec.spoke_namespace.clone(),
                kernels: BTreeSet::from([kernel.clone()]),
                tls: tls(resolution.registry_tls.as_ref()),
                pull_secret: pull_secret.clone(),
                build: resolution.build.clone(),
                sign,
                rebuild_generation: spec.image_rebuild_trigger_generation.unwrap_or_default(),
                follow_interval,
                pin_generation: pin_generation(module),
                access: 0,
            },
        );
    }
    needs
}

/// Whether the hub follows the module's tags (`imagePullPolicy: Always`); with any other
/// policy, or none, the digest pinned first holds.
pub fn follows_tags(module: &ManagedClusterModule) -> bool {
    module
        .spec
        .module_spec
        .module_loader
        .as_ref()
        .and_then(|loader| loader.container.image_pull_policy.as_deref())
        == Some("Always")
}

/// The pin generation the module's status records (0: no tag move followed yet).
pub fn pin_generation(module: &ManagedClusterModule) -> i64 {
    module
        .status
        .as_ref()
        .and_then(|s| s.pin_generation)
        .unwrap_or_default()
}

fn tls(options: Option<&TlsOptions>) -> RegistryTls {
    options.map_or_else(RegistryTls::default, |o| RegistryTls {
        insecure: o.insecure.unwrap_or_default(),
        insecure_skip_tls_verify: o.insecure_skip_tls_verify.unwrap_or_default(),
    })
}

/// Longest tag the OCI distribution spec allows.
const MAX_TAG: usize = 128;

/// The intermediate image a build pushes to when its output is signed afterwards, named
/// as upstream KMM names it: `<repository>:<tag>-<namespace>_<module>_kmm_unsigned`. A
/// tag that would exceed the spec's 128 characters is shortened with a hash, so that two
/// long names never share one intermediate image.
pub fn unsigned_image_name(image: &str, namespace: &str, module: &str) -> String {
    let without_digest = image.split_once('@').map_or(image, |(name, _)| name);
    let last_slash = without_digest.rfind('/').map_or(0, |i| i + 1);
    let (repository, tag) = match without_digest[last_slash..].rfind(':') {
        Some(colon) => (
            &without_digest[..last_slash + colon],
            &without_digest[last_slash + colon + 1..],
        ),
        None => (without_digest, "latest"),
    };
    let mut tag = format!("{tag}-{namespace}_{module}_kmm_unsigned");
    if tag.len() > MAX_TAG {
        let hash = Sha256::digest(tag.as_bytes());
        let suffix: String = hash[..8].iter().map(|b| format!("{b:02x}")).collect();
        tag.truncate(MAX_TAG - suffix.len() - 1);
        tag = format!("{tag}-{suffix}");
    }
    format!("{repository}:{tag}")
}

#[cfg(test)]
mod tests {
    use kmm_api::testing::ModuleBuilder;

    use super::*;
    use crate::resolutions::Resolutions;

    /// The module's needs, resolved afresh.
    fn needs_of(
        module: &ManagedClusterModule,
        kernels: &BTreeSet<String>,
    ) -> BTreeMap<ImageKey, ImageNeed> {
        module_needs(
            module,
            Resolutions::default().resolve(module, kernels),
            kernels,
            Some(Duration::from_secs(60)),
        )
    }

    fn mcm(module_spec: &str) -> ManagedClusterModule {
        ModuleBuilder::new("hello")
            .uid("u-1")
            .without("/metadata/generation")
            .module_spec_yaml(module_spec)
            .build()
    }

    fn kernels(list: &[&str]) -> BTreeSet<String> {
        list.iter().map(|k| k.to_string()).collect()
    }

    const BUILD_AND_SIGN: &str = r#"    selector: {}
    imageRepoSecret: {name: push}
    imageRebuildTriggerGeneration: 3
    moduleLoader:
      container:
        modprobe: {moduleName: hello}
        kernelMappings:
          - regexp: '^6\.1\.'
            containerImage: 'r.example/hello:${KERNEL_FULL_VERSION}'
            registryTLS: {insecure: true}
            build: {dockerfileConfigMap: {name: dockerfile}}
            sign:
              keySecret: {name: key}
              certSecret: {name: cert}
              filesToSign: ['/opt/lib/modules/${KERNEL_FULL_VERSION}/extra/hello.ko']
          - {literal: '5.14.0', containerImage: 'r.example/hello:shared'}
          - {literal: '5.14.1', containerImage: 'r.example/hello:shared'}
"#;

    #[test]
    fn one_need_per_image_with_its_kernels_and_how_to_make_it() {
        let needs = needs_of(
            &mcm(BUILD_AND_SIGN),
            &kernels(&["6.1.0-1-amd64", "5.14.0", "5.14.1", "4.18.0"]),
        );
        assert_eq!(needs.len(), 2, "{needs:#?}");
        let built = &needs[&ImageKey {
            module: "hello".into(),
            image: "r.example/hello:6.1.0-1-amd64".into(),
        }];
        assert_eq!(built.module_uid, "u-1");
        assert_eq!(built.build_kernel(), "6.1.0-1-amd64");
        assert!(built.tls.insecure);
        assert_eq!(built.pull_secret.as_deref(), Some("push"));
        assert_eq!(built.rebuild_generation, 3);
        let sign = built.sign.as_ref().expect("signed");
        assert_eq!(
            sign.unsigned_image,
            "r.example/hello:6.1.0-1-amd64-drivers_hello_kmm_unsigned"
        );
        assert_eq!(
            built.build_target("r.example/hello:6.1.0-1-amd64"),
            sign.unsigned_image
        );
        assert_eq!(
            sign.files,
            ["/opt/lib/modules/6.1.0-1-amd64/extra/hello.ko"]
        );
        assert_eq!(
            (sign.key_secret.as_str(), sign.cert_secret.as_str()),
            ("key", "cert")
        );
        let shared = &needs[&ImageKey {
            module: "hello".into(),
            image: "r.example/hello:shared".into(),
        }];
        assert_eq!(shared.kernels, kernels(&["5.14.0", "5.14.1"]));
        assert!(shared.build.is_none() && shared.sign.is_none());
        assert_eq!(
            shared.build_target("r.example/hello:shared"),
            "r.example/hello:shared"
        );
    }

    #[test]
    fn only_always_follows_the_tag() {
        let with_policy = |policy: Option<&str>| {
            let policy =
                policy.map_or(String::new(), |p| format!("        imagePullPolicy: {p}\n"));
            mcm(&format!(
                "    selector: {{}}\n    moduleLoader:\n      container:\n{policy}        modprobe: {{moduleName: hello}}\n        kernelMappings: [{{regexp: '.', containerImage: r.example/hello:v1}}]\n"
            ))
        };
        let follows = |policy| {
            let needs = needs_of(&with_policy(policy), &kernels(&["6.1.0"]));
            needs.values().next().expect("one image").follow_interval
        };
        assert_eq!(follows(Some("Always")), Some(Duration::from_secs(60)));
        for held in [Some("IfNotPresent"), Some("Never"), None] {
            assert_eq!(follows(held), None, "{held:?}: the pin holds");
        }
        let module = with_policy(Some("Always"));
        let kernels = kernels(&["6.1.0"]);
        let mut resolutions = Resolutions::default();
        let never = module_needs(
            &module,
            resolutions.resolve(&module, &kernels),
            &kernels,
            None,
        );
        assert_eq!(
            never.values().next().unwrap().follow_interval,
            None,
            "a hub that follows no tag"
        );
    }

    #[test]
    fn an_invalid_spec_needs_nothing() {
        let broken = mcm(
            "    selector: {}\n    moduleLoader:\n      container:\n        modprobe: {}\n        kernelMappings: [{regexp: '('}]\n",
        );
        assert!(needs_of(&broken, &kernels(&["6.1.0"])).is_empty());
    }

    #[test]
    fn unsigned_names_follow_upstream_and_stay_valid_tags() {
        assert_eq!(
            unsigned_image_name("r.example:5000/a/b:v1", "ns", "m"),
            "r.example:5000/a/b:v1-ns_m_kmm_unsigned"
        );
        assert_eq!(
            unsigned_image_name("r.example:5000/a/b", "ns", "m"),
            "r.example:5000/a/b:latest-ns_m_kmm_unsigned"
        );
        assert_eq!(
            unsigned_image_name("r/b:v1@sha256:abc", "ns", "m"),
            "r/b:v1-ns_m_kmm_unsigned"
        );
        let long = unsigned_image_name(&format!("r/b:{}", "x".repeat(120)), "ns", "m");
        let tag = long.rsplit_once(':').unwrap().1;
        assert_eq!(tag.len(), MAX_TAG, "{tag}");
        let other = unsigned_image_name(&format!("r/b:{}y", "x".repeat(119)), "ns", "m");
        assert_ne!(long, other, "shortened names stay distinct");
    }
}
