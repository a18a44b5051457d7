//! The local fleet's fleet view, reached from this machine: `kubectl port-forward` to
//! the leading hub Pod's `ui` port, listening on 127.0.0.1 only (the view listens on the
//! Pod's loopback and no Service exposes it; docs/fleet-view.md). `cargo xtask env ui`
//! leaves one running, recorded in the fleet's state so that `env down` stops it by its
//! PID; the browser test starts its own and stops it when done.

use std::net::{IpAddr, Ipv4Addr};
use std::path::Path;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use super::{State, client_for, http_get_plain, hub_install};
use crate::process::{Tracked, spawn};
use crate::toolchain::Toolchain;
use crate::versions::Versions;
use crate::wait::wait_until;
use crate::{Error, IoContext, Result};

/// The hub container's port of the fleet view (addon-manifests/hub/deployment.yaml).
pub const UI_PORT_NAME: &str = "ui";
/// `cargo xtask env ui`'s port: the hub's block of the base port, +90 (the view's 8090).
pub const UI_PORT_OFFSET: u16 = 90;
/// From `kubectl port-forward` to the view answering through it.
const FORWARD_TIMEOUT: Duration = Duration::from_secs(30);
/// Attempts at reaching the leader: the Lease may move between finding the leader and
/// forwarding to it.
const ATTEMPTS: usize = 3;
const LOOPBACK: IpAddr = IpAddr::V4(Ipv4Addr::LOCALHOST);

/// A running `kubectl port-forward` to the leader's fleet view.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct UiForward {
    /// `http://127.0.0.1:<port>`, without a trailing `/`.
    pub url: String,
    /// The hub Pod it forwards to: the leader when it started.
    pub pod: String,
    pub process: Tracked,
}

impl UiForward {
    /// Forwards 127.0.0.1:`port` (`0`: a free one kubectl picks) to the leading hub
    /// Pod's `ui` port, once the leader's fleet page answers through it. `name` names
    /// its log, `<state>/logs/<name>.log`.
    pub async fn start(
        state_dir: &Path,
        bin_dir: Option<&Path>,
        state: &State,
        port: u16,
        name: &str,
    ) -> Result<Self> {
        let toolchain = Toolchain::locate(&Versions::pinned(), bin_dir)?;
        let kubectl = toolchain.bin("kubectl");
        let hub = state.cluster("hub")?;
        let client = client_for(&hub.kubeconfig).await?;
        let logs = state_dir.join("logs");
        std::fs::create_dir_all(&logs).context(|| format!("creating {}", logs.display()))?;
        let log = logs.join(format!("{name}.log"));
        let mut last = String::new();
        for _ in 0..ATTEMPTS {
            let pod = hub_install::wait_leader(&client, FORWARD_TIMEOUT).await?;
            let args: Vec<String> = vec![
                "--kubeconfig".into(),
                hub.kubeconfig.display().to_string(),
                "--namespace".into(),
                super::kmm::HUB_NAMESPACE.into(),
                "port-forward".into(),
                "--address=127.0.0.1".into(),
                format!("pod/{pod}"),
                match port {
                    0 => format!(":{UI_PORT_NAME}"),
                    port => format!("{port}:{UI_PORT_NAME}"),
                },
            ];
            // The log is read for the port kubectl picked: it holds this run only.
            std::fs::write(&log, "").context(|| format!("emptying {}", log.display()))?;
            let process = spawn(name, kubectl, &args, &[], &log, None)?;
            let forward = match listening_port(&process).await {
                Ok(local) => Self {
                    url: format!("http://127.0.0.1:{local}"),
                    pod,
                    process,
                },
                Err(e) => {
                    process.stop(Duration::from_secs(5));
                    return Err(e);
                }
            };
            match forward.leader_page().await {
                Ok(()) => return Ok(forward),
                Err(seen) => {
                    forward.stop();
                    last = seen;
                }
            }
        }
        Err(Error::Invalid(format!(
            "the fleet view through `kubectl port-forward` (log {}): {last}",
            log.display()
        )))
    }

