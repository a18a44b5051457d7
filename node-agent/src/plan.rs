//! Pure decisions: desired modules + recorded state + what the kernel has loaded =>
//! the actions to take. No I/O here.

use std::collections::{BTreeMap, BTreeSet};

use crate::desired::{DesiredModule, DesiredSnapshot};
use crate::state::{ModuleRecord, State};

/// Why an entry is (re)loaded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LoadReason {
    /// Not loaded by this agent during this boot.
    New,
    /// The recorded entry differs (version, image, settings); the old one is unloaded first.
    Changed,
    /// Recorded as loaded, but the kernel no longer has it (removed behind our back).
    Missing,
}

/// Why an entry is unloaded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum UnloadReason {
    /// The control plane asked for it explicitly.
    Requested,
    /// Replaced by a different version or settings.
    Changed,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Action {
    Unload {
        record: Box<ModuleRecord>,
        reason: UnloadReason,
    },
    Load {
        desired: Box<DesiredModule>,
        reason: LoadReason,
    },
}

/// The records valid for the running boot: a different boot ID means the node
/// rebooted and everything recorded is gone from the kernel.
pub fn records_for_boot(state: Option<State>, boot_id: &str) -> BTreeMap<String, ModuleRecord> {
    match state {
        Some(state) if state.boot_id == boot_id => state.modules,
        _ => BTreeMap::new(),
    }
}

/// Kernel module names compare with `-` and `_` as the same character.
pub fn normalize_module_name(name: &str) -> String {
    name.replace('-', "_")
}

/// Whether a record still satisfies a desired entry. A pinned digest decides alone: the
/// same bytes under another reference (a retag, a mirror) are no reason to unload a
/// running driver. Unpinned, a tag is resolved once: the same image reference keeps the
/// recorded digest even if the tag has moved since.
pub fn satisfies(record: &ModuleRecord, desired: &DesiredModule) -> bool {
    let same_bytes = match &desired.digest {
        Some(digest) => *digest == record.digest,
        None => record.image == desired.image,
    };
    record.version == desired.version
        && same_bytes
        && record.modprobe == desired.modprobe
        && record.in_tree_modules_to_remove == desired.in_tree_modules_to_remove
}

fn still_loaded(record: &ModuleRecord, loaded: &BTreeSet<String>) -> bool {
    record
        .loaded
        .iter()
        .all(|m| loaded.contains(&normalize_module_name(m)))
}

/// Unloads first (entries the snapshot asks to unload, then entries being replaced),
/// then loads in the desired order. Recorded entries the snapshot does not mention are
/// left alone. An entry both desired and to be unloaded is unloaded; desired entries
/// with a duplicate key after the first are ignored.
pub fn plan(
    snapshot: &DesiredSnapshot,
    records: &BTreeMap<String, ModuleRecord>,
    loaded: &BTreeSet<String>,
) -> Vec<Action> {
    let unload: BTreeSet<&str> = snapshot.unload.iter().map(String::as_str).collect();
    let mut seen = BTreeSet::new();
    let desired: Vec<&DesiredModule> = snapshot
        .modules
        .iter()
        .filter(|d| !unload.contains(d.key.as_str()) && seen.insert(d.key.as_str()))
        .collect();

    let mut unloads: Vec<Action> = unload
        .iter()
        .filter_map(|key| records.get(*key))
        .map(|record| Action::Unload {
            record: Box::new(record.clone()),
            reason: UnloadReason::Requested,
        })
        .collect();
    let mut loads = Vec::new();
    for d in desired {
        let reason = match records.get(&d.key) {
            None => Some(LoadReason::New),
            Some(record) if !satisfies(record, d) => {
                unloads.push(Action::Unload {
                    record: Box::new(record.clone()),
                    reason: UnloadReason::Changed,
                });
                Some(LoadReason::Changed)
            }
            Some(record) if !still_loaded(record, loaded) => Some(LoadReason::Missing),
            Some(_) => None,
        };
        if let Some(reason) = reason {
            loads.push(Action::Load {
                desired: Box::new(d.clone()),
                reason,
            });
        }
    }
    unloads.extend(loads);
    unloads
}

