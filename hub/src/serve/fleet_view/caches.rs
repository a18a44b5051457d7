//! What the fleet view computes once and reuses: each module's resolutions per
//! generation, its revisions, the distinct intents of every cluster's snapshot, and
//! each module's clusters by state as its view was last counted, and what counting it
//! took.
//! Lock order, where two are held: the image book, then resolutions, then intents.

use std::collections::HashMap;
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use crate::fleet::built_intents::BuiltIntents;
use crate::fleet::cluster_states::StateCounts;
use crate::fleet::revisions::Revisions;
use crate::resolutions::Resolutions;

use super::lock;

#[derive(Debug, Default)]
pub struct Caches {
    resolutions: Mutex<Resolutions>,
    revisions: Mutex<Revisions>,
    /// The intents of every cluster's snapshot, each distinct one held once, and by
    /// what they were built from.
    intents: Mutex<BuiltIntents>,
    /// Per module, its clusters by state when its view was last counted (the controller
    /// counts it on every touch): the fleet UI shows every module without counting each
    /// one's 3,500 clusters again.
    state_counts: Mutex<HashMap<String, Counted>>,
}

/// A module's view as last counted.
#[derive(Clone, Copy, Debug)]
struct Counted {
    counts: StateCounts,
    /// How long the count took: its clusters' sessions read one by one.
    took: Duration,
}

impl Caches {
    pub fn resolutions(&self) -> MutexGuard<'_, Resolutions> {
        lock(&self.resolutions)
    }

    pub fn revisions(&self) -> MutexGuard<'_, Revisions> {
        lock(&self.revisions)
    }

    pub fn intents(&self) -> MutexGuard<'_, BuiltIntents> {
        lock(&self.intents)
    }

    /// Remembers the module's latest counts and what counting took; whether the counts
    /// changed.
    pub fn remember_counts(&self, module: &str, counts: StateCounts, took: Duration) -> bool {
        let counted = Counted { counts, took };
        lock(&self.state_counts)
            .insert(module.to_owned(), counted)
            .is_none_or(|before| before.counts != counts)
    }

    pub fn state_counts(&self, module: &str) -> Option<StateCounts> {
        lock(&self.state_counts).get(module).map(|c| c.counts)
    }

    /// What the module's last count took.
    pub fn count_cost(&self, module: &str) -> Option<Duration> {
        lock(&self.state_counts).get(module).map(|c| c.took)
    }

    /// Forgets a module that is gone.
    pub fn forget(&self, module: &str) {
        self.resolutions().retain(|n| n != module);
        self.revisions().retain(|n| n != module);
        lock(&self.state_counts).remove(module);
    }
}
