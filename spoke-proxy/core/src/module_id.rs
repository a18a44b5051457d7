//! An ordered, hashable module identity (the proto `ModuleKey` is neither). Pure.

use std::fmt;
use std::sync::Arc;

use kmm_proto::v1::ModuleKey;

/// A module on this cluster: the ManagedClusterModule's spokeNamespace and name. Cloning
/// shares the text: every node's work keys its modules with clones of one identity.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ModuleId {
    pub namespace: Arc<str>,
    pub name: Arc<str>,
}

impl ModuleId {
    /// The identity in `key`; a missing key is the empty identity, which no intent has.
    pub fn from_key(key: Option<&ModuleKey>) -> Self {
        key.map_or_else(
            || Self {
                namespace: "".into(),
                name: "".into(),
            },
            |k| Self {
                namespace: k.namespace.as_str().into(),
                name: k.name.as_str().into(),
            },
        )
    }

    pub fn key(&self) -> ModuleKey {
        ModuleKey {
            namespace: self.namespace.to_string(),
            name: self.name.to_string(),
        }
    }
}

impl fmt::Display for ModuleId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_through_the_proto_key() {
        let id = ModuleId {
            namespace: "ns".into(),
            name: "m".into(),
        };
        assert_eq!(ModuleId::from_key(Some(&id.key())), id);
        assert_eq!(id.to_string(), "ns/m");
        assert_eq!(ModuleId::from_key(None).to_string(), "/");
    }
}
