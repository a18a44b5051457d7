//! The pull Secrets of device plugins' Pods. Pure.
//!
//! The kubelet pulls a plugin's image, with Secrets of the plugin Pod's own namespace
//! only. The Pods list:
//! - the module's `imageRepoSecret` by name, as upstream's do: a Secret of that name the
//!   cluster's owners may keep in the module's namespace (the hub's never leaves the hub);
//! - on a cluster with a pull Secret of its own (`CLUSTER_PULL_SECRET`), [`COPY`]: a copy
//!   of that Secret the proxy keeps in each namespace where a plugin runs. The copy is
//!   owned by the namespace's plugin DaemonSets, so Kubernetes deletes it with the last of
//!   them; the proxy deletes it itself when the cluster's Secret goes or becomes unusable.
//!   It is listed whenever the cluster names a pull Secret, usable or not, so that the
//!   Secret coming and going never changes the Pod template (which would restart every
//!   plugin); the kubelet skips a listed Secret that does not exist.

use std::collections::BTreeSet;

use k8s_openapi::ByteString;
use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::{LocalObjectReference, Secret};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use kmm_proto::v1::{DevicePlugin, PullCredential, pull_credential::Content};

use crate::device_plugin::{MANAGED_BY, MANAGED_BY_LABEL, OWNER_LABEL};

/// The name of the cluster pull Secret's copy in a plugin's namespace. Fixed, so that the
/// proxy's RBAC can name it.
pub const COPY: &str = "kmm-device-plugin-pull-secret";

/// The plugin Pod's `imagePullSecrets`: the module's `imageRepoSecret`, then the copy of
/// the cluster's pull Secret when the cluster names one.
pub fn image_pull_secrets(
    plugin: &DevicePlugin,
    cluster_secret_configured: bool,
) -> Vec<LocalObjectReference> {
    let mut names: Vec<&str> = Vec::new();
    if !plugin.image_repo_secret.is_empty() {
        names.push(&plugin.image_repo_secret);
    }
    if cluster_secret_configured && !names.contains(&COPY) {
        names.push(COPY);
    }
    names
        .into_iter()
        .map(|name| LocalObjectReference {
            name: name.to_owned(),
        })
        .collect()
}

/// `set`, its Pods listing `secrets` as their `imagePullSecrets` (none when empty).
pub fn with_image_pull_secrets(
    mut set: DaemonSet,
    secrets: Vec<LocalObjectReference>,
) -> DaemonSet {
    if let Some(pod) = set
        .spec
        .as_mut()
        .and_then(|spec| spec.template.spec.as_mut())
    {
        pod.image_pull_secrets = (!secrets.is_empty()).then_some(secrets);
    }
    set
}

/// A plugin DaemonSet the copy belongs to.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Owner {
    pub name: String,
    pub uid: String,
}

/// The copy of the cluster's pull Secret (its `credential`) in `namespace`, owned by the
/// namespace's plugin DaemonSets and labelled as the proxy of `proxy_namespace`'s.
pub fn copy(
    namespace: &str,
    credential: &PullCredential,
    owners: &[Owner],
    proxy_namespace: &str,
) -> Secret {
    let (type_, key, bytes) = match &credential.content {
        Some(Content::DockerCfg(bytes)) => ("kubernetes.io/dockercfg", ".dockercfg", bytes.clone()),
        Some(Content::DockerConfigJson(bytes)) => (
            "kubernetes.io/dockerconfigjson",
            ".dockerconfigjson",
            bytes.clone(),
        ),
        // The proxy makes credentials only from a Secret's Docker configuration.
        None => (
            "kubernetes.io/dockerconfigjson",
            ".dockerconfigjson",
            Vec::new(),
        ),
    };
    Secret {
        metadata: ObjectMeta {
            name: Some(COPY.to_owned()),
            namespace: Some(namespace.to_owned()),
            labels: Some(
                [
                    (MANAGED_BY_LABEL.to_owned(), MANAGED_BY.to_owned()),
                    (OWNER_LABEL.to_owned(), proxy_namespace.to_owned()),
                ]
                .into(),
            ),
            owner_references: Some(
                owners
                    .iter()
                    .map(|owner| OwnerReference {
                        api_version: "apps/v1".to_owned(),
                        kind: "DaemonSet".to_owned(),
                        name: owner.name.clone(),
                        uid: owner.uid.clone(),
                        ..OwnerReference::default()
                    })
                    .collect(),
            ),
            ..ObjectMeta::default()
        },
        type_: Some(type_.to_owned()),
        data: Some([(key.to_owned(), ByteString(bytes))].into()),
        ..Secret::default()
    }
}

