//! The runner's own view, `<root>/status.json`: one entry per container of every pod it
//! serves, rewritten atomically whenever it changes, so that tests and `env status` can
//! tell which process serves which node.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use serde::{Deserialize, Serialize};
use tokio::sync::Notify;

use super::files::write_atomic;
use crate::{Error, Result};

/// The contents of `status.json`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Status {
    /// Sorted by namespace, pod name, container order.
    pub containers: Vec<ContainerStatus>,
}

/// One container of a pod the runner serves.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ContainerStatus {
    pub namespace: String,
    /// The pod's name.
    pub name: String,
    pub uid: String,
    pub node: String,
    #[serde(rename = "podIP")]
    pub pod_ip: String,
    pub container: String,
    pub state: State,
    /// Why it waits, was refused or will not restart; how it last exited when
    /// restarting.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// The process serving it now.
    pub pid: Option<i32>,
    /// Starts after the first, as the kubelet's `restartCount`.
    pub restarts: u32,
    /// When the current process started (RFC 3339).
    pub started_at: Option<String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum State {
    /// Not started yet: its inputs (a ConfigMap, a hostPath, a token, the Services)
    /// are not all there.
    Waiting,
    Running,
    /// Exited; starts again after its backoff.
    Restarting,
    /// Exited and, by its pod's `restartPolicy`, not to start again.
    Completed,
    /// Its node's `powered-off` file exists.
    PoweredOff,
    /// The runner cannot run this pod (see the reason).
    Refused,
    /// Its pod is stopping (SIGTERM sent).
    Terminating,
}

/// Every supervisor's rows, and the file they are written to.
#[derive(Debug)]
pub(super) struct Board {
    path: PathBuf,
    pods: Mutex<Pods>,
    changed: Notify,
}

#[derive(Debug, Default)]
struct Pods {
    by_uid: BTreeMap<String, Vec<ContainerStatus>>,
    written: Option<Vec<u8>>,
}

impl Board {
    pub(super) fn new(path: &Path) -> Self {
        Self {
            path: path.to_owned(),
            pods: Mutex::default(),
            changed: Notify::new(),
        }
    }

    /// Replaces a pod's rows.
    pub(super) fn set(&self, uid: &str, rows: Vec<ContainerStatus>) {
        let mut pods = self.lock();
        if pods.by_uid.get(uid) != Some(&rows) {
            pods.by_uid.insert(uid.to_owned(), rows);
            self.changed.notify_one();
        }
    }

    pub(super) fn remove(&self, uid: &str) {
        if self.lock().by_uid.remove(uid).is_some() {
            self.changed.notify_one();
        }
    }

    /// Resolves after the next change.
    pub(super) async fn changed(&self) {
        self.changed.notified().await;
    }

    /// Writes the file if it differs from what was last written.
    pub(super) fn write(&self) -> Result<()> {
        let mut pods = self.lock();
        let mut containers: Vec<ContainerStatus> =
            pods.by_uid.values().flatten().cloned().collect();
        // Stable across writes: by pod, then container order within the pod.
        containers.sort_by(|a, b| (&a.namespace, &a.name).cmp(&(&b.namespace, &b.name)));
        let mut json = serde_json::to_vec_pretty(&Status { containers })
            .map_err(|e| Error::Invalid(format!("status: {e}")))?;
        json.push(b'\n');
        if pods.written.as_ref() != Some(&json) {
            write_atomic(&self.path, &json)?;
            pods.written = Some(json);
        }
        Ok(())
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Pods> {
        self.pods.lock().unwrap_or_else(|e| e.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(name: &str, container: &str, state: State) -> ContainerStatus {
        ContainerStatus {
            namespace: "kmm".into(),
            name: name.into(),
            uid: format!("uid-{name}"),
            node: format!("node-{name}"),
            pod_ip: "10.101.0.7".into(),
            container: container.into(),
            state,
            reason: None,
            pid: (state == State::Running).then_some(4242),
            restarts: 0,
            started_at: (state == State::Running).then(|| "2025-01-01T00:00:00Z".into()),
        }
    }

    #[test]
    fn the_file_format() {
        let mut waiting = row("b", "agent", State::Waiting);
        waiting.reason = Some("ConfigMap kmm-agent-ca does not exist".into());
        let status = Status {
            containers: vec![row("a", "agent", State::Running), waiting],
        };
        let json: serde_json::Value = serde_json::to_value(&status).unwrap();
        assert_eq!(
            json["containers"][0],
            serde_json::json!({
                "namespace": "kmm", "name": "a", "uid": "uid-a", "node": "node-a",
                "podIP": "10.101.0.7", "container": "agent", "state": "running",
                "pid": 4242, "restarts": 0, "startedAt": "2025-01-01T00:00:00Z",
            })
        );
        assert_eq!(json["containers"][1]["state"], "waiting");
        assert_eq!(json["containers"][1]["pid"], serde_json::Value::Null);
        assert_eq!(
            serde_json::from_value::<Status>(json).unwrap(),
            status,
            "tests read it back with these types"
        );
        for (state, text) in [
            (State::Restarting, "restarting"),
            (State::Completed, "completed"),
            (State::PoweredOff, "powered-off"),
            (State::Refused, "refused"),
            (State::Terminating, "terminating"),
        ] {
            assert_eq!(serde_json::to_value(state).unwrap(), text);
        }
    }

    #[test]
    fn the_board_writes_sorted_rows_and_only_changes() {
        let dir =
            std::env::temp_dir().join(format!("kwok-pod-runner-status-{}", std::process::id()));
        let path = dir.join("status.json");
        let board = Board::new(&path);
        board.write().unwrap();
        let read = || serde_json::from_slice::<Status>(&std::fs::read(&path).unwrap()).unwrap();
        assert_eq!(read(), Status::default());

        board.set("uid-b", vec![row("b", "agent", State::Running)]);
        board.set(
            "uid-a",
            vec![
                row("a", "agent", State::Running),
                row("a", "sidecar", State::Waiting),
            ],
        );
        board.write().unwrap();
        let names: Vec<(String, String)> = read()
            .containers
            .into_iter()
            .map(|c| (c.name, c.container))
            .collect();
        assert_eq!(
            names,
            [
                ("a".into(), "agent".into()),
                ("a".into(), "sidecar".into()),
                ("b".into(), "agent".into())
            ]
        );
        // Unchanged: not rewritten (a file put in its place stays).
        std::fs::write(&path, "{\"containers\":[]}").unwrap();
        board.write().unwrap();
        assert_eq!(read(), Status::default());
        board.remove("uid-a");
        board.remove("uid-b");
        board.write().unwrap();
        assert_eq!(read(), Status::default());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
