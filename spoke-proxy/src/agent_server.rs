//! The agent-facing `Agent.Attach` server. Each stream is authenticated by the agent's
//! token and bound to the node the token names; it only ever carries that node's
//! DesiredModules (and so only that node's credentials). One stream per node: a newer
//! one replaces the older.

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::{Arc, Mutex};

use futures::Stream;
use kmm_proto::v1::agent_server::Agent;
use kmm_proto::v1::{AgentInstruction, AgentMessage, agent_instruction, agent_message};
use tokio::sync::{mpsc, oneshot};
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status, Streaming};
use tracing::Instrument;

use crate::agent_auth::{AuthError, Authenticated, TokenAuthenticator};
use crate::metrics::Metrics;
use crate::node_events::NodeEvents;
use crate::review_cache;
use crate::shared_state::SharedState;
use kmm_proto::limits::{AGENT_LOADED, truncated};
use kmm_runtime::rate_limit::TokenBucket;

type Replacement = (u64, oneshot::Sender<()>);

/// Events one node's agent may send at once, and then per second: a budget of the node,
/// kept across its streams, so that reconnecting does not refill it.
const EVENT_BURST: u32 = 200;
const EVENTS_PER_SECOND: u32 = 20;

/// The bytes of an event's error the proxy logs at info level: the log says what failed;
/// the status the hub gets carries the error up to `kmm_proto::limits::ERROR_TEXT`.
const LOGGED_ERROR: usize = 256;

/// Every node's event budget. One entry per node whose agent authenticated (its token
/// is bound to a Node), so it grows with the cluster's nodes, not with reconnects.
#[derive(Debug, Default)]
struct EventBudgets {
    nodes: Mutex<HashMap<String, TokenBucket>>,
}

impl EventBudgets {
    /// Takes one event from `node`'s budget; false when it is spent.
    fn try_take(&self, node: &str, now: std::time::Instant) -> bool {
        self.nodes
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(node.to_owned())
            .or_insert_with(|| TokenBucket::new(EVENT_BURST, EVENTS_PER_SECOND, now))
            .try_take(now)
    }
}

/// How long an authenticated agent may take to say hello.
const HELLO_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);

/// See the module documentation.
#[derive(Clone, Debug)]
pub struct AgentService {
    state: SharedState,
    auth: TokenAuthenticator,
    metrics: Metrics,
    cancel: CancellationToken,
    /// Per node, the current stream's number and the means to end it when replaced.
    streams: Arc<Mutex<HashMap<String, Replacement>>>,
    next_stream: Arc<std::sync::atomic::AtomicU64>,
    events: Arc<EventBudgets>,
    node_events: NodeEvents,
}

impl AgentService {
    pub fn new(
        state: SharedState,
        auth: TokenAuthenticator,
        metrics: Metrics,
        node_events: NodeEvents,
        cancel: CancellationToken,
    ) -> Self {
        Self {
            state,
            auth,
            metrics,
            cancel,
            streams: Arc::default(),
            next_stream: Arc::default(),
            events: Arc::default(),
            node_events,
        }
    }

    fn refuse(&self, reason: &'static str, status: Status) -> Status {
        self.metrics
            .agent_refusals
            .get_or_create(&vec![("reason", reason)])
            .inc();
        tracing::warn!(reason, message = status.message(), "agent stream refused");
        status
    }

    async fn authenticate(
        &self,
        request: &Request<Streaming<AgentMessage>>,
    ) -> Result<Authenticated, Status> {
        let token = request
            .metadata()
            .get("authorization")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .map(str::trim)
            .filter(|t| !t.is_empty())
            .ok_or_else(|| {
                self.refuse(
                    "missing_token",
                    Status::unauthenticated(
                        "missing `authorization: Bearer <token>` metadata (the node agent's projected ServiceAccount token)",
                    ),
                )
            })?;
        self.auth
            .authenticate(token)
            .await
            .map_err(|error| match &error {
                AuthError::Refused(refusal) if refusal.is_permission() => {
                    self.refuse("forbidden", Status::permission_denied(error.to_string()))
                }
                AuthError::RefusedBefore {
                    permission: true, ..
                } => self.refuse("forbidden", Status::permission_denied(error.to_string())),
                AuthError::Refused(_) | AuthError::RefusedBefore { .. } => self.refuse(
                    "unauthenticated",
                    Status::unauthenticated(error.to_string()),
                ),
                AuthError::Review(_) => {
                    self.refuse("review_failed", Status::unavailable(error.to_string()))
                }
                AuthError::Throttled { .. } => {
                    self.refuse("throttled", Status::resource_exhausted(error.to_string()))
                }
            })
    }

