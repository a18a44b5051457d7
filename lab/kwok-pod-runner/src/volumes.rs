//! Which host directories and files stand for a Pod's volumes, and where each
//! container's mounts point (planning), and the files a ConfigMap, Downward API or
//! token volume holds at a given moment (rendering). Pure: the supervisor creates and
//! writes what these describe.
//!
//! Supported: `emptyDir`; `hostPath` (below the node's own host directory, created for
//! `DirectoryOrCreate`, `FileOrCreate` and the unchecked empty type, else required to
//! exist); `configMap`; `downwardAPI` (`fieldRef` items); `projected` with any of
//! those and `serviceAccountToken`. Secret volumes and Secret projections are left out
//! (and their mounts dropped): a Secret must never be persisted outside the API. Any
//! other volume type, a `subPath` mount or a `resourceFieldRef` item refuses the pod.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Component, Path, PathBuf};

use k8s_openapi::api::core::v1::{
    ConfigMap, DownwardAPIVolumeFile, KeyToPath, Pod, Volume as PodVolume, VolumeProjection,
};

use super::fields::field_value;
use super::paths::Mount;
use super::tokens::TokenSource;

/// Where a pod's files go on the host.
#[derive(Debug, Clone)]
pub(super) struct Layout {
    /// `<root>/<node>/pods/<uid>`: emptyDirs, tokens, ConfigMaps, Downward API files.
    pub pod_dir: PathBuf,
    /// `<root>/<node>/host`: the simulated node's own `/`, for hostPath volumes.
    pub host_root: PathBuf,
}

impl Layout {
    fn volume_dir(&self, volume: &str) -> PathBuf {
        self.pod_dir.join("volumes").join(volume)
    }
}

/// A pod's volumes as host paths.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct Plan {
    pub volumes: Vec<Volume>,
    /// Secret volumes and projections left out, for the pod's log line.
    pub secrets: Vec<String>,
    /// Each container's mounts, in `spec.containers` order.
    pub mounts: Vec<Vec<Mount>>,
}

#[derive(Debug, Clone, PartialEq)]
pub(super) struct Volume {
    pub name: String,
    /// The directory (or, for a file hostPath, the file) that stands for it.
    pub host: PathBuf,
    pub kind: Kind,
}

#[derive(Debug, Clone, PartialEq)]
pub(super) enum Kind {
    /// `emptyDir`: created empty with the pod, removed with it.
    EmptyDir,
    HostPath(HostPath),
    /// Files written by the runner and kept current.
    Files(Vec<Source>),
}

/// What the runner does with a hostPath before the pod starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum HostPath {
    CreateDirectory,
    CreateFile,
    /// `Directory`, `File`, `Socket`, `CharDevice`, `BlockDevice`: the pod waits for it.
    MustExist,
}

/// One source of a files volume.
#[derive(Debug, Clone, PartialEq)]
pub(super) enum Source {
    ConfigMap {
        name: String,
        optional: bool,
        /// `(key, path)`; every key of `data` and `binaryData` when absent.
        items: Option<Vec<(String, String)>>,
    },
    /// A Downward API item: the file `path` holds the pod's `field`.
    Field {
        path: String,
        field: String,
    },
    Token(TokenSource),
}

