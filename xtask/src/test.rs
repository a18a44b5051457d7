//! The one command that runs every check and test, in the order CI relies on.

use std::{
    io::{BufRead, BufReader},
    path::Path,
    process::Command,
    time::Instant,
};

use anyhow::{Context, bail};

use crate::cargo;
use crate::timings::{SuiteClock, Timing, Timings};

/// Fuzz targets run for a bounded time by `cargo xtask test`.
const FUZZ_TARGETS: &[&str] = &[
    "kernel_template",
    "extract_layers",
    "hub_messages",
    "proxy_agent_messages",
];

#[derive(Debug, clap::Args)]
pub struct Options {
    /// Seconds each fuzz target runs for.
    #[arg(long, default_value_t = 60)]
    fuzz_seconds: u32,
}

pub fn run(root: &Path, options: &Options) -> anyhow::Result<()> {
    let mut timings = Timings::default();
    let outcome = pipeline(root, options, &mut timings);
    // Also after a failure: the steps that ran, and where the time went.
    println!("{}", timings.report());
    outcome
}

fn pipeline(root: &Path, options: &Options, timings: &mut Timings) -> anyhow::Result<()> {
    timings.step("fmt", || cargo(root, &["fmt", "--all", "--", "--check"]))?;
    timings.step("clippy", || {
        cargo(
            root,
            &[
                "clippy",
                "--workspace",
                "--all-targets",
                "--",
                "-D",
                "warnings",
            ],
        )
    })?;
    timings.step("crd drift", || crate::crdgen::run(root, true))?;
    timings.step("fuzz build", || fuzz_build(root))?;
    for targets in FUZZ_TARGETS.chunks(FUZZ_AT_ONCE) {
        timings.step(&format!("fuzz {}", targets.join(" + ")), || {
            fuzz_together(root, targets, options.fuzz_seconds)
        })?;
    }
    timings.step("fleet prerequisites", || {
        eprintln!("==> local fleet prerequisites (Debian packages, upstream builds; cached)");
        crate::env::prepare()
    })?;
    timings.step("kmm debug binaries", crate::env::build_kmm)?;
    let (suites, tested) = timings.step("cargo test --workspace", || tests(root));
    timings.add_suites(suites);
    tested?;
    timings.step("chaos", || chaos(root))
}

/// The chaos soak's short run (issue #27), on the fleet the tests ran on. The seed is
/// fixed so that a failure names a sequence of faults and changes to replay.
const CHAOS_SEED: &str = "27";
const CHAOS_MINUTES: &str = "3";

/// In the dev profile: the soak measures the fleet, not itself, and the tests' build is
/// reused instead of a release build of the whole test lab.
fn chaos(root: &Path) -> anyhow::Result<()> {
    cargo(
        root,
        &[
            "bench",
            "--profile",
            "dev",
            "-p",
            "kmm-e2e",
            "--bench",
            "chaos",
            "--",
            "--minutes",
            CHAOS_MINUTES,
            "--seed",
            CHAOS_SEED,
        ],
    )
}

/// Runs the workspace's tests and closes the output with one summary line over all of
/// them: cargo prints a summary per test binary, the last of which is often an empty one.
/// cargo's stderr shares the pipe with its stdout, so that the line announcing each test
/// binary comes in order with the binary's output: that times each suite.
fn tests(root: &Path) -> (Vec<Timing>, anyhow::Result<()>) {
    let started = Instant::now();
    let mut clock = SuiteClock::new(started);
    let outcome = run_tests(root, &mut clock);
    (clock.finish(Instant::now()), outcome)
}

fn run_tests(root: &Path, clock: &mut SuiteClock) -> anyhow::Result<()> {
    let args = ["test", "--workspace"];
    eprintln!("==> cargo {}", args.join(" "));
    let (output, input) = std::io::pipe().context("a pipe for cargo test's output")?;
    // The command holds the pipe's write ends until it is dropped, right after the spawn,
    // so that the reading below ends when cargo does.
    let mut child = {
        let mut command = Command::new(env!("CARGO"));
        command
            .args(args)
            .current_dir(root)
            .stdout(input.try_clone().context("cloning the pipe")?)
            .stderr(input);
        command.spawn().context("running cargo test")?
    };
    let (mut passed, mut failed) = (0u64, 0u64);
    for line in BufReader::new(output).lines() {
        let line = line.context("reading cargo test output")?;
        println!("{line}");
        clock.line(Instant::now(), &line);
        if let Some((p, f)) = parse_summary(&line) {
            passed += p;
            failed += f;
        }
    }
    let status = child.wait().context("waiting for cargo test")?;
    println!("tests: {passed} passed, {failed} failed");
    if !status.success() {
        bail!("cargo test failed ({status})");
    }
    Ok(())
}

