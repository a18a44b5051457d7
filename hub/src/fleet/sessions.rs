//! One live stream per cluster, the newest wins. Pure bookkeeping: the runtime keeps a
//! handle per stream (its outbound channel) and ends the handle this returns as replaced.

use std::collections::BTreeMap;

/// Identifies one stream among all the streams the hub has accepted.
pub type SessionId = u64;

/// The current stream of every connected cluster.
#[derive(Debug)]
pub struct Sessions<H> {
    next_id: SessionId,
    current: BTreeMap<String, (SessionId, H)>,
}

impl<H> Default for Sessions<H> {
    fn default() -> Self {
        Self {
            next_id: 1,
            current: BTreeMap::new(),
        }
    }
}

impl<H> Sessions<H> {
    /// Makes a new stream the cluster's current one; returns its id and the handle of
    /// the stream it replaces, which the caller must end.
    pub fn open(&mut self, cluster: &str, handle: H) -> (SessionId, Option<H>) {
        let id = self.next_id;
        self.next_id += 1;
        let replaced = self
            .current
            .insert(cluster.to_owned(), (id, handle))
            .map(|(_, h)| h);
        (id, replaced)
    }

    /// Ends a stream. Only the current stream's end disconnects the cluster: a replaced
    /// stream ending late must not drop its successor. Returns whether it was current.
    pub fn close(&mut self, cluster: &str, id: SessionId) -> bool {
        if self.is_current(cluster, id) {
            self.current.remove(cluster);
            true
        } else {
            false
        }
    }

    pub fn is_current(&self, cluster: &str, id: SessionId) -> bool {
        self.current
            .get(cluster)
            .is_some_and(|(current, _)| *current == id)
    }

    /// The current stream's handle.
    pub fn get(&self, cluster: &str) -> Option<&H> {
        self.current.get(cluster).map(|(_, h)| h)
    }

    pub fn is_connected(&self, cluster: &str) -> bool {
        self.current.contains_key(cluster)
    }

    pub fn connected(&self) -> impl Iterator<Item = &str> {
        self.current.keys().map(String::as_str)
    }

    pub fn len(&self) -> usize {
        self.current.len()
    }

    pub fn is_empty(&self) -> bool {
        self.current.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn newest_stream_wins_and_a_late_end_of_the_old_one_is_harmless() {
        let mut sessions = Sessions::default();
        let (first, replaced) = sessions.open("spoke1", "first");
        assert_eq!(replaced, None);
        let (second, replaced) = sessions.open("spoke1", "second");
        assert_eq!(replaced, Some("first"));
        assert_ne!(first, second);
        assert!(!sessions.is_current("spoke1", first));
        assert!(
            !sessions.close("spoke1", first),
            "old stream is no longer current"
        );
        assert!(sessions.is_connected("spoke1"));
        assert_eq!(sessions.get("spoke1"), Some(&"second"));
        assert!(sessions.close("spoke1", second));
        assert!(!sessions.is_connected("spoke1"));
        assert!(sessions.is_empty());
    }

    #[test]
    fn clusters_are_independent() {
        let mut sessions = Sessions::default();
        let (a, _) = sessions.open("spoke1", 1);
        let (b, replaced) = sessions.open("spoke2", 2);
        assert_eq!(replaced, None);
        assert!(!sessions.is_current("spoke2", a));
        assert!(
            !sessions.close("spoke1", b),
            "an id closes only its own cluster"
        );
        assert_eq!(
            sessions.connected().collect::<Vec<_>>(),
            ["spoke1", "spoke2"]
        );
        assert_eq!(sessions.get("spoke2"), Some(&2));
        assert_eq!(sessions.len(), 2);
    }
}
