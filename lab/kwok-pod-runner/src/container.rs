//! A Pod's container as a host process: the program the runner maps the container's
//! `command[0]` to, the rest of the command and the arguments, and the environment the
//! kubelet would give it, each `$(VAR)` expanded by the kubelet's rules and each
//! mounted path rewritten to its host location ([`super::paths`]). Pure.

use std::collections::BTreeMap;
use std::path::PathBuf;

use k8s_openapi::api::core::v1::{Container, Pod};

use super::expansion::expand;
use super::fields::field_value;
use super::paths::{Mount, translate};

/// How to start a container's process.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct ProcessSpec {
    pub program: PathBuf,
    pub args: Vec<String>,
    /// Sorted by name.
    pub env: Vec<(String, String)>,
    /// `None`: the runner's choice (the pod's directory).
    pub working_dir: Option<PathBuf>,
}

/// What the kubelet would run for `container` of `pod`, given the Service link
/// variables, the container's mounts, the image paths the runner may run and the
/// host's `PATH` (the only variable taken from the host). An error says why the
/// runner refuses it.
pub(super) fn process_spec(
    pod: &Pod,
    container: &Container,
    service_env: &BTreeMap<String, String>,
    mounts: &[Mount],
    programs: &BTreeMap<String, PathBuf>,
    host_path: Option<&str>,
) -> Result<ProcessSpec, String> {
    let name = &container.name;
    if container.env_from.as_ref().is_some_and(|e| !e.is_empty()) {
        return Err(format!("container {name}: envFrom is not supported"));
    }
    // The kubelet's order: each variable sees those declared before it and the
    // Service variables; a declared variable hides a Service variable.
    let mut declared: BTreeMap<String, String> = BTreeMap::new();
    for var in container.env.iter().flatten() {
        let value = match (&var.value, &var.value_from) {
            (Some(value), _) if !value.is_empty() => expand(value, |n| {
                declared
                    .get(n)
                    .or_else(|| service_env.get(n))
                    .map(String::as_str)
            }),
            (_, Some(from)) => match &from.field_ref {
                Some(field) => field_value(pod, &field.field_path)
                    .map_err(|e| format!("container {name} env {}: {e}", var.name))?,
                None => {
                    return Err(format!(
                        "container {name} env {}: only value and valueFrom.fieldRef are supported",
                        var.name
                    ));
                }
            },
            _ => String::new(),
        };
        declared.insert(var.name.clone(), value);
    }
    let mut env = service_env.clone();
    env.extend(declared);
    if let Some(path) = host_path {
        env.entry("PATH".into()).or_insert_with(|| path.to_owned());
    }
    let expanded = |s: &String| expand(s, |n| env.get(n).map(String::as_str));
    let mut command = container.command.iter().flatten().map(expanded);
    let Some(image_program) = command.next() else {
        return Err(format!(
            "container {name}: no command (the image's entrypoint is unknown to the runner)"
        ));
    };
    let program = programs
        .get(&image_program)
        .ok_or_else(|| {
            format!("container {name}: program {image_program} is not mapped by --program")
        })?
        .clone();
    let args = command
        .chain(container.args.iter().flatten().map(expanded))
        .map(|a| translate(&a, mounts))
        .collect();
    let working_dir = match container.working_dir.as_deref().filter(|d| !d.is_empty()) {
        None => None,
        Some(dir) => {
            let host = translate(dir, mounts);
            if host == dir {
                return Err(format!(
                    "container {name}: workingDir {dir} is not on a volume mount"
                ));
            }
            Some(PathBuf::from(host))
        }
    };
    Ok(ProcessSpec {
        program,
        args,
        env: env
            .into_iter()
            .map(|(k, v)| {
                let v = translate(&v, mounts);
                (k, v)
            })
            .collect(),
        working_dir,
    })
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use k8s_openapi::api::core::v1::{
        ConfigMapKeySelector, EnvFromSource, EnvVar, EnvVarSource, ObjectFieldSelector,
        ResourceFieldSelector, SecretKeySelector,
    };

    use super::super::fields::tests::agent_pod;
    use super::*;

    const AGENT: &str = "/usr/local/bin/kmm-node-agent";

    fn programs() -> BTreeMap<String, PathBuf> {
        BTreeMap::from([(
            AGENT.into(),
            PathBuf::from("/ws/target/debug/kmm-node-agent"),
        )])
    }

    fn services() -> BTreeMap<String, String> {
        BTreeMap::from([
            ("KUBERNETES_SERVICE_HOST".into(), "10.96.0.1".into()),
            ("KUBERNETES_SERVICE_PORT".into(), "443".into()),
            ("KMM_SPOKE_PROXY_SERVICE_HOST".into(), "10.96.3.4".into()),
        ])
    }

    fn mounts() -> Vec<Mount> {
        vec![
            Mount {
                container: "/var/lib/kmm".into(),
                host: "/r/n1/host/var/lib/kmm".into(),
            },
            Mount {
                container: "/var/run/secrets/kmm".into(),
                host: "/r/n1/pods/u1/volumes/proxy-token".into(),
            },
        ]
    }

    fn value(name: &str, value: &str) -> EnvVar {
        EnvVar {
            name: name.into(),
            value: Some(value.into()),
            ..Default::default()
        }
    }

    fn field(name: &str, path: &str) -> EnvVar {
        EnvVar {
            name: name.into(),
            value_from: Some(EnvVarSource {
                field_ref: Some(ObjectFieldSelector {
                    field_path: path.into(),
                    ..Default::default()
                }),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    fn agent() -> Container {
        Container {
            name: "agent".into(),
            command: Some(vec![AGENT.into(), "run".into()]),
            args: Some(vec![
                "--node-name=$(NODE_NAME)".into(),
                "--proxy-address=https://$(KMM_SPOKE_PROXY_SERVICE_HOST):8443".into(),
                "--token-file=/var/run/secrets/kmm/token".into(),
                "--state-dir=$(STATE)".into(),
                "--metrics-addr=$(POD_IP):8080".into(),
                "--literal=$$(NODE_NAME)".into(),
                "--unknown=$(NOPE)".into(),
            ]),
            env: Some(vec![
                field("NODE_NAME", "spec.nodeName"),
                field("POD_IP", "status.podIP"),
                field("HOST_IP", "status.hostIP"),
                value("STATE", "/var/lib/kmm/state"),
                value("PROXY", "$(KMM_SPOKE_PROXY_SERVICE_HOST):$(PORT)"),
                value("PORT", "8443"),
                value("LATER", "$(PORT)"),
                value("KUBERNETES_SERVICE_PORT", "6443"),
                value("EMPTY", ""),
            ]),
            ..Default::default()
        }
    }

    fn spec(container: &Container) -> Result<ProcessSpec, String> {
        process_spec(
            &agent_pod(),
            container,
            &services(),
            &mounts(),
            &programs(),
            Some("/usr/bin:/bin"),
        )
    }

    #[test]
    fn the_agent_as_a_host_process() {
        let spec = spec(&agent()).unwrap();
        assert_eq!(spec.program, Path::new("/ws/target/debug/kmm-node-agent"));
        assert_eq!(
            spec.args,
            [
                "run",
                "--node-name=spoke1-kwok-1",
                "--proxy-address=https://10.96.3.4:8443",
                "--token-file=/r/n1/pods/u1/volumes/proxy-token/token",
                "--state-dir=/r/n1/host/var/lib/kmm/state",
                "--metrics-addr=10.101.0.7:8080",
                "--literal=$(NODE_NAME)",
                "--unknown=$(NOPE)",
            ]
        );
        assert_eq!(spec.working_dir, None);
    }

    #[test]
    fn the_environment_as_the_kubelet_builds_it() {
        let env: BTreeMap<String, String> = spec(&agent()).unwrap().env.into_iter().collect();
        let expected: BTreeMap<String, String> = [
            ("EMPTY", ""),
            ("HOST_IP", "127.0.0.1"),
            // Declared later: not yet known when PROXY was expanded.
            ("PROXY", "10.96.3.4:$(PORT)"),
            ("LATER", "8443"),
            ("PORT", "8443"),
            ("KMM_SPOKE_PROXY_SERVICE_HOST", "10.96.3.4"),
            ("KUBERNETES_SERVICE_HOST", "10.96.0.1"),
            // A declared variable hides the Service's.
            ("KUBERNETES_SERVICE_PORT", "6443"),
            ("NODE_NAME", "spoke1-kwok-1"),
            ("PATH", "/usr/bin:/bin"),
            ("POD_IP", "10.101.0.7"),
            // Values are translated too.
            ("STATE", "/r/n1/host/var/lib/kmm/state"),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect();
        assert_eq!(env, expected);
    }

    #[test]
    fn a_declared_path_wins_and_no_host_path_means_none() {
        let mut c = agent();
        c.env.as_mut().unwrap().push(value("PATH", "/opt/bin"));
        let env = spec(&c).unwrap().env;
        assert!(env.contains(&("PATH".into(), "/opt/bin".into())));
        let without = process_spec(
            &agent_pod(),
            &agent(),
            &services(),
            &mounts(),
            &programs(),
            None,
        )
        .unwrap();
        assert!(without.env.iter().all(|(k, _)| k != "PATH"));
    }

    #[test]
    fn field_values_are_not_expanded_and_redefinitions_see_the_earlier_value() {
        let mut pod = agent_pod();
        pod.metadata
            .labels
            .as_mut()
            .unwrap()
            .insert("x".into(), "$(PORT)".into());
        let mut c = agent();
        c.env = Some(vec![
            value("PORT", "1"),
            field("LABEL", "metadata.labels['x']"),
            value("PORT", "$(PORT)2"),
        ]);
        let spec = process_spec(&pod, &c, &BTreeMap::new(), &[], &programs(), None).unwrap();
        assert_eq!(
            spec.env,
            [
                ("LABEL".into(), "$(PORT)".into()),
                ("PORT".into(), "12".into())
            ]
        );
    }

    #[test]
    fn the_command_itself_is_expanded_before_mapping() {
        let mut c = agent();
        c.env = Some(vec![value("BIN", "/usr/local/bin")]);
        c.command = Some(vec!["$(BIN)/kmm-node-agent".into()]);
        c.args = None;
        let spec = spec(&c).unwrap();
        assert_eq!(spec.program, Path::new("/ws/target/debug/kmm-node-agent"));
        assert!(spec.args.is_empty());
    }

    #[test]
    fn working_dir_must_be_on_a_mount() {
        let mut c = agent();
        c.working_dir = Some("/var/lib/kmm/work".into());
        assert_eq!(
            spec(&c).unwrap().working_dir,
            Some(PathBuf::from("/r/n1/host/var/lib/kmm/work"))
        );
        c.working_dir = Some("/opt".into());
        assert!(spec(&c).is_err());
        c.working_dir = Some(String::new());
        assert_eq!(spec(&c).unwrap().working_dir, None);
    }

    #[test]
    fn refusals() {
        let mut unmapped = agent();
        unmapped.command = Some(vec!["/bin/sh".into()]);
        let mut no_command = agent();
        no_command.command = None;
        let mut empty_command = agent();
        empty_command.command = Some(vec![]);
        let with_source = |source: EnvVarSource| {
            let mut c = agent();
            c.env = Some(vec![EnvVar {
                name: "X".into(),
                value_from: Some(source),
                ..Default::default()
            }]);
            c
        };
        let mut env_from = agent();
        env_from.env_from = Some(vec![EnvFromSource::default()]);
        for c in [
            unmapped,
            no_command,
            empty_command,
            env_from,
            with_source(EnvVarSource {
                config_map_key_ref: Some(ConfigMapKeySelector::default()),
                ..Default::default()
            }),
            with_source(EnvVarSource {
                secret_key_ref: Some(SecretKeySelector::default()),
                ..Default::default()
            }),
            with_source(EnvVarSource {
                resource_field_ref: Some(ResourceFieldSelector::default()),
                ..Default::default()
            }),
            with_source(EnvVarSource {
                field_ref: Some(ObjectFieldSelector {
                    field_path: "status.phase".into(),
                    ..Default::default()
                }),
                ..Default::default()
            }),
        ] {
            assert!(spec(&c).is_err(), "{c:?}");
        }
        let mut empty_env_from = agent();
        empty_env_from.env_from = Some(vec![]);
        assert!(spec(&empty_env_from).is_ok());
    }
}
