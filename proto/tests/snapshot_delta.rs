//! A delta carries what changed and, applied to the snapshot before it, gives the next
//! one exactly: whatever modules were added, changed, removed or kept.

use kmm_proto::v1::{IntentSnapshot, ModuleIntent, ModuleKey, PullCredential};
use kmm_proto::{apply_snapshot, snapshot_delta, snapshot_digest};

fn intent(name: &str, generation: i64) -> ModuleIntent {
    ModuleIntent {
        key: Some(ModuleKey {
            namespace: "drivers".into(),
            name: name.into(),
        }),
        generation,
        ..ModuleIntent::default()
    }
}

fn snapshot(revision: u64, modules: &[(&str, i64)]) -> IntentSnapshot {
    IntentSnapshot {
        revision,
        modules: modules.iter().map(|(n, g)| intent(n, *g)).collect(),
        credentials: vec![PullCredential {
            id: format!("c{revision}"),
            content: None,
        }],
        ..IntentSnapshot::default()
    }
}

#[test]
fn a_delta_carries_only_changes_and_rebuilds_the_next_snapshot() {
    let before = snapshot(1, &[("a", 1), ("b", 1), ("c", 1)]);
    let next = snapshot(2, &[("a", 1), ("b", 2), ("d", 1)]);
    let delta = snapshot_delta(
        &before.modules,
        &next.modules,
        next.revision,
        &next.credentials,
    );
    assert!(delta.delta);
    assert_eq!(delta.revision, 2);
    let names: Vec<_> = delta
        .modules
        .iter()
        .map(|m| m.key.as_ref().unwrap().name.as_str())
        .collect();
    assert_eq!(names, ["b", "d"], "unchanged a is not sent");
    assert_eq!(delta.removed.len(), 1);
    assert_eq!(delta.removed[0].name, "c");
    assert_eq!(
        delta.credentials, next.credentials,
        "credentials are always complete"
    );
    assert_eq!(apply_snapshot(Some(&before), delta), next);
}

#[test]
fn every_sequence_of_changes_round_trips() {
    // Every subset of four modules at two generations, in sequence.
    let names = ["a", "b", "c", "d"];
    let snapshots: Vec<IntentSnapshot> = (0u64..81)
        .map(|i| {
            let mut code = i;
            let modules: Vec<(&str, i64)> = names
                .iter()
                .filter_map(|n| {
                    let digit = code % 3;
                    code /= 3;
                    (digit > 0).then_some((*n, digit as i64))
                })
                .collect();
            snapshot(i + 1, &modules)
        })
        .collect();
    let mut applied = snapshots[0].clone();
    for next in &snapshots[1..] {
        let delta = snapshot_delta(
            &applied.modules,
            &next.modules,
            next.revision,
            &next.credentials,
        );
        applied = apply_snapshot(Some(&applied), delta);
        assert_eq!(&applied, next);
    }
}

#[test]
fn a_complete_snapshot_replaces_whatever_was_applied() {
    let before = snapshot(1, &[("a", 1)]);
    let complete = snapshot(2, &[("b", 1)]);
    assert_eq!(apply_snapshot(Some(&before), complete.clone()), complete);
    assert_eq!(apply_snapshot(None, complete.clone()), complete);
}

#[test]
fn a_snapshot_rebuilt_from_deltas_has_the_digest_of_the_complete_one() {
    let before = snapshot(1, &[("c", 1), ("a", 1), ("b", 1)]);
    let next = snapshot(2, &[("d", 1), ("a", 1), ("b", 2)]);
    let delta = snapshot_delta(
        &before.modules,
        &next.modules,
        next.revision,
        &next.credentials,
    );
    let held = apply_snapshot(Some(&before), delta);
    assert_ne!(held.modules, next.modules, "the proxy keeps its own order");
    assert_eq!(
        snapshot_digest(&held.modules, &held.credentials),
        snapshot_digest(&next.modules, &next.credentials)
    );
}

#[test]
fn any_difference_in_intents_or_credentials_changes_the_digest() {
    let base = snapshot(1, &[("a", 1), ("b", 1)]);
    let digest = |s: &IntentSnapshot| snapshot_digest(&s.modules, &s.credentials);
    let mut other_generation = base.clone();
    other_generation.modules[1].generation = 2;
    let mut other_credential = base.clone();
    other_credential.credentials[0].id = "other".into();
    let mut fewer = base.clone();
    fewer.modules.pop();
    let mut selector = base.clone();
    selector.modules[0]
        .node_selector
        .insert("zone".into(), "a".into());
    let mut other_revision = base.clone();
    other_revision.revision = 9;
    for changed in [&other_generation, &other_credential, &fewer, &selector] {
        assert_ne!(digest(changed), digest(&base), "{changed:?}");
    }
    assert_eq!(digest(&other_revision), digest(&base));
}
