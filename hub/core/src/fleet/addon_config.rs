//! The add-on's AddOnDeploymentConfigs (ADCs) as the hub sees them: which ones the add-on
//! uses, the variables holding the hub's CA that the hub keeps in each (the proxies learn
//! the CA only from there), and the variables users must set. Pure: the runtime passes
//! the watched objects' contents.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;
use kmm_api::ocm::ADD_ON_DEPLOYMENT_CONFIG as ADC;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use thiserror::Error;

use super::mirrors::ImageMirror;

/// Prefix of the variables holding the hub's CA bundle: `HUB_CA_BUNDLE_1`,
/// `HUB_CA_BUNDLE_2`, ... Concatenated in order they are the base64 of the CA certificate
/// PEM.
pub const CA_BUNDLE_PREFIX: &str = "HUB_CA_BUNDLE_";
/// How many bundle variables the add-on's template concatenates. Unused ones render empty.
pub const CA_BUNDLE_PARTS: usize = 4;
/// OCM's CRD limits a variable's value to 1024 characters, and the base64 of an RSA-2048
/// CA's PEM is about 1460: the bundle is split over several variables.
pub const MAX_VALUE_LEN: usize = 1024;
/// Variables users must set, non-empty, for the proxy and the agents to work.
pub const REQUIRED_VARIABLES: [&str; 3] = ["HUB_ADDRESS", "LOG_LEVEL", "FIRMWARE_DIR"];

/// The host directory the agents copy firmware to, mounted at the same path in their
/// Pods (`/lib/firmware` by default; a writable one where that is read-only, as on
/// CoreOS); the kernel is told to search it when it is not `/lib/firmware`.
pub const FIRMWARE_DIR: &str = "FIRMWARE_DIR";

/// The cluster's own pull Secret, in the add-on's namespace on the managed cluster: its
/// nodes pull with it the images of modules that name no `imageRepoSecret`, and device
/// plugins' Pods get a copy of it. Unset, or empty, for none.
pub const CLUSTER_PULL_SECRET: &str = "CLUSTER_PULL_SECRET";
/// Variables users may set; the hub checks their values when they do.
pub const OPTIONAL_VARIABLES: [&str; 1] = [CLUSTER_PULL_SECRET];

/// Prefix of the variables holding the CAs a cluster's registries chain to (optional):
/// `REGISTRY_CA_BUNDLE_1` to `_4`, concatenated in order the base64 of a PEM bundle,
/// which the template renders into the ConfigMap the agents trust.
pub const REGISTRY_CA_BUNDLE_PREFIX: &str = "REGISTRY_CA_BUNDLE_";
/// How many of those the template concatenates, as many as the hub's CA's.
pub const REGISTRY_CA_BUNDLE_PARTS: usize = CA_BUNDLE_PARTS;

/// Parses a watched object's field leniently: a field OCM left out, or shaped unlike the
/// subset read here, reads as empty rather than stopping the controller.
pub fn parse<T: DeserializeOwned + Default>(value: &serde_json::Value) -> T {
    T::deserialize(value).unwrap_or_default()
}

/// One entry of an ADC's `spec.customizedVariables`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct Variable {
    pub name: String,
    pub value: String,
}

/// The part of an AddOnDeploymentConfig's spec the hub reads.
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(default, rename_all = "camelCase")]
pub struct DeploymentConfigSpec {
    pub customized_variables: Vec<Variable>,
    /// OCM's image mirrors, which the hub applies to the cluster's kmod and device
    /// plugin images too (`super::mirrors`).
    pub registries: Vec<ImageMirror>,
}

/// Namespace and name of a namespaced config.
#[derive(Clone, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Deserialize)]
#[serde(default)]
pub struct ConfigName {
    pub namespace: String,
    pub name: String,
}

impl ConfigName {
    pub fn new(namespace: &str, name: &str) -> Self {
        Self {
            namespace: namespace.to_owned(),
            name: name.to_owned(),
        }
    }

    fn is_complete(&self) -> bool {
        !self.namespace.is_empty() && !self.name.is_empty()
    }
}

