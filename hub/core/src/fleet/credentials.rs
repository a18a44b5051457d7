//! The pull credentials a cluster's snapshot carries: the `imageRepoSecret`s its modules
//! name, read from the hub's Secrets. Pure.

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::api::core::v1::Secret;
use kmm_api::ManagedClusterModule;
use kmm_proto::v1::{PullCredential, pull_credential::Content};
use kube::ResourceExt;

/// The credentials `modules` reference, by Secret name. A Secret that is missing or holds
/// no Docker config is left out: the proxy reports the image as unpullable.
pub fn referenced<'a>(
    modules: impl Iterator<Item = &'a ManagedClusterModule>,
    secrets: impl FnOnce() -> Vec<std::sync::Arc<Secret>>,
) -> BTreeMap<String, PullCredential> {
    let names: BTreeSet<String> = modules
        .filter_map(|m| m.spec.module_spec.image_repo_secret.as_ref())
        .map(|s| s.name.clone())
        .filter(|n| !n.is_empty())
        .collect();
    if names.is_empty() {
        return BTreeMap::new();
    }
    secrets()
        .iter()
        .filter(|s| names.contains(&s.name_any()))
        .filter_map(|s| pull_credential(s).map(|c| (s.name_any(), c)))
        .collect()
}

/// A pull Secret as the wire carries it: `.dockerconfigjson` first, else `.dockercfg`.
pub fn pull_credential(secret: &Secret) -> Option<PullCredential> {
    let data = secret.data.as_ref()?;
    let content = if let Some(json) = data.get(".dockerconfigjson") {
        Content::DockerConfigJson(json.0.clone())
    } else {
        Content::DockerCfg(data.get(".dockercfg")?.0.clone())
    };
    Some(PullCredential {
        id: secret.name_any(),
        content: Some(content),
    })
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use k8s_openapi::ByteString;

    use kmm_api::testing::ModuleBuilder;

    use super::*;

    fn secret(name: &str, key: &str) -> Arc<Secret> {
        let mut secret = Secret::default();
        secret.metadata.name = Some(name.to_owned());
        secret.data = Some(BTreeMap::from([(
            key.to_owned(),
            ByteString(b"{}".to_vec()),
        )]));
        Arc::new(secret)
    }

    fn module(secret: Option<&str>) -> ManagedClusterModule {
        let module = ModuleBuilder::new("m");
        match secret {
            Some(name) => module.with("/spec/moduleSpec/imageRepoSecret/name", name),
            None => module,
        }
        .build()
    }

    #[test]
    fn only_the_named_secrets_in_docker_config_shape_are_carried() {
        let modules = [module(Some("pull")), module(Some("old")), module(None)];
        let carried = referenced(modules.iter(), || {
            vec![
                secret("pull", ".dockerconfigjson"),
                secret("old", ".dockercfg"),
                secret("unnamed", ".dockerconfigjson"),
            ]
        });
        assert_eq!(carried.keys().collect::<Vec<_>>(), ["old", "pull"]);
        assert!(matches!(
            carried["pull"].content,
            Some(Content::DockerConfigJson(_))
        ));
        assert!(matches!(
            carried["old"].content,
            Some(Content::DockerCfg(_))
        ));
    }

    #[test]
    fn a_secret_without_docker_config_is_not_carried_and_none_is_read_when_unnamed() {
        let modules = [module(Some("pull"))];
        assert!(referenced(modules.iter(), || vec![secret("pull", "token")]).is_empty());
        let unnamed = [module(None)];
        assert!(referenced(unnamed.iter(), || panic!("no Secret is read")).is_empty());
    }
}
