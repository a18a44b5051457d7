//! The image worker (leader only): for every image the fleet needs it performs the step
//! the pure image pipeline (`crate::images`) says is due (ask the registry, start or
//! follow a build, sign) and records the outcome in the fleet view, which pins digests
//! into the clusters' intents and lists the images in status. Transitions become Events
//! on the module.

use std::collections::BTreeMap;
use std::hash::{DefaultHasher, Hash, Hasher};
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::{ConfigMap, Secret};
use k8s_openapi::jiff::Timestamp;
use kmm_api::{ManagedClusterModule, TlsOptions};
use kmm_registry::{PullSecret, RegistryCas, RegistryError, RegistryTls, error_chain};
use kmm_runtime::events::EventType;
use kube::runtime::reflector::{ObjectRef, Store};
use kube::{Api, ResourceExt};

use super::events::EventQueue;
use super::fleet_view::FleetView;
use super::image_tasks::{Finished, ImageTasks, Wake};
use super::signing::{MAX_IMAGE_BYTES, sign_image, signing_key};
use crate::build::{BuildJobs, BuildProgress, BuildRequest};
use crate::images::record::{Next, Observation, due, observe};
use crate::images::status::{Seed, seed};
use crate::images::{ImageKey, ImageNeed, ImageRecord, ImageState};

/// Images worked on at once.
const IN_FLIGHT: usize = 16;
/// Longest a registry request may take before the check counts as failed.
const REGISTRY_TIMEOUT: Duration = Duration::from_secs(30);
/// Longest a signing (pull, sign, push) may take.
const SIGN_TIMEOUT: Duration = Duration::from_secs(600);
/// Least time between two passes woken by changes of what the fleet needs.
const PASS_INTERVAL: Duration = Duration::from_millis(100);
/// A pass reads every cluster (tens of milliseconds at thousands of clusters): while
/// changes keep coming (a fleet reconnecting), passes are spaced so that they take at
/// most a fifth of the time.
const PASS_SPACING: u32 = 5;
/// Steps one image may take in a row (check, check unsigned, build, sign, resolve).
const MAX_STEPS: usize = 8;
/// How often the worker looks whether its CAs or Secrets changed (`ImageNeed::access`).
const ACCESS_POLL: Duration = Duration::from_secs(5);

/// What the worker works with.
pub struct ImageWorker {
    pub state: Arc<FleetView>,
    pub modules: Store<ManagedClusterModule>,
    pub secrets: Store<Secret>,
    pub config_maps: Api<ConfigMap>,
    pub namespace: String,
    pub builds: BuildJobs,
    /// The images' Events, recorded in order without holding a check's place.
    pub events: EventQueue,
    /// PEM CAs the registries chain to besides the system's (`--registry-ca-file`), read
    /// at each step: its optional ConfigMap may come, change or go while the hub runs.
    pub registry_ca_file: Option<std::path::PathBuf>,
    /// How often the tags of `imagePullPolicy: Always` images are resolved again.
    pub follow_interval: Duration,
}

impl std::fmt::Debug for ImageWorker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ImageWorker")
            .field("namespace", &self.namespace)
            .finish_non_exhaustive()
    }
}

