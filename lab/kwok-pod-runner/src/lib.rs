//! `kwok-pod-runner`: a stand-in kubelet for a spoke's KWOK nodes (the binary is
//! `src/main.rs`; the local fleet starts one per spoke).
//!
//! * [`selection`] which pods are the runner's, and how long a stopping one may take.
//! * [`supervisor`] one pod's life: inputs, files, processes, restarts, power.
//! * [`volumes`] a pod's volumes as host directories and files.
//! * [`tokens`] the projected service account tokens, requested and renewed.
//! * [`container`] a container's process: program, arguments, environment.
//! * [`fields`] Downward API field values.
//! * [`service_env`] the Service link variables a kubelet sets.
//! * [`expansion`] `$(VAR)` expansion.
//! * [`paths`] mount paths rewritten to the host paths standing for them.
//! * [`child`] starting a process in the real node's network namespace.
//! * [`address`] pod IPs on the runner's interface in that namespace.
//! * [`files`] atomic file replacement.
//! * [`status`] the runner's view, `status.json`.
//!
//! KWOK makes simulated nodes look Ready and marks the pods bound to them Running with
//! an IP from its range, but runs nothing. The runner makes the selected pods on those
//! nodes real: for each it starts the container's program as a host process with the
//! command, arguments, environment and mounted files taken from the Pod, so that
//! whatever the cluster applies (the node agent's DaemonSet, through OCM) is what runs,
//! not a hand-written command line. It is the only simulated part of the deployment.
//! One runner serves one cluster.
//!
//! # Design
//!
//! * Reflectors keep the selected Pods (namespace and label selector), the Nodes and
//!   the namespace's ConfigMaps in memory. On every Pod or Node change the runner
//!   works out which pods are its own ([`selection`]: bound to a node carrying the
//!   KWOK annotation, not terminating, with a pod IP) and starts or stops one
//!   supervisor per pod UID ([`supervisor`]). A pod that is deleted, gets a
//!   `deletionTimestamp` or is replaced (same name, new UID) is stopped; a new pod on a
//!   node waits until that node's stopping pods are gone, as a DaemonSet's successor
//!   would (KWOK deletes a pod at once, where a kubelet would first stop it).
//! * A supervisor waits, like the kubelet, for the pod's inputs (a non-optional
//!   ConfigMap, a required hostPath, the tokens), writes the volumes' files
//!   ([`volumes`], [`tokens`]), adds the pod IP ([`address`]), builds each container's
//!   process ([`container`]: Downward API [`fields`], Service link variables
//!   [`service_env`], `$(VAR)` [`expansion`], [`paths`]) and starts it ([`child`]).
//!   It restarts an exited process with the kubelet's kind of backoff (1 s doubling to
//!   30 s, reset after 60 s of running), keeps token and ConfigMap files current, and
//!   stops the pod with SIGTERM, its `terminationGracePeriodSeconds` (at most 30 s)
//!   and SIGKILL; what a process forked is killed with it.
//! * Every process runs in the network namespace of the cluster's first real node
//!   (`--netns`), where kube-proxy programs the Service ClusterIPs, with the pod's IP on
//!   an interface of the runner's (`--address-interface`) so it can bind to it. A
//!   container's process cannot outlive the runner (parent-death signal); on SIGTERM
//!   or SIGINT the runner stops every pod, removes that interface and exits.
//! * The runner writes nothing to the API but TokenRequests: pod status stays KWOK's.
//!
//! # On disk
//!
//! ```text
//! <root>/status.json                      the runner's view (see `Status`)
//! <root>/<node>/powered-off               the power switch (created by tests)
//! <root>/<node>/host/<path>               hostPath volumes: the node's own /run, /var/lib, ...
//! <root>/<node>/pods/<uid>/               working directory of the pod's processes
//! <root>/<node>/pods/<uid>/volumes/<vol>/ emptyDir, configMap, downwardAPI, projected
//! <logs>/<namespace>_<pod>_<container>.log stdout and stderr, appended across restarts
//! ```
//!
//! A pod's directory is removed when it stops; the host directories stay, as a node's
//! disk does.
//!
//! # Power switch
//!
//! While the file `<root>/<node>/powered-off` exists, the node has lost power: its
//! processes are killed with SIGKILL (no SIGTERM, no grace), its pod IPs removed, and
//! nothing starts on it. The runner looks every 500 ms. Once the file is removed,
//! every container of the node's pods starts at once (no backoff) and its restart
//! count grows, as after a reboot; the host directories kept their contents.
//!
//! # Differences from a kubelet
//!
//! * **Paths.** There is no container filesystem: a process sees the host's. Every
//!   volume mount's `mountPath` is therefore rewritten to the host directory (or file)
//!   that stands for it, in the command, the arguments and the environment values,
//!   after `$(VAR)` expansion. Only whole path prefixes are rewritten: the `mountPath`
//!   must start the string or follow `=`, `:`, `,` or a space, and end the string or be
//!   followed by `/`; the longest `mountPath` wins. So
//!   `--token-file=/var/run/secrets/kmm/token` becomes
//!   `--token-file=<root>/<node>/pods/<uid>/volumes/<vol>/token`. Paths a program
//!   builds in itself (a client library's default token path) are not rewritten: pass
//!   them as flags or environment values. A `workingDir` must be on a mount.
//! * **Programs.** No image is pulled: `--program IMAGE_PATH=HOST_PATH` maps a
//!   container's `command[0]` to a host binary; a container without `command` or with
//!   an unmapped one refuses its pod (logged, `refused` in `status.json`).
//! * **Secrets** are never written to disk: Secret volumes and Secret projections are
//!   left out and their mounts dropped (logged once per pod); `secretKeyRef`,
//!   `configMapKeyRef`, `resourceFieldRef` and `envFrom` refuse the pod, as do init
//!   containers, `subPath` mounts and volume types other than emptyDir, hostPath,
//!   configMap, downwardAPI and projected.
//! * **Isolation.** Processes run as the runner's user, in the host's mount and PID
//!   namespaces, and all KWOK nodes of the cluster share one network namespace: two
//!   pods listening on the same port must bind to their pod IPs. No cgroups, limits,
//!   probes, security contexts or file modes.
//! * **Environment.** The kubelet's variables (container `env` with `value` and
//!   `fieldRef`, Service links computed when the process starts) plus the runner's own
//!   `PATH`, nothing else from the host; `status.hostIP` is the pod's (KWOK's).
//! * **Stopping.** The grace period is always the pod's `terminationGracePeriodSeconds`
//!   (at most 30 s), never a deletion's own: KWOK deletes every terminating pod again
//!   with a grace period of 0.
//! * **Timing.** ConfigMap changes reach the files within 500 ms (a kubelet may take a
//!   minute).

