//! What one kmod image build is made of, and the fingerprint that identifies it. Pure.
//!
//! A build is started once per fingerprint: the fingerprint names its Job, so asking for
//! the same build again finds the Job instead of starting another, and any change to what
//! the Job would do (a build argument, the Dockerfile, the builder, a rebuild trigger)
//! gives a new fingerprint and so exactly one new build.

use std::collections::{BTreeMap, BTreeSet};

use kmm_api::{Build, TlsOptions};
use kmm_resolver::kernel::KernelRelease;
use serde::Serialize;
use sha2::{Digest, Sha256};

/// Hex characters of the fingerprint: 128 bits of SHA-256, short enough for a label
/// value (≤ 63) and to fit a Job name beside the module's name.
pub const FINGERPRINT_LENGTH: usize = 32;

/// The build arguments every build gets, as upstream KMM sets them: they win over the
/// module's arguments of the same name.
pub const IMPLICIT_BUILD_ARGS: [&str; 4] = [
    "KERNEL_VERSION",
    "KERNEL_FULL_VERSION",
    "MOD_NAME",
    "MOD_NAMESPACE",
];

/// One kmod image to build and push, as the hub's image pipeline asks for it.
#[derive(Clone, Debug, PartialEq)]
pub struct BuildRequest {
    /// The ManagedClusterModule's name (`MOD_NAME`).
    pub module: String,
    /// The ManagedClusterModule's uid: the Job's owner.
    pub module_uid: String,
    /// The module's namespace on the spokes (`MOD_NAMESPACE`).
    pub spoke_namespace: String,
    /// The kernel release as the node reported it.
    pub kernel: String,
    /// Where the built image is pushed.
    pub image: String,
    /// The build settings, merged for the kernel's mapping.
    pub build: Build,
    /// TLS settings of the pushed image's registry.
    pub registry_tls: Option<TlsOptions>,
    /// The module's `imageRepoSecret`: a Secret in the hub's namespace whose
    /// `.dockerconfigjson` authenticates the pulls and the push.
    pub push_secret: Option<String>,
    /// The Dockerfile: the content of the ConfigMap's key `dockerfile`, read by the caller.
    pub dockerfile: String,
    /// The module's `imageRebuildTriggerGeneration` (0 when unset).
    pub rebuild_generation: i64,
}

/// A registry's TLS settings reduced to what they change: plain HTTP or unverified
/// HTTPS both mean buildah's `--tls-verify=false`.
pub fn tls_verify(tls: Option<&TlsOptions>) -> bool {
    tls.is_none_or(|tls| {
        !tls.insecure.unwrap_or(false) && !tls.insecure_skip_tls_verify.unwrap_or(false)
    })
}

impl BuildRequest {
    /// The kernel with a trailing `+` trimmed, as the resolver's `KERNEL_FULL_VERSION`.
    fn kernel_version(&self) -> String {
        KernelRelease::parse(&self.kernel).normalized().to_owned()
    }

    /// The build arguments the build gets, by name: the module's, merged by name (a later
    /// one of the same name wins, as with repeated `--build-arg`), overridden by the
    /// implicit ones.
    pub fn build_args(&self) -> BTreeMap<String, String> {
        let mut args: BTreeMap<String, String> = self
            .build
            .build_args
            .iter()
            .flatten()
            .map(|arg| (arg.name.clone(), arg.value.clone()))
            .collect();
        let kernel = self.kernel_version();
        for (name, value) in IMPLICIT_BUILD_ARGS.iter().zip([
            kernel.clone(),
            kernel,
            self.module.clone(),
            self.spoke_namespace.clone(),
        ]) {
            args.insert((*name).to_owned(), value);
        }
        args
    }

    /// The build Secrets' names, each once (a mapping's list is appended to the
    /// container's, which may repeat a name), in name order; empty names are dropped.
    pub fn secret_names(&self) -> BTreeSet<String> {
        self.build
            .secrets
            .iter()
            .flatten()
            .map(|s| s.name.clone())
            .filter(|name| !name.is_empty())
            .collect()
    }

