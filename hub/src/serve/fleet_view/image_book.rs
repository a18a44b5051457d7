//! Where every image the fleet needs stands, as the image worker recorded it, and which
//! kernels need each now. Read by snapshots (pinned digests) and status (image lists).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{RwLock, RwLockReadGuard};

use kmm_api::ImageStatus;

use crate::images::status::{image_statuses, with_persisted};
use crate::images::{ImageKey, ImageNeed, ImageRecord};

#[derive(Debug, Default)]
pub struct Images {
    /// Where every image stands, as the image worker found it.
    pub records: BTreeMap<ImageKey, ImageRecord>,
    /// The kernels needing each image now, as the image worker last computed them.
    needed: BTreeMap<ImageKey, BTreeSet<String>>,
}

/// What a new record changed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RecordChange {
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

    /// Records the image worker's new `record` for `key`.
    pub fn set(&self, key: ImageKey, record: ImageRecord) -> RecordChange {
        let previous = self.write().records.insert(key, record.clone());
        RecordChange {
            verdict: previous.as_ref().map(ImageRecord::verdict) != Some(record.verdict()),
            reported: previous.is_none_or(|p| !p.reported_alike(&record)),
        }
    }

    /// Takes the image worker's latest `needs`; forgets the images of modules not in
    /// `modules`. The images of a module that exists are kept even while no kernel needs
    /// them (a cluster reconnecting has not sent its kernels yet): their pins must
    /// survive, so the same bytes load again. Returns the modules whose listed images
    /// changed.
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
        let keys: BTreeSet<&ImageKey> = images.needed.keys().chain(needed.keys()).collect();
        touched.extend(
            keys.into_iter()
                .filter(|key| images.needed.get(*key) != needed.get(*key))
                .map(|key| key.module.clone()),
        );
        images.needed = needed;
        touched
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
            ),
            persisted,
        )
    }
}
