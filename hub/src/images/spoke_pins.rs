//! The digests clusters resolved for an image the hub cannot check
//! ([`ImageState::SpokeResolved`]), one pin per cluster. Pure.
//!
//! Each cluster's proxy resolves the tag once, with the cluster's own pull Secret and
//! registry CAs, and reports the digest; that cluster loads it from then on. Two clusters
//! may pin different digests (the tag moved between their resolutions): each keeps its
//! own, status shows both. A pin is never replaced by a later answer: only a new
//! resolution of the image ([`super::record::re_resolve_now`], a new
//! `imageRebuildTriggerGeneration`) starts over, and the answers to an older generation's
//! request are ignored. A failed resolution is not a pin: the cluster retries and its
//! next answer replaces it.

use std::collections::BTreeMap;

use super::need::ImageKey;
use super::record::{ImageRecord, ImageState};

/// One cluster's answer for one image (a `SpokeImage` of its proxy).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SpokeAnswer {
    pub key: ImageKey,
    /// The request's `imageRebuildTriggerGeneration`.
    pub generation: i64,
    pub pin: SpokePin,
}

/// What a cluster answered for one image.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SpokePin {
    /// The tag resolved to this digest: the cluster loads it.
    Digest(String),
    /// The cluster could not resolve the tag: its nodes report why.
    Failed { reason: String, message: String },
}

/// Every cluster's answer for one image, for one generation of it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SpokePins {
    /// The `imageRebuildTriggerGeneration` the answers are for.
    pub generation: i64,
    pub clusters: BTreeMap<String, SpokePin>,
}

/// What one cluster gets for a spoke-resolved image.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ClusterVerdict<'a> {
    /// Load these bytes: the digest the cluster resolved.
    Load { digest: &'a str },
    /// Nothing pinned for the cluster yet: its proxy is to resolve the tag.
    Resolve,
    /// The cluster's resolution failed, and why.
    Wait { reason: &'a str, message: &'a str },
}

impl SpokePins {
    /// Pins already answered for `generation` (a status persisted by an earlier leader).
    pub fn seeded(generation: i64, clusters: BTreeMap<String, SpokePin>) -> Self {
        Self {
            generation,
            clusters,
        }
    }

    /// Takes `cluster`'s `answer` to the request of `generation`, for the image `record`
    /// describes. Returns whether what the cluster gets changed.
    pub fn answer(
        &mut self,
        record: &ImageRecord,
        cluster: &str,
        generation: i64,
        answer: SpokePin,
    ) -> bool {
        let current = record.need.rebuild_generation;
        if record.state != ImageState::SpokeResolved || generation != current {
            return false;
        }
        if self.generation != current {
            *self = Self {
                generation: current,
                clusters: BTreeMap::new(),
            };
        }
        match self.clusters.get(cluster) {
            // A pin holds: a second answer (a proxy resolving again after a restart,
            // the tag moved meanwhile) must not move the cluster.
            Some(SpokePin::Digest(_)) => false,
            Some(known) if *known == answer => false,
            _ => {
                self.clusters.insert(cluster.to_owned(), answer);
                true
            }
        }
    }

    /// What `cluster` gets for the image, whose current generation is `generation`.
    pub fn verdict(&self, generation: i64, cluster: &str) -> ClusterVerdict<'_> {
        if self.generation != generation {
            return ClusterVerdict::Resolve;
        }
        match self.clusters.get(cluster) {
            Some(SpokePin::Digest(digest)) => ClusterVerdict::Load { digest },
            Some(SpokePin::Failed { reason, message }) => ClusterVerdict::Wait { reason, message },
            None => ClusterVerdict::Resolve,
        }
    }
}

