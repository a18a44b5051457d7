//! Carries out the plan: fetches images, removes in-tree modules, installs firmware,
//! runs modprobe through the kernel backend, records the result and reports an event
//! for every load and unload.

use std::collections::{BTreeMap, BTreeSet};
use std::future::Future;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};
use tracing::Instrument;

use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::control::{
    AgentEvent, EventAction, Hello, LoadTiming, LoadedModule, Outcome, Progress, millis,
    now_unix_ms,
};
use crate::desired::{DesiredModule, DesiredSnapshot};
use crate::firmware::{self, FirmwareError};
use crate::image::pull::{PullRequest, error_chain};
use crate::image::{FetchRequest, Fetched, ImageError, ImageStore};
use crate::kernel::{Kernel, KernelError};
use crate::modprobe::{self, ToolError};
use crate::plan::{self, Action, normalize_module_name};
use crate::shared_modules::{InUse, Kept, Removal, needed, plan_removal};
use crate::signature;
use crate::state::{ModuleRecord, State, StateError, StateStore};

#[derive(Debug, thiserror::Error)]
pub enum StepError {
    #[error(transparent)]
    Kernel(#[from] KernelError),
    #[error(transparent)]
    Firmware(#[from] FirmwareError),
    #[error(transparent)]
    Tool(#[from] ToolError),
    #[error("nothing to load: neither moduleName nor rawArgs.load is set")]
    NothingToLoad,
    #[error(
        "the image has no {dir_name}/lib/modules/{kernel}: it holds no modules for this node's kernel"
    )]
    NoModulesForKernel { dir_name: String, kernel: String },
    #[error(transparent)]
    InUse(#[from] InUse),
}

#[derive(Debug, thiserror::Error)]
pub enum ReconcileError {
    #[error(transparent)]
    Kernel(#[from] KernelError),
    #[error(transparent)]
    State(#[from] StateError),
}

/// How long an image no module uses any more stays in the cache by default: a module
/// deleted and created again, a rollback or a placement flapping loads it again without
/// pulling and extracting it (kubelet keeps unused images at least 2 minutes).
pub const DEFAULT_UNUSED_IMAGE_RETENTION: Duration = Duration::from_secs(300);

/// What a pull is for: the module and what its image request is made of (the kernel is
/// the agent's own).
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
struct FetchKey {
    module: String,
    image: String,
    digest: Option<String>,
    dir_name: String,
    firmware_path: Option<String>,
}

impl FetchKey {
    fn of(desired: &DesiredModule) -> Self {
        Self {
            module: desired.key.clone(),
            image: desired.image.clone(),
            digest: desired.digest.clone(),
            dir_name: desired.modprobe.dir_name().to_string(),
            firmware_path: desired.modprobe.firmware_path.clone(),
        }
    }
}

/// The request for `desired`'s image on the kernel `release`.
fn fetch_request<'a>(desired: &'a DesiredModule, release: &str) -> FetchRequest<'a> {
    FetchRequest {
        pull: PullRequest {
            image: &desired.image,
            tls: desired.registry_tls,
            secret: desired.pull_secret.as_ref(),
        },
        digest: desired.digest.as_deref(),
        selection: kmm_extract::Selection {
            dir_name: desired.modprobe.dir_name().to_string(),
            kernel: release.to_string(),
            firmware_path: desired.modprobe.firmware_path.clone(),
            host_modules: Some(modprobe::HOST_MODULES.into()),
        },
    }
}

/// The agent's executor: owns the state for the running boot.
#[derive(Debug)]
pub struct Reconciler {
    kernel: Arc<dyn Kernel>,
    images: Arc<ImageStore>,
    /// Pulls under way, each in its own task: a pass interrupted by a new snapshot
    /// leaves them running and the next pass takes them over.
    fetches: BTreeMap<FetchKey, JoinHandle<Result<Fetched, ImageError>>>,
    store: StateStore,
    state: State,
    firmware_dir: PathBuf,
    release: String,
    progress: watch::Sender<Progress>,
    /// Modules whose last attempt failed: their actions go after the others'.
    failing: BTreeSet<String>,
    unused_image_retention: Duration,
}

impl Reconciler {
    /// Loads the saved state; a different boot ID (a reboot) discards it.
    pub fn new(
        kernel: Arc<dyn Kernel>,
        images: ImageStore,
        store: StateStore,
        firmware_dir: PathBuf,
    ) -> Result<Self, ReconcileError> {
        let boot_id = kernel.boot_id()?;
        let release = kernel.release()?;
        let saved = match store.load() {
            Ok(saved) => saved,
            // Unreadable state: start over. Loading what is loaded is a no-op for
            // modprobe, so this costs time, not correctness.
            Err(e @ StateError::Invalid { .. }) => {
                tracing::warn!(error = %error_chain(&e), "discarding invalid agent state");
                None
            }
            Err(e) => return Err(e.into()),
        };
        let rebooted = saved.as_ref().is_some_and(|s| s.boot_id != boot_id);
        let state = State {
            modules: plan::records_for_boot(saved, &boot_id),
            boot_id,
        };
        if rebooted {
            tracing::info!("boot ID changed since the state was saved: everything loads again");
        }
        store.save(&state)?;
        let progress = watch::Sender::new(Progress {
            loaded: loaded_modules(&state),
            applied_revision: None,
        });
        Ok(Self {
            kernel,
            images: Arc::new(images),
            fetches: BTreeMap::new(),
            store,
            state,
            firmware_dir,
            release,
            progress,
            failing: BTreeSet::new(),
            unused_image_retention: DEFAULT_UNUSED_IMAGE_RETENTION,
        })
    }

    /// Keeps an image no module uses for `retention` after its last use (zero: collect
    /// it at the end of the pass that stopped using it).
    pub fn with_unused_image_retention(mut self, retention: Duration) -> Self {
        self.unused_image_retention = retention;
        self
    }

    /// Follows what this reconciler has loaded and applied.
    pub fn progress(&self) -> watch::Receiver<Progress> {
        self.progress.subscribe()
    }

    pub fn state(&self) -> &State {
        &self.state
    }

    pub fn kernel(&self) -> &Arc<dyn Kernel> {
        &self.kernel
    }

    pub fn hello(&self, node_name: &str) -> Hello {
        Hello {
            node_name: node_name.to_string(),
            boot_id: self.state.boot_id.clone(),
            kernel_release: self.release.clone(),
            loaded: loaded_modules(&self.state),
        }
    }

    /// Successful unload events for the keys `snapshot` asks to unload that this agent
    /// has not loaded: the control plane learns they are unloaded without anything
    /// being run. Meant once per received snapshot, not on every pass.
    pub fn confirm_already_unloaded(&self, snapshot: &DesiredSnapshot) -> Vec<AgentEvent> {
        plan::already_unloaded(snapshot, &self.state.modules)
            .into_iter()
            .map(|key| AgentEvent {
                key: key.to_string(),
                version: None,
                action: EventAction::Unload,
                outcome: Outcome::Success,
                image: String::new(),
                digest: None,
                pull_ms: 0,
                duration_ms: 0,
                at_unix_ms: now_unix_ms(),
                revision: snapshot.revision,
                kept: vec![],
                timing: LoadTiming::default(),
            })
            .collect()
    }

    /// One pass: plan against the kernel's loaded modules, act, report. Waits for
    /// every pull the pass needs.
    pub async fn reconcile(&mut self, snapshot: &DesiredSnapshot) -> Vec<AgentEvent> {
        let mut events = vec![];
        self.reconcile_until(snapshot, std::future::pending(), |event| events.push(event))
            .await;
        events
    }

    /// One pass that stops waiting for pulls when `interrupt` completes (a new snapshot
    /// arrived): the loads still waiting are not attempted, their pulls go on and the
    /// next pass takes them over. Each event goes to `emit` as it happens, so an unload
    /// is reported before the pass waits for any pull. Returns whether the pass ran to
    /// its end.
    #[tracing::instrument(name = "reconcile", skip_all, fields(revision = snapshot.revision))]
    pub async fn reconcile_until(
        &mut self,
        snapshot: &DesiredSnapshot,
        interrupt: impl Future<Output = ()>,
        emit: impl FnMut(AgentEvent),
    ) -> bool {
        let complete = self.reconcile_pass(snapshot, interrupt, emit).await;
        self.progress.send_modify(|p| {
            p.loaded = loaded_modules(&self.state);
            if complete {
                p.applied_revision = Some(snapshot.revision);
            }
        });
        complete
    }

    async fn reconcile_pass(
        &mut self,
        snapshot: &DesiredSnapshot,
        interrupt: impl Future<Output = ()>,
        mut emit: impl FnMut(AgentEvent),
    ) -> bool {
        let loaded = match self.kernel.loaded_modules() {
            Ok(loaded) => loaded,
            Err(e) => {
                tracing::error!(error = %error_chain(&e), "cannot read the loaded modules");
                return true;
            }
        };
        // Unloads never wait behind loads or pulls: they all go first, while the pulls
        // the loads need already run.
        let mut unloads = vec![];
        let mut loads = vec![];
        for action in plan::failed_last(
            plan::plan(snapshot, &self.state.modules, &loaded),
            &self.failing,
        ) {
            match action {
                Action::Unload { record, reason } => unloads.push((record, reason)),
                Action::Load { desired, reason } => loads.push((desired, reason)),
            }
        }
        self.start_fetches(loads.iter().map(|(desired, _)| desired.as_ref()));
        let in_use_before: BTreeSet<String> = self
            .state
            .modules
            .values()
            .map(|r| r.digest.clone())
            .collect();
        let mut keep: BTreeSet<String> = BTreeSet::new();
        // Keys whose previous version could not be unloaded: loading the new one now
        // would be a no-op for modprobe while the old code keeps running.
        let mut blocked = BTreeSet::new();
        for (record, reason) in unloads {
            let span = tracing::info_span!("module", key = %record.key);
            span.in_scope(|| tracing::info!(?reason, "unloading"));
            let event = self
                .unload(*record, snapshot.revision)
                .instrument(span)
                .await;
            if !event.is_success() {
                blocked.insert(event.key.clone());
            }
            emit(self.note(event));
        }
        let mut interrupt = std::pin::pin!(interrupt);
        let mut complete = true;
        for (desired, reason) in loads {
            let key = FetchKey::of(&desired);
            let event = if blocked.contains(&desired.key) {
                if let Some(fetch) = self.fetches.remove(&key) {
                    fetch.abort();
                }
                AgentEvent {
                    key: desired.key.clone(),
                    version: desired.version.clone(),
                    action: EventAction::Load,
                    outcome: Outcome::Failure(
                        "not loaded: unloading the previous version failed (see its unload event)"
                            .into(),
                    ),
                    image: desired.image.clone(),
                    digest: desired.digest.clone(),
                    pull_ms: 0,
                    duration_ms: 0,
                    at_unix_ms: 0,
                    revision: snapshot.revision,
                    kept: vec![],
                    timing: LoadTiming::default(),
                }
                .ended(SystemTime::now())
            } else {
                let fetch = self.fetches.get_mut(&key).expect("started above");
                let joined = tokio::select! {
                    biased;
                    () = interrupt.as_mut() => {
                        complete = false;
                        break;
                    }
                    joined = fetch => joined,
                };
                self.fetches.remove(&key);
                let fetched = match joined {
                    Ok(Ok(fetched)) => Ok(fetched),
                    Ok(Err(e)) => {
                        if let Some(digest) = self
                            .images
                            .known_digest(&fetch_request(&desired, &self.release))
                        {
                            keep.insert(digest);
                        }
                        Err(error_chain(&e))
                    }
                    Err(e) => Err(format!("the pull stopped: {e}")),
                };
                let span = tracing::info_span!("module", key = %desired.key);
                span.in_scope(|| tracing::info!(?reason, image = %desired.image, "loading"));
                self.load(&desired, fetched, snapshot.revision, &mut keep)
                    .instrument(span)
                    .await
            };
            emit(self.note(event));
        }
        keep.extend(self.state.modules.values().map(|r| r.digest.clone()));
        for released in in_use_before.difference(&keep) {
            if let Err(e) = self.images.cache().touch(released) {
                tracing::warn!(error = %error_chain(&e), "cannot record an image's last use");
            }
        }
        // Pulls still running may be about to use what a collection would remove.
        if !complete {
            return false;
        }
        let unused_since = SystemTime::now()
            .checked_sub(self.unused_image_retention)
            .unwrap_or(SystemTime::UNIX_EPOCH);
        match self.images.gc(&keep, unused_since) {
            Ok(report) if report != Default::default() => {
                tracing::info!(?report, "cache collected")
            }
            Ok(_) => {}
            Err(e) => tracing::warn!(error = %error_chain(&e), "cache garbage collection failed"),
        }
        complete
    }

    /// Remembers which modules failed last, logs the outcome.
    fn note(&mut self, event: AgentEvent) -> AgentEvent {
        match &event.outcome {
            Outcome::Success => {
                self.failing.remove(&event.key);
                tracing::info!(key = %event.key, action = ?event.action, "done")
            }
            Outcome::Failure(error) => {
                self.failing.insert(event.key.clone());
                tracing::warn!(key = %event.key, action = ?event.action, %error, "failed")
            }
        }
        event
    }

    /// Starts a pull, each in its own task, for every module to load that has none
    /// running; stops those no module to load needs any more (each holds one of the
    /// concurrent pulls).
    fn start_fetches<'a>(&mut self, loads: impl Iterator<Item = &'a DesiredModule>) {
        let loads: BTreeMap<FetchKey, &DesiredModule> = loads
            .map(|desired| (FetchKey::of(desired), desired))
            .collect();
        self.fetches.retain(|key, fetch| {
            let wanted = loads.contains_key(key);
            if !wanted {
                fetch.abort();
            }
            wanted
        });
        for (key, desired) in loads {
            if self.fetches.contains_key(&key) {
                continue;
            }
            let images = self.images.clone();
            let desired = desired.clone();
            let release = self.release.clone();
            let span = tracing::info_span!("pull", key = %desired.key);
            let fetch = tokio::spawn(
                async move { images.fetch(&fetch_request(&desired, &release)).await }
                    .instrument(span),
            );
            self.fetches.insert(key, fetch);
        }
    }

    fn save(&self) -> Result<(), String> {
        self.store.save(&self.state).map_err(|e| error_chain(&e))
    }

    async fn load(
        &mut self,
        desired: &DesiredModule,
        fetched: Result<Fetched, String>,
        revision: u64,
        keep: &mut BTreeSet<String>,
    ) -> AgentEvent {
        let mut event = AgentEvent {
            key: desired.key.clone(),
            version: desired.version.clone(),
            action: EventAction::Load,
            outcome: Outcome::Success,
            image: desired.image.clone(),
            digest: desired.digest.clone(),
            pull_ms: 0,
            duration_ms: 0,
            at_unix_ms: 0,
            revision,
            kept: vec![],
            timing: LoadTiming::default(),
        };
        let fetched = match fetched {
            Ok(f) => f,
            Err(error) => {
                event.outcome = Outcome::Failure(error);
                return event.ended(SystemTime::now());
            }
        };
        keep.insert(fetched.digest.clone());
        event.digest = Some(fetched.digest.clone());
        event.pull_ms = if fetched.fresh {
            millis(fetched.elapsed)
        } else {
            0
        };
        event.timing.pull = fetched.steps.pull;
        event.timing.extract = fetched.steps.extract;

        let started = Instant::now();
        let kernel = self.kernel.clone();
        let job = LoadJob {
            desired: desired.clone(),
            root: fetched.root.clone(),
            release: self.release.clone(),
            firmware_dir: self.firmware_dir.clone(),
        };
        let result = tokio::task::spawn_blocking(move || job.run(kernel.as_ref()))
            .await
            .expect("load does not panic");
        let modprobe = started.elapsed();
        event.duration_ms = millis(modprobe);
        event.timing.modprobe = Some(modprobe);
        event.at_unix_ms = now_unix_ms();
        match result {
            Ok((loaded, firmware_files)) => {
                let module_dir = module_dir(&fetched.root, desired.modprobe.dir_name());
                self.state.modules.insert(
                    desired.key.clone(),
                    ModuleRecord {
                        key: desired.key.clone(),
                        version: desired.version.clone(),
                        image: desired.image.clone(),
                        digest: fetched.digest,
                        kernel: self.release.clone(),
                        module_dir,
                        modprobe: desired.modprobe.clone(),
                        in_tree_modules_to_remove: desired.in_tree_modules_to_remove.clone(),
                        loaded,
                        firmware_files,
                        loaded_at_unix_ms: event.at_unix_ms,
                    },
                );
                if let Err(e) = self.save() {
                    event.outcome =
                        Outcome::Failure(format!("loaded, but saving the state failed: {e}"));
                }
            }
            Err(e) => event.outcome = Outcome::Failure(signature::explain(&error_chain(&e))),
        }
        // The state saved too: the agent's part of the load is done.
        event.timing.finished = Some(SystemTime::now());
        event
    }

    async fn unload(&mut self, record: ModuleRecord, revision: u64) -> AgentEvent {
        let started = Instant::now();
        let kernel = self.kernel.clone();
        let firmware_dir = self.firmware_dir.clone();
        let job = record.clone();
        let others: Vec<(String, Vec<String>)> = self
            .state
            .modules
            .values()
            .filter(|r| r.key != record.key)
            .map(|r| (r.key.clone(), r.loaded.clone()))
            .collect();
        let result = tokio::task::spawn_blocking(move || {
            unload(kernel.as_ref(), &job, &others, &firmware_dir)
        })
        .await
        .expect("unload does not panic");
        let mut event = AgentEvent {
            key: record.key.clone(),
            version: record.version.clone(),
            action: EventAction::Unload,
            outcome: Outcome::Success,
            image: record.image.clone(),
            digest: Some(record.digest.clone()),
            pull_ms: 0,
            duration_ms: millis(started.elapsed()),
            at_unix_ms: now_unix_ms(),
            revision,
            kept: vec![],
            timing: LoadTiming::default(),
        };
        match result {
            Ok(kept) => {
                for Kept { module, needed_by } in &kept {
                    tracing::warn!(
                        module = record.key,
                        kernel_module = module,
                        needed_by = needed_by.join(", "),
                        "kernel module left loaded: other modules served on this node need it"
                    );
                }
                self.state.modules.remove(&record.key);
                match self.save() {
                    Ok(()) => event.kept = kept,
                    Err(e) => {
                        event.outcome =
                            Outcome::Failure(format!("unloaded, but saving the state failed: {e}"))
                    }
                }
            }
            Err(e) => event.outcome = Outcome::Failure(error_chain(&e)),
        }
        event
    }
}

impl Drop for Reconciler {
    fn drop(&mut self) {
        for fetch in self.fetches.values() {
            fetch.abort();
        }
    }
}

fn loaded_modules(state: &State) -> Vec<LoadedModule> {
    state
        .modules
        .values()
        .map(|r| LoadedModule {
            key: r.key.clone(),
            version: r.version.clone(),
            image: r.image.clone(),
            digest: r.digest.clone(),
        })
        .collect()
}

/// `<root>/<dirName>`.
pub fn module_dir(root: &Path, dir_name: &str) -> PathBuf {
    root.join(dir_name.trim_start_matches('/'))
}

struct LoadJob {
    desired: DesiredModule,
    root: PathBuf,
    release: String,
    firmware_dir: PathBuf,
}

impl LoadJob {
    /// In-tree removals, firmware, depmod, modprobe in order; on failure what this
    /// attempt loaded is unloaded again.
    fn run(&self, kernel: &dyn Kernel) -> Result<(Vec<String>, Vec<PathBuf>), StepError> {
        let settings = &self.desired.modprobe;
        let module_dir = module_dir(&self.root, settings.dir_name());
        let loaded_now = kernel.loaded_modules()?;
        for module in &self.desired.in_tree_modules_to_remove {
            if loaded_now.contains(&normalize_module_name(module)) {
                kernel.remove_in_tree(module)?;
            }
        }
        let mut firmware_files = vec![];
        if let Some(path) = &settings.firmware_path {
            let source = self.root.join(path.trim_start_matches('/'));
            firmware_files = firmware::install(&source, &self.firmware_dir)?;
            if firmware::needs_firmware_class_path(&self.firmware_dir) {
                kernel.set_firmware_class_path(&self.firmware_dir)?;
            }
        }
        if !module_dir.join("lib/modules").join(&self.release).is_dir() {
            let _ = firmware::remove(&firmware_files, &self.firmware_dir);
            return Err(StepError::NoModulesForKernel {
                dir_name: settings.dir_name().trim_end_matches('/').to_string(),
                kernel: self.release.clone(),
            });
        }
        modprobe::depmod_if_needed(&module_dir, &self.release)?;
        if modprobe::uses_raw_load(settings) {
            let command = modprobe::load_command(settings, &module_dir, &self.root, "");
            if let Err(e) = kernel.modprobe(&command) {
                let _ = firmware::remove(&firmware_files, &self.firmware_dir);
                return Err(e.into());
            }
            return Ok((self.desired.load_order(), firmware_files));
        }
        let order = self.desired.load_order();
        if order.is_empty() {
            return Err(StepError::NothingToLoad);
        }
        let mut loaded: Vec<String> = vec![];
        for module in &order {
            let command = modprobe::load_command(settings, &module_dir, &self.root, module);
            if let Err(e) = kernel.modprobe(&command) {
                for done in loaded.iter().rev() {
                    let undo = modprobe::unload_command(settings, &module_dir, &self.root, done);
                    let _ = kernel.modprobe(&undo);
                }
                let _ = firmware::remove(&firmware_files, &self.firmware_dir);
                return Err(e.into());
            }
            loaded.push(module.clone());
        }
        Ok((loaded, firmware_files))
    }
}

/// Unloads in reverse load order (skipping what is already gone), then removes the
/// firmware files that were installed. A kernel module that `others` (every other served
/// module's key and the modules it loaded) still need stays: returned, to be reported.
fn unload(
    kernel: &dyn Kernel,
    record: &ModuleRecord,
    others: &[(String, Vec<String>)],
    firmware_dir: &Path,
) -> Result<Vec<Kept>, StepError> {
    let mut kept = vec![];
    let settings = &record.modprobe;
    let root = record
        .module_dir
        .ancestors()
        .nth(
            Path::new(settings.dir_name().trim_start_matches('/'))
                .components()
                .count(),
        )
        .unwrap_or(&record.module_dir)
        .to_path_buf();
    if settings
        .raw_args
        .as_ref()
        .is_some_and(|r| !r.unload.is_empty())
    {
        let command = modprobe::unload_command(settings, &record.module_dir, &root, "");
        kernel.modprobe(&command)?;
    } else if let Some(removal) = shared_removal(kernel, record, others)? {
        for module in &removal.remove {
            kernel.remove_module(module)?;
        }
        kept = removal.kept;
    } else {
        let loaded = kernel.loaded_modules()?;
        for module in record.loaded.iter().rev() {
            if !loaded.contains(&normalize_module_name(module)) {
                continue;
            }
            let still = kernel.loaded_modules()?;
            if !still.contains(&normalize_module_name(module)) {
                continue; // removed with a module unloaded before it
            }
            let command = modprobe::unload_command(settings, &record.module_dir, &root, module);
            kernel.modprobe(&command)?;
        }
    }
    firmware::remove(&record.firmware_files, firmware_dir)?;
    Ok(kept)
}

/// The removals that unload `record` without touching what `others` need, when they
/// share a kernel module with it (see `shared_modules`).
fn shared_removal(
    kernel: &dyn Kernel,
    record: &ModuleRecord,
    others: &[(String, Vec<String>)],
) -> Result<Option<Removal>, StepError> {
    if others.is_empty() {
        return Ok(None);
    }
    let users = kernel.module_users()?;
    let needs: Vec<(String, BTreeSet<String>)> = others
        .iter()
        .map(|(key, named)| (key.clone(), needed(&users, named)))
        .collect();
    Ok(plan_removal(&users, &record.loaded, &needs).transpose()?)
}
