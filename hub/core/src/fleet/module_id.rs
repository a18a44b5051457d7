//! A module's key in a cluster's per-module maps, `(spokeNamespace, module name)`, and a
//! way to look it up by borrowed strings. A module's status is counted over every node of
//! every cluster, up to ten times a second while reports stream in: building an owned key
//! (two allocations) per lookup was a sixth of the hub's CPU in a fleet-wide event, and
//! comparing keys whose text lived elsewhere on the heap (a cache miss per comparison, a
//! dozen per lookup) was most of a count at 3,500 clusters. Names up to 24 bytes are held
//! in the key itself, so a lookup reads only the map's nodes.

use std::borrow::Borrow;
use std::cmp::Ordering;

use compact_str::CompactString;

/// `(spokeNamespace, module name)`.
pub type ModuleId = (CompactString, CompactString);

/// The key of module `namespace/name`.
pub fn module_id(namespace: &str, name: &str) -> ModuleId {
    (namespace.into(), name.into())
}

/// A module key, owned or borrowed, as maps keyed by [`ModuleId`] compare it.
pub trait ModuleIdRef {
    fn parts(&self) -> (&str, &str);
}

impl ModuleIdRef for ModuleId {
    fn parts(&self) -> (&str, &str) {
        (&self.0, &self.1)
    }
}

impl ModuleIdRef for (&str, &str) {
    fn parts(&self) -> (&str, &str) {
        (self.0, self.1)
    }
}

// Ordered as `ModuleId` orders (field by field, `CompactString` as `str`), as `Borrow`
// requires.
impl<'a> Borrow<dyn ModuleIdRef + 'a> for ModuleId {
    fn borrow(&self) -> &(dyn ModuleIdRef + 'a) {
        self
    }
}

impl PartialEq for dyn ModuleIdRef + '_ {
    fn eq(&self, other: &Self) -> bool {
        self.parts() == other.parts()
    }
}

impl Eq for dyn ModuleIdRef + '_ {}

impl PartialOrd for dyn ModuleIdRef + '_ {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for dyn ModuleIdRef + '_ {
    fn cmp(&self, other: &Self) -> Ordering {
        self.parts().cmp(&other.parts())
    }
}

/// The lookup key of `namespace/name` in a map keyed by [`ModuleId`].
pub fn module_key<'a>(key: &'a (&'a str, &'a str)) -> &'a (dyn ModuleIdRef + 'a) {
    key
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;

    #[test]
    fn borrowed_lookups_find_what_owned_keys_hold_and_nothing_else() {
        let long = "a-namespace-longer-than-twenty-four-bytes";
        let ids = [("a", "m"), ("a", "n"), ("b", "m"), ("ab", ""), (long, "m")];
        let map: BTreeMap<ModuleId, usize> = ids
            .iter()
            .enumerate()
            .map(|(i, (ns, name))| (module_id(ns, name), i))
            .collect();
        for (i, (ns, name)) in ids.iter().enumerate() {
            assert_eq!(map.get(module_key(&(ns, name))), Some(&i));
        }
        // A namespace and name that concatenate alike are still different modules.
        assert_eq!(map.get(module_key(&("a", "bm"))), None);
        assert_eq!(map.get(module_key(&("", "am"))), None);
        // Ordered as the strings are, whether held inline or not.
        let order: Vec<_> = map
            .keys()
            .map(|(ns, name)| (ns.as_str(), name.as_str()))
            .collect();
        let mut sorted = ids.to_vec();
        sorted.sort_unstable();
        assert_eq!(order, sorted);
    }
}
