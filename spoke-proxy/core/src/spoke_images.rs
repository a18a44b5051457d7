//! The images the hub cannot check and asks this cluster to resolve
//! (`KernelTarget.resolve`), and the cluster's answers, which the proxy reports
//! (`SpokeImageReport`) and the hub pins for this cluster. Pure: `spoke_image_sync`
//! asks the registry.
//!
//! A tag is resolved once per request (module, image, `imageRebuildTriggerGeneration`):
//! the digest found is the answer for as long as the hub asks or loads that image, so a
//! hub that forgot it (a new leader beyond what status keeps) hears the same digest
//! again, never one a moved tag points at now. A failed resolution is retried with a
//! backoff, 10 s doubling to 5 min.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use kmm_proto::v1::{
    IntentSnapshot, ModuleKey, ModuleLoad, SpokeImage, SpokeImageReport, Unresolved,
    kernel_target::Target, spoke_image,
};

const RETRY_FIRST: Duration = Duration::from_secs(10);
const RETRY_MAX: Duration = Duration::from_secs(300);

/// One request of the hub's.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Request {
    pub namespace: String,
    pub module: String,
    pub image: String,
    pub generation: i64,
}

/// What the cluster answered.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Answer {
    Digest(String),
    Failed {
        reason: String,
        message: String,
        failures: u32,
        retry_at: Instant,
    },
}

/// See the module documentation.
#[derive(Clone, Debug, Default)]
pub struct SpokeImages {
    /// The requests of the current snapshot, with the load to resolve (image, registry
    /// TLS, credential id).
    requested: BTreeMap<Request, ModuleLoad>,
    answers: BTreeMap<Request, Answer>,
}

impl SpokeImages {
    /// Takes the requests of the hub's current `snapshot`. An answer is kept while its
    /// request is made, or, for a digest, while the module loads that image (the hub
    /// pinned it): otherwise it is forgotten.
    pub fn set_requests(&mut self, snapshot: &IntentSnapshot) {
        let mut requested = BTreeMap::new();
        let mut loaded = BTreeSet::new();
        for intent in &snapshot.modules {
            let key = intent.key.clone().unwrap_or_default();
            for target in &intent.kernels {
                match &target.target {
                    Some(Target::Resolve(resolution)) => {
                        let load = resolution.load.clone().unwrap_or_default();
                        requested.insert(
                            Request {
                                namespace: key.namespace.clone(),
                                module: key.name.clone(),
                                image: load.image.clone(),
                                generation: resolution.image_generation,
                            },
                            load,
                        );
                    }
                    Some(Target::Load(load)) => {
                        loaded.insert((
                            key.namespace.clone(),
                            key.name.clone(),
                            load.image.clone(),
                        ));
                    }
                    _ => {}
                }
            }
        }
        self.answers.retain(|request, answer| {
            requested.contains_key(request)
                || (matches!(answer, Answer::Digest(_))
                    && loaded.contains(&(
                        request.namespace.clone(),
                        request.module.clone(),
                        request.image.clone(),
                    )))
        });
        self.requested = requested;
    }

    /// The requests to resolve at `now`: never answered, or failed and due again.
    pub fn due(&self, now: Instant) -> Vec<(Request, ModuleLoad)> {
        self.requested
            .iter()
            .filter(|(request, _)| match self.answers.get(*request) {
                None => true,
                Some(Answer::Digest(_)) => false,
                Some(Answer::Failed { retry_at, .. }) => *retry_at <= now,
            })
            .map(|(request, load)| (request.clone(), load.clone()))
            .collect()
    }

    /// Makes every failed request due at once: what it failed for (the cluster's pull
    /// Secret, say) changed.
    pub fn retry_failed_now(&mut self, now: Instant) {
        for answer in self.answers.values_mut() {
            if let Answer::Failed { retry_at, .. } = answer {
                *retry_at = now;
            }
        }
    }

    /// When the next failed request is due again.
    pub fn next_retry(&self) -> Option<Instant> {
        self.requested
            .keys()
            .filter_map(|request| match self.answers.get(request) {
                Some(Answer::Failed { retry_at, .. }) => Some(*retry_at),
                _ => None,
            })
            .min()
    }

    /// Records what resolving `request` found. A digest answered before stays. Returns
    /// whether the report changed.
    pub fn answered(
        &mut self,
        request: Request,
        found: Result<String, Unresolved>,
        now: Instant,
    ) -> bool {
        let before = self.answers.get(&request).cloned();
        let answer = match (found, &before) {
            (_, Some(Answer::Digest(_))) => return false,
            (Ok(digest), _) => Answer::Digest(digest),
            (Err(why), previous) => {
                let failures = match previous {
                    Some(Answer::Failed { failures, .. }) => failures + 1,
                    _ => 1,
                };
                Answer::Failed {
                    reason: why.reason,
                    message: why.message,
                    failures,
                    retry_at: now + retry_after(failures),
                }
            }
        };
        let changed = !same_report(before.as_ref(), &answer);
        self.answers.insert(request, answer);
        changed
    }

    /// The answers to report, to the requests still made and the digests kept.
    pub fn report(&self) -> SpokeImageReport {
        SpokeImageReport {
            images: self
                .answers
                .iter()
                .map(|(request, answer)| SpokeImage {
                    module: Some(ModuleKey {
                        namespace: request.namespace.clone(),
                        name: request.module.clone(),
                    }),
                    image: request.image.clone(),
                    image_generation: request.generation,
                    result: Some(match answer {
                        Answer::Digest(digest) => spoke_image::Result::Digest(digest.clone()),
                        Answer::Failed {
                            reason, message, ..
                        } => spoke_image::Result::Failure(Unresolved {
                            reason: reason.clone(),
                            message: message.clone(),
                        }),
                    }),
                })
                .collect(),
        }
    }
}

