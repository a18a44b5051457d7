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
//! With `imagePullPolicy: Always` the hub follows the tag instead: it resolves it again
//! every `follow_interval` (once per image, however many clusters load it) and, when it
//! moved, pins the new digest at the module's next pin generation, keeping the earlier
//! pins. The pin generation is part of the module's revision (`fleet::revisions`), so
//! clusters on an earlier revision keep loading the earlier digest until the rollout
//! moves them ([`ImageRecord::digest_at`]).
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
use kmm_api::{ImagePin, MAX_EARLIER_PINS};

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
    /// The module's pin generation when `digest` was pinned: revisions of that generation
    /// or later load it. 0 for a first pin, which every revision loads.
    pub pinned_at: i64,
    /// Digests pinned before `digest` (a followed tag that moved), oldest first, at most
    /// [`MAX_EARLIER_PINS`]: what clusters on earlier revisions load.
    pub earlier: Vec<ImagePin>,
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
            pinned_at: 0,
            earlier: Vec::new(),
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
            pinned_at: 0,
            earlier: Vec::new(),
        }
    }

    /// The record with the pins an earlier leader persisted along with its digest.
    pub fn with_pins(mut self, pinned_at: i64, earlier: Vec<ImagePin>) -> Self {
        self.pinned_at = pinned_at;
        self.earlier = earlier;
        self
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
            self.pinned_at,
            &self.earlier,
        ) == (
            other.state,
            &other.digest,
            &other.reason,
            &other.message,
            other.since,
            other.pinned_at,
            &other.earlier,
        ) && self.need.kernels == other.need.kernels
    }

    /// What nodes on the module's latest revision get.
    pub fn verdict(&self) -> Verdict<'_> {
        self.verdict_at(i64::MAX)
    }

    /// What nodes on a revision of `pin_generation` get.
    pub fn verdict_at(&self, pin_generation: i64) -> Verdict<'_> {
        match self.digest_at(pin_generation) {
            Some(digest) => Verdict::Load { digest },
            None if self.state == ImageState::SpokeResolved => Verdict::ResolveOnSpoke,
            None => Verdict::Wait {
                reason: &self.reason,
                message: &self.message,
            },
        }
    }

    /// The digest a revision of `pin_generation` loads: the newest pin made at or before
    /// it. An image first pinned after that revision was cut (a kernel that appeared
    /// since) loads its oldest pin kept. Nothing while the image has no pin at all: a lost
    /// image is lost for every revision.
    pub fn digest_at(&self, pin_generation: i64) -> Option<&str> {
        let latest = self.digest.as_deref()?;
        if pin_generation >= self.pinned_at {
            return Some(latest);
        }
        self.earlier
            .iter()
            .rev()
            .find(|pin| pin.pin_generation <= pin_generation)
            .or(self.earlier.first())
            .map_or(Some(latest), |pin| Some(pin.digest.as_str()))
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
    if record.need.tls != need.tls
        || record.need.pull_secret != need.pull_secret
        || record.need.access != need.access
    {
        return Some(Next::Check);
    }
    // A spoke-resolved image too: the hub looks again, and takes the image over only
    // where that moves no cluster (`spoke_pins::settle`).
    let follows = need.follow_interval.is_some();
    if follows != record.need.follow_interval.is_some() {
        // The policy changed: start following the tag, or hold the pin, now.
        return Some(if follows { Next::Resolve } else { Next::Check });
    }
    (record.next_at <= now).then_some(match record.then {
        // A followed image's recheck looks at the tag, not at the pinned digest.
        Next::Check if follows && record.digest.is_some() => Next::Resolve,
        step => step,
    })
}

