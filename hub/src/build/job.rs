//! The Kubernetes objects of one build. Pure.
//!
//! A build is a Job in the builds namespace (`<hub namespace>-builds`, see
//! [`builds_namespace`]) running the builder image (buildah, `hub/builder/`), plus the
//! inputs it mounts, copied there by the hub because a Pod can mount only its own
//! namespace's ConfigMaps and Secrets:
//!
//! * a ConfigMap with the Dockerfile (key `dockerfile`, mounted as
//!   `/workspace/Dockerfile`; `/workspace` is the build context, as upstream KMM's);
//! * one Secret per build Secret, mounted at `/run/secrets/<name>` in the builder and
//!   bound read-only at the same path into every `RUN` step (not into the image);
//! * the push Secret's `.dockerconfigjson`, mounted as buildah's auth file for the
//!   pulls of base images and the push.
//!
//! The copies are owned by the Job, so they go when it goes. The Job itself is owned by
//! the ManagedClusterModule: deleting the module deletes its builds.

use std::collections::BTreeMap;

use k8s_openapi::ByteString;
use k8s_openapi::api::batch::v1::{Job, JobSpec};
use k8s_openapi::api::core::v1::{
    Capabilities, ConfigMap, ConfigMapVolumeSource, Container, EmptyDirVolumeSource, EnvVar,
    KeyToPath, PodSecurityContext, PodSpec, PodTemplateSpec, ResourceRequirements, SeccompProfile,
    Secret, SecretVolumeSource, SecurityContext, Volume, VolumeMount,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};

use super::request::{BuildRequest, tls_verify};

/// The builds namespace of a hub whose namespace is `hub_namespace`: the hub's own is
/// Pod Security `restricted`, which buildah cannot run under (see
/// `addon-manifests/hub/builds.yaml`).
pub fn builds_namespace(hub_namespace: &str) -> String {
    format!("{hub_namespace}-builds")
}

/// Every object of a build carries it.
pub const MANAGED_BY_LABEL: &str = "app.kubernetes.io/managed-by";
pub const MANAGED_BY: &str = "kmm-hub";
/// The ManagedClusterModule's name (when it is a valid label value, which the hub's
/// validation guarantees: name and namespace together have at most 41 characters).
pub const MODULE_LABEL: &str = "hub.kmm.sigs.x-k8s.io/module";
/// The ManagedClusterModule's uid: how the hub finds a module's builds.
pub const MODULE_UID_LABEL: &str = "hub.kmm.sigs.x-k8s.io/module-uid";
/// The build's fingerprint ([`BuildRequest::fingerprint`]).
pub const FINGERPRINT_LABEL: &str = "hub.kmm.sigs.x-k8s.io/build-fingerprint";
/// Annotations saying what the build makes, for people reading the Job.
pub const IMAGE_ANNOTATION: &str = "hub.kmm.sigs.x-k8s.io/image";
pub const KERNEL_ANNOTATION: &str = "hub.kmm.sigs.x-k8s.io/kernel";
pub const MODULE_ANNOTATION: &str = "hub.kmm.sigs.x-k8s.io/module";

/// The owner of every Job: the cluster-scoped ManagedClusterModule.
const MODULE_API_VERSION: &str = "hub.kmm.sigs.x-k8s.io/v1beta1";
const MODULE_KIND: &str = "ManagedClusterModule";

/// The container's name, whose log is the build's.
pub const CONTAINER: &str = "build";
/// The build context: the Dockerfile only, as upstream KMM's kaniko builds see it.
pub const WORKSPACE: &str = "/workspace";
/// The ConfigMap key holding the Dockerfile, in the module's ConfigMap and in the copy.
pub const DOCKERFILE_KEY: &str = "dockerfile";
/// The key of the copy holding the CAs the hub trusts for registries, when it has any.
pub const REGISTRY_CA_KEY: &str = "registry-ca.crt";
/// Where the builder finds them: buildah's `--cert-dir`, which takes `*.crt` as CAs.
pub const REGISTRY_CA_DIR: &str = "/etc/kmm/registry-ca";
/// Where build Secrets appear, in the builder and in `RUN` steps: `<dir>/<name>/<key>`.
pub const SECRETS_DIR: &str = "/run/secrets";
/// The push Secret's key and where it is mounted (buildah's `REGISTRY_AUTH_FILE`).
pub const DOCKER_CONFIG_KEY: &str = ".dockerconfigjson";
const AUTH_DIR: &str = "/var/run/kmm-build/auth";
const AUTH_FILE: &str = "auth.json";
/// buildah's storage (vfs, `hub/builder/storage.conf`) and temporary files: node disk
/// that goes with the Pod, not the container's writable layer (the root filesystem is
/// read-only).
const STORAGE_DIR: &str = "/var/lib/containers";
const TMP_DIR: &str = "/var/tmp";
/// buildah's locks and run state (`/run/libpod`, `/run/containers`): a small tmpfs.
const RUN_DIR: &str = "/run";

