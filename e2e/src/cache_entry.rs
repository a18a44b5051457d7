//! An entry of the fleet's cache (`<cache>/...`) made once: the tests of one binary run
//! side by side, and two of them needing the same entry on a fresh machine made it twice
//! at once in one place (two Go builds of Prometheus; two downloads of the guest kernel
//! into one directory, where one found the other's half-written files).

use std::path::{Path, PathBuf};

use crate::{IoContext, Result};

/// Unless `ready()` says the entry at `dir` is there, `make()` it, one maker at a time
/// across threads and processes (a lock file beside `dir`); whether this call made it.
pub(crate) fn once(
    dir: &Path,
    ready: impl Fn() -> bool,
    make: impl FnOnce() -> Result<()>,
) -> Result<bool> {
    if ready() {
        return Ok(false);
    }
    let lock_path = beside(dir, "lock");
    if let Some(parent) = lock_path.parent() {
        std::fs::create_dir_all(parent).context(|| format!("creating {}", parent.display()))?;
    }
    let lock = std::fs::File::create(&lock_path)
        .context(|| format!("creating {}", lock_path.display()))?;
    lock.lock()
        .context(|| format!("locking {}", lock_path.display()))?;
    // Another maker may have finished while this one waited.
    if ready() {
        return Ok(false);
    }
    make()?;
    Ok(true)
}

/// `<dir>.<suffix>`, with `dir`'s name whole: a version's dots (`6.1.0-56-cloud-amd64`,
/// `v0.316.0`) are not an extension to replace.
pub(crate) fn beside(dir: &Path, suffix: &str) -> PathBuf {
    let mut path = dir.as_os_str().to_owned();
    path.push(".");
    path.push(suffix);
    PathBuf::from(path)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc::{Receiver, Sender, channel};
    use std::time::Duration;

    #[test]
    fn two_callers_wanting_one_entry_make_it_once() {
        let dir = std::env::temp_dir().join(format!("kmm-cache-entry-{}", std::process::id()));
        let marker = dir.join("made");
        let caller = |started: Sender<()>, other: Receiver<()>| {
            let (dir, marker) = (dir.clone(), marker.clone());
            move || {
                once(
                    &dir,
                    || marker.is_file(),
                    || {
                        started.send(()).expect("the other caller listens");
                        // Made side by side, the other caller starts too: it gets the
                        // time a make takes to do so, and must not.
                        let _ = other.recv_timeout(Duration::from_secs(2));
                        std::fs::create_dir_all(&dir).expect("dir");
                        std::fs::write(&marker, b"").expect("marker");
                        Ok(())
                    },
                )
                .expect("once")
            }
        };
        let (a_started, a_heard) = channel();
        let (b_started, b_heard) = channel();
        let a = std::thread::spawn(caller(a_started, b_heard));
        let b = std::thread::spawn(caller(b_started, a_heard));
        let made = [a.join().expect("a"), b.join().expect("b")];
        let _ = std::fs::remove_dir_all(&dir);
        let _ = std::fs::remove_file(beside(&dir, "lock"));
        assert_eq!(made.iter().filter(|m| **m).count(), 1, "{made:?}");
    }

    #[test]
    fn beside_keeps_a_versions_dots() {
        assert_eq!(
            beside(Path::new("/c/guest/kernel/6.1.0-56-cloud-amd64"), "partial"),
            Path::new("/c/guest/kernel/6.1.0-56-cloud-amd64.partial")
        );
        assert_eq!(
            beside(Path::new("/c/bin/prometheus-v0.316.0"), "lock"),
            Path::new("/c/bin/prometheus-v0.316.0.lock")
        );
    }
}