/// What `cluster` gets for a spoke-resolved image of `generation`, with its pins if any.
pub fn cluster_verdict<'a>(
    pins: Option<&'a SpokePins>,
    generation: i64,
    cluster: &str,
) -> ClusterVerdict<'a> {
    pins.map_or(ClusterVerdict::Resolve, |p| p.verdict(generation, cluster))
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use k8s_openapi::jiff::Timestamp;

    use super::*;
    use crate::images::record::{Next, Observation, observe};
    use crate::images::{ImageNeed, Verdict};

    fn need(generation: i64) -> ImageNeed {
        ImageNeed {
            module_uid: "u".into(),
            spoke_namespace: "drivers".into(),
            kernels: BTreeSet::from(["6.1.0".to_string()]),
            tls: Default::default(),
            pull_secret: None,
            build: None,
            sign: None,
            rebuild_generation: generation,
        }
    }

    fn spoke_resolved(generation: i64) -> ImageRecord {
        let record = observe(
            &need(generation),
            None,
            Next::Check,
            Observation::CheckFailed {
                unauthorized: false,
                message: "connection refused".into(),
            },
            Timestamp::UNIX_EPOCH,
        );
        assert_eq!(record.verdict(), Verdict::ResolveOnSpoke);
        record
    }

    fn digest(d: &str) -> SpokePin {
        SpokePin::Digest(d.into())
    }

    #[test]
    fn each_cluster_loads_the_digest_it_resolved_and_keeps_it() {
        let record = spoke_resolved(0);
        let mut pins = SpokePins::default();
        assert_eq!(pins.verdict(0, "spoke1"), ClusterVerdict::Resolve);
        assert!(pins.answer(&record, "spoke1", 0, digest("sha256:aa")));
        // The tag moved before spoke2 looked: each keeps its own.
        assert!(pins.answer(&record, "spoke2", 0, digest("sha256:bb")));
        assert_eq!(
            pins.verdict(0, "spoke1"),
            ClusterVerdict::Load {
                digest: "sha256:aa"
            }
        );
        assert_eq!(
            pins.verdict(0, "spoke2"),
            ClusterVerdict::Load {
                digest: "sha256:bb"
            }
        );
        assert_eq!(pins.verdict(0, "spoke3"), ClusterVerdict::Resolve);
        // A later answer (a restarted proxy, the tag moved again) moves nothing.
        assert!(!pins.answer(&record, "spoke1", 0, digest("sha256:cc")));
        assert_eq!(
            pins.verdict(0, "spoke1"),
            ClusterVerdict::Load {
                digest: "sha256:aa"
            }
        );
    }

    #[test]
    fn a_failed_resolution_waits_and_gives_way_to_a_digest() {
        let record = spoke_resolved(0);
        let mut pins = SpokePins::default();
        let failed = SpokePin::Failed {
            reason: "ImageNotFound".into(),
            message: "r/x:v1: manifest unknown".into(),
        };
        assert!(pins.answer(&record, "spoke1", 0, failed.clone()));
        assert!(
            !pins.answer(&record, "spoke1", 0, failed),
            "the same answer"
        );
        assert_eq!(
            pins.verdict(0, "spoke1"),
            ClusterVerdict::Wait {
                reason: "ImageNotFound",
                message: "r/x:v1: manifest unknown"
            }
        );
        assert!(pins.answer(&record, "spoke1", 0, digest("sha256:aa")));
        assert_eq!(
            pins.verdict(0, "spoke1"),
            ClusterVerdict::Load {
                digest: "sha256:aa"
            }
        );
    }

    #[test]
    fn a_new_generation_starts_over_and_old_answers_are_ignored() {
        let mut pins = SpokePins::default();
        assert!(pins.answer(&spoke_resolved(0), "spoke1", 0, digest("sha256:aa")));
        let bumped = spoke_resolved(1);
        assert_eq!(pins.verdict(1, "spoke1"), ClusterVerdict::Resolve);
        assert!(
            !pins.answer(&bumped, "spoke1", 0, digest("sha256:aa")),
            "an answer to the older request"
        );
        assert!(pins.answer(&bumped, "spoke1", 1, digest("sha256:bb")));
        assert_eq!(pins.generation, 1);
        assert_eq!(
            pins.verdict(1, "spoke1"),
            ClusterVerdict::Load {
                digest: "sha256:bb"
            }
        );
    }

    #[test]
    fn answers_for_an_image_the_hub_pins_are_ignored() {
        let pinned = observe(
            &need(0),
            None,
            Next::Check,
            Observation::Found {
                digest: "sha256:aa".into(),
            },
            Timestamp::UNIX_EPOCH,
        );
        let mut pins = SpokePins::default();
        assert!(!pins.answer(&pinned, "spoke1", 0, digest("sha256:bb")));
        assert_eq!(cluster_verdict(None, 0, "spoke1"), ClusterVerdict::Resolve);
    }
}