impl fmt::Display for ConfigName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

/// A config reference: an MCA's `spec.configs[]` or `status.configReferences[]`, a
/// placement's `configs[]`.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(default, rename_all = "camelCase")]
pub struct ConfigRef {
    pub group: String,
    pub resource: String,
    #[serde(flatten)]
    pub referent: ConfigName,
    /// In `status.configReferences`: the config OCM renders with.
    pub desired_config: Option<ConfigName>,
}

impl ConfigRef {
    /// The ADC this references, if it references one.
    fn deployment_config(&self) -> Option<ConfigName> {
        if self.group != ADC.group || self.resource != ADC.plural {
            return None;
        }
        let desired = self.desired_config.as_ref().filter(|d| d.is_complete());
        Some(desired.unwrap_or(&self.referent).clone()).filter(ConfigName::is_complete)
    }
}

/// The part of a ClusterManagementAddOn's spec the hub reads.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(default, rename_all = "camelCase")]
pub struct ManagementAddOnSpec {
    pub supported_configs: Vec<SupportedConfig>,
    pub install_strategy: InstallStrategy,
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(default, rename_all = "camelCase")]
pub struct SupportedConfig {
    pub group: String,
    pub resource: String,
    pub default_config: Option<ConfigName>,
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(default)]
pub struct InstallStrategy {
    pub placements: Vec<PlacementStrategy>,
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(default)]
pub struct PlacementStrategy {
    pub configs: Vec<ConfigRef>,
}

impl ManagementAddOnSpec {
    /// The default ADC of every cluster's add-on.
    fn default_config(&self) -> Option<ConfigName> {
        self.supported_configs
            .iter()
            .filter(|c| c.group == ADC.group && c.resource == ADC.plural)
            .find_map(|c| c.default_config.clone())
            .filter(ConfigName::is_complete)
    }
}

/// The part of a ManagedClusterAddOn's spec the hub reads.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(default)]
pub struct AddOnSpec {
    pub configs: Vec<ConfigRef>,
}

/// The part of a ManagedClusterAddOn's status the hub reads (conditions apart).
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(default, rename_all = "camelCase")]
pub struct AddOnStatus {
    pub config_references: Vec<ConfigRef>,
}

/// Every ADC the add-on uses: the ClusterManagementAddOn's default and its placements'
/// configs, and what each ManagedClusterAddOn names or OCM resolved for it.
pub fn used_configs<'a>(
    management: Option<&ManagementAddOnSpec>,
    addons: impl IntoIterator<Item = (&'a AddOnSpec, &'a AddOnStatus)>,
) -> BTreeSet<ConfigName> {
    let mut used: BTreeSet<ConfigName> = BTreeSet::new();
    if let Some(management) = management {
        used.extend(management.default_config());
        used.extend(
            management
                .install_strategy
                .placements
                .iter()
                .flat_map(|p| &p.configs)
                .filter_map(ConfigRef::deployment_config),
        );
    }
    for (spec, status) in addons {
        used.extend(
            spec.configs
                .iter()
                .chain(&status.config_references)
                .filter_map(ConfigRef::deployment_config),
        );
    }
    used
}

/// The ADC OCM renders a cluster's add-on with: the first ADC reference of
/// `status.configReferences` (OCM reads only that one). Until OCM's addon-manager has
/// filled them in, what it will fill in: the add-on's own config, else the default.
pub fn effective_config(
    management: Option<&ManagementAddOnSpec>,
    spec: &AddOnSpec,
    status: &AddOnStatus,
) -> Option<ConfigName> {
    status
        .config_references
        .iter()
        .find_map(ConfigRef::deployment_config)
        .or_else(|| spec.configs.iter().find_map(ConfigRef::deployment_config))
        .or_else(|| management.and_then(ManagementAddOnSpec::default_config))
}

