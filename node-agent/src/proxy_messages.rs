//! Translation between the proxy's messages (`kmm.v1.Agent`) and the agent's own
//! types. Pure, no I/O. The generated messages' `Debug` shows credential bytes, so
//! nothing here formats them; errors name the field and the value, never a credential.

use kmm_proto::v1 as pb;

use crate::control::{AgentEvent, EventAction, Hello, Outcome};
use crate::desired::{self, DesiredModule, DesiredSnapshot, PullSecret};

/// Why one entry of a `DesiredModules` cannot be acted on.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EntryError {
    #[error("modules[{index}].key: namespace and name must both be set, got {key:?}")]
    Key { index: usize, key: String },
    #[error("modules[{index}] ({key}).load: missing (unload is false, so load is required)")]
    NoLoad { index: usize, key: String },
    #[error("modules[{index}] ({key}).load.image: must be set")]
    NoImage { index: usize, key: String },
    #[error("modules[{index}] ({key}).load.modprobe: neither moduleName nor rawArgs.load is set")]
    NothingToLoad { index: usize, key: String },
    #[error(
        "modules[{index}] ({key}).credential: load.pullCredentialId is {id:?} but no credential came with it"
    )]
    MissingCredential {
        index: usize,
        key: String,
        id: String,
    },
    #[error("modules[{index}] ({key}).credential: {problem}")]
    Credential {
        index: usize,
        key: String,
        problem: &'static str,
    },
}

impl EntryError {
    /// The module the entry names (`<namespace>/<name>`, as far as it is set).
    pub fn key(&self) -> &str {
        match self {
            Self::Key { key, .. }
            | Self::NoLoad { key, .. }
            | Self::NoImage { key, .. }
            | Self::NothingToLoad { key, .. }
            | Self::MissingCredential { key, .. }
            | Self::Credential { key, .. } => key,
        }
    }
}

/// A `DesiredModules` as the agent acts on it, and the entries it refused.
#[derive(Debug, Default)]
pub struct Translated {
    pub snapshot: DesiredSnapshot,
    pub refused: Vec<EntryError>,
}

/// `<namespace>/<name>`: the agent's key for a module.
pub fn key_string(key: &pb::ModuleKey) -> String {
    format!("{}/{}", key.namespace, key.name)
}

/// The inverse of [`key_string`]; a key without `/` is all name.
pub fn module_key(key: &str) -> pb::ModuleKey {
    let (namespace, name) = key.split_once('/').unwrap_or(("", key));
    pb::ModuleKey {
        namespace: namespace.into(),
        name: name.into(),
    }
}

fn non_empty(s: String) -> Option<String> {
    (!s.is_empty()).then_some(s)
}

fn args(args: Option<pb::ModprobeArgs>) -> Option<desired::ModprobeArgs> {
    args.filter(|a| !a.load.is_empty() || !a.unload.is_empty())
        .map(|a| desired::ModprobeArgs {
            load: a.load,
            unload: a.unload,
        })
}

fn pull_secret(
    index: usize,
    key: &str,
    credential: pb::PullCredential,
) -> Result<PullSecret, EntryError> {
    use pb::pull_credential::Content;
    let problem = |problem| EntryError::Credential {
        index,
        key: key.to_string(),
        problem,
    };
    match credential.content {
        Some(Content::DockerConfigJson(bytes)) => String::from_utf8(bytes)
            .map(PullSecret::DockerConfigJson)
            .map_err(|_| problem("dockerConfigJson is not UTF-8")),
        Some(Content::DockerCfg(bytes)) => String::from_utf8(bytes)
            .map(PullSecret::DockerCfg)
            .map_err(|_| problem("dockerCfg is not UTF-8")),
        None => Err(problem("neither dockerConfigJson nor dockerCfg is set")),
    }
}

