//! Build Jobs on the hub cluster: start a build once, report how it went, delete the
//! builds a module no longer wants.
//!
//! A build's Job is named after its fingerprint, so [`BuildJobs::ensure`] only ever
//! creates a Job that does not exist yet: asking again while it exists (also from
//! another replica, or after a restart) reports on that Job. The Job is created
//! suspended, then its inputs are copied next to it (owned by it), then it is resumed;
//! an interruption anywhere is finished by the next `ensure`.

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::{ConfigMap, Pod, Secret};
use kmm_registry::RegistryCas;
use kube::api::{DeleteParams, ListParams, LogParams, Patch, PatchParams, PostParams};
use kube::{Api, Client, Resource, ResourceExt};
use thiserror::Error;

use super::job::{
    self, BuildJob, CONTAINER, FINGERPRINT_LABEL, MANAGED_BY, MANAGED_BY_LABEL, MODULE_UID_LABEL,
    builds_namespace,
};
use super::request::BuildRequest;

/// Lines of the build's log reported when it fails.
pub const LOG_TAIL_LINES: i64 = 20;
/// Bytes of the build's log reported when it fails, at most.
pub const LOG_TAIL_BYTES: usize = 2048;
/// The label the Job controller puts on a Job's Pods.
const JOB_NAME_LABEL: &str = "batch.kubernetes.io/job-name";

/// Where a build is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum BuildProgress {
    /// The Job exists and has not finished (its Pod may still be waiting for a node or
    /// an image).
    Running { job: String },
    /// The image was built and pushed.
    Succeeded { job: String },
    /// The build failed; the end of its log says why. `ensure` reports this again
    /// instead of building again; `retry` replaces the failed Job.
    Failed { job: String, log_tail: String },
    /// A failed attempt's Job is being deleted (its Pods and input copies first); the
    /// next `ensure` after it is gone starts the build afresh.
    Retrying { job: String },
}

/// What went wrong talking to the API about a build.
#[derive(Debug, Error)]
pub enum BuildError {
    #[error("{action} {kind} {namespace}/{name}: {source}")]
    Api {
        action: &'static str,
        kind: &'static str,
        namespace: String,
        name: String,
        #[source]
        source: kube::Error,
    },
    #[error("listing the build Jobs of module uid {module_uid} in {namespace}: {source}")]
    List {
        namespace: String,
        module_uid: String,
        #[source]
        source: kube::Error,
    },
    #[error("the build of {image} needs Secret {namespace}/{name}, which does not exist")]
    MissingSecret {
        namespace: String,
        name: String,
        image: String,
    },
    #[error(
        "Secret {namespace}/{name}, the push secret of {image}, has no .dockerconfigjson: \
         it must be a kubernetes.io/dockerconfigjson Secret"
    )]
    NotDockerConfig {
        namespace: String,
        name: String,
        image: String,
    },
}

/// Builds of the hub whose namespace holds the modules' Secrets.
#[derive(Clone)]
pub struct BuildJobs {
    builder_image: String,
    /// The hub's namespace: the Secrets builds name.
    secrets: Api<Secret>,
    hub_namespace: String,
    /// The builds namespace: Jobs, their Pods and the copies of their inputs.
    namespace: String,
    jobs: Api<Job>,
    pods: Api<Pod>,
    config_maps: Api<ConfigMap>,
    copies: Api<Secret>,
}

impl std::fmt::Debug for BuildJobs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BuildJobs")
            .field("hub_namespace", &self.hub_namespace)
            .field("namespace", &self.namespace)
            .field("builder_image", &self.builder_image)
            .finish_non_exhaustive()
    }
}

impl BuildJobs {
    /// Builds with `builder_image` for the hub in `namespace`, whose Secrets the builds
    /// name; the Jobs run in its builds namespace ([`builds_namespace`]).
    pub fn new(client: Client, namespace: &str, builder_image: &str) -> Self {
        let builds = builds_namespace(namespace);
        Self {
            builder_image: builder_image.to_owned(),
            secrets: Api::namespaced(client.clone(), namespace),
            hub_namespace: namespace.to_owned(),
            jobs: Api::namespaced(client.clone(), &builds),
            pods: Api::namespaced(client.clone(), &builds),
            config_maps: Api::namespaced(client.clone(), &builds),
            copies: Api::namespaced(client, &builds),
            namespace: builds,
        }
    }