/// Each cluster's image mirrors: the `registries` of the config its add-on is rendered
/// with ([`effective_config`]), for the clusters (by `addons`' namespaces) that have any.
pub fn mirrors_by_cluster<'a>(
    management: Option<&ManagementAddOnSpec>,
    addons: impl IntoIterator<Item = (&'a str, &'a AddOnSpec, &'a AddOnStatus)>,
    config: impl Fn(&ConfigName) -> Option<&'a DeploymentConfigSpec>,
) -> BTreeMap<String, Vec<ImageMirror>> {
    addons
        .into_iter()
        .filter_map(|(cluster, spec, status)| {
            let name = effective_config(management, spec, status)?;
            let registries = &config(&name)?.registries;
            (!registries.is_empty()).then(|| (cluster.to_owned(), registries.clone()))
        })
        .collect()
}

#[derive(Clone, Debug, PartialEq, Eq, Error)]
#[error(
    "the hub's CA bundle needs {parts} variables of at most {MAX_VALUE_LEN} characters, more \
     than the {CA_BUNDLE_PARTS} the add-on's template reads"
)]
pub struct BundleTooLarge {
    parts: usize,
}

/// The variables carrying `ca_pem`: its base64, split into values OCM accepts.
pub fn ca_bundle_variables(ca_pem: &str) -> Result<Vec<Variable>, BundleTooLarge> {
    let encoded = STANDARD.encode(ca_pem);
    let parts: Vec<&[u8]> = encoded.as_bytes().chunks(MAX_VALUE_LEN).collect();
    if parts.len() > CA_BUNDLE_PARTS {
        return Err(BundleTooLarge { parts: parts.len() });
    }
    Ok(parts
        .iter()
        .enumerate()
        .map(|(i, part)| Variable {
            name: format!("{CA_BUNDLE_PREFIX}{}", i + 1),
            // Base64 is ASCII: every split is valid UTF-8.
            value: String::from_utf8_lossy(part).into_owned(),
        })
        .collect())
}

/// Whether the ADC lacks any of `bundle` as it is.
pub fn lacks(spec: &DeploymentConfigSpec, bundle: &[Variable]) -> bool {
    bundle
        .iter()
        .any(|wanted| !spec.customized_variables.contains(wanted))
}

/// Why the add-on of a cluster cannot be rendered as the proxy needs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ConfigProblem {
    /// No ADC configures it at all.
    NoConfig,
    /// The ADC it references does not exist.
    NotFound(ConfigName),
    /// Required variables are unset or empty.
    Missing {
        config: ConfigName,
        variables: Vec<&'static str>,
    },
    /// A variable's value cannot work.
    Invalid {
        config: ConfigName,
        variable: &'static str,
        value: String,
        why: &'static str,
    },
    /// The registries' CA bundle, joined from its variables, cannot be trusted.
    RegistryCaBundle { config: ConfigName, why: String },
}

impl fmt::Display for ConfigProblem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let required = REQUIRED_VARIABLES.join(", ");
        match self {
            Self::NoConfig => write!(
                f,
                "no AddOnDeploymentConfig configures the add-on for this cluster (neither the \
                 ClusterManagementAddOn's default nor the ManagedClusterAddOn's configs); one \
                 must set {required}"
            ),
            Self::NotFound(config) => write!(
                f,
                "AddOnDeploymentConfig {config}, which configures the add-on for this \
                 cluster, does not exist; it must set {required}"
            ),
            Self::Missing { config, variables } => write!(
                f,
                "AddOnDeploymentConfig {config} does not set {} (required, non-empty, in \
                 spec.customizedVariables)",
                variables.join(", ")
            ),
            Self::Invalid {
                config,
                variable,
                value,
                why,
            } => write!(
                f,
                "AddOnDeploymentConfig {config}: spec.customizedVariables {variable} {value:?} \
                 {why}"
            ),
            Self::RegistryCaBundle { config, why } => write!(
                f,
                "AddOnDeploymentConfig {config}: spec.customizedVariables \
                 {REGISTRY_CA_BUNDLE_PREFIX}1..{REGISTRY_CA_BUNDLE_PARTS} (the base64 of the \
                 registries' PEM CA bundle, in parts) {why}"
            ),
        }
    }
}

