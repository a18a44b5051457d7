//! The cluster's own pull Secret (the add-on's variable `CLUSTER_PULL_SECRET`, a Secret in
//! the proxy's namespace that the cluster's owners keep): what it gives the loads the hub
//! sent without a credential (modules that name no `imageRepoSecret`), and why those loads
//! wait when it cannot be used. Pure: `cluster_pull_secret_sync` reads the Secret and
//! hands it here.
//!
//! Its content reaches the agents as the hub's credentials do, in memory, in the node's
//! `DesiredModules`; `Debug` never shows it and no error quotes it.

use std::fmt;

use k8s_openapi::api::core::v1::Secret;
use kmm_proto::v1::{ModuleLoad, PullCredential, Unresolved, pull_credential::Content};
use kmm_registry::PullSecret;

/// The add-on variable that names the Secret.
pub const VARIABLE: &str = "CLUSTER_PULL_SECRET";

/// Whether `name` can name a Secret: a DNS subdomain (lower-case letters, digits, `-`
/// and `.`, at most 253 characters).
pub fn is_secret_name(name: &str) -> bool {
    name.len() <= 253
        && name.split('.').all(|label| {
            !label.is_empty()
                && !label.starts_with('-')
                && !label.ends_with('-')
                && label
                    .bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        })
}

/// The configured Secret: the proxy's namespace and the variable's value.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SecretRef {
    pub namespace: String,
    pub name: String,
}

impl SecretRef {
    /// The credential id loads name it by. A Secret's name holds no `:`, so it is never
    /// the id of one of the hub's credentials (an `imageRepoSecret`'s name).
    pub fn credential_id(&self) -> String {
        format!("cluster:{self}")
    }
}

impl fmt::Display for SecretRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

/// Why the configured Secret cannot be used. The text never quotes its content.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SecretProblem {
    #[error("does not exist")]
    NotFound,
    #[error("cannot be read: {0}")]
    Unreadable(String),
    #[error("holds neither .dockerconfigjson nor .dockercfg (type {type_}, keys: {keys})")]
    NoDockerConfig { type_: String, keys: String },
    #[error("is not usable: {0}")]
    Invalid(String),
}

impl SecretProblem {
    /// The node status reason of a load that waits for the Secret.
    pub fn reason(&self) -> &'static str {
        match self {
            Self::NotFound => "ClusterPullSecretNotFound",
            Self::Unreadable(_) => "ClusterPullSecretUnreadable",
            Self::NoDockerConfig { .. } | Self::Invalid(_) => "ClusterPullSecretInvalid",
        }
    }
}

/// Where the cluster's pull Secret stands. `Debug` shows no credential.
#[derive(Clone, Default, PartialEq)]
pub enum ClusterPullSecret {
    /// None configured: loads go to the agents as the hub sent them.
    #[default]
    NotConfigured,
    Usable {
        secret: SecretRef,
        credential: PullCredential,
    },
    /// Configured, but the loads it is for wait, saying why on their nodes' statuses.
    Unusable {
        secret: SecretRef,
        problem: SecretProblem,
    },
}

impl fmt::Debug for ClusterPullSecret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::NotConfigured => f.write_str("NotConfigured"),
            Self::Usable { secret, .. } => f
                .debug_struct("Usable")
                .field("secret", secret)
                .finish_non_exhaustive(),
            Self::Unusable { secret, problem } => f
                .debug_struct("Unusable")
                .field("secret", secret)
                .field("problem", problem)
                .finish(),
        }
    }
}

impl fmt::Display for ClusterPullSecret {
    /// For logs: which Secret, and whether it can be used.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::NotConfigured => write!(f, "no cluster pull Secret ({VARIABLE} is unset)"),
            Self::Usable { secret, .. } => write!(f, "cluster pull Secret {secret} is usable"),
            Self::Unusable { secret, problem } => {
                write!(f, "cluster pull Secret {secret} {problem}")
            }
        }
    }
}

impl ClusterPullSecret {
    /// What the Secret as read (`None`: it does not exist) makes of `secret`.
    pub fn read(secret: &SecretRef, found: Option<&Secret>) -> Self {
        match found.map(|s| credential(secret, s)) {
            Some(Ok(credential)) => Self::Usable {
                secret: secret.clone(),
                credential,
            },
            Some(Err(problem)) => Self::Unusable {
                secret: secret.clone(),
                problem,
            },
            None => Self::Unusable {
                secret: secret.clone(),
                problem: SecretProblem::NotFound,
            },
        }
    }

    /// After a failed read (`error`, the API's answer): a credential already known stays,
    /// for a passing API outage must not stop loads; otherwise the failure is what loads
    /// wait for.
    pub fn read_failed(&self, secret: &SecretRef, error: String) -> Self {
        match self {
            Self::Usable { secret: known, .. } if known == secret => self.clone(),
            _ => Self::Unusable {
                secret: secret.clone(),
                problem: SecretProblem::Unreadable(error),
            },
        }
    }

