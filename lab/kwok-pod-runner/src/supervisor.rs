//! One pod's life on its simulated node, as a kubelet's pod worker would lead it: wait
//! for the pod's inputs and materialise its volumes, add its IP, start each container's
//! process, restart one that exits (by the pod's `restartPolicy`, after a backoff of
//! 1 s doubling to 30 s, reset once a process ran for 60 s), keep its token and
//! ConfigMap files current, honour the node's power switch, and finally stop it
//! (SIGTERM, its grace period, SIGKILL) and remove its files and address.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::path::PathBuf;
use std::process::ExitStatus;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::{ConfigMap, Pod, Service};
use k8s_openapi::jiff::Timestamp;
use kmm_runtime::backoff::Backoff;
use kube::api::ListParams;
use kube::runtime::reflector::{ObjectRef, Store};
use kube::{Api, Client, ResourceExt};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use tokio::sync::{mpsc, oneshot, watch};
use tokio::task::{AbortHandle, JoinSet};
use tokio::time::{Instant, MissedTickBehavior, sleep_until};

use super::address::Addresses;
use super::container::process_spec;
use super::selection::grace_period;
use super::service_env::service_env;
use super::status::{Board, ContainerStatus, State};
use super::tokens::{TokenSource, Tokens};
use super::volumes::{self, HostPath, Kind, Layout, Plan, Source};
use super::{POWERED_OFF, child, files};
use crate::{Error, Result};

/// How often the node's power switch is read and the pod's inputs re-synced.
const POLL: Duration = Duration::from_millis(500);
const FIRST_BACKOFF: Duration = Duration::from_secs(1);
const MAX_BACKOFF: Duration = Duration::from_secs(30);
/// A process that ran this long restarts after the first backoff again.
const RESET_AFTER: Duration = Duration::from_secs(60);
/// How long killed processes get to be reaped.
const REAP_TIMEOUT: Duration = Duration::from_secs(5);

/// What every supervisor shares.
pub(super) struct Context {
    pub client: Client,
    /// `--root`: per-node directories and `status.json`.
    pub root: PathBuf,
    pub logs: PathBuf,
    /// `/run/netns/<name>` of the real node.
    pub netns: PathBuf,
    /// Image path of a program -> host path.
    pub programs: BTreeMap<String, PathBuf>,
    /// The runner's own `PATH`, the one variable processes get from the host.
    pub host_path: Option<String>,
    /// The pods' namespace's ConfigMaps.
    pub config_maps: Store<ConfigMap>,
    pub addresses: Addresses,
    pub board: Board,
}

/// The runner's hold on a supervisor.
#[derive(Debug)]
pub(super) struct Handle {
    pub node: String,
    pod: watch::Sender<Arc<Pod>>,
    stop: oneshot::Sender<()>,
    pub task: AbortHandle,
}

impl Handle {
    /// Passes on a newer version of the pod (for the Downward API files).
    pub(super) fn update(&self, pod: &Arc<Pod>) {
        self.pod.send_if_modified(|current| {
            let newer = current.resource_version() != pod.resource_version();
            if newer {
                *current = pod.clone();
            }
            newer
        });
    }

    /// Has the supervisor stop the pod; its task ends once the pod is stopped and
    /// cleaned up.
    pub(super) fn stop(self) {
        let _ = self.stop.send(());
    }
}

/// Starts supervising `pod` in `tasks`; the task yields the pod's UID when done.
pub(super) fn start(ctx: Arc<Context>, pod: Arc<Pod>, tasks: &mut JoinSet<String>) -> Handle {
    let (pod_tx, pod_rx) = watch::channel(pod.clone());
    let (stop_tx, stop_rx) = oneshot::channel();
    let (exits_tx, exits_rx) = mpsc::unbounded_channel();
    let supervisor = Supervisor::new(ctx, pod, exits_tx);
    let node = supervisor.node.clone();
    let task = tasks.spawn(supervisor.run(pod_rx, stop_rx, exits_rx));
    Handle {
        node,
        pod: pod_tx,
        stop: stop_tx,
        task,
    }
}

/// A container's process ended.
#[derive(Debug)]
struct Exit {
    index: usize,
    pid: i32,
    status: std::io::Result<ExitStatus>,
}