/// Finished Jobs, with their Pod and log, are deleted this long after they end. The hub
/// reads the outcome and the log tail on its next look at the build, normally seconds
/// later; an hour also covers a hub that is down, restarting or failing over meanwhile.
/// A failed Job also keeps its fingerprint taken for that hour: the hub's backoff, not
/// a recreated Job, decides when to try again.
pub const TTL_SECONDS_AFTER_FINISHED: i32 = 3600;
/// A build running longer fails (`DeadlineExceeded`): out-of-tree modules compile in
/// minutes; an hour leaves room for large ones on small nodes, and ends builds stuck on
/// an unreachable registry or an image pull that never succeeds.
pub const ACTIVE_DEADLINE_SECONDS: i64 = 3600;

/// A Secret the build needs, copied from the hub's namespace into the builds namespace.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SecretCopy {
    /// The Secret in the hub's namespace.
    pub source: String,
    /// The copy in the builds namespace, owned by the Job.
    pub name: String,
    /// Whether it is the push Secret (whose `.dockerconfigjson` must exist).
    pub push: bool,
}

/// The Job of a build and the inputs it mounts.
#[derive(Clone, Debug)]
pub struct BuildJob {
    pub name: String,
    pub fingerprint: String,
    pub job: Job,
    /// The Dockerfile's ConfigMap, without its owner (the Job's uid is known once the
    /// Job exists: [`owned_by_job`]).
    pub dockerfile: ConfigMap,
    pub secrets: Vec<SecretCopy>,
}

/// The Job's name: the module's name, made a DNS label and cut to leave room, then the
/// fingerprint; at most 63 characters (the Job controller's `job-name` label value).
pub fn job_name(module: &str, fingerprint: &str) -> String {
    let room = 63 - 1 - fingerprint.len();
    let prefix: String = module
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() {
                c.to_ascii_lowercase()
            } else {
                '-'
            }
        })
        .take(room)
        .collect();
    let prefix = prefix.trim_matches('-');
    if prefix.is_empty() {
        format!("build-{fingerprint}")
    } else {
        format!("{prefix}-{fingerprint}")
    }
}

fn is_label_value(s: &str) -> bool {
    s.len() <= 63
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
        && s.bytes().next().is_some_and(|b| b.is_ascii_alphanumeric())
        && s.bytes().last().is_some_and(|b| b.is_ascii_alphanumeric())
}

/// The labels of the Job, its Pod and its copies.
fn labels(request: &BuildRequest, fingerprint: &str) -> BTreeMap<String, String> {
    let mut labels = BTreeMap::from([
        (MANAGED_BY_LABEL.to_owned(), MANAGED_BY.to_owned()),
        (MODULE_UID_LABEL.to_owned(), request.module_uid.clone()),
        (FINGERPRINT_LABEL.to_owned(), fingerprint.to_owned()),
    ]);
    if is_label_value(&request.module) {
        labels.insert(MODULE_LABEL.to_owned(), request.module.clone());
    }
    labels
}

