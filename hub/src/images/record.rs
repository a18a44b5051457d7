//! Where one image stands, and what the hub does next about it. Pure: the runtime
//! performs the step [`due`] names, then hands the outcome to [`observe`].
//!
//! An image is pinned to the digest its tag resolved to when the hub first found it (or
//! signed it), and that digest is what every node loads, so the same bytes land
//! everywhere even if the tag moves. The pin is checked again every
//! [`EXISTS_RECHECK`]: an image the registry lost is noticed and rebuilt, re-signed or
//! reported, never left "existing". Failures back off exponentially; a build is started
//! once per input and retried only after its backoff.
//!
//! An image the hub cannot check (its registry refuses or does not answer the hub) of a
//! module that names no `imageRepoSecret` (the clusters' own credentials serve it) and
//! that the hub needs for no build or signing is resolved by the clusters instead
//! ([`ImageState::SpokeResolved`]):
//! each cluster's proxy resolves the tag with what the cluster has (its own pull Secret,
//! its registry CAs) and reports the digest, which is pinned for that cluster
//! (`super::spoke_pins`). No node ever loads an unpinned image. The hub keeps looking
//! every [`EXISTS_RECHECK`]: once it reaches the registry and finds the digest every
//! cluster pinned, the image is the hub's again (`super::spoke_pins::settle`).
//!
//! A pin, the hub's or a cluster's, holds until [`re_resolve_now`] says otherwise: while
//! `imageRebuildTriggerGeneration` is unchanged, a moved tag moves nothing.

use std::time::Duration;

use k8s_openapi::jiff::{SignedDuration, Timestamp};

use super::need::ImageNeed;

/// How often an existing image's pinned digest is checked again.
pub const EXISTS_RECHECK: Duration = Duration::from_secs(600);
/// How often a running build is looked at (its Job's changes also wake the hub).
pub const BUILD_POLL: Duration = Duration::from_secs(5);
const BACKOFF_FIRST: Duration = Duration::from_secs(10);
const BACKOFF_MAX: Duration = Duration::from_secs(600);

/// The states of upstream KMM's image lifecycle, as status reports them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ImageState {
    Exists,
    NeedsBuild,
    NeedsSign,
    Building,
    Signing,
    Failed,
    NotFound,
    /// The hub cannot check the image: each cluster resolves its tag and loads the digest
    /// it found, pinned for that cluster.
    SpokeResolved,
}

impl ImageState {
    pub const ALL: [Self; 8] = [
        Self::Exists,
        Self::NeedsBuild,
        Self::NeedsSign,
        Self::Building,
        Self::Signing,
        Self::Failed,
        Self::NotFound,
        Self::SpokeResolved,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Exists => "Exists",
            Self::NeedsBuild => "NeedsBuild",
            Self::NeedsSign => "NeedsSign",
            Self::Building => "Building",
            Self::Signing => "Signing",
            Self::Failed => "Failed",
            Self::NotFound => "NotFound",
            Self::SpokeResolved => "SpokeResolved",
        }
    }
}

/// A step the runtime performs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Next {
    /// Ask the registry for the pinned digest (the tag when nothing is pinned yet).
    Check,
    /// Ask the registry what the tag points at now, whatever is pinned.
    Resolve,
    /// Ask the registry for the unsigned image.
    CheckUnsigned,
    /// Start the build, or look at the running one.
    Build,
    /// Replace a failed build with a new attempt.
    RetryBuild,
    /// Sign the unsigned image and push the signed one.
    Sign,
}

/// What a step found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Observation {
    /// The registry has the image, at this digest.
    Found {
        digest: String,
    },
    /// The registry answered that it does not have the image.
    Missing {
        answer: String,
    },
    /// The registry could not be asked, or refused the credentials.
    CheckFailed {
        unauthorized: bool,
        message: String,
    },
    UnsignedFound,
    UnsignedMissing {
        answer: String,
    },
    BuildRunning {
        job: String,
    },
    BuildSucceeded {
        job: String,
    },
    BuildFailed {
        job: String,
        log_tail: String,
    },
    /// A failed build's Job is being replaced.
    BuildRetrying {
        job: String,
    },
    /// The build could not be started (its Dockerfile's ConfigMap is missing, say).
    BuildNotStarted {
        message: String,
    },
    Signed {
        digest: String,
    },
    SignFailed {
        message: String,
    },
}