/// One container's process over the pod's life.
#[derive(Debug)]
struct Run {
    name: String,
    pid: Option<i32>,
    /// When the current process started, monotonic and as RFC 3339.
    since: Option<(Instant, String)>,
    starts: u32,
    backoff: Backoff,
    next_start: Instant,
    /// Why it will not start again.
    finished: Option<String>,
    last_exit: Option<String>,
    /// Killed by a power loss: restarts when the power is back, without backoff.
    power_killed: bool,
}

impl Run {
    fn new(name: &str) -> Self {
        Self {
            name: name.to_owned(),
            pid: None,
            since: None,
            starts: 0,
            backoff: Backoff::new(FIRST_BACKOFF, MAX_BACKOFF),
            next_start: Instant::now(),
            finished: None,
            last_exit: None,
            power_killed: false,
        }
    }
}

struct Supervisor {
    ctx: Arc<Context>,
    pod: Arc<Pod>,
    /// `namespace/name`, for logs.
    key: String,
    uid: String,
    node: String,
    pod_ip: String,
    layout: Layout,
    /// The pod's volumes, or why the runner refuses the pod.
    plan: Result<(Plan, IpAddr), String>,
    containers: Vec<Run>,
    tokens: Tokens,
    /// Each files volume's files as last written.
    written: BTreeMap<String, BTreeMap<String, Vec<u8>>>,
    /// All inputs were there once: the containers may start.
    ready: bool,
    /// Why a container cannot start now.
    waiting: Option<String>,
    address: Option<IpAddr>,
    powered_off: bool,
    terminating: bool,
    exits: mpsc::UnboundedSender<Exit>,
}

impl Supervisor {
    fn new(ctx: Arc<Context>, pod: Arc<Pod>, exits: mpsc::UnboundedSender<Exit>) -> Self {
        let node = pod
            .spec
            .as_ref()
            .and_then(|s| s.node_name.clone())
            .unwrap_or_default();
        let uid = pod.uid().unwrap_or_default();
        let node_dir = ctx.root.join(&node);
        let layout = Layout {
            pod_dir: node_dir.join("pods").join(&uid),
            host_root: node_dir.join("host"),
        };
        let pod_ip = pod
            .status
            .as_ref()
            .and_then(|s| s.pod_ip.clone())
            .unwrap_or_default();
        let plan = admit(&pod, &layout, &ctx.programs, &pod_ip);
        let containers = pod
            .spec
            .iter()
            .flat_map(|s| &s.containers)
            .map(|c| Run::new(&c.name))
            .collect();
        Self {
            key: format!("{}/{}", pod.namespace().unwrap_or_default(), pod.name_any()),
            ctx,
            pod,
            uid,
            node,
            pod_ip,
            layout,
            plan,
            containers,
            tokens: Tokens::default(),
            written: BTreeMap::new(),
            ready: false,
            waiting: None,
            address: None,
            powered_off: false,
            terminating: false,
            exits,
        }
    }

    async fn run(
        mut self,
        mut pod_rx: watch::Receiver<Arc<Pod>>,
        mut stop: oneshot::Receiver<()>,
        mut exits: mpsc::UnboundedReceiver<Exit>,
    ) -> String {
        let (key, node) = (self.key.clone(), self.node.clone());
        match &self.plan {
            Err(reason) => tracing::warn!(pod = key, node, reason, "refused"),
            Ok((plan, _)) if !plan.secrets.is_empty() => tracing::info!(
                pod = key,
                node,
                skipped = plan.secrets.join(", "),
                "Secrets are never written to disk: their volumes and projections are left out"
            ),
            Ok(_) => tracing::info!(pod = key, node, "supervising"),
        }
        let mut tick = tokio::time::interval(POLL);
        tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
        loop {
            self.publish();
            tokio::select! {
                _ = &mut stop => break,
                _ = tick.tick(), if self.plan.is_ok() => self.step().await,
                Some(exit) = exits.recv() => self.exited(exit),
                Ok(()) = pod_rx.changed() => self.pod = pod_rx.borrow_and_update().clone(),
            }
        }
        self.terminate(&mut exits).await;
        self.cleanup().await;
        self.uid
    }

