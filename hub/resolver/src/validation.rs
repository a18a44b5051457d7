//! Validation of a module spec: every problem, each with its field path and value.
//!
//! This is what the admission webhook answers with, so it reports all errors at once
//! rather than the first, and never needs a kernel: rules that depend on one (a
//! distribution variable a kernel lacks, a kernel release that is not a valid tag) are
//! reported by resolution instead.

use std::{collections::BTreeSet, fmt};

use k8s_openapi::api::core::v1::Toleration;
use kmm_api::{
    KernelMapping, ModprobeSpec, ModuleLoaderContainerSpec, ModuleSpec, Sign,
    labels::MAX_COMBINED_NAME_LENGTH,
};

use crate::{go_regexp, image_reference, kernel::KERNEL_VARIABLES, merge::non_empty, template};

/// Variables the module itself defines, next to the kernel's.
pub const MODULE_VARIABLES: &[&str] = &["MOD_NAME", "MOD_NAMESPACE"];

/// Where a module is deployed: its name, and its namespace on the spoke clusters.
#[derive(Clone, Copy, Debug)]
pub struct ModuleIdentity<'a> {
    /// `metadata.name` of the ManagedClusterModule (or Module).
    pub name: &'a str,
    /// The module's namespace on the spokes (`spec.spokeNamespace`).
    pub namespace: &'a str,
    /// JSON path of the module spec in its object, e.g. `spec.moduleSpec`.
    pub spec_path: &'a str,
}

/// One invalid field.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FieldError {
    /// JSON path of the field, e.g. `spec.moduleSpec.moduleLoader.container.kernelMappings[2].regexp`.
    pub field: String,
    /// The offending value, when there is one to show.
    pub value: Option<String>,
    /// What is wrong with it.
    pub message: String,
}

impl fmt::Display for FieldError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.value {
            Some(value) => write!(f, "{}: {:?}: {}", self.field, value, self.message),
            None => write!(f, "{}: {}", self.field, self.message),
        }
    }
}

/// Every problem found in a spec.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub struct ValidationErrors(pub Vec<FieldError>);

impl fmt::Display for ValidationErrors {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let lines: Vec<String> = self.0.iter().map(ToString::to_string).collect();
        f.write_str(&lines.join("\n"))
    }
}

#[derive(Default)]
struct Collector(Vec<FieldError>);

impl Collector {
    fn error(&mut self, field: impl Into<String>, value: Option<&str>, message: impl Into<String>) {
        self.0.push(FieldError {
            field: field.into(),
            value: value.map(str::to_owned),
            message: message.into(),
        });
    }
}

/// Validates `spec` for the module `identity`; `Ok` means every rule holds.
pub fn validate(spec: &ModuleSpec, identity: ModuleIdentity<'_>) -> Result<(), ValidationErrors> {
    let mut c = Collector::default();
    validate_identity(&mut c, identity);
    if let Some(tolerations) = &spec.tolerations {
        validate_tolerations(
            &mut c,
            &format!("{}.tolerations", identity.spec_path),
            tolerations,
        );
    }
    if let Some(plugin) = &spec.device_plugin {
        let path = format!("{}.devicePlugin", identity.spec_path);
        validate_pull_policy(
            &mut c,
            &format!("{path}.container"),
            plugin.container.image_pull_policy.as_deref(),
        );
        if let Some(init) = &plugin.init_container {
            validate_pull_policy(
                &mut c,
                &format!("{path}.initContainer"),
                init.image_pull_policy.as_deref(),
            );
        }
    }
    match (&spec.module_loader, &spec.device_plugin) {
        (Some(loader), _) => {
            let path = format!("{}.moduleLoader.container", identity.spec_path);
            validate_container(&mut c, &path, &loader.container);
        }
        // Upstream documents a module with only a device plugin (an in-tree driver);
        // with neither, the module would do nothing at all.
        (None, Some(_)) => {}
        (None, None) => c.error(
            format!("{}.moduleLoader", identity.spec_path),
            None,
            "must be set when devicePlugin is not: the module would load nothing and run \
             nothing",
        ),
    }
    if c.0.is_empty() {
        Ok(())
    } else {
        Err(ValidationErrors(c.0))
    }
}

