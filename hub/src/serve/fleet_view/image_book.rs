//! Where every image the fleet needs stands, as the image worker recorded it, and which
//! kernels need each now. Read by snapshots (pinned digests) and status (image lists).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{RwLock, RwLockReadGuard};

use k8s_openapi::jiff::Timestamp;
use kmm_api::ImageStatus;

use crate::images::spoke_pins::{SpokeAnswer, settle};
use crate::images::status::{image_statuses, with_persisted};
use crate::images::{ImageKey, ImageNeed, ImageRecord, ImageState, SpokePins};

/// Pinned records of images no kernel needs now that one module keeps (the most recently
/// changed): a cluster reconnecting has not sent its kernels yet, and its pins must
/// survive so the same bytes load again; beyond these, a dropped pin still lives in the
/// module's status, which a new record is seeded from.
pub const UNNEEDED_PINS_KEPT: usize = 64;

#[derive(Debug, Default)]
pub struct Images {
    /// Where every image stands, as the image worker found it.
    pub records: BTreeMap<ImageKey, ImageRecord>,
    /// The kernels needing each image now, as the image worker last computed them.
    needed: BTreeMap<ImageKey, BTreeSet<String>>,
    /// The clusters' digests of the images the hub cannot check (spoke-resolved).
    pub spoke_pins: BTreeMap<ImageKey, SpokePins>,
    /// Per module, a count that moves whenever one of its records changes (see
    /// `intents::ClusterImages::versions`). Counts come from one counter, so that a
    /// module's never comes back to one it had.
    pub versions: BTreeMap<String, u64>,
    counter: u64,
}

impl Images {
    /// One of `module`'s records changed.
    fn moved(&mut self, module: &str) {
        self.counter += 1;
        match self.versions.get_mut(module) {
            Some(version) => *version = self.counter,
            None => {
                self.versions.insert(module.to_owned(), self.counter);
            }
        }
    }
}

/// What a new record changed.
#[derive(Clone, Debug, PartialEq)]
pub struct RecordChange {
    /// The record kept (see [`ImageBook::set`]).
    pub kept: ImageRecord,
    /// What nodes get (the verdict) changed: the module's snapshots follow.
    pub verdict: bool,
    /// What status shows changed.
    pub reported: bool,
}

#[derive(Debug, Default)]
pub struct ImageBook {
    images: RwLock<Images>,
}