    /// One round: power switch, inputs, starts.
    async fn step(&mut self) {
        let powered_off = self.ctx.root.join(&self.node).join(POWERED_OFF).exists();
        if powered_off != self.powered_off {
            self.powered_off = powered_off;
            tracing::info!(
                pod = self.key,
                node = self.node,
                powered_off,
                "power switch"
            );
            if !powered_off {
                // As after a reboot: everything starts at once.
                let now = Instant::now();
                for run in &mut self.containers {
                    run.backoff.reset();
                    run.next_start = now;
                    run.finished = None;
                }
            }
        }
        if !powered_off {
            match self.sync_volumes().await {
                Ok(()) => self.ready = true,
                // Once started, the kubelet keeps the files it had; so does the runner.
                Err(reason) if !self.ready => {
                    self.wait_for(reason);
                    return;
                }
                Err(reason) => {
                    tracing::debug!(pod = self.key, reason, "volumes not re-synced");
                }
            }
        }
        let now = Instant::now();
        let mut due = vec![];
        for (index, run) in self.containers.iter_mut().enumerate() {
            let running = run.pid.is_some();
            match action(
                powered_off,
                running,
                run.finished.is_some(),
                self.ready,
                now >= run.next_start,
            ) {
                Action::Kill => {
                    // Once is enough: the exit is on its way.
                    if let Some(pid) = run.pid.filter(|_| !run.power_killed) {
                        tracing::info!(
                            pod = self.key,
                            container = run.name,
                            pid,
                            "power loss: SIGKILL"
                        );
                        let _ = kill(Pid::from_raw(-pid), Signal::SIGKILL);
                        run.power_killed = true;
                    }
                }
                Action::Start => due.push(index),
                Action::Wait => {}
            }
        }
        if powered_off {
            self.release_address().await;
            return;
        }
        if due.is_empty() {
            return;
        }
        if let Err(e) = self.acquire_address().await {
            self.wait_for(format!("adding the pod IP: {e}"));
            return;
        }
        let services = match self.services().await {
            Ok(services) => services,
            Err(e) => {
                self.wait_for(format!("listing Services: {e}"));
                return;
            }
        };
        self.waiting = None;
        let enable_links = self
            .pod
            .spec
            .as_ref()
            .and_then(|s| s.enable_service_links)
            .unwrap_or(true);
        let namespace = self.pod.namespace().unwrap_or_default();
        let env = service_env(&namespace, enable_links, &services);
        for index in due {
            self.start(index, &env);
        }
    }

    fn wait_for(&mut self, reason: String) {
        if self.waiting.as_ref() != Some(&reason) {
            tracing::warn!(pod = self.key, reason, "waiting");
        }
        self.waiting = Some(reason);
    }

    /// Creates the volumes' directories (until the pod is ready) and brings their
    /// files up to date; the first reason a volume is not complete.
    async fn sync_volumes(&mut self) -> Result<(), String> {
        let Ok((plan, _)) = &self.plan else {
            return Ok(());
        };
        if !self.ready {
            // The processes' working directory, even for a pod without volumes.
            std::fs::create_dir_all(&self.layout.pod_dir)
                .map_err(|e| format!("creating {}: {e}", self.layout.pod_dir.display()))?;
            for volume in &plan.volumes {
                prepare(volume).map_err(|e| format!("volume {}: {e}", volume.name))?;
            }
        }
        let tokens: Vec<&TokenSource> = plan
            .volumes
            .iter()
            .flat_map(|v| match &v.kind {
                Kind::Files(sources) => sources.as_slice(),
                _ => &[],
            })
            .filter_map(|s| match s {
                Source::Token(t) => Some(t),
                _ => None,
            })
            .collect();
        if let Err(e) = self
            .tokens
            .refresh(&self.ctx.client, &self.pod, &tokens)
            .await
        {
            tracing::warn!(pod = self.key, error = %e, "TokenRequest failed; retrying");
        }
        let namespace = self.pod.namespace().unwrap_or_default();
        let mut incomplete = None;
        for volume in &plan.volumes {
            let Kind::Files(sources) = &volume.kind else {
                continue;
            };
            let rendered = volumes::render(
                sources,
                &self.pod,
                |name| {
                    self.ctx
                        .config_maps
                        .get(&ObjectRef::new(name).within(&namespace))
                },
                |source| self.tokens.get(source),
            );
            let files = match rendered {
                Ok(files) => files,
                Err(reason) => {
                    incomplete.get_or_insert(format!("volume {}: {reason}", volume.name));
                    continue;
                }
            };
            let previous = self.written.remove(&volume.name).unwrap_or_default();
            match files::sync_dir(&volume.host, &previous, &files) {
                Ok(()) => {
                    self.written.insert(volume.name.clone(), files);
                }
                Err(e) => {
                    // Unknown state on disk: everything is rewritten next time.
                    incomplete.get_or_insert(format!("volume {}: {e}", volume.name));
                }
            }
        }
        incomplete.map_or(Ok(()), Err)
    }