    /// Identifies the build: a hash over everything the build's Job depends on, so that
    /// the same inputs always map to the same Job and any change to one maps to a new
    /// Job. Covered: the Dockerfile text, the effective build arguments (implicit ones
    /// included), the image, the kernel, the names of the build Secrets and of the push
    /// Secret (not their contents, which the hub does not watch), both registries' TLS
    /// settings, the node selector, the builder image and the rebuild generation. Not
    /// covered: the module's uid (a recreated module with the same spec builds the same
    /// image) and `kanikoParams` (the builder is buildah).
    pub fn fingerprint(&self, builder_image: &str) -> String {
        #[derive(Serialize)]
        struct Inputs<'a> {
            version: &'static str,
            dockerfile: &'a str,
            build_args: BTreeMap<String, String>,
            image: &'a str,
            kernel: &'a str,
            secrets: BTreeSet<String>,
            push_secret: Option<&'a str>,
            base_tls_verify: bool,
            push_tls_verify: bool,
            selector: BTreeMap<String, String>,
            builder_image: &'a str,
            rebuild_generation: i64,
        }
        let inputs = Inputs {
            // Bump when what the Job does with the same inputs changes.
            version: "kmm-build/1",
            dockerfile: &self.dockerfile,
            build_args: self.build_args(),
            image: &self.image,
            kernel: &self.kernel,
            secrets: self.secret_names(),
            push_secret: self.push_secret.as_deref().filter(|s| !s.is_empty()),
            base_tls_verify: tls_verify(self.build.base_image_registry_tls.as_ref()),
            push_tls_verify: tls_verify(self.registry_tls.as_ref()),
            selector: self.build.selector.clone().unwrap_or_default(),
            builder_image,
            rebuild_generation: self.rebuild_generation,
        };
        let encoded = serde_json::to_vec(&inputs).expect("plain data always serializes");
        let digest = format!("{:x}", Sha256::digest(&encoded));
        digest[..FINGERPRINT_LENGTH].to_owned()
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use k8s_openapi::api::core::v1::LocalObjectReference;
    use kmm_api::BuildArg;

    use super::*;

    pub(crate) const BUILDER: &str = "registry.example.com/kmm-fleet/kmm-builder:0.1.0";

    fn reference(name: &str) -> LocalObjectReference {
        LocalObjectReference {
            name: name.to_owned(),
        }
    }

    fn arg(name: &str, value: &str) -> BuildArg {
        BuildArg {
            name: name.to_owned(),
            value: value.to_owned(),
        }
    }

    pub(crate) fn request() -> BuildRequest {
        BuildRequest {
            module: "kmm-hello".into(),
            module_uid: "3f1c1b9e-3f0a-4e4c-9a39-0d7a6a1b2c3d".into(),
            spoke_namespace: "kmm-demo".into(),
            kernel: "6.1.0-47-amd64".into(),
            image: "registry.example.com/kmm/kmm-hello:6.1.0-47-amd64".into(),
            build: Build {
                build_args: Some(vec![arg("FLAVOUR", "debug")]),
                dockerfile_config_map: reference("kmm-hello-dockerfile"),
                base_image_registry_tls: None,
                secrets: Some(vec![reference("signing-token")]),
                kaniko_params: None,
                selector: None,
            },
            registry_tls: None,
            push_secret: Some("registry-push".into()),
            dockerfile: "FROM base\nRUN make\n".into(),
            rebuild_generation: 0,
        }
    }

    #[test]
    fn the_fingerprint_is_stable_and_short_hex() {
        let fingerprint = request().fingerprint(BUILDER);
        assert_eq!(fingerprint, request().fingerprint(BUILDER));
        assert_eq!(fingerprint.len(), FINGERPRINT_LENGTH);
        assert!(
            fingerprint
                .bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
        );
        // Pinned: a change of the encoding must be deliberate (and bump its version),
        // since every running build would otherwise start again after a hub upgrade.
        assert_eq!(fingerprint, "458818526f3a923e099daa7c49267948");
    }

