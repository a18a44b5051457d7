//! What a proxy's kernel inventory may say. Pure.
//!
//! Every kernel a cluster names is resolved for every module, and a templated image
//! becomes one image to check per kernel: the kernels are the proxy's lever on the hub's
//! work and memory, so they are validated and counted before anything keeps them.

use std::collections::BTreeSet;

use kmm_proto::limits::{INVENTORY_KERNELS, KERNEL_RELEASE, truncated, valid_kernel_release};
use kmm_proto::v1::KernelInventory;

/// An inventory refused whole: which field broke which limit.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum InventoryRefused {
    #[error(
        "KernelInventory.kernels names {count} distinct kernels, more than the {INVENTORY_KERNELS} a cluster may report"
    )]
    TooManyKernels { count: usize },
    #[error(
        "KernelInventory.kernels[].release {release:?} is not a kernel release (1 to {KERNEL_RELEASE} bytes of letters, digits and . - _ + ~)"
    )]
    InvalidKernel {
        /// The offending release, cut so that the error stays small.
        release: String,
    },
}

impl InventoryRefused {
    /// The limit's name, for the metric counting refusals.
    pub fn limit(&self) -> &'static str {
        match self {
            Self::TooManyKernels { .. } => "inventory_kernels",
            Self::InvalidKernel { .. } => "kernel_release",
        }
    }
}

/// The distinct kernels `inventory` names, once each is a valid release and there are at
/// most [`INVENTORY_KERNELS`] of them.
pub fn kernels(inventory: KernelInventory) -> Result<BTreeSet<String>, InventoryRefused> {
    let mut kernels = BTreeSet::new();
    for kernel in inventory.kernels {
        if !valid_kernel_release(&kernel.release) {
            return Err(InventoryRefused::InvalidKernel {
                release: truncated(&kernel.release, KERNEL_RELEASE + 1).to_owned(),
            });
        }
        kernels.insert(kernel.release);
        if kernels.len() > INVENTORY_KERNELS {
            return Err(InventoryRefused::TooManyKernels {
                count: kernels.len(),
            });
        }
    }
    Ok(kernels)
}

#[cfg(test)]
mod tests {
    use kmm_proto::v1::Kernel;

    use super::*;

    fn inventory<S: Into<String>>(releases: impl IntoIterator<Item = S>) -> KernelInventory {
        KernelInventory {
            revision: 1,
            kernels: releases
                .into_iter()
                .map(|r| Kernel { release: r.into() })
                .collect(),
        }
    }

    #[test]
    fn distinct_valid_kernels_are_kept() {
        let kept = kernels(inventory([
            "6.1.0-13-amd64",
            "6.1.21-v8+",
            "6.1.0-13-amd64",
        ]));
        assert_eq!(
            kept.unwrap(),
            BTreeSet::from(["6.1.0-13-amd64".to_owned(), "6.1.21-v8+".to_owned()])
        );
        let at_most = (0..INVENTORY_KERNELS).map(|i| format!("6.1.{i}"));
        assert_eq!(
            kernels(inventory(at_most)).unwrap().len(),
            INVENTORY_KERNELS
        );
    }

    #[test]
    fn an_inventory_naming_too_many_kernels_is_refused_by_field_and_limit() {
        let flood = (0..=INVENTORY_KERNELS).map(|i| format!("6.1.{i}"));
        let refused = kernels(inventory(flood)).unwrap_err();
        assert_eq!(
            refused,
            InventoryRefused::TooManyKernels {
                count: INVENTORY_KERNELS + 1
            }
        );
        let said = refused.to_string();
        assert!(
            said.contains("KernelInventory.kernels") && said.contains("256"),
            "{said}"
        );
    }

    #[test]
    fn a_release_no_kernel_has_is_refused_and_named_briefly() {
        let huge = "6".repeat(1 << 20);
        let refused = kernels(inventory(["6.1", huge.as_str()])).unwrap_err();
        assert!(
            matches!(&refused, InventoryRefused::InvalidKernel { release } if release.len() == KERNEL_RELEASE + 1),
            "{refused:?}"
        );
        assert!(kernels(inventory(["6.1 && rm -rf /"])).is_err());
        assert!(kernels(inventory([""])).is_err());
    }
}