/// Renders the build of `request` with `builder_image` in `namespace` (the builds
/// namespace).
pub fn render(request: &BuildRequest, builder_image: &str, namespace: &str) -> BuildJob {
    let fingerprint = request.fingerprint(builder_image);
    let name = job_name(&request.module, &fingerprint);
    let labels = labels(request, &fingerprint);
    let annotations = BTreeMap::from([
        (MODULE_ANNOTATION.to_owned(), request.module.clone()),
        (IMAGE_ANNOTATION.to_owned(), request.image.clone()),
        (KERNEL_ANNOTATION.to_owned(), request.kernel.clone()),
    ]);
    let metadata = |name: String| ObjectMeta {
        name: Some(name),
        namespace: Some(namespace.to_owned()),
        labels: Some(labels.clone()),
        annotations: Some(annotations.clone()),
        ..ObjectMeta::default()
    };

    let mut secrets: Vec<SecretCopy> = request
        .secret_names()
        .into_iter()
        .enumerate()
        .map(|(index, source)| SecretCopy {
            source,
            name: format!("{name}-secret-{index}"),
            push: false,
        })
        .collect();
    let push = request
        .push_secret
        .as_deref()
        .filter(|s| !s.is_empty())
        .map(|source| SecretCopy {
            source: source.to_owned(),
            name: format!("{name}-push"),
            push: true,
        });

    let mut volumes = vec![
        Volume {
            name: "workspace".into(),
            config_map: Some(ConfigMapVolumeSource {
                name: name.clone(),
                items: Some(vec![KeyToPath {
                    key: DOCKERFILE_KEY.into(),
                    path: "Dockerfile".into(),
                    mode: None,
                }]),
                ..ConfigMapVolumeSource::default()
            }),
            ..Volume::default()
        },
        Volume {
            name: "storage".into(),
            empty_dir: Some(EmptyDirVolumeSource::default()),
            ..Volume::default()
        },
        Volume {
            name: "tmp".into(),
            empty_dir: Some(EmptyDirVolumeSource::default()),
            ..Volume::default()
        },
        Volume {
            name: "run".into(),
            empty_dir: Some(EmptyDirVolumeSource {
                medium: Some("Memory".into()),
                size_limit: Some(Quantity("64Mi".into())),
            }),
            ..Volume::default()
        },
    ];
    let mut mounts = vec![
        mount("workspace", WORKSPACE),
        VolumeMount {
            read_only: None,
            ..mount("storage", STORAGE_DIR)
        },
        VolumeMount {
            read_only: None,
            ..mount("tmp", TMP_DIR)
        },
        // The Secrets' mounts below /run/secrets are made on top of it.
        VolumeMount {
            read_only: None,
            ..mount("run", RUN_DIR)
        },
    ];
    let mut args = vec![request.image.clone()];
    args.extend(
        request
            .build_args()
            .iter()
            .map(|(arg, value)| format!("--build-arg={arg}={value}")),
    );
    args.push(format!(
        "--tls-verify={}",
        tls_verify(request.build.base_image_registry_tls.as_ref())
    ));
    for (index, secret) in secrets.iter().enumerate() {
        let volume = format!("secret-{index}");
        let path = format!("{SECRETS_DIR}/{}", secret.source);
        volumes.push(Volume {
            name: volume.clone(),
            secret: Some(SecretVolumeSource {
                secret_name: Some(secret.name.clone()),
                ..SecretVolumeSource::default()
            }),
            ..Volume::default()
        });
        mounts.push(mount(&volume, &path));
        // `RUN` steps run in the image's root, where the builder's mounts are not: the
        // same path is bound into each of them, read-only and never committed.
        args.push(format!("--volume={path}:{path}:ro"));
    }
    let mut env = vec![EnvVar {
        name: "KMM_PUSH_TLS_VERIFY".into(),
        value: Some(tls_verify(request.registry_tls.as_ref()).to_string()),
        ..EnvVar::default()
    }];
    if let Some(push) = &push {
        volumes.push(Volume {
            name: "push-auth".into(),
            secret: Some(SecretVolumeSource {
                secret_name: Some(push.name.clone()),
                items: Some(vec![KeyToPath {
                    key: DOCKER_CONFIG_KEY.into(),
                    path: AUTH_FILE.into(),
                    mode: None,
                }]),
                ..SecretVolumeSource::default()
            }),
            ..Volume::default()
        });
        mounts.push(mount("push-auth", AUTH_DIR));
        env.push(EnvVar {
            name: "REGISTRY_AUTH_FILE".into(),
            value: Some(format!("{AUTH_DIR}/{AUTH_FILE}")),
            ..EnvVar::default()
        });
    }
    secrets.extend(push);

    let quantity = |q: &str| Quantity(q.to_owned());
    let container = Container {
        name: CONTAINER.into(),
        image: Some(builder_image.to_owned()),
        image_pull_policy: Some("IfNotPresent".into()),
        args: Some(args),
        env: Some(env),
        volume_mounts: Some(mounts),
        // Compiling a module takes a core and a few hundred MiB; the limit keeps a
        // runaway build from starving the node, none on CPU, which would only slow it.
        resources: Some(ResourceRequirements {
            requests: Some(BTreeMap::from([
                ("cpu".to_owned(), quantity("250m")),
                ("memory".to_owned(), quantity("256Mi")),
            ])),
            limits: Some(BTreeMap::from([("memory".to_owned(), quantity("4Gi"))])),
            ..ResourceRequirements::default()
        }),
        security_context: Some(builder_security_context()),
        // When the log cannot be read, the Pod's status still holds its end.
        termination_message_policy: Some("FallbackToLogsOnError".into()),
        ..Container::default()
    };
    let pod = PodSpec {
        containers: vec![container],
        restart_policy: Some("Never".into()),
        // The build reads nothing from the API.
        automount_service_account_token: Some(false),
        enable_service_links: Some(false),
        node_selector: request.build.selector.clone().filter(|s| !s.is_empty()),
        security_context: Some(PodSecurityContext {
            seccomp_profile: Some(SeccompProfile {
                type_: "RuntimeDefault".into(),
                ..SeccompProfile::default()
            }),
            ..PodSecurityContext::default()
        }),
        volumes: Some(volumes),
        ..PodSpec::default()
    };
    let job = Job {
        metadata: ObjectMeta {
            owner_references: Some(vec![OwnerReference {
                api_version: MODULE_API_VERSION.into(),
                kind: MODULE_KIND.into(),
                name: request.module.clone(),
                uid: request.module_uid.clone(),
                // A module deleted in the foreground does not wait for its builds:
                // the garbage collector deletes them after it.
                block_owner_deletion: Some(false),
                controller: Some(true),
            }]),
            ..metadata(name.clone())
        },
        spec: Some(JobSpec {
            // One attempt: the hub backs off between builds and reports each failure.
            backoff_limit: Some(0),
            active_deadline_seconds: Some(ACTIVE_DEADLINE_SECONDS),
            ttl_seconds_after_finished: Some(TTL_SECONDS_AFTER_FINISHED),
            // Created suspended: the Pod starts once its copied inputs exist (they can
            // only be created after the Job, whose uid owns them).
            suspend: Some(true),
            template: PodTemplateSpec {
                metadata: Some(ObjectMeta {
                    labels: Some(labels.clone()),
                    annotations: Some(annotations.clone()),
                    ..ObjectMeta::default()
                }),
                spec: Some(pod),
            },
            ..JobSpec::default()
        }),
        status: None,
    };
    let dockerfile = ConfigMap {
        metadata: metadata(name.clone()),
        data: Some(BTreeMap::from([(
            DOCKERFILE_KEY.to_owned(),
            request.dockerfile.clone(),
        )])),
        ..ConfigMap::default()
    };
    BuildJob {
        name,
        fingerprint,
        job,
        dockerfile,
        secrets,
    }
}

