//! What a spoke proxy with a valid certificate can send the hub, on arbitrary bytes:
//! decoding, assembling and applying node status reports to the cluster's record and counting a
//! module's status from it never panics, keeps only statuses of known modules, and never
//! holds more than the bound.

#![no_main]

use kmm_hub::fleet::node_statuses::{MAX_ENTRIES, NodeStatuses};
use kmm_hub::fleet::status::{ClusterReport, module_status};
use kmm_proto::v1::{ProxyMessage, proxy_message};
use libfuzzer_sys::fuzz_target;
use prost::Message as _;

fuzz_target!(|data: &[u8]| {
    let mut statuses = NodeStatuses::default();
    // Several messages in a row, as a stream carries them.
    for chunk in data.split(|b| *b == 0xff) {
        let Ok(message) = ProxyMessage::decode(chunk) else {
            continue;
        };
        if let Some(proxy_message::Message::Status(part)) = message.message {
            let _ = statuses.receive(part, |namespace, name| namespace == "ns" && name == "m");
        }
        assert!(statuses.len() <= MAX_ENTRIES);
        assert!(statuses.module("ns", "other").is_empty());
        let nodes = statuses.module("ns", "m");
        let counted = module_status(
            Some(1),
            &[ClusterReport {
                cluster: "c",
                connected: true,
                reflects_generation: true,
                kernels: &[],
                nodes,
            }],
        );
        assert!(counted.nodes.loaded <= counted.nodes.matching);
        assert!(counted.failures.len() <= kmm_api::MAX_FAILURE_SAMPLES);
    }
});
