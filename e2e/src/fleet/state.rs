//! The fleet's record of itself: what `up` started (`state.json`), where a fleet lives
//! (state directory, base port, binaries), and the processes of a running fleet.

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::kmm;
use super::network::Network;
use super::nodes::RealNode;
use super::nodes::images::NodeImages;
use super::ui::UiForward;
use crate::process::{Tracked, spawn};
use crate::toolchain::BIN_DIR_ENV;
use crate::{Error, IoContext, Result, cache_dir, kmod};

/// What `up` started, persisted as `state.json` in the state directory.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct State {
    pub clusters: Vec<Cluster>,
    /// `host:port` of the OCI registry, on loopback.
    pub registry: String,
    /// The same registry as pods and containerd on the real nodes reach it, at the
    /// bridge address (`198.18.F.1:<port>`): images pods pull are named with it.
    #[serde(default)]
    pub node_registry: String,
    /// The real nodes' bridge, addresses and names.
    #[serde(default)]
    pub network: Option<Network>,
    /// Images pushed for the real nodes (sandbox, busybox), named by `node_registry`.
    #[serde(default)]
    pub node_images: Option<NodeImages>,
    /// Sample images pushed to the registry, by kernel.
    pub images: Vec<kmod::SampleImage>,
    pub processes: Vec<Tracked>,
    /// kmm-fleet's components, unless started with `--no-kmm`.
    #[serde(default)]
    pub kmm: Option<kmm::Kmm>,
    /// The port-forward to the fleet view `cargo xtask env ui` left running: not one of
    /// [`State::processes`], whose every member must run for the fleet to be up (a
    /// forward ends with the Pod it reaches).
    #[serde(default)]
    pub ui_forward: Option<UiForward>,
}

/// One cluster of the fleet.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Cluster {
    /// `hub`, `spoke1`, `spoke2`, ...
    pub name: String,
    pub kubeconfig: PathBuf,
    pub server: String,
    /// Simulated nodes and their kernels (empty on the hub).
    pub nodes: Vec<SimulatedNode>,
    /// Real nodes (`<cluster>-real1`, ...), labelled `kmm-fleet.dev/node-type=real`.
    #[serde(default)]
    pub real_nodes: Vec<RealNode>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SimulatedNode {
    pub name: String,
    pub kernel: String,
}

impl State {
    pub fn cluster(&self, name: &str) -> Result<&Cluster> {
        self.clusters
            .iter()
            .find(|c| c.name == name)
            .ok_or_else(|| Error::Invalid(format!("no cluster {name} in the running fleet")))
    }

    pub fn spokes(&self) -> impl Iterator<Item = &Cluster> {
        self.clusters.iter().filter(|c| c.name != "hub")
    }

    /// Every real node of every cluster.
    pub fn real_nodes(&self) -> impl Iterator<Item = &RealNode> {
        self.clusters.iter().flat_map(|c| &c.real_nodes)
    }

    pub fn load(dir: &Path) -> Result<Option<Self>> {
        let path = dir.join("state.json");
        match std::fs::read(&path) {
            Ok(bytes) => serde_json::from_slice(&bytes)
                .map(Some)
                .map_err(|e| Error::Invalid(format!("{}: {e}", path.display()))),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(Error::Io {
                context: format!("reading {}", path.display()),
                source: e,
            }),
        }
    }

    pub(super) fn save(&self, dir: &Path) -> Result<()> {
        let path = dir.join("state.json");
        let text = serde_json::to_vec_pretty(self).map_err(|e| Error::Invalid(e.to_string()))?;
        std::fs::write(&path, text).context(|| format!("writing {}", path.display()))
    }
}

/// Where a fleet lives: its state directory, its ports, and the binaries it runs.
#[derive(Debug, Clone)]
pub struct Settings {
    /// Certificates, kubeconfigs, logs and `state.json`.
    pub state_dir: PathBuf,
    /// Every port is `base_port` plus a fixed offset (see README).
    pub base_port: u16,
    /// Prebuilt upstream binaries instead of the built, cached toolchain.
    pub bin_dir: Option<PathBuf>,
}

impl Settings {
    /// `$KMM_FLEET_STATE_DIR` (default `<cache>/env`), `$KMM_FLEET_BASE_PORT` (default
    /// 16000) and `$KMM_FLEET_BIN_DIR`.
    pub fn from_env() -> Result<Self> {
        let base_port = match std::env::var("KMM_FLEET_BASE_PORT") {
            Ok(v) => v
                .parse()
                .map_err(|e| Error::Invalid(format!("KMM_FLEET_BASE_PORT={v}: {e}")))?,
            Err(_) => 16000,
        };
        Ok(Self {
            state_dir: std::env::var_os("KMM_FLEET_STATE_DIR")
                .map_or_else(|| cache_dir().join("env"), PathBuf::from),
            base_port,
            bin_dir: std::env::var_os(BIN_DIR_ENV).map(PathBuf::from),
        })
    }
}

