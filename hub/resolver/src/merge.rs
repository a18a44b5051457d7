//! How a kernel mapping's settings combine with the container-level defaults, as upstream.

use kmm_api::{Build, BuildArg, KernelMapping, ModuleLoaderContainerSpec, Sign, TlsOptions};

/// The container's build with the mapping's laid over it: the mapping's Dockerfile wins,
/// build args merge by name (the mapping's win; new ones are appended sorted by name) and
/// build secrets are appended. Other settings come from the container, as upstream.
pub fn build(container: Option<&Build>, mapping: Option<&Build>) -> Option<Build> {
    match (container, mapping) {
        (None, None) => None,
        (Some(only), None) | (None, Some(only)) => Some(only.clone()),
        (Some(container), Some(mapping)) => {
            let mut merged = container.clone();
            merged.dockerfile_config_map = mapping.dockerfile_config_map.clone();
            let overrides = mapping.build_args.as_deref().unwrap_or_default();
            if !overrides.is_empty() {
                merged.build_args = Some(merge_build_args(
                    container.build_args.as_deref().unwrap_or_default(),
                    overrides,
                ));
            }
            if let Some(extra) = &mapping.secrets {
                merged
                    .secrets
                    .get_or_insert_with(Vec::new)
                    .extend(extra.iter().cloned());
            }
            Some(merged)
        }
    }
}

fn merge_build_args(base: &[BuildArg], overrides: &[BuildArg]) -> Vec<BuildArg> {
    let override_for = |name: &str| overrides.iter().rev().find(|o| o.name == name);
    let mut merged: Vec<BuildArg> = base
        .iter()
        .map(|arg| override_for(&arg.name).unwrap_or(arg).clone())
        .collect();
    let mut added: Vec<&BuildArg> = Vec::new();
    for candidate in overrides.iter().rev() {
        let known = base.iter().any(|b| b.name == candidate.name)
            || added.iter().any(|a| a.name == candidate.name);
        if !known {
            added.push(candidate);
        }
    }
    added.sort_by(|a, b| a.name.cmp(&b.name));
    merged.extend(added.into_iter().cloned());
    merged
}

/// The container's signing settings with the mapping's laid over them: the mapping's
/// unsigned image and key/cert secrets win, its files to sign are appended.
pub fn sign(container: Option<&Sign>, mapping: Option<&Sign>) -> Option<Sign> {
    match (container, mapping) {
        (None, None) => None,
        (Some(only), None) | (None, Some(only)) => Some(only.clone()),
        (Some(container), Some(mapping)) => {
            let mut merged = container.clone();
            if let Some(image) = mapping.unsigned_image.as_ref().filter(|i| !i.is_empty()) {
                merged.unsigned_image = Some(image.clone());
            }
            merged.key_secret = mapping.key_secret.clone();
            merged.cert_secret = mapping.cert_secret.clone();
            if let Some(files) = &mapping.files_to_sign {
                merged
                    .files_to_sign
                    .get_or_insert_with(Vec::new)
                    .extend(files.iter().cloned());
            }
            Some(merged)
        }
    }
}

/// The mapping's registry TLS settings when it has them, else the container's.
pub fn registry_tls(
    container: &ModuleLoaderContainerSpec,
    mapping: &KernelMapping,
) -> Option<TlsOptions> {
    mapping
        .registry_tls
        .clone()
        .or_else(|| container.registry_tls.clone())
}

/// The mapping's image when it has one, else the container's (still a template).
pub fn container_image<'a>(
    container: &'a ModuleLoaderContainerSpec,
    mapping: &'a KernelMapping,
) -> Option<&'a str> {
    non_empty(&mapping.container_image).or_else(|| non_empty(&container.container_image))
}

/// In-tree modules to remove: the mapping's list replaces the container's; the deprecated
/// single-module field, where set, wins as upstream.
pub fn in_tree_modules_to_remove(
    container: &ModuleLoaderContainerSpec,
    mapping: &KernelMapping,
) -> Vec<String> {
    let single = non_empty(&mapping.in_tree_module_to_remove)
        .or_else(|| non_empty(&container.in_tree_module_to_remove));
    if let Some(single) = single {
        return vec![single.to_owned()];
    }
    mapping
        .in_tree_modules_to_remove
        .clone()
        .or_else(|| container.in_tree_modules_to_remove.clone())
        .unwrap_or_default()
}

pub(crate) fn non_empty(value: &Option<String>) -> Option<&str> {
    value.as_deref().filter(|v| !v.is_empty())
}