/// Reads `test result: ok. 12 passed; 0 failed; ...`.
fn parse_summary(line: &str) -> Option<(u64, u64)> {
    let rest = line.strip_prefix("test result: ")?;
    let count = |word: &str| {
        rest.split(';').find_map(|part| {
            part.trim()
                .strip_suffix(word)?
                .trim()
                .rsplit(' ')
                .next()?
                .parse()
                .ok()
        })
    };
    Some((count(" passed")?, count(" failed")?))
}

/// A libFuzzer run is one process on one core: this many share the machine's cores.
const FUZZ_AT_ONCE: usize = 2;

/// How much of a fuzz run's output is printed: libFuzzer's closing lines (the run's
/// figures, or the crash and its input's path).
const FUZZ_TAIL_LINES: usize = 40;

/// Codegen units of the fuzz build. cargo-fuzz's default, 1, compiled each crate on one
/// core: the build of kmm-hub, kmm-spoke-proxy and their dependencies took 28 minutes of
/// a cold CI run. 16 is what cargo-fuzz suggests for faster builds, at the cost of
/// somewhat slower runs.
const FUZZ_CODEGEN_UNITS: &str = "16";

/// `cargo fuzz <command> [target]` with the build options every call shares (a run with
/// other ones would build everything again), with the stable toolchain: RUSTC_BOOTSTRAP
/// spares downloading a nightly one.
fn cargo_fuzz(root: &Path, command: &str, target: Option<&str>) -> Command {
    let mut cargo = Command::new(env!("CARGO"));
    cargo
        .args(["fuzz", command, "--codegen-units", FUZZ_CODEGEN_UNITS])
        .args(target)
        .env("RUSTC_BOOTSTRAP", "1")
        .current_dir(root);
    cargo
}

const CARGO_FUZZ_MISSING: &str =
    "running cargo fuzz (install it with `cargo install cargo-fuzz --locked`)";

/// Builds every fuzz target at once: the runs after it find them built.
fn fuzz_build(root: &Path) -> anyhow::Result<()> {
    eprintln!("==> cargo fuzz build");
    let status = cargo_fuzz(root, "build", None)
        .status()
        .context(CARGO_FUZZ_MISSING)?;
    if !status.success() {
        bail!("cargo fuzz build failed ({status})");
    }
    Ok(())
}

/// Runs these libFuzzer targets side by side, each for `seconds`, its output in
/// `fuzz/target/<target>.log`; prints each one's closing lines, and fails naming every
/// target that failed.
fn fuzz_together(root: &Path, targets: &[&str], seconds: u32) -> anyhow::Result<()> {
    let max_time = format!("-max_total_time={seconds}");
    let logs = root.join("fuzz/target");
    std::fs::create_dir_all(&logs).with_context(|| format!("creating {}", logs.display()))?;
    let mut running = Vec::new();
    for target in targets {
        eprintln!("==> cargo fuzz run {target} -- {max_time}");
        let log_path = logs.join(format!("{target}.log"));
        let log = std::fs::File::create(&log_path)
            .with_context(|| format!("creating {}", log_path.display()))?;
        let child = cargo_fuzz(root, "run", Some(target))
            .args(["--", max_time.as_str()])
            .stdout(log.try_clone().context("sharing the fuzz log")?)
            .stderr(log)
            .spawn()
            .context(CARGO_FUZZ_MISSING)?;
        running.push((*target, log_path, child));
    }
    let mut failed = Vec::new();
    for (target, log_path, mut child) in running {
        let status = child
            .wait()
            .with_context(|| format!("waiting for fuzz target {target}"))?;
        let log = std::fs::read_to_string(&log_path).unwrap_or_default();
        println!(
            "--- fuzz {target} ({status}), the end of {}:",
            log_path.display()
        );
        println!("{}", tail(&log, FUZZ_TAIL_LINES));
        if !status.success() {
            failed.push(target);
        }
    }
    if !failed.is_empty() {
        bail!(
            "fuzz target(s) {} failed; each crash input is under fuzz/artifacts/<target>/",
            failed.join(", ")
        );
    }
    Ok(())
}

/// The last `lines` lines of `text`.
fn tail(text: &str, lines: usize) -> String {
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

#[cfg(test)]
mod tests {
    use super::{parse_summary, tail};

    #[test]
    fn keeps_the_last_lines_of_a_fuzz_log() {
        assert_eq!(tail("a\nb\nc\n", 2), "b\nc");
        assert_eq!(tail("a\nb", 5), "a\nb");
        assert_eq!(tail("", 3), "");
    }

    #[test]
    fn reads_cargo_test_summaries() {
        assert_eq!(
            parse_summary(
                "test result: ok. 26 passed; 0 failed; 0 ignored; 0 measured; 0 filtered out; finished in 0.2s"
            ),
            Some((26, 0))
        );
        assert_eq!(
            parse_summary("test result: FAILED. 5 passed; 1 failed; 0 ignored"),
            Some((5, 1))
        );
        assert_eq!(parse_summary("running 3 tests"), None);
    }
}