/// `build`, its builder trusting the CAs of `registry_ca_pem` (the hub's own) for the
/// pulls and the push, besides the system's: they travel in the Dockerfile's copy (no
/// other object, no other permission) and reach buildah as `--cert-dir`.
pub fn trusting(mut build: BuildJob, registry_ca_pem: &str) -> BuildJob {
    build
        .dockerfile
        .data
        .get_or_insert_with(BTreeMap::new)
        .insert(REGISTRY_CA_KEY.to_owned(), registry_ca_pem.to_owned());
    let Some(pod) = build
        .job
        .spec
        .as_mut()
        .and_then(|spec| spec.template.spec.as_mut())
    else {
        return build;
    };
    pod.volumes.get_or_insert_with(Vec::new).push(Volume {
        name: "registry-ca".into(),
        config_map: Some(ConfigMapVolumeSource {
            name: build.name.clone(),
            items: Some(vec![KeyToPath {
                key: REGISTRY_CA_KEY.into(),
                path: "ca.crt".into(),
                mode: None,
            }]),
            ..ConfigMapVolumeSource::default()
        }),
        ..Volume::default()
    });
    let container = &mut pod.containers[0];
    container
        .volume_mounts
        .get_or_insert_with(Vec::new)
        .push(mount("registry-ca", REGISTRY_CA_DIR));
    container
        .args
        .get_or_insert_with(Vec::new)
        .push(format!("--cert-dir={REGISTRY_CA_DIR}"));
    container.env.get_or_insert_with(Vec::new).push(EnvVar {
        name: "KMM_CERT_DIR".into(),
        value: Some(REGISTRY_CA_DIR.into()),
        ..EnvVar::default()
    });
    build
}

/// What buildah needs to build as root in a container: see `addon-manifests/hub/builds.yaml`.
fn builder_security_context() -> SecurityContext {
    SecurityContext {
        run_as_user: Some(0),
        run_as_group: Some(0),
        run_as_non_root: Some(false),
        privileged: Some(false),
        allow_privilege_escalation: Some(false),
        read_only_root_filesystem: Some(true),
        capabilities: Some(Capabilities {
            drop: Some(vec!["ALL".into()]),
            add: Some(
                BUILDER_CAPABILITIES
                    .iter()
                    .map(|c| (*c).to_owned())
                    .collect(),
            ),
        }),
        ..SecurityContext::default()
    }
}

/// The capabilities the builder keeps; every other is dropped. buildah gives each `RUN`
/// step containers.conf's default set (Docker's, less AUDIT_WRITE, MKNOD, NET_RAW) and
/// can only hand on what it has: without KILL, NET_BIND_SERVICE or SETPCAP it fails
/// with "setting capabilities: operation not permitted". SYS_ADMIN is for its own
/// mounts: without it, buildah takes itself for rootless and fails to create a user
/// namespace. (Both measured on the local fleet's real node.)
pub const BUILDER_CAPABILITIES: &[&str] = &[
    "CHOWN",
    "DAC_OVERRIDE",
    "FOWNER",
    "FSETID",
    "KILL",
    "NET_BIND_SERVICE",
    "SETFCAP",
    "SETGID",
    "SETPCAP",
    "SETUID",
    "SYS_CHROOT",
    "SYS_ADMIN",
];

