//! What a node agent with a valid token can send the proxy, on arbitrary bytes: decoding
//! and applying hellos and events to the cluster's state never panics, statuses stay those
//! of the node's own intents, labels are only ever for modules the proxy knows, and the
//! agent's view stays within its budget: one proof and one failure (error cut to
//! `ERROR_TEXT`, version and digest to `MODULE_VERSION`) per module sent to the node or
//! named loaded by its last hello (at most `AGENT_LOADED`, as the server refuses more).

#![no_main]

use kmm_proto::limits::{AGENT_LOADED, ERROR_TEXT, MODULE_VERSION};
use kmm_proto::v1::{
    AgentMessage, IntentSnapshot, KernelTarget, ModuleIntent, ModuleKey, ModuleLoad, agent_message,
    kernel_target::Target,
};
use kmm_spoke_proxy_core::cluster_state::ClusterState;
use kmm_spoke_proxy_core::node_facts::NodeFacts;
use libfuzzer_sys::fuzz_target;
use prost::Message as _;

fuzz_target!(|data: &[u8]| {
    let mut state = ClusterState::new(1);
    state.replace_nodes(vec![NodeFacts {
        name: "n".into(),
        kernel: "6.1".into(),
        ..NodeFacts::default()
    }]);
    state.set_intents(IntentSnapshot {
        revision: 2,
        modules: vec![ModuleIntent {
            key: Some(ModuleKey {
                namespace: "ns".into(),
                name: "m".into(),
            }),
            generation: 1,
            kernels: vec![KernelTarget {
                kernel: "6.1".into(),
                target: Some(Target::Load(ModuleLoad {
                    image: "r/m:6.1".into(),
                    version: "v1".into(),
                    ..ModuleLoad::default()
                })),
            }],
            ..ModuleIntent::default()
        }],
        ..IntentSnapshot::default()
    });
    // What one module costs the view at most: its key (as long as the hello allowed it),
    // a proof, a failure and their map entries.
    let per_module = |key: usize| 2 * (key + 64) + 2 * MODULE_VERSION + ERROR_TEXT;
    let mut budget = per_module("ns".len() + "m".len());
    for chunk in data.split(|b| *b == 0xff) {
        let Ok(message) = AgentMessage::decode(chunk) else {
            continue;
        };
        match message.message {
            Some(agent_message::Message::Hello(hello)) => {
                // The server refuses a hello naming more before it reaches the state.
                if hello.loaded.len() > AGENT_LOADED {
                    continue;
                }
                budget = per_module("ns".len() + "m".len())
                    + hello.boot_id.len()
                    + hello.kernel_release.len()
                    + hello
                        .loaded
                        .iter()
                        .map(|m| {
                            per_module(
                                m.key
                                    .as_ref()
                                    .map_or(0, |k| k.namespace.len() + k.name.len()),
                            )
                        })
                        .sum::<usize>();
                state.agent_hello("n", &hello);
            }
            Some(agent_message::Message::Event(event)) => {
                let _ = state.agent_event("n", &event);
            }
            None => {}
        }
        assert!(
            state.agent_bytes() <= "n".len() + budget,
            "{} bytes held, budget {budget}",
            state.agent_bytes()
        );
        let statuses = state.all_statuses();
        for node in statuses.values() {
            for id in node.keys() {
                assert_eq!(id.to_string(), "ns/m", "a status of a module never sent");
            }
        }
        if let Some(patch) = state.label_patch("n") {
            let labels = patch["metadata"]["labels"]
                .as_object()
                .cloned()
                .unwrap_or_default();
            assert!(labels.keys().all(|k| k.contains("ns.m")), "{labels:?}");
        }
    }
});