/// What is wrong with the ADC `effective` (looked up with `lookup`), if anything.
pub fn config_problem<'a>(
    effective: Option<&ConfigName>,
    lookup: impl Fn(&ConfigName) -> Option<&'a DeploymentConfigSpec>,
) -> Option<ConfigProblem> {
    let Some(config) = effective else {
        return Some(ConfigProblem::NoConfig);
    };
    let Some(spec) = lookup(config) else {
        return Some(ConfigProblem::NotFound(config.clone()));
    };
    let variables: Vec<&'static str> = REQUIRED_VARIABLES
        .into_iter()
        .filter(|required| {
            !spec
                .customized_variables
                .iter()
                .any(|v| v.name == *required && !v.value.trim().is_empty())
        })
        .collect();
    if !variables.is_empty() {
        return Some(ConfigProblem::Missing {
            config: config.clone(),
            variables,
        });
    }
    let value = |name: &str| {
        spec.customized_variables
            .iter()
            .rev()
            .find(|v| v.name == name)
            .map_or("", |v| v.value.as_str())
    };
    let invalid = |variable: &'static str, why| ConfigProblem::Invalid {
        config: config.clone(),
        variable,
        value: value(variable).to_owned(),
        why,
    };
    firmware_dir_problem(value(FIRMWARE_DIR))
        .map(|why| invalid(FIRMWARE_DIR, why))
        .or_else(|| {
            pull_secret_name_problem(value(CLUSTER_PULL_SECRET))
                .map(|why| invalid(CLUSTER_PULL_SECRET, why))
        })
        .or_else(|| {
            registry_ca_bundle_problem(&spec.customized_variables).map(|why| {
                ConfigProblem::RegistryCaBundle {
                    config: config.clone(),
                    why,
                }
            })
        })
}

/// Why the registries' CA bundle in `variables` cannot be trusted (none set: nothing).
/// The template joins parts 1 to [`REGISTRY_CA_BUNDLE_PARTS`] as a ConfigMap's
/// `binaryData`, which the agents read as PEM.
pub fn registry_ca_bundle_problem(variables: &[Variable]) -> Option<String> {
    let part = |i: usize| {
        let name = format!("{REGISTRY_CA_BUNDLE_PREFIX}{i}");
        variables
            .iter()
            .rev()
            .find(|v| v.name == name)
            .map_or("", |v| v.value.as_str())
    };
    let unread: Vec<&str> = variables
        .iter()
        .filter_map(|v| v.name.strip_prefix(REGISTRY_CA_BUNDLE_PREFIX))
        .filter(|n| {
            n.parse::<usize>()
                .map_or(true, |n| n == 0 || n > REGISTRY_CA_BUNDLE_PARTS)
        })
        .collect();
    if let Some(n) = unread.first() {
        return Some(format!(
            "sets {REGISTRY_CA_BUNDLE_PREFIX}{n}, which the add-on's template does not read \
             (it joins 1 to {REGISTRY_CA_BUNDLE_PARTS})"
        ));
    }
    let joined: String = (1..=REGISTRY_CA_BUNDLE_PARTS).map(part).collect();
    if joined.is_empty() {
        return None;
    }
    let pem = match STANDARD.decode(joined.trim()) {
        Ok(pem) => pem,
        Err(e) => return Some(format!("is not base64: {e}")),
    };
    kmm_registry::RegistryCas::from_pem(&pem)
        .err()
        .map(|e| format!("is not a CA bundle: {e}"))
}

/// Why `name` cannot name the cluster's pull Secret (empty names none).
pub fn pull_secret_name_problem(name: &str) -> Option<&'static str> {
    (!name.is_empty() && !super::cluster_identity::is_dns_subdomain(name)).then_some(
        "must be a Secret's name: lower-case letters, digits, - and ., at most 253 \
         characters",
    )
}