    /// Gives `load` the cluster's credential when the hub sent it none, or says why it
    /// cannot be loaded now. A load with the hub's credential, or on a cluster without a
    /// pull Secret, is left as it is.
    pub fn supply(&self, load: &mut ModuleLoad) -> Result<(), Unresolved> {
        if !load.pull_credential_id.is_empty() {
            return Ok(());
        }
        match self {
            Self::NotConfigured => Ok(()),
            Self::Usable { credential, .. } => {
                load.pull_credential_id.clone_from(&credential.id);
                Ok(())
            }
            Self::Unusable { secret, problem } => Err(Unresolved {
                reason: problem.reason().to_owned(),
                message: format!(
                    "the cluster's pull Secret {secret} (the add-on's variable {VARIABLE}) \
                     {problem}; this module names no imageRepoSecret, so its images are \
                     pulled with it"
                ),
            }),
        }
    }

    /// The credential `id` names, when it is the cluster's.
    pub fn credential(&self, id: &str) -> Option<&PullCredential> {
        match self {
            Self::Usable { credential, .. } if credential.id == id => Some(credential),
            _ => None,
        }
    }

    /// The credential, while the Secret is usable.
    pub fn usable(&self) -> Option<&PullCredential> {
        match self {
            Self::Usable { credential, .. } => Some(credential),
            _ => None,
        }
    }

    pub fn is_configured(&self) -> bool {
        !matches!(self, Self::NotConfigured)
    }
}

