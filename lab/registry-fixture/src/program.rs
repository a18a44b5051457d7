//! Debian's `docker-registry` program, and how the local fleet's shared registry is
//! configured.

use std::path::{Path, PathBuf};

use serde_json::json;

use crate::{Error, IoContext, Result};

/// The registry program from Debian's `docker-registry` package.
pub fn registry_binary() -> Result<PathBuf> {
    let path = PathBuf::from("/usr/bin/docker-registry");
    if path.is_file() {
        Ok(path)
    } else {
        Err(Error::Invalid(
            "/usr/bin/docker-registry is missing: run `cargo xtask env setup` (apt package docker-registry)".into(),
        ))
    }
}

/// Write the registry's configuration: plain HTTP on loopback, storage under `dir`.
pub fn registry_config(dir: &Path, port: u16) -> Result<PathBuf> {
    let storage = dir.join("storage");
    std::fs::create_dir_all(&storage).context(|| format!("creating {}", storage.display()))?;
    let config = json!({
        "version": 0.1,
        "log": { "level": "info" },
        "storage": { "filesystem": { "rootdirectory": storage }, "delete": { "enabled": true } },
        "http": { "addr": format!("127.0.0.1:{port}") },
    });
    let path = dir.join("config.yml");
    let text = serde_yaml_ng::to_string(&config).map_err(|e| Error::Invalid(e.to_string()))?;
    std::fs::write(&path, text).context(|| format!("writing {}", path.display()))?;
    Ok(path)
}
