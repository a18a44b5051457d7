//! Where the pipeline's time goes: each step of `cargo xtask test`, and each test binary
//! of its `cargo test` run, printed at the end (issue 31). Pure: the caller passes the
//! clock's readings with the lines.

use std::time::{Duration, Instant};

/// What one step or suite took.
#[derive(Debug, Clone, PartialEq)]
pub struct Timing {
    pub name: String,
    pub took: Duration,
}

/// The steps of the pipeline, in the order they ran.
#[derive(Debug, Default)]
pub struct Timings {
    steps: Vec<Timing>,
    suites: Vec<Timing>,
}

impl Timings {
    /// Runs `step` and records how long it took, also when it fails.
    pub fn step<T>(&mut self, name: &str, step: impl FnOnce() -> T) -> T {
        let started = Instant::now();
        let outcome = step();
        self.steps.push(Timing {
            name: name.to_owned(),
            took: started.elapsed(),
        });
        outcome
    }

    pub fn add_suites(&mut self, suites: Vec<Timing>) {
        self.suites.extend(suites);
    }

    /// The report: every step in order, then the suites slowest first, then the total.
    pub fn report(&self) -> String {
        let mut out = String::from("timings (seconds):\n");
        for step in &self.steps {
            out.push_str(&format!(
                "  step  {:>8.1}  {}\n",
                step.took.as_secs_f64(),
                step.name
            ));
        }
        let mut suites: Vec<&Timing> = self.suites.iter().collect();
        suites.sort_by(|a, b| b.took.cmp(&a.took).then_with(|| a.name.cmp(&b.name)));
        for suite in suites {
            out.push_str(&format!(
                "  suite {:>8.1}  {}\n",
                suite.took.as_secs_f64(),
                suite.name
            ));
        }
        let total: Duration = self.steps.iter().map(|s| s.took).sum();
        out.push_str(&format!("  total {:>8.1}\n", total.as_secs_f64()));
        out
    }
}

/// Times the test binaries of one `cargo test` run from its merged output: a suite runs
/// from the line announcing it (`Running ...`, `Doc-tests ...`) to the next announcement
/// or the end of the output. What comes before the first one is the build.
#[derive(Debug)]
pub struct SuiteClock {
    started: Instant,
    current: Option<(String, Instant)>,
    done: Vec<Timing>,
}

impl SuiteClock {
    pub fn new(started: Instant) -> Self {
        Self {
            started,
            current: None,
            done: Vec::new(),
        }
    }

    pub fn line(&mut self, at: Instant, line: &str) {
        let Some(name) = suite_name(line) else {
            return;
        };
        self.close(at);
        self.current = Some((name, at));
    }

    pub fn finish(mut self, at: Instant) -> Vec<Timing> {
        self.close(at);
        self.done
    }

    fn close(&mut self, at: Instant) {
        match self.current.take() {
            Some((name, since)) => self.done.push(Timing {
                name,
                took: at.saturating_duration_since(since),
            }),
            None => self.done.push(Timing {
                name: "build (cargo test)".to_owned(),
                took: at.saturating_duration_since(self.started),
            }),
        }
    }
}

/// `Running tests/addon.rs (target/debug/deps/addon-0a1b)` -> `tests/addon.rs [addon]`;
/// `Running unittests src/lib.rs (target/debug/deps/kmm_hub-0a1b)` ->
/// `unittests src/lib.rs [kmm_hub]`; `Doc-tests kmm_api` -> `doc-tests kmm_api`.
fn suite_name(line: &str) -> Option<String> {
    let line = line.trim();
    if let Some(crate_name) = line.strip_prefix("Doc-tests ") {
        return Some(format!("doc-tests {}", crate_name.trim()));
    }
    let rest = line.strip_prefix("Running ")?;
    let (source, binary) = rest.split_once(" (")?;
    let binary = binary.strip_suffix(')')?;
    let stem = binary.rsplit('/').next()?;
    let stem = stem.rsplit_once('-').map_or(stem, |(stem, _hash)| stem);
    Some(format!("{source} [{stem}]"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_the_suites_cargo_announces() {
        assert_eq!(
            suite_name("     Running tests/addon.rs (target/debug/deps/addon-0a1b2c)").as_deref(),
            Some("tests/addon.rs [addon]")
        );
        assert_eq!(
            suite_name("     Running unittests src/lib.rs (target/debug/deps/kmm_hub-99)")
                .as_deref(),
            Some("unittests src/lib.rs [kmm_hub]")
        );
        assert_eq!(
            suite_name("   Doc-tests kmm_api").as_deref(),
            Some("doc-tests kmm_api")
        );
        assert_eq!(suite_name("test result: ok. 1 passed; 0 failed"), None);
        assert_eq!(suite_name("test running_things ... ok"), None);
    }

    #[test]
    fn a_suite_lasts_until_the_next_one_starts_and_the_build_comes_first() {
        let t0 = Instant::now();
        let at = |s| t0 + Duration::from_secs(s);
        let mut clock = SuiteClock::new(t0);
        clock.line(at(5), "   Compiling kmm-hub v0.1.0");
        clock.line(at(60), "     Running tests/a.rs (target/debug/deps/a-1)");
        clock.line(at(61), "test result: ok. 1 passed; 0 failed");
        clock.line(at(70), "     Running tests/b.rs (target/debug/deps/b-2)");
        let suites = clock.finish(at(100));
        let took: Vec<(&str, u64)> = suites
            .iter()
            .map(|t| (t.name.as_str(), t.took.as_secs()))
            .collect();
        assert_eq!(
            took,
            [
                ("build (cargo test)", 60),
                ("tests/a.rs [a]", 10),
                ("tests/b.rs [b]", 30)
            ]
        );
    }

    #[test]
    fn the_report_lists_steps_in_order_and_suites_slowest_first_with_a_total() {
        let mut timings = Timings {
            steps: vec![
                Timing {
                    name: "clippy".into(),
                    took: Duration::from_secs(30),
                },
                Timing {
                    name: "tests".into(),
                    took: Duration::from_secs(90),
                },
            ],
            suites: Vec::new(),
        };
        timings.add_suites(vec![
            Timing {
                name: "fast".into(),
                took: Duration::from_secs(1),
            },
            Timing {
                name: "slow".into(),
                took: Duration::from_secs(80),
            },
        ]);
        let report = timings.report();
        let lines: Vec<&str> = report.lines().map(str::trim).collect();
        assert_eq!(
            lines,
            [
                "timings (seconds):",
                "step      30.0  clippy",
                "step      90.0  tests",
                "suite     80.0  slow",
                "suite      1.0  fast",
                "total    120.0",
            ]
        );
    }
}