/// The host paths for `pod`'s volumes, or why the runner cannot run it.
pub(super) fn plan(pod: &Pod, layout: &Layout) -> Result<Plan, String> {
    let spec = pod.spec.as_ref().ok_or("the pod has no spec")?;
    let mut volumes = vec![];
    let mut secrets = vec![];
    for volume in spec.volumes.iter().flatten() {
        let name = &volume.name;
        if let Some(secret) = &volume.secret {
            secrets.push(format!(
                "volume {name} (Secret {})",
                secret.secret_name.as_deref().unwrap_or_default()
            ));
            continue;
        }
        let (host, kind) = volume_kind(pod, volume, layout, &mut secrets)?;
        volumes.push(Volume {
            name: name.clone(),
            host,
            kind,
        });
    }
    let mut mounts = vec![];
    for container in &spec.containers {
        let mut own = vec![];
        for mount in container.volume_mounts.iter().flatten() {
            let context = || format!("container {} mount {}", container.name, mount.mount_path);
            if [&mount.sub_path, &mount.sub_path_expr]
                .iter()
                .any(|s| s.as_deref().is_some_and(|s| !s.is_empty()))
            {
                return Err(format!("{}: subPath is not supported", context()));
            }
            let Some(volume) = volumes.iter().find(|v| v.name == mount.name) else {
                let is_secret = spec
                    .volumes
                    .iter()
                    .flatten()
                    .any(|v| v.name == mount.name && v.secret.is_some());
                if is_secret {
                    continue;
                }
                return Err(format!("{}: no volume {}", context(), mount.name));
            };
            let container_path = mount.mount_path.trim_end_matches('/');
            if !container_path.starts_with('/') {
                return Err(format!(
                    "{}: the mount path must be absolute, not /",
                    context()
                ));
            }
            own.push(Mount {
                container: container_path.to_owned(),
                host: volume.host.clone(),
            });
        }
        mounts.push(own);
    }
    Ok(Plan {
        volumes,
        secrets,
        mounts,
    })
}

fn volume_kind(
    pod: &Pod,
    volume: &PodVolume,
    layout: &Layout,
    secrets: &mut Vec<String>,
) -> Result<(PathBuf, Kind), String> {
    let name = &volume.name;
    let dir = layout.volume_dir(name);
    if let Some(host_path) = &volume.host_path {
        let relative = relative_path(host_path.path.trim_start_matches('/'))
            .filter(|p| !p.as_os_str().is_empty())
            .ok_or_else(|| {
                format!(
                    "volume {name}: hostPath {:?} is not a plain path",
                    host_path.path
                )
            })?;
        let check = match host_path.type_.as_deref().unwrap_or_default() {
            "" | "DirectoryOrCreate" => HostPath::CreateDirectory,
            "FileOrCreate" => HostPath::CreateFile,
            "Directory" | "File" | "Socket" | "CharDevice" | "BlockDevice" => HostPath::MustExist,
            other => return Err(format!("volume {name}: unknown hostPath type {other}")),
        };
        return Ok((layout.host_root.join(relative), Kind::HostPath(check)));
    }
    if volume.empty_dir.is_some() {
        return Ok((dir, Kind::EmptyDir));
    }
    let mut sources = vec![];
    if let Some(config_map) = &volume.config_map {
        sources.push(config_map_source(
            name,
            &config_map.name,
            config_map.optional,
            config_map.items.as_deref(),
        )?);
    } else if let Some(downward) = &volume.downward_api {
        sources.extend(field_sources(pod, name, downward.items.as_deref())?);
    } else if let Some(projected) = &volume.projected {
        for projection in projected.sources.iter().flatten() {
            projection_sources(pod, name, projection, &mut sources, secrets)?;
        }
    } else {
        return Err(format!(
            "volume {name}: only emptyDir, hostPath, configMap, downwardAPI, projected and (skipped) secret volumes are supported"
        ));
    }
    Ok((dir, Kind::Files(sources)))
}

fn projection_sources(
    pod: &Pod,
    volume: &str,
    projection: &VolumeProjection,
    sources: &mut Vec<Source>,
    secrets: &mut Vec<String>,
) -> Result<(), String> {
    if let Some(secret) = &projection.secret {
        secrets.push(format!(
            "volume {volume} (projected Secret {})",
            secret.name
        ));
    } else if let Some(token) = &projection.service_account_token {
        sources.push(Source::Token(TokenSource {
            audience: token.audience.clone().filter(|a| !a.is_empty()),
            expiration_seconds: token
                .expiration_seconds
                .unwrap_or(TokenSource::DEFAULT_EXPIRATION_SECONDS),
            path: item_path(volume, &token.path)?,
        }));
    } else if let Some(config_map) = &projection.config_map {
        sources.push(config_map_source(
            volume,
            &config_map.name,
            config_map.optional,
            config_map.items.as_deref(),
        )?);
    } else if let Some(downward) = &projection.downward_api {
        sources.extend(field_sources(pod, volume, downward.items.as_deref())?);
    } else {
        return Err(format!(
            "volume {volume}: only serviceAccountToken, configMap, downwardAPI and (skipped) secret projections are supported"
        ));
    }
    Ok(())
}