    async fn services(&self) -> Result<Vec<Service>> {
        let namespace = self.pod.namespace().unwrap_or_default();
        let client = &self.ctx.client;
        let mut services = Api::<Service>::namespaced(client.clone(), &namespace)
            .list(&ListParams::default())
            .await?
            .items;
        if namespace != "default" {
            services.extend(
                Api::<Service>::namespaced(client.clone(), "default")
                    .get_opt("kubernetes")
                    .await?,
            );
        }
        Ok(services)
    }

    fn start(&mut self, index: usize, service_env: &BTreeMap<String, String>) {
        let Ok((plan, _)) = &self.plan else {
            return;
        };
        let Some(container) = self.pod.spec.as_ref().and_then(|s| s.containers.get(index)) else {
            return;
        };
        let run = &mut self.containers[index];
        let spec = match process_spec(
            &self.pod,
            container,
            service_env,
            &plan.mounts[index],
            &self.ctx.programs,
            self.ctx.host_path.as_deref(),
        ) {
            Ok(spec) => spec,
            // Not expected: admission made the same checks on the same spec.
            Err(reason) => {
                tracing::warn!(pod = self.key, container = run.name, reason, "refused");
                run.finished = Some(reason);
                return;
            }
        };
        let namespace = self.pod.namespace().unwrap_or_default();
        let log = self.ctx.logs.join(format!(
            "{namespace}_{}_{}.log",
            self.pod.name_any(),
            run.name
        ));
        let started =
            child::spawn(&spec, &self.ctx.netns, &self.layout.pod_dir, &log).and_then(|child| {
                match child.id().and_then(|pid| i32::try_from(pid).ok()) {
                    Some(pid) => Ok((child, pid)),
                    None => Err(Error::Invalid("the process has no PID".into())),
                }
            });
        match started {
            Ok((mut child, pid)) => {
                let exits = self.exits.clone();
                tokio::spawn(async move {
                    let status = child.wait().await;
                    let _ = exits.send(Exit { index, pid, status });
                });
                let restarts = run.starts;
                run.starts += 1;
                run.pid = Some(pid);
                run.since = Some((Instant::now(), Timestamp::now().to_string()));
                tracing::info!(
                    pod = self.key,
                    node = self.node,
                    container = run.name,
                    pid,
                    restarts,
                    program = %spec.program.display(),
                    log = %log.display(),
                    "started"
                );
            }
            Err(e) => {
                tracing::warn!(pod = self.key, container = run.name, error = %e, "cannot start");
                run.starts += 1;
                self.schedule_restart(index, false, Duration::ZERO, e.to_string());
            }
        }
    }

    /// Records an exit; how long the process ran, `None` for a stale report.
    fn record_exit(&mut self, exit: &Exit) -> Option<(Duration, bool, String)> {
        let run = self.containers.get_mut(exit.index)?;
        if run.pid != Some(exit.pid) {
            return None;
        }
        run.pid = None;
        // What the process forked dies with it, as in a container whose init exits. Its
        // group keeps the number from being reused while any member lives.
        let _ = kill(Pid::from_raw(-exit.pid), Signal::SIGKILL);
        let ran = run
            .since
            .take()
            .map_or(Duration::ZERO, |(at, _)| at.elapsed());
        let (success, what) = match &exit.status {
            Ok(status) => (status.success(), status.to_string()),
            Err(e) => (false, format!("lost: {e}")),
        };
        tracing::info!(pod = self.key, node = self.node, container = run.name, pid = exit.pid, status = what, ran = ?ran, "exited");
        run.last_exit = Some(what.clone());
        Some((ran, success, what))
    }