    /// The namespace the Jobs run in.
    pub fn namespace(&self) -> &str {
        &self.namespace
    }

    /// Starts the build of `request` unless its Job exists, and reports its progress.
    /// Creates only: an existing Job is never replaced, whatever its state. A new Job's
    /// builder trusts `registry_cas` besides the system's CAs.
    pub async fn ensure(
        &self,
        request: &BuildRequest,
        registry_cas: &RegistryCas,
    ) -> Result<BuildProgress, BuildError> {
        let mut build = job::render(request, &self.builder_image, &self.namespace);
        if !registry_cas.is_empty() {
            build = job::trusting(build, &registry_cas.to_pem());
        }
        let mut sources = None;
        let job = match self
            .jobs
            .get_opt(&build.name)
            .await
            .map_err(|e| self.api_error("reading", "Job", &build.name, e))?
        {
            // A new Job of the same name must wait: its inputs' copies would otherwise
            // be found still owned by the old one and collected with it.
            Some(job) if job.metadata.deletion_timestamp.is_some() => {
                return Ok(BuildProgress::Retrying { job: build.name });
            }
            Some(job) => job,
            None => {
                // Checked before anything exists: a build that cannot start leaves
                // nothing behind.
                sources = Some(self.sources(&build, request).await?);
                self.create(&build).await?
            }
        };
        if job.spec.as_ref().and_then(|s| s.suspend) == Some(true) {
            let sources = match sources {
                Some(sources) => sources,
                None => self.sources(&build, request).await?,
            };
            self.start(&build, &job, &sources).await?;
            return Ok(BuildProgress::Running { job: build.name });
        }
        Ok(self.progress(&job).await)
    }

    /// Tries a failed build again: its Job is deleted, and the build starts afresh once
    /// the Job is gone. A build that has not failed is left as [`Self::ensure`] leaves
    /// it.
    pub async fn retry(
        &self,
        request: &BuildRequest,
        registry_cas: &RegistryCas,
    ) -> Result<BuildProgress, BuildError> {
        let progress = self.ensure(request, registry_cas).await?;
        let BuildProgress::Failed { job, .. } = progress else {
            return Ok(progress);
        };
        match self.jobs.delete(&job, &DeleteParams::foreground()).await {
            Ok(_) => {}
            Err(kube::Error::Api(status)) if status.code == 404 => {}
            Err(e) => return Err(self.api_error("deleting", "Job", &job, e)),
        }
        tracing::info!(job, namespace = %self.namespace, "retrying a failed build");
        Ok(BuildProgress::Retrying { job })
    }

    /// Deletes the build Jobs of the module `module_uid` whose fingerprint is not in
    /// `keep` (their Pods and copied inputs go with them); returns their names.
    pub async fn cleanup(
        &self,
        module_uid: &str,
        keep: &BTreeSet<String>,
    ) -> Result<Vec<String>, BuildError> {
        let selector = format!("{MANAGED_BY_LABEL}={MANAGED_BY},{MODULE_UID_LABEL}={module_uid}");
        let jobs = self
            .jobs
            .list(&ListParams::default().labels(&selector))
            .await
            .map_err(|source| BuildError::List {
                namespace: self.namespace.clone(),
                module_uid: module_uid.to_owned(),
                source,
            })?;
        let mut deleted = vec![];
        for job in jobs {
            let wanted = job
                .labels()
                .get(FINGERPRINT_LABEL)
                .is_some_and(|f| keep.contains(f));
            if wanted || job.meta().deletion_timestamp.is_some() {
                continue;
            }
            let name = job.name_any();
            match self.jobs.delete(&name, &DeleteParams::background()).await {
                Ok(_) => {}
                Err(kube::Error::Api(status)) if status.code == 404 => continue,
                Err(e) => return Err(self.api_error("deleting", "Job", &name, e)),
            }
            tracing::info!(job = %name, module_uid, "deleted a build no longer wanted");
            deleted.push(name);
        }
        Ok(deleted)
    }