/// Upstream's (Kubernetes') pull policies; the kubelet refuses any other in a plugin Pod.
fn validate_pull_policy(c: &mut Collector, container_path: &str, policy: Option<&str>) {
    if let Some(policy) = policy
        && !matches!(policy, "Always" | "Never" | "IfNotPresent")
    {
        c.error(
            format!("{container_path}.imagePullPolicy"),
            Some(policy),
            "must be one of Always, Never, IfNotPresent",
        );
    }
}

fn validate_identity(c: &mut Collector, identity: ModuleIdentity<'_>) {
    let combined = identity.name.len() + identity.namespace.len();
    if combined > MAX_COMBINED_NAME_LENGTH {
        c.error(
            "metadata.name",
            Some(identity.name),
            format!(
                "name and namespace {:?} have {combined} characters together; at most \
                 {MAX_COMBINED_NAME_LENGTH} fit in the node labels",
                identity.namespace
            ),
        );
    }
    if !is_dns_label(identity.namespace) {
        c.error(
            "spec.spokeNamespace",
            Some(identity.namespace),
            "must be a valid namespace name: lowercase letters, digits and '-', at most 63 characters",
        );
    }
}

fn is_dns_label(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 63
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !s.starts_with('-')
        && !s.ends_with('-')
}

/// Kubernetes label value syntax: at most 63 characters, alphanumerics with `-_.` inside.
fn is_label_value(s: &str) -> bool {
    s.len() <= 63
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
        && s.bytes().next().is_none_or(|b| b.is_ascii_alphanumeric())
        && s.bytes().last().is_none_or(|b| b.is_ascii_alphanumeric())
}

fn validate_container(c: &mut Collector, path: &str, container: &ModuleLoaderContainerSpec) {
    if container.kernel_mappings.is_empty() {
        c.error(
            format!("{path}.kernelMappings"),
            None,
            "at least one kernel mapping is required",
        );
    }
    if let Some(image) = non_empty(&container.container_image) {
        validate_image_template(c, &format!("{path}.containerImage"), image);
    }
    validate_pull_policy(c, path, container.image_pull_policy.as_deref());
    if let Some(version) = container.version.as_deref()
        && !is_label_value(version)
    {
        c.error(
            format!("{path}.version"),
            Some(version),
            "must be a valid label value (it becomes the value of the version.ready node label): \
             at most 63 characters, alphanumerics and '-', '_', '.', starting and ending with an alphanumeric",
        );
    }
    if non_empty(&container.in_tree_module_to_remove).is_some()
        && container.in_tree_modules_to_remove.is_some()
    {
        c.error(
            format!("{path}.inTreeModuleToRemove"),
            container.in_tree_module_to_remove.as_deref(),
            "only one of inTreeModuleToRemove (deprecated) or inTreeModulesToRemove may be set",
        );
    }
    for (i, mapping) in container.kernel_mappings.iter().enumerate() {
        validate_mapping(
            c,
            &format!("{path}.kernelMappings[{i}]"),
            container,
            mapping,
        );
    }
    validate_modprobe(c, &format!("{path}.modprobe"), &container.modprobe);
    let dir_name = container.modprobe.dir_name_or_default();
    if let Some(sign) = &container.sign {
        validate_sign(c, &format!("{path}.sign"), sign, dir_name);
    }
}