    fn exited(&mut self, exit: Exit) {
        let Some((ran, success, what)) = self.record_exit(&exit) else {
            return;
        };
        let run = &mut self.containers[exit.index];
        if std::mem::take(&mut run.power_killed) {
            // Starts again when the power is back.
            return;
        }
        self.schedule_restart(exit.index, success, ran, what);
    }

    fn schedule_restart(&mut self, index: usize, success: bool, ran: Duration, what: String) {
        let policy = self
            .pod
            .spec
            .as_ref()
            .and_then(|s| s.restart_policy.clone())
            .unwrap_or_else(|| "Always".into());
        let run = &mut self.containers[index];
        run.last_exit = Some(what.clone());
        match restart_delay(&policy, success, ran, &mut run.backoff) {
            Some(delay) => {
                run.next_start = Instant::now() + delay;
                tracing::info!(pod = self.key, container = run.name, delay = ?delay, "restarting after backoff");
            }
            None => {
                tracing::info!(
                    pod = self.key,
                    container = run.name,
                    policy,
                    "not restarting"
                );
                run.finished = Some(format!("{what}; restartPolicy {policy}"));
            }
        }
    }

    /// SIGTERM to each process, the grace period, SIGKILL to the process groups of those
    /// still running.
    async fn terminate(&mut self, exits: &mut mpsc::UnboundedReceiver<Exit>) {
        self.terminating = true;
        let pids: Vec<i32> = self.containers.iter().filter_map(|r| r.pid).collect();
        if pids.is_empty() {
            return;
        }
        let grace = grace_period(&self.pod);
        tracing::info!(pod = self.key, node = self.node, grace = ?grace, "stopping");
        for pid in &pids {
            let _ = kill(Pid::from_raw(*pid), Signal::SIGTERM);
        }
        self.publish();
        self.reap_until(exits, Instant::now() + grace).await;
        for run in &self.containers {
            if let Some(pid) = run.pid {
                tracing::warn!(
                    pod = self.key,
                    container = run.name,
                    pid,
                    "still running after the grace period: SIGKILL"
                );
                let _ = kill(Pid::from_raw(-pid), Signal::SIGKILL);
            }
        }
        self.reap_until(exits, Instant::now() + REAP_TIMEOUT).await;
    }

    async fn reap_until(&mut self, exits: &mut mpsc::UnboundedReceiver<Exit>, deadline: Instant) {
        while self.containers.iter().any(|r| r.pid.is_some()) {
            tokio::select! {
                Some(exit) = exits.recv() => {
                    self.record_exit(&exit);
                }
                () = sleep_until(deadline) => return,
            }
        }
    }

    async fn cleanup(&mut self) {
        self.release_address().await;
        if let Err(e) = std::fs::remove_dir_all(&self.layout.pod_dir)
            && e.kind() != std::io::ErrorKind::NotFound
        {
            tracing::warn!(pod = self.key, dir = %self.layout.pod_dir.display(), error = %e, "cannot remove the pod's files");
        }
        self.ctx.board.remove(&self.uid);
        tracing::info!(pod = self.key, node = self.node, "stopped");
    }

    async fn acquire_address(&mut self) -> Result<()> {
        let Ok((_, ip)) = &self.plan else {
            return Ok(());
        };
        if self.address.is_some() {
            return Ok(());
        }
        let (ctx, ip) = (self.ctx.clone(), *ip);
        tokio::task::spawn_blocking(move || ctx.addresses.acquire(ip))
            .await
            .map_err(|e| Error::Invalid(format!("adding {ip}: {e}")))??;
        self.address = Some(ip);
        Ok(())
    }