    /// The Secrets the build copies, read from the hub's namespace by name.
    async fn sources(
        &self,
        build: &BuildJob,
        request: &BuildRequest,
    ) -> Result<BTreeMap<String, Secret>, BuildError> {
        let mut sources = BTreeMap::new();
        for copy in &build.secrets {
            let secret = self
                .secrets
                .get_opt(&copy.source)
                .await
                .map_err(|e| BuildError::Api {
                    action: "reading",
                    kind: "Secret",
                    namespace: self.hub_namespace.clone(),
                    name: copy.source.clone(),
                    source: e,
                })?
                .ok_or_else(|| BuildError::MissingSecret {
                    namespace: self.hub_namespace.clone(),
                    name: copy.source.clone(),
                    image: request.image.clone(),
                })?;
            if copy.push && !job::has_docker_config(&secret) {
                return Err(BuildError::NotDockerConfig {
                    namespace: self.hub_namespace.clone(),
                    name: copy.source.clone(),
                    image: request.image.clone(),
                });
            }
            sources.insert(copy.source.clone(), secret);
        }
        Ok(sources)
    }

    /// Creates the (suspended) Job; when another replica just did, returns theirs.
    async fn create(&self, build: &BuildJob) -> Result<Job, BuildError> {
        match self.jobs.create(&PostParams::default(), &build.job).await {
            Ok(job) => {
                tracing::info!(
                    job = %build.name,
                    namespace = %self.namespace,
                    fingerprint = %build.fingerprint,
                    "created a build Job"
                );
                Ok(job)
            }
            Err(kube::Error::Api(status)) if status.code == 409 => self
                .jobs
                .get(&build.name)
                .await
                .map_err(|e| self.api_error("reading", "Job", &build.name, e)),
            Err(e) => Err(self.api_error("creating", "Job", &build.name, e)),
        }
    }

    /// Copies the build's inputs next to its suspended Job, owned by it, and resumes it.
    async fn start(
        &self,
        build: &BuildJob,
        job: &Job,
        sources: &BTreeMap<String, Secret>,
    ) -> Result<(), BuildError> {
        let uid = job.uid().unwrap_or_default();
        let mut dockerfile = build.dockerfile.clone();
        dockerfile.metadata = job::owned_by_job(dockerfile.metadata, &build.name, &uid);
        create_once(&self.config_maps, &dockerfile)
            .await
            .map_err(|e| self.api_error("creating", "ConfigMap", &build.name, e))?;
        for copy in &build.secrets {
            let source = &sources[&copy.source];
            let secret = job::secret_copy(build, copy, source, &uid);
            create_once(&self.copies, &secret)
                .await
                .map_err(|e| self.api_error("creating", "Secret", &copy.name, e))?;
        }
        let resume = serde_json::json!({ "spec": { "suspend": false } });
        self.jobs
            .patch(&build.name, &PatchParams::default(), &Patch::Merge(&resume))
            .await
            .map_err(|e| self.api_error("resuming", "Job", &build.name, e))?;
        Ok(())
    }

    /// The progress of a started Job, from its conditions.
    async fn progress(&self, job: &Job) -> BuildProgress {
        let name = job.name_any();
        let condition = |type_: &str| {
            job.status
                .as_ref()
                .and_then(|s| s.conditions.as_ref())
                .and_then(|c| c.iter().find(|c| c.type_ == type_ && c.status == "True"))
        };
        if condition("Complete").is_some() {
            return BuildProgress::Succeeded { job: name };
        }
        match condition("Failed") {
            Some(failed) => {
                let why = format!(
                    "Job {}/{name} failed: {}: {}",
                    self.namespace,
                    failed.reason.as_deref().unwrap_or("Failed"),
                    failed.message.as_deref().unwrap_or_default()
                );
                let log_tail = self.log_tail(&name, &why).await;
                BuildProgress::Failed {
                    job: name,
                    log_tail,
                }
            }
            None => BuildProgress::Running { job: name },
        }
    }

