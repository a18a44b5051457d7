//! The Downward API: a pod's fields by `fieldPath`, for `valueFrom.fieldRef`
//! environment variables and `downwardAPI` volume items, formatted as the kubelet does
//! (`pkg/fieldpath`, `podFieldSelectorRuntimeValue`). `status.hostIP` is the pod's
//! (KWOK's node address), not that of the real node whose network the process uses.
//! Pure.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::Pod;

/// The value of `path` for `pod`, or why it cannot be given.
pub(super) fn field_value(pod: &Pod, path: &str) -> Result<String, String> {
    let meta = &pod.metadata;
    let spec = pod.spec.as_ref();
    let status = pod.status.as_ref();
    let text = |value: Option<&String>| value.cloned().unwrap_or_default();
    if let Some((map, key)) = subscripted(path) {
        let entries = match map {
            "metadata.labels" => meta.labels.as_ref(),
            "metadata.annotations" => meta.annotations.as_ref(),
            _ => return Err(format!("fieldPath {path:?} does not support a subscript")),
        };
        return Ok(text(entries.and_then(|m| m.get(key))));
    }
    let ips = |list: Option<Vec<String>>| list.unwrap_or_default().join(",");
    Ok(match path {
        "metadata.name" => text(meta.name.as_ref()),
        "metadata.namespace" => text(meta.namespace.as_ref()),
        "metadata.uid" => text(meta.uid.as_ref()),
        "metadata.labels" => format_map(meta.labels.as_ref()),
        "metadata.annotations" => format_map(meta.annotations.as_ref()),
        "spec.nodeName" => text(spec.and_then(|s| s.node_name.as_ref())),
        "spec.serviceAccountName" => text(spec.and_then(|s| s.service_account_name.as_ref())),
        "status.podIP" => text(status.and_then(|s| s.pod_ip.as_ref())),
        "status.hostIP" => text(status.and_then(|s| s.host_ip.as_ref())),
        "status.podIPs" => ips(status.and_then(|s| {
            s.pod_ips
                .as_ref()
                .map(|l| l.iter().map(|ip| ip.ip.clone()).collect())
        })),
        "status.hostIPs" => ips(status.and_then(|s| {
            s.host_ips
                .as_ref()
                .map(|l| l.iter().map(|ip| ip.ip.clone()).collect())
        })),
        _ => return Err(format!("unsupported fieldPath {path:?}")),
    })
}

/// `metadata.labels['key']` as (`metadata.labels`, `key`).
fn subscripted(path: &str) -> Option<(&str, &str)> {
    let inner = path.strip_suffix("']")?;
    let (map, key) = inner.split_once("['")?;
    (!map.is_empty()).then_some((map, key))
}

/// `key="value"` lines sorted by key, values quoted as Go's `strconv.Quote` does.
fn format_map(map: Option<&BTreeMap<String, String>>) -> String {
    map.into_iter()
        .flatten()
        .map(|(k, v)| format!("{k}={}", go_quote(v)))
        .collect::<Vec<_>>()
        .join("\n")
}

fn go_quote(value: &str) -> String {
    let mut out = String::with_capacity(value.len() + 2);
    out.push('"');
    for c in value.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{7}' => out.push_str("\\a"),
            '\u{8}' => out.push_str("\\b"),
            '\u{b}' => out.push_str("\\v"),
            '\u{c}' => out.push_str("\\f"),
            c if c.is_control() && (c as u32) < 0x80 => {
                out.push_str(&format!("\\x{:02x}", c as u32));
            }
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

#[cfg(test)]
pub(super) mod tests {
    use k8s_openapi::api::core::v1::{HostIP, PodIP, PodSpec, PodStatus};
    use kube::api::ObjectMeta;

    use super::*;

    /// A pod of the node agent's DaemonSet as KWOK runs it.
    pub(crate) fn agent_pod() -> Pod {
        Pod {
            metadata: ObjectMeta {
                name: Some("kmm-node-agent-x7k2p".into()),
                namespace: Some("kmm".into()),
                uid: Some("6f1c9a54-0001".into()),
                labels: Some(BTreeMap::from([
                    ("app.kubernetes.io/name".into(), "kmm-node-agent".into()),
                    ("pod-template-generation".into(), "1".into()),
                ])),
                annotations: Some(BTreeMap::from([(
                    "note".into(),
                    "say \"hi\"\n\ttab\\ \u{1}".into(),
                )])),
                ..Default::default()
            },
            spec: Some(PodSpec {
                node_name: Some("spoke1-kwok-1".into()),
                service_account_name: Some("kmm-node-agent".into()),
                ..Default::default()
            }),
            status: Some(PodStatus {
                pod_ip: Some("10.101.0.7".into()),
                pod_ips: Some(vec![
                    PodIP {
                        ip: "10.101.0.7".into(),
                    },
                    PodIP {
                        ip: "fd00::7".into(),
                    },
                ]),
                host_ip: Some("127.0.0.1".into()),
                host_ips: Some(vec![HostIP {
                    ip: "127.0.0.1".into(),
                }]),
                phase: Some("Running".into()),
                ..Default::default()
            }),
        }
    }

    #[test]
    fn scalar_fields() {
        let pod = agent_pod();
        for (path, value) in [
            ("metadata.name", "kmm-node-agent-x7k2p"),
            ("metadata.namespace", "kmm"),
            ("metadata.uid", "6f1c9a54-0001"),
            ("spec.nodeName", "spoke1-kwok-1"),
            ("spec.serviceAccountName", "kmm-node-agent"),
            ("status.podIP", "10.101.0.7"),
            ("status.podIPs", "10.101.0.7,fd00::7"),
            ("status.hostIP", "127.0.0.1"),
            ("status.hostIPs", "127.0.0.1"),
            (
                "metadata.labels['app.kubernetes.io/name']",
                "kmm-node-agent",
            ),
            ("metadata.labels['absent']", ""),
            ("metadata.annotations['note']", "say \"hi\"\n\ttab\\ \u{1}"),
        ] {
            assert_eq!(field_value(&pod, path).as_deref(), Ok(value), "{path}");
        }
    }

    #[test]
    fn whole_maps_are_sorted_quoted_lines() {
        let pod = agent_pod();
        assert_eq!(
            field_value(&pod, "metadata.labels").unwrap(),
            "app.kubernetes.io/name=\"kmm-node-agent\"\npod-template-generation=\"1\""
        );
        assert_eq!(
            field_value(&pod, "metadata.annotations").unwrap(),
            r#"note="say \"hi\"\n\ttab\\ \x01""#
        );
        let bare = Pod::default();
        assert_eq!(field_value(&bare, "metadata.labels").unwrap(), "");
    }

    #[test]
    fn missing_fields_are_empty() {
        let bare = Pod::default();
        for path in [
            "metadata.name",
            "spec.nodeName",
            "status.podIP",
            "status.podIPs",
        ] {
            assert_eq!(field_value(&bare, path).as_deref(), Ok(""), "{path}");
        }
    }

    #[test]
    fn unsupported_paths_are_refused() {
        let pod = agent_pod();
        for path in [
            "spec.containers",
            "status.phase",
            "metadata.name['x']",
            "['x']",
            "metadata.generateName",
        ] {
            assert!(field_value(&pod, path).is_err(), "{path}");
        }
    }
}