/// `actions` with those of modules in `failed_last` (whose last attempt failed: a module
/// stuck in the kernel, say) moved after all others, each group in its order. A module
/// whose modprobe hangs until the tool's time limit then delays no other module's unload,
/// nor another's load behind its own load, pass after pass (the reconciler runs every
/// unload before any load).
pub fn failed_last(actions: Vec<Action>, failed_last: &BTreeSet<String>) -> Vec<Action> {
    let (mut healthy, failed): (Vec<Action>, Vec<Action>) = actions
        .into_iter()
        .partition(|action| !failed_last.contains(action.key()));
    healthy.extend(failed);
    healthy
}

impl Action {
    /// The module the action is about.
    pub fn key(&self) -> &str {
        match self {
            Self::Unload { record, .. } => &record.key,
            Self::Load { desired, .. } => &desired.key,
        }
    }
}

/// Keys the snapshot asks to unload that this agent has not loaded (in this boot):
/// already unloaded, which is confirmed to the control plane once per snapshot.
pub fn already_unloaded<'a>(
    snapshot: &'a DesiredSnapshot,
    records: &BTreeMap<String, ModuleRecord>,
) -> Vec<&'a str> {
    let unload: BTreeSet<&str> = snapshot.unload.iter().map(String::as_str).collect();
    unload
        .into_iter()
        .filter(|key| !records.contains_key(*key))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::desired::{Modprobe, ModprobeArgs};

    fn desired(key: &str, version: Option<&str>) -> DesiredModule {
        DesiredModule {
            key: key.into(),
            version: version.map(Into::into),
            image: format!("registry/{key}:tag"),
            digest: None,
            modprobe: Modprobe {
                module_name: Some(key.replace('/', "_")),
                ..Default::default()
            },
            in_tree_modules_to_remove: vec![],
            registry_tls: Default::default(),
            pull_secret: None,
        }
    }

    fn want(modules: &[DesiredModule]) -> DesiredSnapshot {
        DesiredSnapshot {
            revision: 1,
            modules: modules.to_vec(),
            unload: vec![],
        }
    }

    fn unload(modules: &[DesiredModule], keys: &[&str]) -> DesiredSnapshot {
        DesiredSnapshot {
            unload: keys.iter().map(|k| k.to_string()).collect(),
            ..want(modules)
        }
    }

    fn record_of(d: &DesiredModule) -> ModuleRecord {
        ModuleRecord {
            key: d.key.clone(),
            version: d.version.clone(),
            image: d.image.clone(),
            digest: "sha256:aa".into(),
            kernel: "k".into(),
            module_dir: "/cache/x/opt".into(),
            modprobe: d.modprobe.clone(),
            in_tree_modules_to_remove: d.in_tree_modules_to_remove.clone(),
            loaded: d.load_order(),
            firmware_files: vec![],
            loaded_at_unix_ms: 0,
        }
    }

    fn records(ds: &[&DesiredModule]) -> BTreeMap<String, ModuleRecord> {
        ds.iter().map(|d| (d.key.clone(), record_of(d))).collect()
    }

    fn loaded(names: &[&str]) -> BTreeSet<String> {
        names.iter().map(|s| s.to_string()).collect()
    }

    fn summary(actions: &[Action]) -> Vec<String> {
        actions
            .iter()
            .map(|a| match a {
                Action::Unload { record, reason } => format!("unload {} {reason:?}", record.key),
                Action::Load { desired, reason } => format!("load {} {reason:?}", desired.key),
            })
            .collect()
    }

    #[test]
    fn nothing_desired_nothing_recorded() {
        assert!(plan(&want(&[]), &BTreeMap::new(), &loaded(&[])).is_empty());
    }

    #[test]
    fn new_module_is_loaded() {
        let a = desired("ns/a", None);
        assert_eq!(
            summary(&plan(&want(&[a]), &BTreeMap::new(), &loaded(&[]))),
            ["load ns/a New"]
        );
    }

    #[test]
    fn loaded_module_is_left_alone_after_restart() {
        let a = desired("ns/a", Some("1"));
        assert!(
            plan(
                &want(std::slice::from_ref(&a)),
                &records(&[&a]),
                &loaded(&["ns_a"])
            )
            .is_empty()
        );
    }

    #[test]
    fn module_removed_behind_our_back_is_loaded_again() {
        let a = desired("ns/a", Some("1"));
        assert_eq!(
            summary(&plan(
                &want(std::slice::from_ref(&a)),
                &records(&[&a]),
                &loaded(&[])
            )),
            ["load ns/a Missing"]
        );
    }

    #[test]
    fn hyphens_and_underscores_are_the_same_module() {
        let mut a = desired("ns/a", None);
        a.modprobe.module_name = Some("my-mod".into());
        assert!(
            plan(
                &want(std::slice::from_ref(&a)),
                &records(&[&a]),
                &loaded(&["my_mod"])
            )
            .is_empty()
        );
    }

    #[test]
    fn version_change_unloads_then_loads() {
        let old = desired("ns/a", Some("1"));
        let new = desired("ns/a", Some("2"));
        assert_eq!(
            summary(&plan(&want(&[new]), &records(&[&old]), &loaded(&["ns_a"]))),
            ["unload ns/a Changed", "load ns/a Changed"]
        );
    }

    #[test]
    fn settings_or_image_changes_reload() {
        let old = desired("ns/a", None);
        let mut changes = vec![];
        let mut d = old.clone();
        d.image = "registry/other:tag".into();
        changes.push(d);
        let mut d = old.clone();
        d.modprobe.parameters = vec!["x=1".into()];
        changes.push(d);
        let mut d = old.clone();
        d.modprobe.args = Some(ModprobeArgs {
            load: vec!["-v".into()],
            unload: vec![],
        });
        changes.push(d);
        let mut d = old.clone();
        d.in_tree_modules_to_remove = vec!["intree".into()];
        changes.push(d);
        let mut d = old.clone();
        d.digest = Some("sha256:bb".into());
        changes.push(d);
        for d in changes {
            assert_eq!(
                summary(&plan(
                    &want(std::slice::from_ref(&d)),
                    &records(&[&old]),
                    &loaded(&["ns_a"])
                )),
                ["unload ns/a Changed", "load ns/a Changed"],
                "{d:?}"
            );
        }
    }

    #[test]
    fn same_digest_or_same_tag_is_not_a_change() {
        let old = desired("ns/a", None);
        let mut d = old.clone();
        d.digest = Some("sha256:aa".into());
        assert!(plan(&want(&[d]), &records(&[&old]), &loaded(&["ns_a"])).is_empty());
        // The pinned bytes under another reference (seen in the chaos soak: a retag
        // reloaded every node running the module).
        let mut d = old.clone();
        d.image = "mirror.example/other:retagged".into();
        d.digest = Some("sha256:aa".into());
        assert!(plan(&want(&[d]), &records(&[&old]), &loaded(&["ns_a"])).is_empty());
        // Registry TLS and credentials do not change what runs.
        let mut d = old.clone();
        d.registry_tls.insecure = true;
        assert!(plan(&want(&[d]), &records(&[&old]), &loaded(&["ns_a"])).is_empty());
    }

    #[test]
    fn requested_unload_comes_before_loads() {
        let a = desired("ns/a", None);
        let b = desired("ns/b", None);
        assert_eq!(
            summary(&plan(
                &unload(&[b], &["ns/a"]),
                &records(&[&a]),
                &loaded(&["ns_a"])
            )),
            ["unload ns/a Requested", "load ns/b New"]
        );
    }

    #[test]
    fn absent_modules_are_left_alone() {
        let a = desired("ns/a", None);
        let b = desired("ns/b", None);
        // Neither desired nor to unload: nothing happens, even when it went missing.
        assert!(plan(&want(&[]), &records(&[&a, &b]), &loaded(&["ns_a", "ns_b"])).is_empty());
        assert!(plan(&want(&[]), &records(&[&a]), &loaded(&[])).is_empty());
        assert_eq!(
            summary(&plan(&want(&[b]), &records(&[&a]), &loaded(&["ns_a"]))),
            ["load ns/b New"]
        );
    }

    #[test]
    fn unload_wins_over_load_of_the_same_key() {
        let a = desired("ns/a", Some("1"));
        assert_eq!(
            summary(&plan(
                &unload(std::slice::from_ref(&a), &["ns/a"]),
                &records(&[&a]),
                &loaded(&["ns_a"])
            )),
            ["unload ns/a Requested"]
        );
        // Not recorded: nothing to unload, and it is not loaded either.
        assert!(plan(&unload(&[a], &["ns/a"]), &BTreeMap::new(), &loaded(&[])).is_empty());
    }

    #[test]
    fn unloading_something_never_loaded_is_confirmed_not_acted_on() {
        let a = desired("ns/a", None);
        let snapshot = unload(&[], &["ns/a", "ns/b", "ns/b"]);
        let recs = records(&[&a]);
        assert_eq!(
            summary(&plan(&snapshot, &recs, &loaded(&["ns_a"]))),
            ["unload ns/a Requested"]
        );
        assert_eq!(already_unloaded(&snapshot, &recs), ["ns/b"]);
        assert!(already_unloaded(&want(&[a]), &recs).is_empty());
    }

    #[test]
    fn duplicate_keys_use_the_first() {
        let a1 = desired("ns/a", Some("1"));
        let a2 = desired("ns/a", Some("2"));
        assert_eq!(
            summary(&plan(&want(&[a1, a2]), &BTreeMap::new(), &loaded(&[]))),
            ["load ns/a New"]
        );
    }

    #[test]
    fn loading_order_modules_must_all_be_loaded() {
        let mut a = desired("ns/a", None);
        a.modprobe.modules_loading_order = vec!["ns_a".into(), "dep".into()];
        let recs = records(&[&a]);
        assert!(
            plan(
                &want(std::slice::from_ref(&a)),
                &recs,
                &loaded(&["ns_a", "dep"])
            )
            .is_empty()
        );
        assert_eq!(
            summary(&plan(&want(&[a]), &recs, &loaded(&["ns_a"]))),
            ["load ns/a Missing"]
        );
    }

    #[test]
    fn reboot_discards_records() {
        let a = desired("ns/a", None);
        let state = State {
            boot_id: "one".into(),
            modules: records(&[&a]),
        };
        assert_eq!(records_for_boot(Some(state.clone()), "one").len(), 1);
        assert!(records_for_boot(Some(state), "two").is_empty());
        assert!(records_for_boot(None, "one").is_empty());
        // After a reboot the module is loaded again, nothing is unloaded.
        let recs = records_for_boot(None, "two");
        assert_eq!(
            summary(&plan(&want(&[a]), &recs, &loaded(&[]))),
            ["load ns/a New"]
        );
    }

    #[test]
    fn modules_that_failed_last_time_go_after_the_others() {
        let (stuck, ok, new) = (
            desired("stuck", Some("1")),
            desired("ok", Some("1")),
            desired("new", Some("1")),
        );
        let planned = plan(
            &unload(std::slice::from_ref(&new), &["ok", "stuck"]),
            &records(&[&stuck, &ok]),
            &BTreeSet::new(),
        );
        let keys = |actions: &[Action]| {
            actions
                .iter()
                .map(|a| a.key().to_owned())
                .collect::<Vec<_>>()
        };
        assert_eq!(keys(&planned), ["ok", "stuck", "new"]);
        let failing: BTreeSet<String> = ["stuck".to_string()].into();
        assert_eq!(
            keys(&failed_last(planned, &failing)),
            ["ok", "new", "stuck"]
        );
    }
}
