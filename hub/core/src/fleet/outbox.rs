//! Revisioning of a cluster's intent snapshots: a snapshot goes out only when its content
//! differs from the last one sent, or when the current stream has not received it yet;
//! revisions only ever increase, also past what a proxy applied from an earlier hub. Pure.

use std::collections::BTreeMap;
use std::hash::{Hash, Hasher};
use std::sync::Arc;

use kmm_proto::v1::ModuleIntent;
use kmm_proto::v1::kernel_target::Target;

use super::module_id::{ModuleId, module_id, module_key};
use super::revisions::RevisionMark;
use super::shared_snapshot::SharedSnapshot;

/// The snapshots sent to one cluster, kept across its reconnects.
#[derive(Clone, Debug, Default)]
pub struct Outbox {
    /// Shared with the stream that sends it: a cluster's snapshot is held once.
    last: Option<Arc<SharedSnapshot>>,
    /// The highest revision the proxy said it applied (its hello).
    applied: u64,
    /// What the current stream's proxy said it holds, until the stream's first snapshot.
    held: Option<Held>,
    delivered_on_stream: bool,
    /// Per module (namespace, name) in the last snapshot: what it sent of the module.
    sent: BTreeMap<ModuleId, Sent>,
    /// Whether the last snapshot unloads any module.
    unloading: bool,
}

/// What the last snapshot carried of one module.
#[derive(Clone, Copy, Debug)]
struct Sent {
    /// The module's revision the intent was made of.
    mark: RevisionMark,
    /// A digest of the image digests it loads: a cluster resolving a tag itself moves
    /// them with neither generation moving.
    loads: u64,
    /// The revision of the first snapshot that carried both.
    since: u64,
    /// When it unloads the module: the revision of the first snapshot that unloaded it.
    /// Only a report made with that revision applied can confirm the unload.
    unloaded_since: Option<u64>,
    /// Where its intent is in the snapshot.
    at: usize,
}

/// One module's intent in the last snapshot, with what was sent of it.
#[derive(Clone, Copy, Debug)]
pub struct Carried<'a> {
    pub intent: &'a ModuleIntent,
    sent: &'a Sent,
}

impl Carried<'_> {
    /// Whether statuses the proxy made with revision `acked` applied reflect the module
    /// at revision `mark`: the intent was made of that revision, and the proxy applied the
    /// snapshot that first carried it with the digests it loads now (or a later one).
    pub fn reflects(&self, mark: Option<RevisionMark>, acked: u64) -> bool {
        Some(self.sent.mark) == mark && acked >= self.sent.since
    }

    /// Whether the intent unloads the module and no report made with that unload applied
    /// (`acked`) arrived yet: until one does, no status (nor the absence of one) confirms
    /// the unload. A restarted proxy's first report, made before it had any intents, is
    /// one such.
    pub fn unload_unconfirmed(&self, acked: u64) -> bool {
        self.sent.unloaded_since.is_some_and(|since| acked < since)
    }
}

/// What a proxy's hello says it holds: the revision it applied last and the digest of
/// the intents that left it with (`kmm_proto::snapshot_digest`), if any.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Held {
    pub revision: u64,
    pub digest: Option<[u8; 32]>,
}

impl Outbox {
    /// A new stream opened; `held` is what its hello reports.
    pub fn new_stream(&mut self, held: Held) {
        self.applied = self.applied.max(held.revision);
        self.held = Some(held);
        self.delivered_on_stream = false;
    }

    /// Whether the current stream's proxy named intents it holds and was sent nothing yet:
    /// it keeps running them, so a snapshot can wait for the whole content.
    pub fn resuming(&self) -> bool {
        !self.delivered_on_stream && self.held.is_some_and(|held| held.digest.is_some())
    }

    /// Whether the current stream was sent the last snapshot (or resumed it).
    pub fn delivered(&self) -> bool {
        self.delivered_on_stream
    }