/// What to do about the copy in a namespace.
#[derive(Debug, PartialEq)]
pub enum CopyAction {
    Nothing,
    Create(Box<Secret>),
    /// Replace the copy there (the wanted one carries its resourceVersion).
    Update(Box<Secret>),
    /// Delete the copy there, then create this one: a Secret's type cannot change.
    Recreate(Box<Secret>),
    Delete,
    /// A Secret of that name the proxy did not make: left alone.
    Foreign,
}

/// Whether `secret` is a copy made by the proxy of `proxy_namespace`.
fn ours(secret: &Secret, proxy_namespace: &str) -> bool {
    let labels = secret.metadata.labels.as_ref();
    let label = |key: &str| labels.and_then(|l| l.get(key)).map(String::as_str);
    label(MANAGED_BY_LABEL) == Some(MANAGED_BY) && label(OWNER_LABEL) == Some(proxy_namespace)
}

/// The owners' uids, whatever their order.
fn owner_uids(secret: &Secret) -> BTreeSet<&str> {
    secret
        .metadata
        .owner_references
        .iter()
        .flatten()
        .map(|o| o.uid.as_str())
        .collect()
}

/// What takes the namespace from the copy `existing` (as the API has it) to `wanted`
/// (`None`: no copy).
pub fn copy_action(
    existing: Option<&Secret>,
    wanted: Option<Secret>,
    proxy_namespace: &str,
) -> CopyAction {
    match (existing, wanted) {
        (None, None) => CopyAction::Nothing,
        (None, Some(wanted)) => CopyAction::Create(Box::new(wanted)),
        (Some(existing), _) if !ours(existing, proxy_namespace) => CopyAction::Foreign,
        (Some(_), None) => CopyAction::Delete,
        (Some(existing), Some(wanted)) if existing.type_ != wanted.type_ => {
            CopyAction::Recreate(Box::new(wanted))
        }
        (Some(existing), Some(wanted))
            if existing.data == wanted.data && owner_uids(existing) == owner_uids(&wanted) =>
        {
            CopyAction::Nothing
        }
        (Some(existing), Some(mut wanted)) => {
            wanted
                .metadata
                .resource_version
                .clone_from(&existing.metadata.resource_version);
            CopyAction::Update(Box::new(wanted))
        }
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::device_plugin::daemon_set;
    use crate::module_id::ModuleId;

    fn plugin(image_repo_secret: &str) -> DevicePlugin {
        DevicePlugin {
            spec_json: json!({"container": {"image": "reg/plugin:1"}}).to_string(),
            image_repo_secret: image_repo_secret.to_owned(),
        }
    }

    fn names(secrets: &[LocalObjectReference]) -> Vec<&str> {
        secrets.iter().map(|s| s.name.as_str()).collect()
    }

    fn credential(content: Content) -> PullCredential {
        PullCredential {
            id: "cluster:kmm/pull".into(),
            content: Some(content),
        }
    }

    fn json_credential(config: &str) -> PullCredential {
        credential(Content::DockerConfigJson(config.as_bytes().to_vec()))
    }

    fn owners(uids: &[&str]) -> Vec<Owner> {
        uids.iter()
            .map(|uid| Owner {
                name: format!("{uid}-device-plugin"),
                uid: (*uid).to_owned(),
            })
            .collect()
    }

    /// `secret` as the API answers it: with a resourceVersion.
    fn stored(mut secret: Secret) -> Secret {
        secret.metadata.resource_version = Some("42".into());
        secret
    }

    #[test]
    fn plugin_pods_list_the_modules_secret_as_upstream_and_the_clusters_copy() {
        assert_eq!(
            names(&image_pull_secrets(&plugin("pull"), false)),
            ["pull"],
            "upstream's: the module's imageRepoSecret"
        );
        assert_eq!(
            names(&image_pull_secrets(&plugin("pull"), true)),
            ["pull", COPY]
        );
        assert_eq!(names(&image_pull_secrets(&plugin(""), true)), [COPY]);
        assert!(image_pull_secrets(&plugin(""), false).is_empty());
        assert_eq!(names(&image_pull_secrets(&plugin(COPY), true)), [COPY]);
    }

    #[test]
    fn the_rendered_pods_carry_the_pull_secrets_and_nothing_else_changes() {
        let id = ModuleId {
            namespace: "drivers".into(),
            name: "hello".into(),
        };
        let rendered = daemon_set(&id, &plugin("pull"), &[], "kmm").unwrap();
        let with =
            with_image_pull_secrets(rendered.clone(), image_pull_secrets(&plugin("pull"), true));
        let pod = with.spec.as_ref().unwrap().template.spec.as_ref().unwrap();
        assert_eq!(
            names(pod.image_pull_secrets.as_deref().unwrap()),
            ["pull", COPY]
        );
        let mut without = with.clone();
        without
            .spec
            .as_mut()
            .unwrap()
            .template
            .spec
            .as_mut()
            .unwrap()
            .image_pull_secrets = None;
        assert_eq!(without, rendered);
        let none = with_image_pull_secrets(rendered.clone(), vec![]);
        assert_eq!(none, rendered, "no list rather than an empty one");
    }

    #[test]
    fn the_copy_is_the_clusters_secret_owned_by_the_namespaces_plugins() {
        let copy = copy(
            "drivers",
            &json_credential(r#"{"auths":{}}"#),
            &owners(&["u1", "u2"]),
            "kmm",
        );
        assert_eq!(copy.metadata.name.as_deref(), Some(COPY));
        assert_eq!(copy.metadata.namespace.as_deref(), Some("drivers"));
        assert_eq!(
            copy.type_.as_deref(),
            Some("kubernetes.io/dockerconfigjson")
        );
        assert_eq!(
            copy.data.as_ref().unwrap()[".dockerconfigjson"],
            ByteString(br#"{"auths":{}}"#.to_vec())
        );
        let references = copy.metadata.owner_references.as_ref().unwrap();
        assert_eq!(
            references
                .iter()
                .map(|o| (o.kind.as_str(), o.name.as_str(), o.uid.as_str()))
                .collect::<Vec<_>>(),
            [
                ("DaemonSet", "u1-device-plugin", "u1"),
                ("DaemonSet", "u2-device-plugin", "u2")
            ]
        );
        assert!(
            references.iter().all(|o| o.controller.is_none()),
            "Kubernetes deletes it with the last owner"
        );
        assert!(ours(&copy, "kmm"));
        assert!(!ours(&copy, "other-proxy"));
        let legacy = copy_of(Content::DockerCfg(b"{}".to_vec()));
        assert_eq!(legacy.type_.as_deref(), Some("kubernetes.io/dockercfg"));
        assert!(legacy.data.as_ref().unwrap().contains_key(".dockercfg"));
    }

    fn copy_of(content: Content) -> Secret {
        copy("drivers", &credential(content), &owners(&["u1"]), "kmm")
    }

    #[test]
    fn the_copy_follows_the_clusters_secret_and_the_plugins() {
        let wanted = || copy("drivers", &json_credential("{1}"), &owners(&["u1"]), "kmm");
        assert_eq!(copy_action(None, None, "kmm"), CopyAction::Nothing);
        assert_eq!(
            copy_action(None, Some(wanted()), "kmm"),
            CopyAction::Create(Box::new(wanted()))
        );
        let existing = stored(wanted());
        assert_eq!(
            copy_action(Some(&existing), Some(wanted()), "kmm"),
            CopyAction::Nothing
        );
        // The cluster's Secret rotated, or another plugin's DaemonSet joined: replaced,
        // at the version read.
        for changed in [
            copy("drivers", &json_credential("{2}"), &owners(&["u1"]), "kmm"),
            copy(
                "drivers",
                &json_credential("{1}"),
                &owners(&["u1", "u2"]),
                "kmm",
            ),
        ] {
            let CopyAction::Update(update) =
                copy_action(Some(&existing), Some(changed.clone()), "kmm")
            else {
                panic!("an update")
            };
            assert_eq!(update.metadata.resource_version.as_deref(), Some("42"));
            assert_eq!(update.data, changed.data);
        }
        let legacy = copy_of(Content::DockerCfg(b"{}".to_vec()));
        assert_eq!(
            copy_action(Some(&existing), Some(legacy.clone()), "kmm"),
            CopyAction::Recreate(Box::new(legacy)),
            "a Secret's type cannot change"
        );
        // The cluster's Secret is gone or unusable: so is the copy.
        assert_eq!(
            copy_action(Some(&existing), None, "kmm"),
            CopyAction::Delete
        );
    }

    #[test]
    fn a_secret_of_that_name_the_proxy_did_not_make_is_never_touched() {
        let mut theirs = stored(copy_of(Content::DockerConfigJson(b"{}".to_vec())));
        theirs.metadata.labels = None;
        let wanted = copy_of(Content::DockerConfigJson(b"{1}".to_vec()));
        assert_eq!(
            copy_action(Some(&theirs), Some(wanted.clone()), "kmm"),
            CopyAction::Foreign
        );
        assert_eq!(copy_action(Some(&theirs), None, "kmm"), CopyAction::Foreign);
        let another_proxys = stored(copy("drivers", &json_credential("{}"), &[], "kmm-b"));
        assert_eq!(
            copy_action(Some(&another_proxys), Some(wanted), "kmm"),
            CopyAction::Foreign
        );
    }
}
