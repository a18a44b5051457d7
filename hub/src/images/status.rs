//! The images of one module as its status lists them. Pure.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kmm_api::{ImageStatus, MAX_IMAGE_KERNELS, MAX_IMAGE_STATUSES};

use super::need::ImageKey;
use super::record::ImageRecord;

/// Status entries for `records` (one module's), sorted by image, bounded. Only the
/// entries kept are built: a module may track many more images than status lists.
pub fn image_statuses<'a>(
    records: impl Iterator<Item = (&'a ImageKey, &'a ImageRecord)>,
) -> Vec<ImageStatus> {
    let mut records: Vec<_> = records.collect();
    records.sort_by(|(a, _), (b, _)| a.image.cmp(&b.image));
    records
        .into_iter()
        .take(MAX_IMAGE_STATUSES)
        .map(|(key, record)| ImageStatus {
            image: key.image.clone(),
            kernels: record
                .need
                .kernels
                .iter()
                .take(MAX_IMAGE_KERNELS)
                .cloned()
                .collect(),
            state: record.state.as_str().to_owned(),
            digest: record.digest.clone(),
            reason: record.reason.clone(),
            message: record.message.clone(),
            last_transition_time: Some(Time(record.since)),
        })
        .collect()
}

/// The digest status persisted for `image`, for a new leader to start from.
pub fn persisted_digest<'a>(statuses: &'a [ImageStatus], image: &str) -> Option<&'a str> {
    statuses
        .iter()
        .find(|s| s.image == image)
        .and_then(|s| s.digest.as_deref())
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use k8s_openapi::jiff::Timestamp;

    use super::*;
    use crate::images::ImageNeed;

    #[test]
    fn statuses_are_sorted_bounded_and_round_trip_the_pin() {
        let need = ImageNeed {
            module_uid: String::new(),
            spoke_namespace: String::new(),
            kernels: (0..20).map(|i| format!("6.1.{i}")).collect::<BTreeSet<_>>(),
            tls: Default::default(),
            pull_secret: None,
            build: None,
            sign: None,
            rebuild_generation: 0,
        };
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
        let statuses = image_statuses(records.iter().map(|(k, r)| (k, r)));
        assert_eq!(statuses.len(), MAX_IMAGE_STATUSES);
        assert_eq!(statuses[0].image, "r/x:000");
        assert_eq!(statuses[0].kernels.len(), MAX_IMAGE_KERNELS);
        assert_eq!(statuses[0].state, "Exists");
        assert_eq!(persisted_digest(&statuses, "r/x:007"), Some("sha256:007"));
        assert_eq!(
            persisted_digest(&statuses, "r/x:149"),
            None,
            "beyond the bound"
        );
    }
}
