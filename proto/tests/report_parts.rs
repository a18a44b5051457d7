//! A node status report too large for one message travels in parts that together are the
//! report, each within the size asked for.

use kmm_proto::report_parts;
use kmm_proto::v1::{ModuleKey, ModuleNodeKey, ModuleNodeStatus, NodeStatusReport};
use prost::Message;

fn key(node: usize) -> ModuleNodeKey {
    ModuleNodeKey {
        module: Some(ModuleKey {
            namespace: "drivers".into(),
            name: "hello".into(),
        }),
        node: format!("node-{node:05}"),
    }
}

fn report(statuses: usize, removed: usize) -> NodeStatusReport {
    NodeStatusReport {
        full: true,
        statuses: (0..statuses)
            .map(|n| ModuleNodeStatus {
                key: Some(key(n)),
                kernel: "6.1.0-13-amd64".into(),
                message: "x".repeat(n % 300),
                ..ModuleNodeStatus::default()
            })
            .collect(),
        removed: (0..removed).map(|n| key(statuses + n)).collect(),
        intent_revision: 42,
        continued: false,
    }
}

#[test]
fn parts_together_are_the_report_and_each_fits() {
    let whole = report(20_000, 3_000);
    let max = 64 << 10;
    let parts = report_parts(whole.clone(), max);
    assert!(parts.len() > 10, "{} parts", parts.len());
    for (i, part) in parts.iter().enumerate() {
        assert_eq!(
            part.continued,
            i + 1 < parts.len(),
            "only the last ends the report"
        );
        assert!(part.full);
        assert_eq!(part.intent_revision, 42);
        assert!(
            part.encoded_len() <= max + 64,
            "part {i}: {} bytes",
            part.encoded_len()
        );
    }
    let statuses: Vec<_> = parts.iter().flat_map(|p| p.statuses.clone()).collect();
    let removed: Vec<_> = parts.iter().flat_map(|p| p.removed.clone()).collect();
    assert_eq!(statuses, whole.statuses);
    assert_eq!(removed, whole.removed);
}

#[test]
fn a_small_or_empty_report_is_one_part() {
    for whole in [report(3, 1), report(0, 0)] {
        assert_eq!(report_parts(whole.clone(), 1 << 20), [whole]);
    }
}

#[test]
fn an_entry_larger_than_a_part_still_travels_alone() {
    let whole = report(2, 0);
    let parts = report_parts(whole.clone(), 1);
    assert_eq!(parts.len(), 2);
    assert_eq!(parts[0].statuses, whole.statuses[..1]);
    assert_eq!(parts[1].statuses, whole.statuses[1..]);
}

#[test]
fn a_part_as_the_proxy_sends_it_fits_the_codec_envelope() {
    use kmm_proto::codec::PART_ENVELOPE;
    use kmm_proto::limits::REPORT_PART;
    use kmm_proto::v1::{ProxyMessage, proxy_message};
    let mut whole = report(5_000, 2_000);
    whole.intent_revision = u64::MAX;
    let largest = report_parts(whole, REPORT_PART)
        .into_iter()
        .map(|part| {
            ProxyMessage {
                message: Some(proxy_message::Message::Status(part)),
            }
            .encoded_len()
        })
        .max()
        .expect("parts");
    assert!(
        largest > REPORT_PART - 300,
        "parts are filled: largest {largest}"
    );
    assert!(
        largest <= REPORT_PART + PART_ENVELOPE,
        "largest part message {largest} bytes, envelope allows {}",
        REPORT_PART + PART_ENVELOPE
    );
}
