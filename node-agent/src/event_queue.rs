//! The agent's events on their way to the control plane: bounded whatever the time spent
//! disconnected. A newer event of a module replaces its older one still waiting (the
//! control plane acts on the latest outcome per module), and past [`CAPACITY`] modules
//! the oldest waiting event goes.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use tokio::sync::Notify;

use crate::control::AgentEvent;

/// Modules with an event waiting, at most.
pub const CAPACITY: usize = 1024;

#[derive(Debug, Default)]
struct Waiting {
    /// Module keys, oldest first; each has one event in `latest`.
    order: VecDeque<String>,
    latest: HashMap<String, AgentEvent>,
    senders: usize,
    receiver_gone: bool,
}

#[derive(Debug, Default)]
struct Shared {
    waiting: Mutex<Waiting>,
    notify: Notify,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Waiting> {
        self.waiting.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// The sending half; clones share the queue.
#[derive(Debug)]
pub struct EventSender(Arc<Shared>);

/// The receiving half.
#[derive(Debug)]
pub struct EventReceiver(Arc<Shared>);

/// The receiver is gone: nobody takes events any more.
#[derive(Debug, PartialEq, Eq)]
pub struct Closed;

/// A new, empty queue.
pub fn event_queue() -> (EventSender, EventReceiver) {
    let shared = Arc::new(Shared::default());
    shared.lock().senders = 1;
    (EventSender(shared.clone()), EventReceiver(shared))
}

impl EventSender {
    /// Queues `event`, replacing a waiting one of the same module.
    pub fn send(&self, event: AgentEvent) -> Result<(), Closed> {
        let mut waiting = self.0.lock();
        if waiting.receiver_gone {
            return Err(Closed);
        }
        let key = event.key.clone();
        if waiting.latest.insert(key.clone(), event).is_none() {
            waiting.order.push_back(key);
            while waiting.order.len() > CAPACITY {
                if let Some(oldest) = waiting.order.pop_front() {
                    waiting.latest.remove(&oldest);
                }
            }
        }
        drop(waiting);
        self.0.notify.notify_one();
        Ok(())
    }
}

impl Clone for EventSender {
    fn clone(&self) -> Self {
        self.0.lock().senders += 1;
        Self(self.0.clone())
    }
}

impl Drop for EventSender {
    fn drop(&mut self) {
        self.0.lock().senders -= 1;
        self.0.notify.notify_one();
    }
}

impl EventReceiver {
    /// The oldest waiting event; `None` once every sender is gone and nothing waits.
    pub async fn recv(&mut self) -> Option<AgentEvent> {
        loop {
            {
                let mut waiting = self.0.lock();
                if let Some(key) = waiting.order.pop_front() {
                    return waiting.latest.remove(&key);
                }
                if waiting.senders == 0 {
                    return None;
                }
            }
            self.0.notify.notified().await;
        }
    }

    /// How many modules have an event waiting.
    pub fn len(&self) -> usize {
        self.0.lock().order.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl Drop for EventReceiver {
    fn drop(&mut self) {
        self.0.lock().receiver_gone = true;
    }
}

#[cfg(test)]
mod tests {
    use std::pin::{Pin, pin};
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::task::{Context, Poll, Wake, Waker};

    use super::*;
    use crate::control::{EventAction, Outcome};

    fn event(key: &str, outcome: Outcome) -> AgentEvent {
        AgentEvent {
            key: key.into(),
            version: None,
            action: EventAction::Load,
            outcome,
            image: "i".into(),
            digest: None,
            pull_ms: 0,
            duration_ms: 0,
            at_unix_ms: 0,
            revision: 1,
            kept: vec![],
            timing: Default::default(),
        }
    }

    #[tokio::test]
    async fn a_newer_event_of_a_module_replaces_the_waiting_one_in_its_place() {
        let (tx, mut rx) = event_queue();
        tx.send(event("a", Outcome::Failure("1".into()))).unwrap();
        tx.send(event("b", Outcome::Success)).unwrap();
        tx.send(event("a", Outcome::Success)).unwrap();
        assert_eq!(rx.len(), 2);
        assert_eq!(rx.recv().await, Some(event("a", Outcome::Success)));
        assert_eq!(rx.recv().await, Some(event("b", Outcome::Success)));
        drop(tx);
        assert_eq!(rx.recv().await, None);
    }

    #[tokio::test]
    async fn the_queue_stays_bounded_however_long_nobody_reads() {
        let (tx, mut rx) = event_queue();
        for round in 0..3 {
            for i in 0..(CAPACITY + 10) {
                tx.send(event(&format!("m{i}"), Outcome::Failure(round.to_string())))
                    .unwrap();
            }
        }
        assert_eq!(rx.len(), CAPACITY);
        let first = rx.recv().await.unwrap();
        assert_eq!(first.key, "m10", "the oldest modules' events went first");
    }

    /// A waker that remembers being woken. Awaiting in a test polls again anyway; in the
    /// agent only the wake brings a parked receiver back.
    #[derive(Default)]
    struct Woken(AtomicBool);

    impl Wake for Woken {
        fn wake(self: Arc<Self>) {
            self.0.store(true, Ordering::SeqCst);
        }
    }

    impl Woken {
        fn poll<F: Future>(self: &Arc<Self>, future: Pin<&mut F>) -> Poll<F::Output> {
            let waker = Waker::from(self.clone());
            future.poll(&mut Context::from_waker(&waker))
        }

        fn take(&self) -> bool {
            self.0.swap(false, Ordering::SeqCst)
        }
    }

    #[test]
    fn a_waiting_receiver_is_woken_by_a_send_and_by_the_senders_going() {
        let (tx, mut rx) = event_queue();
        let other = tx.clone();
        let woken = Arc::new(Woken::default());
        {
            let mut next = pin!(rx.recv());
            assert!(woken.poll(next.as_mut()).is_pending(), "nothing sent yet");
            other.send(event("a", Outcome::Success)).unwrap();
            assert!(woken.take(), "the send wakes the waiting receiver");
            assert_eq!(
                woken.poll(next.as_mut()),
                Poll::Ready(Some(event("a", Outcome::Success)))
            );
        }
        let mut end = pin!(rx.recv());
        assert!(woken.poll(end.as_mut()).is_pending());
        drop(tx);
        assert!(woken.take(), "a sender going wakes the receiver");
        assert!(woken.poll(end.as_mut()).is_pending(), "one sender is left");
        drop(other);
        assert!(woken.take(), "the last sender going wakes the receiver");
        assert_eq!(woken.poll(end.as_mut()), Poll::Ready(None));
    }

    #[test]
    fn sending_after_the_receiver_went_fails() {
        let (tx, rx) = event_queue();
        drop(rx);
        assert_eq!(tx.send(event("a", Outcome::Success)), Err(Closed));
    }
}
