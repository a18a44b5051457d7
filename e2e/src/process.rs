//! Background processes of the local fleet: started in their own process group with
//! output to a log file, tracked by PID so a later `cargo xtask env` can find them.
//! A real node's processes are also confined to the node's namespaces and cgroup.

use std::fs::File;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use serde::{Deserialize, Serialize};

use crate::{Error, IoContext, Result, cgroup};

/// util-linux's `nsenter`, which enters a real node's namespaces.
const NSENTER: &str = "/usr/bin/nsenter";
/// How long `nsenter` may take to execute the program it was given.
const EXEC_TIMEOUT: Duration = Duration::from_secs(5);

/// A process started by the fleet, as recorded in the state directory.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Tracked {
    /// `<cluster>/<component>`, e.g. `spoke1/kube-apiserver`.
    pub name: String,
    pub pid: i32,
    pub program: PathBuf,
    pub log: PathBuf,
    /// The command line and environment it was started with, to restart it.
    #[serde(default)]
    pub args: Vec<String>,
    #[serde(default)]
    pub env: Vec<(String, String)>,
    /// Set for a real node's processes (containerd, kubelet, kube-proxy).
    #[serde(default)]
    pub confinement: Option<Confinement>,
}

/// Where a real node's process runs: inside the node's network and mount namespaces
/// (entered with `nsenter`, which then executes the program, so the PID is the
/// program's), and moved into the node's cgroup right after it starts.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Confinement {
    /// The network namespace, as a file (`/run/netns/<name>`).
    pub net: PathBuf,
    /// The node's persistent mount namespace, as a file.
    pub mount: PathBuf,
    /// cgroup path below each hierarchy's root.
    pub cgroup: String,
}

impl Tracked {
    /// Whether the PID is still this program (a recycled PID is not).
    pub fn alive(&self) -> bool {
        let Ok(exe) = std::fs::read_link(format!("/proc/{}/exe", self.pid)) else {
            return false;
        };
        let alive = kill(Pid::from_raw(self.pid), None).is_ok();
        let zombie = std::fs::read_to_string(format!("/proc/{}/stat", self.pid))
            .map(|s| {
                s.rsplit(')')
                    .next()
                    .is_some_and(|rest| rest.trim_start().starts_with('Z'))
            })
            .unwrap_or(true);
        alive && !zombie && same_file(&exe, &self.program)
    }

    /// SIGTERM, then SIGKILL if it has not exited within `grace`.
    pub fn stop(&self, grace: Duration) {
        if !self.alive() {
            return;
        }
        let pid = Pid::from_raw(self.pid);
        // The process leads its own group, so this also reaches anything it forked.
        let group = Pid::from_raw(-self.pid);
        let _ = kill(group, Signal::SIGTERM);
        let deadline = Instant::now() + grace;
        while self.alive() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(50));
        }
        if self.alive() {
            let _ = kill(group, Signal::SIGKILL);
            let _ = kill(pid, Signal::SIGKILL);
        }
    }

    /// Current and peak resident memory in KiB (`VmRSS`, `VmHWM`).
    pub fn memory_kib(&self) -> Option<(u64, u64)> {
        memory_kib(self.pid)
    }

    /// The last lines of the log, to explain a failure.
    pub fn log_tail(&self, lines: usize) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let all: Vec<&str> = text.lines().collect();
        all[all.len().saturating_sub(lines)..].join("\n")
    }
}

/// Current and peak resident memory of any process in KiB (`VmRSS`, `VmHWM`).
pub fn memory_kib(pid: i32) -> Option<(u64, u64)> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
    };
    Some((field("VmRSS:")?, field("VmHWM:")?))
}

fn same_file(a: &Path, b: &Path) -> bool {
    match (a.canonicalize(), b.canonicalize()) {
        (Ok(a), Ok(b)) => a == b,
        _ => false,
    }
}

/// Start `program args...` detached from the caller (its own process group, stdin
/// closed, stdout+stderr appended to `log`), so it outlives `cargo xtask env up`;
/// inside a real node's namespaces and cgroup when `confinement` is given. A confined
/// process is returned once its PID runs `program` (no longer `nsenter`), so that
/// [`Tracked::alive`] holds from the start.
pub fn spawn(
    name: &str,
    program: &Path,
    args: &[String],
    env: &[(&str, String)],
    log: &Path,
    confinement: Option<&Confinement>,
) -> Result<Tracked> {
    let out = File::options()
        .create(true)
        .append(true)
        .open(log)
        .context(|| format!("opening {}", log.display()))?;
    let err = out
        .try_clone()
        .context(|| format!("opening {}", log.display()))?;
    let mut cmd = match confinement {
        Some(c) => {
            let mut cmd = Command::new(NSENTER);
            cmd.arg(format!("--net={}", c.net.display()))
                .arg(format!("--mount={}", c.mount.display()))
                .arg("--")
                .arg(program);
            cmd
        }
        None => Command::new(program),
    };
    cmd.args(args)
        .stdin(Stdio::null())
        .stdout(out)
        .stderr(err)
        .process_group(0);
    for (k, v) in env {
        cmd.env(k, v);
    }
    let child = cmd.spawn().map_err(|e| Error::Component {
        component: name.to_string(),
        reason: format!("cannot execute {}: {e}", program.display()),
        log: log.to_path_buf(),
    })?;
    let program = program
        .canonicalize()
        .unwrap_or_else(|_| program.to_path_buf());
    let tracked = Tracked {
        name: name.to_string(),
        pid: i32::try_from(child.id()).map_err(|e| Error::Invalid(format!("pid: {e}")))?,
        program,
        log: log.to_path_buf(),
        args: args.to_vec(),
        env: env
            .iter()
            .map(|(k, v)| ((*k).to_owned(), v.clone()))
            .collect(),
        confinement: confinement.cloned(),
    };
    if let Some(c) = confinement {
        // Before the program can start anything: what it forks inherits the cgroup.
        if let Err(e) = cgroup::attach(&c.cgroup, tracked.pid) {
            let _ = kill(Pid::from_raw(tracked.pid), Signal::SIGKILL);
            return Err(e);
        }
        let deadline = Instant::now() + EXEC_TIMEOUT;
        while !tracked.alive() {
            if Instant::now() >= deadline || !pid_exists(tracked.pid) {
                return Err(Error::Component {
                    component: name.to_string(),
                    reason: format!(
                        "{NSENTER} did not start {} within {}s:\n{}",
                        tracked.program.display(),
                        EXEC_TIMEOUT.as_secs(),
                        tracked.log_tail(10)
                    ),
                    log: tracked.log.clone(),
                });
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }
    Ok(tracked)
}

/// Whether any process, even a zombie, has this PID.
fn pid_exists(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| {
        !s.rsplit(')')
            .next()
            .is_some_and(|r| r.trim_start().starts_with('Z'))
    })
}

/// Run `cmd` to completion; its output when it succeeded, an error carrying its standard
/// error if not.
pub(crate) fn output(cmd: &mut Command) -> Result<Output> {
    let describe = format!("{cmd:?}");
    let out = cmd.output().context(|| format!("running {describe}"))?;
    if !out.status.success() {
        return Err(Error::Command {
            command: describe,
            status: format!(
                "{}: {}",
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            ),
        });
    }
    Ok(out)
}

/// Run `cmd` to completion; its standard output, or an error carrying its standard error.
pub(crate) fn run(cmd: &mut Command) -> Result<String> {
    output(cmd).map(|out| String::from_utf8_lossy(&out.stdout).into_owned())
}
