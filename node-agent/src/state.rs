//! The agent's state under `/run/kmm` (configurable): what it loaded, for which boot.
//! It survives agent restarts (the directory is on the host) but not reboots (`/run`
//! is emptied, and a changed boot ID discards it anyway). It never holds secrets.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::desired::Modprobe;

const FILE: &str = "state.json";

/// Everything the agent loaded during one boot.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct State {
    pub boot_id: String,
    #[serde(default)]
    pub modules: BTreeMap<String, ModuleRecord>,
}

/// One loaded entry, with what is needed to unload it after a restart.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ModuleRecord {
    pub key: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub version: Option<String>,
    /// The image as asked for, and the digest it resolved to when first loaded.
    pub image: String,
    pub digest: String,
    pub kernel: String,
    /// The `modprobe -d` directory (inside the image cache).
    pub module_dir: PathBuf,
    pub modprobe: Modprobe,
    #[serde(default)]
    pub in_tree_modules_to_remove: Vec<String>,
    /// Modules loaded, in load order.
    pub loaded: Vec<String>,
    /// Firmware files copied to the host, removed after unload.
    #[serde(default)]
    pub firmware_files: Vec<PathBuf>,
    pub loaded_at_unix_ms: u64,
}

#[derive(Debug, thiserror::Error)]
pub enum StateError {
    #[error("{action} {path}: {source}")]
    Io {
        action: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path} is not valid agent state: {source}")]
    Invalid {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
}

/// Reads and writes the state file atomically.
#[derive(Clone, Debug)]
pub struct StateStore {
    dir: PathBuf,
}

impl StateStore {
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        Self { dir: dir.into() }
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    fn path(&self) -> PathBuf {
        self.dir.join(FILE)
    }

    /// The saved state, if any.
    pub fn load(&self) -> Result<Option<State>, StateError> {
        let path = self.path();
        match std::fs::read(&path) {
            Ok(bytes) => serde_json::from_slice(&bytes)
                .map(Some)
                .map_err(|source| StateError::Invalid { path, source }),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(source) => Err(StateError::Io {
                action: "reading",
                path,
                source,
            }),
        }
    }

    /// Writes the state (temporary file, fsync, rename), so that a crash or SIGTERM
    /// at any point leaves either the old or the new state.
    pub fn save(&self, state: &State) -> Result<(), StateError> {
        let io = |action, path: &Path| {
            let path = path.to_path_buf();
            move |source| StateError::Io {
                action,
                path,
                source,
            }
        };
        std::fs::create_dir_all(&self.dir).map_err(io("creating", &self.dir))?;
        let tmp = self.dir.join(format!(".{FILE}.tmp"));
        let bytes = serde_json::to_vec_pretty(state).expect("state serialises");
        let mut file = std::fs::File::create(&tmp).map_err(io("creating", &tmp))?;
        file.write_all(&bytes).map_err(io("writing", &tmp))?;
        file.sync_all().map_err(io("syncing", &tmp))?;
        std::fs::rename(&tmp, self.path()).map_err(io("renaming", &tmp))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_missing() {
        let dir = tempfile::tempdir().unwrap();
        let store = StateStore::new(dir.path().join("kmm"));
        assert_eq!(store.load().unwrap(), None);
        let mut state = State {
            boot_id: "b".into(),
            ..Default::default()
        };
        state.modules.insert(
            "ns/m".into(),
            ModuleRecord {
                key: "ns/m".into(),
                version: Some("1".into()),
                image: "r/i:t".into(),
                digest: "sha256:00".into(),
                kernel: "k".into(),
                module_dir: "/c/opt".into(),
                modprobe: Modprobe::default(),
                in_tree_modules_to_remove: vec![],
                loaded: vec!["m".into()],
                firmware_files: vec![],
                loaded_at_unix_ms: 1,
            },
        );
        store.save(&state).unwrap();
        assert_eq!(store.load().unwrap(), Some(state));
        std::fs::write(dir.path().join("kmm/state.json"), b"{").unwrap();
        assert!(matches!(store.load(), Err(StateError::Invalid { .. })));
    }
}
