//! The images of one module as its status lists them. Pure.

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kmm_api::{
    ImageClusterStatus, ImageStatus, MAX_IMAGE_CLUSTER_MESSAGE, MAX_IMAGE_CLUSTERS,
    MAX_IMAGE_KERNELS, MAX_IMAGE_STATUSES, MAX_MODULE_IMAGE_CLUSTERS,
};
use kmm_proto::limits::truncated;

use super::need::{ImageKey, ImageNeed};
use super::record::{ImageRecord, ImageState};
use super::spoke_pins::{SpokePin, SpokePins};

/// Status entries for `records` (one module's), bounded: the images some kernel needs
/// now first, with those kernels (`needed`), then the ones none needs at the moment
/// (their pins are kept, see `FleetView::track_images`), with no kernels; each group
/// sorted by image. Only the entries kept are built: a module may track many more images
/// than status lists. A spoke-resolved image lists its clusters' answers (`spoke_pins`).
pub fn image_statuses<'a>(
    records: impl Iterator<Item = (&'a ImageKey, &'a ImageRecord)>,
    needed: &BTreeMap<ImageKey, BTreeSet<String>>,
    spoke_pins: &BTreeMap<ImageKey, SpokePins>,
) -> Vec<ImageStatus> {
    let mut records: Vec<_> = records
        .map(|(key, record)| (key, record, needed.get(key)))
        .collect();
    records.sort_by(|(a, _, a_needed), (b, _, b_needed)| {
        (a_needed.is_none(), &a.image).cmp(&(b_needed.is_none(), &b.image))
    });
    let mut cluster_budget = MAX_MODULE_IMAGE_CLUSTERS;
    records
        .into_iter()
        .take(MAX_IMAGE_STATUSES)
        .map(|(key, record, kernels)| ImageStatus {
            image: key.image.clone(),
            kernels: kernels
                .into_iter()
                .flatten()
                .take(MAX_IMAGE_KERNELS)
                .cloned()
                .collect(),
            state: record.state.as_str().to_owned(),
            digest: record.digest.clone(),
            pin_generation: (record.pinned_at > 0).then_some(record.pinned_at),
            rebuild_generation: Some(record.need.rebuild_generation),
            earlier_pins: record.earlier.clone(),
            reason: record.reason.clone(),
            message: record.message.clone(),
            last_transition_time: Some(Time(record.since)),
            clusters: if record.state == ImageState::SpokeResolved {
                let listed: Vec<ImageClusterStatus> = spoke_pins
                    .get(key)
                    .filter(|p| p.generation == record.need.rebuild_generation)
                    .map(|pins| cluster_statuses(pins, cluster_budget))
                    .unwrap_or_default();
                cluster_budget -= listed.len();
                listed
            } else {
                Vec::new()
            },
        })
        .collect()
}

/// Each cluster's answer, by name, at most `budget` and [`MAX_IMAGE_CLUSTERS`], each
/// message cut to [`MAX_IMAGE_CLUSTER_MESSAGE`] bytes.
fn cluster_statuses(pins: &SpokePins, budget: usize) -> Vec<ImageClusterStatus> {
    pins.clusters
        .iter()
        .take(MAX_IMAGE_CLUSTERS.min(budget))
        .map(|(cluster, pin)| match pin {
            SpokePin::Digest(digest) => ImageClusterStatus {
                cluster: cluster.clone(),
                digest: Some(digest.clone()),
                ..ImageClusterStatus::default()
            },
            SpokePin::Failed { reason, message } => ImageClusterStatus {
                cluster: cluster.clone(),
                digest: None,
                reason: reason.clone(),
                message: truncated(message, MAX_IMAGE_CLUSTER_MESSAGE).to_owned(),
            },
        })
        .collect()
}

/// What a new leader starts an image from: the record an earlier leader persisted, and
/// for a spoke-resolved image the clusters' pins.
#[derive(Debug)]
pub struct Seed {
    pub record: ImageRecord,
    pub spoke_pins: Option<SpokePins>,
}

