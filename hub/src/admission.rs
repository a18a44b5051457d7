//! Admission review of ManagedClusterModules: the pure decision behind the hub's
//! validating webhook. A create or update is refused with every problem the resolver's
//! validation finds, each named by field path and value, so nothing invalid is stored.
//! The one fact it cannot see, whether a named Placement exists, the webhook looks up
//! first ([`placements_to_check`]) and hands in.

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kmm_api::{ManagedClusterModule, MaxUnavailable, PlacementRef, ocm};
use kmm_resolver::{FieldError, ModuleIdentity, validate};
use kube::core::DynamicObject;
use kube::core::admission::{AdmissionRequest, AdmissionResponse, Operation};
use kube::core::response::{StatusCause, StatusDetails, StatusSummary};

/// Path the webhook serves; the ValidatingWebhookConfiguration points here.
pub const VALIDATE_PATH: &str = "/validate-managedclustermodule";

/// What the webhook found of a Placement a module names.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Lookup {
    Exists,
    Missing,
    /// The lookup failed; the error says why.
    Failed(String),
}

/// The Placements a create or a spec update newly names: those the webhook must look up.
/// Placements named before are not checked again, so that editing a module whose
/// Placement went is refused only for what the edit adds.
pub fn placements_to_check(request: &AdmissionRequest<DynamicObject>) -> Vec<PlacementRef> {
    let refs = |object: Option<&DynamicObject>| {
        object
            .and_then(|o| parse(o).ok())
            .and_then(|m| m.spec.placement_refs)
            .unwrap_or_default()
    };
    if !matches!(request.operation, Operation::Create | Operation::Update) {
        return Vec::new();
    }
    let before: BTreeSet<PlacementRef> = refs(request.old_object.as_ref()).into_iter().collect();
    let mut wanted: Vec<PlacementRef> = refs(request.object.as_ref())
        .into_iter()
        .filter(|r| !before.contains(r))
        .collect();
    wanted.sort();
    wanted.dedup();
    wanted
}

/// Decides one admission request, given what the lookups of [`placements_to_check`]
/// found.
pub fn review(
    request: &AdmissionRequest<DynamicObject>,
    placements: &BTreeMap<PlacementRef, Lookup>,
) -> AdmissionResponse {
    let response = AdmissionResponse::from(request);
    if !matches!(request.operation, Operation::Create | Operation::Update) {
        return response;
    }
    let Some(object) = &request.object else {
        return deny(
            response,
            &request.name,
            vec![problem("", None, "the request carries no object")],
        );
    };
    let name = object.metadata.name.as_deref().unwrap_or(&request.name);
    // Before parsing: an object stored before a rule existed, even one the types no
    // longer read, must still have its finalizer released.
    if request.operation == Operation::Update && is_exempt(object, request) {
        return response;
    }
    let module = match parse(object) {
        Ok(module) => module,
        Err(problem) => return deny(response, name, vec![problem]),
    };
    if request.operation == Operation::Update && !needs_validation(&module, request) {
        return response;
    }
    let mut problems = validate(
        &module.spec.module_spec,
        ModuleIdentity {
            name,
            namespace: &module.spec.spoke_namespace,
            spec_path: "spec.moduleSpec",
        },
    )
    .err()
    .map(|errors| errors.0)
    .unwrap_or_default();
    problems.extend(node_upgrade_problem(&module));
    problems.extend(rollout_problems(&module));
    problems.extend(placement_problems(&module, placements));
    problems.extend(version_switch_problem(&module, request));
    problems.extend(loader_switch_problem(&module, request));
    if problems.is_empty() {
        with_warnings(response, ignored_fields(&module))
    } else {
        deny(response, name, problems)
    }
}

