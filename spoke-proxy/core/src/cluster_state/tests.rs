use super::*;
use kmm_proto::REASON_KERNEL_MODULE_SHARED;
use kmm_proto::v1::{
    Action, KeptKernelModule, KernelTarget, LoadedModule, ModuleKey, ModuleNodeStatus, Outcome,
    PullCredential, Unresolved, kernel_target::Target, module_intent, pull_credential::Content,
};
use std::sync::Arc;

const NODES: [&str; 2] = ["a", "b"];

fn key(name: &str) -> ModuleKey {
    ModuleKey {
        namespace: "ns".into(),
        name: name.into(),
    }
}

fn id(name: &str) -> ModuleId {
    ModuleId::from_key(Some(&key(name)))
}

fn node(name: &str, kernel: &str, role: &str) -> NodeFacts {
    NodeFacts {
        name: name.into(),
        uid: format!("uid-{name}"),
        kernel: kernel.into(),
        boot_id: "boot".into(),
        labels: [("role".to_string(), role.to_string())].into(),
        taints: vec![],
    }
}

fn load(kernel: &str, version: &str) -> ModuleLoad {
    ModuleLoad {
        image: format!("reg/m:{kernel}-{version}"),
        version: version.into(),
        pull_credential_id: "pull".into(),
        ..Default::default()
    }
}

fn intent(name: &str, version: &str) -> ModuleIntent {
    ModuleIntent {
        key: Some(key(name)),
        generation: 1,
        pin_generation: 0,
        node_selector: [("role".to_string(), "worker".to_string())].into(),
        tolerations: vec![],
        kernels: vec![
            KernelTarget {
                kernel: "6.1".into(),
                target: Some(Target::Load(load("6.1", version))),
            },
            KernelTarget {
                kernel: "6.2".into(),
                target: Some(Target::Load(load("6.2", version))),
            },
            KernelTarget {
                kernel: "5.14".into(),
                target: Some(Target::Unresolved(Unresolved {
                    reason: "NoKernelMapping".into(),
                    message: "nothing for 5.14".into(),
                })),
            },
        ],
        unload: false,
        max_unavailable: None,
        device_plugin: None,
        device_plugin_only: false,
    }
}

fn snapshot(revision: u64, modules: Vec<ModuleIntent>) -> IntentSnapshot {
    IntentSnapshot {
        revision,
        modules,
        credentials: vec![
            PullCredential {
                id: "pull".into(),
                content: Some(Content::DockerConfigJson(b"{\"auths\":{}}".to_vec())),
            },
            PullCredential {
                id: "unused".into(),
                content: Some(Content::DockerConfigJson(b"{}".to_vec())),
            },
        ],
        ..IntentSnapshot::default()
    }
}

/// The hello of an agent running the kernel every test node's kubelet reports first.
fn hello(node: &str, loaded: &[(&str, &str)]) -> AgentHello {
    hello_running(node, "6.1", loaded)
}

fn hello_running(node: &str, kernel: &str, loaded: &[(&str, &str)]) -> AgentHello {
    AgentHello {
        node_name: node.into(),
        boot_id: "boot".into(),
        kernel_release: kernel.into(),
        agent_version: "test".into(),
        loaded: loaded
            .iter()
            .map(|(name, version)| LoadedModule {
                key: Some(key(name)),
                version: (*version).into(),
                image_digest: "sha256:aa".into(),
            })
            .collect(),
    }
}

fn event(name: &str, action: Action, outcome: Outcome, revision: u64) -> ModuleEvent {
    ModuleEvent {
        key: Some(key(name)),
        action: action.into(),
        outcome: outcome.into(),
        version: "v1".into(),
        image_digest: "sha256:aa".into(),
        error: if outcome == Outcome::Failed {
            "insmod: ERROR".into()
        } else {
            String::new()
        },
        duration_ms: 1,
        desired_revision: revision,
        kept: Vec::new(),
    }
}

fn statuses(s: &ClusterState) -> BTreeMap<StatusKey, ModuleNodeStatus> {
    s.all_statuses()
        .into_iter()
        .flat_map(|(node, statuses)| {
            statuses
                .into_iter()
                .map(move |(id, status)| ((id, node.clone()), status))
        })
        .collect()
}

fn state_of(s: &ClusterState, name: &str, node: &str) -> Option<ModuleState> {
    statuses(s)
        .get(&(id(name), node.to_string()))
        .map(|st| ModuleState::try_from(st.state).unwrap())
}

fn cluster() -> ClusterState {
    let mut s = ClusterState::new(1000);
    s.replace_nodes(vec![node("a", "6.1", "worker"), node("b", "6.1", "infra")]);
    s
}

#[test]
fn no_intents_means_no_work_but_an_inventory() {
    assert!(!ClusterState::new(1).nodes_listed());
    let s = cluster();
    assert!(s.nodes_listed());
    assert_eq!(s.desired_modules("a"), DesiredModules::default());
    assert!(statuses(&s).is_empty());
    assert_eq!(s.inventory().kernels.len(), 1);
    assert_eq!(s.inventory().kernels[0].release, "6.1");
    assert_eq!(s.inventory().revision, 1001);
    assert_eq!(s.applied_intent_revision(), 0);
    assert!(s.applied_intent_digest().is_empty(), "nothing held");
}

#[test]
fn the_digest_named_in_the_hello_is_of_the_intents_held_after_deltas() {
    let mut s = cluster();
    let whole = snapshot(3, vec![intent("m", "v1"), intent("n", "v1")]);
    s.set_intents(whole.clone());
    let digest = |snapshot: &IntentSnapshot| {
        kmm_proto::snapshot_digest(&snapshot.modules, &snapshot.credentials).to_vec()
    };
    assert_eq!(s.applied_intent_digest(), digest(&whole));
    let next = snapshot(4, vec![intent("m", "v2"), intent("n", "v1")]);
    s.set_intents(kmm_proto::snapshot_delta(
        &whole.modules,
        &next.modules,
        4,
        &next.credentials,
    ));
    assert_eq!(s.applied_intent_revision(), 4);
    assert_eq!(s.applied_intent_digest(), digest(&next));
}

#[test]
fn each_node_gets_only_its_own_work_and_credentials() {
    let mut s = cluster();
    s.set_intents(snapshot(3, vec![intent("m", "v1")]));
    assert_eq!(s.applied_intent_revision(), 3);
    let a = s.desired_modules("a");
    assert_eq!(a.modules.len(), 1);
    let m = &a.modules[0];
    assert_eq!(m.load.as_ref().unwrap().image, "reg/m:6.1-v1");
    assert_eq!(m.credential.as_ref().unwrap().id, "pull");
    assert!(!m.unload);
    // b is not selected and never had the module: nothing, not even an unload.
    assert!(s.desired_modules("b").modules.is_empty());
    assert!(s.desired_modules("b").revision > 0);
    assert_eq!(state_of(&s, "m", "a"), Some(ModuleState::Pending));
    assert_eq!(state_of(&s, "m", "b"), None);
    assert_eq!(s.label_patch("a"), None, "nothing proven yet");
}

