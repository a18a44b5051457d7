//! A real browser for the tests that look at the fleet view as a person does: Debian's
//! `chromium`, headless, on 127.0.0.1 with a profile of its own, driven over the
//! DevTools protocol (chromiumoxide connects to the Chromium this module starts; it
//! downloads no browser and starts none itself).
//!
//! Waits poll the page's DOM until a condition holds or a deadline passes, and a failed
//! wait says what the page last showed. The Chromium started is stopped by its PID, with
//! everything it forked, when the [`Browser`] is dropped.

use std::fs::File;
use std::os::unix::fs::MetadataExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use chromiumoxide::cdp::browser_protocol::emulation::SetScriptExecutionDisabledParams;
use chromiumoxide::cdp::browser_protocol::page::NavigateParams;
use chromiumoxide::error::CdpError;
use chromiumoxide::page::ScreenshotParams;
use futures::StreamExt;
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use tempfile::TempDir;
use tokio::task::JoinHandle;

/// Debian's package installs it here (`cargo xtask env setup` installs the package).
pub const CHROMIUM: &str = "/usr/bin/chromium";
/// Another Chromium instead of Debian's.
pub const CHROMIUM_ENV: &str = "KMM_CHROMIUM";
/// From starting Chromium to its DevTools endpoint listening: seconds on a loaded
/// 2-core machine.
const START_TIMEOUT: Duration = Duration::from_secs(30);
/// How often a wait reads the page again.
const POLL: Duration = Duration::from_millis(100);
/// The window every page is laid out and photographed in.
const WINDOW: &str = "--window-size=1200,700";

/// Why driving the browser failed.
#[derive(Debug, thiserror::Error)]
pub enum BrowserError {
    #[error(
        "cannot start {program}: {source} (Debian's `chromium` package: `cargo xtask env setup` \
         installs it; {CHROMIUM_ENV} names another)"
    )]
    Start {
        program: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{program} {what}; its output:\n{output}")]
    NoDevTools {
        program: PathBuf,
        what: String,
        output: String,
    },
    #[error("DevTools protocol: {0}")]
    Cdp(#[from] CdpError),
    #[error("the page answered another type than asked: {0}")]
    Value(#[from] serde_json::Error),
    #[error("timed out after {seconds}s waiting for {what} on {url}; last seen: {last}")]
    Timeout {
        what: String,
        url: String,
        seconds: u64,
        last: String,
    },
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },
}

pub type Result<T, E = BrowserError> = std::result::Result<T, E>;

fn io(context: impl Into<String>) -> impl FnOnce(std::io::Error) -> BrowserError {
    let context = context.into();
    move |source| BrowserError::Io { context, source }
}

/// A headless Chromium started by this process, stopped when dropped.
#[derive(Debug)]
pub struct Browser {
    browser: chromiumoxide::Browser,
    /// Reads the DevTools connection; pages answer only while it runs.
    handler: JoinHandle<()>,
    child: Child,
    /// The profile, and Chromium's output: removed after Chromium is stopped.
    _profile: TempDir,
}

impl Browser {
    /// Starts Chromium ([`CHROMIUM`], or `$KMM_CHROMIUM`) headless, listening for DevTools
    /// on 127.0.0.1 at a port it picks, and connects to it.
    pub async fn start() -> Result<Self> {
        let program =
            std::env::var_os(CHROMIUM_ENV).map_or_else(|| PathBuf::from(CHROMIUM), PathBuf::from);
        let profile = tempfile::Builder::new()
            .prefix("kmm-chromium-")
            .tempdir()
            .map_err(io("creating Chromium's profile directory"))?;
        let log_path = profile.path().join("chromium.log");
        let log =
            File::create(&log_path).map_err(io(format!("creating {}", log_path.display())))?;
        let err = log
            .try_clone()
            .map_err(io(format!("opening {}", log_path.display())))?;
        let mut command = Command::new(&program);
        command
            .args([
                "--headless",
                "--remote-debugging-address=127.0.0.1",
                "--remote-debugging-port=0",
                "--no-first-run",
                "--no-default-browser-check",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-default-apps",
                "--disable-extensions",
                "--disable-sync",
                // /dev/shm is small in containers; Chromium then crashes its renderers.
                "--disable-dev-shm-usage",
                "--hide-scrollbars",
                "--force-device-scale-factor=1",
                WINDOW,
            ])
            .arg(format!("--user-data-dir={}", profile.path().display()));
        // Chromium refuses to run as root inside its sandbox; CI and the fleet's hosts
        // run the tests as root. The pages it opens are the hub's own.
        if is_root() {
            command.arg("--no-sandbox");
        }
        command
            .arg("about:blank")
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(err)
            // Its own group, so that its renderers and helpers are stopped with it.
            .process_group(0);
        let child = command.spawn().map_err(|source| BrowserError::Start {
            program: program.clone(),
            source,
        })?;
        let mut starting = Starting {
            child: Some(child),
            program,
            log: log_path,
        };
        let endpoint = starting.devtools_endpoint(profile.path()).await?;
        let (browser, mut handler) = chromiumoxide::Browser::connect(endpoint).await?;
        // An event the crate does not know is an error of this stream, not of the
        // connection: reading goes on until the connection ends.
        let handler = tokio::spawn(async move { while handler.next().await.is_some() {} });
        Ok(Self {
            browser,
            handler,
            child: starting.child.take().expect("the child is kept until now"),
            _profile: profile,
        })
    }

    /// Opens `url` in a new tab, its scripts running, once it has loaded.
    pub async fn open(&self, url: &str) -> Result<Page> {
        let page = self.browser.new_page(url).await?;
        Ok(Page {
            page,
            url: url.to_owned(),
        })
    }

    /// Opens `url` in a new tab that runs no script: the page as served, as a browser
    /// with JavaScript turned off shows it.
    pub async fn open_without_javascript(&self, url: &str) -> Result<Page> {
        let page = self.browser.new_page("about:blank").await?;
        page.execute(SetScriptExecutionDisabledParams::new(true))
            .await?;
        page.goto(NavigateParams::new(url)).await?;
        Ok(Page {
            page,
            url: url.to_owned(),
        })
    }

    /// Chromium's PID.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        self.handler.abort();
        stop(&mut self.child);
    }
}