impl ImageBook {
    pub fn read(&self) -> RwLockReadGuard<'_, Images> {
        self.images
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, Images> {
        self.images
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    pub fn get(&self, key: &ImageKey) -> Option<ImageRecord> {
        self.read().records.get(key).cloned()
    }

    /// Records the image worker's new `record` for `key`, unless it would move a cluster
    /// off its own pin (`spoke_pins::settle`). An image no longer resolved by the
    /// clusters (the hub pinned it, or it failed) forgets their pins.
    pub fn set(&self, key: ImageKey, record: ImageRecord) -> RecordChange {
        let mut images = self.write();
        let record = settle(
            images.records.get(&key),
            record,
            images.spoke_pins.get(&key),
        );
        if record.state != ImageState::SpokeResolved {
            images.spoke_pins.remove(&key);
        }
        images.moved(&key.module);
        let previous = images.records.insert(key, record.clone());
        drop(images);
        RecordChange {
            kept: record.clone(),
            verdict: previous.as_ref().map(ImageRecord::verdict) != Some(record.verdict()),
            reported: previous.is_none_or(|p| !p.reported_alike(&record)),
        }
    }

    /// Takes the image worker's latest `needs`; forgets the images of modules not in
    /// `modules`, and those no kernel needs now (made-up kernels of a proxy become
    /// image records no longer): of those, only pinned ones are kept, at most
    /// [`UNNEEDED_PINS_KEPT`] per module (see there). Returns the modules whose listed
    /// images changed.
    pub fn track(
        &self,
        needs: &BTreeMap<ImageKey, ImageNeed>,
        modules: &BTreeSet<String>,
    ) -> BTreeSet<String> {
        let needed: BTreeMap<ImageKey, BTreeSet<String>> = needs
            .iter()
            .map(|(key, need)| (key.clone(), need.kernels.clone()))
            .collect();
        let mut images = self.write();
        let mut touched: BTreeSet<String> = images
            .records
            .keys()
            .filter(|key| !modules.contains(&key.module))
            .map(|key| key.module.clone())
            .collect();
        images
            .records
            .retain(|key, _| modules.contains(&key.module));
        // Per module, its unneeded records, the pinned ones by when they last changed.
        let mut unneeded: BTreeMap<&str, Vec<(Option<Timestamp>, &ImageKey)>> = BTreeMap::new();
        for (key, record) in &images.records {
            if !needs.contains_key(key) {
                let pinned = record.digest.is_some().then_some(record.since);
                unneeded.entry(&key.module).or_default().push((pinned, key));
            }
        }
        let dropped: BTreeSet<ImageKey> = unneeded
            .into_values()
            .flat_map(|mut keys| {
                // The most recently changed pins first, then every record without one.
                keys.sort_unstable_by(|a, b| b.cmp(a));
                let kept = keys
                    .iter()
                    .take_while(|(pinned, _)| pinned.is_some())
                    .count()
                    .min(UNNEEDED_PINS_KEPT);
                keys.into_iter().skip(kept).map(|(_, key)| key.clone())
            })
            .collect();
        touched.extend(dropped.iter().map(|key| key.module.clone()));
        images.records.retain(|key, _| !dropped.contains(key));
        let Images {
            records,
            spoke_pins,
            ..
        } = &mut *images;
        spoke_pins.retain(|key, _| records.contains_key(key));
        let keys: BTreeSet<&ImageKey> = images.needed.keys().chain(needed.keys()).collect();
        touched.extend(
            keys.into_iter()
                .filter(|key| images.needed.get(*key) != needed.get(*key))
                .map(|key| key.module.clone()),
        );
        images.needed = needed;
        images.versions.retain(|module, _| modules.contains(module));
        for module in touched.iter().filter(|module| modules.contains(*module)) {
            images.moved(module);
        }
        touched
    }

    /// The module's pin generation: the latest any of its images was pinned at, never
    /// below the one its status records (`persisted`), so that it never goes back even
    /// when the image that moved is no longer tracked.
    pub fn pin_generation(&self, module: &str, persisted: i64) -> i64 {
        self.read()
            .records
            .iter()
            .filter(|(key, _)| key.module == module)
            .map(|(_, record)| record.pinned_at)
            .fold(persisted, i64::max)
    }

    /// The module's image statuses, completed with the pins an earlier leader
    /// `persisted`.
    pub fn statuses(&self, module: &str, persisted: &[ImageStatus]) -> Vec<ImageStatus> {
        let images = self.read();
        with_persisted(
            image_statuses(
                images
                    .records
                    .iter()
                    .filter(|(key, _)| key.module == module),
                &images.needed,
                &images.spoke_pins,
            ),
            persisted,
        )
    }

    /// The pins an earlier leader persisted for a spoke-resolved image.
    pub fn seed_spoke_pins(&self, key: ImageKey, pins: SpokePins) {
        self.write().spoke_pins.insert(key, pins);
    }

    /// Takes `cluster`'s answers; an answer for an image the hub does not leave to the
    /// clusters (or to another generation) is ignored. Returns the modules whose answers
    /// changed: the cluster's snapshot and their status follow.
    pub fn answer(&self, cluster: &str, answers: Vec<SpokeAnswer>) -> BTreeSet<String> {
        let mut images = self.write();
        let Images {
            records,
            spoke_pins,
            ..
        } = &mut *images;
        let mut changed = BTreeSet::new();
        for answer in answers {
            let Some(record) = records.get(&answer.key) else {
                continue;
            };
            if spoke_pins.entry(answer.key.clone()).or_default().answer(
                record,
                cluster,
                answer.generation,
                answer.pin,
            ) {
                changed.insert(answer.key.module);
            }
        }
        spoke_pins.retain(|_, pins| !pins.clusters.is_empty());
        changed
    }
}

#[cfg(test)]
mod tests {
    use crate::images::{ImageNeed, ImageState};