    /// The end of the build Pod's log, read through the API; when there is no log (the
    /// Pod never ran, or is gone), what the Pod's status says, after `why`.
    async fn log_tail(&self, job: &str, why: &str) -> String {
        let pods = match self
            .pods
            .list(&ListParams::default().labels(&format!("{JOB_NAME_LABEL}={job}")))
            .await
        {
            Ok(pods) => pods.items,
            Err(e) => return format!("{why}; its Pods cannot be listed: {e}"),
        };
        // backoffLimit 0: one Pod, unless it was replaced before it ran (evicted).
        let Some(pod) = pods
            .iter()
            .max_by_key(|p| p.metadata.creation_timestamp.clone())
        else {
            return format!("{why}; it has no Pod");
        };
        let name = pod.name_any();
        let params = LogParams {
            container: Some(CONTAINER.to_owned()),
            tail_lines: Some(LOG_TAIL_LINES),
            ..LogParams::default()
        };
        match self.pods.logs(&name, &params).await {
            Ok(log) if !log.trim().is_empty() => tail(&log, LOG_TAIL_BYTES).to_owned(),
            Ok(_) => format!("{why}; Pod {name} logged nothing; {}", container_state(pod)),
            Err(e) => format!(
                "{why}; the log of Pod {name} cannot be read ({e}); {}",
                container_state(pod)
            ),
        }
    }

    fn api_error(
        &self,
        action: &'static str,
        kind: &'static str,
        name: &str,
        source: kube::Error,
    ) -> BuildError {
        BuildError::Api {
            action,
            kind,
            namespace: self.namespace.clone(),
            name: name.to_owned(),
            source,
        }
    }
}

/// Creates `object` unless it exists (a former, interrupted `ensure` made it).
async fn create_once<K>(api: &Api<K>, object: &K) -> Result<(), kube::Error>
where
    K: Resource + Clone + serde::Serialize + serde::de::DeserializeOwned + std::fmt::Debug,
{
    match api.create(&PostParams::default(), object).await {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(status)) if status.code == 409 => Ok(()),
        Err(e) => Err(e),
    }
}

/// What the build container's status says: why it waits or how it ended.
fn container_state(pod: &Pod) -> String {
    let state = pod
        .status
        .as_ref()
        .and_then(|s| s.container_statuses.as_ref())
        .and_then(|c| c.iter().find(|c| c.name == CONTAINER))
        .and_then(|c| c.state.as_ref());
    match state {
        Some(state) => {
            if let Some(waiting) = &state.waiting {
                format!(
                    "the container is waiting: {}: {}",
                    waiting.reason.as_deref().unwrap_or_default(),
                    waiting.message.as_deref().unwrap_or_default()
                )
            } else if let Some(terminated) = &state.terminated {
                format!(
                    "the container ended with {}: {}",
                    terminated.exit_code,
                    terminated.message.as_deref().unwrap_or_default().trim()
                )
            } else {
                "the container is running".to_owned()
            }
        }
        None => format!(
            "the Pod is {}",
            pod.status
                .as_ref()
                .and_then(|s| s.phase.as_deref())
                .unwrap_or("unknown")
        ),
    }
}

/// The last `max` bytes of `log` at most, starting on a line when one starts in them
/// (else on a character), without trailing blank space.
fn tail(log: &str, max: usize) -> &str {
    let log = log.trim_end();
    if log.len() <= max {
        return log;
    }
    let mut start = log.len() - max;
    while !log.is_char_boundary(start) {
        start += 1;
    }
    let cut = &log[start..];
    match cut.find('\n') {
        Some(newline) if newline + 1 < cut.len() => &cut[newline + 1..],
        _ => cut,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_short_log_is_kept_whole_without_trailing_space() {
        assert_eq!(tail("one\ntwo\n\n", 2048), "one\ntwo");
    }

    #[test]
    fn a_long_log_keeps_its_last_whole_lines_within_the_limit() {
        let log: String = (0..300).map(|i| format!("line {i}\n")).collect();
        let cut = tail(&log, 2048);
        assert!(cut.len() <= 2048);
        assert!(cut.starts_with("line ") && cut.ends_with("line 299"));
        assert!(log.contains(&format!("\n{cut}")), "starts on a line");
    }

    #[test]
    fn a_cut_never_splits_a_character() {
        let log = "é".repeat(2000);
        let cut = tail(&log, 2047);
        assert!(cut.len() <= 2047 && cut.chars().all(|c| c == 'é'));
    }
}
