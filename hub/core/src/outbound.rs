//! What a proxy stream's outbound half must do next. Only the latest value matters, so a
//! slow proxy gets the newest snapshot rather than a backlog; but a stream's end is final:
//! a snapshot computed after it must not hide it, or neither half of the stream ever sees
//! the end and the server's graceful stop waits for that stream forever.

use std::sync::Arc;

use tokio::sync::watch;

use crate::fleet::shared_snapshot::SharedSnapshot;

#[derive(Clone, Debug, PartialEq)]
pub enum Outbound {
    Idle,
    /// The cluster's complete snapshot; the stream sends what changed since its last.
    Snapshot(Arc<SharedSnapshot>),
    /// The snapshot the proxy holds already (its hello named it): nothing is sent, and
    /// the stream's next snapshot goes as a delta from it.
    Held(Arc<SharedSnapshot>),
    /// End the stream with this gRPC status.
    End(tonic::Code, String),
}

/// The sending side of one stream's [`Outbound`]: snapshots until the first end.
#[derive(Clone, Debug)]
pub struct OutboundSender(watch::Sender<Outbound>);

impl Default for OutboundSender {
    fn default() -> Self {
        Self(watch::Sender::new(Outbound::Idle))
    }
}

impl OutboundSender {
    pub fn subscribe(&self) -> watch::Receiver<Outbound> {
        self.0.subscribe()
    }

    /// Offers the stream a newer snapshot; nothing once the stream is ending.
    pub fn snapshot(&self, snapshot: Arc<SharedSnapshot>) {
        self.offer(Outbound::Snapshot(snapshot));
    }

    /// Tells the stream what the proxy holds already; nothing once the stream is ending.
    pub fn held(&self, snapshot: Arc<SharedSnapshot>) {
        self.offer(Outbound::Held(snapshot));
    }

    fn offer(&self, next: Outbound) {
        self.0.send_if_modified(|current| {
            if matches!(current, Outbound::End(..)) {
                return false;
            }
            *current = next;
            true
        });
    }

    /// Ends the stream with this status; the first reason given is the one sent.
    pub fn end(&self, code: tonic::Code, message: impl Into<String>) {
        self.0.send_if_modified(|current| {
            if matches!(current, Outbound::End(..)) {
                return false;
            }
            *current = Outbound::End(code, message.into());
            true
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn snapshot(revision: u64) -> Arc<SharedSnapshot> {
        Arc::new(SharedSnapshot {
            revision,
            ..SharedSnapshot::default()
        })
    }

    #[test]
    fn a_snapshot_after_the_end_does_not_hide_it() {
        let sender = OutboundSender::default();
        let mut receiver = sender.subscribe();
        sender.snapshot(snapshot(1));
        assert!(matches!(&*receiver.borrow_and_update(), Outbound::Snapshot(s) if s.revision == 1));
        sender.end(tonic::Code::Unavailable, "the hub is shutting down");
        sender.snapshot(snapshot(2));
        assert!(receiver.has_changed().unwrap());
        assert_eq!(
            *receiver.borrow_and_update(),
            Outbound::End(tonic::Code::Unavailable, "the hub is shutting down".into())
        );
    }

    #[test]
    fn the_first_end_is_the_one_sent() {
        let sender = OutboundSender::default();
        let receiver = sender.subscribe();
        sender.end(tonic::Code::Aborted, "replaced by a newer stream");
        sender.end(tonic::Code::Unavailable, "the hub is shutting down");
        assert_eq!(
            *receiver.borrow(),
            Outbound::End(tonic::Code::Aborted, "replaced by a newer stream".into())
        );
    }
}