    /// Takes `content` as the stream's first snapshot without sending it when the proxy
    /// holds it already (its hello named its digest, at a revision no older than the last
    /// this hub sent): a hub restart, a leader change or a reconnect then costs the
    /// cluster no snapshot. `Ok` with the snapshot at the revision the proxy holds it at,
    /// or `Err` with `content` to [`offer`](Self::offer).
    pub fn resume(
        &mut self,
        mut content: SharedSnapshot,
    ) -> Result<Arc<SharedSnapshot>, SharedSnapshot> {
        let Some(Held {
            revision,
            digest: Some(digest),
        }) = self.held.take()
        else {
            return Err(content);
        };
        let last_revision = self.last.as_ref().map_or(0, |s| s.revision);
        if self.delivered_on_stream
            || revision == 0
            || revision < last_revision
            || kmm_proto::snapshot_digest(&content.modules, &content.credentials) != digest
        {
            return Err(content);
        }
        content.revision = revision;
        Ok(self.record(content))
    }

    /// The snapshot to send for freshly computed `content` (its revision is ignored),
    /// stamped with its revision, or `None` when the stream already has it.
    pub fn offer(&mut self, mut content: SharedSnapshot) -> Option<Arc<SharedSnapshot>> {
        let last_revision = self.last.as_ref().map_or(0, |s| s.revision);
        content.revision = last_revision;
        let unchanged = self.last.as_deref() == Some(&content);
        if unchanged && self.delivered_on_stream {
            return None;
        }
        self.held = None;
        if !unchanged || self.applied > last_revision || last_revision == 0 {
            // Saturating: a hello's revision is bounded (`MAX_INTENT_REVISION`), but a
            // wrap to 0 would make every later report count as up to date.
            content.revision = last_revision.max(self.applied).saturating_add(1);
        }
        Some(self.record(content))
    }

    /// `content`, at its revision, as what the stream now has.
    fn record(&mut self, content: SharedSnapshot) -> Arc<SharedSnapshot> {
        let mut sent = BTreeMap::new();
        for (at, intent) in content.modules.iter().enumerate() {
            let Some(key) = &intent.key else { continue };
            let id = module_id(&key.namespace, &key.name);
            let mark = RevisionMark::of_intent(intent);
            let loads = loaded_digests(intent);
            let since = match self.sent.get(&id) {
                Some(before) if (before.mark, before.loads) == (mark, loads) => before.since,
                _ => content.revision,
            };
            let unloaded_since = intent.unload.then(|| {
                self.sent
                    .get(&id)
                    .and_then(|before| before.unloaded_since)
                    .unwrap_or(content.revision)
            });
            let module = Sent {
                mark,
                loads,
                since,
                unloaded_since,
                at,
            };
            sent.insert(id, module);
        }
        self.unloading = sent.values().any(|s| s.unloaded_since.is_some());
        self.sent = sent;
        let content = Arc::new(content);
        self.last = Some(content.clone());
        self.delivered_on_stream = true;
        content
    }

    /// The module's intent in the last snapshot, if it carries one.
    pub fn carried(&self, namespace: &str, name: &str) -> Option<Carried<'_>> {
        let sent = self.sent.get(module_key(&(namespace, name)))?;
        let intent = self.last.as_ref()?.modules.get(sent.at)?;
        Some(Carried { intent, sent })
    }

    /// [`Carried::reflects`] of module `namespace/name`; false when it is not carried.
    #[cfg(test)]
    pub fn reflects(
        &self,
        namespace: &str,
        name: &str,
        mark: Option<RevisionMark>,
        acked: u64,
    ) -> bool {
        self.carried(namespace, name)
            .is_some_and(|carried| carried.reflects(mark, acked))
    }

    /// [`Carried::unload_unconfirmed`] of module `namespace/name`.
    pub fn unload_unconfirmed(&self, namespace: &str, name: &str, acked: u64) -> bool {
        self.carried(namespace, name)
            .is_some_and(|carried| carried.unload_unconfirmed(acked))
    }

    /// Whether the last snapshot unloads any module.
    pub fn unloads(&self) -> bool {
        self.unloading
    }

    /// What a report's intent revision may acknowledge: no more than the proxy can have
    /// applied, i.e. the newest revision sent, or the one its hello named. A report naming
    /// a later one would count snapshots it never had as applied.
    pub fn acknowledged(&self, reported: u64) -> u64 {
        let newest = self.last.as_ref().map_or(0, |s| s.revision);
        reported.min(newest.max(self.applied))
    }

    /// The last snapshot sent, if any.
    pub fn last(&self) -> Option<&SharedSnapshot> {
        self.last.as_deref()
    }
}

