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
//!
//! The hub keeps checking the image itself. When it finds it (its registry answers the
//! hub again), the image becomes the hub's, pinned fleet-wide, only if that moves no
//! cluster: every cluster's pin is the digest the hub found ([`settle`]). Otherwise the
//! clusters keep their own pins until the image is resolved anew.

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

/// The record to keep when the hub's step turned the spoke-resolved `previous` into
/// `next`: a digest the hub found replaces the clusters' pins only when every one of
/// them is that digest; otherwise the image stays spoke-resolved, checked again when
/// `next` would have been.
pub fn settle(
    previous: Option<&ImageRecord>,
    next: ImageRecord,
    pins: Option<&SpokePins>,
) -> ImageRecord {
    let Some(previous) = previous.filter(|p| p.state == ImageState::SpokeResolved) else {
        return next;
    };
    let Some(found) = next.digest.as_deref() else {
        return next;
    };
    let generation = next.need.rebuild_generation;
    let agrees = pins.is_none_or(|pins| {
        pins.generation != generation
            || pins.clusters.values().all(|pin| match pin {
                SpokePin::Digest(digest) => digest == found,
                SpokePin::Failed { .. } => true,
            })
    });
    if agrees || previous.need.rebuild_generation != generation {
        return next;
    }
    ImageRecord {
        then: next.then,
        next_at: next.next_at,
        ..previous.clone()
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

    use k8s_openapi::jiff::Timestamp;

    use super::*;
    use crate::images::record::{Next, Observation, observe};
    use crate::images::{ImageNeed, Verdict};

    fn need(generation: i64) -> ImageNeed {
        ImageNeed {
            rebuild_generation: generation,
            ..ImageNeed::for_kernels(["6.1.0"])
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
    fn the_hub_takes_the_image_over_only_where_no_cluster_moves() {
        let spoke = spoke_resolved(0);
        let found = |digest: &str| {
            observe(
                &need(0),
                Some(&spoke),
                Next::Check,
                Observation::Found {
                    digest: digest.into(),
                },
                Timestamp::UNIX_EPOCH,
            )
        };
        let mut pins = SpokePins::default();
        pins.answer(&spoke, "spoke1", 0, digest("sha256:aa"));
        pins.answer(
            &spoke,
            "spoke2",
            0,
            SpokePin::Failed {
                reason: "ImageNotFound".into(),
                message: "m".into(),
            },
        );
        // The hub finds what every cluster pinned: the fleet's pin from now on.
        let agreed = settle(Some(&spoke), found("sha256:aa"), Some(&pins));
        assert_eq!(
            agreed.verdict(),
            Verdict::Load {
                digest: "sha256:aa"
            }
        );
        // The tag moved since spoke1 resolved it: spoke1 keeps its bytes.
        let moved = found("sha256:bb");
        let kept = settle(Some(&spoke), moved.clone(), Some(&pins));
        assert_eq!(kept.verdict(), Verdict::ResolveOnSpoke);
        assert_eq!(kept.next_at, moved.next_at, "checked again later");
        assert_eq!(kept.message, spoke.message);
        // Nothing pinned by any cluster yet, or an image the hub held already: as found.
        assert_eq!(settle(Some(&spoke), moved.clone(), None), moved);
        assert_eq!(settle(None, moved.clone(), Some(&pins)), moved);
        // A new generation is a new resolution: the hub's finding stands.
        let bumped = observe(
            &need(1),
            Some(&spoke),
            Next::Resolve,
            Observation::Found {
                digest: "sha256:bb".into(),
            },
            Timestamp::UNIX_EPOCH,
        );
        assert_eq!(settle(Some(&spoke), bumped.clone(), Some(&pins)), bumped);
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