/// The running fleet's state; an error if none is running.
pub fn running(settings: &Settings) -> Result<State> {
    let dir = &settings.state_dir;
    match State::load(dir)? {
        Some(state) if state.processes.iter().all(Tracked::alive) => Ok(state),
        Some(state) => {
            let dead: Vec<_> = state
                .processes
                .iter()
                .filter(|p| !p.alive())
                .map(|p| format!("{} (log: {})", p.name, p.log.display()))
                .collect();
            Err(Error::Invalid(format!(
                "the fleet in {} is degraded; not running: {}",
                dir.display(),
                dead.join(", ")
            )))
        }
        None => Err(Error::Invalid(format!(
            "no fleet is running (no state in {}); start one with `cargo xtask env up`",
            dir.display()
        ))),
    }
}

/// The processes in `state.json`, read on their own: a state written by another
/// version of this crate still names what `down` must stop. The fleet view's
/// port-forward, when one runs, comes last.
pub(super) fn recorded_processes(dir: &Path) -> Result<Vec<Tracked>> {
    #[derive(Deserialize)]
    struct Recorded {
        processes: Vec<Tracked>,
        #[serde(default)]
        ui_forward: Option<Forward>,
    }
    #[derive(Deserialize)]
    struct Forward {
        process: Tracked,
    }
    let path = dir.join("state.json");
    match std::fs::read(&path) {
        Ok(bytes) => serde_json::from_slice::<Recorded>(&bytes)
            .map(|r| {
                let mut processes = r.processes;
                processes.extend(r.ui_forward.map(|f| f.process));
                processes
            })
            .map_err(|e| Error::Invalid(format!("{}: {e}", path.display()))),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(vec![]),
        Err(e) => Err(Error::Io {
            context: format!("reading {}", path.display()),
            source: e,
        }),
    }
}

/// Stops process `name` of the running fleet (SIGTERM, then SIGKILL after `grace`); it
/// stays in the state, so [`start_process`] can start it again.
pub fn stop_process(settings: &Settings, name: &str, grace: Duration) -> Result<Tracked> {
    let state = State::load(&settings.state_dir)?
        .ok_or_else(|| Error::Invalid("no fleet is running".into()))?;
    let process = state
        .processes
        .iter()
        .find(|p| p.name == name)
        .ok_or_else(|| Error::Invalid(format!("the fleet has no process {name}")))?;
    process.stop(grace);
    Ok(process.clone())
}

/// (Re)starts process `name` of the running fleet with its recorded command line, or
/// with `args` instead (recorded for later restarts); a running one is stopped first.
pub fn start_process(
    settings: &Settings,
    name: &str,
    args: Option<Vec<String>>,
) -> Result<Tracked> {
    let dir = &settings.state_dir;
    let mut state =
        State::load(dir)?.ok_or_else(|| Error::Invalid("no fleet is running".into()))?;
    let process = state
        .processes
        .iter_mut()
        .find(|p| p.name == name)
        .ok_or_else(|| Error::Invalid(format!("the fleet has no process {name}")))?;
    process.stop(Duration::from_secs(10));
    let previous = process.clone();
    let args = args.unwrap_or(previous.args);
    let env: Vec<(&str, String)> = previous
        .env
        .iter()
        .map(|(k, v)| (k.as_str(), v.clone()))
        .collect();
    *process = spawn(
        name,
        &previous.program,
        &args,
        &env,
        &previous.log,
        previous.confinement.as_ref(),
    )?;
    let started = process.clone();
    state.save(dir)?;
    Ok(started)
}

#[cfg(test)]
mod tests {
    use super::recorded_processes;

    fn tracked(name: &str, pid: i32) -> serde_json::Value {
        serde_json::json!({"name": name, "pid": pid, "program": "/bin/true", "log": "/dev/null"})
    }

    #[test]
    fn down_stops_env_uis_forward_first_and_a_state_without_one_reads_as_before() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("state.json");
        let forward = serde_json::json!({
            "url": "http://127.0.0.1:16090",
            "pod": "kmm-hub-7d9f-x2",
            "process": tracked("hub-ui-forward", 12),
        });
        let state = serde_json::json!({
            "processes": [tracked("etcd", 10), tracked("hub/kube-apiserver", 11)],
            "ui_forward": forward,
        });
        std::fs::write(&path, state.to_string()).unwrap();
        let names: Vec<String> = recorded_processes(dir.path())
            .unwrap()
            .into_iter()
            .rev()
            .map(|p| p.name)
            .collect();
        assert_eq!(names, ["hub-ui-forward", "hub/kube-apiserver", "etcd"]);

        let state = serde_json::json!({"processes": [tracked("etcd", 10)]});
        std::fs::write(&path, state.to_string()).unwrap();
        assert_eq!(recorded_processes(dir.path()).unwrap().len(), 1);
    }
}