/// A digest of which image digest the intent loads on each kernel.
fn loaded_digests(intent: &ModuleIntent) -> u64 {
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    for target in &intent.kernels {
        if let Some(Target::Load(load)) = &target.target {
            (&target.kernel, &load.digest).hash(&mut hasher);
        }
    }
    hasher.finish()
}

#[cfg(test)]
mod tests {
    use kmm_proto::v1::{IntentSnapshot, ModuleIntent, ModuleKey};

    use super::*;

    fn at(revision: u64) -> Held {
        Held {
            revision,
            digest: None,
        }
    }

    fn mark(generation: i64, pin_generation: i64) -> Option<RevisionMark> {
        Some(RevisionMark {
            generation,
            pin_generation,
        })
    }

    fn with_generation(names: &[&str], generation: i64) -> SharedSnapshot {
        let mut s = snapshot(names);
        for m in &mut s.modules {
            Arc::make_mut(m).generation = generation;
        }
        s
    }

    fn snapshot(modules: &[&str]) -> SharedSnapshot {
        SharedSnapshot::from(IntentSnapshot {
            revision: 99,
            modules: modules
                .iter()
                .map(|name| ModuleIntent {
                    key: Some(ModuleKey {
                        namespace: "drivers".into(),
                        name: (*name).into(),
                    }),
                    ..ModuleIntent::default()
                })
                .collect(),
            ..IntentSnapshot::default()
        })
    }

    #[test]
    fn sends_only_changes_with_increasing_revisions() {
        let mut outbox = Outbox::default();
        outbox.new_stream(Held::default());
        let first = outbox
            .offer(snapshot(&["a"]))
            .expect("first snapshot goes out");
        assert_eq!(first.revision, 1);
        assert_eq!(
            outbox.offer(snapshot(&["a"])),
            None,
            "same content, same stream"
        );
        let second = outbox
            .offer(snapshot(&["a", "b"]))
            .expect("a change goes out");
        assert_eq!(second.revision, 2);
        assert_eq!(outbox.last(), Some(&*second));
    }

    #[test]
    fn an_empty_snapshot_is_sent_too() {
        let mut outbox = Outbox::default();
        outbox.new_stream(Held::default());
        let empty = outbox
            .offer(snapshot(&[]))
            .expect("the proxy learns there is nothing");
        assert_eq!(empty.revision, 1);
        assert!(empty.modules.is_empty());
    }

    #[test]
    fn a_reconnect_resends_the_same_revision_when_nothing_changed() {
        let mut outbox = Outbox::default();
        outbox.new_stream(Held::default());
        outbox.offer(snapshot(&["a"])).unwrap();
        outbox.new_stream(at(1));
        let again = outbox
            .offer(snapshot(&["a"]))
            .expect("new stream gets the state");
        assert_eq!(again.revision, 1);
        assert_eq!(outbox.offer(snapshot(&["a"])), None);
    }

    #[test]
    fn revisions_continue_past_what_the_proxy_applied_from_an_earlier_hub() {
        let mut outbox = Outbox::default();
        outbox.new_stream(at(41));
        assert_eq!(outbox.offer(snapshot(&["a"])).unwrap().revision, 42);
        // The proxy reconnects claiming more than this hub sent (e.g. another replica).
        outbox.new_stream(at(50));
        assert_eq!(outbox.offer(snapshot(&["a"])).unwrap().revision, 51);
        outbox.new_stream(at(3));
        assert_eq!(
            outbox.offer(snapshot(&["b"])).unwrap().revision,
            52,
            "an older applied revision never lowers the counter"
        );
    }

    #[test]
    fn a_generation_is_reflected_once_the_snapshot_first_carrying_it_is_applied() {
        let mut outbox = Outbox::default();
        outbox.new_stream(Held::default());
        assert!(
            !outbox.reflects("drivers", "a", mark(1, 0), 0),
            "nothing sent yet"
        );
        outbox.offer(with_generation(&["a"], 1)).unwrap();
        assert!(!outbox.reflects("drivers", "a", mark(1, 0), 0));
        assert!(outbox.reflects("drivers", "a", mark(1, 0), 1));
        // Another module's change sends revision 2; a's generation 1 stays reflected.
        outbox.offer(with_generation(&["a", "b"], 1)).unwrap();
        assert!(outbox.reflects("drivers", "a", mark(1, 0), 1));
        assert!(!outbox.reflects("drivers", "b", mark(1, 0), 1));
        // a's spec changes: only revision 3 (or later) reflects generation 2.
        outbox.offer(with_generation(&["a", "b"], 2)).unwrap();
        assert!(!outbox.reflects("drivers", "a", mark(2, 0), 2));
        assert!(outbox.reflects("drivers", "a", mark(2, 0), 3));
        assert!(
            !outbox.reflects("drivers", "a", mark(1, 0), 3),
            "an older generation"
        );
        assert!(!outbox.reflects("drivers", "a", None, 3));
        // A module left out of the snapshot is reflected no more.
        outbox.offer(with_generation(&["b"], 2)).unwrap();
        assert!(!outbox.reflects("drivers", "a", mark(2, 0), 4));
    }

