//! What the proxy needs to know about a Node, taken from the API object. Pure.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::Node;

/// A node taint, as the scheduler sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Taint {
    pub key: String,
    pub value: String,
    pub effect: String,
}

/// The facts of one Node that decide what it runs and what the hub hears about it.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct NodeFacts {
    pub name: String,
    pub uid: String,
    /// `status.nodeInfo.kernelVersion`; empty until the kubelet reports it.
    pub kernel: String,
    pub boot_id: String,
    pub labels: BTreeMap<String, String>,
    pub taints: Vec<Taint>,
}

impl NodeFacts {
    /// The facts of `node`; `None` for an object without a name (never a real Node).
    pub fn from_node(node: &Node) -> Option<Self> {
        let name = node.metadata.name.clone()?;
        let info = node.status.as_ref().and_then(|s| s.node_info.as_ref());
        Some(Self {
            name,
            uid: node.metadata.uid.clone().unwrap_or_default(),
            kernel: info.map(|i| i.kernel_version.clone()).unwrap_or_default(),
            boot_id: info.map(|i| i.boot_id.clone()).unwrap_or_default(),
            labels: node.metadata.labels.clone().unwrap_or_default(),
            taints: node
                .spec
                .as_ref()
                .and_then(|s| s.taints.as_ref())
                .map(|taints| {
                    taints
                        .iter()
                        .map(|t| Taint {
                            key: t.key.clone(),
                            value: t.value.clone().unwrap_or_default(),
                            effect: t.effect.clone(),
                        })
                        .collect()
                })
                .unwrap_or_default(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::{NodeSpec, NodeStatus, NodeSystemInfo, Taint as KubeTaint};
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

    #[test]
    fn reads_kernel_labels_and_taints() {
        let node = Node {
            metadata: ObjectMeta {
                name: Some("n1".into()),
                uid: Some("u1".into()),
                labels: Some([("a".to_string(), "b".to_string())].into()),
                ..Default::default()
            },
            spec: Some(NodeSpec {
                taints: Some(vec![KubeTaint {
                    key: "k".into(),
                    value: None,
                    effect: "NoSchedule".into(),
                    ..Default::default()
                }]),
                ..Default::default()
            }),
            status: Some(NodeStatus {
                node_info: Some(NodeSystemInfo {
                    kernel_version: "6.1.0-13-amd64".into(),
                    boot_id: "boot".into(),
                    ..Default::default()
                }),
                ..Default::default()
            }),
        };
        let facts = NodeFacts::from_node(&node).unwrap();
        assert_eq!(facts.name, "n1");
        assert_eq!(facts.uid, "u1");
        assert_eq!(facts.kernel, "6.1.0-13-amd64");
        assert_eq!(facts.boot_id, "boot");
        assert_eq!(facts.labels.get("a").map(String::as_str), Some("b"));
        assert_eq!(
            facts.taints,
            vec![Taint {
                key: "k".into(),
                value: String::new(),
                effect: "NoSchedule".into()
            }]
        );
    }

    #[test]
    fn a_node_without_status_has_empty_facts() {
        let node = Node {
            metadata: ObjectMeta {
                name: Some("bare".into()),
                ..Default::default()
            },
            ..Default::default()
        };
        let facts = NodeFacts::from_node(&node).unwrap();
        assert_eq!(facts.kernel, "");
        assert!(facts.taints.is_empty());
        assert!(NodeFacts::from_node(&Node::default()).is_none());
    }
}