    /// Whether the forward still runs and the leader's fleet page answers through it.
    pub async fn serves_leader(&self) -> bool {
        self.process.alive() && self.leader_page().await.is_ok()
    }

    /// SIGTERM to the forward (its PID), SIGKILL if it lingers.
    pub fn stop(&self) {
        self.process.stop(Duration::from_secs(5));
    }

    /// Waits until the fleet page answers through the forward, and is the leader's.
    async fn leader_page(&self) -> std::result::Result<(), String> {
        let port = self
            .url
            .rsplit_once(':')
            .and_then(|(_, port)| port.parse::<u16>().ok())
            .ok_or_else(|| format!("no port in {}", self.url))?;
        let page = wait_until(
            "the fleet page through the forward",
            FORWARD_TIMEOUT,
            || async {
                if !self.process.alive() {
                    return Err(format!("kubectl exited: {}", self.process.log_tail(5)));
                }
                http_get_plain(LOOPBACK, port, "/")
                    .await
                    .ok_or_else(|| format!("no answer on 127.0.0.1:{port} yet"))
            },
        )
        .await
        .map_err(|e| e.to_string())?;
        if page.contains("<h1>Fleet</h1>") {
            Ok(())
        } else {
            Err(format!("{} is not the leader any more", self.pod))
        }
    }
}

/// The local port kubectl says it forwards from (`Forwarding from 127.0.0.1:PORT -> ...`).
async fn listening_port(process: &Tracked) -> Result<u16> {
    let deadline = Instant::now() + FORWARD_TIMEOUT;
    loop {
        let log = std::fs::read_to_string(&process.log).unwrap_or_default();
        if let Some(port) = forwarded_port(&log) {
            return Ok(port);
        }
        if !process.alive() || Instant::now() >= deadline {
            return Err(Error::Component {
                component: process.name.clone(),
                reason: format!(
                    "kubectl port-forward did not listen: {}",
                    process.log_tail(5)
                ),
                log: process.log.clone(),
            });
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The port of kubectl's `Forwarding from 127.0.0.1:PORT -> 8090` line.
fn forwarded_port(log: &str) -> Option<u16> {
    log.lines().find_map(|line| {
        line.strip_prefix("Forwarding from 127.0.0.1:")?
            .split_whitespace()
            .next()?
            .parse()
            .ok()
    })
}

/// The fleet view's URL for `cargo xtask env ui`: the recorded forward while it still
/// reaches the leader, or a new one on the base port + [`UI_PORT_OFFSET`], recorded in
/// the state (the previous one stopped by its PID).
pub async fn ensure(settings: &super::Settings) -> Result<String> {
    let mut state = super::running(settings)?;
    if let Some(forward) = &state.ui_forward {
        if forward.serves_leader().await {
            return Ok(forward.url.clone());
        }
        forward.stop();
    }
    let port = settings.base_port + UI_PORT_OFFSET;
    let forward = UiForward::start(
        &settings.state_dir,
        settings.bin_dir.as_deref(),
        &state,
        port,
        "hub-ui-forward",
    )
    .await?;
    let url = forward.url.clone();
    state.ui_forward = Some(forward);
    state.save(&settings.state_dir)?;
    Ok(url)
}

#[cfg(test)]
mod tests {
    use super::forwarded_port;

    #[test]
    fn the_port_is_the_one_kubectl_says_it_forwards_from() {
        let log = "Forwarding from 127.0.0.1:43117 -> 8090\nHandling connection for 43117\n";
        assert_eq!(forwarded_port(log), Some(43117));
        assert_eq!(
            forwarded_port("Forwarding from [::1]:43117 -> 8090\n"),
            None
        );
        assert_eq!(forwarded_port("error: unable to forward port\n"), None);
    }
}