/// The Secret's Docker configuration as a credential (`.dockerconfigjson` first, as the
/// hub reads `imageRepoSecret`s), checked the way the agents will read it.
fn credential(secret: &SecretRef, found: &Secret) -> Result<PullCredential, SecretProblem> {
    let data = found.data.clone().unwrap_or_default();
    let text = |key: &str| {
        data.get(key).map(|value| {
            String::from_utf8(value.0.clone())
                .map_err(|_| SecretProblem::Invalid(format!("its {key} is not UTF-8")))
        })
    };
    let (pull_secret, content) = match (text(".dockerconfigjson"), text(".dockercfg")) {
        (Some(json), _) => {
            let json = json?;
            (
                PullSecret::DockerConfigJson(json.clone()),
                Content::DockerConfigJson(json.into_bytes()),
            )
        }
        (None, Some(cfg)) => {
            let cfg = cfg?;
            (
                PullSecret::DockerCfg(cfg.clone()),
                Content::DockerCfg(cfg.into_bytes()),
            )
        }
        (None, None) => {
            return Err(SecretProblem::NoDockerConfig {
                type_: found.type_.clone().unwrap_or_else(|| "Opaque".to_owned()),
                keys: if data.is_empty() {
                    "none".to_owned()
                } else {
                    data.keys().cloned().collect::<Vec<_>>().join(", ")
                },
            });
        }
    };
    let registries = kmm_registry::credentials::parse(&pull_secret)
        .map_err(|e| SecretProblem::Invalid(e.to_string()))?;
    if registries.is_empty() {
        return Err(SecretProblem::Invalid(
            "its Docker configuration names no registry".to_owned(),
        ));
    }
    Ok(PullCredential {
        id: secret.credential_id(),
        content: Some(content),
    })
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use k8s_openapi::ByteString;

    use super::*;

    const PASSWORD: &str = "s3cr3t-pw";

    fn secret_ref() -> SecretRef {
        SecretRef {
            namespace: "kmm".into(),
            name: "pull".into(),
        }
    }

    fn secret(type_: &str, data: &[(&str, &[u8])]) -> Secret {
        Secret {
            type_: Some(type_.to_owned()),
            data: Some(
                data.iter()
                    .map(|(k, v)| ((*k).to_owned(), ByteString(v.to_vec())))
                    .collect::<BTreeMap<_, _>>(),
            ),
            ..Secret::default()
        }
    }

    fn docker_config() -> String {
        format!(
            r#"{{"auths":{{"registry.example:5000":{{"username":"robot","password":"{PASSWORD}"}}}}}}"#
        )
    }

    fn usable() -> ClusterPullSecret {
        let found = secret(
            "kubernetes.io/dockerconfigjson",
            &[(".dockerconfigjson", docker_config().as_bytes())],
        );
        ClusterPullSecret::read(&secret_ref(), Some(&found))
    }

    fn problem(state: &ClusterPullSecret) -> &SecretProblem {
        match state {
            ClusterPullSecret::Unusable { problem, .. } => problem,
            other => panic!("usable or unconfigured: {other:?}"),
        }
    }

    #[test]
    fn a_docker_config_is_a_credential_named_after_the_secret() {
        let state = usable();
        let credential = state.usable().expect("usable");
        assert_eq!(credential.id, "cluster:kmm/pull");
        assert_eq!(
            credential.content,
            Some(Content::DockerConfigJson(docker_config().into_bytes()))
        );
        let legacy = secret(
            "kubernetes.io/dockercfg",
            &[(
                ".dockercfg",
                br#"{"registry.example:5000":{"auth":"cm9ib3Q6cHc="}}"#,
            )],
        );
        let state = ClusterPullSecret::read(&secret_ref(), Some(&legacy));
        assert!(matches!(
            state.usable().unwrap().content,
            Some(Content::DockerCfg(_))
        ));
    }

    #[test]
    fn a_missing_or_malformed_secret_is_named_with_its_problem_never_its_content() {
        assert_eq!(
            problem(&ClusterPullSecret::read(&secret_ref(), None)),
            &SecretProblem::NotFound
        );
        let opaque = secret("Opaque", &[("token", PASSWORD.as_bytes())]);
        let state = ClusterPullSecret::read(&secret_ref(), Some(&opaque));
        assert_eq!(
            state.to_string(),
            "cluster pull Secret kmm/pull holds neither .dockerconfigjson nor .dockercfg \
             (type Opaque, keys: token)"
        );
        let broken = format!(r#"{{"auths":{{"r":{{"password":"{PASSWORD}""#);
        for (found, says) in [
            (
                secret(
                    "kubernetes.io/dockerconfigjson",
                    &[(".dockerconfigjson", broken.as_bytes())],
                ),
                "not a valid .dockerconfigjson: JSON error at line 1",
            ),
            (
                secret(
                    "kubernetes.io/dockerconfigjson",
                    &[(".dockerconfigjson", &[0xff, 0xfe])],
                ),
                ".dockerconfigjson is not UTF-8",
            ),
            (
                secret(
                    "kubernetes.io/dockerconfigjson",
                    &[(".dockerconfigjson", br#"{"auths":{}}"#)],
                ),
                "names no registry",
            ),
            (
                secret(
                    "kubernetes.io/dockerconfigjson",
                    &[(".dockerconfigjson", br#"{"auths":{"r":{"email":"x"}}}"#)],
                ),
                "neither `auth` nor `username`/`password`",
            ),
        ] {
            let state = ClusterPullSecret::read(&secret_ref(), Some(&found));
            let problem = problem(&state);
            assert_eq!(problem.reason(), "ClusterPullSecretInvalid");
            let text = state.to_string();
            assert!(
                text.starts_with("cluster pull Secret kmm/pull is not usable: ")
                    && text.contains(says),
                "{text}"
            );
            assert!(!text.contains(PASSWORD), "{text}");
        }
    }

    #[test]
    fn a_failed_read_keeps_known_credentials_and_otherwise_says_so() {
        let kept = usable().read_failed(&secret_ref(), "connection refused".into());
        assert_eq!(kept, usable());
        let renamed = SecretRef {
            name: "other".into(),
            ..secret_ref()
        };
        let other = usable().read_failed(&renamed, "forbidden".into());
        assert_eq!(
            problem(&other),
            &SecretProblem::Unreadable("forbidden".into())
        );
        let missing = ClusterPullSecret::read(&secret_ref(), None);
        let failed = missing.read_failed(&secret_ref(), "forbidden".into());
        assert_eq!(problem(&failed).reason(), "ClusterPullSecretUnreadable");
    }

    #[test]
    fn only_loads_the_hub_sent_without_a_credential_take_the_clusters() {
        let mut hubs = ModuleLoad {
            pull_credential_id: "hub-pull".into(),
            ..ModuleLoad::default()
        };
        for state in [usable(), ClusterPullSecret::read(&secret_ref(), None)] {
            state.supply(&mut hubs).unwrap();
            assert_eq!(hubs.pull_credential_id, "hub-pull");
        }
        let mut load = ModuleLoad::default();
        ClusterPullSecret::NotConfigured.supply(&mut load).unwrap();
        assert_eq!(load.pull_credential_id, "");
        let state = usable();
        state.supply(&mut load).unwrap();
        assert_eq!(load.pull_credential_id, "cluster:kmm/pull");
        assert_eq!(
            state.credential(&load.pull_credential_id),
            state.usable(),
            "the id finds the credential"
        );
        assert_eq!(state.credential("hub-pull"), None);
    }

    #[test]
    fn a_load_waits_for_an_unusable_secret_naming_it_and_the_variable() {
        let mut load = ModuleLoad::default();
        let why = ClusterPullSecret::read(&secret_ref(), None)
            .supply(&mut load)
            .unwrap_err();
        assert_eq!(why.reason, "ClusterPullSecretNotFound");
        assert_eq!(
            why.message,
            "the cluster's pull Secret kmm/pull (the add-on's variable CLUSTER_PULL_SECRET) \
             does not exist; this module names no imageRepoSecret, so its images are pulled \
             with it"
        );
    }

    #[test]
    fn secret_names_are_dns_subdomains() {
        for good in ["pull", "registry.example-pull", "a1", &"a".repeat(253)] {
            assert!(is_secret_name(good), "{good}");
        }
        for bad in [
            "",
            "Pull",
            "pull_secret",
            "-pull",
            "pull.",
            "a..b",
            &"a".repeat(254),
        ] {
            assert!(!is_secret_name(bad), "{bad:?}");
        }
    }

    #[test]
    fn debug_never_shows_the_credential() {
        let text = format!("{:?} {}", usable(), usable());
        assert!(
            text.contains("kmm/pull") || text.contains("\"pull\""),
            "{text}"
        );
        assert!(!text.contains(PASSWORD), "{text}");
        assert!(!text.contains("robot"), "{text}");
    }
}