/// The [`Seed`] of `image` for `need` from the module's persisted `statuses`; `None`
/// when nothing was pinned. An entry persisted for another `imageRebuildTriggerGeneration`
/// than `need`'s seeds a record of that generation, which `record::due` then resolves,
/// builds or signs anew: a generation bumped while no leader ran is not lost, and nodes
/// keep loading the pinned bytes meanwhile.
pub fn seed(
    need: &ImageNeed,
    statuses: &[ImageStatus],
    image: &str,
    now: Timestamp,
) -> Option<Seed> {
    let status = statuses.iter().find(|s| s.image == image)?;
    let generation = status.rebuild_generation.unwrap_or(need.rebuild_generation);
    let at = ImageNeed {
        rebuild_generation: generation,
        ..need.clone()
    };
    if let Some((message, pins)) = persisted_spoke_pins(statuses, image) {
        return Some(Seed {
            record: ImageRecord::seeded_spoke_resolved(&at, message, now),
            spoke_pins: Some(SpokePins::seeded(generation, pins)),
        });
    }
    let pin = persisted_pin(statuses, image)?;
    let record = ImageRecord::seeded(&at, pin.digest.clone()?, now).with_pins(
        pin.pin_generation.unwrap_or_default(),
        pin.earlier_pins.clone(),
    );
    Some(Seed {
        record,
        spoke_pins: None,
    })
}

/// The clusters' pins status persisted for a spoke-resolved `image`, with its message;
/// `None` for any other image.
fn persisted_spoke_pins(
    statuses: &[ImageStatus],
    image: &str,
) -> Option<(String, BTreeMap<String, SpokePin>)> {
    let status = statuses
        .iter()
        .find(|s| s.image == image && s.state == ImageState::SpokeResolved.as_str())?;
    let pins = status
        .clusters
        .iter()
        .filter_map(|c| {
            let digest = c.digest.clone()?;
            Some((c.cluster.clone(), SpokePin::Digest(digest)))
        })
        .collect();
    Some((status.message.clone(), pins))
}

/// `listed` (from the records this hub holds) completed with the pinned entries an
/// earlier leader `persisted` for images this hub has no record of yet: a new leader
/// writing status before its image worker has looked at them must not erase the pins it
/// is about to start from.
pub fn with_persisted(mut listed: Vec<ImageStatus>, persisted: &[ImageStatus]) -> Vec<ImageStatus> {
    let unseen: Vec<ImageStatus> = persisted
        .iter()
        .filter(|p| {
            (p.digest.is_some() || p.clusters.iter().any(|c| c.digest.is_some()))
                && !listed.iter().any(|l| l.image == p.image)
        })
        .cloned()
        .collect();
    listed.extend(unseen);
    listed.truncate(MAX_IMAGE_STATUSES);
    listed
}

