//! A hostile spoke proxy (issue 28): a real `Hub.Sync` client with a valid certificate
//! of its own cluster that, stream after stream, sends the hub what a broken or
//! compromised proxy could: inventories of made-up kernels (valid ones, too many, and
//! names no kernel has), node status reports whose texts are as large as a message
//! allows, in parts that never finish, and statuses and device plugin counts of modules
//! that do not exist. The hub refuses and ends its streams; it reconnects as soon as the
//! hub lets it, until the deadline.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use kmm_proto::limits::{ERROR_TEXT, INVENTORY_KERNELS, PROXY_MESSAGE};
use kmm_proto::v1::{
    DevicePluginCount, DevicePluginReport, Kernel, KernelInventory, ModuleKey, ModuleNodeKey,
    ModuleNodeStatus, ModuleState, NodeStatusReport, ProxyHello, ProxyMessage,
    hub_client::HubClient, proxy_message,
};
use prost::Message as _;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::{Certificate, ClientTlsConfig, Endpoint, Identity};

use super::proxy::ProxyIdentity;
use super::{Error, Result};

/// How long the hostile proxy waits before reopening a stream the hub refused to open
/// (it throttles a cluster's reconnects): a pace, not a synchronisation.
const REOPEN_PAUSE: Duration = Duration::from_secs(2);
/// The text of each hostile status: all of it kept, so that few messages reach the
/// hub's bound on a cluster's statuses in bytes...
const STATUS_TEXT: usize = ERROR_TEXT;
/// ... and of one per message, far beyond what the hub keeps of a status.
const HUGE_TEXT: usize = 1 << 20;
/// Statuses per hostile message: as many as fit well within `PROXY_MESSAGE`.
const STATUSES_PER_MESSAGE: usize = (PROXY_MESSAGE - 2 * HUGE_TEXT) / (STATUS_TEXT + 64);

/// What the hostile proxy sent, and how the hub answered.
#[derive(Clone, Debug, Default)]
pub struct HostileTraffic {
    /// Streams the hub accepted.
    pub streams: u64,
    /// Streams the hub ended, with the messages it gave (the first few).
    pub ended: u64,
    pub reasons: Vec<String>,
    pub messages: u64,
    pub bytes: u64,
}

/// The messages of one hostile stream, the `n`th: each stream tries another attack.
fn attack(n: u64, module: &ModuleKey) -> Vec<ProxyMessage> {
    let message = |m| ProxyMessage { message: Some(m) };
    // Each inventory of a stream newer than the one before: the hub ignores a late
    // duplicate before looking at it.
    let inventory = |revision: u64, kernels: Vec<String>| {
        message(proxy_message::Message::Inventory(KernelInventory {
            revision,
            kernels: kernels
                .into_iter()
                .map(|release| Kernel { release })
                .collect(),
        }))
    };
    let statuses = |module: &ModuleKey, part: u64, continued: bool| {
        message(proxy_message::Message::Status(NodeStatusReport {
            full: true,
            statuses: (0..STATUSES_PER_MESSAGE)
                .map(|i| ModuleNodeStatus {
                    key: Some(ModuleNodeKey {
                        module: Some(module.clone()),
                        node: format!("junk-{n}-{part}-{i}"),
                    }),
                    state: ModuleState::Failed.into(),
                    kernel: format!("6.{n}.{i}-junk"),
                    reason: "Junk".into(),
                    message: format!(
                        "{n}-{part}-{i}-{}",
                        "x".repeat(if i == 0 { HUGE_TEXT } else { STATUS_TEXT })
                    ),
                    ..ModuleNodeStatus::default()
                })
                .collect(),
            intent_revision: n,
            continued,
            ..NodeStatusReport::default()
        }))
    };
    let stranger = |i: u64| ModuleKey {
        namespace: format!("junk-{n}"),
        name: format!("stranger-{i}"),
    };
    // Valid, made up, new each stream: kept (at most INVENTORY_KERNELS), resolved.
    let made_up = (0..INVENTORY_KERNELS)
        .map(|k| format!("6.{n}.{k}-junk"))
        .collect();
    let mut messages = vec![
        message(proxy_message::Message::Hello(ProxyHello {
            proxy_version: "hostile".into(),
            applied_intent_revision: 0,
            applied_intent_digest: Vec::new(),
        })),
        inventory(1, made_up),
    ];
    match n % 3 {
        // Oversized statuses of a real module, a report whose parts never end: refused
        // once its bytes reach the hub's bound.
        0 => messages.extend((0..64).map(|part| statuses(module, part, true))),
        // Modules that do not exist: dropped, the stream goes on; then too many kernels.
        1 => {
            for batch in 0..16 {
                messages.push(message(proxy_message::Message::DevicePlugins(
                    DevicePluginReport {
                        plugins: (0..2_000)
                            .map(|i| DevicePluginCount {
                                module: Some(stranger(batch * 2_000 + i)),
                                desired: 1,
                                available: 0,
                            })
                            .collect(),
                    },
                )));
                messages.push(statuses(&stranger(batch), batch, false));
            }
            messages.push(inventory(
                2,
                (0..=4 * INVENTORY_KERNELS)
                    .map(|k| format!("6.{n}.{k}"))
                    .collect(),
            ));
        }
        // A kernel name no kernel has.
        _ => messages.push(inventory(2, vec![format!("6.1 {}", "x".repeat(1 << 20))])),
    }
    messages
}