#[test]
fn nodes_given_the_same_load_share_one_copy_until_nobody_holds_it() {
    let mut s = ClusterState::new(1000);
    s.replace_nodes(vec![
        node("a", "6.1", "worker"),
        node("b", "6.1", "worker"),
        node("c", "6.2", "worker"),
    ]);
    s.set_intents(snapshot(1, vec![intent("m", "v1")]));
    let given = |s: &ClusterState, node: &str| s.work[node].modules[0].clone();
    let (a, b, c) = (given(&s, "a"), given(&s, "b"), given(&s, "c"));
    let load = |g: &Given| g.load.clone().unwrap();
    assert!(Arc::ptr_eq(&load(&a), &load(&b)), "one copy for 6.1");
    assert!(!Arc::ptr_eq(&load(&a), &load(&c)), "6.2 has its own");
    assert!(Arc::ptr_eq(&a.id.name, &c.id.name), "one identity");
    let credential = |g: &Given| g.credential.clone().unwrap();
    assert!(Arc::ptr_eq(&credential(&a), &credential(&c)));
    assert_eq!(s.shared.loads_held(), 2);
    drop((a, b, c));

    s.set_intents(snapshot(2, vec![intent("m", "v2")]));
    assert_eq!(load(&given(&s, "a")).version, "v2");
    assert_eq!(s.shared.loads_held(), 2, "v1's copies are forgotten");
    let mut upgraded = node("c", "6.1", "worker");
    upgraded.boot_id = "rebooted".into();
    s.upsert_node(upgraded);
    assert!(Arc::ptr_eq(&load(&given(&s, "a")), &load(&given(&s, "c"))));
    assert_eq!(s.shared.loads_held(), 1, "nobody runs 6.2 any more");
}

#[test]
fn labels_follow_proof_and_confirmed_unload() {
    let mut s = cluster();
    s.set_intents(snapshot(1, vec![intent("m", "v1")]));
    s.agent_hello("a", &hello("a", &[]));
    let rev = s.desired_modules("a").revision;
    assert_eq!(state_of(&s, "m", "a"), Some(ModuleState::Pending));
    assert_eq!(
        s.label_patch("a"),
        None,
        "labels absent and not loaded: nothing to do"
    );

    s.agent_event("a", &event("m", Action::Load, Outcome::Succeeded, rev))
        .unwrap();
    assert_eq!(state_of(&s, "m", "a"), Some(ModuleState::Loaded));
    let patch = s.label_patch("a").unwrap();
    assert_eq!(
        patch["metadata"]["labels"]["kmm.node.kubernetes.io/ns.m.version.ready"],
        "v1"
    );

    // Deselect node a: explicit unload, labels stay until the agent confirms.
    s.upsert_node(labelled_m_v1(node("a", "6.1", "infra")));
    let desired = s.desired_modules("a");
    assert_eq!(desired.modules.len(), 1);
    assert!(desired.modules[0].unload);
    assert!(desired.modules[0].credential.is_none());
    assert_eq!(state_of(&s, "m", "a"), Some(ModuleState::Loaded));
    assert_eq!(s.label_patch("a"), None);

    s.agent_event(
        "a",
        &event("m", Action::Unload, Outcome::Succeeded, desired.revision),
    )
    .unwrap();
    assert_eq!(state_of(&s, "m", "a"), Some(ModuleState::Unloaded));
    let patch = s.label_patch("a").unwrap();
    assert!(patch["metadata"]["labels"]["kmm.node.kubernetes.io/ns.m.ready"].is_null());
}

/// `facts` carrying module m's labels at version v1, as the patcher leaves them.
fn labelled_m_v1(mut facts: NodeFacts) -> NodeFacts {
    facts
        .labels
        .insert("kmm.node.kubernetes.io/ns.m.ready".into(), String::new());
    facts.labels.insert(
        "kmm.node.kubernetes.io/ns.m.version.ready".into(),
        "v1".into(),
    );
    facts
}

/// The hub forgets a module once every node reported it unloaded, which can come
/// before the label patcher removed a node's labels: they still go, on the agent's
/// word, and a forgotten module's labels stay where its agent still has it loaded.
#[test]
fn labels_of_a_module_forgotten_right_after_its_unload_still_go() {
    let mut s = cluster();
    s.set_intents(snapshot(1, vec![intent("m", "v1")]));
    s.agent_hello("a", &hello("a", &[]));
    let rev = s.desired_modules("a").revision;
    s.agent_event("a", &event("m", Action::Load, Outcome::Succeeded, rev))
        .unwrap();
    // m was never sent to b (not selected): its agent says so only in its hello.
    s.agent_hello("b", &hello("b", &[("m", "v1")]));
    for node in ["a", "b"] {
        s.upsert_node(labelled_m_v1(s.nodes[node].clone()));
    }
    let mut unloading = intent("m", "v1");
    unloading.unload = true;
    s.set_intents(snapshot(2, vec![unloading]));
    let rev = s.desired_modules("a").revision;
    s.agent_event("a", &event("m", Action::Unload, Outcome::Succeeded, rev))
        .unwrap();
    // The module leaves the snapshot before the patcher looked at node a.
    s.set_intents(snapshot(3, vec![]));
    let patch = s.label_patch("a").expect("the labels of a go");
    assert!(patch["metadata"]["labels"]["kmm.node.kubernetes.io/ns.m.ready"].is_null());
    assert!(patch["metadata"]["labels"]["kmm.node.kubernetes.io/ns.m.version.ready"].is_null());
    assert_eq!(
        s.label_patch("b"),
        None,
        "b's agent still has it loaded: no unload on silence, labels stay"
    );
}

#[test]
fn events_of_modules_never_sent_to_the_node_are_refused() {
    let mut s = cluster();
    s.set_intents(snapshot(1, vec![intent("m", "v1")]));
    s.agent_hello("a", &hello("a", &[]));
    s.agent_hello("b", &hello("b", &[]));
    let before = s.agent_bytes();
    for i in 0..1_000 {
        let stranger = ModuleEvent {
            error: "x".repeat(1 << 20),
            ..event(&format!("x{i}"), Action::Load, Outcome::Failed, 1)
        };
        assert!(s.agent_event("a", &stranger).is_err());
    }
    // b is not selected: m was never sent to it.
    assert!(
        s.agent_event("b", &event("m", Action::Load, Outcome::Failed, 1))
            .is_err()
    );
    assert_eq!(s.agent_bytes(), before);
    assert_eq!(state_of(&s, "x1", "a"), None);
}

#[test]
fn success_for_an_older_revision_does_not_count() {
    let mut s = cluster();
    s.set_intents(snapshot(1, vec![intent("m", "v1")]));
    let old = s.desired_modules("a").revision;
    s.set_intents(snapshot(2, vec![intent("m", "v2")]));
    let new = s.desired_modules("a").revision;
    assert!(new > old);
    let mut ev = event("m", Action::Load, Outcome::Succeeded, old);
    ev.version = "v2".into();
    s.agent_event("a", &ev).unwrap();
    assert_eq!(state_of(&s, "m", "a"), Some(ModuleState::Pending));
    ev.desired_revision = new;
    s.agent_event("a", &ev).unwrap();
    assert_eq!(state_of(&s, "m", "a"), Some(ModuleState::Loaded));
}

#[test]
fn credential_change_alone_keeps_the_module_loaded() {
    let mut s = cluster();
    s.set_intents(snapshot(1, vec![intent("m", "v1")]));
    let rev = s.desired_modules("a").revision;
    s.agent_event("a", &event("m", Action::Load, Outcome::Succeeded, rev))
        .unwrap();
    let mut rotated = snapshot(2, vec![intent("m", "v1")]);
    rotated.credentials[0].content = Some(Content::DockerConfigJson(b"{\"new\":1}".to_vec()));
    s.set_intents(rotated);
    assert!(
        s.desired_modules("a").revision > rev,
        "the agent gets the new credential"
    );
    assert_eq!(state_of(&s, "m", "a"), Some(ModuleState::Loaded));
}

/// A cluster pull Secret `kmm/cluster-pull`: usable with `config`, else missing.
fn cluster_secret(config: Option<&str>) -> ClusterPullSecret {
    use crate::cluster_pull_secret::SecretRef;
    use k8s_openapi::ByteString;
    use k8s_openapi::api::core::v1::Secret;
    let secret = config.map(|config| Secret {
        data: Some([(".dockerconfigjson".to_owned(), ByteString(config.into()))].into()),
        ..Secret::default()
    });
    let reference = SecretRef {
        namespace: "kmm".into(),
        name: "cluster-pull".into(),
    };
    ClusterPullSecret::read(&reference, secret.as_ref())
}