fn config_map_source(
    volume: &str,
    name: &str,
    optional: Option<bool>,
    items: Option<&[KeyToPath]>,
) -> Result<Source, String> {
    let items = items
        .map(|items| {
            items
                .iter()
                .map(|i| Ok((i.key.clone(), item_path(volume, &i.path)?)))
                .collect::<Result<Vec<_>, String>>()
        })
        .transpose()?;
    Ok(Source::ConfigMap {
        name: name.to_owned(),
        optional: optional.unwrap_or(false),
        items,
    })
}

fn field_sources(
    pod: &Pod,
    volume: &str,
    items: Option<&[DownwardAPIVolumeFile]>,
) -> Result<Vec<Source>, String> {
    items
        .into_iter()
        .flatten()
        .map(|item| {
            let path = item_path(volume, &item.path)?;
            let field = item
                .field_ref
                .as_ref()
                .ok_or_else(|| format!("volume {volume} item {path}: only fieldRef is supported"))?
                .field_path
                .clone();
            // Checked now, so that rendering cannot fail on it later.
            field_value(pod, &field).map_err(|e| format!("volume {volume} item {path}: {e}"))?;
            Ok(Source::Field { path, field })
        })
        .collect()
}

/// A file's path inside its volume: relative, without `..`.
fn item_path(volume: &str, path: &str) -> Result<String, String> {
    relative_path(path)
        .filter(|p| !p.as_os_str().is_empty())
        .map(|p| p.to_string_lossy().into_owned())
        .ok_or_else(|| format!("volume {volume}: item path {path:?} is not a relative path"))
}

/// `path` normalised, if it stays below where it is joined (no root, no `..`).
fn relative_path(path: &str) -> Option<PathBuf> {
    let mut out = PathBuf::new();
    for component in Path::new(path).components() {
        match component {
            Component::Normal(part) => out.push(part),
            Component::CurDir => {}
            Component::RootDir | Component::ParentDir | Component::Prefix(_) => return None,
        }
    }
    Some(out)
}