/// The hub's knowledge of one image.
#[derive(Clone, Debug, PartialEq)]
pub struct ImageRecord {
    pub state: ImageState,
    /// The digest every node loads; kept while a rebuild or a failed check is under way.
    pub digest: Option<String>,
    /// Machine-readable, for node statuses and Events.
    pub reason: String,
    pub message: String,
    /// The need this record was computed for: a changed recipe acts at once.
    pub need: ImageNeed,
    /// Consecutive failures, for the backoff.
    pub failures: u32,
    /// The step to perform at `next_at`.
    pub then: Next,
    pub next_at: Timestamp,
    /// When `state` last changed.
    pub since: Timestamp,
}

/// What nodes get for a kernel whose image this is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Verdict<'a> {
    /// Load these bytes.
    Load { digest: &'a str },
    /// The hub cannot check the image: each cluster's proxy resolves the tag, and the
    /// cluster loads the digest it reported (`super::spoke_pins`).
    ResolveOnSpoke,
    /// Nothing to load yet, and why.
    Wait { reason: &'a str, message: &'a str },
}

impl ImageRecord {
    /// A digest persisted in the module's status by an earlier leader: loadable at once,
    /// checked at once.
    pub fn seeded(need: &ImageNeed, digest: String, now: Timestamp) -> Self {
        Self {
            state: ImageState::Exists,
            digest: Some(digest),
            reason: "ImageExists".into(),
            message: String::new(),
            need: need.clone(),
            failures: 0,
            then: Next::Check,
            next_at: now,
            since: now,
        }
    }

    /// An image an earlier leader left resolved by the clusters (its pins persisted in
    /// the module's status, see `SpokePins::seeded`): it stays so, the hub looking again
    /// at once as for a seeded pin.
    pub fn seeded_spoke_resolved(need: &ImageNeed, message: String, now: Timestamp) -> Self {
        Self {
            state: ImageState::SpokeResolved,
            digest: None,
            reason: "ImageResolvedBySpokes".into(),
            message,
            need: need.clone(),
            failures: 0,
            then: Next::Check,
            next_at: now,
            since: now,
        }
    }

    /// Whether status would say the same of both: rechecks that change nothing visible
    /// do not rewrite status.
    pub fn reported_alike(&self, other: &Self) -> bool {
        (
            self.state,
            &self.digest,
            &self.reason,
            &self.message,
            self.since,
        ) == (
            other.state,
            &other.digest,
            &other.reason,
            &other.message,
            other.since,
        ) && self.need.kernels == other.need.kernels
    }

    pub fn verdict(&self) -> Verdict<'_> {
        match &self.digest {
            Some(digest) => Verdict::Load { digest },
            None if self.state == ImageState::SpokeResolved => Verdict::ResolveOnSpoke,
            None => Verdict::Wait {
                reason: &self.reason,
                message: &self.message,
            },
        }
    }
}

/// The step due for the image now, if any.
pub fn due(need: &ImageNeed, record: Option<&ImageRecord>, now: Timestamp) -> Option<Next> {
    let Some(record) = record else {
        return Some(Next::Check);
    };
    if re_resolve_now(record, need) {
        // The user asked for other bytes: rebuild, re-sign or re-resolve once.
        return Some(if need.build.is_some() {
            Next::Build
        } else if need.sign.is_some() {
            Next::CheckUnsigned
        } else {
            Next::Resolve
        });
    }
    if record.need.tls != need.tls || record.need.pull_secret != need.pull_secret {
        return Some(Next::Check);
    }
    // A spoke-resolved image too: the hub looks again, and takes the image over only
    // where that moves no cluster (`spoke_pins::settle`).
    (record.next_at <= now).then_some(record.then)
}

/// Whether the image's pins (the hub's digest and every cluster's) give way to a new
/// resolution of its tag now: only when the user asks for other bytes, a new
/// `imageRebuildTriggerGeneration` or new build or sign settings. A tag that moved moves
/// nothing otherwise. This is the one place a pull policy that follows tags (upstream's
/// `imagePullPolicy: Always`) decides to look again.
pub fn re_resolve_now(record: &ImageRecord, need: &ImageNeed) -> bool {
    recipe_changed(&record.need, need)
}