const CLUSTER_CONFIG: &str = r#"{"auths":{"reg":{"auth":"dTpw"}}}"#;

/// Intent `m` without the hub's credential (no imageRepoSecret), `h` with it.
fn without_and_with_the_hubs_credential() -> IntentSnapshot {
    let mut unsecured = intent("m", "v1");
    for target in &mut unsecured.kernels {
        if let Some(Target::Load(load)) = &mut target.target {
            load.pull_credential_id.clear();
        }
    }
    snapshot(1, vec![unsecured, intent("h", "v1")])
}

fn credential_of(s: &ClusterState, node: &str, name: &str) -> Option<PullCredential> {
    s.desired_modules(node)
        .modules
        .into_iter()
        .find(|m| m.key == Some(key(name)))
        .and_then(|m| m.credential)
}

#[test]
fn the_clusters_pull_secret_goes_with_the_loads_the_hub_sent_without_one() {
    let mut s = cluster();
    s.set_intents(without_and_with_the_hubs_credential());
    assert_eq!(
        credential_of(&s, "a", "m"),
        None,
        "no cluster Secret: as today"
    );
    assert!(s.set_cluster_pull_secret(cluster_secret(Some(CLUSTER_CONFIG))));
    assert!(!s.set_cluster_pull_secret(cluster_secret(Some(CLUSTER_CONFIG))));
    let cluster = credential_of(&s, "a", "m").expect("the cluster's credential");
    assert_eq!(cluster.id, "cluster:kmm/cluster-pull");
    assert_eq!(
        cluster.content,
        Some(Content::DockerConfigJson(CLUSTER_CONFIG.into()))
    );
    let m = s.desired_modules("a").modules;
    assert_eq!(
        m.iter()
            .find(|m| m.key == Some(key("m")))
            .and_then(|m| m.load.as_ref())
            .map(|l| l.pull_credential_id.as_str()),
        Some("cluster:kmm/cluster-pull"),
        "the load names the credential it comes with"
    );
    assert_eq!(
        credential_of(&s, "a", "h").map(|c| c.id),
        Some("pull".to_owned()),
        "the module's own imageRepoSecret wins"
    );
    assert!(
        s.desired_modules("b").modules.is_empty(),
        "b is not selected"
    );
}