#[cfg(test)]
mod tests {
    use k8s_openapi::api::core::v1::LocalObjectReference;

    use super::*;

    fn reference(name: &str) -> LocalObjectReference {
        LocalObjectReference { name: name.into() }
    }

    fn arg(name: &str, value: &str) -> BuildArg {
        BuildArg {
            name: name.into(),
            value: value.into(),
        }
    }

    fn build_with(dockerfile: &str, args: &[BuildArg], secrets: &[&str]) -> Build {
        Build {
            dockerfile_config_map: reference(dockerfile),
            build_args: Some(args.to_vec()),
            secrets: Some(secrets.iter().map(|s| reference(s)).collect()),
            ..Build::default()
        }
    }

    #[test]
    fn build_merges_like_upstream() {
        let container = build_with("base", &[arg("A", "1"), arg("B", "2")], &["s1"]);
        let mapping = build_with(
            "special",
            &[arg("Z", "26"), arg("B", "two"), arg("C", "3")],
            &["s2"],
        );
        let merged = build(Some(&container), Some(&mapping)).unwrap();
        assert_eq!(merged.dockerfile_config_map.name, "special");
        assert_eq!(
            merged.build_args.unwrap(),
            vec![
                arg("A", "1"),
                arg("B", "two"),
                arg("C", "3"),
                arg("Z", "26")
            ]
        );
        let secrets: Vec<_> = merged
            .secrets
            .unwrap()
            .into_iter()
            .map(|s| s.name)
            .collect();
        assert_eq!(secrets, ["s1", "s2"]);
    }

    #[test]
    fn build_from_one_side_is_kept_whole() {
        let only = build_with("df", &[arg("A", "1")], &[]);
        assert_eq!(build(None, Some(&only)), Some(only.clone()));
        assert_eq!(build(Some(&only), None), Some(only));
        assert_eq!(build(None, None), None);
    }

    #[test]
    fn sign_merges_like_upstream() {
        let container = Sign {
            unsigned_image: Some("c/img:1".into()),
            key_secret: reference("key"),
            cert_secret: reference("cert"),
            files_to_sign: Some(vec!["/opt/a.ko".into()]),
            ..Sign::default()
        };
        let mapping = Sign {
            unsigned_image: None,
            key_secret: reference("key2"),
            cert_secret: reference("cert2"),
            files_to_sign: Some(vec!["/opt/b.ko".into()]),
            ..Sign::default()
        };
        let merged = sign(Some(&container), Some(&mapping)).unwrap();
        assert_eq!(merged.unsigned_image.as_deref(), Some("c/img:1"));
        assert_eq!(merged.key_secret.name, "key2");
        assert_eq!(merged.cert_secret.name, "cert2");
        assert_eq!(merged.files_to_sign.unwrap(), ["/opt/a.ko", "/opt/b.ko"]);
    }

    #[test]
    fn mapping_fields_win_when_set() {
        let container = ModuleLoaderContainerSpec {
            container_image: Some("c:1".into()),
            registry_tls: Some(TlsOptions {
                insecure: Some(true),
                ..TlsOptions::default()
            }),
            in_tree_modules_to_remove: Some(vec!["a".into()]),
            ..ModuleLoaderContainerSpec::default()
        };
        let empty = KernelMapping {
            container_image: Some(String::new()),
            ..KernelMapping::default()
        };
        assert_eq!(container_image(&container, &empty), Some("c:1"));
        assert_eq!(registry_tls(&container, &empty), container.registry_tls);
        assert_eq!(in_tree_modules_to_remove(&container, &empty), ["a"]);

        let full = KernelMapping {
            container_image: Some("m:1".into()),
            registry_tls: Some(TlsOptions::default()),
            in_tree_modules_to_remove: Some(vec![]),
            ..KernelMapping::default()
        };
        assert_eq!(container_image(&container, &full), Some("m:1"));
        assert_eq!(registry_tls(&container, &full), Some(TlsOptions::default()));
        assert!(in_tree_modules_to_remove(&container, &full).is_empty());
    }

    #[test]
    fn deprecated_single_in_tree_module_wins() {
        let container = ModuleLoaderContainerSpec {
            in_tree_module_to_remove: Some("old".into()),
            ..ModuleLoaderContainerSpec::default()
        };
        let mapping = KernelMapping {
            in_tree_module_to_remove: Some("older".into()),
            ..KernelMapping::default()
        };
        assert_eq!(in_tree_modules_to_remove(&container, &mapping), ["older"]);
        assert_eq!(
            in_tree_modules_to_remove(&container, &KernelMapping::default()),
            ["old"]
        );
    }
}