    /// Registers the stream of `node`, ending the one it replaces.
    fn register(&self, node: &str) -> (u64, oneshot::Receiver<()>) {
        let id = self
            .next_stream
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let (tx, rx) = oneshot::channel();
        let mut streams = self.streams.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((_, old)) = streams.insert(node.to_owned(), (id, tx)) {
            // The old stream may have ended already; then nobody listens.
            let _ = old.send(());
        }
        (id, rx)
    }

    fn unregister(&self, node: &str, id: u64) {
        let mut streams = self.streams.lock().unwrap_or_else(|p| p.into_inner());
        if streams.get(node).is_some_and(|(current, _)| *current == id) {
            streams.remove(node);
        }
    }
}

type InstructionStream = Pin<Box<dyn Stream<Item = Result<AgentInstruction, Status>> + Send>>;

#[tonic::async_trait]
impl Agent for AgentService {
    type AttachStream = InstructionStream;

    async fn attach(
        &self,
        request: Request<Streaming<AgentMessage>>,
    ) -> Result<Response<Self::AttachStream>, Status> {
        let Authenticated { node, expires } = self.authenticate(&request).await?;
        let mut inbound = request.into_inner();
        let first = tokio::time::timeout(HELLO_TIMEOUT, inbound.message())
            .await
            .map_err(|_| {
                self.refuse(
                    "no_hello",
                    Status::deadline_exceeded("no AgentHello within 30 seconds"),
                )
            })??;
        let hello = match first {
            Some(AgentMessage {
                message: Some(agent_message::Message::Hello(hello)),
            }) => hello,
            _ => {
                return Err(self.refuse(
                    "no_hello",
                    Status::invalid_argument("the first message of a stream must be AgentHello"),
                ));
            }
        };
        if hello.loaded.len() > AGENT_LOADED {
            return Err(self.refuse(
                "too_many_loaded",
                Status::invalid_argument(format!(
                    "AgentHello.loaded of node {node:?} names {} modules, more than the {AGENT_LOADED} an agent may report",
                    hello.loaded.len()
                )),
            ));
        }
        if hello.node_name != node {
            return Err(self.refuse(
                "node_mismatch",
                Status::permission_denied(format!(
                    "the token is bound to node {node:?} but AgentHello.node_name is {:?}",
                    hello.node_name
                )),
            ));
        }
        self.state.update(|s| s.agent_hello(&node, &hello));
        tracing::info!(
            node,
            boot_id = hello.boot_id,
            kernel = hello.kernel_release,
            agent_version = hello.agent_version,
            loaded = hello.loaded.len(),
            "agent attached"
        );
        let (id, replaced) = self.register(&node);
        let (tx, rx) = mpsc::channel(4);
        let service = self.clone();
        // The stream lives no longer than the token that opened it; the agent reconnects
        // with the one the kubelet rotated in.
        let deadline = expires.map(|at| review_cache::instant_of(at, std::time::Instant::now()));
        let span = tracing::info_span!("agent", node = %node);
        tokio::spawn(
            async move {
                service.metrics.agents_connected.inc();
                let end = service.serve(&node, inbound, &tx, replaced, deadline).await;
                service.metrics.agents_connected.dec();
                service.unregister(&node, id);
                tracing::info!(end, "agent stream ended");
            }
            .instrument(span),
        );
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }
}

