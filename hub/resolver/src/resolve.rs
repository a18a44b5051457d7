//! Resolution: for one validated module and one kernel, exactly what a node must load.

use std::collections::BTreeMap;

use kmm_api::{Build, ModprobeSpec, ModuleLoaderContainerSpec, ModuleSpec, Sign, TlsOptions};
use regex::Regex;
use serde::Serialize;
use thiserror::Error;

use crate::{
    go_regexp,
    image_reference::{self, ImageReferenceError},
    kernel::KernelRelease,
    merge,
    template::{self, TemplateError},
    validation::{self, ModuleIdentity, ValidationErrors},
};

/// What a node on one kernel must load for one module.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Resolution {
    /// The kernel release as the node reported it.
    pub kernel: String,
    /// Index of the kernel mapping that matched.
    pub mapping_index: usize,
    /// How that mapping matched: `literal` or `regexp`, with its value.
    pub matched_by: MatchedBy,
    /// The kmod image, variables substituted.
    pub container_image: String,
    /// Pull policy, when the spec sets one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub image_pull_policy: Option<String>,
    /// How to reach the image's registry.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub registry_tls: Option<TlsOptions>,
    /// Build settings, merged, when the image may have to be built.
    pub build: Option<Build>,
    /// Signing settings, merged and substituted, when the modules must be signed.
    pub sign: Option<Sign>,
    /// modprobe settings, with `dirName` defaulted.
    pub modprobe: ModprobeSpec,
    /// In-tree modules to remove before loading.
    pub in_tree_modules_to_remove: Vec<String>,
    /// Module version, when set.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub version: Option<String>,
    /// The variables that were substituted, with their values.
    pub variables: BTreeMap<String, String>,
}

/// How a kernel mapping matched.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub enum MatchedBy {
    /// The kernel equals this literal.
    Literal(String),
    /// The kernel matches this regular expression.
    Regexp(String),
}

/// Why a kernel cannot be resolved: the kernel, the field at fault and the reason.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
#[error("kernel {kernel}: {field}: {kind}")]
pub struct ResolveError {
    /// The kernel release as reported.
    pub kernel: String,
    /// JSON path of the field at fault.
    pub field: String,
    /// What went wrong.
    pub kind: ResolveErrorKind,
}

/// The reasons a kernel cannot be resolved.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum ResolveErrorKind {
    /// The spec has no module loader.
    #[error("not set; the module has nothing to load")]
    NoModuleLoader,
    /// No kernel mapping matches the kernel.
    #[error("no kernel mapping matches this kernel")]
    NoMatchingMapping,
    /// A template could not be expanded for this kernel.
    #[error("{0}")]
    Template(TemplateError),
    /// The substituted image reference is not acceptable.
    #[error("{0}")]
    Image(ImageReferenceError),
    /// Signing is configured without any file to sign.
    #[error("signing is configured but no filesToSign remain after merging")]
    NothingToSign,
    /// Signing without a build needs an image to sign.
    #[error("signing without a build needs unsignedImage")]
    NoUnsignedImage,
}

impl ResolveErrorKind {
    /// A short machine-readable reason, for status and events.
    pub fn reason(&self) -> &'static str {
        match self {
            Self::NoModuleLoader => "NoModuleLoader",
            Self::NoMatchingMapping => "NoKernelMapping",
            Self::Template(_) => "UndefinedVariable",
            Self::Image(_) => "InvalidImage",
            Self::NothingToSign | Self::NoUnsignedImage => "InvalidSign",
        }
    }
}

/// A validated module, ready to be resolved against any number of kernels.
#[derive(Debug)]
pub struct Resolver<'a> {
    spec: &'a ModuleSpec,
    identity: ModuleIdentity<'a>,
    matchers: Vec<Matcher>,
}

#[derive(Debug)]
enum Matcher {
    Literal(String),
    /// The compiled expression and the pattern as the user wrote it.
    Regexp(Regex, String),
}

impl<'a> Resolver<'a> {
    /// Validates `spec` and prepares its mappings; every validation error is returned.
    pub fn new(
        spec: &'a ModuleSpec,
        identity: ModuleIdentity<'a>,
    ) -> Result<Self, ValidationErrors> {
        validation::validate(spec, identity)?;
        let matchers = spec
            .module_loader
            .iter()
            .flat_map(|loader| &loader.container.kernel_mappings)
            .map(|m| match merge::non_empty(&m.literal) {
                Some(literal) => Matcher::Literal(literal.to_owned()),
                None => {
                    let pattern = m.regexp.clone().unwrap_or_default();
                    let regexp =
                        go_regexp::compile(&pattern).expect("validation compiled every regexp");
                    Matcher::Regexp(regexp, pattern)
                }
            })
            .collect();
        Ok(Self {
            spec,
            identity,
            matchers,
        })
    }

