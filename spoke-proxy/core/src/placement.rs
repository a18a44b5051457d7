//! Which intent applies to one node: node selector, tolerations against the node's
//! taints, then the kernel target for the node's kernel, provided its agent runs that
//! kernel too. Pure.

use std::collections::BTreeMap;
use std::sync::Arc;

use kmm_proto::v1::{ModuleIntent, ModuleLoad, Unresolved, kernel_target::Target};

use crate::node_facts::NodeFacts;
use crate::node_upgrade::Hold;
use crate::tolerations::{TaintVerdict, verdict};

/// What one module means for one node.
#[derive(Clone, Debug, PartialEq)]
pub enum Placement {
    /// The node must run this load (shared with the other nodes given the same).
    Load(Arc<ModuleLoad>),
    /// The node is selected but no image resolves for its kernel.
    Unresolved(Unresolved),
    /// The node is selected but the hub has not resolved its kernel (yet).
    AwaitingKernel,
    /// The node is selected and its kernel resolved, but its agent runs another kernel
    /// than the kubelet reports: the image resolved for the kubelet's may not fit the
    /// running one, so nothing is loaded until they agree (and nothing is unloaded).
    KernelMismatch { kubelet: String, agent: String },
    /// The module must leave the node: the hub asked for it, or the node is no longer
    /// selected while the module may still be on it.
    Unload,
    /// The module is not for this node and never was: nothing to do or report.
    NotApplicable,
    /// The node runs another version and keeps it until its turn (ordered upgrade).
    Held(Box<Held>),
    /// No kernel mapping matches the node's kernel: the module does not apply there.
    Skipped(Unresolved),
    /// The module loads nothing (its intent's `device_plugin_only`): the node runs its
    /// device plugin, whatever its kernel.
    DevicePluginOnly,
}

/// The reason the hub gives a kernel no mapping of the module matches.
pub const NO_KERNEL_MAPPING: &str = "NoKernelMapping";

/// A node kept at the version it runs while the module moves to another.
#[derive(Clone, Debug, PartialEq)]
pub struct Held {
    pub hold: Hold,
    /// The version the agent proved loaded, if any.
    pub running: Option<String>,
    /// The version the intent loads.
    pub target: String,
    /// The load this proxy last gave the node for the running version, sent again so the
    /// agent keeps it; `None` (e.g. after a proxy restart) sends nothing, and an agent
    /// leaves a module it is not told about as it is.
    pub keep: Option<Arc<ModuleLoad>>,
}

impl Placement {
    /// Whether the node is meant to run the module (whatever the kernel target).
    pub fn is_selected(&self) -> bool {
        matches!(
            self,
            Self::Load(_)
                | Self::Unresolved(_)
                | Self::AwaitingKernel
                | Self::KernelMismatch { .. }
                | Self::Held(_)
                | Self::DevicePluginOnly
        )
    }
}

/// Whether `selector` (matchLabels semantics; empty selects every node) selects `labels`.
pub fn selects(selector: &BTreeMap<String, String>, labels: &BTreeMap<String, String>) -> bool {
    selector
        .iter()
        .all(|(key, value)| labels.get(key) == Some(value))
}