/// Runs until dropped.
#[tracing::instrument(name = "image_worker", skip_all)]
pub async fn run(worker: ImageWorker) {
    let worker = Arc::new(worker);
    let mut needs_changed = worker.state.needs_changed();
    let mut tasks = ImageTasks::default();
    let mut cas_before = worker.cas_fingerprint();
    let mut needs = BTreeMap::new();
    let mut pass = tokio::time::Instant::now();
    let mut spacing = PASS_INTERVAL;
    let mut read = Read::Fleet;
    // The fleet's needs changed since the last pass read them: the next pass is due at
    // `pass + spacing`.
    let mut needs_pending = false;
    loop {
        match read {
            Read::Fleet => {
                needs_pending = false;
                pass = tokio::time::Instant::now();
                needs = worker.state.image_needs(Some(worker.follow_interval));
                spacing = PASS_INTERVAL.max(pass.elapsed() * PASS_SPACING);
                worker.state.track_images(&needs);
            }
            Read::Pins => worker.state.pin_needs(&mut needs),
        }
        tracing::debug!(needed = needs.len(), in_flight = tasks.len(), "images");
        let cas = worker.cas_fingerprint();
        if cas != cas_before {
            tracing::info!("the hub's registry CA bundle changed: images are checked again");
            cas_before = cas;
        }
        let access = worker.access_version(cas);
        let now = Timestamp::now();
        let mut wake = now + k8s_openapi::jiff::SignedDuration::from_secs(60);
        for (key, need) in &needs {
            if tasks.contains(key) {
                continue;
            }
            let need = ImageNeed {
                access: worker.access(need, cas),
                ..need.clone()
            };
            let record = match worker.state.image(key) {
                Some(record) => Some(record),
                None => worker.seed(key, &need, now),
            };
            if due(&need, record.as_ref(), now).is_some() {
                if tasks.len() < IN_FLIGHT {
                    let worker = worker.clone();
                    let (task_key, task_need) = (key.clone(), need.clone());
                    tasks.spawn(key.clone(), need, async move {
                        worker.advance(&task_key, &task_need, record).await;
                    });
                }
            } else if let Some(record) = &record {
                wake = wake.min(record.next_at);
            }
        }
        let until = Duration::try_from(wake.duration_since(Timestamp::now()))
            .unwrap_or_default()
            .max(Duration::from_millis(200));
        // An unchecked image wakes a pass only when the pass could start its check.
        let in_flight = tasks.keys().clone();
        let full = tasks.len() >= IN_FLIGHT;
        let covered = |key: &ImageKey| full || in_flight.contains(key);
        let other = async {
            tokio::select! {
                // Unless a snapshot waits for an image nobody checked yet (a module just
                // created): its clusters get nothing until then.
                () = worker.state.images_unchecked(covered) => {}
                () = worker.access_changed(access) => {}
                () = tokio::time::sleep(until) => {}
            }
        };
        // Changes come in bursts (clusters connecting send their kernels one by one): a
        // read goes through them all, so the fleet is read at most once per spacing.
        let woken = tasks
            .wake(
                &mut needs_changed,
                &mut needs_pending,
                pass + spacing,
                other,
            )
            .await;
        read = match woken {
            Wake::Finished(finished) => {
                let Finished { key, need, panic } = *finished;
                if let Some(panic) = panic {
                    worker.failed_unexpectedly(key, &need, &panic);
                }
                Read::Pins
            }
            Wake::Fleet => Read::Fleet,
            Wake::Stopped => return,
        };
    }
}

/// What the next pass reads before it starts the due steps.
#[derive(Debug, Clone, Copy)]
enum Read {
    /// What every cluster needs: after a change of the fleet, and on the timer, which
    /// also bounds how long a change no signal announces goes unseen.
    Fleet,
    /// Only the pins of the needs kept from the last read: after an image's work ended,
    /// which changes its record, not what the clusters need (a kernel upgrade's dozens of
    /// checks each read every cluster again before).
    Pins,
}

impl ImageWorker {
    /// Records that the work on an image panicked: a failure, retried after a backoff
    /// like a failed check, the pinned digest kept.
    fn failed_unexpectedly(&self, key: ImageKey, need: &ImageNeed, panic: &str) {
        tracing::error!(
            module = key.module,
            image = key.image,
            panic,
            "the work on an image panicked"
        );
        let previous = self.state.image(&key);
        let step = previous.as_ref().map_or(Next::Check, |r| r.then);
        let observation = Observation::CheckFailed {
            unauthorized: false,
            message: format!("the hub's work on the image failed unexpectedly: {panic}"),
        };
        let next = observe(need, previous.as_ref(), step, observation, Timestamp::now());
        self.state.set_image(key, next);
    }

    /// A digest an earlier leader persisted in the module's status: nodes keep loading it
    /// while this leader checks it again (or makes it anew, for a rebuild generation the
    /// spec moved past). An image the clusters resolved stays theirs, each cluster with
    /// the pin it had.
    fn seed(&self, key: &ImageKey, need: &ImageNeed, now: Timestamp) -> Option<ImageRecord> {
        let module = self.modules.get(&ObjectRef::new(&key.module))?;
        let images = &module.status.as_ref()?.images;
        let Seed { record, spoke_pins } = seed(need, images, &key.image, now)?;
        if let Some(pins) = spoke_pins {
            self.state.seed_spoke_pins(key.clone(), pins);
        }
        self.state.set_image(key.clone(), record.clone());
        Some(record)
    }