/// Why `dir` cannot be the host firmware directory: it becomes a hostPath, a mount path
/// and the kernel's firmware search path, so it must be a plain absolute path.
pub fn firmware_dir_problem(dir: &str) -> Option<&'static str> {
    if !dir.starts_with('/') {
        Some("must be an absolute path")
    } else if dir == "/" {
        Some("must not be the root directory")
    } else if dir.ends_with('/') || dir.contains("//") {
        Some("must not end in / or hold an empty component")
    } else if dir.split('/').any(|part| part == "." || part == "..") {
        Some("must not hold . or .. components")
    } else if !dir
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || b"/._-".contains(&b))
    {
        Some("may hold only letters, digits, /, ., _ and -")
    } else {
        None
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use kmm_api::ocm::ADD_ON_TEMPLATE as TEMPLATE;
    use serde_json::json;

    use super::*;

    fn adc_ref(namespace: &str, name: &str) -> serde_json::Value {
        json!({"group": ADC.group, "resource": ADC.plural, "namespace": namespace, "name": name})
    }

    fn management(default: Option<(&str, &str)>) -> ManagementAddOnSpec {
        let mut supported = vec![json!({"group": TEMPLATE.group, "resource": TEMPLATE.plural,
            "defaultConfig": {"name": "kmm-template"}})];
        if let Some((namespace, name)) = default {
            supported.push(json!({"group": ADC.group, "resource": ADC.plural,
                "defaultConfig": {"namespace": namespace, "name": name}}));
        }
        parse(&json!({"supportedConfigs": supported, "installStrategy": {"type": "Manual"}}))
    }

    fn variables(pairs: &[(&str, &str)]) -> DeploymentConfigSpec {
        DeploymentConfigSpec {
            customized_variables: pairs
                .iter()
                .map(|(name, value)| Variable {
                    name: (*name).into(),
                    value: (*value).into(),
                })
                .collect(),
            registries: Vec::new(),
        }
    }

    #[test]
    fn used_configs_are_the_default_placements_and_every_add_on_reference() {
        let mut cma = management(Some(("kmm", "defaults")));
        cma.install_strategy = parse(&json!({"type": "Placements", "placements": [
            {"name": "p", "namespace": "kmm", "configs": [adc_ref("kmm", "canary")]},
        ]}));
        let spec: AddOnSpec = parse(&json!({"configs": [
            adc_ref("spoke1", "own"),
            {"group": TEMPLATE.group, "resource": TEMPLATE.plural, "name": "t"},
        ]}));
        let status: AddOnStatus = parse(&json!({"configReferences": [{
            "group": ADC.group, "resource": ADC.plural, "namespace": "old", "name": "old",
            "desiredConfig": {"namespace": "spoke1", "name": "own", "specHash": "h"},
            "lastObservedGeneration": 1,
        }]}));
        let other_status: AddOnStatus =
            parse(&json!({"configReferences": [adc_ref("spoke2", "theirs")]}));
        let empty = AddOnSpec::default();
        let used = used_configs(Some(&cma), [(&spec, &status), (&empty, &other_status)]);
        assert_eq!(
            used.iter().map(ToString::to_string).collect::<Vec<_>>(),
            ["kmm/canary", "kmm/defaults", "spoke1/own", "spoke2/theirs"]
        );
    }

    #[test]
    fn incomplete_or_foreign_references_are_ignored() {
        let spec: AddOnSpec = parse(&json!({"configs": [
            {"group": ADC.group, "resource": ADC.plural, "name": "no-namespace"},
            {"group": "other.example", "resource": ADC.plural, "namespace": "a", "name": "b"},
        ]}));
        let status = AddOnStatus::default();
        assert!(used_configs(None, [(&spec, &status)]).is_empty());
        assert!(used_configs(Some(&management(None)), []).is_empty());
    }

    #[test]
    fn the_effective_config_is_the_first_resolved_reference_then_the_own_then_the_default() {
        let cma = management(Some(("kmm", "defaults")));
        let own: AddOnSpec = parse(&json!({"configs": [adc_ref("spoke1", "own")]}));
        let resolved: AddOnStatus = parse(&json!({"configReferences": [
            {"group": TEMPLATE.group, "resource": TEMPLATE.plural, "name": "t"},
            adc_ref("kmm", "first"),
            adc_ref("kmm", "second"),
        ]}));
        let none = AddOnStatus::default();
        let effective = |spec, status| effective_config(Some(&cma), spec, status);
        assert_eq!(
            effective(&own, &resolved),
            Some(ConfigName::new("kmm", "first"))
        );
        assert_eq!(
            effective(&own, &none),
            Some(ConfigName::new("spoke1", "own"))
        );
        assert_eq!(
            effective(&AddOnSpec::default(), &none),
            Some(ConfigName::new("kmm", "defaults"))
        );
        assert_eq!(effective_config(None, &AddOnSpec::default(), &none), None);
    }

    #[test]
    fn each_cluster_gets_the_mirrors_of_the_config_its_add_on_uses() {
        let cma = management(Some(("kmm", "defaults")));
        let own: AddOnSpec = parse(&json!({"configs": [adc_ref("spoke1", "own")]}));
        let plain = AddOnSpec::default();
        let status = AddOnStatus::default();
        let with_mirror: DeploymentConfigSpec = parse(&json!({
            "registries": [{"source": "r.example", "mirror": "m.example"}],
        }));
        let without = DeploymentConfigSpec::default();
        let configs = BTreeMap::from([
            (ConfigName::new("spoke1", "own"), with_mirror),
            (ConfigName::new("kmm", "defaults"), without),
        ]);
        let mirrors = mirrors_by_cluster(
            Some(&cma),
            [("spoke1", &own, &status), ("spoke2", &plain, &status)],
            |name| configs.get(name),
        );
        assert_eq!(
            mirrors,
            BTreeMap::from([(
                "spoke1".to_owned(),
                vec![ImageMirror {
                    source: "r.example".into(),
                    mirror: "m.example".into()
                }]
            )]),
            "spoke2's default config has none"
        );
    }

    #[test]
    fn the_bundle_is_the_pems_base64_in_parts_ocm_accepts() {
        let pem = format!(
            "-----BEGIN CERTIFICATE-----\n{}\n-----END CERTIFICATE-----\n",
            "A".repeat(1040)
        );
        let bundle = ca_bundle_variables(&pem).unwrap();
        let names: Vec<&str> = bundle.iter().map(|v| v.name.as_str()).collect();
        assert_eq!(names, ["HUB_CA_BUNDLE_1", "HUB_CA_BUNDLE_2"]);
        assert!(bundle.iter().all(|v| v.value.len() <= MAX_VALUE_LEN));
        let joined: String = bundle.iter().map(|v| v.value.as_str()).collect();
        assert_eq!(STANDARD.decode(joined).unwrap(), pem.as_bytes());
    }

    #[test]
    fn a_bundle_beyond_what_the_template_reads_is_refused() {
        assert_eq!(ca_bundle_variables(&"x".repeat(3072)).unwrap().len(), 4);
        let error = ca_bundle_variables(&"x".repeat(3073)).unwrap_err();
        assert!(error.to_string().contains("needs 5 variables"), "{error}");
    }

    #[test]
    fn an_adc_lacks_the_bundle_until_every_part_is_there_as_is() {
        let bundle = ca_bundle_variables("pem").unwrap();
        let user = ("HUB_ADDRESS", "https://hub:7443");
        assert!(lacks(&variables(&[user]), &bundle));
        assert!(lacks(
            &variables(&[user, ("HUB_CA_BUNDLE_1", "stale")]),
            &bundle
        ));
        let value = bundle[0].value.clone();
        assert!(!lacks(
            &variables(&[user, ("HUB_CA_BUNDLE_1", &value)]),
            &bundle
        ));
    }

    #[test]
    fn required_variables_must_be_set_and_non_empty() {
        let configs = BTreeMap::from([
            (
                ConfigName::new("kmm", "complete"),
                variables(&[
                    ("HUB_ADDRESS", "https://hub:7443"),
                    ("LOG_LEVEL", "info"),
                    ("FIRMWARE_DIR", "/lib/firmware"),
                ]),
            ),
            (
                ConfigName::new("kmm", "partial"),
                variables(&[
                    ("HUB_ADDRESS", " "),
                    ("LOG_LEVEL", "info"),
                    ("FIRMWARE_DIR", "/lib/firmware"),
                ]),
            ),
            (
                ConfigName::new("kmm", "relative-firmware"),
                variables(&[
                    ("HUB_ADDRESS", "https://hub:7443"),
                    ("LOG_LEVEL", "info"),
                    ("FIRMWARE_DIR", "var/lib/firmware"),
                ]),
            ),
            (
                ConfigName::new("kmm", "bad-pull-secret"),
                variables(&[
                    ("HUB_ADDRESS", "https://hub:7443"),
                    ("LOG_LEVEL", "info"),
                    ("FIRMWARE_DIR", "/lib/firmware"),
                    ("CLUSTER_PULL_SECRET", "Pull_Secret"),
                ]),
            ),
            (
                ConfigName::new("kmm", "pull-secret"),
                variables(&[
                    ("HUB_ADDRESS", "https://hub:7443"),
                    ("LOG_LEVEL", "info"),
                    ("FIRMWARE_DIR", "/lib/firmware"),
                    ("CLUSTER_PULL_SECRET", "registry.pull-1"),
                ]),
            ),
            (ConfigName::new("kmm", "empty"), variables(&[])),
        ]);
        let problem =
            |name: &str| config_problem(Some(&ConfigName::new("kmm", name)), |c| configs.get(c));
        assert_eq!(problem("complete"), None, "CLUSTER_PULL_SECRET is optional");
        assert_eq!(problem("pull-secret"), None);
        assert_eq!(
            problem("bad-pull-secret").unwrap().to_string(),
            "AddOnDeploymentConfig kmm/bad-pull-secret: spec.customizedVariables \
             CLUSTER_PULL_SECRET \"Pull_Secret\" must be a Secret's name: lower-case letters, \
             digits, - and ., at most 253 characters"
        );
        let partial = problem("partial").unwrap();
        assert_eq!(
            partial,
            ConfigProblem::Missing {
                config: ConfigName::new("kmm", "partial"),
                variables: vec!["HUB_ADDRESS"],
            }
        );
        assert!(
            partial
                .to_string()
                .starts_with("AddOnDeploymentConfig kmm/partial does not set HUB_ADDRESS "),
            "{partial}"
        );
        assert!(
            problem("empty")
                .unwrap()
                .to_string()
                .contains("does not set HUB_ADDRESS, LOG_LEVEL, FIRMWARE_DIR"),
        );
        let relative = problem("relative-firmware").unwrap();
        assert_eq!(
            relative.to_string(),
            "AddOnDeploymentConfig kmm/relative-firmware: spec.customizedVariables \
             FIRMWARE_DIR \"var/lib/firmware\" must be an absolute path"
        );
        let absent = problem("absent").unwrap();
        assert_eq!(
            absent,
            ConfigProblem::NotFound(ConfigName::new("kmm", "absent"))
        );
        assert!(absent.to_string().contains("kmm/absent"), "{absent}");
        let none = config_problem(None, |c| configs.get(c)).unwrap();
        assert!(
            none.to_string()
                .contains("HUB_ADDRESS, LOG_LEVEL, FIRMWARE_DIR"),
            "{none}"
        );
    }

    #[test]
    fn a_firmware_dir_is_a_plain_absolute_path() {
        for good in ["/lib/firmware", "/var/lib/firmware", "/opt/kmm-fw_1.2"] {
            assert_eq!(firmware_dir_problem(good), None, "{good}");
        }
        for (bad, why) in [
            ("", "absolute"),
            ("lib/firmware", "absolute"),
            ("/", "root"),
            ("/var/lib/firmware/", "end in /"),
            ("/var//firmware", "empty component"),
            ("/var/lib/../etc", ".."),
            ("/var/./firmware", ".."),
            ("/var/lib/firm ware", "only letters"),
            ("/var/lib/$(HOME)", "only letters"),
        ] {
            let problem = firmware_dir_problem(bad).unwrap_or_else(|| panic!("{bad:?} accepted"));
            assert!(problem.contains(why), "{bad:?}: {problem}");
        }
    }

    #[test]
    fn a_cluster_pull_secret_is_a_secrets_name_or_nothing() {
        for good in ["", "pull", "registry.example-pull", &"a".repeat(253)] {
            assert_eq!(pull_secret_name_problem(good), None, "{good}");
        }
        for bad in [
            "Pull",
            "pull_secret",
            "-pull",
            "pull.",
            " pull",
            &"a".repeat(254),
        ] {
            assert!(pull_secret_name_problem(bad).is_some(), "{bad:?} accepted");
        }
    }

    /// A CA certificate's PEM.
    fn ca_pem() -> String {
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        params
            .self_signed(&rcgen::KeyPair::generate().unwrap())
            .unwrap()
            .pem()
    }

    /// The variables holding `pem` as a user sets them: base64, in parts of 1024.
    fn registry_bundle(pem: &str) -> Vec<Variable> {
        STANDARD
            .encode(pem)
            .as_bytes()
            .chunks(MAX_VALUE_LEN)
            .enumerate()
            .map(|(i, part)| Variable {
                name: format!("{REGISTRY_CA_BUNDLE_PREFIX}{}", i + 1),
                value: String::from_utf8(part.to_vec()).unwrap(),
            })
            .collect()
    }

    #[test]
    fn the_registries_ca_bundle_is_optional_and_checked_when_set() {
        assert_eq!(registry_ca_bundle_problem(&[]), None);
        let two = format!("{}{}", ca_pem(), ca_pem());
        let bundle = registry_bundle(&two);
        assert!(bundle.len() > 1, "two CAs take more than one variable");
        assert_eq!(registry_ca_bundle_problem(&bundle), None);

        let problem = |variables: &[Variable]| registry_ca_bundle_problem(variables).unwrap();
        let mut missing_part = bundle.clone();
        missing_part.remove(0);
        assert!(
            problem(&missing_part).starts_with("is not "),
            "{}",
            problem(&missing_part)
        );
        let not_base64 = [Variable {
            name: "REGISTRY_CA_BUNDLE_1".into(),
            value: "-----BEGIN CERTIFICATE-----".into(),
        }];
        assert!(problem(&not_base64).starts_with("is not base64"));
        let key = registry_bundle(&rcgen::KeyPair::generate().unwrap().serialize_pem());
        assert_eq!(
            problem(&key),
            "is not a CA bundle: PEM block 1 is a PRIVATE KEY, not a CERTIFICATE"
        );
        let mut fifth = bundle.clone();
        fifth.push(Variable {
            name: "REGISTRY_CA_BUNDLE_5".into(),
            value: "AAAA".into(),
        });
        assert!(problem(&fifth).contains("REGISTRY_CA_BUNDLE_5, which the add-on's template"));

        let mut complete = variables(&[
            ("HUB_ADDRESS", "https://hub:7443"),
            ("LOG_LEVEL", "info"),
            ("FIRMWARE_DIR", "/lib/firmware"),
        ]);
        complete.customized_variables.extend(not_base64);
        let configs = BTreeMap::from([(ConfigName::new("kmm", "ca"), complete)]);
        let named = config_problem(Some(&ConfigName::new("kmm", "ca")), |c| configs.get(c))
            .unwrap()
            .to_string();
        assert!(
            named.starts_with(
                "AddOnDeploymentConfig kmm/ca: spec.customizedVariables REGISTRY_CA_BUNDLE_1..4"
            ),
            "{named}"
        );
    }

    #[test]
    fn misshapen_fields_read_as_empty() {
        let spec: DeploymentConfigSpec = parse(&json!({"customizedVariables": "nonsense"}));
        assert!(spec.customized_variables.is_empty());
        let spec: AddOnSpec = parse(&serde_json::Value::Null);
        assert!(spec.configs.is_empty());
    }
}