    /// Module a at generation 1 and `pin_generation`, loading `digest` on kernel 6.1.
    fn loading(pin_generation: i64, digest: &str) -> SharedSnapshot {
        use kmm_proto::v1::{KernelTarget, ModuleLoad};
        let mut s = snapshot(&["a"]);
        let intent = Arc::make_mut(&mut s.modules[0]);
        intent.generation = 1;
        intent.pin_generation = pin_generation;
        intent.kernels = vec![KernelTarget {
            kernel: "6.1".into(),
            target: Some(Target::Load(ModuleLoad {
                digest: digest.into(),
                ..ModuleLoad::default()
            })),
        }];
        s
    }

    #[test]
    fn a_new_digest_is_reflected_only_once_applied_though_the_generation_stayed() {
        let mut outbox = Outbox::default();
        outbox.new_stream(Held::default());
        outbox.offer(loading(0, "sha256:d1")).unwrap();
        assert!(outbox.reflects("drivers", "a", mark(1, 0), 1));
        let moved = outbox.offer(loading(0, "sha256:d2")).unwrap();
        assert_eq!(moved.revision, 2);
        assert!(
            !outbox.reflects("drivers", "a", mark(1, 0), 1),
            "nodes that loaded the old digest do not count for the new one"
        );
        assert!(outbox.reflects("drivers", "a", mark(1, 0), 2));
    }

    #[test]
    fn a_revision_of_a_moved_tag_is_reflected_only_once_an_intent_of_it_is_applied() {
        let mut outbox = Outbox::default();
        outbox.new_stream(Held::default());
        outbox.offer(loading(0, "sha256:d1")).unwrap();
        assert!(outbox.reflects("drivers", "a", mark(1, 0), 1));
        assert!(
            !outbox.reflects("drivers", "a", mark(1, 1), 1),
            "assigned the new revision before it was sent: the old bytes do not count"
        );
        let moved = outbox.offer(loading(1, "sha256:d2")).unwrap();
        assert_eq!(moved.revision, 2);
        assert!(!outbox.reflects("drivers", "a", mark(1, 1), 1));
        assert!(outbox.reflects("drivers", "a", mark(1, 1), 2));
        assert!(!outbox.reflects("drivers", "a", mark(1, 0), 2));
    }

    #[test]
    fn each_module_carried_is_its_own_intent_of_the_last_snapshot() {
        let carried = |outbox: &Outbox, name: &str| {
            outbox
                .carried("drivers", name)
                .and_then(|c| c.intent.key.as_ref())
                .map(|k| k.name.clone())
        };
        let mut outbox = Outbox::default();
        outbox.new_stream(Held::default());
        outbox.offer(snapshot(&["a", "b", "c"])).unwrap();
        assert_eq!(carried(&outbox, "c").as_deref(), Some("c"));
        outbox.offer(snapshot(&["b", "c"])).unwrap();
        assert_eq!(carried(&outbox, "a"), None);
        assert_eq!(carried(&outbox, "b").as_deref(), Some("b"));
        assert_eq!(carried(&outbox, "c").as_deref(), Some("c"));
        assert!(outbox.carried("other", "c").is_none());
    }

    #[test]
    fn a_hello_at_the_top_revision_never_wraps_to_zero() {
        let mut outbox = Outbox::default();
        outbox.new_stream(at(u64::MAX));
        let sent = outbox
            .offer(snapshot(&["a"]))
            .expect("the first snapshot goes out");
        assert_eq!(
            sent.revision,
            u64::MAX,
            "saturates rather than wrapping to 0"
        );
    }