    /// Performs the due steps of one image until none is due now.
    #[tracing::instrument(name = "image", skip_all, fields(module = %key.module, image = %key.image))]
    async fn advance(&self, key: &ImageKey, need: &ImageNeed, mut record: Option<ImageRecord>) {
        for _ in 0..MAX_STEPS {
            let now = Timestamp::now();
            let Some(step) = due(need, record.as_ref(), now) else {
                return;
            };
            let check = matches!(step, Next::Check | Next::Resolve | Next::CheckUnsigned)
                .then(|| self.state.checking());
            let observation = self.perform(key, need, record.as_ref(), step).await;
            let next = observe(need, record.as_ref(), step, observation, Timestamp::now());
            let next = self.state.set_image(key.clone(), next);
            drop(check);
            self.announce(key, record.as_ref(), &next);
            record = Some(next);
        }
    }

    async fn perform(
        &self,
        key: &ImageKey,
        need: &ImageNeed,
        record: Option<&ImageRecord>,
        step: Next,
    ) -> Observation {
        let secret = self.pull_secret(need);
        let cas = match self.registry_cas() {
            Ok(cas) => cas,
            Err(message) => {
                return match step {
                    Next::Sign => Observation::SignFailed { message },
                    Next::Build | Next::RetryBuild => Observation::BuildNotStarted { message },
                    Next::Check | Next::Resolve | Next::CheckUnsigned => Observation::CheckFailed {
                        unauthorized: false,
                        message,
                    },
                };
            }
        };
        match step {
            Next::Check | Next::Resolve => {
                let pinned = record.and_then(|r| r.digest.as_deref());
                let image = match (step, pinned) {
                    (Next::Check, Some(digest)) => pinned_reference(&key.image, digest),
                    _ => key.image.clone(),
                };
                match self.resolve(&image, need.tls, &cas, secret.as_ref()).await {
                    Ok(digest) => Observation::Found { digest },
                    Err(e) if e.is_not_found() => Observation::Missing {
                        answer: error_chain(&e),
                    },
                    Err(e) => Observation::CheckFailed {
                        unauthorized: e.is_unauthorized(),
                        message: error_chain(&e),
                    },
                }
            }
            Next::CheckUnsigned => {
                let Some(plan) = &need.sign else {
                    return Observation::UnsignedMissing {
                        answer: "no sign settings".into(),
                    };
                };
                match self
                    .resolve(
                        &plan.unsigned_image,
                        plan.unsigned_tls,
                        &cas,
                        secret.as_ref(),
                    )
                    .await
                {
                    Ok(_) => Observation::UnsignedFound,
                    Err(e) if e.is_not_found() => Observation::UnsignedMissing {
                        answer: error_chain(&e),
                    },
                    Err(e) => Observation::CheckFailed {
                        unauthorized: e.is_unauthorized(),
                        message: format!("unsigned image: {}", error_chain(&e)),
                    },
                }
            }
            Next::Build => self.build(key, need, &cas, false).await,
            Next::RetryBuild => self.build(key, need, &cas, true).await,
            Next::Sign => self.sign(key, need, &cas, secret.as_ref()).await,
        }
    }

    /// A fingerprint of the extra CAs as `--registry-ca-file` holds them now.
    fn cas_fingerprint(&self) -> u64 {
        let mut hasher = DefaultHasher::new();
        if let Some(file) = &self.registry_ca_file {
            std::fs::read(file).ok().hash(&mut hasher);
        }
        hasher.finish()
    }

    /// `need.access`: the CAs' fingerprint `cas` and the versions of the Secrets the
    /// image names.
    fn access(&self, need: &ImageNeed, cas: u64) -> u64 {
        let mut hasher = DefaultHasher::new();
        cas.hash(&mut hasher);
        for name in need.secrets() {
            let secret = self
                .secrets
                .get(&ObjectRef::new(name).within(&self.namespace));
            (name, secret.and_then(|s| s.resource_version())).hash(&mut hasher);
        }
        hasher.finish()
    }