mod address;
mod child;
mod container;
mod expansion;
mod fields;
mod files;
mod paths;
mod selection;
mod service_env;
mod status;
mod supervisor;
mod tokens;
mod volumes;

use std::collections::{BTreeMap, HashMap};
use std::future::Future;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use k8s_openapi::api::core::v1::{ConfigMap, Node, Pod};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client, ResourceExt};
use tokio::sync::Notify;
use tokio::task::{self, JoinSet};
use tokio_stream::StreamExt;

pub use child::Exec;
pub use status::{ContainerStatus, State, Status};

/// Why the runner failed.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },
    #[error("`{command}` failed ({status})")]
    Command { command: String, status: String },
    #[error("kubernetes API: {0}")]
    Kube(#[from] kube::Error),
    #[error("kubeconfig: {0}")]
    Kubeconfig(#[from] kube::config::KubeconfigError),
    #[error("{0}")]
    Invalid(String),
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Attach a description to an I/O error.
trait IoContext<T> {
    fn context(self, context: impl FnOnce() -> String) -> Result<T>;
}

impl<T> IoContext<T> for std::io::Result<T> {
    fn context(self, context: impl FnOnce() -> String) -> Result<T> {
        self.map_err(|source| Error::Io {
            context: context(),
            source,
        })
    }
}

/// Where `ip netns` keeps network namespaces.
pub const NETNS_DIR: &str = "/run/netns";

/// `/run/netns/<name>`, the file `nsenter --net=` takes.
pub fn netns_path(name: &str) -> PathBuf {
    Path::new(NETNS_DIR).join(name)
}

/// The power switch's file name in a node's directory.
pub const POWERED_OFF: &str = "powered-off";
/// The runner's view, in the root directory.
pub const STATUS_FILE: &str = "status.json";

/// What the runner serves and where it puts things (the command line).
#[derive(Debug, Clone)]
pub struct Config {
    /// The cluster's admin kubeconfig.
    pub kubeconfig: PathBuf,
    /// The pods' namespace.
    pub namespace: String,
    /// The pods' label selector.
    pub selector: String,
    /// Only pods on nodes with this annotation (KWOK's `kwok.x-k8s.io/node=fake`).
    pub node_annotation: (String, String),
    /// The real node's network namespace (`/run/netns/<name>`).
    pub netns: String,
    /// The interface the runner owns in that namespace for pod IPs.
    pub address_interface: String,
    /// Per-node directories and `status.json`.
    pub root: PathBuf,
    /// Image path of a program -> host path.
    pub programs: BTreeMap<String, PathBuf>,
    /// Containers' logs.
    pub logs: PathBuf,
}

/// `KEY=VALUE` as a pair; the key must not be empty.
pub fn split_assignment(text: &str) -> Result<(String, String)> {
    match text.split_once('=') {
        Some((key, value)) if !key.is_empty() => Ok((key.to_owned(), value.to_owned())),
        _ => Err(Error::Invalid(format!("{text:?} is not KEY=VALUE"))),
    }
}

/// Serves the cluster until `shutdown` resolves, then stops every pod (SIGTERM, grace,
/// SIGKILL), removes its interface and exits.
pub async fn run(config: Config, shutdown: impl Future<Output = ()>) -> Result<()> {
    let netns = netns_path(&config.netns);
    if !netns.exists() {
        return Err(Error::Invalid(format!(
            "network namespace {} does not exist",
            netns.display()
        )));
    }
    for (image, host) in &config.programs {
        if !host.is_file() {
            return Err(Error::Invalid(format!(
                "--program {image}={}: no such file",
                host.display()
            )));
        }
    }
    for dir in [&config.root, &config.logs] {
        std::fs::create_dir_all(dir).context(|| format!("creating {}", dir.display()))?;
    }
    let client = client_for(&config.kubeconfig).await?;
    let addresses = address::Addresses::create(&config.netns, &config.address_interface)?;

    let changed = Arc::new(Notify::new());
    let (pods, pods_writer) = reflector::store::<Pod>();
    let (nodes, nodes_writer) = reflector::store::<Node>();
    let (config_maps, config_maps_writer) = reflector::store::<ConfigMap>();
    let mut watches = JoinSet::new();
    watches.spawn(keep(
        pods_writer,
        Api::namespaced(client.clone(), &config.namespace),
        watcher::Config::default().labels(&config.selector),
        Some(changed.clone()),
    ));
    watches.spawn(keep(
        nodes_writer,
        Api::all(client.clone()),
        watcher::Config::default(),
        Some(changed.clone()),
    ));
    watches.spawn(keep(
        config_maps_writer,
        Api::namespaced(client.clone(), &config.namespace),
        watcher::Config::default(),
        None,
    ));

    let ctx = Arc::new(supervisor::Context {
        client,
        root: config.root.clone(),
        logs: config.logs.clone(),
        netns,
        programs: config.programs.clone(),
        host_path: std::env::var("PATH").ok(),
        config_maps: config_maps.clone(),
        addresses,
        board: status::Board::new(&config.root.join(STATUS_FILE)),
    });
    ctx.board.write()?;
    let board = ctx.clone();
    watches.spawn(async move {
        loop {
            board.board.changed().await;
            if let Err(e) = board.board.write() {
                tracing::warn!(error = %e, "cannot write the status");
            }
        }
    });

    let mut shutdown = std::pin::pin!(shutdown);
    let synced = async {
        let _ = pods.wait_until_ready().await;
        let _ = nodes.wait_until_ready().await;
        let _ = config_maps.wait_until_ready().await;
    };
    tokio::select! {
        () = &mut shutdown => return finish(&ctx, watches),
        () = synced => {}
    }
    tracing::info!(
        namespace = config.namespace,
        selector = config.selector,
        netns = config.netns,
        "caches synced; serving"
    );

    let annotation = (
        config.node_annotation.0.as_str(),
        config.node_annotation.1.as_str(),
    );
    let mut runner = Runner::default();
    loop {
        runner.reconcile(&ctx, &pods, &nodes, annotation);
        tokio::select! {
            () = &mut shutdown => break,
            () = changed.notified() => {}
            Some(done) = runner.tasks.join_next_with_id() => runner.finished(done),
        }
    }
    tracing::info!("stopping every pod");
    for (_, handle) in runner.running.drain() {
        handle.stop();
    }
    while let Some(done) = runner.tasks.join_next_with_id().await {
        runner.finished(done);
    }
    finish(&ctx, watches)
}

/// A client authenticated as `kubeconfig` says.
async fn client_for(kubeconfig: &Path) -> Result<Client> {
    let kc = Kubeconfig::read_from(kubeconfig)?;
    let config = kube::Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default()).await?;
    Ok(Client::try_from(config)?)
}

/// After every pod stopped: the last status, no interface left behind.
fn finish(ctx: &supervisor::Context, mut watches: JoinSet<()>) -> Result<()> {
    watches.abort_all();
    ctx.board.write()?;
    ctx.addresses.delete()
}

/// Keeps a store current; `changed` is told of every change once the store listed.
async fn keep<K>(
    writer: reflector::store::Writer<K>,
    api: Api<K>,
    config: watcher::Config,
    changed: Option<Arc<Notify>>,
) where
    K: kube::Resource<DynamicType = ()>
        + Clone
        + std::fmt::Debug
        + serde::de::DeserializeOwned
        + Send
        + Sync
        + 'static,
{
    let what = K::kind(&());
    let mut events =
        std::pin::pin!(reflector::reflector(writer, watcher(api, config)).default_backoff());
    while let Some(event) = events.next().await {
        match event {
            Ok(watcher::Event::Init | watcher::Event::InitApply(_)) => {}
            Ok(_) => {
                if let Some(changed) = &changed {
                    changed.notify_one();
                }
            }
            Err(error) => tracing::warn!(%what, %error, "watch failed; retrying"),
        }
    }
}

/// The supervisors, by pod UID.
#[derive(Debug, Default)]
struct Runner {
    running: HashMap<String, supervisor::Handle>,
    /// Pods being stopped: UID -> node.
    stopping: HashMap<String, String>,
    /// Supervisor tasks, which end once their pod is stopped.
    tasks: JoinSet<String>,
    /// Which task supervises which UID (to know which pod a panicked task had).
    task_uids: HashMap<task::Id, String>,
}

impl Runner {
    /// Stops the supervisors of pods no longer selected, starts those of new ones.
    fn reconcile(
        &mut self,
        ctx: &Arc<supervisor::Context>,
        pods: &Store<Pod>,
        nodes: &Store<Node>,
        annotation: (&str, &str),
    ) {
        let all: HashMap<String, Arc<Pod>> = pods
            .state()
            .into_iter()
            .filter_map(|p| Some((p.uid()?, p)))
            .collect();
        let wanted: BTreeMap<&String, &Arc<Pod>> = all
            .iter()
            .filter(|(_, pod)| {
                let node = pod
                    .spec
                    .as_ref()
                    .and_then(|s| s.node_name.as_deref())
                    .and_then(|n| nodes.get(&ObjectRef::new(n)));
                selection::selected(pod, node.as_deref(), annotation)
            })
            .collect();
        let unwanted: Vec<String> = self
            .running
            .keys()
            .filter(|uid| !wanted.contains_key(uid))
            .cloned()
            .collect();
        for uid in unwanted {
            let Some(handle) = self.running.remove(&uid) else {
                continue;
            };
            if let Some(pod) = all.get(&uid) {
                handle.update(pod);
            }
            tracing::info!(uid, node = handle.node, "pod gone, terminating or replaced");
            self.stopping.insert(uid, handle.node.clone());
            handle.stop();
        }
        for (uid, pod) in wanted {
            if let Some(handle) = self.running.get(uid) {
                handle.update(pod);
                continue;
            }
            let node = pod.spec.as_ref().and_then(|s| s.node_name.as_deref());
            if self.stopping.values().any(|n| Some(n.as_str()) == node) {
                // Started when the node's stopping pods are gone (a later reconcile).
                continue;
            }
            let handle = supervisor::start(ctx.clone(), pod.clone(), &mut self.tasks);
            self.task_uids.insert(handle.task.id(), uid.clone());
            self.running.insert(uid.clone(), handle);
        }
    }

    /// A supervisor's task ended: its pod is stopped.
    fn finished(&mut self, done: Result<(task::Id, String), task::JoinError>) {
        let id = match done {
            Ok((id, _)) => id,
            Err(e) => {
                tracing::error!(error = %e, "a pod's supervisor failed");
                e.id()
            }
        };
        if let Some(uid) = self.task_uids.remove(&id) {
            self.stopping.remove(&uid);
            // A supervisor that failed while its pod was still wanted: started anew.
            self.running.remove(&uid);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn assignments() {
        assert_eq!(
            split_assignment("kwok.x-k8s.io/node=fake").unwrap(),
            ("kwok.x-k8s.io/node".into(), "fake".into())
        );
        assert_eq!(
            split_assignment("/usr/local/bin/a=/ws/a=b").unwrap(),
            ("/usr/local/bin/a".into(), "/ws/a=b".into())
        );
        assert_eq!(split_assignment("k=").unwrap(), ("k".into(), String::new()));
        assert!(split_assignment("novalue").is_err());
        assert!(split_assignment("=v").is_err());
    }
}