/// Places `intent` on `node`. `may_have_it` says whether the module may be on the node
/// (placed there earlier, or reported loaded by its agent): a node that stops matching
/// gets an explicit unload only then, so no unload is sent for a module never there.
pub fn place(intent: &ModuleIntent, node: &NodeFacts, may_have_it: bool) -> Placement {
    if intent.unload {
        return Placement::Unload;
    }
    let taints = verdict(&intent.tolerations, &node.taints);
    let excluded = !selects(&intent.node_selector, &node.labels)
        || matches!(taints, TaintVerdict::Excludes(_));
    if excluded {
        return if may_have_it {
            Placement::Unload
        } else {
            Placement::NotApplicable
        };
    }
    // A node Kubernetes itself marks (NotReady, unreachable, ...) keeps what it has but
    // starts nothing new.
    if matches!(taints, TaintVerdict::HoldsNewLoads(_)) && !may_have_it {
        return Placement::NotApplicable;
    }
    if intent.device_plugin_only {
        return Placement::DevicePluginOnly;
    }
    if node.kernel.is_empty() {
        return Placement::AwaitingKernel;
    }
    match intent
        .kernels
        .iter()
        .find(|k| k.kernel == node.kernel)
        .and_then(|k| k.target.as_ref())
    {
        Some(Target::Load(load)) => Placement::Load(Arc::new(load.clone())),
        // Like a node the selector leaves out: skipped, and unloaded first when the module
        // may be there (its mappings changed).
        Some(Target::Unresolved(unresolved)) if unresolved.reason == NO_KERNEL_MAPPING => {
            if may_have_it {
                Placement::Unload
            } else {
                Placement::Skipped(unresolved.clone())
            }
        }
        Some(Target::Unresolved(unresolved)) => Placement::Unresolved(unresolved.clone()),
        // The cluster resolves the image for the hub first (`spoke_images`): nothing is
        // loaded before the hub pins the digest it found. While its last answer failed,
        // the nodes say why.
        Some(Target::Resolve(resolution)) => match &resolution.failed {
            Some(failed) => Placement::Unresolved(failed.clone()),
            None => Placement::AwaitingKernel,
        },
        None => Placement::AwaitingKernel,
    }
}

