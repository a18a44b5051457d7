//! `charts/kmm-fleet` against `addon-manifests/`, with the real `helm` (built from the Go
//! module proxy at the version pinned in e2e/versions.toml on first use, then cached) and
//! the toolchain's `kubectl kustomize`:
//!
//! * the default render is `addon-manifests/hub` object by object, and with
//!   monitoring.enabled it adds exactly `addon-manifests/monitoring`; so a change to
//!   addon-manifests that the chart does not follow fails here;
//! * non-default values land where they belong;
//! * the values the Helm fleet test installs with render what the fleet's own overlay
//!   applies.
//!
//! Needs no fleet. Fails, never skips, when helm cannot be built.

use std::path::PathBuf;
use std::sync::OnceLock;

use anyhow::{Result, anyhow, ensure};
use kmm_e2e::fleet::hub_install::{Overlay, write as write_overlay};
use kmm_e2e::helm::{
    Difference, ObjectKey, Objects, chart_dir, compare, field, lint, manifests_dir, render_chart,
    render_kustomize,
};
use kmm_e2e::toolchain::{BIN_DIR_ENV, Toolchain};
use kmm_e2e::versions::Versions;
use serde_json::{Value, json};

/// Built once per test binary: the tests run in parallel, and two builds of one
/// component into one directory would race.
fn toolchain() -> Result<&'static Toolchain> {
    static TOOLCHAIN: OnceLock<Result<Toolchain, String>> = OnceLock::new();
    TOOLCHAIN
        .get_or_init(|| {
            Toolchain::ensure_helm(
                &Versions::pinned(),
                std::env::var_os(BIN_DIR_ENV).map(PathBuf::from).as_deref(),
            )
            .map_err(|e| e.to_string())
        })
        .as_ref()
        .map_err(|e| anyhow!("helm and kubectl from the toolchain: {e}"))
}

fn chart(values: &Value) -> Result<Objects> {
    Ok(render_chart(toolchain()?.bin("helm"), "kmm-fleet", values)?)
}

fn kustomize(dirs: &[&str]) -> Result<Objects> {
    let root = manifests_dir();
    let dirs: Vec<PathBuf> = dirs.iter().map(|d| root.join(d)).collect();
    let dirs: Vec<&std::path::Path> = dirs.iter().map(PathBuf::as_path).collect();
    Ok(render_kustomize(toolchain()?.bin("kubectl"), &dirs)?)
}

/// Fails listing every difference, the kustomize side on the left.
fn ensure_same(what: &str, kustomize: &Objects, chart: &Objects) -> Result<()> {
    let differences = compare(kustomize, chart);
    ensure!(
        differences.is_empty(),
        "{what}: {} differences (kustomize | chart):\n{}",
        differences.len(),
        differences
            .iter()
            .map(Difference::to_string)
            .collect::<Vec<_>>()
            .join("\n")
    );
    Ok(())
}

fn key(api_version: &str, kind: &str, namespace: &str, name: &str) -> ObjectKey {
    ObjectKey {
        api_version: api_version.into(),
        kind: kind.into(),
        namespace: namespace.into(),
        name: name.into(),
    }
}

fn deployment() -> ObjectKey {
    key("apps/v1", "Deployment", "kmm-hub", "kmm-hub")
}

fn template() -> ObjectKey {
    key(
        "addon.open-cluster-management.io/v1alpha1",
        "AddOnTemplate",
        "",
        "kmm-0.1.0",
    )
}

/// The manifest of `kind` inside the AddOnTemplate.
fn template_manifest<'a>(objects: &'a Objects, kind: &str) -> Result<&'a Value> {
    field(objects, &template(), "/spec/agentSpec/workload/manifests")?
        .as_array()
        .and_then(|m| m.iter().find(|m| m["kind"] == kind))
        .ok_or_else(|| anyhow!("the AddOnTemplate has no {kind}"))
}

#[test]
fn the_default_render_is_the_kustomize_base_object_by_object() -> Result<()> {
    let base = kustomize(&["hub"])?;
    let chart = chart(&json!({}))?;
    ensure_same("addon-manifests/hub", &base, &chart)?;
    // The comparison is not vacuous: everything the README installs is there.
    ensure!(base.len() >= 20, "only {} objects in the base", base.len());
    for kind in [
        "CustomResourceDefinition",
        "Deployment",
        "ClusterManagementAddOn",
        "AddOnTemplate",
        "AddOnDeploymentConfig",
        "ValidatingWebhookConfiguration",
    ] {
        ensure!(
            chart.keys().any(|k| k.kind == kind),
            "no {kind} in the chart's render"
        );
    }
    Ok(())
}

#[test]
fn with_monitoring_enabled_the_chart_adds_exactly_the_monitoring_directory() -> Result<()> {
    let both = kustomize(&["hub", "monitoring"])?;
    let chart = chart(&json!({ "monitoring": { "enabled": true } }))?;
    ensure_same("addon-manifests/hub and monitoring", &both, &chart)
}