/// The pin status persisted for `image` (its digest, with the generation it was pinned
/// at and the earlier pins).
fn persisted_pin<'a>(statuses: &'a [ImageStatus], image: &str) -> Option<&'a ImageStatus> {
    statuses
        .iter()
        .find(|s| s.image == image)
        .filter(|s| s.digest.is_some())
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use k8s_openapi::jiff::Timestamp;

    use super::*;
    use crate::images::ImageNeed;

    #[test]
    fn statuses_are_sorted_bounded_and_round_trip_the_pin() {
        let kernels: Vec<String> = (0..20).map(|i| format!("6.1.{i}")).collect();
        let need = ImageNeed::for_kernels(kernels.iter().map(String::as_str));
        let records: Vec<(ImageKey, ImageRecord)> = (0..150)
            .rev()
            .map(|i| {
                (
                    ImageKey {
                        module: "m".into(),
                        image: format!("r/x:{i:03}"),
                    },
                    ImageRecord::seeded(&need, format!("sha256:{i:03}"), Timestamp::UNIX_EPOCH),
                )
            })
            .collect();
        // Every image is needed but r/x:000 to r/x:009, whose kernels went away.
        let needed: BTreeMap<ImageKey, BTreeSet<String>> = records
            .iter()
            .filter(|(key, _)| key.image.as_str() >= "r/x:010")
            .map(|(key, record)| (key.clone(), record.need.kernels.clone()))
            .collect();
        let statuses = image_statuses(
            records.iter().map(|(k, r)| (k, r)),
            &needed,
            &BTreeMap::new(),
        );
        assert_eq!(statuses.len(), MAX_IMAGE_STATUSES);
        assert_eq!(statuses[0].image, "r/x:010", "needed images come first");
        assert_eq!(statuses[0].kernels.len(), MAX_IMAGE_KERNELS);
        assert_eq!(statuses[99].image, "r/x:109");
        // r/x:014 down to r/x:000.
        let few = image_statuses(
            records[135..].iter().map(|(k, r)| (k, r)),
            &needed,
            &BTreeMap::new(),
        );
        let listed: Vec<(&str, usize)> = few
            .iter()
            .map(|s| (s.image.as_str(), s.kernels.len()))
            .collect();
        assert_eq!(listed[0], ("r/x:010", 10));
        assert_eq!(
            &listed[5..],
            [
                ("r/x:000", 0),
                ("r/x:001", 0),
                ("r/x:002", 0),
                ("r/x:003", 0),
                ("r/x:004", 0),
                ("r/x:005", 0),
                ("r/x:006", 0),
                ("r/x:007", 0),
                ("r/x:008", 0),
                ("r/x:009", 0)
            ],
            "images no kernel needs now come last, with no kernels, pins kept"
        );
        let digest = |statuses: &[ImageStatus], image: &str| {
            persisted_pin(statuses, image).and_then(|s| s.digest.clone())
        };
        assert_eq!(digest(&few, "r/x:003").as_deref(), Some("sha256:003"));
        assert_eq!(statuses[0].state, "Exists");
        assert_eq!(digest(&statuses, "r/x:017").as_deref(), Some("sha256:017"));
        for beyond in ["r/x:149", "r/x:007"] {
            assert_eq!(digest(&statuses, beyond), None, "beyond the bound");
        }
    }

    #[test]
    fn a_followed_images_pins_round_trip_through_status() {
        let need = ImageNeed::for_kernels(["6.1.0"]);
        let earlier = vec![kmm_api::ImagePin {
            pin_generation: 0,
            digest: "sha256:d1".into(),
        }];
        let record = ImageRecord::seeded(&need, "sha256:d2".into(), Timestamp::UNIX_EPOCH)
            .with_pins(1, earlier.clone());
        let key = ImageKey {
            module: "m".into(),
            image: "r/x:v1".into(),
        };
        let statuses = image_statuses(
            [(&key, &record)].into_iter(),
            &BTreeMap::new(),
            &BTreeMap::new(),
        );
        let persisted = persisted_pin(&statuses, "r/x:v1").expect("pinned");
        assert_eq!(
            (persisted.digest.as_deref(), persisted.pin_generation),
            (Some("sha256:d2"), Some(1))
        );
        assert_eq!(persisted.earlier_pins, earlier);
        let first = ImageRecord::seeded(&need, "sha256:d1".into(), Timestamp::UNIX_EPOCH);
        let statuses = image_statuses(
            [(&key, &first)].into_iter(),
            &BTreeMap::new(),
            &BTreeMap::new(),
        );
        assert_eq!(
            statuses[0].pin_generation, None,
            "a first pin says nothing more"
        );
    }

    #[test]
    fn a_rebuild_generation_bumped_between_leaders_is_made_anew() {
        use crate::images::record::{Next, Observation, due, observe};

        let at = |generation| ImageNeed {
            rebuild_generation: generation,
            ..ImageNeed::for_kernels(["6.1.0"])
        };
        let now = Timestamp::UNIX_EPOCH;
        let key = |image: &str| ImageKey {
            module: "m".into(),
            image: image.into(),
        };
        let (pinned, resolved) = (key("r/x:1"), key("r/y:1"));
        // The last leader, at generation 0: one image it pinned, one its clusters did.
        let record = ImageRecord::seeded(&at(0), "sha256:d0".into(), now);
        let spoke_record = observe(
            &at(0),
            None,
            Next::Check,
            Observation::CheckFailed {
                unauthorized: false,
                message: "connection refused".into(),
            },
            now,
        );
        let mut pins = SpokePins::default();
        pins.answer(
            &spoke_record,
            "spoke1",
            0,
            SpokePin::Digest("sha256:s0".into()),
        );
        let statuses = image_statuses(
            [(&pinned, &record), (&resolved, &spoke_record)].into_iter(),
            &BTreeMap::new(),
            &BTreeMap::from([(resolved.clone(), pins)]),
        );
        assert_eq!(statuses[0].rebuild_generation, Some(0));

        // The spec moved to generation 1 while no leader ran: the next one makes both
        // anew, the nodes loading the pinned bytes meanwhile.
        let seeded = seed(&at(1), &statuses, "r/x:1", now).expect("a seed");
        assert_eq!(seeded.record.digest.as_deref(), Some("sha256:d0"));
        assert_eq!(due(&at(1), Some(&seeded.record), now), Some(Next::Resolve));
        let seeded = seed(&at(1), &statuses, "r/y:1", now).expect("a seed");
        let spoke_pins = seeded.spoke_pins.expect("the clusters' pins");
        assert_eq!(
            spoke_pins.generation, 0,
            "pins of the generation they were for"
        );
        assert_eq!(due(&at(1), Some(&seeded.record), now), Some(Next::Resolve));

        // The same generation: checked again only, the pins kept.
        let seeded = seed(&at(0), &statuses, "r/x:1", now).expect("a seed");
        assert_eq!(due(&at(0), Some(&seeded.record), now), Some(Next::Check));
        // A status an older hub wrote (no generation) is taken as the spec's.
        let mut older = statuses.clone();
        older[0].rebuild_generation = None;
        let seeded = seed(&at(1), &older, "r/x:1", now).expect("a seed");
        assert_eq!(due(&at(1), Some(&seeded.record), now), Some(Next::Check));
        assert!(
            seed(&at(0), &statuses, "r/z:1", now).is_none(),
            "nothing pinned"
        );
    }

    #[test]
    fn pins_persisted_by_an_earlier_leader_survive_until_seen() {
        let entry = |image: &str, digest: Option<&str>| ImageStatus {
            image: image.into(),
            kernels: vec![],
            state: "Exists".into(),
            digest: digest.map(str::to_owned),
            ..ImageStatus::default()
        };
        let spoke_resolved = ImageStatus {
            state: "SpokeResolved".into(),
            clusters: vec![ImageClusterStatus {
                cluster: "spoke1".into(),
                digest: Some("sha256:s1".into()),
                ..ImageClusterStatus::default()
            }],
            ..entry("r/d:1", None)
        };
        let persisted = [
            entry("r/a:1", Some("sha256:a")),
            entry("r/b:1", Some("sha256:b")),
            entry("r/c:1", None),
            spoke_resolved,
        ];
        let listed = with_persisted(vec![entry("r/a:1", Some("sha256:new"))], &persisted);
        let images: Vec<_> = listed
            .iter()
            .map(|s| (s.image.as_str(), s.digest.as_deref()))
            .collect();
        assert_eq!(
            images,
            [
                ("r/a:1", Some("sha256:new")),
                ("r/b:1", Some("sha256:b")),
                ("r/d:1", None)
            ],
            "what this hub holds wins; an unseen pin stays, a cluster's too; an entry \
             without a pin goes"
        );
    }

    #[test]
    fn a_spoke_resolved_image_lists_each_clusters_answer_and_round_trips_the_pins() {
        use crate::images::record::{Next, Observation, observe};

        let need = ImageNeed::for_kernels(["6.1.0"]);
        let record = observe(
            &need,
            None,
            Next::Check,
            Observation::CheckFailed {
                unauthorized: false,
                message: "connection refused".into(),
            },
            Timestamp::UNIX_EPOCH,
        );
        let key = ImageKey {
            module: "m".into(),
            image: "r/x:1".into(),
        };
        let mut pins = SpokePins::default();
        pins.answer(&record, "spoke2", 0, SpokePin::Digest("sha256:b".into()));
        pins.answer(
            &record,
            "spoke1",
            0,
            SpokePin::Failed {
                reason: "RegistryUnauthorized".into(),
                message: "401".into(),
            },
        );
        let statuses = image_statuses(
            [(&key, &record)].into_iter(),
            &BTreeMap::from([(key.clone(), need.kernels.clone())]),
            &BTreeMap::from([(key.clone(), pins)]),
        );
        let status = &statuses[0];
        assert_eq!(
            (status.state.as_str(), status.digest.as_deref()),
            ("SpokeResolved", None)
        );
        assert_eq!(
            status.clusters,
            [
                ImageClusterStatus {
                    cluster: "spoke1".into(),
                    digest: None,
                    reason: "RegistryUnauthorized".into(),
                    message: "401".into(),
                },
                ImageClusterStatus {
                    cluster: "spoke2".into(),
                    digest: Some("sha256:b".into()),
                    ..ImageClusterStatus::default()
                },
            ]
        );
        let (message, persisted) = persisted_spoke_pins(&statuses, "r/x:1").unwrap();
        assert_eq!(message, record.message);
        assert_eq!(
            persisted,
            BTreeMap::from([("spoke2".to_owned(), SpokePin::Digest("sha256:b".into()))]),
            "only pins come back: a failure is asked again"
        );
        assert!(persisted_pin(&statuses, "r/x:1").is_none());

        // Bounded per image, per module, and in message length.
        let mut many = SpokePins::default();
        for i in 0..80 {
            many.answer(
                &record,
                &format!("c{i:02}"),
                0,
                SpokePin::Failed {
                    reason: "ImageNotFound".into(),
                    message: "x".repeat(1000),
                },
            );
        }
        let keys: Vec<ImageKey> = (0..5)
            .map(|i| ImageKey {
                module: "m".into(),
                image: format!("r/x:{i}"),
            })
            .collect();
        let statuses = image_statuses(
            keys.iter().map(|k| (k, &record)),
            &BTreeMap::new(),
            &keys.iter().map(|k| (k.clone(), many.clone())).collect(),
        );
        let listed: Vec<usize> = statuses.iter().map(|s| s.clusters.len()).collect();
        assert_eq!(listed, [50, 50, 50, 50, 0]);
        assert_eq!(
            statuses[0].clusters[0].message.len(),
            MAX_IMAGE_CLUSTER_MESSAGE
        );
    }
}