    #[test]
    fn every_input_changes_the_fingerprint() {
        let base = request().fingerprint(BUILDER);
        type Change = Box<dyn Fn(&mut BuildRequest)>;
        let changes: Vec<(&str, Change)> = vec![
            (
                "dockerfile",
                Box::new(|r| r.dockerfile.push_str("RUN true\n")),
            ),
            (
                "a build arg's value",
                Box::new(|r| r.build.build_args = Some(vec![arg("FLAVOUR", "release")])),
            ),
            (
                "another build arg",
                Box::new(|r| {
                    r.build
                        .build_args
                        .get_or_insert_default()
                        .push(arg("EXTRA", "1"))
                }),
            ),
            ("image", Box::new(|r| r.image.push_str("-2"))),
            ("kernel", Box::new(|r| r.kernel = "6.1.0-56-amd64".into())),
            (
                "module name (MOD_NAME)",
                Box::new(|r| r.module = "other".into()),
            ),
            (
                "spoke namespace (MOD_NAMESPACE)",
                Box::new(|r| r.spoke_namespace = "other".into()),
            ),
            (
                "a build secret's name",
                Box::new(|r| r.build.secrets = Some(vec![reference("other-token")])),
            ),
            ("push secret", Box::new(|r| r.push_secret = None)),
            (
                "base image TLS",
                Box::new(|r| {
                    r.build.base_image_registry_tls = Some(TlsOptions {
                        insecure: Some(true),
                        insecure_skip_tls_verify: None,
                    })
                }),
            ),
            (
                "push TLS",
                Box::new(|r| {
                    r.registry_tls = Some(TlsOptions {
                        insecure: None,
                        insecure_skip_tls_verify: Some(true),
                    })
                }),
            ),
            (
                "node selector",
                Box::new(|r| r.build.selector = Some([("zone".to_owned(), "a".to_owned())].into())),
            ),
            ("rebuild generation", Box::new(|r| r.rebuild_generation = 1)),
        ];
        for (what, change) in changes {
            let mut changed = request();
            change(&mut changed);
            assert_ne!(changed.fingerprint(BUILDER), base, "{what}");
        }
        assert_ne!(
            request().fingerprint("registry.example.com/kmm-fleet/kmm-builder:0.2.0"),
            base,
            "builder image"
        );
    }

    #[test]
    fn what_does_not_change_the_build_does_not_change_the_fingerprint() {
        let base = request().fingerprint(BUILDER);
        let mut same = request();
        same.module_uid = "another-uid".into();
        same.build.kaniko_params = Some(kmm_api::KanikoParams {
            tag: Some("v1.9".into()),
        });
        same.build.dockerfile_config_map = reference("renamed-but-same-content");
        // Secret contents are not inputs, nor is the order or repetition of their names.
        same.build.secrets = Some(vec![reference("signing-token"), reference("signing-token")]);
        // An explicit "verify" is the default.
        same.registry_tls = Some(TlsOptions::default());
        // An implicit argument always wins over the module's argument of the same name.
        same.build
            .build_args
            .get_or_insert_default()
            .push(arg("KERNEL_VERSION", "ignored"));
        assert_eq!(same.fingerprint(BUILDER), base);
    }

    #[test]
    fn implicit_build_args_override_the_modules() {
        let mut r = request();
        r.kernel = "6.1.0-47-amd64+".into();
        r.build.build_args = Some(vec![
            arg("MOD_NAME", "spoofed"),
            arg("FLAVOUR", "debug"),
            arg("FLAVOUR", "release"),
        ]);
        let args = r.build_args();
        assert_eq!(args["KERNEL_VERSION"], "6.1.0-47-amd64");
        assert_eq!(args["KERNEL_FULL_VERSION"], "6.1.0-47-amd64");
        assert_eq!(args["MOD_NAME"], "kmm-hello");
        assert_eq!(args["MOD_NAMESPACE"], "kmm-demo");
        assert_eq!(args["FLAVOUR"], "release");
        assert_eq!(args.len(), 5);
    }

    #[test]
    fn tls_verify_is_off_for_plain_http_or_skipped_verification() {
        assert!(tls_verify(None));
        assert!(tls_verify(Some(&TlsOptions::default())));
        let insecure = TlsOptions {
            insecure: Some(true),
            insecure_skip_tls_verify: Some(false),
        };
        let skip = TlsOptions {
            insecure: None,
            insecure_skip_tls_verify: Some(true),
        };
        assert!(!tls_verify(Some(&insecure)));
        assert!(!tls_verify(Some(&skip)));
    }
}