/// Whether what the image is made of changed: kernels joining or leaving do not change
/// it, a new rebuild generation or new build or sign settings do.
fn recipe_changed(before: &ImageNeed, now: &ImageNeed) -> bool {
    before.rebuild_generation != now.rebuild_generation
        || before.build != now.build
        || before.sign != now.sign
}

/// The record after `step` found `observation`.
pub fn observe(
    need: &ImageNeed,
    previous: Option<&ImageRecord>,
    step: Next,
    observation: Observation,
    now: Timestamp,
) -> ImageRecord {
    let failures = previous.map_or(0, |r| r.failures);
    let pinned = previous.and_then(|r| r.digest.clone());
    let at = |after: Duration| now + SignedDuration::try_from(after).unwrap_or_default();
    let record =
        |state, digest, reason: &str, message: String, failures, then, next_at| ImageRecord {
            state,
            digest,
            reason: reason.to_owned(),
            message,
            need: need.clone(),
            failures,
            then,
            next_at,
            since: match previous {
                Some(p) if p.state == state => p.since,
                _ => now,
            },
        };
    let failed = |reason: &str, message: String, then| {
        record(
            ImageState::Failed,
            pinned.clone(),
            reason,
            message,
            failures + 1,
            then,
            at(backoff(failures + 1)),
        )
    };
    match observation {
        Observation::Found { digest } | Observation::Signed { digest } => record(
            ImageState::Exists,
            Some(digest),
            "ImageExists",
            String::new(),
            0,
            Next::Check,
            at(EXISTS_RECHECK),
        ),
        Observation::Missing { answer } => {
            if need.sign.is_some() {
                record(
                    ImageState::NeedsSign,
                    None,
                    "ImageNeedsSign",
                    answer,
                    failures,
                    Next::CheckUnsigned,
                    now,
                )
            } else if need.build.is_some() {
                record(
                    ImageState::NeedsBuild,
                    None,
                    "ImageNeedsBuild",
                    answer,
                    failures,
                    Next::Build,
                    now,
                )
            } else {
                record(
                    ImageState::NotFound,
                    None,
                    "ImageNotFound",
                    answer,
                    failures + 1,
                    Next::Resolve,
                    at(backoff(failures + 1)),
                )
            }
        }
        // Nothing pinned, nothing to build or sign, and no credentials of the module's:
        // the hub cannot look (the registry refused or did not answer it), the clusters
        // may, with their own pull Secrets and CAs. A module that names an
        // imageRepoSecret gave the hub what it needs to check: its failures are the hub's.
        Observation::CheckFailed {
            unauthorized,
            message,
        } if pinned.is_none()
            && need.pull_secret.is_none()
            && need.build.is_none()
            && need.sign.is_none() =>
        {
            let why = if unauthorized {
                "the registry refused the hub, and the module names no imageRepoSecret"
            } else {
                "the hub cannot reach the registry, and the module names no imageRepoSecret"
            };
            record(
                ImageState::SpokeResolved,
                None,
                "ImageResolvedBySpokes",
                format!(
                    "{why}: each cluster resolves the tag with its own pull Secret and CAs \
                     and loads the digest it found (status.images[].clusters); the registry \
                     answered the hub: {message}"
                ),
                0,
                Next::Check,
                at(EXISTS_RECHECK),
            )
        }
        Observation::CheckFailed {
            unauthorized,
            message,
        } => failed(
            if unauthorized {
                "RegistryUnauthorized"
            } else {
                "ImageCheckFailed"
            },
            message,
            step,
        ),
        Observation::UnsignedFound => record(
            ImageState::NeedsSign,
            pinned,
            "ImageNeedsSign",
            String::new(),
            failures,
            Next::Sign,
            now,
        ),
        Observation::UnsignedMissing { answer } => {
            if need.build.is_some() {
                record(
                    ImageState::NeedsBuild,
                    pinned,
                    "ImageNeedsBuild",
                    answer,
                    failures,
                    Next::Build,
                    now,
                )
            } else {
                record(
                    ImageState::NotFound,
                    pinned,
                    "UnsignedImageNotFound",
                    answer,
                    failures + 1,
                    Next::CheckUnsigned,
                    at(backoff(failures + 1)),
                )
            }
        }
        Observation::BuildRunning { job } => record(
            ImageState::Building,
            pinned,
            "ImageBuilding",
            format!("build Job {job} is running"),
            failures,
            Next::Build,
            at(BUILD_POLL),
        ),
        Observation::BuildSucceeded { job } if need.sign.is_some() => record(
            ImageState::Signing,
            pinned,
            "ImageSigning",
            format!("build Job {job} succeeded; signing"),
            0,
            Next::Sign,
            now,
        ),
        Observation::BuildSucceeded { job } => record(
            ImageState::Building,
            pinned,
            "ImageBuilding",
            format!("build Job {job} succeeded; checking the image"),
            0,
            Next::Resolve,
            now,
        ),
        Observation::BuildFailed { job, log_tail } => failed(
            "BuildFailed",
            format!("build Job {job} failed; the end of its log:\n{log_tail}"),
            Next::RetryBuild,
        ),
        // The failures stay counted: failing again backs off longer.
        Observation::BuildRetrying { job } => record(
            ImageState::Building,
            pinned,
            "ImageBuilding",
            format!("retrying: the failed build Job {job} is being replaced"),
            failures,
            Next::Build,
            at(BUILD_POLL),
        ),
        Observation::BuildNotStarted { message } => failed("BuildNotStarted", message, Next::Build),
        Observation::SignFailed { message } => failed("SignFailed", message, Next::CheckUnsigned),
    }
}

