//! `run --desired-file`: the agent without a proxy, for trying it on a machine by hand
//! and for tests that drive it with a file.

use std::path::PathBuf;
use std::time::Duration;

use kmm_node_agent::control::{EventReceiver, IntentSender};
use kmm_node_agent::desired::DesiredSnapshot;
use kmm_node_agent::metrics::Metrics;

/// Feeds the agent the file's snapshots and prints its events as JSON lines on stdout.
pub(crate) async fn run(
    path: PathBuf,
    poll: Duration,
    intents: IntentSender,
    mut events: EventReceiver,
    metrics: Metrics,
) {
    let printer = async move {
        while let Some(event) = events.recv().await {
            println!("{}", serde_json::json!({ "event": event }));
        }
    };
    tokio::join!(printer, watch_desired_file(path, poll, intents, metrics));
}

/// Feeds the desired-module snapshots from a JSON file, re-read when it changes.
async fn watch_desired_file(
    path: PathBuf,
    every: Duration,
    intents: IntentSender,
    metrics: Metrics,
) {
    let mut last: Option<Vec<u8>> = None;
    loop {
        match tokio::fs::read(&path).await {
            Ok(bytes) if last.as_deref() != Some(&bytes[..]) => {
                match DesiredSnapshot::from_json(&bytes) {
                    Ok(desired) => {
                        metrics.desired_received();
                        tracing::info!(
                            revision = desired.revision,
                            modules = desired.modules.len(),
                            unload = desired.unload.len(),
                            "new desired modules"
                        );
                        let _ = intents.send(Some(desired));
                    }
                    Err(e) => {
                        tracing::warn!(path = %path.display(), error = %e, "invalid desired-modules file")
                    }
                }
                last = Some(bytes);
            }
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => {
                tracing::warn!(path = %path.display(), error = %e, "cannot read the desired-modules file")
            }
        }
        tokio::time::sleep(every).await;
    }
}