    async fn release_address(&mut self) {
        let Some(ip) = self.address.take() else {
            return;
        };
        let ctx = self.ctx.clone();
        let released = tokio::task::spawn_blocking(move || ctx.addresses.release(ip)).await;
        if let Err(e) = released
            .map_err(|e| Error::Invalid(e.to_string()))
            .and_then(|r| r)
        {
            tracing::warn!(pod = self.key, %ip, error = %e, "cannot remove the pod IP");
        }
    }

    fn publish(&self) {
        let rows = self
            .containers
            .iter()
            .map(|run| {
                let (state, reason) = state(
                    self.plan.as_ref().err(),
                    self.terminating,
                    self.powered_off,
                    self.waiting.as_ref(),
                    run,
                );
                ContainerStatus {
                    namespace: self.pod.namespace().unwrap_or_default(),
                    name: self.pod.name_any(),
                    uid: self.uid.clone(),
                    node: self.node.clone(),
                    pod_ip: self.pod_ip.clone(),
                    container: run.name.clone(),
                    state,
                    reason,
                    pid: run.pid,
                    restarts: run.starts.saturating_sub(1),
                    started_at: run.since.as_ref().map(|(_, at)| at.clone()),
                }
            })
            .collect();
        self.ctx.board.set(&self.uid, rows);
    }
}

/// The pod's plan and IP, or why the runner refuses the pod: everything that does not
/// depend on the moment is checked here, before anything is created.
fn admit(
    pod: &Pod,
    layout: &Layout,
    programs: &BTreeMap<String, PathBuf>,
    pod_ip: &str,
) -> Result<(Plan, IpAddr), String> {
    let spec = pod.spec.as_ref().ok_or("the pod has no spec")?;
    if spec.init_containers.as_ref().is_some_and(|c| !c.is_empty()) {
        return Err("init containers are not supported".into());
    }
    if spec.containers.is_empty() {
        return Err("the pod has no containers".into());
    }
    let ip = pod_ip
        .parse()
        .map_err(|_| format!("the pod IP {pod_ip:?} is not an IP address"))?;
    let plan = volumes::plan(pod, layout)?;
    for (container, mounts) in spec.containers.iter().zip(&plan.mounts) {
        process_spec(pod, container, &BTreeMap::new(), mounts, programs, None)?;
    }
    Ok((plan, ip))
}

/// Creates what a volume needs before the pod starts.
fn prepare(volume: &volumes::Volume) -> std::io::Result<()> {
    match &volume.kind {
        Kind::EmptyDir | Kind::Files(_) | Kind::HostPath(HostPath::CreateDirectory) => {
            std::fs::create_dir_all(&volume.host)
        }
        Kind::HostPath(HostPath::CreateFile) => {
            if let Some(dir) = volume.host.parent() {
                std::fs::create_dir_all(dir)?;
            }
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(&volume.host)
                .map(drop)
        }
        Kind::HostPath(HostPath::MustExist) => match volume.host.try_exists()? {
            true => Ok(()),
            false => Err(std::io::Error::new(
                std::io::ErrorKind::NotFound,
                format!("hostPath {} does not exist", volume.host.display()),
            )),
        },
    }
}

/// What to do with a container in this round.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Action {
    /// Its node lost power while it runs.
    Kill,
    Start,
    Wait,
}

/// The power switch first: a powered-off node runs and starts nothing. Otherwise a
/// stopped container starts when its pod is ready, its backoff is over and its
/// restart policy allows it.
fn action(powered_off: bool, running: bool, finished: bool, ready: bool, due: bool) -> Action {
    match (powered_off, running) {
        (true, true) => Action::Kill,
        (false, false) if ready && due && !finished => Action::Start,
        _ => Action::Wait,
    }
}

/// The delay before restarting a container that exited after running `ran`, `None`
/// if `policy` says it stays stopped.
fn restart_delay(
    policy: &str,
    success: bool,
    ran: Duration,
    backoff: &mut Backoff,
) -> Option<Duration> {
    let restart = match policy {
        "Never" => false,
        "OnFailure" => !success,
        _ => true,
    };
    if !restart {
        return None;
    }
    if ran >= RESET_AFTER {
        backoff.reset();
    }
    // No jitter: one runner per cluster has no herd to spread.
    Some(backoff.next_delay(1.0))
}