#[test]
fn non_default_values_land_where_they_belong() -> Result<()> {
    let objects = chart(&json!({
        "global": { "imageRegistry": "registry.example.com", "imageTag": "0.2.0" },
        "images": { "agent": { "tag": "0.2.1" } },
        "hub": {
            "replicas": 3,
            "resources": { "requests": { "cpu": "100m", "memory": "128Mi" } },
            "grpcSANs": ["kmm-hub.example.com"],
            "grpcService": { "type": "NodePort", "nodePort": 30443 },
        },
        "addon": {
            "hubAddress": "https://kmm-hub.example.com:30443",
            "logLevel": "debug",
            "firmwareDir": "/var/lib/firmware",
            "clusterPullSecret": "regcred",
            "proxy": { "resources": { "limits": { "memory": "1Gi" } } },
            "agent": { "resources": { "limits": { "memory": "2Gi" } } },
        },
        "monitoring": { "enabled": true },
    }))?;
    let deployment = deployment();
    ensure!(*field(&objects, &deployment, "/spec/replicas")? == json!(3));
    let hub = field(&objects, &deployment, "/spec/template/spec/containers/0")?;
    ensure!(
        hub["image"] == "registry.example.com/kmm-fleet/kmm-hub:0.2.0",
        "hub image {}",
        hub["image"]
    );
    // Helm merges maps of values into the defaults: the limits stay (null removes one).
    ensure!(
        hub["resources"]
            == json!({
                "requests": { "cpu": "100m", "memory": "128Mi" },
                "limits": { "cpu": "1", "memory": "512Mi" },
            }),
        "hub resources {}",
        hub["resources"]
    );
    let args = hub["args"].as_array().cloned().unwrap_or_default();
    for arg in [
        "--grpc-san=kmm-hub.example.com",
        // Another registry than kmm-hub's built-in default: the flag is passed.
        "--builder-image=registry.example.com/kmm-fleet/kmm-builder:0.2.0",
    ] {
        ensure!(args.contains(&json!(arg)), "no {arg} in {args:?}");
    }

    let service = key("v1", "Service", "kmm-hub", "kmm-hub");
    ensure!(*field(&objects, &service, "/spec/type")? == json!("NodePort"));
    ensure!(*field(&objects, &service, "/spec/ports/0/nodePort")? == json!(30443));

    let config = key(
        "addon.open-cluster-management.io/v1alpha1",
        "AddOnDeploymentConfig",
        "kmm-hub",
        "kmm",
    );
    ensure!(
        *field(&objects, &config, "/spec/customizedVariables")?
            == json!([
                { "name": "LOG_LEVEL", "value": "debug" },
                { "name": "FIRMWARE_DIR", "value": "/var/lib/firmware" },
                { "name": "HUB_ADDRESS", "value": "https://kmm-hub.example.com:30443" },
                { "name": "CLUSTER_PULL_SECRET", "value": "regcred" },
            ])
    );

    let proxy =
        &template_manifest(&objects, "Deployment")?["spec"]["template"]["spec"]["containers"][0];
    ensure!(
        proxy["image"] == "registry.example.com/kmm-fleet/kmm-spoke-proxy:0.2.0",
        "proxy image {}",
        proxy["image"]
    );
    ensure!(
        proxy["resources"]
            == json!({
                "requests": { "cpu": "20m", "memory": "32Mi" },
                "limits": { "cpu": "1", "memory": "1Gi" },
            }),
        "proxy resources {}",
        proxy["resources"]
    );
    // OCM's own placeholders reach OCM untouched.
    ensure!(
        proxy["args"]
            .as_array()
            .is_some_and(|a| a.contains(&json!("--hub-address={{HUB_ADDRESS}}"))
                && a.contains(&json!("--cluster-pull-secret={{CLUSTER_PULL_SECRET}}"))),
        "proxy args {}",
        proxy["args"]
    );
    let agent =
        &template_manifest(&objects, "DaemonSet")?["spec"]["template"]["spec"]["containers"][0];
    ensure!(
        agent["image"] == "registry.example.com/kmm-fleet/kmm-node-agent:0.2.1",
        "agent image {}",
        agent["image"]
    );
    ensure!(
        agent["resources"]
            == json!({
                "requests": { "cpu": "10m", "memory": "32Mi" },
                "limits": { "memory": "2Gi" },
            }),
        "agent resources {}",
        agent["resources"]
    );

    for monitoring in [
        key(
            "monitoring.coreos.com/v1",
            "PrometheusRule",
            "kmm-hub",
            "kmm-fleet",
        ),
        key(
            "monitoring.coreos.com/v1",
            "ServiceMonitor",
            "kmm-hub",
            "kmm-hub",
        ),
        key("v1", "ConfigMap", "kmm-hub", "kmm-fleet-dashboard"),
    ] {
        ensure!(objects.contains_key(&monitoring), "no {monitoring}");
    }
    Ok(())
}

#[test]
fn the_fleet_test_values_render_what_the_fleet_overlay_applies() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let overlay = Overlay {
        registry: "198.18.16.1:16005",
        tag: "0.1.0",
        node_ip: "198.18.16.10",
    };
    write_overlay(dir.path(), &overlay)?;
    let fleet = render_kustomize(toolchain()?.bin("kubectl"), &[dir.path()])?;
    let chart = chart(&overlay.helm_values())?;
    ensure_same("the fleet's overlay", &fleet, &chart)
}

#[test]
fn the_chart_lints_strictly_and_keeps_the_monitoring_files_byte_for_byte() -> Result<()> {
    lint(toolchain()?.bin("helm"))?;
    for file in ["dashboard.json", "prometheus-rule.yaml"] {
        let ours = std::fs::read(manifests_dir().join("monitoring").join(file))?;
        let chart = std::fs::read(chart_dir().join("files").join(file))?;
        ensure!(
            ours == chart,
            "charts/kmm-fleet/files/{file} differs from addon-manifests/monitoring/{file}: copy it"
        );
    }
    Ok(())
}