fn mount(volume: &str, path: &str) -> VolumeMount {
    VolumeMount {
        name: volume.into(),
        mount_path: path.into(),
        read_only: Some(true),
        ..VolumeMount::default()
    }
}

/// `metadata` owned by the Job `name` (uid `uid`): the copies go when the Job goes.
pub fn owned_by_job(mut metadata: ObjectMeta, name: &str, uid: &str) -> ObjectMeta {
    metadata.owner_references = Some(vec![OwnerReference {
        api_version: "batch/v1".into(),
        kind: "Job".into(),
        name: name.to_owned(),
        uid: uid.to_owned(),
        block_owner_deletion: Some(false),
        controller: Some(true),
    }]);
    metadata
}

/// The copy `copy` of the Secret `source` for the Job `build` (whose uid is `job_uid`):
/// the same type and data, the build's labels, owned by the Job.
pub fn secret_copy(build: &BuildJob, copy: &SecretCopy, source: &Secret, job_uid: &str) -> Secret {
    let metadata = ObjectMeta {
        name: Some(copy.name.clone()),
        ..build.dockerfile.metadata.clone()
    };
    Secret {
        metadata: owned_by_job(metadata, &build.name, job_uid),
        type_: source.type_.clone(),
        // As read from the API, where stringData has been merged into data.
        data: source.data.clone(),
        string_data: None,
        immutable: Some(true),
    }
}

/// Whether `secret` (as read from the API) holds a non-empty `.dockerconfigjson`, as the
/// push Secret must.
pub fn has_docker_config(secret: &Secret) -> bool {
    secret
        .data
        .as_ref()
        .and_then(|d| d.get(DOCKER_CONFIG_KEY))
        .is_some_and(|ByteString(bytes)| !bytes.is_empty())
}

#[cfg(test)]
mod tests {
    use kmm_api::{BuildArg, TlsOptions};

    use super::super::request::tests::{BUILDER, request};
    use super::*;

    const NAMESPACE: &str = "kmm-hub-builds";

    fn pod(build: &BuildJob) -> &PodSpec {
        build
            .job
            .spec
            .as_ref()
            .unwrap()
            .template
            .spec
            .as_ref()
            .unwrap()
    }

    fn container(build: &BuildJob) -> &Container {
        &pod(build).containers[0]
    }

    fn args(build: &BuildJob) -> Vec<String> {
        container(build).args.clone().unwrap()
    }

