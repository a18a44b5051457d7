//! Device plugins: the module's device plugin reaches the proxy with its intent, and the
//! proxies' counts of plugin Pods become the module's status.

use kmm_proto::v1::{DevicePluginCount, DevicePluginReport, ModuleKey, proxy_message};
use serde_json::json;

use super::support::*;

const NAME: &str = "hello-plugin";

/// The module's plugin has `available` of `desired` Pods on the cluster.
fn report(desired: u32, available: u32) -> proxy_message::Message {
    proxy_message::Message::DevicePlugins(DevicePluginReport {
        plugins: vec![DevicePluginCount {
            module: Some(ModuleKey {
                namespace: "kmm-test".into(),
                name: NAME.into(),
            }),
            desired,
            available,
        }],
    })
}

#[tokio::test]
async fn the_plugin_travels_with_the_intent_and_its_pods_are_counted_per_cluster() {
    let fleet = fleet().await;
    let (hub, namespace) = TestHub::start(&fleet, WAIT).await;
    hub.label_cluster("spoke1", true).await;
    let mut spec = module("1", None);
    spec["devicePlugin"] = json!({"container": {"image": "registry.example/plugin:1"}});
    hub.create_module(NAME, spec).await;
    let mut proxy = hub.proxy("spoke1", &[MAPPED_KERNEL]).await;
    let snapshot = proxy
        .snapshot_where("the module with its plugin", |s| intent(s, NAME).is_some())
        .await;
    let plugin = intent(&snapshot, NAME)
        .and_then(|i| i.device_plugin.clone())
        .expect("the intent carries the device plugin");
    assert!(
        plugin.spec_json.contains("registry.example/plugin:1"),
        "{plugin:?}"
    );

    proxy.send(report(3, 2)).await;
    let counted = hub
        .wait_module(NAME, "the plugin's Pods counted", WAIT, |m| {
            let plugins = m.and_then(|m| m.status?.device_plugins).ok_or("no count")?;
            (plugins.desired == 3)
                .then(|| plugins.clone())
                .ok_or_else(|| format!("{plugins:?}"))
        })
        .await;
    assert_eq!(counted.available, 2);
    assert_eq!(counted.short.len(), 1);
    assert_eq!(counted.short[0].cluster, "spoke1");

    proxy.send(report(3, 3)).await;
    hub.wait_module(NAME, "every plugin Pod available", WAIT, |m| {
        let plugins = m.and_then(|m| m.status?.device_plugins).ok_or("no count")?;
        (plugins.available == 3 && plugins.short.is_empty())
            .then_some(())
            .ok_or_else(|| format!("{plugins:?}"))
    })
    .await;
    hub.clean_up(namespace, &[NAME], &["spoke1"]).await;
}
