//! A proxy's `SpokeImageReport` as the hub takes it: bounded, and only answers that can
//! be pins. Pure.

use kmm_proto::limits::{ERROR_TEXT, MODULE_VERSION, SPOKE_IMAGES, truncated};
use kmm_proto::v1::{SpokeImageReport, spoke_image};

use crate::images::spoke_pins::SpokeAnswer;
use crate::images::{ImageKey, SpokePin};

/// The report's answers, and how many were dropped: beyond [`SPOKE_IMAGES`], without a
/// module, an image or a result, or with a digest that is not one (`<algorithm>:<hex>`,
/// at most [`MODULE_VERSION`] bytes). Failure texts are cut to [`ERROR_TEXT`].
pub fn spoke_answers(report: SpokeImageReport) -> (Vec<SpokeAnswer>, usize) {
    let total = report.images.len();
    let answers: Vec<SpokeAnswer> = report
        .images
        .into_iter()
        .take(SPOKE_IMAGES)
        .filter_map(|image| {
            let module = image.module.filter(|m| !m.name.is_empty())?.name;
            if image.image.is_empty() {
                return None;
            }
            let pin = match image.result? {
                spoke_image::Result::Digest(digest) if is_digest(&digest) => {
                    SpokePin::Digest(digest)
                }
                spoke_image::Result::Digest(_) => return None,
                spoke_image::Result::Failure(failure) => SpokePin::Failed {
                    reason: truncated(&failure.reason, ERROR_TEXT).to_owned(),
                    message: truncated(&failure.message, ERROR_TEXT).to_owned(),
                },
            };
            Some(SpokeAnswer {
                key: ImageKey {
                    module,
                    image: image.image,
                },
                generation: image.image_generation,
                pin,
            })
        })
        .collect();
    let dropped = total - answers.len();
    (answers, dropped)
}

/// `sha256:<64 hex>` or another algorithm's `<name>:<hex>`, within the bound.
fn is_digest(digest: &str) -> bool {
    digest.len() <= MODULE_VERSION
        && digest.split_once(':').is_some_and(|(algorithm, hex)| {
            !algorithm.is_empty()
                && algorithm
                    .bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit())
                && !hex.is_empty()
                && hex.bytes().all(|b| b.is_ascii_hexdigit())
        })
}

#[cfg(test)]
mod tests {
    use kmm_proto::v1::{ModuleKey, SpokeImage, Unresolved};

    use super::*;

    fn image(name: &str, result: spoke_image::Result) -> SpokeImage {
        SpokeImage {
            module: Some(ModuleKey {
                namespace: "drivers".into(),
                name: name.into(),
            }),
            image: "r/x:v1".into(),
            image_generation: 3,
            result: Some(result),
        }
    }

    #[test]
    fn answers_that_can_be_pins_are_taken_and_the_rest_counted() {
        let digest = format!("sha256:{}", "a".repeat(64));
        let report = SpokeImageReport {
            images: vec![
                image("m", spoke_image::Result::Digest(digest.clone())),
                image(
                    "n",
                    spoke_image::Result::Failure(Unresolved {
                        reason: "ImageNotFound".into(),
                        message: "x".repeat(ERROR_TEXT + 10),
                    }),
                ),
                image("m", spoke_image::Result::Digest("latest".into())),
                image("", spoke_image::Result::Digest(digest.clone())),
                SpokeImage {
                    result: None,
                    ..image("m", spoke_image::Result::Digest(digest.clone()))
                },
            ],
        };
        let (answers, dropped) = spoke_answers(report);
        assert_eq!(dropped, 3);
        assert_eq!(
            answers[0],
            SpokeAnswer {
                key: ImageKey {
                    module: "m".into(),
                    image: "r/x:v1".into()
                },
                generation: 3,
                pin: SpokePin::Digest(digest.clone()),
            }
        );
        let SpokePin::Failed { reason, message } = &answers[1].pin else {
            panic!("a failure")
        };
        assert_eq!(reason, "ImageNotFound");
        assert_eq!(message.len(), ERROR_TEXT);

        let many = SpokeImageReport {
            images: vec![image("m", spoke_image::Result::Digest(digest)); SPOKE_IMAGES + 5],
        };
        let (answers, dropped) = spoke_answers(many);
        assert_eq!((answers.len(), dropped), (SPOKE_IMAGES, 5));
    }
}