/// Chromium between its start and its DevTools connection: stopped if the start fails.
struct Starting {
    child: Option<Child>,
    program: PathBuf,
    log: PathBuf,
}

impl Starting {
    /// The browser's DevTools WebSocket, from the file Chromium writes into its profile
    /// once it listens (`DevToolsActivePort`: the port, then the path).
    async fn devtools_endpoint(&mut self, profile: &Path) -> Result<String> {
        let file = profile.join("DevToolsActivePort");
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            if let Ok(text) = std::fs::read_to_string(&file) {
                let mut lines = text.lines();
                if let (Some(port), Some(path)) = (lines.next(), lines.next()) {
                    return Ok(format!("ws://127.0.0.1:{port}{path}"));
                }
            }
            let child = self
                .child
                .as_mut()
                .expect("the child is kept until connected");
            if let Ok(Some(status)) = child.try_wait() {
                return Err(self.failed(format!("exited at start ({status})")));
            }
            if Instant::now() >= deadline {
                return Err(self.failed(format!(
                    "did not listen for DevTools within {}s",
                    START_TIMEOUT.as_secs()
                )));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    fn failed(&self, what: String) -> BrowserError {
        BrowserError::NoDevTools {
            program: self.program.clone(),
            what,
            output: std::fs::read_to_string(&self.log).unwrap_or_default(),
        }
    }
}

impl Drop for Starting {
    fn drop(&mut self) {
        if let Some(child) = self.child.as_mut() {
            stop(child);
        }
    }
}

/// SIGKILL to Chromium's process group (it leads it), then reaps it: nothing of it
/// outlives the test.
fn stop(child: &mut Child) {
    if let Ok(pid) = i32::try_from(child.id()) {
        let _ = kill(Pid::from_raw(-pid), Signal::SIGKILL);
    }
    let _ = child.kill();
    let _ = child.wait();
}

fn is_root() -> bool {
    std::fs::metadata("/proc/self").is_ok_and(|m| m.uid() == 0)
}

/// A tab of the [`Browser`].
#[derive(Debug)]
pub struct Page {
    page: chromiumoxide::Page,
    url: String,
}

impl Page {
    /// The URL it was opened at.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// The rendered text of the first element matching the CSS `selector`, `None` when
    /// none does.
    pub async fn text(&self, selector: &str) -> Result<Option<String>> {
        let selector = serde_json::to_string(selector).expect("a string serialises");
        // A list, empty when nothing matches: DevTools answers a JavaScript `null` with no
        // value at all, which chromiumoxide cannot read as an `Option`.
        let expression = format!(
            "(() => {{ const e = document.querySelector({selector}); \
             return e === null ? [] : [e.innerText]; }})()"
        );
        let found: Vec<String> = self.page.evaluate(expression).await?.into_value()?;
        Ok(found.into_iter().next())
    }

    /// The rendered text of every element matching `selector`.
    pub async fn texts(&self, selector: &str) -> Result<Vec<String>> {
        let selector = serde_json::to_string(selector).expect("a string serialises");
        let expression =
            format!("Array.from(document.querySelectorAll({selector}), e => e.innerText)");
        Ok(self.page.evaluate(expression).await?.into_value()?)
    }

    /// Reads the text of `selector` until `holds` accepts it, for at most `timeout`; the
    /// text it accepted.
    pub async fn wait_for_text(
        &self,
        what: &str,
        selector: &str,
        timeout: Duration,
        mut holds: impl FnMut(&str) -> bool,
    ) -> Result<String> {
        let deadline = Instant::now() + timeout;
        loop {
            let last = match self.text(selector).await? {
                Some(text) if holds(&text) => return Ok(text),
                Some(text) => format!("{selector}: {text:?}"),
                None => format!("no {selector}"),
            };
            if Instant::now() >= deadline {
                return Err(BrowserError::Timeout {
                    what: what.to_owned(),
                    url: self.url.clone(),
                    seconds: timeout.as_secs(),
                    last,
                });
            }
            tokio::time::sleep(POLL).await;
        }
    }

    /// When this document was loaded (`performance.timeOrigin`, in ms since the epoch): a
    /// reload or another navigation changes it, an update of the page in place does not.
    pub async fn loaded_at(&self) -> Result<f64> {
        Ok(self
            .page
            .evaluate("performance.timeOrigin")
            .await?
            .into_value()?)
    }

    /// A PNG of the whole page, written to `path` (its directory is created).
    pub async fn screenshot(&self, path: &Path) -> Result<()> {
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).map_err(io(format!("creating {}", dir.display())))?;
        }
        let png = self
            .page
            .screenshot(ScreenshotParams::builder().full_page(true).build())
            .await?;
        std::fs::write(path, png).map_err(io(format!("writing {}", path.display())))
    }
}

