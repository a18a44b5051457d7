//! What the fleet view computes once and reuses: each module's resolutions per
//! generation, its revisions, and the distinct intents of every cluster's snapshot.
//! Lock order, where two are held: the image book, then resolutions.

use std::sync::{Mutex, MutexGuard};

use crate::fleet::revisions::Revisions;
use crate::fleet::shared_snapshot::IntentPool;
use crate::resolutions::Resolutions;

use super::lock;

#[derive(Debug, Default)]
pub struct Caches {
    resolutions: Mutex<Resolutions>,
    revisions: Mutex<Revisions>,
    /// The intents of every cluster's snapshot, each distinct one held once.
    intents: Mutex<IntentPool>,
}

impl Caches {
    pub fn resolutions(&self) -> MutexGuard<'_, Resolutions> {
        lock(&self.resolutions)
    }

    pub fn revisions(&self) -> MutexGuard<'_, Revisions> {
        lock(&self.revisions)
    }

    pub fn intents(&self) -> MutexGuard<'_, IntentPool> {
        lock(&self.intents)
    }

    /// Forgets a module that is gone.
    pub fn forget(&self, module: &str) {
        self.resolutions().retain(|n| n != module);
        self.revisions().retain(|n| n != module);
    }
}
