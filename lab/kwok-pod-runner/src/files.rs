//! Files a process may read at any moment (tokens, ConfigMap keys, `status.json`) are
//! replaced atomically: written beside their final name, then renamed over it.

use std::collections::BTreeMap;
use std::path::Path;

use crate::{IoContext, Result};

/// Replaces `path` with `contents` in one step, creating its directory.
pub(super) fn write_atomic(path: &Path, contents: &[u8]) -> Result<()> {
    let dir = path.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir).context(|| format!("creating {}", dir.display()))?;
    let mut partial = path.as_os_str().to_owned();
    partial.push(".partial");
    std::fs::write(&partial, contents).context(|| format!("writing {}", path.display()))?;
    std::fs::rename(&partial, path).context(|| format!("writing {}", path.display()))
}

/// Brings the files below `dir` from `previous` (what the runner wrote last) to
/// `files`: changed and new files are replaced atomically, files no longer wanted
/// removed. Paths are relative to `dir`.
pub(super) fn sync_dir(
    dir: &Path,
    previous: &BTreeMap<String, Vec<u8>>,
    files: &BTreeMap<String, Vec<u8>>,
) -> Result<()> {
    for (path, contents) in files {
        if previous.get(path) != Some(contents) {
            write_atomic(&dir.join(path), contents)?;
        }
    }
    for path in previous.keys().filter(|p| !files.contains_key(*p)) {
        let file = dir.join(path);
        match std::fs::remove_file(&file) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                return Err(e).context(|| format!("removing {}", file.display()));
            }
            _ => {}
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn files(pairs: &[(&str, &str)]) -> BTreeMap<String, Vec<u8>> {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), v.as_bytes().to_vec()))
            .collect()
    }

    fn read(dir: &Path) -> BTreeMap<String, String> {
        fn walk(root: &Path, dir: &Path, out: &mut BTreeMap<String, String>) {
            for entry in std::fs::read_dir(dir).unwrap().flatten() {
                let path = entry.path();
                if path.is_dir() {
                    walk(root, &path, out);
                } else {
                    let name = path
                        .strip_prefix(root)
                        .unwrap()
                        .to_string_lossy()
                        .into_owned();
                    out.insert(name, std::fs::read_to_string(&path).unwrap());
                }
            }
        }
        let mut out = BTreeMap::new();
        walk(dir, dir, &mut out);
        out
    }

    #[test]
    fn a_directory_follows_its_files() {
        let dir =
            std::env::temp_dir().join(format!("kwok-pod-runner-files-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let first = files(&[("token", "t1"), ("ca/ca.crt", "PEM")]);
        sync_dir(&dir, &BTreeMap::new(), &first).unwrap();
        let second = files(&[("token", "t2"), ("namespace", "kmm")]);
        sync_dir(&dir, &first, &second).unwrap();
        let on_disk = read(&dir);
        let expected: BTreeMap<String, String> = [("token", "t2"), ("namespace", "kmm")]
            .into_iter()
            .map(|(k, v)| (k.to_owned(), v.to_owned()))
            .collect();
        assert_eq!(on_disk, expected, "no partial files, stale files gone");
        // Removing what is already gone is fine.
        std::fs::remove_file(dir.join("namespace")).unwrap();
        sync_dir(&dir, &second, &BTreeMap::new()).unwrap();
        assert!(read(&dir).is_empty());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