fn validate_mapping(
    c: &mut Collector,
    path: &str,
    container: &ModuleLoaderContainerSpec,
    mapping: &KernelMapping,
) {
    match (non_empty(&mapping.literal), non_empty(&mapping.regexp)) {
        (Some(_), Some(_)) => c.error(
            path.to_owned(),
            None,
            "literal and regexp are mutually exclusive; set exactly one",
        ),
        (None, None) => c.error(
            path.to_owned(),
            None,
            "set exactly one of literal or regexp",
        ),
        (None, Some(pattern)) => {
            if let Err(e) = go_regexp::compile(pattern) {
                // The engine's message draws a caret diagram over several lines; its last
                // line names the problem, which is what fits in an admission response.
                let text = e.to_string();
                let problem = text.lines().last().unwrap_or_default().trim();
                let problem = problem.strip_prefix("error: ").unwrap_or(problem);
                c.error(
                    format!("{path}.regexp"),
                    Some(pattern),
                    format!("does not compile: {problem}"),
                );
            }
        }
        (Some(_), None) => {}
    }
    match non_empty(&mapping.container_image) {
        Some(image) => validate_image_template(c, &format!("{path}.containerImage"), image),
        None if non_empty(&container.container_image).is_none() => c.error(
            format!("{path}.containerImage"),
            None,
            "no image: set containerImage here or on the container",
        ),
        None => {}
    }
    let single = non_empty(&mapping.in_tree_module_to_remove);
    if single.is_some() && mapping.in_tree_modules_to_remove.is_some() {
        c.error(
            format!("{path}.inTreeModuleToRemove"),
            single,
            "only one of inTreeModuleToRemove (deprecated) or inTreeModulesToRemove may be set",
        );
    }
    let container_single = non_empty(&container.in_tree_module_to_remove).is_some();
    if (mapping.in_tree_modules_to_remove.is_some() && container_single)
        || (single.is_some() && container.in_tree_modules_to_remove.is_some())
    {
        c.error(
            format!("{path}.inTreeModulesToRemove"),
            None,
            "the mapping and the container must use the same field: inTreeModuleToRemove \
             (deprecated) or inTreeModulesToRemove",
        );
    }
    if let Some(sign) = &mapping.sign {
        validate_sign(
            c,
            &format!("{path}.sign"),
            sign,
            container.modprobe.dir_name_or_default(),
        );
    }
}

fn validate_modprobe(c: &mut Collector, path: &str, modprobe: &ModprobeSpec) {
    let module_name = non_empty(&modprobe.module_name);
    let raw = modprobe.raw_args.as_ref();
    let raw_load = raw
        .and_then(|r| r.load.as_ref())
        .is_some_and(|l| !l.is_empty());
    let raw_unload = raw
        .and_then(|r| r.unload.as_ref())
        .is_some_and(|l| !l.is_empty());
    match module_name {
        Some(_) if raw_load || raw_unload => c.error(
            format!("{path}.rawArgs"),
            None,
            "must not be set together with moduleName",
        ),
        None if !(raw_load && raw_unload) => c.error(
            format!("{path}.moduleName"),
            None,
            "required unless rawArgs sets both load and unload",
        ),
        _ => {}
    }
    if let Some(order) = &modprobe.modules_loading_order {
        let field = format!("{path}.modulesLoadingOrder");
        if order.len() < 2 {
            c.error(
                field.clone(),
                None,
                "when set, must list at least two modules",
            );
        }
        match (module_name, order.first()) {
            (None, _) => c.error(field.clone(), None, "requires moduleName to be set"),
            (Some(name), Some(first)) if first != name => c.error(
                format!("{field}[0]"),
                Some(first),
                format!("must be moduleName {name:?}"),
            ),
            _ => {}
        }
        let mut seen = BTreeSet::new();
        for (i, module) in order.iter().enumerate() {
            if !seen.insert(module) {
                c.error(
                    format!("{field}[{i}]"),
                    Some(module),
                    "appears more than once",
                );
            }
        }
    }
}