/// Whether the hub would hear the same of both (a retry's time is the proxy's own).
fn same_report(before: Option<&Answer>, after: &Answer) -> bool {
    match (before, after) {
        (Some(Answer::Digest(a)), Answer::Digest(b)) => a == b,
        (
            Some(Answer::Failed {
                reason: r1,
                message: m1,
                ..
            }),
            Answer::Failed {
                reason: r2,
                message: m2,
                ..
            },
        ) => (r1, m1) == (r2, m2),
        _ => false,
    }
}

/// 10 s, doubling, at most 5 min.
fn retry_after(failures: u32) -> Duration {
    RETRY_FIRST
        .saturating_mul(1 << failures.saturating_sub(1).min(16))
        .min(RETRY_MAX)
}

#[cfg(test)]
mod tests {
    use kmm_proto::v1::{ImageResolution, KernelTarget, ModuleIntent};

    use super::*;

    fn load(image: &str) -> ModuleLoad {
        ModuleLoad {
            image: image.into(),
            ..ModuleLoad::default()
        }
    }

    fn snapshot(targets: Vec<Target>) -> IntentSnapshot {
        IntentSnapshot {
            modules: vec![ModuleIntent {
                key: Some(ModuleKey {
                    namespace: "drivers".into(),
                    name: "m".into(),
                }),
                kernels: targets
                    .into_iter()
                    .enumerate()
                    .map(|(i, target)| KernelTarget {
                        kernel: format!("6.1.{i}"),
                        target: Some(target),
                    })
                    .collect(),
                ..ModuleIntent::default()
            }],
            ..IntentSnapshot::default()
        }
    }

    fn resolve(image: &str, generation: i64) -> Target {
        Target::Resolve(ImageResolution {
            load: Some(load(image)),
            image_generation: generation,
            failed: None,
        })
    }

    fn request(image: &str, generation: i64) -> Request {
        Request {
            namespace: "drivers".into(),
            module: "m".into(),
            image: image.into(),
            generation,
        }
    }

    fn not_found() -> Unresolved {
        Unresolved {
            reason: "ImageNotFound".into(),
            message: "r/x:v1: manifest unknown".into(),
        }
    }

    #[test]
    fn each_request_is_resolved_once_and_its_digest_kept_while_loaded() {
        let now = Instant::now();
        let mut images = SpokeImages::default();
        // Two kernels of one image: one request.
        images.set_requests(&snapshot(vec![resolve("r/x:v1", 0), resolve("r/x:v1", 0)]));
        let due = images.due(now);
        assert_eq!(due.len(), 1);
        assert_eq!(due[0].0, request("r/x:v1", 0));
        assert!(images.answered(request("r/x:v1", 0), Ok("sha256:aa".into()), now));
        assert!(images.due(now).is_empty());
        assert!(
            !images.answered(request("r/x:v1", 0), Ok("sha256:bb".into()), now),
            "a digest answered stays"
        );
        // The hub pinned it: the request becomes a load, the answer is kept.
        let mut pinned = load("r/x:v1");
        pinned.digest = "sha256:aa".into();
        images.set_requests(&snapshot(vec![Target::Load(pinned)]));
        let report = images.report();
        assert_eq!(report.images.len(), 1);
        assert_eq!(
            report.images[0].result,
            Some(spoke_image::Result::Digest("sha256:aa".into()))
        );
        // A new leader asks again: the same digest, no new resolution.
        images.set_requests(&snapshot(vec![resolve("r/x:v1", 0)]));
        assert!(images.due(now).is_empty());
        // A new generation is a new request.
        images.set_requests(&snapshot(vec![resolve("r/x:v1", 1)]));
        assert_eq!(images.due(now)[0].0, request("r/x:v1", 1));
        assert!(images.report().images.is_empty(), "the old answer went");
    }

    #[test]
    fn a_failure_is_reported_and_retried_with_a_backoff() {
        let now = Instant::now();
        let mut images = SpokeImages::default();
        images.set_requests(&snapshot(vec![resolve("r/x:v1", 0)]));
        assert!(images.answered(request("r/x:v1", 0), Err(not_found()), now));
        assert_eq!(images.next_retry(), Some(now + Duration::from_secs(10)));
        assert!(images.due(now + Duration::from_secs(9)).is_empty());
        assert_eq!(images.due(now + Duration::from_secs(10)).len(), 1);
        assert!(
            !images.answered(request("r/x:v1", 0), Err(not_found()), now),
            "the same failure again: nothing new to report"
        );
        assert_eq!(images.next_retry(), Some(now + Duration::from_secs(20)));
        let Some(spoke_image::Result::Failure(failure)) = &images.report().images[0].result else {
            panic!("a failure")
        };
        assert_eq!(failure.reason, "ImageNotFound");
        images.retry_failed_now(now);
        assert_eq!(images.due(now).len(), 1, "what it failed for changed");
        assert!(images.answered(request("r/x:v1", 0), Ok("sha256:aa".into()), now));
        assert_eq!(images.next_retry(), None);
        // A failure no longer asked for is forgotten.
        images.set_requests(&snapshot(vec![resolve("r/y:v1", 0)]));
        images.answered(request("r/y:v1", 0), Err(not_found()), now);
        images.set_requests(&snapshot(vec![]));
        assert!(images.report().images.is_empty());
        assert_eq!(retry_after(40), RETRY_MAX);
    }
}