    /// The CAs' fingerprint `cas` and the versions of every Secret the hub watches: a
    /// change is worth a pass, which finds the images it concerns.
    fn access_version(&self, cas: u64) -> u64 {
        let mut versions: Vec<_> = self
            .secrets
            .state()
            .iter()
            .map(|s| (s.name_any(), s.resource_version()))
            .collect();
        versions.sort_unstable();
        let mut hasher = DefaultHasher::new();
        (cas, versions).hash(&mut hasher);
        hasher.finish()
    }

    /// Returns once the CAs or the Secrets differ from `seen` (an [`Self::access_version`]).
    async fn access_changed(&self, seen: u64) {
        loop {
            tokio::time::sleep(ACCESS_POLL).await;
            if self.access_version(self.cas_fingerprint()) != seen {
                return;
            }
        }
    }

    /// The extra CAs of `--registry-ca-file`; none while the file is absent (its
    /// ConfigMap is optional).
    fn registry_cas(&self) -> Result<RegistryCas, String> {
        let Some(file) = &self.registry_ca_file else {
            return Ok(RegistryCas::default());
        };
        let unusable = |why: String| {
            format!(
                "the hub's registry CA bundle {} (--registry-ca-file, ConfigMap \
                 kmm-hub-registry-ca) cannot be used: {why}",
                file.display()
            )
        };
        match std::fs::read(file) {
            Ok(pem) => RegistryCas::from_pem(&pem).map_err(|e| unusable(e.to_string())),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(RegistryCas::default()),
            Err(e) => Err(unusable(e.to_string())),
        }
    }

    async fn resolve(
        &self,
        image: &str,
        tls: RegistryTls,
        cas: &RegistryCas,
        secret: Option<&PullSecret>,
    ) -> Result<String, RegistryError> {
        let client = kmm_registry::client_trusting(tls, cas);
        match tokio::time::timeout(
            REGISTRY_TIMEOUT,
            kmm_registry::resolve_digest(&client, image, secret),
        )
        .await
        {
            Ok(result) => result,
            Err(_) => Err(RegistryError::Registry {
                image: image.to_owned(),
                detail: format!("no answer within {}s", REGISTRY_TIMEOUT.as_secs()),
            }),
        }
    }

    /// Starts or follows the image's build; `retry` replaces a failed one.
    #[tracing::instrument(name = "build", skip_all, fields(kernel = need.build_kernel()))]
    async fn build(
        &self,
        key: &ImageKey,
        need: &ImageNeed,
        cas: &RegistryCas,
        retry: bool,
    ) -> Observation {
        let Some(build) = &need.build else {
            return Observation::BuildNotStarted {
                message: "no build settings".into(),
            };
        };
        let config_map = &build.dockerfile_config_map.name;
        let dockerfile = match self.config_maps.get_opt(config_map).await {
            Ok(Some(cm)) => cm.data.and_then(|mut d| d.remove("dockerfile")),
            Ok(None) => None,
            Err(e) => {
                return Observation::BuildNotStarted {
                    message: format!(
                        "reading ConfigMap {}/{config_map}: {}",
                        self.namespace,
                        error_chain(&e)
                    ),
                };
            }
        };
        let Some(dockerfile) = dockerfile else {
            return Observation::BuildNotStarted {
                message: format!(
                    "build.dockerfileConfigMap: ConfigMap {}/{config_map} does not exist or has no key \"dockerfile\"",
                    self.namespace
                ),
            };
        };
        let target = need.build_target(&key.image);
        let tls = need.sign.as_ref().map_or(need.tls, |s| s.unsigned_tls);
        let request = BuildRequest {
            module: key.module.clone(),
            module_uid: need.module_uid.clone(),
            spoke_namespace: need.spoke_namespace.clone(),
            kernel: need.build_kernel().to_owned(),
            image: target.to_owned(),
            build: build.clone(),
            registry_tls: Some(TlsOptions {
                insecure: Some(tls.insecure),
                insecure_skip_tls_verify: Some(tls.insecure_skip_tls_verify),
            }),
            push_secret: need.pull_secret.clone(),
            dockerfile,
            rebuild_generation: need.rebuild_generation,
        };
        let progress = if retry {
            self.builds.retry(&request, cas).await
        } else {
            self.builds.ensure(&request, cas).await
        };
        match progress {
            Ok(BuildProgress::Running { job }) => Observation::BuildRunning { job },
            Ok(BuildProgress::Retrying { job }) => Observation::BuildRetrying { job },
            Ok(BuildProgress::Succeeded { job }) => Observation::BuildSucceeded { job },
            Ok(BuildProgress::Failed { job, log_tail }) => {
                Observation::BuildFailed { job, log_tail }
            }
            Err(e) => Observation::BuildNotStarted {
                message: error_chain(&e),
            },
        }
    }

