//! The seam between the agent loop and its control plane: the proxy connection
//! ([`crate::proxy_connection`]) or, standalone, `run --desired-file`. Either sends
//! the [`Hello`], feeds [`DesiredSnapshot`]s into an [`IntentSender`] and forwards
//! every [`AgentEvent`]; the reconciler publishes its [`Progress`].

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};
use tokio::sync::watch;

use crate::desired::DesiredSnapshot;
pub use crate::event_queue::{EventReceiver, EventSender};
pub use crate::shared_modules::Kept;

/// Sent first on every connection.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Hello {
    pub node_name: String,
    pub boot_id: String,
    pub kernel_release: String,
    /// What this agent has loaded (from its state), so the proxy can resync.
    pub loaded: Vec<LoadedModule>,
}

/// One loaded module entry, as reported in [`Hello`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct LoadedModule {
    pub key: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub version: Option<String>,
    pub image: String,
    pub digest: String,
}

/// What happened.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum EventAction {
    Load,
    Unload,
}

/// How it ended; failures carry the full error text.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", tag = "result", content = "error")]
pub enum Outcome {
    Success,
    Failure(String),
}

/// One load or unload attempt.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct AgentEvent {
    pub key: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub version: Option<String>,
    pub action: EventAction,
    pub outcome: Outcome,
    /// Image and digest concerned (the digest once it is known).
    pub image: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub digest: Option<String>,
    /// Time spent pulling and extracting (loads only; zero when cached).
    pub pull_ms: u64,
    /// Time spent on the kernel side: in-tree removals, firmware, modprobe.
    pub duration_ms: u64,
    /// When the attempt ended, in milliseconds since the Unix epoch.
    pub at_unix_ms: u64,
    /// Revision of the snapshot this attempt acted on.
    pub revision: u64,
    /// A successful unload's kernel modules left loaded for other served modules: the
    /// control plane reports the overlap on both modules.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub kept: Vec<Kept>,
    /// A load's steps at the clock's precision, for the metrics (the wire and the JSON
    /// lines carry the milliseconds above).
    #[serde(skip)]
    pub timing: LoadTiming,
}

/// How long a load attempt's steps took, each `None` when it did not run (an image
/// already extracted is neither pulled nor extracted), and when the attempt ended.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LoadTiming {
    pub pull: Option<Duration>,
    pub extract: Option<Duration>,
    /// The kernel side: in-tree removals, firmware, modprobe.
    pub modprobe: Option<Duration>,
    pub finished: Option<SystemTime>,
}

impl AgentEvent {
    pub fn is_success(&self) -> bool {
        self.outcome == Outcome::Success
    }

    /// The attempt ended `at`.
    pub(crate) fn ended(mut self, at: SystemTime) -> Self {
        self.at_unix_ms = unix_ms(at);
        self.timing.finished = Some(at);
        self
    }
}

pub(crate) fn millis(duration: Duration) -> u64 {
    u64::try_from(duration.as_millis()).unwrap_or(u64::MAX)
}

pub(crate) fn now_unix_ms() -> u64 {
    unix_ms(SystemTime::now())
}

pub(crate) fn unix_ms(at: SystemTime) -> u64 {
    millis(at.duration_since(UNIX_EPOCH).unwrap_or_default())
}

/// The latest desired snapshot; `None` until the control plane sent one, so that the
/// agent never acts on silence.
pub type IntentReceiver = watch::Receiver<Option<DesiredSnapshot>>;
pub type IntentSender = watch::Sender<Option<DesiredSnapshot>>;

/// The two channels between the agent and a control-plane client: the latest intents
/// down, the events (bounded, coalesced by module) up.
pub fn channels() -> ((IntentSender, IntentReceiver), (EventSender, EventReceiver)) {
    (watch::channel(None), crate::event_queue::event_queue())
}

/// What the reconciler has done so far: its loaded modules (for a [`Hello`] on every
/// reconnect and the modules gauge) and the last snapshot revision it acted on (for
/// readiness).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Progress {
    pub loaded: Vec<LoadedModule>,
    pub applied_revision: Option<u64>,
}
