//! A module's device plugin (upstream's `spec.devicePlugin`) as the DaemonSet the proxy
//! owns in the module's namespace, and which of its Pods are where. Pure.
//!
//! The DaemonSet selects only nodes carrying the module's scheduling label
//! (`device-plugin.kmm.sigs.x-k8s.io/<ns>.<name>`), which the proxy sets once the module
//! runs there at the version it is to run (on every selected node for a module that
//! loads nothing), and removes before the module is unloaded or moves to another
//! version: the kubelet stops the plugin before the module goes, and starts it after the
//! new one is loaded. Upstream's `device-plugin-ready` label follows the readiness of the
//! Pods found here.

use std::collections::BTreeMap;

use k8s_openapi::api::apps::v1::{DaemonSet, DaemonSetSpec};
use k8s_openapi::api::core::v1::{
    Container, HostPathVolumeSource, Pod, PodSpec, PodTemplateSpec, SecurityContext, Toleration,
    Volume, VolumeMount,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta};
use kmm_api::labels::device_plugin_scheduling_label;
use kmm_api::{DevicePluginContainerSpec, DevicePluginSpec};
use kmm_proto::v1::{DevicePlugin, Toleration as WireToleration};
use thiserror::Error;

use crate::module_id::ModuleId;
use crate::node_status::StatusKey;

/// On the DaemonSet and its Pods: the name of the module whose plugin they run.
pub const MODULE_LABEL: &str = "kmm.sigs.x-k8s.io/device-plugin";
/// On the DaemonSet: who owns it.
pub const MANAGED_BY_LABEL: &str = "app.kubernetes.io/managed-by";
pub const MANAGED_BY: &str = "kmm-spoke-proxy";
/// On the DaemonSet and its Pods: the namespace of the proxy that owns them (one proxy
/// per cluster; a second one, as in tests, must leave the first one's alone).
pub const OWNER_LABEL: &str = "kmm.sigs.x-k8s.io/proxy-namespace";
/// Where the kubelet's device plugin sockets are, mounted into the plugin as upstream does.
pub const KUBELET_PLUGINS: &str = "/var/lib/kubelet/device-plugins";
const PLUGINS_VOLUME: &str = "kubelet-device-plugins";

#[derive(Debug, Error, PartialEq, Eq)]
#[error("module {module}: the device plugin spec from the hub cannot be read: {reason}")]
pub struct DevicePluginError {
    pub module: String,
    pub reason: String,
}

/// The DaemonSet's name: `<module>-device-plugin`.
pub fn daemon_set_name(id: &ModuleId) -> String {
    format!("{}-device-plugin", id.name)
}

/// The DaemonSet running the module's device plugin.
pub fn daemon_set(
    id: &ModuleId,
    plugin: &DevicePlugin,
    tolerations: &[WireToleration],
    owner: &str,
) -> Result<DaemonSet, DevicePluginError> {
    let spec: DevicePluginSpec =
        serde_json::from_str(&plugin.spec_json).map_err(|e| DevicePluginError {
            module: format!("{}/{}", id.namespace, id.name),
            reason: e.to_string(),
        })?;
    let selector = BTreeMap::from([
        (MODULE_LABEL.to_owned(), id.name.to_string()),
        (OWNER_LABEL.to_owned(), owner.to_owned()),
    ]);
    let mut labels = selector.clone();
    labels.insert(MANAGED_BY_LABEL.to_owned(), MANAGED_BY.to_owned());
    let mut volumes = vec![Volume {
        name: PLUGINS_VOLUME.to_owned(),
        host_path: Some(HostPathVolumeSource {
            path: KUBELET_PLUGINS.to_owned(),
            type_: Some("Directory".to_owned()),
        }),
        ..Volume::default()
    }];
    volumes.extend(spec.volumes.iter().flatten().cloned());
    Ok(DaemonSet {
        metadata: ObjectMeta {
            name: Some(daemon_set_name(id)),
            namespace: Some(id.namespace.to_string()),
            labels: Some(labels.clone()),
            ..ObjectMeta::default()
        },
        spec: Some(DaemonSetSpec {
            selector: LabelSelector {
                match_labels: Some(selector),
                ..LabelSelector::default()
            },
            template: PodTemplateSpec {
                metadata: Some(ObjectMeta {
                    labels: Some(labels),
                    ..ObjectMeta::default()
                }),
                spec: Some(PodSpec {
                    node_selector: Some(BTreeMap::from([(
                        device_plugin_scheduling_label(&id.namespace, &id.name),
                        String::new(),
                    )])),
                    containers: vec![container("device-plugin", &spec.container, true)],
                    init_containers: spec
                        .init_container
                        .as_ref()
                        .map(|init| vec![container("init", init, false)]),
                    service_account_name: spec.service_account_name.clone(),
                    automount_service_account_token: spec.automount_service_account_token,
                    // A device plugin is node infrastructure, as upstream ranks it.
                    priority_class_name: Some("system-node-critical".to_owned()),
                    tolerations: (!tolerations.is_empty())
                        .then(|| tolerations.iter().map(toleration).collect()),
                    volumes: Some(volumes),
                    ..PodSpec::default()
                }),
            },
            ..DaemonSetSpec::default()
        }),
        ..DaemonSet::default()
    })
}

