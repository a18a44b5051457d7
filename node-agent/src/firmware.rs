//! Firmware: files under the image's `firmwarePath` are copied to the host firmware
//! directory (default `/lib/firmware`) before loading, and removed after unloading.

use std::path::{Path, PathBuf};

/// The default host firmware directory; the kernel searches it without configuration.
pub const DEFAULT_FIRMWARE_DIR: &str = "/lib/firmware";

#[derive(Debug, thiserror::Error)]
#[error("{action} {path}: {source}")]
pub struct FirmwareError {
    action: &'static str,
    path: PathBuf,
    #[source]
    source: std::io::Error,
}

fn err(action: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> FirmwareError {
    let path = path.to_path_buf();
    move |source| FirmwareError {
        action,
        path,
        source,
    }
}

/// Whether the kernel must be told about `host_dir` (it already searches `/lib/firmware`).
pub fn needs_firmware_class_path(host_dir: &Path) -> bool {
    host_dir != Path::new(DEFAULT_FIRMWARE_DIR)
}

/// Copies every regular file below `source` to the same relative place below
/// `host_dir`; returns the files written. Links to files are followed (extraction
/// guarantees they stay inside the image); links to directories are not, so a link
/// loop cannot make the copy endless.
pub fn install(source: &Path, host_dir: &Path) -> Result<Vec<PathBuf>, FirmwareError> {
    let mut written = vec![];
    if !source.is_dir() {
        return Ok(written);
    }
    copy_tree(source, host_dir, &mut written)?;
    written.sort();
    Ok(written)
}

fn copy_tree(from: &Path, to: &Path, written: &mut Vec<PathBuf>) -> Result<(), FirmwareError> {
    std::fs::create_dir_all(to).map_err(err("creating", to))?;
    for entry in std::fs::read_dir(from).map_err(err("reading", from))? {
        let entry = entry.map_err(err("reading", from))?;
        let src = entry.path();
        let dst = to.join(entry.file_name());
        let kind = entry.file_type().map_err(err("inspecting", &src))?;
        let is_file = if kind.is_symlink() {
            std::fs::metadata(&src).is_ok_and(|m| m.is_file())
        } else {
            kind.is_file()
        };
        if kind.is_dir() {
            copy_tree(&src, &dst, written)?;
        } else if is_file {
            let tmp = to.join(format!(".{}.kmm-tmp", entry.file_name().to_string_lossy()));
            std::fs::copy(&src, &tmp).map_err(err("copying to", &tmp))?;
            std::fs::rename(&tmp, &dst).map_err(err("renaming", &tmp))?;
            written.push(dst);
        }
    }
    Ok(())
}

/// Removes files written by [`install`], and the directories left empty below
/// `host_dir`.
pub fn remove(files: &[PathBuf], host_dir: &Path) -> Result<(), FirmwareError> {
    for file in files {
        match std::fs::remove_file(file) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(err("removing", file)(e)),
        }
        let mut dir = file.parent();
        while let Some(d) = dir {
            if d == host_dir || !d.starts_with(host_dir) || std::fs::remove_dir(d).is_err() {
                break;
            }
            dir = d.parent();
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn install_and_remove() {
        let dir = tempfile::tempdir().unwrap();
        let src = dir.path().join("image/firmware");
        std::fs::create_dir_all(src.join("vendor")).unwrap();
        std::fs::write(src.join("a.bin"), b"a").unwrap();
        std::fs::write(src.join("vendor/b.bin"), b"b").unwrap();
        std::os::unix::fs::symlink("..", src.join("vendor/loop")).unwrap();
        std::os::unix::fs::symlink("../a.bin", src.join("vendor/alias.bin")).unwrap();
        let host = dir.path().join("host-fw");
        std::fs::create_dir_all(&host).unwrap();
        std::fs::write(host.join("other.bin"), b"keep").unwrap();
        let files = install(&src, &host).unwrap();
        assert_eq!(
            files,
            [
                host.join("a.bin"),
                host.join("vendor/alias.bin"),
                host.join("vendor/b.bin")
            ]
        );
        assert!(!host.join("vendor/loop").exists());
        assert_eq!(std::fs::read(host.join("vendor/b.bin")).unwrap(), b"b");
        remove(&files, &host).unwrap();
        assert!(!host.join("a.bin").exists());
        assert!(!host.join("vendor").exists());
        assert!(host.join("other.bin").exists());
        assert!(
            install(&dir.path().join("nothing"), &host)
                .unwrap()
                .is_empty()
        );
        assert!(needs_firmware_class_path(&host));
        assert!(!needs_firmware_class_path(Path::new("/lib/firmware")));
    }
}