/// A container's row state: refusal, stopping and power loss first, then its process.
fn state(
    refused: Option<&String>,
    terminating: bool,
    powered_off: bool,
    waiting: Option<&String>,
    run: &Run,
) -> (State, Option<String>) {
    if let Some(reason) = refused {
        return (State::Refused, Some(reason.clone()));
    }
    if terminating {
        return (State::Terminating, None);
    }
    if powered_off {
        return (State::PoweredOff, None);
    }
    if run.pid.is_some() {
        return (State::Running, None);
    }
    if let Some(reason) = &run.finished {
        return (State::Completed, Some(reason.clone()));
    }
    if run.starts == 0 {
        return (State::Waiting, waiting.cloned());
    }
    (State::Restarting, run.last_exit.clone())
}

#[cfg(test)]
mod tests {
    use k8s_openapi::api::core::v1::{Container, PodSpec};

    use super::super::fields::tests::agent_pod;
    use super::*;

    const S: Duration = Duration::from_secs(1);

    /// Every `[running, finished, ready, due]`.
    fn every_container() -> impl Iterator<Item = [bool; 4]> {
        (0..16).map(|bits: u8| [0, 1, 2, 3].map(|i| bits & (1 << i) != 0))
    }

    /// Whether the container runs once `action` is carried out: what the node ends up
    /// with, whatever way `action` chose.
    fn runs_after(running: bool, action: Action) -> bool {
        match action {
            Action::Kill => false,
            Action::Start => true,
            Action::Wait => running,
        }
    }

    #[test]
    fn a_powered_off_node_kills_and_starts_nothing() {
        for [running, finished, ready, due] in every_container() {
            let chosen = action(true, running, finished, ready, due);
            let case =
                format!("{chosen:?} running {running} finished {finished} ready {ready} due {due}");
            assert!(!runs_after(running, chosen), "still runs: {case}");
            assert_eq!(
                chosen == Action::Kill,
                running,
                "kills only what runs: {case}"
            );
        }
    }

    #[test]
    fn a_powered_node_starts_a_stopped_container_when_ready_due_and_not_finished() {
        let on = |running, finished, ready, due| action(false, running, finished, ready, due);
        assert_eq!(
            on(false, false, true, true),
            Action::Start,
            "stopped, ready and due"
        );
        assert_eq!(on(true, false, true, true), Action::Wait, "already running");
        assert_eq!(
            on(false, false, true, false),
            Action::Wait,
            "its backoff is not over"
        );
        assert_eq!(
            on(false, false, false, true),
            Action::Wait,
            "its pod is not ready"
        );
        assert_eq!(
            on(false, true, true, true),
            Action::Wait,
            "its restart policy ended it"
        );
        let chosen: Vec<Action> = every_container()
            .map(|[running, finished, ready, due]| on(running, finished, ready, due))
            .collect();
        assert!(
            !chosen.contains(&Action::Kill),
            "nothing is killed: {chosen:?}"
        );
        assert_eq!(
            chosen.iter().filter(|a| **a == Action::Start).count(),
            1,
            "one combination of the 16 starts: {chosen:?}"
        );
    }

    #[test]
    fn restarts_back_off_from_1s_doubling_to_30s() {
        let mut backoff = Backoff::new(FIRST_BACKOFF, MAX_BACKOFF);
        let delays: Vec<Duration> = (0..7)
            .map(|_| restart_delay("Always", false, S, &mut backoff).unwrap())
            .collect();
        assert_eq!(delays, [S, 2 * S, 4 * S, 8 * S, 16 * S, 30 * S, 30 * S]);
        // A clean exit restarts too under Always, still backing off.
        assert_eq!(restart_delay("Always", true, S, &mut backoff), Some(30 * S));
    }

    #[test]
    fn a_minute_of_running_resets_the_backoff() {
        let mut backoff = Backoff::new(FIRST_BACKOFF, MAX_BACKOFF);
        for _ in 0..5 {
            restart_delay("Always", false, S, &mut backoff);
        }
        assert_eq!(
            restart_delay("Always", false, 59 * S, &mut backoff),
            Some(30 * S)
        );
        assert_eq!(
            restart_delay("Always", false, 60 * S, &mut backoff),
            Some(S)
        );
        assert_eq!(restart_delay("Always", false, S, &mut backoff), Some(2 * S));
    }