impl AgentService {
    /// Relays the node's DesiredModules down and its events up until the stream ends;
    /// returns why it ended.
    async fn serve(
        &self,
        node: &str,
        mut inbound: Streaming<AgentMessage>,
        tx: &mpsc::Sender<Result<AgentInstruction, Status>>,
        mut replaced: oneshot::Receiver<()>,
        deadline: Option<std::time::Instant>,
    ) -> &'static str {
        let mut changes = self.state.subscribe();
        let mut sent_revision = None;
        let expired = async {
            match deadline {
                Some(at) => tokio::time::sleep_until(at.into()).await,
                None => std::future::pending().await,
            }
        };
        tokio::pin!(expired);
        loop {
            changes.borrow_and_update();
            let revision = self.state.read(|s| s.desired_revision(node));
            // Revision 0 means no intents yet: the agent waits rather than getting an
            // empty list it could mistake for "nothing to run".
            if revision != 0 && sent_revision != Some(revision) {
                let desired = self.state.read(|s| s.desired_modules(node));
                sent_revision = Some(desired.revision);
                let instruction = AgentInstruction {
                    message: Some(agent_instruction::Message::Desired(desired)),
                };
                // An agent that stops reading must not hold up shutdown or its successor.
                tokio::select! {
                    sent = tx.send(Ok(instruction)) => if sent.is_err() {
                        return "agent went away";
                    } else {
                        self.metrics.work_sent.set_now();
                    },
                    () = self.cancel.cancelled() => return "proxy shutting down",
                    _ = &mut replaced => return "replaced by a newer stream",
                }
            }
            tokio::select! {
                () = self.cancel.cancelled() => {
                    let _ = tx.send(Err(Status::unavailable("kmm-spoke-proxy is shutting down"))).await;
                    return "proxy shutting down";
                }
                _ = &mut replaced => {
                    let _ = tx.send(Err(Status::aborted(format!("a newer stream for node {node:?} replaced this one")))).await;
                    return "replaced by a newer stream";
                }
                () = &mut expired => {
                    let _ = tx.send(Err(Status::unauthenticated("the agent's token expired; reconnect with the current one"))).await;
                    return "token expired";
                }
                _ = changes.changed() => {}
                message = inbound.message() => match message {
                    Ok(Some(AgentMessage { message: Some(agent_message::Message::Event(event)) })) => {
                        // An agent sends an event per load or unload attempt: a burst at
                        // start, then a trickle. One that floods is cut off, so it cannot
                        // starve the other nodes, and finds its budget spent when it
                        // reconnects.
                        if !self.events.try_take(node, std::time::Instant::now()) {
                            self.refuse("flooding", Status::resource_exhausted("too many events"));
                            let _ = tx.send(Err(Status::resource_exhausted(format!(
                                "more than {EVENTS_PER_SECOND} events a second from node {node:?}; reconnect later"
                            )))).await;
                            return "cut off for flooding";
                        }
                        self.metrics.agent_events.inc();
                        tracing::info!(
                            module = %crate::module_id::ModuleId::from_key(event.key.as_ref()),
                            action = event.action().as_str_name(),
                            outcome = event.outcome().as_str_name(),
                            version = event.version,
                            desired_revision = event.desired_revision,
                            error = truncated(&event.error, LOGGED_ERROR),
                            "agent event"
                        );
                        match self.state.update(|s| s.agent_event(node, &event)) {
                            Ok(()) => self.node_events.record(node, &event),
                            Err(refused) => {
                                self.metrics.agent_events_refused.inc();
                                tracing::warn!(error = %refused, "agent event dropped");
                            }
                        }
                    }
                    Ok(Some(_)) => tracing::debug!("unexpected message from the agent ignored"),
                    Ok(None) => return "agent closed the stream",
                    Err(_) => return "agent stream broken",
                },
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use super::*;

    #[test]
    fn a_nodes_event_budget_outlives_its_stream() {
        let budgets = EventBudgets::default();
        let start = Instant::now();
        for _ in 0..EVENT_BURST {
            assert!(budgets.try_take("n1", start));
        }
        assert!(!budgets.try_take("n1", start), "the burst is spent");
        // The agent reconnects at once: the budget is the node's, not the stream's.
        assert!(!budgets.try_take("n1", start));
        assert!(budgets.try_take("n2", start), "another node has its own");
        let later = start + Duration::from_secs(1);
        assert!(budgets.try_take("n1", later), "and it refills with time");
    }
}
