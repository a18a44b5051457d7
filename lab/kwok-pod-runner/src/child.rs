//! Starting a container's process inside the real node's network namespace, tied to the
//! runner's life.
//!
//! The workspace forbids `unsafe` code, which rules out a `pre_exec` hook; instead the
//! runner starts its own executable (`/proc/self/exe`, which stays valid even if the
//! binary is rebuilt meanwhile) with [`TRAMPOLINE`] as first argument. That child sets
//! its parent-death signal to SIGKILL, checks the runner is still its parent, enters
//! the network namespace with `setns` and then executes the program in place, so the
//! PID the runner holds is the program's from then on and the program dies with the
//! runner however the runner ends. What the program itself forks is killed with its
//! process group when the program exits, its pod stops or its node loses power, but
//! not when the runner is SIGKILLed (only the program gets the parent-death signal).

use std::ffi::{OsStr, OsString};
use std::fs::File;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::Stdio;

use nix::sched::{CloneFlags, setns};
use nix::sys::prctl::set_pdeathsig;
use nix::sys::signal::Signal;
use nix::unistd::getppid;

use super::container::ProcessSpec;
use crate::{Error, IoContext, Result};

/// The first argument by which the runner's executable knows it is to execute a
/// container's program rather than run.
const TRAMPOLINE: &str = "--kwok-pod-runner-exec";

/// The trampoline's command line (after the executable): the network namespace, the
/// runner's PID, the program and its arguments.
fn trampoline_args(netns: &Path, parent: u32, program: &Path, args: &[String]) -> Vec<OsString> {
    let mut all: Vec<OsString> = vec![
        TRAMPOLINE.into(),
        netns.into(),
        parent.to_string().into(),
        program.into(),
    ];
    all.extend(args.iter().map(OsString::from));
    all
}

/// What the trampoline is to do, read back from its command line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Exec {
    netns: PathBuf,
    parent: u32,
    program: OsString,
    args: Vec<OsString>,
}

impl Exec {
    /// `Some` when the process was started as a trampoline (`args` as from
    /// [`std::env::args_os`], executable first).
    pub fn from_args(args: impl IntoIterator<Item = OsString>) -> Option<Self> {
        let mut args = args.into_iter().skip(1);
        if args.next()? != OsStr::new(TRAMPOLINE) {
            return None;
        }
        let netns = PathBuf::from(args.next()?);
        let parent = args.next()?.to_str()?.parse().ok()?;
        let program = args.next()?;
        Some(Self {
            netns,
            parent,
            program,
            args: args.collect(),
        })
    }

    /// Becomes the program; returns only why it could not.
    pub fn run(self) -> Error {
        if let Err(e) = set_pdeathsig(Signal::SIGKILL) {
            return Error::Invalid(format!("setting the parent-death signal: {e}"));
        }
        // Had the runner died before the line above, nothing would ever kill this
        // process: it now has another parent.
        if u32::try_from(getppid().as_raw()).ok() != Some(self.parent) {
            return Error::Invalid("the runner exited before its child started".into());
        }
        let netns = match File::open(&self.netns) {
            Ok(file) => file,
            Err(source) => {
                return Error::Io {
                    context: format!("opening {}", self.netns.display()),
                    source,
                };
            }
        };
        if let Err(e) = setns(&netns, CloneFlags::CLONE_NEWNET) {
            return Error::Invalid(format!("entering {}: {e}", self.netns.display()));
        }
        let source = std::process::Command::new(&self.program)
            .args(&self.args)
            .exec();
        Error::Io {
            context: format!("executing {}", self.program.to_string_lossy()),
            source,
        }
    }
}

/// Starts `spec` in `netns` with only its own environment, in `working_dir` unless it
/// names one, its stdin closed and stdout+stderr appended to `log`, leading its own
/// process group (so that a power loss or a late SIGKILL reaches what it forks).
///
/// The parent-death signal fires when the *thread* that forked the child ends, so this
/// must be called from a thread that lives as long as the runner: a runtime worker
/// (an async task), never a `spawn_blocking` thread.
pub(super) fn spawn(
    spec: &ProcessSpec,
    netns: &Path,
    working_dir: &Path,
    log: &Path,
) -> Result<tokio::process::Child> {
    let out = File::options()
        .create(true)
        .append(true)
        .open(log)
        .context(|| format!("opening {}", log.display()))?;
    let err = out
        .try_clone()
        .context(|| format!("opening {}", log.display()))?;
    tokio::process::Command::new("/proc/self/exe")
        .args(trampoline_args(
            netns,
            std::process::id(),
            &spec.program,
            &spec.args,
        ))
        .env_clear()
        .envs(spec.env.iter().map(|(k, v)| (k, v)))
        .current_dir(spec.working_dir.as_deref().unwrap_or(working_dir))
        .stdin(Stdio::null())
        .stdout(out)
        .stderr(err)
        .process_group(0)
        .spawn()
        .context(|| format!("starting {}", spec.program.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_trampoline_reads_back_what_the_runner_wrote() {
        let args = ["run".to_owned(), "--x=a b".to_owned(), String::new()];
        let mut argv = vec![OsString::from("/proc/self/exe")];
        argv.extend(trampoline_args(
            Path::new("/run/netns/kmmf-spoke1-real1"),
            4242,
            Path::new("/ws/kmm-node-agent"),
            &args,
        ));
        assert_eq!(
            Exec::from_args(argv),
            Some(Exec {
                netns: "/run/netns/kmmf-spoke1-real1".into(),
                parent: 4242,
                program: "/ws/kmm-node-agent".into(),
                args: args.iter().map(OsString::from).collect(),
            })
        );
    }

    #[test]
    fn anything_else_is_the_runner() {
        let argv = |args: &[&str]| args.iter().map(OsString::from).collect::<Vec<_>>();
        assert_eq!(
            Exec::from_args(argv(&["runner", "--kubeconfig", "k"])),
            None
        );
        assert_eq!(Exec::from_args(argv(&["runner"])), None);
        assert_eq!(Exec::from_args(argv(&[])), None);
        assert_eq!(
            Exec::from_args(argv(&["r", TRAMPOLINE, "/ns", "x", "/p"])),
            None
        );
        assert_eq!(Exec::from_args(argv(&["r", TRAMPOLINE, "/ns", "1"])), None);
        assert!(Exec::from_args(argv(&["r", TRAMPOLINE, "/ns", "1", "/p"])).is_some());
    }
}