    /// Resolves the module for the kernel a node reported.
    pub fn resolve(&self, reported_kernel: &str) -> Result<Resolution, ResolveError> {
        let kernel = KernelRelease::parse(reported_kernel);
        let fail = |field: String, kind| ResolveError {
            kernel: reported_kernel.to_owned(),
            field,
            kind,
        };
        let loader_path = format!("{}.moduleLoader", self.identity.spec_path);
        let container = &self
            .spec
            .module_loader
            .as_ref()
            .ok_or_else(|| fail(loader_path.clone(), ResolveErrorKind::NoModuleLoader))?
            .container;
        let container_path = format!("{loader_path}.container");
        let (index, matched_by) = self.select(kernel.normalized()).ok_or_else(|| {
            fail(
                format!("{container_path}.kernelMappings"),
                ResolveErrorKind::NoMatchingMapping,
            )
        })?;
        let mapping = &container.kernel_mappings[index];
        let mapping_path = format!("{container_path}.kernelMappings[{index}]");

        let mut variables: BTreeMap<&str, String> = kernel
            .variables()
            .iter()
            .map(|(k, v)| (*k, v.clone()))
            .collect();
        variables.insert("MOD_NAME", self.identity.name.to_owned());
        variables.insert("MOD_NAMESPACE", self.identity.namespace.to_owned());
        let mut used = BTreeMap::new();
        let mut expand = |field: &str, value: &str| {
            template::expand(value, &variables, &mut used)
                .map_err(|e| fail(field.to_owned(), ResolveErrorKind::Template(e)))
        };

        let image_field = if merge::non_empty(&mapping.container_image).is_some() {
            format!("{mapping_path}.containerImage")
        } else {
            format!("{container_path}.containerImage")
        };
        let template = merge::container_image(container, mapping)
            .expect("validation requires an image on the mapping or the container");
        let container_image = expand(&image_field, template)?;
        image_reference::check(&container_image)
            .map_err(|e| fail(image_field.clone(), ResolveErrorKind::Image(e)))?;

        let build = merge::build(container.build.as_ref(), mapping.build.as_ref());
        let sign = match merge::sign(container.sign.as_ref(), mapping.sign.as_ref()) {
            None => None,
            Some(sign) => {
                let sign_path = if mapping.sign.is_some() {
                    format!("{mapping_path}.sign")
                } else {
                    format!("{container_path}.sign")
                };
                Some(self.resolve_sign(sign, &sign_path, build.is_some(), &mut expand, &fail)?)
            }
        };

        Ok(Resolution {
            kernel: reported_kernel.to_owned(),
            mapping_index: index,
            matched_by,
            container_image,
            image_pull_policy: container.image_pull_policy.clone(),
            registry_tls: merge::registry_tls(container, mapping),
            build,
            sign,
            modprobe: modprobe_with_defaults(container),
            in_tree_modules_to_remove: merge::in_tree_modules_to_remove(container, mapping),
            version: merge::non_empty(&container.version).map(str::to_owned),
            variables: used,
        })
    }

    fn resolve_sign(
        &self,
        mut sign: Sign,
        path: &str,
        has_build: bool,
        expand: &mut impl FnMut(&str, &str) -> Result<String, ResolveError>,
        fail: &impl Fn(String, ResolveErrorKind) -> ResolveError,
    ) -> Result<Sign, ResolveError> {
        let files = sign.files_to_sign.take().unwrap_or_default();
        if files.is_empty() {
            return Err(fail(
                format!("{path}.filesToSign"),
                ResolveErrorKind::NothingToSign,
            ));
        }
        let files = files
            .iter()
            .enumerate()
            .map(|(i, f)| expand(&format!("{path}.filesToSign[{i}]"), f))
            .collect::<Result<Vec<_>, _>>()?;
        sign.files_to_sign = Some(files);
        match merge::non_empty(&sign.unsigned_image) {
            // The build's output is what gets signed.
            _ if has_build => {}
            None => {
                return Err(fail(
                    format!("{path}.unsignedImage"),
                    ResolveErrorKind::NoUnsignedImage,
                ));
            }
            Some(image) => {
                let field = format!("{path}.unsignedImage");
                let image = expand(&field, image)?;
                image_reference::check(&image)
                    .map_err(|e| fail(field.clone(), ResolveErrorKind::Image(e)))?;
                sign.unsigned_image = Some(image);
            }
        }
        Ok(sign)
    }

    /// The first mapping matching `kernel`, as upstream: literal equality or an unanchored match.
    fn select(&self, kernel: &str) -> Option<(usize, MatchedBy)> {
        self.matchers
            .iter()
            .enumerate()
            .find_map(|(i, matcher)| match matcher {
                Matcher::Literal(literal) if literal == kernel => {
                    Some((i, MatchedBy::Literal(literal.clone())))
                }
                Matcher::Regexp(regexp, pattern) if regexp.is_match(kernel) => {
                    Some((i, MatchedBy::Regexp(pattern.clone())))
                }
                _ => None,
            })
    }
}

fn modprobe_with_defaults(container: &ModuleLoaderContainerSpec) -> ModprobeSpec {
    let mut modprobe = container.modprobe.clone();
    modprobe.dir_name = Some(container.modprobe.dir_name_or_default().to_owned());
    modprobe
}
