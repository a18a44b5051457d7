//! What a spoke proxy with a valid certificate can send the hub, on arbitrary bytes:
//! decoding and applying inventories, node status reports (in parts, arriving over
//! time) and device plugin reports to the cluster's session, reading the images a
//! cluster resolved, and counting a module's status from it, never panics, keeps only
//! statuses and plugin counts of known modules, and never holds more than the documented
//! bounds: the session's accounted bytes stay within `reported_bytes_bound`, its kernels
//! within the inventory limits, and a report's answers within `SPOKE_IMAGES`.

#![no_main]

use std::time::Duration;

use kmm_hub_core::fleet::node_statuses::{Arrival, MAX_BYTES, MAX_ENTRIES};
use kmm_hub_core::fleet::spoke_answers::spoke_answers;
use kmm_hub_core::fleet::status::{ClusterReport, module_status};
use kmm_hub_core::images::SpokePin;
use kmm_hub_core::sessions::{ClusterSession, reported_bytes_bound};
use kmm_proto::limits::{ERROR_TEXT, INVENTORY_KERNELS, SPOKE_IMAGES, valid_kernel_release};
use kmm_proto::v1::{ProxyMessage, proxy_message};
use libfuzzer_sys::fuzz_target;
use prost::Message as _;

fuzz_target!(|data: &[u8]| {
    let mut session = ClusterSession::default();
    let known = |namespace: &str, name: &str| namespace == "ns" && name == "m";
    let mut now = Arrival::now();
    // Several messages in a row, as a stream carries them; each chunk's first byte is
    // the seconds elapsed since the one before (reports in parts may outlive their
    // deadline).
    for chunk in data.split(|b| *b == 0xff) {
        let Some((elapsed, chunk)) = chunk.split_first() else {
            continue;
        };
        now = Arrival {
            at: now.at + Duration::from_secs(u64::from(*elapsed)),
            unix_seconds: now.unix_seconds.saturating_add(u32::from(*elapsed)),
        };
        let Ok(message) = ProxyMessage::decode(chunk) else {
            continue;
        };
        match message.message {
            Some(proxy_message::Message::Status(part)) => {
                let _ = session.statuses.receive(part, known, now);
            }
            Some(proxy_message::Message::Inventory(inventory)) => {
                let _ = session.receive_inventory(inventory);
            }
            Some(proxy_message::Message::DevicePlugins(report)) => {
                session.receive_device_plugins(report, known);
            }
            Some(proxy_message::Message::SpokeImages(report)) => {
                let sent = report.images.len();
                let (answers, dropped) = spoke_answers(report);
                assert!(answers.len() <= SPOKE_IMAGES && answers.len() + dropped == sent);
                for answer in &answers {
                    if let SpokePin::Failed { reason, message } = &answer.pin {
                        assert!(reason.len() <= ERROR_TEXT && message.len() <= ERROR_TEXT);
                    }
                }
            }
            Some(proxy_message::Message::Hello(_)) | None => {}
        }
        assert!(session.statuses.len() <= MAX_ENTRIES);
        assert!(session.statuses.bytes() <= MAX_BYTES);
        assert!(session.reported_bytes() <= reported_bytes_bound(1, "ns".len() + "m".len()));
        if let Some(kernels) = &session.kernels {
            assert!(kernels.len() <= INVENTORY_KERNELS);
            assert!(kernels.iter().all(|k| valid_kernel_release(k)));
        }
        assert!(session.statuses.module("ns", "other").is_empty());
        assert_eq!(session.sight("ns", "other", None).device_plugin, None);
        let nodes = session.statuses.module("ns", "m");
        assert!(
            nodes
                .iter()
                .all(|s| s.message().len() <= ERROR_TEXT && s.reason().len() <= ERROR_TEXT)
        );
        let counted = module_status(
            Some(1),
            &[ClusterReport {
                cluster: "c",
                connected: true,
                reflects_revision: true,
                kernels: &[],
                nodes,
                device_plugin_only: false,
                device_plugin: None,
            }],
        );
        assert!(counted.nodes.loaded <= counted.nodes.matching);
        assert!(counted.failures.len() <= kmm_api::MAX_FAILURE_SAMPLES);
    }
});