    #[test]
    fn a_report_acknowledges_no_revision_the_proxy_was_not_sent() {
        let mut outbox = Outbox::default();
        outbox.new_stream(at(7));
        assert_eq!(
            outbox.acknowledged(u64::MAX),
            7,
            "the hello's revision at most"
        );
        let sent = outbox.offer(snapshot(&["a"])).unwrap();
        assert_eq!(sent.revision, 8);
        assert_eq!(outbox.acknowledged(u64::MAX), 8);
        assert_eq!(outbox.acknowledged(5), 5);
    }

    #[test]
    fn an_unload_is_confirmed_only_by_a_report_made_with_it_applied() {
        let unloading = |names: &[&str]| {
            let mut content = snapshot(names);
            for intent in &mut content.modules {
                let mut unload = intent.as_ref().clone();
                unload.unload = true;
                *intent = std::sync::Arc::new(unload);
            }
            content
        };
        let mut outbox = Outbox::default();
        outbox.new_stream(Held::default());
        outbox.offer(snapshot(&["a"])).unwrap();
        assert!(!outbox.unloads());
        let sent = outbox.offer(unloading(&["a"])).unwrap();
        assert_eq!(sent.revision, 2);
        assert!(outbox.unload_unconfirmed("drivers", "a", 1));
        assert!(
            outbox.unload_unconfirmed("drivers", "a", 0),
            "a restarted proxy's report"
        );
        assert!(!outbox.unload_unconfirmed("drivers", "a", 2));
        // Resent on a new stream, the unload keeps the revision it was first sent with.
        outbox.new_stream(Held::default());
        outbox.offer(unloading(&["a"])).unwrap();
        assert!(!outbox.unload_unconfirmed("drivers", "a", 2));
        assert!(outbox.unloads());
        // Once it leaves the snapshot, nothing is pending.
        outbox.offer(snapshot(&[])).unwrap();
        assert!(!outbox.unload_unconfirmed("drivers", "a", 0));
    }

    fn holding(revision: u64, content: &SharedSnapshot) -> Held {
        Held {
            revision,
            digest: Some(kmm_proto::snapshot_digest(
                &content.modules,
                &content.credentials,
            )),
        }
    }

    #[test]
    fn a_proxy_holding_the_content_is_sent_nothing_and_keeps_its_revision() {
        // A hub that just started: it sent nothing yet, the proxy applied 41 earlier.
        let mut outbox = Outbox::default();
        let content = with_generation(&["a", "b"], 3);
        outbox.new_stream(holding(41, &content));
        assert_eq!(outbox.resume(content.clone()).map(|s| s.revision), Ok(41));
        assert_eq!(outbox.offer(content.clone()), None, "the stream has it");
        assert!(
            outbox.reflects("drivers", "a", mark(3, 0), 41),
            "reports made with 41 applied speak for what it carries"
        );
        assert!(!outbox.reflects("drivers", "a", mark(3, 0), 40));
        // The next change continues from the revision the proxy holds.
        let next = with_generation(&["a"], 3);
        assert_eq!(outbox.offer(next.clone()).unwrap().revision, 42);
        // Only a stream's first snapshot may resume, and only with the digest's content.
        assert!(outbox.resume(next.clone()).is_err(), "no new stream");
        outbox.new_stream(holding(42, &content));
        assert!(outbox.resume(next.clone()).is_err(), "other content");
        assert_eq!(outbox.offer(next.clone()).unwrap().revision, 42);
    }

    #[test]
    fn a_proxy_behind_this_hub_or_naming_no_digest_is_sent_the_snapshot() {
        let content = snapshot(&["a"]);
        let mut outbox = Outbox::default();
        outbox.new_stream(Held::default());
        let sent = outbox.offer(snapshot(&["b"])).unwrap();
        outbox.offer(content.clone()).unwrap();
        // Holding the content at a revision older than this hub's last: it missed one.
        outbox.new_stream(holding(sent.revision, &content));
        assert!(outbox.resume(content.clone()).is_err());
        outbox.new_stream(at(2));
        assert!(outbox.resume(content.clone()).is_err(), "no digest named");
        assert!(outbox.offer(content.clone()).is_some(), "resent");
        let mut fresh = Outbox::default();
        fresh.new_stream(holding(0, &content));
        assert!(
            fresh.resume(content).is_err(),
            "revision 0 is no snapshot at all"
        );
    }
}