/// A container of the plugin's Pod. The plugin itself is privileged and mounts the
/// kubelet's plugin directory, as upstream runs it; the init container only gets what
/// its spec asks.
fn container(name: &str, spec: &DevicePluginContainerSpec, plugin: bool) -> Container {
    let mut mounts: Vec<VolumeMount> = Vec::new();
    if plugin {
        mounts.push(VolumeMount {
            name: PLUGINS_VOLUME.to_owned(),
            mount_path: KUBELET_PLUGINS.to_owned(),
            ..VolumeMount::default()
        });
    }
    mounts.extend(spec.volume_mounts.iter().flatten().cloned());
    Container {
        name: name.to_owned(),
        image: Some(spec.image.clone()),
        image_pull_policy: spec.image_pull_policy.clone(),
        command: spec.command.clone(),
        args: spec.args.clone(),
        env: spec.env.clone(),
        resources: spec.resources.clone(),
        volume_mounts: (!mounts.is_empty()).then_some(mounts),
        security_context: plugin.then(|| SecurityContext {
            privileged: Some(true),
            ..SecurityContext::default()
        }),
        ..Container::default()
    }
}

fn toleration(t: &WireToleration) -> Toleration {
    let text = |s: &str| (!s.is_empty()).then(|| s.to_owned());
    Toleration {
        key: text(&t.key),
        operator: text(&t.operator),
        value: text(&t.value),
        effect: text(&t.effect),
        toleration_seconds: None,
    }
}

/// The label selector of everything one proxy owns.
pub fn owned_by(owner: &str) -> String {
    format!("{MANAGED_BY_LABEL}={MANAGED_BY},{OWNER_LABEL}={owner},{MODULE_LABEL}")
}

/// Per module, its plugin DaemonSet's desired and available Pods.
pub fn counts<'a>(
    daemon_sets: impl IntoIterator<Item = &'a DaemonSet>,
) -> BTreeMap<ModuleId, (u32, u32)> {
    daemon_sets
        .into_iter()
        .filter_map(|set| {
            let id = ModuleId {
                namespace: set.metadata.namespace.as_deref()?.into(),
                name: set
                    .metadata
                    .labels
                    .as_ref()?
                    .get(MODULE_LABEL)?
                    .as_str()
                    .into(),
            };
            let status = set.status.as_ref();
            let count = |n: Option<i32>| n.map_or(0, |n| u32::try_from(n).unwrap_or(0));
            Some((
                id,
                (
                    count(status.map(|s| s.desired_number_scheduled)),
                    count(status.and_then(|s| s.number_available)),
                ),
            ))
        })
        .collect()
}