    fn mount_of<'a>(build: &'a BuildJob, path: &str) -> &'a VolumeMount {
        container(build)
            .volume_mounts
            .as_ref()
            .unwrap()
            .iter()
            .find(|m| m.mount_path == path)
            .unwrap_or_else(|| panic!("nothing mounted at {path}"))
    }

    fn volume<'a>(build: &'a BuildJob, name: &str) -> &'a Volume {
        pod(build)
            .volumes
            .as_ref()
            .unwrap()
            .iter()
            .find(|v| v.name == name)
            .unwrap_or_else(|| panic!("no volume {name}"))
    }

    #[test]
    fn names_are_dns_labels_derived_from_module_and_fingerprint() {
        let fingerprint = "0123456789abcdef0123456789abcdef";
        assert_eq!(
            job_name("kmm-hello", fingerprint),
            format!("kmm-hello-{fingerprint}")
        );
        let long = job_name(&format!("a.b_{}", "x".repeat(100)), fingerprint);
        assert_eq!(long.len(), 63);
        assert!(long.starts_with("a-b-xxx") && long.ends_with(fingerprint));
        // A cut that ends on a separator does not leave it dangling.
        let cut = job_name(&format!("{}.tail", "y".repeat(29)), fingerprint);
        assert_eq!(cut, format!("{}-{fingerprint}", "y".repeat(29)));
        assert_eq!(job_name("---", fingerprint), format!("build-{fingerprint}"));
        for name in [long, cut] {
            assert!(
                name.bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
            );
        }
        let build = render(&request(), BUILDER, NAMESPACE);
        assert_eq!(build.name, job_name("kmm-hello", &build.fingerprint));
        assert_eq!(
            render(&request(), BUILDER, NAMESPACE).name,
            build.name,
            "deterministic"
        );
    }

    #[test]
    fn the_job_is_labelled_and_owned_by_the_module() {
        let build = render(&request(), BUILDER, NAMESPACE);
        let meta = &build.job.metadata;
        assert_eq!(meta.namespace.as_deref(), Some(NAMESPACE));
        let labels = meta.labels.as_ref().unwrap();
        assert_eq!(labels[MANAGED_BY_LABEL], "kmm-hub");
        assert_eq!(labels[MODULE_LABEL], "kmm-hello");
        assert_eq!(labels[MODULE_UID_LABEL], request().module_uid);
        assert_eq!(labels[FINGERPRINT_LABEL], build.fingerprint);
        let template_labels = build.job.spec.as_ref().unwrap().template.metadata.as_ref();
        assert_eq!(template_labels.unwrap().labels.as_ref(), Some(labels));
        let owner = &meta.owner_references.as_ref().unwrap()[0];
        assert_eq!(owner.api_version, "hub.kmm.sigs.x-k8s.io/v1beta1");
        assert_eq!(owner.kind, "ManagedClusterModule");
        assert_eq!(owner.name, "kmm-hello");
        assert_eq!(owner.uid, request().module_uid);
        assert_eq!(owner.block_owner_deletion, Some(false));
        let annotations = meta.annotations.as_ref().unwrap();
        assert_eq!(annotations[IMAGE_ANNOTATION], request().image);
        assert_eq!(annotations[KERNEL_ANNOTATION], "6.1.0-47-amd64");
    }

    #[test]
    fn a_module_name_that_is_no_label_value_is_left_to_the_annotation() {
        let mut long = request();
        long.module = format!("{}.example", "m".repeat(60));
        let build = render(&long, BUILDER, NAMESPACE);
        let meta = &build.job.metadata;
        assert!(!meta.labels.as_ref().unwrap().contains_key(MODULE_LABEL));
        assert_eq!(
            meta.annotations.as_ref().unwrap()[MODULE_ANNOTATION],
            long.module
        );
        assert!(build.name.len() <= 63);
    }

    #[test]
    fn the_job_runs_once_within_a_deadline_and_is_collected_after_it_finished() {
        let build = render(&request(), BUILDER, NAMESPACE);
        let spec = build.job.spec.as_ref().unwrap();
        assert_eq!(spec.backoff_limit, Some(0));
        assert_eq!(spec.ttl_seconds_after_finished, Some(3600));
        assert_eq!(spec.active_deadline_seconds, Some(3600));
        assert_eq!(spec.suspend, Some(true));
        let pod = pod(&build);
        assert_eq!(pod.restart_policy.as_deref(), Some("Never"));
        assert_eq!(pod.automount_service_account_token, Some(false));
        let container = container(&build);
        assert_eq!(container.image.as_deref(), Some(BUILDER));
        assert_eq!(container.name, CONTAINER);
        let resources = container.resources.as_ref().unwrap();
        assert!(resources.requests.as_ref().unwrap().contains_key("memory"));
        assert!(resources.limits.as_ref().unwrap().contains_key("memory"));
    }

    #[test]
    fn the_dockerfile_is_the_build_context_from_a_copied_config_map() {
        let build = render(&request(), BUILDER, NAMESPACE);
        assert_eq!(
            build.dockerfile.metadata.name.as_deref(),
            Some(build.name.as_str())
        );
        assert_eq!(
            build.dockerfile.metadata.namespace.as_deref(),
            Some(NAMESPACE)
        );
        assert_eq!(
            build.dockerfile.data.as_ref().unwrap()[DOCKERFILE_KEY],
            "FROM base\nRUN make\n"
        );
        let source = volume(&build, "workspace").config_map.as_ref().unwrap();
        assert_eq!(source.name, build.name);
        let items = source.items.as_ref().unwrap();
        assert_eq!(
            (items[0].key.as_str(), items[0].path.as_str()),
            ("dockerfile", "Dockerfile")
        );
        assert_eq!(mount_of(&build, WORKSPACE).read_only, Some(true));
        assert_eq!(
            args(&build)[0],
            request().image,
            "the image to push comes first"
        );
    }

    #[test]
    fn build_args_are_passed_merged_with_the_implicit_ones() {
        let mut r = request();
        r.build.build_args = Some(vec![
            BuildArg {
                name: "FLAVOUR".into(),
                value: "a b=c".into(),
            },
            BuildArg {
                name: "MOD_NAME".into(),
                value: "spoofed".into(),
            },
        ]);
        let args = args(&render(&r, BUILDER, NAMESPACE));
        for expected in [
            "--build-arg=FLAVOUR=a b=c",
            "--build-arg=KERNEL_VERSION=6.1.0-47-amd64",
            "--build-arg=KERNEL_FULL_VERSION=6.1.0-47-amd64",
            "--build-arg=MOD_NAME=kmm-hello",
            "--build-arg=MOD_NAMESPACE=kmm-demo",
        ] {
            assert!(
                args.contains(&expected.to_owned()),
                "{expected} in {args:?}"
            );
        }
        assert_eq!(
            args.iter()
                .filter(|a| a.starts_with("--build-arg="))
                .count(),
            5
        );
    }

    #[test]
    fn build_secrets_are_mounted_at_run_secrets_and_bound_into_run_steps() {
        let mut r = request();
        r.build.secrets = Some(vec![
            k8s_openapi::api::core::v1::LocalObjectReference {
                name: "zeta".into(),
            },
            k8s_openapi::api::core::v1::LocalObjectReference {
                name: "alpha".into(),
            },
            k8s_openapi::api::core::v1::LocalObjectReference {
                name: "alpha".into(),
            },
        ]);
        let build = render(&r, BUILDER, NAMESPACE);
        let copies: Vec<(&str, &str, bool)> = build
            .secrets
            .iter()
            .map(|s| (s.source.as_str(), s.name.as_str(), s.push))
            .collect();
        let alpha = format!("{}-secret-0", build.name);
        let zeta = format!("{}-secret-1", build.name);
        let push = format!("{}-push", build.name);
        assert_eq!(
            copies,
            [
                ("alpha", alpha.as_str(), false),
                ("zeta", zeta.as_str(), false),
                ("registry-push", push.as_str(), true)
            ]
        );
        let alpha_mount = mount_of(&build, "/run/secrets/alpha");
        assert_eq!(alpha_mount.read_only, Some(true));
        let alpha_volume = volume(&build, &alpha_mount.name).secret.as_ref().unwrap();
        assert_eq!(alpha_volume.secret_name.as_deref(), Some(alpha.as_str()));
        let args = args(&build);
        assert!(args.contains(&"--volume=/run/secrets/alpha:/run/secrets/alpha:ro".to_owned()));
        assert!(args.contains(&"--volume=/run/secrets/zeta:/run/secrets/zeta:ro".to_owned()));
    }

    #[test]
    fn the_push_secret_becomes_buildahs_auth_file() {
        let build = render(&request(), BUILDER, NAMESPACE);
        let env = container(&build).env.as_ref().unwrap();
        let auth = env
            .iter()
            .find(|e| e.name == "REGISTRY_AUTH_FILE")
            .and_then(|e| e.value.as_deref())
            .unwrap();
        let (dir, file) = auth.rsplit_once('/').unwrap();
        let mount = mount_of(&build, dir);
        let source = volume(&build, &mount.name).secret.as_ref().unwrap();
        assert_eq!(source.secret_name, Some(format!("{}-push", build.name)));
        let item = &source.items.as_ref().unwrap()[0];
        assert_eq!(
            (item.key.as_str(), item.path.as_str()),
            (".dockerconfigjson", file)
        );

        let mut anonymous = request();
        anonymous.push_secret = None;
        let build = render(&anonymous, BUILDER, NAMESPACE);
        assert!(build.secrets.iter().all(|s| !s.push));
        let env = container(&build).env.as_ref().unwrap();
        assert!(env.iter().all(|e| e.name != "REGISTRY_AUTH_FILE"));
    }

    #[test]
    fn a_build_trusts_the_hubs_registry_cas_through_its_dockerfiles_copy() {
        let plain = render(&request(), BUILDER, NAMESPACE);
        let pem = "-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n";
        let build = trusting(plain.clone(), pem);
        assert_eq!(build.name, plain.name, "the same build: the same Job");
        assert_eq!(
            build.dockerfile.data.as_ref().unwrap()[REGISTRY_CA_KEY],
            pem
        );
        assert_eq!(
            build.dockerfile.data.as_ref().unwrap()[DOCKERFILE_KEY],
            plain.dockerfile.data.as_ref().unwrap()[DOCKERFILE_KEY]
        );
        let pod = build
            .job
            .spec
            .as_ref()
            .unwrap()
            .template
            .spec
            .as_ref()
            .unwrap();
        let volume = pod
            .volumes
            .iter()
            .flatten()
            .find(|v| v.name == "registry-ca")
            .unwrap();
        let source = volume.config_map.as_ref().unwrap();
        assert_eq!(source.name, build.name, "the Dockerfile's copy");
        assert_eq!(source.items.as_ref().unwrap()[0].path, "ca.crt");
        let container = &pod.containers[0];
        assert!(
            container
                .volume_mounts
                .iter()
                .flatten()
                .any(|m| m.name == "registry-ca" && m.mount_path == REGISTRY_CA_DIR)
        );
        assert!(args(&build).contains(&format!("--cert-dir={REGISTRY_CA_DIR}")));
        assert!(
            container
                .env
                .iter()
                .flatten()
                .any(|e| e.name == "KMM_CERT_DIR" && e.value.as_deref() == Some(REGISTRY_CA_DIR)),
            "the push trusts them too"
        );
        assert_eq!(build.secrets, plain.secrets, "no Secret: a CA is no secret");
    }

    #[test]
    fn tls_settings_turn_verification_off_for_pulls_and_push_separately() {
        let verify_env = |build: &BuildJob| {
            container(build)
                .env
                .as_ref()
                .unwrap()
                .iter()
                .find(|e| e.name == "KMM_PUSH_TLS_VERIFY")
                .and_then(|e| e.value.clone())
                .unwrap()
        };
        let default = render(&request(), BUILDER, NAMESPACE);
        assert!(args(&default).contains(&"--tls-verify=true".to_owned()));
        assert_eq!(verify_env(&default), "true");

        let mut base_insecure = request();
        base_insecure.build.base_image_registry_tls = Some(TlsOptions {
            insecure: Some(true),
            insecure_skip_tls_verify: None,
        });
        let build = render(&base_insecure, BUILDER, NAMESPACE);
        assert!(args(&build).contains(&"--tls-verify=false".to_owned()));
        assert_eq!(verify_env(&build), "true");

        let mut push_insecure = request();
        push_insecure.registry_tls = Some(TlsOptions {
            insecure: None,
            insecure_skip_tls_verify: Some(true),
        });
        let build = render(&push_insecure, BUILDER, NAMESPACE);
        assert!(args(&build).contains(&"--tls-verify=true".to_owned()));
        assert_eq!(verify_env(&build), "false");
    }

    #[test]
    fn the_build_selector_chooses_the_node() {
        assert_eq!(
            pod(&render(&request(), BUILDER, NAMESPACE)).node_selector,
            None
        );
        let mut r = request();
        r.build.selector = Some([("kubernetes.io/hostname".to_owned(), "n1".to_owned())].into());
        assert_eq!(
            pod(&render(&r, BUILDER, NAMESPACE)).node_selector,
            r.build.selector
        );
    }

    #[test]
    fn the_builder_drops_every_capability_but_buildahs_and_is_not_privileged() {
        let build = render(&request(), BUILDER, NAMESPACE);
        let security = container(&build).security_context.as_ref().unwrap();
        assert_eq!(security.privileged, Some(false));
        assert_eq!(security.allow_privilege_escalation, Some(false));
        assert_eq!(security.read_only_root_filesystem, Some(true));
        let capabilities = security.capabilities.as_ref().unwrap();
        assert_eq!(capabilities.drop.as_deref(), Some(&["ALL".to_owned()][..]));
        assert_eq!(
            capabilities.add.as_ref().unwrap().len(),
            BUILDER_CAPABILITIES.len()
        );
        // Everything buildah writes is on the Pod's volumes.
        for path in [STORAGE_DIR, TMP_DIR, RUN_DIR] {
            assert_eq!(mount_of(&build, path).read_only, None);
        }
    }

    #[test]
    fn copies_keep_type_and_data_and_are_owned_by_the_job() {
        let build = render(&request(), BUILDER, NAMESPACE);
        let source = Secret {
            metadata: ObjectMeta {
                name: Some("registry-push".into()),
                namespace: Some("kmm-hub".into()),
                resource_version: Some("42".into()),
                uid: Some("source-uid".into()),
                ..ObjectMeta::default()
            },
            type_: Some("kubernetes.io/dockerconfigjson".into()),
            data: Some(BTreeMap::from([(
                DOCKER_CONFIG_KEY.to_owned(),
                ByteString(b"{\"auths\":{}}".to_vec()),
            )])),
            ..Secret::default()
        };
        assert!(has_docker_config(&source));
        assert!(!has_docker_config(&Secret::default()));
        let push = build.secrets.iter().find(|s| s.push).unwrap();
        let copy = secret_copy(&build, push, &source, "job-uid");
        assert_eq!(copy.metadata.name.as_deref(), Some(push.name.as_str()));
        assert_eq!(copy.metadata.namespace.as_deref(), Some(NAMESPACE));
        assert_eq!(copy.metadata.resource_version, None);
        assert_eq!(copy.metadata.uid, None);
        assert_eq!(copy.type_, source.type_);
        assert_eq!(copy.data, source.data);
        assert_eq!(
            copy.metadata.labels.as_ref().unwrap()[FINGERPRINT_LABEL],
            build.fingerprint
        );
        let owner = &copy.metadata.owner_references.as_ref().unwrap()[0];
        assert_eq!(
            (owner.kind.as_str(), owner.name.as_str()),
            ("Job", build.name.as_str())
        );
        assert_eq!(owner.uid, "job-uid");
    }
}