/// Set to write the screenshots over the docs' images too.
pub const REFRESH_DOCS_ENV: &str = "KMM_REFRESH_DOCS_IMAGES";

/// Where a test's screenshots go: `<dir>/<suite>/<page>.png`, and with
/// `KMM_REFRESH_DOCS_IMAGES=1` also `docs/images/fleet-view-<page>.png`.
#[derive(Debug)]
pub struct Screenshots {
    dir: PathBuf,
    docs: Option<PathBuf>,
}

impl Screenshots {
    /// Under `target_tmp` (a test's `CARGO_TARGET_TMPDIR`), in folder `suite`.
    pub fn new(target_tmp: &Path, suite: &str) -> Self {
        let docs = std::env::var_os(REFRESH_DOCS_ENV)
            .is_some_and(|v| v == "1")
            .then(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/images"));
        Self {
            dir: target_tmp.join(suite),
            docs,
        }
    }

    /// Photographs `page` as `name`; the path written in the target directory.
    pub async fn take(&self, page: &Page, name: &str) -> Result<PathBuf> {
        let path = self.dir.join(format!("{name}.png"));
        page.screenshot(&path).await?;
        if let Some(docs) = &self.docs {
            std::fs::create_dir_all(docs).map_err(io(format!("creating {}", docs.display())))?;
            let copy = docs.join(format!("fleet-view-{name}.png"));
            std::fs::copy(&path, &copy).map_err(io(format!(
                "copying {} to {}",
                path.display(),
                copy.display()
            )))?;
        }
        eprintln!("screenshot of {}: {}", page.url(), path.display());
        Ok(path)
    }
}