/// Where the plugins' Pods are: (module, node) of every Pod bound to a node, with
/// whether one of them is Ready there. A Pod counts until it is gone from the API, that
/// is until the kubelet stopped it; one being deleted is stopping, hence not Ready
/// whatever its last condition said.
pub fn pods_by_node<'a>(pods: impl IntoIterator<Item = &'a Pod>) -> BTreeMap<StatusKey, bool> {
    let mut found = BTreeMap::new();
    for pod in pods {
        let Some(name) = pod
            .metadata
            .labels
            .as_ref()
            .and_then(|l| l.get(MODULE_LABEL))
        else {
            continue;
        };
        let (Some(namespace), Some(node)) = (
            pod.metadata.namespace.clone(),
            pod.spec.as_ref().and_then(|s| s.node_name.clone()),
        ) else {
            continue;
        };
        let id = ModuleId {
            namespace: namespace.into(),
            name: name.as_str().into(),
        };
        let ready = found.entry((id, node)).or_insert(false);
        *ready |= pod.metadata.deletion_timestamp.is_none() && is_ready(pod);
    }
    found
}

/// Whether the Pod's `Ready` condition is True.
fn is_ready(pod: &Pod) -> bool {
    pod.status
        .iter()
        .flat_map(|s| s.conditions.iter().flatten())
        .any(|c| c.type_ == "Ready" && c.status == "True")
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn id() -> ModuleId {
        ModuleId {
            namespace: "drivers".into(),
            name: "hello".into(),
        }
    }

    fn plugin(spec: serde_json::Value) -> DevicePlugin {
        DevicePlugin {
            spec_json: spec.to_string(),
            ..DevicePlugin::default()
        }
    }

    #[test]
    fn the_daemon_set_runs_the_plugin_only_on_nodes_ready_for_it() {
        let spec = json!({
            "container": {
                "image": "reg/plugin:1",
                "args": ["--resource", "example.com/hello"],
                "volumeMounts": [{"name": "extra", "mountPath": "/extra"}],
            },
            "initContainer": {"image": "reg/init:1"},
            "serviceAccountName": "plugin",
            "volumes": [{"name": "extra", "emptyDir": {}}],
        });
        let tolerations = [WireToleration {
            key: "gpu".into(),
            operator: "Exists".into(),
            value: String::new(),
            effect: "NoSchedule".into(),
        }];
        let set = daemon_set(&id(), &plugin(spec), &tolerations, "kmm").unwrap();
        assert_eq!(set.metadata.name.as_deref(), Some("hello-device-plugin"));
        assert_eq!(set.metadata.namespace.as_deref(), Some("drivers"));
        assert_eq!(set.metadata.labels.as_ref().unwrap()[OWNER_LABEL], "kmm");
        let pod = set.spec.unwrap().template.spec.unwrap();
        assert_eq!(
            pod.node_selector.unwrap(),
            BTreeMap::from([(
                "device-plugin.kmm.sigs.x-k8s.io/drivers.hello".to_owned(),
                String::new()
            )])
        );
        let container = &pod.containers[0];
        assert_eq!(container.image.as_deref(), Some("reg/plugin:1"));
        let mounts: Vec<&str> = container
            .volume_mounts
            .iter()
            .flatten()
            .map(|m| m.mount_path.as_str())
            .collect();
        assert_eq!(mounts, [KUBELET_PLUGINS, "/extra"]);
        let volumes: Vec<&str> = pod
            .volumes
            .iter()
            .flatten()
            .map(|v| v.name.as_str())
            .collect();
        assert_eq!(volumes, [PLUGINS_VOLUME, "extra"]);
        assert_eq!(
            pod.init_containers.unwrap()[0].image.as_deref(),
            Some("reg/init:1")
        );
        assert_eq!(pod.service_account_name.as_deref(), Some("plugin"));
        let toleration = &pod.tolerations.unwrap()[0];
        assert_eq!(
            (toleration.key.as_deref(), toleration.value.as_deref()),
            (Some("gpu"), None)
        );
    }

    #[test]
    fn the_plugin_pods_pull_as_the_spec_says_as_upstreams_do() {
        // The kubelet pulls the plugin's images by tag: its pull policy is upstream's.
        for policy in [Some("Always"), Some("IfNotPresent"), Some("Never"), None] {
            let spec = json!({
                "container": {"image": "reg/plugin:1", "imagePullPolicy": policy},
                "initContainer": {"image": "reg/init:1", "imagePullPolicy": policy},
            });
            let set = daemon_set(&id(), &plugin(spec), &[], "kmm").unwrap();
            let pod = set.spec.unwrap().template.spec.unwrap();
            assert_eq!(
                pod.containers[0].image_pull_policy.as_deref(),
                policy,
                "{policy:?}"
            );
            assert_eq!(
                pod.init_containers.unwrap()[0].image_pull_policy.as_deref(),
                policy,
                "{policy:?}"
            );
        }
    }

    #[test]
    fn an_unreadable_spec_names_the_module() {
        let error = daemon_set(&id(), &plugin(json!({"container": 3})), &[], "kmm").unwrap_err();
        assert_eq!(error.module, "drivers/hello");
    }

    fn pod(labels: serde_json::Value, node: Option<&str>, ready: Option<&str>) -> Pod {
        let conditions: Vec<serde_json::Value> = ready
            .map(|status| json!({"type": "Ready", "status": status}))
            .into_iter()
            .collect();
        serde_json::from_value(json!({
            "metadata": {"name": "p", "namespace": "drivers", "labels": labels},
            "spec": {"containers": [], "nodeName": node},
            "status": {"conditions": conditions},
        }))
        .unwrap()
    }

    #[test]
    fn only_bound_pods_of_a_plugin_count() {
        let pods = [
            pod(json!({MODULE_LABEL: "hello"}), Some("n1"), None),
            pod(json!({MODULE_LABEL: "hello"}), None, Some("True")),
            pod(json!({"other": "x"}), Some("n2"), Some("True")),
        ];
        assert_eq!(
            pods_by_node(&pods),
            BTreeMap::from([((id(), "n1".to_owned()), false)])
        );
    }

    #[test]
    fn a_node_has_a_ready_plugin_while_one_of_its_pods_is_ready_and_not_being_deleted() {
        let on =
            |node: &str, ready: &str| pod(json!({MODULE_LABEL: "hello"}), Some(node), Some(ready));
        let deleted = |mut pod: Pod| {
            pod.metadata.deletion_timestamp =
                Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
                    k8s_openapi::jiff::Timestamp::UNIX_EPOCH,
                ));
            pod
        };
        let pods = [
            on("n1", "True"),
            on("n2", "False"),
            deleted(on("n3", "True")),
            // A rolling update: the old Pod stopping, the new one Ready.
            deleted(on("n4", "True")),
            on("n4", "True"),
        ];
        let found = pods_by_node(&pods);
        let ready = |node: &str| found.get(&(id(), node.to_owned())).copied();
        assert_eq!(ready("n1"), Some(true));
        assert_eq!(ready("n2"), Some(false));
        assert_eq!(ready("n3"), Some(false), "being deleted: stopping");
        assert_eq!(ready("n4"), Some(true));
        assert_eq!(ready("n5"), None);
    }

    #[test]
    fn counts_come_from_each_daemon_sets_status() {
        let set: DaemonSet = serde_json::from_value(json!({
            "metadata": {"name": "hello-device-plugin", "namespace": "drivers",
                         "labels": {MODULE_LABEL: "hello"}},
            "status": {"desiredNumberScheduled": 3, "numberAvailable": 2,
                       "currentNumberScheduled": 3, "numberMisscheduled": 0, "numberReady": 2},
        }))
        .unwrap();
        let fresh: DaemonSet = serde_json::from_value(json!({
            "metadata": {"name": "other-device-plugin", "namespace": "drivers",
                         "labels": {MODULE_LABEL: "other"}},
        }))
        .unwrap();
        let counted = counts([&set, &fresh]);
        assert_eq!(counted[&id()], (3, 2));
        assert_eq!(counted.len(), 2);
        assert_eq!(
            counted[&ModuleId {
                namespace: "drivers".into(),
                name: "other".into()
            }],
            (0, 0)
        );
    }
}
