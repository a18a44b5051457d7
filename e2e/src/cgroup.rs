//! The cgroups of the fleet's real nodes. Each node gets one cgroup, the same path in
//! every mounted hierarchy (cgroup v1 controllers, named hierarchies and the unified
//! one): its kubelet's `cgroupRoot`, and the parent of its daemons' cgroup. Everything a
//! node starts (containerd's shims, containers, their children) stays inside it, so
//! `down` can find and stop all of it without knowing any of their PIDs beforehand.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

use crate::{Error, IoContext, Result};

/// Where this machine mounts its cgroup hierarchies.
const CGROUP_FS: &str = "/sys/fs/cgroup";

/// Every mounted cgroup hierarchy under `/sys/fs/cgroup` (just the root itself on a
/// pure cgroup v2 machine).
pub fn hierarchies() -> Result<Vec<PathBuf>> {
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo")
        .context(|| "reading /proc/self/mountinfo".into())?;
    Ok(mountinfo
        .lines()
        .filter_map(|line| {
            // `... mount-point ... - fstype source options`
            let (before, after) = line.split_once(" - ")?;
            let fstype = after.split_whitespace().next()?;
            let mount_point = before.split_whitespace().nth(4)?;
            (matches!(fstype, "cgroup" | "cgroup2") && mount_point.starts_with(CGROUP_FS))
                .then(|| PathBuf::from(mount_point))
        })
        .collect())
}

/// Create `path` (relative, e.g. `kmmf16000-hub-real1/node`) in every hierarchy. A new
/// cpuset cgroup starts with no CPUs and no memory nodes, so every level created there
/// gets its parent's.
pub fn create(path: &str) -> Result<()> {
    for hierarchy in hierarchies()? {
        let mut dir = hierarchy.clone();
        for part in path.split('/').filter(|p| !p.is_empty()) {
            let parent = dir.clone();
            dir.push(part);
            if dir.is_dir() {
                continue;
            }
            std::fs::create_dir(&dir).context(|| format!("creating cgroup {}", dir.display()))?;
            for file in ["cpuset.cpus", "cpuset.mems"] {
                let from = parent.join(file);
                if from.is_file() && !hierarchy.join("cgroup.controllers").exists() {
                    let value = std::fs::read_to_string(&from)
                        .context(|| format!("reading {}", from.display()))?;
                    let to = dir.join(file);
                    std::fs::write(&to, value.trim())
                        .context(|| format!("writing {}", to.display()))?;
                }
            }
        }
    }
    Ok(())
}

/// Move process `pid` into `path` in every hierarchy.
pub fn attach(path: &str, pid: i32) -> Result<()> {
    for hierarchy in hierarchies()? {
        let procs = hierarchy.join(path).join("cgroup.procs");
        std::fs::write(&procs, pid.to_string())
            .context(|| format!("moving {pid} into {}", procs.display()))?;
    }
    Ok(())
}

/// Names of the top-level cgroups starting with `prefix` (in any hierarchy).
pub fn roots_with_prefix(prefix: &str) -> Result<Vec<String>> {
    let mut names = vec![];
    for hierarchy in hierarchies()? {
        let Ok(entries) = std::fs::read_dir(&hierarchy) else {
            continue;
        };
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            if name.starts_with(prefix) && entry.path().is_dir() && !names.contains(&name) {
                names.push(name);
            }
        }
    }
    Ok(names)
}

/// Every process in `path` and below, in any hierarchy.
pub fn processes(path: &str) -> Result<Vec<i32>> {
    let mut pids: Vec<i32> = hierarchies()?
        .iter()
        .flat_map(|h| processes_below(&h.join(path)))
        .collect();
    pids.sort_unstable();
    pids.dedup();
    Ok(pids)
}

/// SIGKILL every process in `path` and below, in every hierarchy, until none is left,
/// then remove the cgroups, deepest first. Fails naming what is left after `grace`.
pub fn remove(path: &str, grace: Duration) -> Result<()> {
    let deadline = Instant::now() + grace;
    loop {
        let pids = processes(path)?;
        if pids.is_empty() {
            break;
        }
        if Instant::now() >= deadline {
            return Err(Error::Invalid(format!(
                "processes {pids:?} of cgroup {path} survived SIGKILL for {}s",
                grace.as_secs()
            )));
        }
        for pid in pids {
            let _ = kill(Pid::from_raw(pid), Signal::SIGKILL);
        }
        // A killed process leaves its cgroup once it has exited; this is a bounded
        // poll for that, not a guess at how long it takes.
        std::thread::sleep(Duration::from_millis(20));
    }
    for hierarchy in hierarchies()? {
        let top = hierarchy.join(path);
        if top.is_dir() {
            remove_tree(&top)?;
        }
    }
    Ok(())
}

fn processes_below(dir: &Path) -> Vec<i32> {
    let mut pids: Vec<i32> = std::fs::read_to_string(dir.join("cgroup.procs"))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.trim().parse().ok())
        .collect();
    if let Ok(entries) = std::fs::read_dir(dir) {
        for entry in entries.flatten() {
            if entry.path().is_dir() {
                pids.extend(processes_below(&entry.path()));
            }
        }
    }
    pids
}

/// A cgroup directory holds only kernel files, so it goes with `rmdir` once its
/// children have gone (`remove_dir_all` would try to unlink those files and fail).
fn remove_tree(dir: &Path) -> Result<()> {
    for entry in std::fs::read_dir(dir).context(|| format!("reading {}", dir.display()))? {
        let path = entry
            .context(|| format!("reading {}", dir.display()))?
            .path();
        if path.is_dir() {
            remove_tree(&path)?;
        }
    }
    std::fs::remove_dir(dir).context(|| format!("removing cgroup {}", dir.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn this_machine_has_cgroup_hierarchies() {
        let found = hierarchies().unwrap();
        assert!(!found.is_empty(), "no cgroup mounts under {CGROUP_FS}");
        assert!(found.iter().all(|h| h.starts_with(CGROUP_FS)));
    }
}