    #[tracing::instrument(name = "sign", skip_all)]
    async fn sign(
        &self,
        key: &ImageKey,
        need: &ImageNeed,
        cas: &RegistryCas,
        secret: Option<&PullSecret>,
    ) -> Observation {
        let Some(plan) = &need.sign else {
            return Observation::SignFailed {
                message: "no sign settings".into(),
            };
        };
        let signing_key = match signing_key(&self.secrets, &self.namespace, plan) {
            Ok(k) => k,
            Err(e) => {
                return Observation::SignFailed {
                    message: error_chain(&e),
                };
            }
        };
        let signing = sign_image(
            plan,
            signing_key,
            &key.image,
            need.tls,
            secret,
            cas,
            MAX_IMAGE_BYTES,
        );
        match tokio::time::timeout(SIGN_TIMEOUT, signing).await {
            Ok(Ok(digest)) => Observation::Signed { digest },
            Ok(Err(e)) => Observation::SignFailed {
                message: error_chain(&e),
            },
            Err(_) => Observation::SignFailed {
                message: format!("signing took longer than {}s", SIGN_TIMEOUT.as_secs()),
            },
        }
    }

    /// The module's pull secret's content, from the watched Secrets; in memory only.
    fn pull_secret(&self, need: &ImageNeed) -> Option<PullSecret> {
        let name = need.pull_secret.as_deref()?;
        let secret = self
            .secrets
            .get(&ObjectRef::new(name).within(&self.namespace))?;
        let data = secret.data.as_ref()?;
        let text = |key: &str| {
            data.get(key)
                .and_then(|v| String::from_utf8(v.0.clone()).ok())
        };
        text(".dockerconfigjson")
            .map(PullSecret::DockerConfigJson)
            .or_else(|| text(".dockercfg").map(PullSecret::DockerCfg))
    }

    /// An Event when the image's state or reason changes.
    fn announce(&self, key: &ImageKey, before: Option<&ImageRecord>, after: &ImageRecord) {
        if before.is_some_and(|b| {
            (b.state, &b.reason, &b.digest) == (after.state, &after.reason, &after.digest)
        }) {
            return;
        }
        let Some(module) = self.modules.get(&ObjectRef::new(&key.module)) else {
            return;
        };
        let warning = matches!(after.state, ImageState::Failed | ImageState::NotFound);
        let kernels: Vec<&str> = after
            .need
            .kernels
            .iter()
            .map(String::as_str)
            .take(5)
            .collect();
        let mut note = format!(
            "image {} (kernels {}): {}",
            key.image,
            kernels.join(", "),
            after.state.as_str()
        );
        if let Some(digest) = &after.digest {
            note.push_str(&format!(" at {digest}"));
        }
        if !after.message.is_empty() {
            note.push_str(": ");
            note.push_str(&after.message);
        }
        if warning {
            tracing::warn!(reason = after.reason, message = after.message, "image");
        } else {
            tracing::info!(reason = after.reason, digest = after.digest, "image");
        }
        let type_ = if warning {
            EventType::Warning
        } else {
            EventType::Normal
        };
        self.events
            .publish(module, type_, &after.reason, "Image", note);
    }
}

/// `image` pinned to `digest`: the tag kept for readability, the digest deciding.
fn pinned_reference(image: &str, digest: &str) -> String {
    match image.split_once('@') {
        Some((name, _)) => format!("{name}@{digest}"),
        None => format!("{image}@{digest}"),
    }
}
