//! What a node agent with a valid token can send the proxy, on arbitrary bytes: decoding
//! and applying hellos and events to the cluster's state never panics, statuses stay those
//! of the node's own intents, and labels are only ever for modules the proxy knows.

#![no_main]

use kmm_proto::v1::{
    AgentMessage, IntentSnapshot, KernelTarget, ModuleIntent, ModuleKey, ModuleLoad, agent_message,
    kernel_target::Target,
};
use kmm_spoke_proxy::cluster_state::ClusterState;
use kmm_spoke_proxy::node_facts::NodeFacts;
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
    for chunk in data.split(|b| *b == 0xff) {
        let Ok(message) = AgentMessage::decode(chunk) else {
            continue;
        };
        match message.message {
            Some(agent_message::Message::Hello(hello)) => state.agent_hello("n", &hello),
            Some(agent_message::Message::Event(event)) => state.agent_event("n", &event),
            None => {}
        }
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