/// Fields stored for upstream compatibility that do nothing here: each gets a warning
/// (which `kubectl` prints) naming the field and what happens instead.
fn ignored_fields(module: &ManagedClusterModule) -> Vec<String> {
    let spec = &module.spec.module_spec;
    let mut warnings = Vec::new();
    if spec.dra.is_some() {
        warnings
            .push("spec.moduleSpec.dra has no effect: kmm-fleet deploys no DRA driver".to_owned());
    }
    let Some(loader) = &spec.module_loader else {
        return warnings;
    };
    if loader.service_account_name.is_some() {
        warnings.push(
            "spec.moduleSpec.moduleLoader.serviceAccountName has no effect: no user Pod \
             loads modules, the node agent does"
                .to_owned(),
        );
    }
    let container = &loader.container;
    let builds = std::iter::once((
        "spec.moduleSpec.moduleLoader.container".to_owned(),
        &container.build,
    ))
    .chain(container.kernel_mappings.iter().enumerate().map(|(i, m)| {
        (
            format!("spec.moduleSpec.moduleLoader.container.kernelMappings[{i}]"),
            &m.build,
        )
    }));
    for (path, build) in builds {
        if build.as_ref().is_some_and(|b| b.kaniko_params.is_some()) {
            warnings.push(format!(
                "{path}.build.kanikoParams has no effect: the hub builds with buildah in its \
                 build Jobs"
            ));
        }
    }
    warnings
}

fn with_warnings(mut response: AdmissionResponse, warnings: Vec<String>) -> AdmissionResponse {
    if !warnings.is_empty() {
        response.warnings = Some(warnings);
    }
    response
}

/// As upstream: `version` may not switch between empty and set on an update. Set, nodes
/// move between versions in order (old unloaded, then new loaded); empty, an image change
/// reloads in place; switching would leave no rule for the nodes in between.
fn version_switch_problem(
    module: &ManagedClusterModule,
    request: &AdmissionRequest<DynamicObject>,
) -> Option<FieldError> {
    let version = |m: &ManagedClusterModule| {
        m.spec
            .module_spec
            .module_loader
            .as_ref()
            .and_then(|l| l.container.version.clone())
            .filter(|v| !v.is_empty())
    };
    let old = request.old_object.as_ref().and_then(|o| parse(o).ok())?;
    // Adding or removing the loader is refused as such (`loader_switch_problem`).
    if old.spec.module_spec.module_loader.is_none()
        || module.spec.module_spec.module_loader.is_none()
    {
        return None;
    }
    let (before, now) = (version(&old), version(module));
    if before.is_some() == now.is_some() {
        return None;
    }
    Some(problem(
        "spec.moduleSpec.moduleLoader.container.version",
        Some(now.as_deref().unwrap_or("")),
        &format!(
            "cannot change from {} to {} on an update (as upstream KMM): delete the module \
             and create it again to switch between versioned and unversioned updates",
            before.map_or_else(|| "empty".to_owned(), |v| format!("{v:?}")),
            if now.is_some() { "set" } else { "empty" }
        ),
    ))
}

/// `moduleLoader` may not come or go on an update. Nodes that loaded the module would keep
/// it loaded with nothing left to unload it (a module without a loader sends the node
/// agents nothing), and nodes that only ran its device plugin would stop it without the
/// order a version change keeps.
fn loader_switch_problem(
    module: &ManagedClusterModule,
    request: &AdmissionRequest<DynamicObject>,
) -> Option<FieldError> {
    let old = request.old_object.as_ref().and_then(|o| parse(o).ok())?;
    let before = old.spec.module_spec.module_loader.is_some();
    let now = module.spec.module_spec.module_loader.is_some();
    (before != now).then(|| {
        problem(
            "spec.moduleSpec.moduleLoader",
            None,
            &format!(
                "cannot be {} on an update: delete the module and create it again",
                if now { "added" } else { "removed" }
            ),
        )
    })
}

fn node_upgrade_problem(module: &ManagedClusterModule) -> Option<FieldError> {
    let value = module
        .spec
        .node_upgrade
        .as_ref()?
        .max_unavailable
        .as_ref()?;
    let message = MaxUnavailable::parse(value).err()?;
    let shown = match value {
        IntOrString::Int(n) => n.to_string(),
        IntOrString::String(s) => s.clone(),
    };
    Some(problem(
        "spec.nodeUpgrade.maxUnavailable",
        Some(&shown),
        &message,
    ))
}

fn rollout_problems(module: &ManagedClusterModule) -> Vec<FieldError> {
    let Some(strategy) = &module.spec.rollout_strategy else {
        return Vec::new();
    };
    strategy
        .check()
        .err()
        .unwrap_or_default()
        .iter()
        .map(|p| {
            problem(
                &format!("spec.rolloutStrategy.{}", p.field),
                Some(&p.value),
                &p.message,
            )
        })
        .collect()
}