fn module(index: usize, entry: pb::NodeModule, key: String) -> Result<DesiredModule, EntryError> {
    let Some(load) = entry.load else {
        return Err(EntryError::NoLoad { index, key });
    };
    if load.image.is_empty() {
        return Err(EntryError::NoImage { index, key });
    }
    let modprobe = load.modprobe.unwrap_or_default();
    let modprobe = desired::Modprobe {
        module_name: non_empty(modprobe.module_name),
        parameters: modprobe.parameters,
        dir_name: non_empty(modprobe.dir_name),
        args: args(modprobe.args),
        raw_args: args(modprobe.raw_args),
        firmware_path: non_empty(modprobe.firmware_path),
        modules_loading_order: modprobe.modules_loading_order,
    };
    let raw_load = modprobe
        .raw_args
        .as_ref()
        .is_some_and(|r| !r.load.is_empty());
    if modprobe.module_name.is_none() && !raw_load {
        return Err(EntryError::NothingToLoad { index, key });
    }
    let pull_secret = match entry.credential {
        Some(credential) => Some(pull_secret(index, &key, credential)?),
        None if !load.pull_credential_id.is_empty() => {
            return Err(EntryError::MissingCredential {
                index,
                key,
                id: load.pull_credential_id,
            });
        }
        None => None,
    };
    let tls = load.registry_tls.unwrap_or_default();
    Ok(DesiredModule {
        key,
        version: non_empty(load.version),
        image: load.image,
        digest: non_empty(load.digest),
        modprobe,
        in_tree_modules_to_remove: load.in_tree_modules_to_remove,
        registry_tls: desired::RegistryTls {
            insecure: tls.insecure,
            insecure_skip_tls_verify: tls.insecure_skip_tls_verify,
        },
        pull_secret,
    })
}

/// The agent's snapshot for a `DesiredModules`. An entry that cannot be acted on is
/// refused on its own (reported as a failed load) without holding up the others.
pub fn desired_snapshot(message: pb::DesiredModules) -> Translated {
    let mut translated = Translated {
        snapshot: DesiredSnapshot {
            revision: message.revision,
            ..Default::default()
        },
        refused: vec![],
    };
    for (index, entry) in message.modules.into_iter().enumerate() {
        let key = entry.key.clone().unwrap_or_default();
        let key_text = key_string(&key);
        if key.namespace.is_empty() || key.name.is_empty() {
            translated.refused.push(EntryError::Key {
                index,
                key: key_text,
            });
            continue;
        }
        if entry.unload {
            translated.snapshot.unload.push(key_text);
            continue;
        }
        match module(index, entry, key_text) {
            Ok(module) => translated.snapshot.modules.push(module),
            Err(error) => translated.refused.push(error),
        }
    }
    translated
}

/// The failed load reported for a refused entry.
pub fn refusal_event(error: &EntryError, revision: u64) -> pb::ModuleEvent {
    pb::ModuleEvent {
        key: Some(module_key(error.key())),
        action: pb::Action::Load.into(),
        outcome: pb::Outcome::Failed.into(),
        error: format!("the agent cannot act on this instruction: {error}"),
        desired_revision: revision,
        ..Default::default()
    }
}

/// The hello of a stream.
pub fn agent_hello(hello: &Hello, agent_version: &str) -> pb::AgentHello {
    pb::AgentHello {
        node_name: hello.node_name.clone(),
        boot_id: hello.boot_id.clone(),
        kernel_release: hello.kernel_release.clone(),
        agent_version: agent_version.into(),
        loaded: hello
            .loaded
            .iter()
            .map(|m| pb::LoadedModule {
                key: Some(module_key(&m.key)),
                version: m.version.clone().unwrap_or_default(),
                image_digest: m.digest.clone(),
            })
            .collect(),
    }
}