#[test]
fn a_missing_cluster_pull_secret_fails_its_loads_by_name_and_keeps_what_runs() {
    let mut s = cluster();
    s.set_cluster_pull_secret(cluster_secret(Some(CLUSTER_CONFIG)));
    s.set_intents(without_and_with_the_hubs_credential());
    s.agent_hello("a", &hello("a", &[]));
    let rev = s.desired_modules("a").revision;
    for name in ["m", "h"] {
        s.agent_event("a", &event(name, Action::Load, Outcome::Succeeded, rev))
            .unwrap();
    }
    assert_eq!(state_of(&s, "m", "a"), Some(ModuleState::Loaded));

    // Deleted (or rotated by delete and create): m waits, saying why; h goes on.
    s.set_cluster_pull_secret(cluster_secret(None));
    let status = &statuses(&s)[&(id("m"), "a".to_owned())];
    assert_eq!(status.state(), ModuleState::Failed);
    assert_eq!(status.reason, "ClusterPullSecretNotFound");
    assert!(
        status.message.contains("kmm/cluster-pull") && status.message.contains("does not exist"),
        "{}",
        status.message
    );
    let desired = s.desired_modules("a");
    assert!(
        !desired.modules.iter().any(|m| m.key == Some(key("m"))),
        "nothing to load, and no unload: the module stays loaded"
    );
    assert_eq!(state_of(&s, "h", "a"), Some(ModuleState::Loaded));
    let labels = s.label_patch("a").expect("the test node lacks the labels");
    assert_eq!(
        labels["metadata"]["labels"]["kmm.node.kubernetes.io/ns.m.ready"], "",
        "the ready label stays"
    );

    // Back with other content: the agent gets it, and nothing is reloaded.
    s.set_cluster_pull_secret(cluster_secret(Some(r#"{"auths":{"reg":{"auth":"djpx"}}}"#)));
    assert_eq!(state_of(&s, "m", "a"), Some(ModuleState::Loaded));
    assert!(credential_of(&s, "a", "m").is_some());
}

#[test]
fn kernel_change_switches_the_image_and_waits_for_proof() {
    let mut s = cluster();
    s.set_intents(snapshot(1, vec![intent("m", "v1")]));
    let rev = s.desired_modules("a").revision;
    s.agent_event("a", &event("m", Action::Load, Outcome::Succeeded, rev))
        .unwrap();
    s.upsert_node(node("a", "6.2", "worker"));
    let desired = s.desired_modules("a");
    assert_eq!(
        desired.modules[0].load.as_ref().unwrap().image,
        "reg/m:6.2-v1"
    );
    assert!(!desired.modules[0].unload);
    assert_eq!(state_of(&s, "m", "a"), Some(ModuleState::Pending));
    // The rebooted node's agent has nothing loaded: labels go.
    s.agent_hello("a", &hello("a", &[]));
    assert!(s.label_patch("a").is_none(), "node a carries no labels yet");
}

/// Three workers running `m` v1, proven by their agents' hellos.
fn upgrading_cluster(max_unavailable: Option<module_intent::MaxUnavailable>) -> ClusterState {
    let mut s = ClusterState::new(1000);
    s.replace_nodes(["x", "y", "z"].map(|n| node(n, "6.1", "worker")).to_vec());
    s.set_intents(snapshot(1, vec![intent("m", "v1")]));
    for n in ["x", "y", "z"] {
        s.agent_hello(n, &hello(n, &[("m", "v1")]));
    }
    let mut v2 = intent("m", "v2");
    v2.max_unavailable = max_unavailable;
    s.set_intents(snapshot(2, vec![v2]));
    s
}

fn desired_version(s: &ClusterState, node: &str) -> Option<String> {
    s.desired_modules(node)
        .modules
        .first()
        .and_then(|m| m.load.as_ref())
        .map(|l| l.version.clone())
}

/// The agent of `node` unloads v1 and loads `version`, as a version change does.
fn upgrade(s: &mut ClusterState, node: &str, version: &str) {
    let revision = s.desired_modules(node).revision;
    s.agent_event(
        node,
        &event("m", Action::Unload, Outcome::Succeeded, revision),
    )
    .unwrap();
    let mut loaded = event("m", Action::Load, Outcome::Succeeded, revision);
    loaded.version = version.into();
    s.agent_event(node, &loaded).unwrap();
}

#[test]
fn a_version_change_moves_one_node_at_a_time_with_max_unavailable_one() {
    let one = Some(module_intent::MaxUnavailable::MaxUnavailableNodes(1));
    let mut s = upgrading_cluster(one);
    let versions = |s: &ClusterState| ["x", "y", "z"].map(|n| desired_version(s, n));
    let v = |v: &str| Some(v.to_owned());
    assert_eq!(versions(&s), [v("v2"), v("v1"), v("v1")]);
    let held = statuses(&s)[&(id("m"), "y".to_string())].clone();
    assert_eq!(held.reason, node_upgrade::REASON_AWAITING_TURN);
    assert_eq!(held.loaded_version, "v1");
    assert_eq!(ModuleState::try_from(held.state), Ok(ModuleState::Pending));
    // A held node keeps its labels, naming the version it runs.
    let patch = s.label_patch("y").expect("labels to set");
    assert_eq!(
        patch["metadata"]["labels"]["kmm.node.kubernetes.io/ns.m.version.ready"],
        "v1"
    );

    let revision = s.desired_modules("x").revision;
    s.agent_event(
        "x",
        &event("m", Action::Unload, Outcome::Succeeded, revision),
    )
    .unwrap();
    assert_eq!(versions(&s), [v("v2"), v("v1"), v("v1")], "x is still down");
    let mut loaded = event("m", Action::Load, Outcome::Succeeded, revision);
    loaded.version = "v2".into();
    s.agent_event("x", &loaded).unwrap();
    assert_eq!(versions(&s), [v("v2"), v("v2"), v("v1")]);
    upgrade(&mut s, "y", "v2");
    assert_eq!(versions(&s), [v("v2"), v("v2"), v("v2")]);
    upgrade(&mut s, "z", "v2");
    for n in ["x", "y", "z"] {
        assert_eq!(state_of(&s, "m", n), Some(ModuleState::Loaded), "{n}");
    }
}

#[test]
fn a_failed_node_counts_against_max_unavailable() {
    let one = Some(module_intent::MaxUnavailable::MaxUnavailableNodes(1));
    let mut s = upgrading_cluster(one);
    let revision = s.desired_modules("x").revision;
    s.agent_event("x", &event("m", Action::Load, Outcome::Failed, revision))
        .unwrap();
    assert_eq!(desired_version(&s, "y").as_deref(), Some("v1"));
    assert_eq!(desired_version(&s, "z").as_deref(), Some("v1"));
}

#[test]
fn a_percentage_rounds_up_and_no_limit_moves_every_node() {
    let half = Some(module_intent::MaxUnavailable::MaxUnavailablePercent(50));
    let s = upgrading_cluster(half);
    let moving = ["x", "y", "z"]
        .iter()
        .filter(|n| desired_version(&s, n).as_deref() == Some("v2"))
        .count();
    assert_eq!(moving, 2);
    let s = upgrading_cluster(None);
    for n in ["x", "y", "z"] {
        assert_eq!(desired_version(&s, n).as_deref(), Some("v2"), "{n}");
    }
}

#[test]
fn the_version_module_label_pins_and_releases_a_node() {
    let pinned = |version: &str| {
        let mut y = node("y", "6.1", "worker");
        y.labels
            .insert(version_module_label("ns", "m"), version.to_owned());
        y
    };
    let mut s = ClusterState::new(1000);
    s.replace_nodes(vec![node("x", "6.1", "worker"), pinned("v1")]);
    s.set_intents(snapshot(1, vec![intent("m", "v1")]));
    for n in ["x", "y"] {
        s.agent_hello(n, &hello(n, &[("m", "v1")]));
    }
    s.set_intents(snapshot(2, vec![intent("m", "v2")]));
    assert_eq!(desired_version(&s, "x").as_deref(), Some("v2"));
    assert_eq!(desired_version(&s, "y").as_deref(), Some("v1"));
    assert_eq!(
        statuses(&s)[&(id("m"), "y".to_string())].reason,
        node_upgrade::REASON_VERSION_PINNED
    );
    s.upsert_node(pinned("v2"));
    assert_eq!(desired_version(&s, "y").as_deref(), Some("v2"));
}

#[test]
fn a_restarted_proxy_moves_no_more_nodes_than_allowed() {
    let mut s = ClusterState::new(2000);
    s.replace_nodes(["x", "y", "z"].map(|n| node(n, "6.1", "worker")).to_vec());
    let mut v2 = intent("m", "v2");
    v2.max_unavailable = Some(module_intent::MaxUnavailable::MaxUnavailableNodes(1));
    s.set_intents(snapshot(2, vec![v2]));
    for n in ["x", "y", "z"] {
        s.agent_hello(n, &hello(n, &[("m", "v1")]));
    }
    let moving: Vec<&str> = ["x", "y", "z"]
        .into_iter()
        .filter(|n| desired_version(&s, n).as_deref() == Some("v2"))
        .collect();
    assert_eq!(moving.len(), 1, "{moving:?}");
    // The held nodes were never given v1 by this proxy: nothing is sent for them, and
    // their agents leave v1 loaded.
    let held = ["x", "y", "z"]
        .into_iter()
        .find(|n| !moving.contains(n))
        .unwrap();
    assert!(s.desired_modules(held).modules.is_empty());
    assert_eq!(state_of(&s, "m", held), Some(ModuleState::Pending));
}

#[test]
fn a_kernel_no_mapping_matches_is_skipped_and_never_labelled() {
    let mut s = cluster();
    s.upsert_node(node("a", "5.14", "worker"));
    s.set_intents(snapshot(1, vec![intent("m", "v1")]));
    assert!(s.desired_modules("a").modules.is_empty());
    let st = &statuses(&s)[&(id("m"), "a".to_string())];
    assert_eq!(st.state, ModuleState::Skipped as i32);
    assert_eq!(st.reason, "NoKernelMapping");
    assert_eq!(st.kernel, "5.14");
    s.agent_hello("a", &hello("a", &[]));
    assert_eq!(s.label_patch("a"), None);
}

#[test]
fn an_agent_on_another_kernel_gets_nothing_loaded_and_is_reported() {
    let mut s = cluster();
    s.set_intents(snapshot(1, vec![intent("m", "v1")]));
    // Loaded before: a mismatch leaves it as it is, never unloads it.
    s.agent_hello("a", &hello_running("a", "6.2", &[("m", "v1")]));
    assert!(s.desired_modules("a").modules.is_empty());
    let st = &statuses(&s)[&(id("m"), "a".to_string())];
    assert_eq!(ModuleState::try_from(st.state), Ok(ModuleState::Failed));
    assert_eq!(st.reason, "KernelMismatch");
    assert!(
        st.message.contains("\"6.1\"") && st.message.contains("\"6.2\""),
        "{}",
        st.message
    );
    assert_eq!(st.kernel, "6.1", "the kubelet's, as for every status");
    assert_eq!(s.label_patch("a"), None, "no ready label");
}

#[test]
fn a_hello_from_before_a_reboot_is_no_mismatch() {
    let mut s = cluster();
    s.set_intents(snapshot(1, vec![intent("m", "v1")]));
    // The agent said hello on the old kernel; the node then rebooted into 6.1, which
    // the kubelet already reports, before the agent says hello again.
    let mut stale = hello_running("a", "6.0", &[]);
    stale.boot_id = "the boot before".into();
    s.agent_hello("a", &stale);
    assert_eq!(
        s.desired_modules("a").modules.len(),
        1,
        "loads as the kubelet says"
    );
    let st = &statuses(&s)[&(id("m"), "a".to_string())];
    assert_ne!(st.reason, "KernelMismatch");
}

#[test]
fn agreement_after_a_kernel_mismatch_loads_again() {
    let mut s = cluster();
    s.set_intents(snapshot(1, vec![intent("m", "v1")]));
    s.agent_hello("a", &hello_running("a", "6.2", &[]));
    assert!(s.desired_modules("a").modules.is_empty());

    // The kubelet catches up with the kernel the agent runs.
    s.upsert_node(node("a", "6.2", "worker"));
    let desired = s.desired_modules("a");
    assert_eq!(desired.modules.len(), 1);
    assert_eq!(
        desired.modules[0].load.as_ref().unwrap().image,
        "reg/m:6.2-v1"
    );
    assert_eq!(state_of(&s, "m", "a"), Some(ModuleState::Pending));

    // The kubelet moves on alone, then the agent follows.
    s.upsert_node(node("a", "6.1", "worker"));
    assert!(s.desired_modules("a").modules.is_empty());
    s.agent_hello("a", &hello("a", &[]));
    let desired = s.desired_modules("a");
    assert_eq!(
        desired.modules[0].load.as_ref().unwrap().image,
        "reg/m:6.1-v1"
    );
    s.agent_event(
        "a",
        &event("m", Action::Load, Outcome::Succeeded, desired.revision),
    )
    .unwrap();
    assert_eq!(state_of(&s, "m", "a"), Some(ModuleState::Loaded));
    let patch = s.label_patch("a").expect("the ready labels");
    assert_eq!(
        patch["metadata"]["labels"]["kmm.node.kubernetes.io/ns.m.ready"],
        ""
    );
}

#[test]
fn an_unload_still_reaches_an_agent_on_another_kernel() {
    let mut s = cluster();
    s.set_intents(snapshot(1, vec![intent("m", "v1")]));
    s.agent_hello("a", &hello_running("a", "6.2", &[("m", "v1")]));
    let mut gone = intent("m", "v1");
    gone.unload = true;
    s.set_intents(snapshot(2, vec![gone]));
    let desired = s.desired_modules("a");
    assert_eq!(desired.modules.len(), 1);
    assert!(desired.modules[0].unload);
    assert!(desired.modules[0].load.is_none());
    s.agent_event(
        "a",
        &event("m", Action::Unload, Outcome::Succeeded, desired.revision),
    )
    .unwrap();
    assert_eq!(state_of(&s, "m", "a"), Some(ModuleState::Unloaded));
}

#[test]
fn an_agent_that_names_no_kernel_follows_the_kubelet() {
    let mut s = cluster();
    s.set_intents(snapshot(1, vec![intent("m", "v1")]));
    s.agent_hello("a", &hello_running("a", "", &[]));
    let desired = s.desired_modules("a");
    assert_eq!(desired.modules.len(), 1);
    assert_eq!(
        desired.modules[0].load.as_ref().unwrap().image,
        "reg/m:6.1-v1"
    );
    let st = &statuses(&s)[&(id("m"), "a".to_string())];
    assert_eq!(ModuleState::try_from(st.state), Ok(ModuleState::Pending));
    assert_eq!(st.reason, "");
}

#[test]
fn failed_load_reports_the_agents_error() {
    let mut s = cluster();
    s.set_intents(snapshot(1, vec![intent("m", "v1")]));
    let rev = s.desired_modules("a").revision;
    s.agent_event("a", &event("m", Action::Load, Outcome::Failed, rev))
        .unwrap();
    let st = &statuses(&s)[&(id("m"), "a".to_string())];
    assert_eq!(st.state, ModuleState::Failed as i32);
    assert_eq!(st.reason, "LoadFailed");
    assert_eq!(st.message, "insmod: ERROR");
}

#[test]
fn absent_module_is_forgotten_not_unloaded() {
    let mut s = cluster();
    s.set_intents(snapshot(1, vec![intent("m", "v1"), intent("keep", "v1")]));
    let rev = s.desired_modules("a").revision;
    s.agent_event("a", &event("m", Action::Load, Outcome::Succeeded, rev))
        .unwrap();
    s.set_intents(snapshot(2, vec![intent("keep", "v1")]));
    let desired = s.desired_modules("a");
    assert_eq!(desired.modules.len(), 1);
    assert_eq!(
        ModuleId::from_key(desired.modules[0].key.as_ref()),
        id("keep")
    );
    assert!(!desired.modules.iter().any(|m| m.unload));
    assert_eq!(state_of(&s, "m", "a"), None);
    let mut facts = node("a", "6.1", "worker");
    facts
        .labels
        .insert("kmm.node.kubernetes.io/ns.m.ready".into(), String::new());
    s.upsert_node(facts);
    let patch = s.label_patch("a");
    assert!(
        patch.is_none_or(|p| p["metadata"]["labels"]
            .get("kmm.node.kubernetes.io/ns.m.ready")
            .is_none()),
        "labels of a forgotten module are not touched"
    );
}

/// Seen on the fleet after a hub leader change: the new leader's first snapshot left
/// the module out (its images not checked yet), the next brought it back unchanged,
/// and the node stayed pending, waiting for a report its agent had no reason to make.
#[test]
fn a_module_back_unchanged_in_the_snapshot_stays_loaded() {
    let mut s = cluster();
    s.set_intents(snapshot(1, vec![intent("m", "v1")]));
    let rev = s.desired_modules("a").revision;
    s.agent_event("a", &event("m", Action::Load, Outcome::Succeeded, rev))
        .unwrap();
    assert_eq!(state_of(&s, "m", "a"), Some(ModuleState::Loaded));
    s.set_intents(snapshot(2, vec![]));
    s.set_intents(snapshot(3, vec![intent("m", "v1")]));
    assert_eq!(state_of(&s, "m", "a"), Some(ModuleState::Loaded));
    // Back changed, it waits for the agent's new proof.
    s.set_intents(snapshot(4, vec![]));
    s.set_intents(snapshot(5, vec![intent("m", "v2")]));
    assert_eq!(state_of(&s, "m", "a"), Some(ModuleState::Pending));
}

/// Seen in the chaos soak: the module's image retagged (the same pinned digest under
/// another tag) made the node pending again, for a load its agent rightly skips.
#[test]
fn a_retag_of_the_pinned_digest_keeps_the_module_loaded() {
    let pinned = |tag: &str| {
        let mut m = intent("m", "v1");
        for kernel in &mut m.kernels {
            if let Some(Target::Load(load)) = &mut kernel.target {
                load.image = format!("reg/m:{tag}@sha256:aa");
            }
        }
        m
    };
    let mut s = cluster();
    s.set_intents(snapshot(1, vec![pinned("6.1-v1")]));
    let rev = s.desired_modules("a").revision;
    s.agent_event("a", &event("m", Action::Load, Outcome::Succeeded, rev))
        .unwrap();
    assert_eq!(state_of(&s, "m", "a"), Some(ModuleState::Loaded));
    s.set_intents(snapshot(2, vec![pinned("6.1-v1-retagged")]));
    assert_eq!(state_of(&s, "m", "a"), Some(ModuleState::Loaded));
}

/// The hub followed the tag to new bytes (`imagePullPolicy: Always`): the same image
/// name and version, another pinned digest. The node is not loaded with them until its
/// agent reloads.
#[test]
fn a_new_pinned_digest_under_the_same_tag_makes_the_node_pending_until_reloaded() {
    let pinned = |digest: &str| {
        let mut m = intent("m", "v1");
        for kernel in &mut m.kernels {
            if let Some(Target::Load(load)) = &mut kernel.target {
                load.digest = digest.into();
            }
        }
        m
    };
    let mut s = cluster();
    s.set_intents(snapshot(1, vec![pinned("sha256:aa")]));
    let rev = s.desired_modules("a").revision;
    s.agent_event("a", &event("m", Action::Load, Outcome::Succeeded, rev))
        .unwrap();
    assert_eq!(state_of(&s, "m", "a"), Some(ModuleState::Loaded));
    s.set_intents(snapshot(2, vec![pinned("sha256:bb")]));
    assert_eq!(state_of(&s, "m", "a"), Some(ModuleState::Pending));
    let rev = s.desired_modules("a").revision;
    s.agent_event("a", &event("m", Action::Load, Outcome::Succeeded, rev))
        .unwrap();
    assert_eq!(state_of(&s, "m", "a"), Some(ModuleState::Loaded));
}

/// Seen in the chaos soak: a new hub leader, its images not yet checked, sends a
/// snapshot without a module; the module comes back narrowed away from a node whose
/// agent still has it loaded. The agent's word decides that the node may have it.
#[test]
fn a_module_back_in_the_snapshot_narrowed_unloads_where_the_agent_has_it() {
    let mut s = cluster();
    s.set_intents(snapshot(1, vec![intent("m", "v1")]));
    let rev = s.desired_modules("a").revision;
    s.agent_event("a", &event("m", Action::Load, Outcome::Succeeded, rev))
        .unwrap();
    s.set_intents(snapshot(2, vec![]));
    let mut narrowed = intent("m", "v1");
    narrowed.node_selector = [("role".to_string(), "infra".to_string())].into();
    s.set_intents(snapshot(3, vec![narrowed]));
    let desired = s.desired_modules("a");
    assert!(
        desired
            .modules
            .iter()
            .any(|m| ModuleId::from_key(m.key.as_ref()) == id("m") && m.unload),
        "{desired:?}"
    );
}

#[test]
fn explicit_unload_reaches_every_node_and_reports_where_it_was() {
    let mut s = cluster();
    s.set_intents(snapshot(1, vec![intent("m", "v1")]));
    let mut gone = intent("m", "v1");
    gone.unload = true;
    s.set_intents(snapshot(2, vec![gone]));
    for n in NODES {
        let desired = s.desired_modules(n);
        assert_eq!(desired.modules.len(), 1, "{n}");
        assert!(desired.modules[0].unload);
    }
    assert_eq!(state_of(&s, "m", "a"), Some(ModuleState::Pending));
    assert_eq!(state_of(&s, "m", "b"), Some(ModuleState::Pending));
    s.agent_hello("a", &hello("a", &[]));
    assert_eq!(state_of(&s, "m", "a"), Some(ModuleState::Unloaded));
}

#[test]
fn an_unload_that_kept_a_kernel_module_for_another_module_reports_it_on_both() {
    let mut s = cluster();
    s.set_intents(snapshot(
        1,
        vec![intent("first", "v1"), intent("second", "v1")],
    ));
    s.agent_hello("a", &hello("a", &[]));
    let revision = s.desired_modules("a").revision;
    for m in ["first", "second"] {
        s.agent_event("a", &event(m, Action::Load, Outcome::Succeeded, revision))
            .unwrap();
    }
    let mut gone = intent("second", "v1");
    gone.unload = true;
    s.set_intents(snapshot(2, vec![intent("first", "v1"), gone]));
    s.take_status_dirty();
    let unloaded = ModuleEvent {
        kept: vec![KeptKernelModule {
            name: "kmm_hello".into(),
            needed_by: vec![key("first")],
        }],
        ..event(
            "second",
            Action::Unload,
            Outcome::Succeeded,
            s.desired_modules("a").revision,
        )
    };
    s.agent_event("a", &unloaded).unwrap();
    assert!(s.take_status_dirty().contains("a"));
    let statuses = statuses(&s);
    let first = &statuses[&(id("first"), "a".to_owned())];
    assert_eq!(first.state(), ModuleState::Loaded, "{first:?}");
    assert_eq!(first.reason, REASON_KERNEL_MODULE_SHARED);
    assert!(
        first.message.contains("kmm_hello with ns/second"),
        "{first:?}"
    );
    let second = &statuses[&(id("second"), "a".to_owned())];
    assert_eq!(second.state(), ModuleState::Unloaded, "{second:?}");
    assert_eq!(second.reason, REASON_KERNEL_MODULE_SHARED);
    assert!(
        second.message.contains("kmm_hello stays loaded: ns/first"),
        "{second:?}"
    );
}

#[test]
fn hello_with_a_module_on_a_deselected_node_unloads_it() {
    let mut s = cluster();
    s.set_intents(snapshot(1, vec![intent("m", "v1")]));
    assert!(s.desired_modules("b").modules.is_empty());
    s.agent_hello("b", &hello("b", &[("m", "v1")]));
    let desired = s.desired_modules("b");
    assert_eq!(desired.modules.len(), 1);
    assert!(desired.modules[0].unload);
}

#[test]
fn hello_proves_a_module_loaded_before_a_proxy_restart() {
    let mut s = cluster();
    s.set_intents(snapshot(1, vec![intent("m", "v1")]));
    s.agent_hello("a", &hello("a", &[("m", "v1")]));
    assert_eq!(state_of(&s, "m", "a"), Some(ModuleState::Loaded));
    s.agent_hello("a", &hello("a", &[("m", "v0")]));
    assert_eq!(state_of(&s, "m", "a"), Some(ModuleState::Pending));
}

#[test]
fn debug_never_shows_credentials() {
    let mut s = cluster();
    let snapshot = snapshot(1, vec![intent("m", "v1")]);
    // prost prints a bytes field as numbers, never as text: look for that form too,
    // and make sure the search finds the secret where it is printed.
    let numbers = format!("{:?}", b"{\"auths\":{}}");
    let numbers = numbers.trim_matches(|c| c == '[' || c == ']');
    assert!(format!("{snapshot:?}").contains(numbers));
    s.set_intents(snapshot);
    let text = format!("{s:?}");
    assert!(!text.contains("auths") && !text.contains(numbers), "{text}");
    assert!(text.contains("nodes: 2"), "{text}");
}

#[test]
fn changes_mark_only_the_nodes_they_touch() {
    let mut s = cluster();
    s.set_intents(snapshot(1, vec![intent("m", "v1")]));
    assert_eq!(
        s.take_status_dirty(),
        ["a".to_string(), "b".to_string()].into()
    );
    assert_eq!(s.take_label_dirty().len(), 2);
    assert!(s.take_status_dirty().is_empty());
    let rev = s.desired_revision("a");
    s.agent_event("a", &event("m", Action::Load, Outcome::Succeeded, rev))
        .unwrap();
    assert_eq!(s.take_status_dirty(), ["a".to_string()].into());
    s.upsert_node(node("b", "6.2", "infra"));
    assert_eq!(
        s.take_label_dirty(),
        ["a".to_string(), "b".to_string()].into()
    );
    s.remove_node("b");
    assert_eq!(s.take_status_dirty(), ["b".to_string()].into());
    assert_eq!(s.statuses_of(&["b".to_string()])["b"].len(), 0);
    s.replace_nodes(vec![node("c", "6.1", "worker")]);
    let dirty = s.take_status_dirty();
    assert!(dirty.contains("a") && dirty.contains("c"), "{dirty:?}");
}

#[test]
fn revision_is_stable_without_change_and_node_removal_drops_entries() {
    let mut s = cluster();
    s.set_intents(snapshot(1, vec![intent("m", "v1")]));
    let rev = s.desired_modules("a").revision;
    s.set_intents(snapshot(2, vec![intent("m", "v1")]));
    assert_eq!(s.desired_modules("a").revision, rev);
    assert_eq!(s.desired_revision("a"), rev);
    assert!(
        !s.upsert_node(node("a", "6.1", "worker")),
        "same facts, no change"
    );
    assert!(s.upsert_node(node("a", "6.1", "other")));
    assert!(s.remove_node("a"));
    assert!(!s.remove_node("a"));
    assert_eq!(s.node_count(), 1);
    assert_eq!(s.desired_modules("a"), DesiredModules::default());
    assert!(statuses(&s).is_empty());
}

#[test]
fn node_churn_on_known_kernels_leaves_the_inventory_alone() {
    let mut s = cluster();
    let before = s.inventory();
    assert!(s.upsert_node(node("c", "6.1", "worker")));
    assert!(s.remove_node("a"));
    assert!(s.upsert_node(node("b", "6.1", "worker")));
    assert_eq!(
        s.inventory(),
        before,
        "no kernel came or went: nothing to send"
    );
    s.upsert_node(node("c", "6.2", "worker"));
    let after = s.inventory();
    assert_eq!(after.revision, before.revision + 1);
    let releases: Vec<&str> = after.kernels.iter().map(|k| k.release.as_str()).collect();
    assert_eq!(releases, ["6.1", "6.2"]);
}

const SCHEDULING: &str = "device-plugin.kmm.sigs.x-k8s.io/ns.m";
const DEVICE_PLUGIN_READY: &str = "kmm.node.kubernetes.io/ns.m.device-plugin-ready";

/// Applies the node's label patch, as the label writer and the Node watch do; the
/// patched labels.
fn patch_labels(s: &mut ClusterState, node: &str) -> Value {
    let Some(patch) = s.label_patch(node) else {
        return Value::Null;
    };
    let mut facts = s.nodes[node].clone();
    for (key, value) in patch["metadata"]["labels"].as_object().unwrap() {
        match value.as_str() {
            Some(value) => facts.labels.insert(key.clone(), value.to_owned()),
            None => facts.labels.remove(key),
        };
    }
    s.upsert_node(facts);
    patch["metadata"]["labels"].clone()
}

fn plugin_pod(module: &str, node: &str, ready: bool) -> BTreeMap<StatusKey, bool> {
    BTreeMap::from([((id(module), node.to_string()), ready)])
}

#[test]
fn a_device_plugin_pod_stops_before_its_module_moves_or_leaves() {
    let mut s = cluster();
    s.set_device_plugin_pods(BTreeMap::new());
    let mut with_plugin = intent("m", "v1");
    with_plugin.device_plugin = Some(DevicePlugin {
        spec_json: r#"{"container":{"image":"reg/plugin:1"}}"#.into(),
        ..DevicePlugin::default()
    });
    s.set_intents(snapshot(1, vec![with_plugin.clone()]));
    assert_eq!(s.device_plugins().len(), 1);
    s.agent_hello("a", &hello("a", &[]));
    let rev = s.desired_modules("a").revision;
    s.agent_event("a", &event("m", Action::Load, Outcome::Succeeded, rev))
        .unwrap();
    let patched = patch_labels(&mut s, "a");
    assert_eq!(patched[SCHEDULING], "", "{patched}");
    assert!(
        patched.get(DEVICE_PLUGIN_READY).is_none(),
        "no plugin Pod yet: {patched}"
    );
    // The DaemonSet put its Pod on a; device-plugin-ready waits for it to be Ready.
    assert!(s.set_device_plugin_pods(plugin_pod("m", "a", false)));
    assert!(
        !s.set_device_plugin_pods(plugin_pod("m", "a", false)),
        "no change, nothing to do"
    );
    assert_eq!(patch_labels(&mut s, "a"), Value::Null);
    s.take_label_dirty();
    assert!(s.set_device_plugin_pods(plugin_pod("m", "a", true)));
    assert!(
        s.take_label_dirty().contains("a"),
        "the Pod's readiness relabels"
    );
    assert_eq!(
        patch_labels(&mut s, "a"),
        serde_json::json!({DEVICE_PLUGIN_READY: ""})
    );

    // v2: the node keeps v1 and loses both plugin labels at once, the Pod still
    // Ready, until the Pod is gone.
    let mut v2 = with_plugin.clone();
    v2.kernels = intent("m", "v2").kernels;
    s.set_intents(snapshot(2, vec![v2]));
    assert_eq!(desired_version(&s, "a").as_deref(), Some("v1"));
    let status = &statuses(&s)[&(id("m"), "a".to_string())];
    assert_eq!(status.reason, "DevicePluginStopping");
    assert_eq!(
        patch_labels(&mut s, "a"),
        serde_json::json!({SCHEDULING: null, DEVICE_PLUGIN_READY: null})
    );
    assert!(s.set_device_plugin_pods(BTreeMap::new()));
    assert_eq!(desired_version(&s, "a").as_deref(), Some("v2"));

    // An unload waits for the plugin's Pod too.
    s.set_device_plugin_pods(plugin_pod("m", "a", true));
    let mut gone = with_plugin;
    gone.unload = true;
    s.set_intents(snapshot(3, vec![gone]));
    assert!(s.device_plugins().is_empty(), "an unload runs no plugin");
    assert!(
        !s.desired_modules("a").modules.iter().any(|m| m.unload),
        "no unload while the plugin's Pod is there"
    );
    s.set_device_plugin_pods(BTreeMap::new());
    assert!(s.desired_modules("a").modules.iter().any(|m| m.unload));
}

#[test]
fn device_plugin_ready_goes_with_the_pods_readiness_and_comes_back_with_it() {
    let mut s = cluster();
    s.set_device_plugin_pods(BTreeMap::new());
    let mut with_plugin = intent("m", "v1");
    with_plugin.device_plugin = Some(DevicePlugin {
        spec_json: r#"{"container":{"image":"reg/plugin:1"}}"#.into(),
        ..DevicePlugin::default()
    });
    s.set_intents(snapshot(1, vec![with_plugin]));
    s.agent_hello("a", &hello("a", &[("m", "v1")]));
    s.set_device_plugin_pods(plugin_pod("m", "a", true));
    let patched = patch_labels(&mut s, "a");
    assert_eq!(
        (&patched[SCHEDULING], &patched[DEVICE_PLUGIN_READY]),
        (&Value::from(""), &Value::from(""))
    );
    // The Pod stops being Ready (its container crashed), then is deleted and
    // replaced: the label goes at once, and is back once the new Pod is Ready.
    s.set_device_plugin_pods(plugin_pod("m", "a", false));
    assert_eq!(
        patch_labels(&mut s, "a"),
        serde_json::json!({DEVICE_PLUGIN_READY: null})
    );
    s.set_device_plugin_pods(BTreeMap::new());
    assert_eq!(patch_labels(&mut s, "a"), Value::Null, "the Pod deleted");
    s.set_device_plugin_pods(plugin_pod("m", "a", true));
    assert_eq!(
        patch_labels(&mut s, "a"),
        serde_json::json!({DEVICE_PLUGIN_READY: ""})
    );
    s.set_device_plugin_pods(BTreeMap::new());
    assert_eq!(
        patch_labels(&mut s, "a"),
        serde_json::json!({DEVICE_PLUGIN_READY: null}),
        "the Pod deleted while Ready"
    );
    assert_eq!(
        s.nodes["a"].labels.get(SCHEDULING).map(String::as_str),
        Some("")
    );
}

/// The module leaves the snapshot once every node reported it unloaded: its plugin's
/// DaemonSet goes with it, and the labels still on a node go with the Pod.
#[test]
fn the_plugin_labels_of_a_forgotten_module_go_with_its_pod() {
    let mut s = cluster();
    s.set_device_plugin_pods(BTreeMap::new());
    let mut with_plugin = intent("m", "v1");
    with_plugin.device_plugin = Some(DevicePlugin {
        spec_json: r#"{"container":{"image":"reg/plugin:1"}}"#.into(),
        ..DevicePlugin::default()
    });
    s.set_intents(snapshot(1, vec![with_plugin]));
    s.agent_hello("a", &hello("a", &[("m", "v1")]));
    s.set_device_plugin_pods(plugin_pod("m", "a", true));
    patch_labels(&mut s, "a");
    s.set_intents(snapshot(2, vec![]));
    assert_eq!(
        s.label_patch("a"),
        None,
        "its agent still has it loaded and its Pod is Ready: nothing changes"
    );
    s.set_device_plugin_pods(BTreeMap::new());
    assert_eq!(
        patch_labels(&mut s, "a"),
        serde_json::json!({DEVICE_PLUGIN_READY: null})
    );
    s.agent_hello("a", &hello("a", &[]));
    let patched = patch_labels(&mut s, "a");
    assert!(patched[SCHEDULING].is_null(), "{patched}");
    assert!(
        patched["kmm.node.kubernetes.io/ns.m.ready"].is_null(),
        "{patched}"
    );
    s.set_intents(snapshot(3, vec![]));
    assert!(s.unlabel.is_empty(), "the labels are gone: forgotten");
}

#[test]
fn before_the_plugins_pods_are_listed_a_module_with_a_plugin_never_leaves() {
    let mut s = cluster();
    let mut with_plugin = intent("m", "v1");
    with_plugin.device_plugin = Some(DevicePlugin {
        spec_json: "{}".into(),
        ..DevicePlugin::default()
    });
    with_plugin.unload = true;
    s.set_intents(snapshot(1, vec![with_plugin, intent("plain", "v1")]));
    s.agent_hello("a", &hello("a", &[("m", "v1")]));
    assert!(s.desired_modules("a").modules.iter().all(|m| !m.unload));
    assert!(s.set_device_plugin_pods(BTreeMap::new()));
    assert!(s.desired_modules("a").modules.iter().any(|m| m.unload));
}

/// A module without a loader: its plugin on every selected node, nothing for agents.
fn plugin_only(name: &str) -> ModuleIntent {
    ModuleIntent {
        kernels: Vec::new(),
        device_plugin: Some(DevicePlugin {
            spec_json: r#"{"container":{"image":"reg/plugin:1"}}"#.into(),
            ..DevicePlugin::default()
        }),
        device_plugin_only: true,
        ..intent(name, "")
    }
}

fn plugin_counts(s: &ClusterState, name: &str) -> Option<(u32, u32)> {
    s.device_plugin_report()
        .plugins
        .iter()
        .find(|p| p.module.as_ref().is_some_and(|m| m.name == name))
        .map(|p| (p.desired, p.available))
}

#[test]
fn a_module_that_loads_nothing_runs_its_plugin_on_every_selected_node() {
    let mut s = cluster();
    s.replace_nodes(vec![
        node("a", "6.1", "worker"),
        node("b", "6.1", "infra"),
        node("c", "", "worker"),
    ]);
    s.set_intents(snapshot(1, vec![plugin_only("m")]));
    for n in ["a", "b", "c"] {
        assert!(
            s.desired_modules(n).modules.is_empty(),
            "{n}: nothing for the agent"
        );
    }
    assert!(
        s.agent_event("a", &event("m", Action::Load, Outcome::Succeeded, 1))
            .is_err(),
        "an agent cannot speak for a module it was never sent"
    );
    assert!(statuses(&s).is_empty(), "nothing is loaded: no status");
    assert_eq!(s.device_plugins().len(), 1);
    assert_eq!(plugin_counts(&s, "m"), None, "the Pods not listed yet");
    for n in ["a", "c"] {
        let patched = patch_labels(&mut s, n);
        assert_eq!(
            patched,
            serde_json::json!({SCHEDULING: ""}),
            "{n}: scheduled whatever its kernel, no ready label"
        );
    }
    assert_eq!(s.label_patch("b"), None, "not selected");

    s.set_device_plugin_pods(BTreeMap::new());
    assert_eq!(plugin_counts(&s, "m"), Some((2, 0)));
    s.set_device_plugin_pods(plugin_pod("m", "a", true));
    assert_eq!(plugin_counts(&s, "m"), Some((2, 1)));
    assert_eq!(
        patch_labels(&mut s, "a"),
        serde_json::json!({DEVICE_PLUGIN_READY: ""})
    );
    let mut both = plugin_pod("m", "a", true);
    both.extend(plugin_pod("m", "c", true));
    s.set_device_plugin_pods(both);
    assert_eq!(plugin_counts(&s, "m"), Some((2, 2)));
    assert_eq!(
        patch_labels(&mut s, "c"),
        serde_json::json!({DEVICE_PLUGIN_READY: ""})
    );
    // The DaemonSet's own counts are not the ones of a module that loads nothing.
    s.set_device_plugin_counts(BTreeMap::from([(id("m"), (5, 0))]));
    assert_eq!(plugin_counts(&s, "m"), Some((2, 2)));

    // Node a leaves the selector: its plugin stops, then it counts as unloaded.
    let mut infra = s.nodes["a"].clone();
    infra.labels.insert("role".into(), "infra".into());
    s.upsert_node(infra);
    assert_eq!(plugin_counts(&s, "m"), Some((1, 1)));
    let status = &statuses(&s)[&(id("m"), "a".to_string())];
    assert_eq!(
        (status.state(), status.reason.as_str()),
        (ModuleState::Pending, "DevicePluginStopping")
    );
    assert!(
        s.desired_modules("a").modules.is_empty(),
        "no unload for the agent either"
    );
    s.set_device_plugin_pods(plugin_pod("m", "c", true));
    assert_eq!(
        state_of(&s, "m", "a"),
        Some(ModuleState::Pending),
        "the Pod is gone, its labels not yet"
    );
    assert_eq!(
        patch_labels(&mut s, "a"),
        serde_json::json!({SCHEDULING: null, DEVICE_PLUGIN_READY: null})
    );
    assert_eq!(state_of(&s, "m", "a"), Some(ModuleState::Unloaded));

    // Deleted: every node is told, nothing reaches the agents, and the module is
    // unloaded where its plugin is gone with its labels.
    let mut gone = plugin_only("m");
    gone.unload = true;
    s.set_intents(snapshot(2, vec![gone]));
    assert!(s.device_plugins().is_empty(), "the DaemonSet goes");
    assert!(s.desired_modules("c").modules.is_empty());
    assert_eq!(state_of(&s, "m", "b"), Some(ModuleState::Unloaded));
    assert_eq!(state_of(&s, "m", "c"), Some(ModuleState::Pending));
    assert_eq!(
        patch_labels(&mut s, "c"),
        serde_json::json!({SCHEDULING: null, DEVICE_PLUGIN_READY: null}),
        "both at once, the Pod still Ready"
    );
    s.set_device_plugin_pods(BTreeMap::new());
    assert_eq!(state_of(&s, "m", "c"), Some(ModuleState::Unloaded));
    assert_eq!(plugin_counts(&s, "m"), None, "no plugin runs for it");
}

/// Intent `m` whose 6.1 image the cluster is to resolve for the hub, without the hub's
/// credential.
fn to_resolve() -> IntentSnapshot {
    let mut resolving = intent("m", "v1");
    let mut load = load("6.1", "v1");
    load.pull_credential_id.clear();
    resolving.kernels[0].target = Some(Target::Resolve(kmm_proto::v1::ImageResolution {
        load: Some(load),
        image_generation: 2,
        failed: None,
    }));
    snapshot(1, vec![resolving])
}

#[test]
fn an_image_to_resolve_loads_nothing_until_pinned_and_is_resolved_with_the_clusters_secret() {
    let now = std::time::Instant::now();
    let mut s = cluster();
    s.set_cluster_pull_secret(cluster_secret(Some(CLUSTER_CONFIG)));
    s.set_intents(to_resolve());
    assert!(
        s.desired_modules("a").modules.is_empty(),
        "nothing to load yet"
    );
    assert_eq!(state_of(&s, "m", "a"), Some(ModuleState::Pending));
    let due = s.spoke_images_due(now);
    assert_eq!(due.len(), 1);
    assert_eq!(due[0].request.image, "reg/m:6.1-v1");
    assert_eq!(due[0].request.generation, 2);
    let credential = due[0].credential.clone().unwrap().expect("a credential");
    assert_eq!(credential.id, "cluster:kmm/cluster-pull");
    assert!(
        !format!("{:?}", due[0]).contains("dTpw"),
        "Debug shows no credential"
    );

    let request = due[0].request.clone();
    assert!(s.spoke_image_answered(request, Ok("sha256:aa".into()), now));
    let report = s.spoke_image_report();
    assert_eq!(report.images.len(), 1);
    assert_eq!(report.images[0].image_generation, 2);
    assert!(s.spoke_images_due(now).is_empty());

    // The hub pins the digest: the node loads it, by digest.
    let mut pinned = to_resolve();
    let mut load = load("6.1", "v1");
    load.pull_credential_id.clear();
    load.digest = "sha256:aa".into();
    pinned.revision = 2;
    pinned.modules[0].kernels[0].target = Some(Target::Load(load));
    s.set_intents(pinned);
    let modules = s.desired_modules("a").modules;
    assert_eq!(modules[0].load.as_ref().unwrap().digest, "sha256:aa");
    assert_eq!(s.spoke_image_report().images.len(), 1, "the answer is kept");
}

#[test]
fn an_image_to_resolve_with_an_unusable_cluster_secret_fails_naming_it() {
    let mut s = cluster();
    s.set_cluster_pull_secret(cluster_secret(None));
    s.set_intents(to_resolve());
    let due = s.spoke_images_due(std::time::Instant::now());
    let why = due[0].credential.clone().unwrap_err();
    assert_eq!(why.reason, "ClusterPullSecretNotFound");
    assert!(why.message.contains("kmm/cluster-pull"), "{}", why.message);
}