/// Placements named twice, named but not found, and decision groups wanted without any
/// Placement to give them.
fn placement_problems(
    module: &ManagedClusterModule,
    placements: &BTreeMap<PlacementRef, Lookup>,
) -> Vec<FieldError> {
    let refs = module.spec.placement_refs.as_deref().unwrap_or_default();
    let mut problems = Vec::new();
    for (i, placement) in refs.iter().enumerate() {
        let field = format!("spec.placementRefs[{i}]");
        let shown = placement.to_string();
        let message = if refs[..i].contains(placement) {
            "is named twice".to_owned()
        } else {
            match placements.get(placement) {
                Some(Lookup::Missing) => {
                    format!("no such Placement ({})", ocm::PLACEMENT.api_version())
                }
                Some(Lookup::Failed(why)) => format!("the Placement cannot be looked up: {why}"),
                Some(Lookup::Exists) | None => continue,
            }
        };
        problems.push(problem(&field, Some(&shown), &message));
    }
    let strategy = module.spec.rollout_strategy.as_ref();
    if refs.is_empty()
        && let Some(field) = strategy.and_then(|s| s.needs_decision_groups())
    {
        problems.push(problem(
            &format!("spec.rolloutStrategy.{field}"),
            (field == "type").then_some("ProgressivePerGroup"),
            "needs spec.placementRefs: decision groups come from Placements",
        ));
    }
    problems
}

/// An update that belongs to a deletion, or leaves the stored spec exactly as it was
/// (finalizers, labels, annotations), is never refused: an object stored before a rule
/// existed must still be labelled, and its finalizer released.
fn is_exempt(object: &DynamicObject, request: &AdmissionRequest<DynamicObject>) -> bool {
    object.metadata.deletion_timestamp.is_some()
        || request
            .old_object
            .as_ref()
            .is_some_and(|old| old.data.get("spec") == object.data.get("spec"))
}

/// Whether an update changes the spec as the types read it.
fn needs_validation(
    module: &ManagedClusterModule,
    request: &AdmissionRequest<DynamicObject>,
) -> bool {
    let old = request.old_object.as_ref().and_then(|old| parse(old).ok());
    old.is_none_or(|old| old.spec != module.spec)
}

fn parse(object: &DynamicObject) -> Result<ManagedClusterModule, FieldError> {
    let value = serde_json::to_value(object)
        .map_err(|e| problem("", None, &format!("the object cannot be read: {e}")))?;
    serde_path_to_error::deserialize(value).map_err(|e| {
        let field = e.path().to_string();
        problem(&field, None, &e.into_inner().to_string())
    })
}

fn problem(field: &str, value: Option<&str>, message: &str) -> FieldError {
    FieldError {
        field: field.to_owned(),
        value: value.map(str::to_owned),
        message: message.to_owned(),
    }
}

/// Refuses with status 422 Invalid: the message lists every problem (it is what
/// `kubectl apply` prints), and the causes carry them field by field; the details name
/// the object, which `kubectl` shows (`The managedclustermodules "<name>" is invalid`).
fn deny(response: AdmissionResponse, name: &str, problems: Vec<FieldError>) -> AdmissionResponse {
    let lines: Vec<String> = problems.iter().map(ToString::to_string).collect();
    let message = format!(
        "ManagedClusterModule is invalid ({} problem{}): {}",
        lines.len(),
        if lines.len() == 1 { "" } else { "s" },
        lines.join("; ")
    );
    let mut response = response.deny(message);
    response.result.status = Some(StatusSummary::Failure);
    response.result.code = 422;
    response.result.reason = "Invalid".to_owned();
    response.result.details = Some(StatusDetails {
        name: name.to_owned(),
        group: "hub.kmm.sigs.x-k8s.io".to_owned(),
        kind: "managedclustermodules".to_owned(),
        uid: String::new(),
        retry_after_seconds: 0,
        causes: problems
            .iter()
            .map(|p| StatusCause {
                reason: "FieldValueInvalid".to_owned(),
                message: match &p.value {
                    Some(value) => format!("{value:?}: {}", p.message),
                    None => p.message.clone(),
                },
                field: p.field.clone(),
            })
            .collect(),
    });
    response
}

#[cfg(test)]
mod tests;