/// Runs the hostile proxy of `identity` against the hub at `hub` (whose serving
/// certificate `ca_pem` signs) until `until`; `module` is a module the hub knows.
pub async fn run(
    hub: SocketAddr,
    ca_pem: &str,
    identity: &ProxyIdentity,
    module: &ModuleKey,
    until: Instant,
) -> Result<HostileTraffic> {
    let tls = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(ca_pem))
        .identity(Identity::from_pem(&identity.cert_pem, &identity.key_pem))
        .domain_name(hub.ip().to_string());
    let endpoint = Endpoint::from_shared(format!("https://{hub}"))
        .map_err(|e| Error::Invalid(format!("hub address {hub}: {e}")))?
        .tls_config(tls)?
        .connect_timeout(Duration::from_secs(10));
    let mut traffic = HostileTraffic::default();
    let mut n = 0;
    while Instant::now() < until {
        let deadline = tokio::time::sleep_until(until.into());
        tokio::select! {
            () = deadline => break,
            ended = stream(&endpoint, attack(n, module), &mut traffic) => {
                if let Some(reason) = ended? {
                    traffic.ended += 1;
                    if traffic.reasons.len() < 8 && !traffic.reasons.contains(&reason) {
                        traffic.reasons.push(reason);
                    }
                }
            }
        }
        n += 1;
        tokio::time::sleep(REOPEN_PAUSE.min(until.saturating_duration_since(Instant::now()))).await;
    }
    Ok(traffic)
}

/// One stream: sends `messages` while the hub reads them; returns how the hub ended it
/// (`None` when it did not before they were all sent and answered).
async fn stream(
    endpoint: &Endpoint,
    messages: Vec<ProxyMessage>,
    traffic: &mut HostileTraffic,
) -> Result<Option<String>> {
    let channel = endpoint.connect().await?;
    let (tx, rx) = mpsc::channel(2);
    let mut client = HubClient::new(channel).max_encoding_message_size(PROXY_MESSAGE);
    // Fed as the hub reads: a stream it ends stops the feeding. The last message sent
    // closes the stream, which the hub then ends.
    let counted = Arc::new((AtomicU64::new(0), AtomicU64::new(0)));
    let feeding = tokio::spawn({
        let counted = counted.clone();
        async move {
            for message in messages {
                let len = message.encoded_len() as u64;
                if tx.send(message).await.is_err() {
                    break;
                }
                counted.0.fetch_add(1, Ordering::Relaxed);
                counted.1.fetch_add(len, Ordering::Relaxed);
            }
        }
    });
    let ended = match client.sync(ReceiverStream::new(rx)).await {
        Err(status) => Some(format!("{:?}: {}", status.code(), status.message())),
        Ok(response) => {
            traffic.streams += 1;
            let mut inbound = response.into_inner();
            loop {
                match inbound.message().await {
                    Ok(Some(_)) => {}
                    Ok(None) => break None,
                    Err(status) => {
                        break Some(format!("{:?}: {}", status.code(), status.message()));
                    }
                }
            }
        }
    };
    feeding.abort();
    traffic.messages += counted.0.load(Ordering::Relaxed);
    traffic.bytes += counted.1.load(Ordering::Relaxed);
    Ok(ended)
}