/// Whether the image's pins (the hub's digest and every cluster's) give way to a new
/// resolution of its tag now: when the user asks for other bytes, a new
/// `imageRebuildTriggerGeneration` or new build or sign settings. `imagePullPolicy:
/// Always` follows a hub-checked image's tag on its own schedule (`follow_interval`,
/// in [`due`]); the clusters' pins of a spoke-resolved image follow no tag.
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
            pinned_at: previous.map_or(0, |p| p.pinned_at),
            earlier: previous.map(|p| p.earlier.clone()).unwrap_or_default(),
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
        Observation::Found { digest } | Observation::Signed { digest } => {
            let (then, recheck) = match need.follow_interval {
                Some(every) => (Next::Resolve, every),
                None => (Next::Check, EXISTS_RECHECK),
            };
            let moved_from = pinned
                .clone()
                .filter(|before| need.follow_interval.is_some() && *before != digest);
            let message = moved_from.as_ref().map_or_else(String::new, |before| {
                format!(
                    "the tag moved from {before} (imagePullPolicy Always): clusters get the new \
                     digest as the module's rollout releases them"
                )
            });
            let mut found = record(
                ImageState::Exists,
                Some(digest),
                "ImageExists",
                message,
                0,
                then,
                at(recheck),
            );
            if let Some(before) = moved_from {
                found.earlier.push(ImagePin {
                    pin_generation: found.pinned_at,
                    digest: before,
                });
                let over = found.earlier.len().saturating_sub(MAX_EARLIER_PINS);
                found.earlier.drain(..over);
                found.pinned_at = need.pin_generation.max(found.pinned_at) + 1;
            }
            found
        }
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

    use kmm_api::Build;
    use kmm_registry::RegistryTls;

    use super::*;
    use crate::images::need::SignPlan;

    fn plain() -> ImageNeed {
        ImageNeed::for_kernels(["6.1.0"])
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
    fn new_access_checks_a_failing_image_at_once_whatever_its_backoff() {
        let need = ImageNeed {
            pull_secret: Some("pull".into()),
            ..plain()
        };
        let distrusted = Observation::CheckFailed {
            unauthorized: false,
            message: "certificate verify failed".into(),
        };
        let failed = observe(&need, None, Next::Check, distrusted, now());
        assert_eq!(failed.state, ImageState::Failed);
        assert_eq!(due(&need, Some(&failed), later(1)), None, "backing off");
        // The hub's CA bundle or the Secret changed: the fix the user made counts now.
        let trusted = ImageNeed { access: 1, ..need };
        assert_eq!(due(&trusted, Some(&failed), later(1)), Some(Next::Check));
        let found = observe(
            &trusted,
            Some(&failed),
            Next::Check,
            Observation::Found {
                digest: "sha256:aa".into(),
            },
            later(1),
        );
        assert_eq!(found.state, ImageState::Exists);
        assert_eq!(due(&trusted, Some(&found), later(2)), None, "one look");
    }

    #[test]
    fn an_images_secrets_are_its_pull_secret_and_signing_keys() {
        let need = ImageNeed {
            pull_secret: Some("pull".into()),
            ..signed(false)
        };
        assert_eq!(need.secrets().collect::<Vec<_>>(), ["pull", "key", "cert"]);
        assert_eq!(plain().secrets().count(), 0);
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

    fn following(every: u64) -> ImageNeed {
        ImageNeed {
            follow_interval: Some(Duration::from_secs(every)),
            ..plain()
        }
    }

    fn found(digest: &str) -> Observation {
        Observation::Found {
            digest: digest.into(),
        }
    }

    #[test]
    fn always_resolves_the_tag_again_each_interval_and_pins_a_move_at_the_next_generation() {
        let need = following(30);
        let (steps, first) = run(&need, None, |_| found("sha256:d1"));
        assert_eq!(steps, [Next::Check]);
        assert_eq!((first.pinned_at, first.earlier.len()), (0, 0));
        assert_eq!(due(&need, Some(&first), later(29)), None);
        assert_eq!(due(&need, Some(&first), later(30)), Some(Next::Resolve));
        let same = observe(
            &need,
            Some(&first),
            Next::Resolve,
            found("sha256:d1"),
            later(30),
        );
        assert_eq!(same.pinned_at, 0, "a tag that stayed is no move");
        assert!(same.reported_alike(&first));

        let moved = observe(
            &need,
            Some(&same),
            Next::Resolve,
            found("sha256:d2"),
            later(60),
        );
        assert_eq!(moved.digest.as_deref(), Some("sha256:d2"));
        assert_eq!(moved.pinned_at, 1);
        assert_eq!(
            moved.earlier,
            [ImagePin {
                pin_generation: 0,
                digest: "sha256:d1".into()
            }]
        );
        assert!(moved.message.contains("sha256:d1"), "{}", moved.message);
        assert_eq!(
            moved.verdict(),
            Verdict::Load {
                digest: "sha256:d2"
            }
        );
        assert_eq!(
            moved.verdict_at(0),
            Verdict::Load {
                digest: "sha256:d1"
            },
            "clusters on the earlier revision keep the earlier bytes"
        );
        assert_eq!(
            moved.verdict_at(1),
            Verdict::Load {
                digest: "sha256:d2"
            }
        );
        assert_eq!(moved.next_at, later(90));

        // Another image of the module moved meanwhile: this one's move joins the next
        // generation, never one already taken.
        let raced = ImageNeed {
            pin_generation: 3,
            ..need.clone()
        };
        let again = observe(
            &raced,
            Some(&moved),
            Next::Resolve,
            found("sha256:d3"),
            later(90),
        );
        assert_eq!(again.pinned_at, 4);
        assert_eq!(again.digest_at(0), Some("sha256:d1"));
        assert_eq!(again.digest_at(3), Some("sha256:d2"));
        assert_eq!(again.digest_at(4), Some("sha256:d3"));
    }

    #[test]
    fn earlier_pins_are_bounded_and_a_revision_older_than_them_loads_the_oldest() {
        let mut record = observe(&following(30), None, Next::Check, found("sha256:0"), now());
        for generation in 0..6 {
            let need = ImageNeed {
                pin_generation: generation,
                ..following(30)
            };
            let digest = format!("sha256:{}", generation + 1);
            record = observe(&need, Some(&record), Next::Resolve, found(&digest), now());
        }
        assert_eq!(record.pinned_at, 6);
        assert_eq!(record.earlier.len(), MAX_EARLIER_PINS);
        assert_eq!(record.digest_at(5), Some("sha256:5"));
        assert_eq!(record.digest_at(2), Some("sha256:2"));
        assert_eq!(record.digest_at(0), Some("sha256:2"), "the oldest kept");
    }

    #[test]
    fn if_not_present_never_and_unset_hold_the_pin() {
        // The three policies give the same need: no follow interval (`need::module_needs`).
        let (_, pinned) = run(&plain(), None, |_| found("sha256:d1"));
        assert_eq!(due(&plain(), Some(&pinned), later(30)), None);
        assert_eq!(
            due(&plain(), Some(&pinned), later(600)),
            Some(Next::Check),
            "the pinned digest is checked, the tag is not looked at"
        );
        // A new digest all the same (a rebuild): every revision loads it, as before.
        let rebuilt = observe(
            &plain(),
            Some(&pinned),
            Next::Resolve,
            found("sha256:d2"),
            now(),
        );
        assert_eq!((rebuilt.pinned_at, rebuilt.earlier.len()), (0, 0));
        assert_eq!(rebuilt.digest_at(0), Some("sha256:d2"));
        assert!(rebuilt.message.is_empty());
    }

    #[test]
    fn a_changed_policy_acts_at_once() {
        let (_, held) = run(&plain(), None, |_| found("sha256:d1"));
        assert_eq!(due(&following(30), Some(&held), now()), Some(Next::Resolve));
        let (_, followed) = run(&following(30), None, |_| found("sha256:d1"));
        assert_eq!(due(&plain(), Some(&followed), now()), Some(Next::Check));
        // A seeded pin of a followed image looks at the tag first.
        let seeded = ImageRecord::seeded(&following(30), "sha256:d1".into(), now());
        assert_eq!(
            due(&following(30), Some(&seeded), now()),
            Some(Next::Resolve)
        );
    }

    #[test]
    fn a_lost_followed_image_loads_nowhere() {
        let need = following(30);
        let (_, first) = run(&need, None, |_| found("sha256:d1"));
        let moved = observe(
            &need,
            Some(&first),
            Next::Resolve,
            found("sha256:d2"),
            now(),
        );
        let lost = observe(
            &need,
            Some(&moved),
            Next::Resolve,
            Observation::Missing {
                answer: "manifest unknown".into(),
            },
            now(),
        );
        assert!(matches!(lost.verdict_at(0), Verdict::Wait { .. }));
        assert!(matches!(lost.verdict(), Verdict::Wait { .. }));
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