/// The files of a files volume now, by path inside the volume; or why the pod cannot
/// start yet (a ConfigMap or key it needs is missing, a token is not issued yet).
pub(super) fn render(
    sources: &[Source],
    pod: &Pod,
    config_map: impl Fn(&str) -> Option<std::sync::Arc<ConfigMap>>,
    token: impl Fn(&TokenSource) -> Option<String>,
) -> Result<BTreeMap<String, Vec<u8>>, String> {
    let mut files = BTreeMap::new();
    for source in sources {
        match source {
            Source::Field { path, field } => {
                files.insert(path.clone(), field_value(pod, field)?.into_bytes());
            }
            Source::Token(source) => {
                let value = token(source).ok_or_else(|| {
                    format!(
                        "no token yet for audience {}",
                        source.audience.as_deref().unwrap_or("(the apiserver's)")
                    )
                })?;
                files.insert(source.path.clone(), value.into_bytes());
            }
            Source::ConfigMap {
                name,
                optional,
                items,
            } => {
                let Some(map) = config_map(name) else {
                    if *optional {
                        continue;
                    }
                    return Err(format!("ConfigMap {name} does not exist"));
                };
                let value = |key: &str| -> Option<Vec<u8>> {
                    map.data
                        .as_ref()
                        .and_then(|d| d.get(key))
                        .map(|v| v.clone().into_bytes())
                        .or_else(|| {
                            map.binary_data
                                .as_ref()
                                .and_then(|d| d.get(key))
                                .map(|v| v.0.clone())
                        })
                };
                match items {
                    None => {
                        let keys: BTreeSet<&String> = map
                            .data
                            .iter()
                            .flatten()
                            .map(|(k, _)| k)
                            .chain(map.binary_data.iter().flatten().map(|(k, _)| k))
                            .collect();
                        for key in keys {
                            files.extend(value(key).map(|v| (key.clone(), v)));
                        }
                    }
                    Some(items) => {
                        for (key, path) in items {
                            match value(key) {
                                Some(v) => {
                                    files.insert(path.clone(), v);
                                }
                                None if *optional => {}
                                None => return Err(format!("ConfigMap {name} has no key {key}")),
                            }
                        }
                    }
                }
            }
        }
    }
    Ok(files)
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use k8s_openapi::ByteString;
    use k8s_openapi::api::core::v1::{
        ConfigMapProjection, ConfigMapVolumeSource, Container, DownwardAPIProjection,
        DownwardAPIVolumeSource, EmptyDirVolumeSource, HostPathVolumeSource, NFSVolumeSource,
        ObjectFieldSelector, ProjectedVolumeSource, ResourceFieldSelector, SecretProjection,
        SecretVolumeSource, ServiceAccountTokenProjection, VolumeMount,
    };
    use kube::api::ObjectMeta;

    use super::super::fields::tests::agent_pod;
    use super::*;

    fn layout() -> Layout {
        Layout {
            pod_dir: "/r/n1/pods/u1".into(),
            host_root: "/r/n1/host".into(),
        }
    }

    fn mount(name: &str, path: &str) -> VolumeMount {
        VolumeMount {
            name: name.into(),
            mount_path: path.into(),
            ..Default::default()
        }
    }

    fn field(path: &str, field_path: &str) -> DownwardAPIVolumeFile {
        DownwardAPIVolumeFile {
            path: path.into(),
            field_ref: Some(ObjectFieldSelector {
                field_path: field_path.into(),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    fn key(key: &str, path: &str) -> KeyToPath {
        KeyToPath {
            key: key.into(),
            path: path.into(),
            ..Default::default()
        }
    }

    /// The agent pod with the volumes its DaemonSet would have: the injected
    /// ServiceAccount volume, a bound token, the proxy's CA, node state on the host, a
    /// cache, a Secret.
    fn pod_with(volumes: Vec<PodVolume>, mounts: Vec<VolumeMount>) -> Pod {
        let mut pod = agent_pod();
        let spec = pod.spec.as_mut().unwrap();
        spec.volumes = Some(volumes);
        spec.containers = vec![Container {
            name: "agent".into(),
            volume_mounts: Some(mounts),
            ..Default::default()
        }];
        pod
    }

    fn volume(name: &str) -> PodVolume {
        PodVolume {
            name: name.into(),
            ..Default::default()
        }
    }

    fn agent_volumes() -> Pod {
        let api_access = PodVolume {
            projected: Some(ProjectedVolumeSource {
                sources: Some(vec![
                    VolumeProjection {
                        service_account_token: Some(ServiceAccountTokenProjection {
                            expiration_seconds: Some(3607),
                            path: "token".into(),
                            ..Default::default()
                        }),
                        ..Default::default()
                    },
                    VolumeProjection {
                        config_map: Some(ConfigMapProjection {
                            name: "kube-root-ca.crt".into(),
                            items: Some(vec![key("ca.crt", "ca.crt")]),
                            ..Default::default()
                        }),
                        ..Default::default()
                    },
                    VolumeProjection {
                        downward_api: Some(DownwardAPIProjection {
                            items: Some(vec![field("namespace", "metadata.namespace")]),
                        }),
                        ..Default::default()
                    },
                ]),
                ..Default::default()
            }),
            ..volume("kube-api-access")
        };
        let token = PodVolume {
            projected: Some(ProjectedVolumeSource {
                sources: Some(vec![
                    VolumeProjection {
                        service_account_token: Some(ServiceAccountTokenProjection {
                            audience: Some("kmm-spoke-proxy".into()),
                            path: "token".into(),
                            ..Default::default()
                        }),
                        ..Default::default()
                    },
                    VolumeProjection {
                        secret: Some(SecretProjection {
                            name: "extra".into(),
                            ..Default::default()
                        }),
                        ..Default::default()
                    },
                ]),
                ..Default::default()
            }),
            ..volume("proxy-token")
        };
        let ca = PodVolume {
            config_map: Some(ConfigMapVolumeSource {
                name: "kmm-agent-ca".into(),
                ..Default::default()
            }),
            ..volume("proxy-ca")
        };
        let state = PodVolume {
            host_path: Some(HostPathVolumeSource {
                path: "/var/lib/kmm/".into(),
                type_: Some("DirectoryOrCreate".into()),
            }),
            ..volume("state")
        };
        let cache = PodVolume {
            empty_dir: Some(EmptyDirVolumeSource::default()),
            ..volume("cache")
        };
        let pull = PodVolume {
            secret: Some(SecretVolumeSource {
                secret_name: Some("pull".into()),
                ..Default::default()
            }),
            ..volume("pull-secret")
        };
        let info = PodVolume {
            downward_api: Some(DownwardAPIVolumeSource {
                items: Some(vec![
                    field("labels", "metadata.labels"),
                    field("ip/pod", "status.podIP"),
                ]),
                ..Default::default()
            }),
            ..volume("podinfo")
        };
        pod_with(
            vec![api_access, token, ca, state, cache, pull, info],
            vec![
                mount(
                    "kube-api-access",
                    "/var/run/secrets/kubernetes.io/serviceaccount",
                ),
                mount("proxy-token", "/var/run/secrets/kmm/"),
                mount("proxy-ca", "/etc/kmm/ca"),
                mount("state", "/var/lib/kmm"),
                mount("cache", "/var/cache/kmm"),
                mount("pull-secret", "/etc/kmm/pull"),
                mount("podinfo", "/etc/podinfo"),
            ],
        )
    }

    #[test]
    fn the_agents_volumes_become_host_paths() {
        let plan = plan(&agent_volumes(), &layout()).unwrap();
        let hosts: Vec<(&str, &Path)> = plan
            .volumes
            .iter()
            .map(|v| (v.name.as_str(), v.host.as_path()))
            .collect();
        assert_eq!(
            hosts,
            [
                (
                    "kube-api-access",
                    Path::new("/r/n1/pods/u1/volumes/kube-api-access")
                ),
                (
                    "proxy-token",
                    Path::new("/r/n1/pods/u1/volumes/proxy-token")
                ),
                ("proxy-ca", Path::new("/r/n1/pods/u1/volumes/proxy-ca")),
                ("state", Path::new("/r/n1/host/var/lib/kmm")),
                ("cache", Path::new("/r/n1/pods/u1/volumes/cache")),
                ("podinfo", Path::new("/r/n1/pods/u1/volumes/podinfo")),
            ]
        );
        assert_eq!(
            plan.secrets,
            [
                "volume proxy-token (projected Secret extra)",
                "volume pull-secret (Secret pull)"
            ]
        );
        let mounts: Vec<(&str, &Path)> = plan.mounts[0]
            .iter()
            .map(|m| (m.container.as_str(), m.host.as_path()))
            .collect();
        assert_eq!(
            mounts,
            [
                (
                    "/var/run/secrets/kubernetes.io/serviceaccount",
                    Path::new("/r/n1/pods/u1/volumes/kube-api-access")
                ),
                (
                    "/var/run/secrets/kmm",
                    Path::new("/r/n1/pods/u1/volumes/proxy-token")
                ),
                ("/etc/kmm/ca", Path::new("/r/n1/pods/u1/volumes/proxy-ca")),
                ("/var/lib/kmm", Path::new("/r/n1/host/var/lib/kmm")),
                ("/var/cache/kmm", Path::new("/r/n1/pods/u1/volumes/cache")),
                ("/etc/podinfo", Path::new("/r/n1/pods/u1/volumes/podinfo")),
            ]
        );
    }

    #[test]
    fn each_kind_with_its_sources() {
        let plan = plan(&agent_volumes(), &layout()).unwrap();
        let kind = |name: &str| &plan.volumes.iter().find(|v| v.name == name).unwrap().kind;
        assert_eq!(
            kind("kube-api-access"),
            &Kind::Files(vec![
                Source::Token(TokenSource {
                    audience: None,
                    expiration_seconds: 3607,
                    path: "token".into()
                }),
                Source::ConfigMap {
                    name: "kube-root-ca.crt".into(),
                    optional: false,
                    items: Some(vec![("ca.crt".into(), "ca.crt".into())]),
                },
                Source::Field {
                    path: "namespace".into(),
                    field: "metadata.namespace".into()
                },
            ])
        );
        assert_eq!(
            kind("proxy-token"),
            &Kind::Files(vec![Source::Token(TokenSource {
                audience: Some("kmm-spoke-proxy".into()),
                expiration_seconds: 3600,
                path: "token".into()
            })])
        );
        assert_eq!(
            kind("proxy-ca"),
            &Kind::Files(vec![Source::ConfigMap {
                name: "kmm-agent-ca".into(),
                optional: false,
                items: None
            }])
        );
        assert_eq!(kind("state"), &Kind::HostPath(HostPath::CreateDirectory));
        assert_eq!(kind("cache"), &Kind::EmptyDir);
    }

    #[test]
    fn host_path_types() {
        for (type_, expected) in [
            (None, HostPath::CreateDirectory),
            (Some(""), HostPath::CreateDirectory),
            (Some("DirectoryOrCreate"), HostPath::CreateDirectory),
            (Some("FileOrCreate"), HostPath::CreateFile),
            (Some("Directory"), HostPath::MustExist),
            (Some("File"), HostPath::MustExist),
            (Some("Socket"), HostPath::MustExist),
            (Some("CharDevice"), HostPath::MustExist),
            (Some("BlockDevice"), HostPath::MustExist),
        ] {
            let pod = pod_with(
                vec![PodVolume {
                    host_path: Some(HostPathVolumeSource {
                        path: "/run//kmm/./x".into(),
                        type_: type_.map(Into::into),
                    }),
                    ..volume("h")
                }],
                vec![],
            );
            let plan = plan(&pod, &layout()).unwrap();
            assert_eq!(plan.volumes[0].kind, Kind::HostPath(expected), "{type_:?}");
            assert_eq!(plan.volumes[0].host, Path::new("/r/n1/host/run/kmm/x"));
        }
    }

    #[test]
    fn host_paths_stay_below_the_nodes_host_directory() {
        for path in ["/", "", "/var/../../etc", "../x"] {
            let pod = pod_with(
                vec![PodVolume {
                    host_path: Some(HostPathVolumeSource {
                        path: path.into(),
                        type_: None,
                    }),
                    ..volume("h")
                }],
                vec![],
            );
            assert!(plan(&pod, &layout()).is_err(), "{path:?}");
        }
        let odd_type = pod_with(
            vec![PodVolume {
                host_path: Some(HostPathVolumeSource {
                    path: "/x".into(),
                    type_: Some("Fifo".into()),
                }),
                ..volume("h")
            }],
            vec![],
        );
        assert!(plan(&odd_type, &layout()).is_err());
    }

    #[test]
    fn secret_mounts_are_dropped_and_other_gaps_refuse_the_pod() {
        let secret = PodVolume {
            secret: Some(SecretVolumeSource::default()),
            ..volume("s")
        };
        let cache = PodVolume {
            empty_dir: Some(EmptyDirVolumeSource::default()),
            ..volume("cache")
        };
        let only_secret = pod_with(vec![secret.clone()], vec![mount("s", "/etc/s")]);
        let plan_ = plan(&only_secret, &layout()).unwrap();
        assert!(plan_.volumes.is_empty());
        assert_eq!(plan_.mounts, [vec![]]);
        assert_eq!(plan_.secrets, ["volume s (Secret )"]);

        let refusals = [
            pod_with(vec![cache.clone()], vec![mount("missing", "/x")]),
            pod_with(
                vec![cache.clone()],
                vec![VolumeMount {
                    sub_path: Some("a".into()),
                    ..mount("cache", "/x")
                }],
            ),
            pod_with(
                vec![cache.clone()],
                vec![VolumeMount {
                    sub_path_expr: Some("$(POD)".into()),
                    ..mount("cache", "/x")
                }],
            ),
            pod_with(vec![cache.clone()], vec![mount("cache", "/")]),
            pod_with(vec![cache.clone()], vec![mount("cache", "relative")]),
            pod_with(
                vec![PodVolume {
                    nfs: Some(NFSVolumeSource::default()),
                    ..volume("nfs")
                }],
                vec![],
            ),
            pod_with(vec![volume("nothing")], vec![]),
            pod_with(
                vec![PodVolume {
                    projected: Some(ProjectedVolumeSource {
                        sources: Some(vec![VolumeProjection::default()]),
                        ..Default::default()
                    }),
                    ..volume("p")
                }],
                vec![],
            ),
            pod_with(
                vec![PodVolume {
                    downward_api: Some(DownwardAPIVolumeSource {
                        items: Some(vec![DownwardAPIVolumeFile {
                            path: "cpu".into(),
                            resource_field_ref: Some(ResourceFieldSelector {
                                resource: "limits.cpu".into(),
                                ..Default::default()
                            }),
                            ..Default::default()
                        }]),
                        ..Default::default()
                    }),
                    ..volume("d")
                }],
                vec![],
            ),
            pod_with(
                vec![PodVolume {
                    downward_api: Some(DownwardAPIVolumeSource {
                        items: Some(vec![field("phase", "status.phase")]),
                        ..Default::default()
                    }),
                    ..volume("d")
                }],
                vec![],
            ),
        ];
        for pod in refusals {
            assert!(plan(&pod, &layout()).is_err(), "{:?}", pod.spec);
        }
        // Secret volumes are dropped silently from the mounts, not refused.
        let mixed = pod_with(
            vec![secret, cache],
            vec![mount("s", "/etc/s"), mount("cache", "/c")],
        );
        assert_eq!(plan(&mixed, &layout()).unwrap().mounts[0].len(), 1);
    }

    #[test]
    fn item_paths_stay_inside_their_volume() {
        for (path, ok) in [
            ("a", true),
            ("a/b", true),
            ("./a", true),
            ("", false),
            (".", false),
            ("/abs", false),
            ("../up", false),
            ("a/../../up", false),
        ] {
            let pod = pod_with(
                vec![PodVolume {
                    config_map: Some(ConfigMapVolumeSource {
                        name: "c".into(),
                        items: Some(vec![key("k", path)]),
                        ..Default::default()
                    }),
                    ..volume("c")
                }],
                vec![],
            );
            assert_eq!(plan(&pod, &layout()).is_ok(), ok, "{path:?}");
        }
    }

    #[test]
    fn every_container_gets_its_own_mounts() {
        let mut pod = agent_volumes();
        let spec = pod.spec.as_mut().unwrap();
        spec.containers.push(Container {
            name: "sidecar".into(),
            volume_mounts: Some(vec![mount("cache", "/cache")]),
            ..Default::default()
        });
        spec.containers.push(Container {
            name: "bare".into(),
            ..Default::default()
        });
        let plan = plan(&pod, &layout()).unwrap();
        assert_eq!(plan.mounts.len(), 3);
        assert_eq!(
            plan.mounts[1],
            [Mount {
                container: "/cache".into(),
                host: "/r/n1/pods/u1/volumes/cache".into()
            }]
        );
        assert!(plan.mounts[2].is_empty());
    }

    fn config_maps() -> BTreeMap<&'static str, Arc<ConfigMap>> {
        let ca = ConfigMap {
            metadata: ObjectMeta {
                name: Some("kmm-agent-ca".into()),
                ..Default::default()
            },
            data: Some(BTreeMap::from([("ca.crt".into(), "PEM".into())])),
            binary_data: Some(BTreeMap::from([("raw.bin".into(), ByteString(vec![0, 1]))])),
            ..Default::default()
        };
        let root = ConfigMap {
            data: Some(BTreeMap::from([("ca.crt".into(), "ROOT".into())])),
            ..Default::default()
        };
        BTreeMap::from([
            ("kmm-agent-ca", Arc::new(ca)),
            ("kube-root-ca.crt", Arc::new(root)),
        ])
    }

    fn render_volume(
        pod: &Pod,
        name: &str,
        maps: &BTreeMap<&'static str, Arc<ConfigMap>>,
        tokens: bool,
    ) -> Result<BTreeMap<String, Vec<u8>>, String> {
        let plan = plan(pod, &layout()).unwrap();
        let Kind::Files(sources) = &plan.volumes.iter().find(|v| v.name == name).unwrap().kind
        else {
            panic!("{name} is not a files volume");
        };
        render(
            sources,
            pod,
            |n| maps.get(n).cloned(),
            |s| tokens.then(|| format!("jwt-for-{}", s.audience.as_deref().unwrap_or("api"))),
        )
    }

    fn files(pairs: &[(&str, &[u8])]) -> BTreeMap<String, Vec<u8>> {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), v.to_vec()))
            .collect()
    }

    #[test]
    fn files_of_tokens_config_maps_and_fields() {
        let pod = agent_volumes();
        let maps = config_maps();
        assert_eq!(
            render_volume(&pod, "kube-api-access", &maps, true).unwrap(),
            files(&[
                ("ca.crt", b"ROOT"),
                ("namespace", b"kmm"),
                ("token", b"jwt-for-api")
            ])
        );
        assert_eq!(
            render_volume(&pod, "proxy-token", &maps, true).unwrap(),
            files(&[("token", b"jwt-for-kmm-spoke-proxy")])
        );
        assert_eq!(
            render_volume(&pod, "proxy-ca", &maps, true).unwrap(),
            files(&[("ca.crt", b"PEM"), ("raw.bin", &[0, 1])])
        );
        assert_eq!(
            render_volume(&pod, "podinfo", &maps, true).unwrap(),
            files(&[
                ("ip/pod", b"10.101.0.7"),
                (
                    "labels",
                    b"app.kubernetes.io/name=\"kmm-node-agent\"\npod-template-generation=\"1\""
                ),
            ])
        );
    }

    #[test]
    fn missing_inputs_hold_the_pod_back_unless_optional() {
        let pod = agent_volumes();
        let maps = config_maps();
        assert!(render_volume(&pod, "proxy-token", &maps, false).is_err());
        assert!(render_volume(&pod, "proxy-ca", &BTreeMap::new(), true).is_err());

        let optional = |items: Option<Vec<KeyToPath>>, optional: bool| {
            pod_with(
                vec![PodVolume {
                    config_map: Some(ConfigMapVolumeSource {
                        name: "kmm-agent-ca".into(),
                        items,
                        optional: Some(optional),
                        ..Default::default()
                    }),
                    ..volume("c")
                }],
                vec![],
            )
        };
        // A missing optional ConfigMap leaves the volume empty.
        assert_eq!(
            render_volume(&optional(None, true), "c", &BTreeMap::new(), true).unwrap(),
            files(&[])
        );
        // Listed keys: a missing one holds the pod unless optional.
        let items = Some(vec![key("ca.crt", "tls/ca.pem"), key("absent", "absent")]);
        assert!(render_volume(&optional(items.clone(), false), "c", &maps, true).is_err());
        assert_eq!(
            render_volume(&optional(items, true), "c", &maps, true).unwrap(),
            files(&[("tls/ca.pem", b"PEM")])
        );
        let binary = Some(vec![key("raw.bin", "raw")]);
        assert_eq!(
            render_volume(&optional(binary, false), "c", &maps, true).unwrap(),
            files(&[("raw", &[0, 1])])
        );
    }
}