    use super::*;

    fn need(kernel: &str) -> ImageNeed {
        ImageNeed {
            module_uid: "u1".into(),
            ..ImageNeed::for_kernels([kernel])
        }
    }

    fn key(kernel: &str) -> ImageKey {
        ImageKey {
            module: "hello".into(),
            image: format!("r/hello:{kernel}"),
        }
    }

    /// A record of the image for `kernel`, pinned at second `at` or, without, missing.
    fn record(kernel: &str, pinned_at: Option<i64>) -> ImageRecord {
        let since = Timestamp::from_second(pinned_at.unwrap_or(0)).unwrap();
        let mut record = ImageRecord::seeded(&need(kernel), "sha256:00".into(), since);
        if pinned_at.is_none() {
            record.digest = None;
            record.state = ImageState::NotFound;
        }
        record
    }

    #[test]
    fn the_pin_generation_is_the_latest_pin_and_never_goes_back() {
        let book = ImageBook::default();
        assert_eq!(book.pin_generation("hello", 0), 0);
        book.set(key("6.1"), record("6.1", Some(1)).with_pins(2, Vec::new()));
        book.set(key("6.2"), record("6.2", Some(1)));
        assert_eq!(book.pin_generation("hello", 0), 2);
        assert_eq!(book.pin_generation("hello", 5), 5, "as status records it");
        assert_eq!(book.pin_generation("other", 0), 0);
    }

    #[test]
    fn every_change_of_a_modules_records_moves_its_version_and_never_back() {
        let book = ImageBook::default();
        let version = || book.read().versions.get("hello").copied();
        assert_eq!(version(), None);
        book.set(key("6.1"), record("6.1", None));
        let first = version().unwrap();
        book.set(key("6.1"), record("6.1", Some(1)));
        let pinned = version().unwrap();
        assert!(pinned > first, "a new record");
        book.set(key("6.2"), record("6.2", None));
        let unpinned = version().unwrap();
        let hello = BTreeSet::from(["hello".to_owned()]);
        book.track(&BTreeMap::new(), &hello);
        assert!(!book.read().records.contains_key(&key("6.2")));
        let dropped = version().unwrap();
        assert!(dropped > unpinned, "an unneeded record dropped");
        book.track(&BTreeMap::new(), &hello);
        assert_eq!(version(), Some(dropped), "nothing changed");
        book.track(&BTreeMap::new(), &BTreeSet::new());
        assert_eq!(version(), None, "the module is gone");
        book.set(key("6.1"), record("6.1", None));
        assert!(version().unwrap() > dropped, "a count it never had");
    }

    #[test]
    fn records_of_images_no_kernel_needs_go_but_recent_pins_stay() {
        let book = ImageBook::default();
        let modules = BTreeSet::from(["hello".to_owned()]);
        book.set(key("6.1"), record("6.1", None));
        for i in 0..1_000 {
            let kernel = format!("junk{i}");
            book.set(key(&kernel), record(&kernel, None));
        }
        for i in 0..100 {
            let kernel = format!("pinned{i}");
            book.set(key(&kernel), record(&kernel, Some(i)));
        }
        let needs = BTreeMap::from([(key("6.1"), need("6.1"))]);
        let touched = book.track(&needs, &modules);
        assert_eq!(touched, modules);
        let records = &book.read().records;
        assert!(records.contains_key(&key("6.1")), "a needed image stays");
        assert!(!records.keys().any(|k| k.image.contains("junk")));
        let pins: BTreeSet<&str> = records
            .keys()
            .filter_map(|k| k.image.strip_prefix("r/hello:pinned"))
            .collect();
        assert_eq!(pins.len(), UNNEEDED_PINS_KEPT);
        assert!(
            pins.contains("99") && !pins.contains("0"),
            "the most recent"
        );
    }
}