    #[test]
    fn restart_policies() {
        let mut backoff = Backoff::new(FIRST_BACKOFF, MAX_BACKOFF);
        assert_eq!(restart_delay("Never", false, S, &mut backoff), None);
        assert_eq!(restart_delay("Never", true, S, &mut backoff), None);
        assert_eq!(restart_delay("OnFailure", true, S, &mut backoff), None);
        assert_eq!(restart_delay("OnFailure", false, S, &mut backoff), Some(S));
        assert_eq!(restart_delay("Always", true, S, &mut backoff), Some(2 * S));
    }

    #[test]
    fn row_states() {
        let reason = String::from("why");
        let mut run = Run::new("agent");
        assert_eq!(
            state(None, false, false, None, &run),
            (State::Waiting, None)
        );
        assert_eq!(
            state(None, false, false, Some(&reason), &run),
            (State::Waiting, Some("why".into()))
        );
        run.pid = Some(7);
        run.starts = 1;
        assert_eq!(
            state(None, false, false, None, &run),
            (State::Running, None)
        );
        assert_eq!(
            state(None, false, true, None, &run),
            (State::PoweredOff, None)
        );
        assert_eq!(
            state(None, true, true, None, &run),
            (State::Terminating, None)
        );
        assert_eq!(
            state(Some(&reason), true, true, None, &run),
            (State::Refused, Some("why".into()))
        );
        run.pid = None;
        run.last_exit = Some("exit status: 1".into());
        assert_eq!(
            state(None, false, false, Some(&reason), &run),
            (State::Restarting, Some("exit status: 1".into()))
        );
        run.finished = Some("exit status: 0; restartPolicy Never".into());
        assert_eq!(
            state(None, false, false, None, &run),
            (
                State::Completed,
                Some("exit status: 0; restartPolicy Never".into())
            )
        );
    }

    fn layout() -> Layout {
        Layout {
            pod_dir: "/r/n/pods/u".into(),
            host_root: "/r/n/host".into(),
        }
    }

    fn runnable() -> Pod {
        let mut pod = agent_pod();
        pod.spec = Some(PodSpec {
            containers: vec![Container {
                name: "agent".into(),
                command: Some(vec!["/usr/local/bin/kmm-node-agent".into()]),
                ..Default::default()
            }],
            ..pod.spec.unwrap()
        });
        pod
    }

    fn programs() -> BTreeMap<String, PathBuf> {
        BTreeMap::from([(
            "/usr/local/bin/kmm-node-agent".into(),
            PathBuf::from("/ws/kmm-node-agent"),
        )])
    }

    #[test]
    fn admission() {
        let (plan, ip) = admit(&runnable(), &layout(), &programs(), "10.101.0.7").unwrap();
        assert_eq!(ip, "10.101.0.7".parse::<IpAddr>().unwrap());
        assert_eq!(plan.mounts, [vec![]]);

        assert!(
            admit(&runnable(), &layout(), &BTreeMap::new(), "10.101.0.7").is_err(),
            "unmapped program"
        );
        assert!(
            admit(&runnable(), &layout(), &programs(), "").is_err(),
            "no IP"
        );
        assert!(
            admit(&runnable(), &layout(), &programs(), "kwok").is_err(),
            "not an IP"
        );
        let mut with_init = runnable();
        with_init.spec.as_mut().unwrap().init_containers = Some(vec![Container::default()]);
        assert!(admit(&with_init, &layout(), &programs(), "10.101.0.7").is_err());
        let mut empty = runnable();
        empty.spec.as_mut().unwrap().containers.clear();
        assert!(admit(&empty, &layout(), &programs(), "10.101.0.7").is_err());
        let mut second_unmapped = runnable();
        second_unmapped
            .spec
            .as_mut()
            .unwrap()
            .containers
            .push(Container {
                name: "sidecar".into(),
                command: Some(vec!["/bin/sh".into()]),
                ..Default::default()
            });
        assert!(admit(&second_unmapped, &layout(), &programs(), "10.101.0.7").is_err());
    }
}