/// `placement` on a node whose agent said it runs `agent_kernel` (empty when it has not
/// said hello, or did not say): a load resolved for the kubelet's `kubelet_kernel` becomes
/// [`Placement::KernelMismatch`] when the two differ. The kubelet's kernel decides what
/// is resolved; the agent's only stops a load that may not fit.
pub fn check_agent_kernel(
    placement: Placement,
    kubelet_kernel: &str,
    agent_kernel: &str,
) -> Placement {
    match placement {
        Placement::Load(_) if !agent_kernel.is_empty() && agent_kernel != kubelet_kernel => {
            Placement::KernelMismatch {
                kubelet: kubelet_kernel.to_owned(),
                agent: agent_kernel.to_owned(),
            }
        }
        other => other,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::node_facts::Taint;
    use kmm_proto::v1::{KernelTarget, ModuleKey, Toleration};

    fn load(image: &str) -> ModuleLoad {
        ModuleLoad {
            image: image.into(),
            version: "1".into(),
            ..Default::default()
        }
    }

    fn intent() -> ModuleIntent {
        ModuleIntent {
            key: Some(ModuleKey {
                namespace: "ns".into(),
                name: "m".into(),
            }),
            generation: 1,
            pin_generation: 0,
            node_selector: [("role".to_string(), "worker".to_string())].into(),
            tolerations: vec![],
            kernels: vec![
                KernelTarget {
                    kernel: "6.1".into(),
                    target: Some(Target::Load(load("reg/m:6.1"))),
                },
                KernelTarget {
                    kernel: "6.2".into(),
                    target: Some(Target::Load(load("reg/m:6.2"))),
                },
                KernelTarget {
                    kernel: "5.14".into(),
                    target: Some(Target::Unresolved(Unresolved {
                        reason: "NoKernelMapping".into(),
                        message: "no mapping matches 5.14".into(),
                    })),
                },
            ],
            unload: false,
            max_unavailable: None,
            device_plugin: None,
            device_plugin_only: false,
        }
    }

    fn node(kernel: &str) -> NodeFacts {
        NodeFacts {
            name: "n".into(),
            kernel: kernel.into(),
            labels: [("role".to_string(), "worker".to_string())].into(),
            ..Default::default()
        }
    }

    #[test]
    fn selected_node_gets_the_image_of_its_kernel() {
        assert_eq!(
            place(&intent(), &node("6.1"), false),
            Placement::Load(Arc::new(load("reg/m:6.1")))
        );
    }

    #[test]
    fn a_kernel_no_mapping_matches_is_skipped_and_unloaded_first_if_the_module_may_be_there() {
        let Placement::Skipped(why) = place(&intent(), &node("5.14"), false) else {
            panic!("skipped")
        };
        assert_eq!(why.reason, NO_KERNEL_MAPPING);
        assert!(!Placement::Skipped(why).is_selected());
        assert_eq!(place(&intent(), &node("5.14"), true), Placement::Unload);
    }

    #[test]
    fn kernel_change_switches_the_image() {
        assert_eq!(
            place(&intent(), &node("6.2"), true),
            Placement::Load(Arc::new(load("reg/m:6.2")))
        );
    }

    #[test]
    fn unresolved_kernel_carries_the_hubs_reason() {
        let mut intent = intent();
        intent.kernels[2].target = Some(Target::Unresolved(Unresolved {
            reason: "ImageNotFound".into(),
            message: "reg/m:5.14: manifest unknown".into(),
        }));
        let Placement::Unresolved(u) = place(&intent, &node("5.14"), false) else {
            panic!("expected unresolved");
        };
        assert_eq!(u.reason, "ImageNotFound");
        assert_eq!(u.message, "reg/m:5.14: manifest unknown");
    }

    #[test]
    fn an_image_the_cluster_resolves_waits_and_shows_its_last_failure() {
        let mut intent = intent();
        let resolution = |failed| {
            Some(Target::Resolve(kmm_proto::v1::ImageResolution {
                load: Some(load("spoke-only/m:5.14")),
                image_generation: 0,
                failed,
            }))
        };
        intent.kernels[2].target = resolution(None);
        assert_eq!(
            place(&intent, &node("5.14"), false),
            Placement::AwaitingKernel
        );
        let failed = Unresolved {
            reason: "ClusterPullSecretInvalid".into(),
            message: "kernel 5.14: the cluster's pull Secret kmm/pull ...".into(),
        };
        intent.kernels[2].target = resolution(Some(failed.clone()));
        assert_eq!(
            place(&intent, &node("5.14"), false),
            Placement::Unresolved(failed)
        );
    }

    #[test]
    fn kernel_unknown_to_the_hub_or_unreported_waits() {
        assert_eq!(
            place(&intent(), &node("7.0"), false),
            Placement::AwaitingKernel
        );
        assert_eq!(
            place(&intent(), &node(""), false),
            Placement::AwaitingKernel
        );
        let mut no_target = intent();
        no_target.kernels[0].target = None;
        assert_eq!(
            place(&no_target, &node("6.1"), false),
            Placement::AwaitingKernel
        );
    }

    #[test]
    fn selector_must_match_every_label() {
        let mut n = node("6.1");
        n.labels.insert("role".into(), "infra".into());
        assert_eq!(place(&intent(), &n, false), Placement::NotApplicable);
        n.labels.clear();
        assert_eq!(place(&intent(), &n, false), Placement::NotApplicable);
        let mut all = intent();
        all.node_selector.clear();
        assert!(place(&all, &n, false).is_selected());
    }

    #[test]
    fn deselection_unloads_only_where_the_module_may_be() {
        let mut n = node("6.1");
        n.labels.clear();
        assert_eq!(place(&intent(), &n, true), Placement::Unload);
        assert_eq!(place(&intent(), &n, false), Placement::NotApplicable);
    }

    #[test]
    fn untolerated_taint_keeps_the_module_off() {
        let mut n = node("6.1");
        n.taints.push(Taint {
            key: "dedicated".into(),
            value: "gpu".into(),
            effect: "NoSchedule".into(),
        });
        assert_eq!(place(&intent(), &n, false), Placement::NotApplicable);
        assert_eq!(place(&intent(), &n, true), Placement::Unload);
        let mut tolerant = intent();
        tolerant.tolerations.push(Toleration {
            key: "dedicated".into(),
            operator: "Equal".into(),
            value: "gpu".into(),
            effect: "NoSchedule".into(),
        });
        assert_eq!(
            place(&tolerant, &n, false),
            Placement::Load(Arc::new(load("reg/m:6.1")))
        );
    }

    #[test]
    fn a_node_kubernetes_marks_unready_keeps_its_module_but_starts_none() {
        for (key, effect) in [
            ("node.kubernetes.io/not-ready", "NoExecute"),
            ("node.kubernetes.io/unreachable", "NoExecute"),
            ("node.kubernetes.io/not-ready", "NoSchedule"),
            ("node.kubernetes.io/network-unavailable", "NoSchedule"),
            ("node.kubernetes.io/memory-pressure", "NoExecute"),
        ] {
            let mut n = node("6.1");
            n.taints.push(Taint {
                key: key.into(),
                value: String::new(),
                effect: effect.into(),
            });
            assert_eq!(
                place(&intent(), &n, true),
                Placement::Load(Arc::new(load("reg/m:6.1"))),
                "{key}:{effect} unloaded the module"
            );
            assert_eq!(
                place(&intent(), &n, false),
                Placement::NotApplicable,
                "{key}:{effect} started a load"
            );
            // A user's change still unloads.
            n.labels.clear();
            assert_eq!(place(&intent(), &n, true), Placement::Unload);
        }
    }

    #[test]
    fn explicit_unload_applies_to_every_node() {
        let mut gone = intent();
        gone.unload = true;
        assert_eq!(place(&gone, &node("6.1"), false), Placement::Unload);
        let mut other = node("6.1");
        other.labels.clear();
        assert_eq!(place(&gone, &other, false), Placement::Unload);
        assert!(!Placement::Unload.is_selected());
    }

    #[test]
    fn a_load_waits_for_the_agent_to_run_the_kubelets_kernel() {
        let resolved = place(&intent(), &node("6.1"), false);
        assert_eq!(
            check_agent_kernel(resolved.clone(), "6.1", "6.2"),
            Placement::KernelMismatch {
                kubelet: "6.1".into(),
                agent: "6.2".into()
            }
        );
        assert!(check_agent_kernel(resolved.clone(), "6.1", "6.2").is_selected());
        assert_eq!(
            check_agent_kernel(resolved.clone(), "6.1", "6.1"),
            resolved,
            "they agree"
        );
        assert_eq!(
            check_agent_kernel(resolved.clone(), "6.1", ""),
            resolved,
            "no hello, or an agent that did not say: the kubelet's kernel, as it is"
        );
    }

    #[test]
    fn only_a_load_is_stopped_by_another_agent_kernel() {
        for placement in [
            Placement::Unload,
            Placement::NotApplicable,
            Placement::AwaitingKernel,
            place(&intent(), &node("5.14"), false),
        ] {
            assert_eq!(
                check_agent_kernel(placement.clone(), "6.1", "6.2"),
                placement
            );
        }
    }

    #[test]
    fn a_module_that_loads_nothing_is_placed_by_selector_and_tolerations_alone() {
        let plugin_only = ModuleIntent {
            kernels: Vec::new(),
            device_plugin_only: true,
            ..intent()
        };
        for kernel in ["6.1", "5.14", "7.0", ""] {
            assert_eq!(
                place(&plugin_only, &node(kernel), false),
                Placement::DevicePluginOnly,
                "kernel {kernel:?}"
            );
        }
        assert!(Placement::DevicePluginOnly.is_selected());
        let mut other = node("6.1");
        other.labels.clear();
        assert_eq!(place(&plugin_only, &other, false), Placement::NotApplicable);
        assert_eq!(place(&plugin_only, &other, true), Placement::Unload);
        let mut tainted = node("6.1");
        tainted.taints.push(Taint {
            key: "dedicated".into(),
            value: "gpu".into(),
            effect: "NoSchedule".into(),
        });
        assert_eq!(
            place(&plugin_only, &tainted, false),
            Placement::NotApplicable
        );
        let mut gone = plugin_only;
        gone.unload = true;
        assert_eq!(place(&gone, &node("6.1"), false), Placement::Unload);
    }
}
