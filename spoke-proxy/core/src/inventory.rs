//! The cluster's kernel inventory for the hub: its distinct kernel releases, revisioned
//! so a late duplicate is recognised. Pure.

use std::collections::BTreeSet;

use kmm_proto::v1::{Kernel, KernelInventory};

use crate::node_facts::NodeFacts;

/// Distinct kernels of `nodes`, sorted by release. Nodes whose kubelet has not reported
/// a kernel yet are left out: there is nothing to resolve for them.
pub fn kernels<'a>(nodes: impl IntoIterator<Item = &'a NodeFacts>) -> Vec<Kernel> {
    nodes
        .into_iter()
        .map(|node| node.kernel.as_str())
        .filter(|kernel| !kernel.is_empty())
        .collect::<BTreeSet<_>>()
        .into_iter()
        .map(|release| Kernel {
            release: release.to_owned(),
        })
        .collect()
}

/// The last inventory and its revision.
#[derive(Clone, Debug)]
pub struct Inventory {
    revision: u64,
    kernels: Vec<Kernel>,
}

impl Inventory {
    /// Starts at `initial_revision`, which the caller takes from the clock so a
    /// restarted proxy never goes back to a revision the hub already saw.
    pub fn new(initial_revision: u64) -> Self {
        Self {
            revision: initial_revision,
            kernels: Vec::new(),
        }
    }

    /// Records `kernels`; bumps the revision and returns true only if they changed.
    pub fn update(&mut self, kernels: Vec<Kernel>) -> bool {
        if kernels == self.kernels {
            return false;
        }
        self.kernels = kernels;
        self.revision += 1;
        true
    }

    pub fn message(&self) -> KernelInventory {
        KernelInventory {
            revision: self.revision,
            kernels: self.kernels.clone(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(name: &str, kernel: &str) -> NodeFacts {
        NodeFacts {
            name: name.into(),
            kernel: kernel.into(),
            ..Default::default()
        }
    }

    fn releases(kernels: &[Kernel]) -> Vec<&str> {
        kernels.iter().map(|k| k.release.as_str()).collect()
    }

    #[test]
    fn lists_each_reported_kernel_once_sorted() {
        let nodes = [
            node("a", "6.1"),
            node("b", "6.1"),
            node("c", "5.14"),
            node("d", ""),
        ];
        assert_eq!(releases(&kernels(&nodes)), ["5.14", "6.1"]);
        assert!(kernels(&[]).is_empty());
    }

    #[test]
    fn revision_moves_only_on_change() {
        let mut inventory = Inventory::new(100);
        assert_eq!(inventory.message().revision, 100);
        assert!(!inventory.update(Vec::new()), "empty to empty is no change");
        let one = kernels(&[node("a", "6.1")]);
        assert!(inventory.update(one.clone()));
        assert_eq!(inventory.message().revision, 101);
        assert!(!inventory.update(one));
        assert!(
            !inventory.update(kernels(&[node("a", "6.1"), node("b", "6.1")])),
            "another node on a known kernel changes nothing"
        );
        assert_eq!(inventory.message().revision, 101);
        assert!(inventory.update(kernels(&[node("a", "6.2")])));
        assert_eq!(inventory.message().revision, 102);
        assert_eq!(releases(&inventory.message().kernels), ["6.2"]);
    }
}