/// One event as the proxy receives it. The duration is the whole attempt: pulling and
/// extracting plus the kernel side.
pub fn module_event(event: &AgentEvent) -> pb::ModuleEvent {
    let (outcome, error) = match &event.outcome {
        Outcome::Success => (pb::Outcome::Succeeded, String::new()),
        Outcome::Failure(error) => (pb::Outcome::Failed, error.clone()),
    };
    pb::ModuleEvent {
        key: Some(module_key(&event.key)),
        action: match event.action {
            EventAction::Load => pb::Action::Load,
            EventAction::Unload => pb::Action::Unload,
        }
        .into(),
        outcome: outcome.into(),
        version: event.version.clone().unwrap_or_default(),
        image_digest: event.digest.clone().unwrap_or_default(),
        error,
        duration_ms: event.pull_ms.saturating_add(event.duration_ms),
        desired_revision: event.revision,
        kept: event
            .kept
            .iter()
            .map(|kept| pb::KeptKernelModule {
                name: kept.module.clone(),
                needed_by: kept
                    .needed_by
                    .iter()
                    .map(String::as_str)
                    .map(module_key)
                    .collect(),
            })
            .collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::control::LoadedModule;

    fn key(namespace: &str, name: &str) -> Option<pb::ModuleKey> {
        Some(pb::ModuleKey {
            namespace: namespace.into(),
            name: name.into(),
        })
    }

    fn load(image: &str) -> pb::ModuleLoad {
        pb::ModuleLoad {
            image: image.into(),
            modprobe: Some(pb::Modprobe {
                module_name: "kmm_hello".into(),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    fn entry(name: &str, load: Option<pb::ModuleLoad>) -> pb::NodeModule {
        pb::NodeModule {
            key: key("ns", name),
            load,
            credential: None,
            unload: false,
        }
    }

    #[test]
    fn a_full_load_translates_field_by_field() {
        let message = pb::DesiredModules {
            revision: 9,
            modules: vec![pb::NodeModule {
                key: key("ns", "a"),
                load: Some(pb::ModuleLoad {
                    image: "r/a:1".into(),
                    registry_tls: Some(pb::RegistryTls {
                        insecure: true,
                        insecure_skip_tls_verify: true,
                    }),
                    modprobe: Some(pb::Modprobe {
                        module_name: "a".into(),
                        parameters: vec!["x=1".into()],
                        dir_name: "/lib".into(),
                        args: Some(pb::ModprobeArgs {
                            load: vec!["-v".into()],
                            unload: vec![],
                        }),
                        raw_args: Some(pb::ModprobeArgs::default()),
                        firmware_path: "/firmware".into(),
                        modules_loading_order: vec!["a".into(), "b".into()],
                    }),
                    in_tree_modules_to_remove: vec!["old".into()],
                    version: "2".into(),
                    pull_credential_id: "cred".into(),
                    digest: "sha256:0123".into(),
                }),
                credential: Some(pb::PullCredential {
                    id: "cred".into(),
                    content: Some(pb::pull_credential::Content::DockerConfigJson(
                        br#"{"auths":{}}"#.to_vec(),
                    )),
                }),
                unload: false,
            }],
        };
        let t = desired_snapshot(message);
        assert!(t.refused.is_empty(), "{:?}", t.refused);
        assert_eq!(t.snapshot.revision, 9);
        assert!(t.snapshot.unload.is_empty());
        let m = &t.snapshot.modules[0];
        assert_eq!(m.key, "ns/a");
        assert_eq!(m.version.as_deref(), Some("2"));
        assert_eq!(m.image, "r/a:1");
        assert_eq!(m.digest.as_deref(), Some("sha256:0123"), "the hub's pin");
        assert!(m.registry_tls.insecure && m.registry_tls.insecure_skip_tls_verify);
        assert_eq!(m.modprobe.module_name.as_deref(), Some("a"));
        assert_eq!(m.modprobe.parameters, ["x=1"]);
        assert_eq!(m.modprobe.dir_name(), "/lib");
        assert_eq!(m.modprobe.args.as_ref().unwrap().load, ["-v"]);
        assert_eq!(m.modprobe.raw_args, None, "empty raw args are no raw args");
        assert_eq!(m.modprobe.firmware_path.as_deref(), Some("/firmware"));
        assert_eq!(m.load_order(), ["b", "a"]);
        assert_eq!(m.in_tree_modules_to_remove, ["old"]);
        assert_eq!(
            m.pull_secret,
            Some(PullSecret::DockerConfigJson(r#"{"auths":{}}"#.into()))
        );
    }

    #[test]
    fn empty_strings_are_unset() {
        let t = desired_snapshot(pb::DesiredModules {
            revision: 1,
            modules: vec![entry("a", Some(load("r/a:1")))],
        });
        let m = &t.snapshot.modules[0];
        assert_eq!(m.version, None);
        assert_eq!(m.modprobe.dir_name, None);
        assert_eq!(m.modprobe.dir_name(), "/opt");
        assert_eq!(m.modprobe.firmware_path, None);
        assert_eq!(m.modprobe.args, None);
        assert!(!m.registry_tls.insecure);
        assert_eq!(m.pull_secret, None);
    }

    #[test]
    fn unload_entries_need_only_a_key() {
        let mut gone = entry("gone", None);
        gone.unload = true;
        let mut both = entry("both", Some(load("r/b:1")));
        both.unload = true;
        let t = desired_snapshot(pb::DesiredModules {
            revision: 3,
            modules: vec![gone, both, entry("kept", Some(load("r/k:1")))],
        });
        assert!(t.refused.is_empty(), "{:?}", t.refused);
        assert_eq!(t.snapshot.unload, ["ns/gone", "ns/both"]);
        assert_eq!(t.snapshot.modules.len(), 1);
        assert_eq!(t.snapshot.modules[0].key, "ns/kept");
    }

    #[test]
    fn bad_entries_are_refused_one_by_one_naming_field_and_value() {
        let mut no_key = entry("x", Some(load("r/x:1")));
        no_key.key = key("", "x");
        let mut no_image = load("");
        no_image.image.clear();
        let mut nothing = load("r/n:1");
        nothing.modprobe = None;
        let mut needs_credential = load("r/c:1");
        needs_credential.pull_credential_id = "pull".into();
        let mut empty_credential = entry("e", Some(load("r/e:1")));
        empty_credential.credential = Some(pb::PullCredential {
            id: "pull".into(),
            content: None,
        });
        let mut binary = entry("b", Some(load("r/b:1")));
        binary.credential = Some(pb::PullCredential {
            id: "pull".into(),
            content: Some(pb::pull_credential::Content::DockerCfg(vec![
                0xff, 0xfe, b's', b'e', b'c',
            ])),
        });
        let mut raw = load("r/raw:1");
        raw.modprobe = Some(pb::Modprobe {
            raw_args: Some(pb::ModprobeArgs {
                load: vec!["raw".into()],
                unload: vec![],
            }),
            ..Default::default()
        });
        let t = desired_snapshot(pb::DesiredModules {
            revision: 4,
            modules: vec![
                no_key,
                entry("none", None),
                entry("img", Some(no_image)),
                entry("n", Some(nothing)),
                entry("c", Some(needs_credential)),
                empty_credential,
                binary,
                entry("raw", Some(raw)),
                pb::NodeModule::default(),
            ],
        });
        let texts: Vec<String> = t.refused.iter().map(ToString::to_string).collect();
        assert_eq!(
            texts,
            [
                r#"modules[0].key: namespace and name must both be set, got "/x""#,
                "modules[1] (ns/none).load: missing (unload is false, so load is required)",
                "modules[2] (ns/img).load.image: must be set",
                "modules[3] (ns/n).load.modprobe: neither moduleName nor rawArgs.load is set",
                r#"modules[4] (ns/c).credential: load.pullCredentialId is "pull" but no credential came with it"#,
                "modules[5] (ns/e).credential: neither dockerConfigJson nor dockerCfg is set",
                "modules[6] (ns/b).credential: dockerCfg is not UTF-8",
                r#"modules[8].key: namespace and name must both be set, got "/""#,
            ]
        );
        assert_eq!(t.snapshot.modules.len(), 1, "raw args alone can load");
        assert_eq!(t.refused[1].key(), "ns/none");
        let event = refusal_event(&t.refused[2], 4);
        assert_eq!(event.key, key("ns", "img"));
        assert_eq!(event.action(), pb::Action::Load);
        assert_eq!(event.outcome(), pb::Outcome::Failed);
        assert_eq!(event.desired_revision, 4);
        assert!(
            event.error.ends_with("load.image: must be set"),
            "{}",
            event.error
        );
    }

    #[test]
    fn keys_round_trip() {
        assert_eq!(key_string(&module_key("ns/a")), "ns/a");
        assert_eq!(module_key("ns/a/b"), key("ns", "a/b").unwrap());
        assert_eq!(module_key("bare"), key("", "bare").unwrap());
    }

    #[test]
    fn hello_carries_what_is_loaded() {
        let hello = Hello {
            node_name: "node-1".into(),
            boot_id: "boot".into(),
            kernel_release: "6.1.0-1-amd64".into(),
            loaded: vec![
                LoadedModule {
                    key: "ns/a".into(),
                    version: Some("1".into()),
                    image: "r/a:1".into(),
                    digest: "sha256:aa".into(),
                },
                LoadedModule {
                    key: "ns/b".into(),
                    version: None,
                    image: "r/b:1".into(),
                    digest: "sha256:bb".into(),
                },
            ],
        };
        let pb = agent_hello(&hello, "0.1.0");
        assert_eq!(pb.node_name, "node-1");
        assert_eq!(pb.boot_id, "boot");
        assert_eq!(pb.kernel_release, "6.1.0-1-amd64");
        assert_eq!(pb.agent_version, "0.1.0");
        assert_eq!(
            pb.loaded,
            [
                pb::LoadedModule {
                    key: key("ns", "a"),
                    version: "1".into(),
                    image_digest: "sha256:aa".into()
                },
                pb::LoadedModule {
                    key: key("ns", "b"),
                    version: String::new(),
                    image_digest: "sha256:bb".into()
                },
            ]
        );
    }

    #[test]
    fn events_carry_outcome_error_duration_and_revision() {
        let mut event = AgentEvent {
            key: "ns/a".into(),
            version: Some("2".into()),
            action: EventAction::Load,
            outcome: Outcome::Failure("modprobe: ERROR: the full text".into()),
            image: "r/a:2".into(),
            digest: Some("sha256:aa".into()),
            pull_ms: 30,
            duration_ms: 12,
            at_unix_ms: 5,
            revision: 17,
            kept: vec![],
            timing: Default::default(),
        };
        let pb = module_event(&event);
        assert_eq!(pb.key, key("ns", "a"));
        assert_eq!(pb.action(), pb::Action::Load);
        assert_eq!(pb.outcome(), pb::Outcome::Failed);
        assert_eq!(pb.version, "2");
        assert_eq!(pb.image_digest, "sha256:aa");
        assert_eq!(pb.error, "modprobe: ERROR: the full text");
        assert_eq!(pb.duration_ms, 42);
        assert_eq!(pb.desired_revision, 17);

        event.action = EventAction::Unload;
        event.outcome = Outcome::Success;
        event.digest = None;
        event.version = None;
        let pb = module_event(&event);
        assert_eq!(pb.action(), pb::Action::Unload);
        assert_eq!(pb.outcome(), pb::Outcome::Succeeded);
        assert!(pb.error.is_empty() && pb.image_digest.is_empty() && pb.version.is_empty());
        assert!(pb.kept.is_empty());
    }

    #[test]
    fn an_unload_names_the_kernel_modules_it_kept_and_the_modules_needing_them() {
        let event = AgentEvent {
            key: "kmm-ops/second".into(),
            version: Some("1".into()),
            action: EventAction::Unload,
            outcome: Outcome::Success,
            image: "r/hello:1".into(),
            digest: Some("sha256:aa".into()),
            pull_ms: 0,
            duration_ms: 3,
            at_unix_ms: 5,
            revision: 2,
            kept: vec![crate::control::Kept {
                module: "kmm_hello".into(),
                needed_by: vec!["kmm-ops/kmm-hello".into()],
            }],
            timing: Default::default(),
        };
        assert_eq!(
            module_event(&event).kept,
            [pb::KeptKernelModule {
                name: "kmm_hello".into(),
                needed_by: vec![key("kmm-ops", "kmm-hello").unwrap()],
            }]
        );
    }
}
