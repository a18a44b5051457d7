//! The cluster's kernel inventory for the hub: distinct kernel releases, how many nodes
//! run each and their most common OS image, revisioned so a late duplicate is
//! recognised. Pure.

use std::collections::BTreeMap;

use kmm_proto::v1::{Kernel, KernelInventory};

use crate::node_facts::NodeFacts;

/// Distinct kernels of `nodes`, sorted by release. Nodes whose kubelet has not reported
/// a kernel yet are left out: there is nothing to resolve for them.
pub fn kernels<'a>(nodes: impl IntoIterator<Item = &'a NodeFacts>) -> Vec<Kernel> {
    let mut by_kernel: BTreeMap<&str, BTreeMap<&str, u32>> = BTreeMap::new();
    for node in nodes {
        if node.kernel.is_empty() {
            continue;
        }
        *by_kernel
            .entry(&node.kernel)
            .or_default()
            .entry(&node.os_image)
            .or_default() += 1;
    }
    by_kernel
        .into_iter()
        .map(|(release, images)| {
            // Ties go to the first image in lexical order, so the answer is stable.
            let (os_image, _) = images.iter().fold(("", 0), |best, (image, count)| {
                if *count > best.1 {
                    (*image, *count)
                } else {
                    best
                }
            });
            Kernel {
                release: release.to_owned(),
                os_image: os_image.to_owned(),
                node_count: images.values().sum(),
            }
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

    fn node(name: &str, kernel: &str, os: &str) -> NodeFacts {
        NodeFacts {
            name: name.into(),
            kernel: kernel.into(),
            os_image: os.into(),
            ..Default::default()
        }
    }

    #[test]
    fn counts_distinct_kernels_with_most_common_os_image() {
        let nodes = [
            node("a", "6.1", "Debian 12"),
            node("b", "6.1", "Debian 12"),
            node("c", "6.1", "Debian 12 custom"),
            node("d", "5.14", "RHEL 9"),
            node("e", "", "unknown yet"),
        ];
        assert_eq!(
            kernels(&nodes),
            vec![
                Kernel {
                    release: "5.14".into(),
                    os_image: "RHEL 9".into(),
                    node_count: 1
                },
                Kernel {
                    release: "6.1".into(),
                    os_image: "Debian 12".into(),
                    node_count: 3
                },
            ]
        );
    }

    #[test]
    fn ties_pick_the_lexically_first_image() {
        let nodes = [node("a", "6.1", "Zeta"), node("b", "6.1", "Alpha")];
        assert_eq!(kernels(&nodes)[0].os_image, "Alpha");
        assert!(kernels(&[]).is_empty());
    }

    #[test]
    fn revision_moves_only_on_change() {
        let mut inventory = Inventory::new(100);
        assert_eq!(inventory.message().revision, 100);
        assert!(!inventory.update(Vec::new()), "empty to empty is no change");
        let one = kernels(&[node("a", "6.1", "D")]);
        assert!(inventory.update(one.clone()));
        assert_eq!(inventory.message().revision, 101);
        assert!(!inventory.update(one));
        assert_eq!(inventory.message().revision, 101);
        assert!(inventory.update(kernels(&[node("a", "6.2", "D")])));
        assert_eq!(inventory.message().revision, 102);
        assert_eq!(inventory.message().kernels[0].release, "6.2");
    }
}