/// 10 s, doubling, at most 10 min.
pub fn backoff(failures: u32) -> Duration {
    let doublings = failures.saturating_sub(1).min(16);
    BACKOFF_FIRST
        .saturating_mul(1 << doublings)
        .min(BACKOFF_MAX)
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use kmm_api::Build;
    use kmm_registry::RegistryTls;

    use super::*;
    use crate::images::need::SignPlan;

    fn plain() -> ImageNeed {
        ImageNeed {
            module_uid: "u".into(),
            spoke_namespace: "drivers".into(),
            kernels: BTreeSet::from(["6.1.0".to_string()]),
            tls: Default::default(),
            pull_secret: None,
            build: None,
            sign: None,
            rebuild_generation: 0,
        }
    }

    fn built() -> ImageNeed {
        ImageNeed {
            build: Some(Build::default()),
            ..plain()
        }
    }

    fn signed(build: bool) -> ImageNeed {
        ImageNeed {
            build: build.then(Build::default),
            sign: Some(SignPlan {
                unsigned_image: "r/x:1-unsigned".into(),
                unsigned_tls: Default::default(),
                key_secret: "key".into(),
                cert_secret: "cert".into(),
                files: vec!["/opt/x.ko".into()],
            }),
            ..plain()
        }
    }

    fn now() -> Timestamp {
        Timestamp::from_second(1_800_000_000).unwrap()
    }

    fn later(secs: i64) -> Timestamp {
        now() + SignedDuration::from_secs(secs)
    }

    /// Runs steps from `start` while they are due now, answering each from `answer`.
    fn run(
        need: &ImageNeed,
        mut record: Option<ImageRecord>,
        mut answer: impl FnMut(Next) -> Observation,
    ) -> (Vec<Next>, ImageRecord) {
        let mut steps = vec![];
        while let Some(step) = due(need, record.as_ref(), now()) {
            assert!(steps.len() < 10, "steps never settle: {steps:?}");
            steps.push(step);
            record = Some(observe(need, record.as_ref(), step, answer(step), now()));
        }
        (steps, record.expect("at least one step"))
    }

    #[test]
    fn an_existing_image_is_pinned_and_rechecked_later() {
        let (steps, record) = run(&plain(), None, |_| Observation::Found {
            digest: "sha256:aa".into(),
        });
        assert_eq!(steps, [Next::Check]);
        assert_eq!(record.state, ImageState::Exists);
        assert_eq!(
            record.verdict(),
            Verdict::Load {
                digest: "sha256:aa"
            }
        );
        assert_eq!(due(&plain(), Some(&record), later(599)), None);
        assert_eq!(due(&plain(), Some(&record), later(600)), Some(Next::Check));
    }

    #[test]
    fn a_missing_image_without_recipe_is_not_found_and_backs_off() {
        let (_, first) = run(&plain(), None, |_| Observation::Missing {
            answer: "manifest unknown".into(),
        });
        assert_eq!(first.state, ImageState::NotFound);
        assert_eq!(
            first.verdict(),
            Verdict::Wait {
                reason: "ImageNotFound",
                message: "manifest unknown"
            }
        );
        assert_eq!(first.next_at, later(10));
        let second = observe(
            &plain(),
            Some(&first),
            Next::Resolve,
            Observation::Missing {
                answer: "manifest unknown".into(),
            },
            now(),
        );
        assert_eq!(second.next_at, later(20));
        assert_eq!(second.since, first.since, "same state, same since");
        assert_eq!(backoff(30), BACKOFF_MAX);
    }

    #[test]
    fn a_lost_image_is_noticed_and_rebuilt() {
        let pinned = observe(
            &built(),
            None,
            Next::Check,
            Observation::Found {
                digest: "sha256:aa".into(),
            },
            now(),
        );
        let mut pinned_again = pinned.clone();
        pinned_again.next_at = now();
        let (steps, record) = run(&built(), Some(pinned_again), |step| match step {
            Next::Check => Observation::Missing {
                answer: "gone".into(),
            },
            Next::Build => Observation::BuildRunning { job: "j".into() },
            other => panic!("unexpected {other:?}"),
        });
        assert_eq!(steps, [Next::Check, Next::Build]);
        assert_eq!(record.state, ImageState::Building);
        assert_eq!(
            record.digest, None,
            "the lost digest is not loaded anywhere"
        );
        assert_eq!(record.next_at, later(5));
    }

    #[test]
    fn build_then_sign_then_pin() {
        let need = signed(true);
        let (steps, building) = run(&need, None, |step| match step {
            Next::Check => Observation::Missing {
                answer: "manifest unknown".into(),
            },
            Next::CheckUnsigned => Observation::UnsignedMissing {
                answer: "manifest unknown".into(),
            },
            Next::Build => Observation::BuildRunning { job: "j".into() },
            other => panic!("unexpected {other:?}"),
        });
        assert_eq!(steps, [Next::Check, Next::CheckUnsigned, Next::Build]);
        assert_eq!(building.state, ImageState::Building);
        let mut polled = building.clone();
        polled.next_at = now();
        let (steps, done) = run(&need, Some(polled), |step| match step {
            Next::Build => Observation::BuildSucceeded { job: "j".into() },
            Next::Sign => Observation::Signed {
                digest: "sha256:bb".into(),
            },
            other => panic!("unexpected {other:?}"),
        });
        assert_eq!(steps, [Next::Build, Next::Sign]);
        assert_eq!(done.state, ImageState::Exists);
        assert_eq!(done.digest.as_deref(), Some("sha256:bb"));
    }

    #[test]
    fn sign_only_signs_an_existing_unsigned_image_or_says_it_is_missing() {
        let need = signed(false);
        let (steps, record) = run(&need, None, |step| match step {
            Next::Check => Observation::Missing {
                answer: "no".into(),
            },
            Next::CheckUnsigned => Observation::UnsignedFound,
            Next::Sign => Observation::SignFailed {
                message: "certSecret cert: Secret not found".into(),
            },
            other => panic!("unexpected {other:?}"),
        });
        assert_eq!(steps, [Next::Check, Next::CheckUnsigned, Next::Sign]);
        assert_eq!(
            (record.state, record.reason.as_str()),
            (ImageState::Failed, "SignFailed")
        );
        assert_eq!(record.then, Next::CheckUnsigned);
        assert_eq!(record.next_at, later(10));
        let (_, missing) = run(&need, None, |step| match step {
            Next::Check => Observation::Missing {
                answer: "no".into(),
            },
            _ => Observation::UnsignedMissing {
                answer: "r/x:1-unsigned: manifest unknown".into(),
            },
        });
        assert_eq!(missing.reason, "UnsignedImageNotFound");
        assert!(missing.message.contains("r/x:1-unsigned"));
    }

    #[test]
    fn a_failed_build_reports_its_log_and_is_retried_only_after_backoff() {
        let need = built();
        let (_, failed) = run(&need, None, |step| match step {
            Next::Check => Observation::Missing {
                answer: "no".into(),
            },
            _ => Observation::BuildFailed {
                job: "kmm-build-x".into(),
                log_tail: "make: *** [all] Error 2".into(),
            },
        });
        assert_eq!(failed.state, ImageState::Failed);
        assert!(failed.message.contains("make: *** [all] Error 2"));
        assert_eq!(due(&need, Some(&failed), later(9)), None);
        assert_eq!(due(&need, Some(&failed), later(10)), Some(Next::RetryBuild));
    }

    #[test]
    fn a_retried_build_that_fails_again_backs_off_longer() {
        let need = built();
        let failed = |previous: Option<&ImageRecord>| {
            observe(
                &need,
                previous,
                Next::Build,
                Observation::BuildFailed {
                    job: "kmm-build-x".into(),
                    log_tail: "Error 2".into(),
                },
                now(),
            )
        };
        let first = failed(None);
        let retrying = observe(
            &need,
            Some(&first),
            Next::RetryBuild,
            Observation::BuildRetrying {
                job: "kmm-build-x".into(),
            },
            now(),
        );
        assert_eq!(retrying.state, ImageState::Building);
        assert!(
            retrying.message.contains("kmm-build-x"),
            "{}",
            retrying.message
        );
        assert_eq!(due(&need, Some(&retrying), later(5)), Some(Next::Build));
        let second = failed(Some(&retrying));
        assert_eq!(second.failures, 2);
        assert_eq!(due(&need, Some(&second), later(19)), None);
        assert_eq!(due(&need, Some(&second), later(20)), Some(Next::RetryBuild));
    }

    #[test]
    fn a_failed_check_keeps_the_pin_loadable() {
        let pinned = observe(
            &plain(),
            None,
            Next::Check,
            Observation::Found {
                digest: "sha256:aa".into(),
            },
            now(),
        );
        let failed = observe(
            &plain(),
            Some(&pinned),
            Next::Check,
            Observation::CheckFailed {
                unauthorized: true,
                message: "401".into(),
            },
            now(),
        );
        assert_eq!(failed.reason, "RegistryUnauthorized");
        assert_eq!(
            failed.verdict(),
            Verdict::Load {
                digest: "sha256:aa"
            }
        );
        assert_eq!(failed.then, Next::Check);
    }

    #[test]
    fn an_image_the_hub_cannot_check_is_resolved_by_the_spokes() {
        let refused = || Observation::CheckFailed {
            unauthorized: true,
            message: "unauthorized: authentication required".into(),
        };
        let (steps, spoke) = run(&plain(), None, |_| refused());
        assert_eq!(steps, [Next::Check]);
        assert_eq!(spoke.state, ImageState::SpokeResolved);
        assert_eq!(spoke.verdict(), Verdict::ResolveOnSpoke);
        assert!(
            spoke.message.contains("each cluster resolves the tag")
                && spoke.message.ends_with("authentication required"),
            "{}",
            spoke.message
        );
        assert_eq!(spoke.failures, 0, "not a failure: nothing backs off");
        // A registry that does not answer the hub at all: the spokes may reach it.
        let unreachable = observe(
            &plain(),
            None,
            Next::Check,
            Observation::CheckFailed {
                unauthorized: false,
                message: "connection refused".into(),
            },
            now(),
        );
        assert_eq!(unreachable.state, ImageState::SpokeResolved);
        assert!(unreachable.message.contains("cannot reach"));
        // The module's own Secret (the hub was given what it needs to check), or
        // something for the hub to build or sign: a failure, nothing loaded.
        let with_secret = ImageNeed {
            pull_secret: Some("pull".into()),
            ..plain()
        };
        for need in [with_secret.clone(), built(), signed(false)] {
            let failed = observe(&need, None, Next::Check, refused(), now());
            assert_eq!(
                (failed.state, failed.reason.as_str()),
                (ImageState::Failed, "RegistryUnauthorized"),
                "{need:?}"
            );
            assert!(matches!(failed.verdict(), Verdict::Wait { .. }));
        }
        let unreachable_with_secret = observe(
            &with_secret,
            None,
            Next::Check,
            Observation::CheckFailed {
                unauthorized: false,
                message: "certificate verify failed".into(),
            },
            now(),
        );
        assert_eq!(
            (
                unreachable_with_secret.state,
                unreachable_with_secret.reason.as_str()
            ),
            (ImageState::Failed, "ImageCheckFailed")
        );
    }

    #[test]
    fn a_spoke_resolved_image_is_looked_at_again_only_for_a_new_recipe() {
        let spoke = observe(
            &plain(),
            None,
            Next::Check,
            Observation::CheckFailed {
                unauthorized: true,
                message: "401".into(),
            },
            now(),
        );
        // The hub looks again later, as for a pin (whether it may take the image over is
        // `spoke_pins::settle`'s); no re-resolution while the generation holds.
        assert_eq!(due(&plain(), Some(&spoke), later(599)), None);
        assert_eq!(due(&plain(), Some(&spoke), later(600)), Some(Next::Check));
        assert!(!re_resolve_now(&spoke, &plain()));
        // A new rebuild generation: the hub tries first, and pins for the whole fleet if
        // it can now.
        let bumped = ImageNeed {
            rebuild_generation: 1,
            ..plain()
        };
        assert!(re_resolve_now(&spoke, &bumped));
        assert_eq!(due(&bumped, Some(&spoke), now()), Some(Next::Resolve));
        let pinned = observe(
            &bumped,
            Some(&spoke),
            Next::Resolve,
            Observation::Found {
                digest: "sha256:aa".into(),
            },
            now(),
        );
        assert_eq!(
            pinned.verdict(),
            Verdict::Load {
                digest: "sha256:aa"
            }
        );
        // Other TLS settings (a module change) are worth one more look by the hub.
        let insecure = ImageNeed {
            tls: RegistryTls {
                insecure: true,
                insecure_skip_tls_verify: false,
            },
            ..plain()
        };
        assert_eq!(due(&insecure, Some(&spoke), now()), Some(Next::Check));
    }

    #[test]
    fn a_pinned_image_whose_registry_stops_answering_the_hub_keeps_its_pin() {
        let pinned = observe(
            &plain(),
            None,
            Next::Check,
            Observation::Found {
                digest: "sha256:aa".into(),
            },
            now(),
        );
        let unreachable = observe(
            &plain(),
            Some(&pinned),
            Next::Check,
            Observation::CheckFailed {
                unauthorized: false,
                message: "connection refused".into(),
            },
            now(),
        );
        assert_eq!(unreachable.state, ImageState::Failed);
        assert_eq!(
            unreachable.verdict(),
            Verdict::Load {
                digest: "sha256:aa"
            },
            "the hub's pin holds: the clusters are not asked for another"
        );
    }

    #[test]
    fn a_new_recipe_acts_at_once_and_only_once() {
        let need = built();
        let pinned = observe(
            &need,
            None,
            Next::Check,
            Observation::Found {
                digest: "sha256:aa".into(),
            },
            now(),
        );
        let mut changed = need.clone();
        changed.build = Some(Build {
            build_args: Some(vec![kmm_api::BuildArg {
                name: "A".into(),
                value: "2".into(),
            }]),
            ..Build::default()
        });
        assert_eq!(due(&changed, Some(&pinned), now()), Some(Next::Build));
        let building = observe(
            &changed,
            Some(&pinned),
            Next::Build,
            Observation::BuildRunning { job: "j2".into() },
            now(),
        );
        assert_eq!(
            building.verdict(),
            Verdict::Load {
                digest: "sha256:aa"
            },
            "nodes keep the old bytes until the new ones exist"
        );
        assert_eq!(due(&changed, Some(&building), now()), None, "only once");
        // A plain image re-resolves its tag on a new rebuild generation.
        let plain_pinned = observe(
            &plain(),
            None,
            Next::Check,
            Observation::Found {
                digest: "sha256:aa".into(),
            },
            now(),
        );
        let bumped = ImageNeed {
            rebuild_generation: 1,
            ..plain()
        };
        assert_eq!(
            due(&bumped, Some(&plain_pinned), now()),
            Some(Next::Resolve)
        );
        // Kernels joining change nothing.
        let mut more = plain();
        more.kernels.insert("6.1.1".into());
        assert_eq!(due(&more, Some(&plain_pinned), now()), None);
    }

    #[test]
    fn a_seeded_spoke_resolved_image_stays_with_the_clusters() {
        let seeded = ImageRecord::seeded_spoke_resolved(&plain(), "m".into(), now());
        assert_eq!(seeded.verdict(), Verdict::ResolveOnSpoke);
        assert_eq!(due(&plain(), Some(&seeded), now()), Some(Next::Check));
    }

    #[test]
    fn a_seeded_pin_loads_at_once_and_is_checked_at_once() {
        let seeded = ImageRecord::seeded(&plain(), "sha256:aa".into(), now());
        assert_eq!(
            seeded.verdict(),
            Verdict::Load {
                digest: "sha256:aa"
            }
        );
        assert_eq!(due(&plain(), Some(&seeded), now()), Some(Next::Check));
    }
}