fn validate_sign(c: &mut Collector, path: &str, sign: &Sign, dir_name: &str) {
    if let Some(image) = non_empty(&sign.unsigned_image) {
        validate_image_template(c, &format!("{path}.unsignedImage"), image);
    }
    let prefix = format!("{}/", dir_name.trim_end_matches('/'));
    for (i, file) in sign.files_to_sign.iter().flatten().enumerate() {
        let field = format!("{path}.filesToSign[{i}]");
        if !file.starts_with(&prefix) || file.split('/').any(|part| part == "..") {
            c.error(
                field.clone(),
                Some(file),
                format!("must be a path under modprobe.dirName {dir_name:?}"),
            );
        }
        if file.contains(['*', '?', '['])
            && let Err(e) = glob::Pattern::new(file)
        {
            c.error(
                field.clone(),
                Some(file),
                format!("is not a valid glob: {}", e.msg),
            );
        }
        validate_template(c, &field, file);
    }
}

/// Checks that a template only names known variables, and that it is a pinned image
/// reference once they are substituted with a placeholder.
fn validate_image_template(c: &mut Collector, field: &str, image: &str) {
    if !validate_template(c, field, image) {
        return;
    }
    let placeholders = KERNEL_VARIABLES
        .iter()
        .chain(MODULE_VARIABLES)
        .map(|name| (*name, "0".to_owned()))
        .collect();
    let sample = template::expand(image, &placeholders, &mut Default::default())
        .expect("every referenced name was checked to be known");
    if let Err(e) = image_reference::check(&sample) {
        let message = match e {
            image_reference::ImageReferenceError::Unpinned { .. } => {
                "has neither a tag nor a digest; set one explicitly".to_owned()
            }
            image_reference::ImageReferenceError::Invalid { reason, .. } => {
                format!("is not a valid image reference: {reason}")
            }
        };
        c.error(field.to_owned(), Some(image), message);
    }
}

/// Checks that `value` parses as a template naming only known variables.
fn validate_template(c: &mut Collector, field: &str, value: &str) -> bool {
    match template::references(value) {
        Err(e) => {
            c.error(field.to_owned(), Some(value), e.to_string());
            false
        }
        Ok(names) => {
            let unknown: Vec<&String> = names
                .iter()
                .filter(|n| {
                    !KERNEL_VARIABLES.contains(&n.as_str())
                        && !MODULE_VARIABLES.contains(&n.as_str())
                })
                .collect();
            for name in &unknown {
                c.error(
                    field.to_owned(),
                    Some(value),
                    format!(
                        "unknown variable {name}; known: {}",
                        KERNEL_VARIABLES
                            .iter()
                            .chain(MODULE_VARIABLES)
                            .copied()
                            .collect::<Vec<_>>()
                            .join(", ")
                    ),
                );
            }
            unknown.is_empty()
        }
    }
}

fn validate_tolerations(c: &mut Collector, path: &str, tolerations: &[Toleration]) {
    for (i, t) in tolerations.iter().enumerate() {
        let field = format!("{path}[{i}]");
        let key = t.key.as_deref().unwrap_or_default();
        let operator = t.operator.as_deref().unwrap_or("Equal");
        let value = t.value.as_deref().unwrap_or_default();
        if key.is_empty() && operator != "Exists" {
            c.error(
                format!("{field}.operator"),
                Some(operator),
                "must be Exists when key is empty",
            );
        }
        match operator {
            "Equal" if !is_label_value(value) => {
                c.error(
                    format!("{field}.value"),
                    Some(value),
                    "must be a valid label value",
                );
            }
            "Exists" if !value.is_empty() => {
                c.error(
                    format!("{field}.value"),
                    Some(value),
                    "must be empty when operator is Exists",
                );
            }
            "Equal" | "Exists" => {}
            other => c.error(
                format!("{field}.operator"),
                Some(other),
                "must be Equal or Exists",
            ),
        }
        let effect = t.effect.as_deref().unwrap_or_default();
        if !matches!(effect, "" | "NoSchedule" | "PreferNoSchedule" | "NoExecute") {
            c.error(
                format!("{field}.effect"),
                Some(effect),
                "must be NoSchedule, PreferNoSchedule or NoExecute",
            );
        }
        if t.toleration_seconds.is_some() && effect != "NoExecute" {
            c.error(
                format!("{field}.tolerationSeconds"),
                None,
                "requires effect NoExecute",
            );
        }
    }
}
