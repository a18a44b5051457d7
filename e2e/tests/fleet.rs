//! Proof that the local fleet is real: OCM registration and work, KWOK nodes and pods,
//! the sample registry, and the generated MCM CRD on a real kube-apiserver.
//!
//! These attach to the running fleet (`cargo xtask env up`) or start one; they fail,
//! never skip, when it cannot start.

use std::time::Duration;

use anyhow::{Context, Result, ensure};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{ConfigMap, Node, Pod};
use kmm_api::ocm::{
    self, ADD_ON_TEMPLATE, CLUSTER_MANAGEMENT_ADD_ON, MANAGED_CLUSTER_ADD_ON,
    MANAGED_CLUSTER_SET_BINDING, MANIFEST_WORK, PLACEMENT, PLACEMENT_DECISION, PLACEMENT_LABEL,
};
use kmm_e2e::fixture::{Fleet, TempNamespace, wait_until};
use kmm_e2e::fleet::nodes::NODE_TYPE_LABEL;
use kmm_e2e::fleet::{
    KERNEL_LABEL, Settings, apply_crd, condition_true, managed_clusters, node_ready,
};
use kmm_e2e::kmod::{MODULES, REPOSITORY};
use kmm_e2e::toolchain::Toolchain;
use kmm_e2e::versions::Versions;
use kube::Api;
use kube::api::{ApiResource, DeleteParams, DynamicObject, GroupVersionKind, PostParams};
use oci_client::client::{ClientConfig, ClientProtocol};
use oci_client::secrets::RegistryAuth;
use serde_json::{Value, json};

const WAIT: Duration = Duration::from_secs(90);

fn unique(prefix: &str) -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or_default();
    format!("{prefix}-{}-{nanos:x}", std::process::id())
}

#[tokio::test]
async fn every_spoke_is_joined_and_available_on_the_hub() -> Result<()> {
    let fleet = Fleet::get().await?;
    let clusters = managed_clusters(&fleet.hub);
    let names = fleet.spoke_names();
    ensure!(
        names.len() >= 2,
        "expected at least two spokes, got {names:?}"
    );
    for name in names {
        let mc = clusters
            .get(&name)
            .await
            .with_context(|| format!("ManagedCluster {name}"))?;
        ensure!(
            mc.data["spec"]["hubAcceptsClient"] == true,
            "{name} is not accepted: {}",
            mc.data["spec"]
        );
        for condition in [
            "HubAcceptedManagedCluster",
            "ManagedClusterJoined",
            "ManagedClusterConditionAvailable",
        ] {
            ensure!(
                condition_true(&mc.data, condition),
                "{name}: {condition} is not True: {}",
                mc.data["status"]
            );
        }
    }
    Ok(())
}

#[tokio::test]
async fn kwok_nodes_are_ready_with_their_debian_kernels() -> Result<()> {
    let fleet = Fleet::get().await?;
    let versions = Versions::pinned();
    let mut kernels_seen = vec![];
    for spoke in fleet.state.spokes() {
        let nodes: Api<Node> = Api::all(fleet.spoke(&spoke.name)?.clone());
        ensure!(
            !spoke.nodes.is_empty(),
            "{} has no simulated nodes",
            spoke.name
        );
        for expected in &spoke.nodes {
            let node = nodes
                .get(&expected.name)
                .await
                .with_context(|| format!("node {}", expected.name))?;
            ensure!(
                node_ready(&node),
                "{}/{} is not Ready",
                spoke.name,
                expected.name
            );
            let info = node
                .status
                .as_ref()
                .and_then(|s| s.node_info.as_ref())
                .context("no nodeInfo")?;
            ensure!(
                info.kernel_version == expected.kernel,
                "{}: kernel {}",
                expected.name,
                info.kernel_version
            );
            ensure!(
                info.os_image == versions.kernels.os_image,
                "{}: osImage {}",
                expected.name,
                info.os_image
            );
            let label = node
                .metadata
                .labels
                .as_ref()
                .and_then(|l| l.get(KERNEL_LABEL));
            ensure!(
                label == Some(&expected.kernel),
                "{}: label {label:?}",
                expected.name
            );
            kernels_seen.push(expected.kernel.clone());
        }
    }
    ensure!(
        kernels_seen.contains(&versions.kernels.without_image),
        "no node runs the kernel without a sample image ({}); kernels: {kernels_seen:?}",
        versions.kernels.without_image
    );
    for flavour in ["-cloud-amd64", "-rt-amd64"] {
        ensure!(
            kernels_seen.iter().any(|k| k.ends_with(flavour)),
            "no {flavour} node in {kernels_seen:?}"
        );
    }
    Ok(())
}

#[tokio::test]
async fn a_pod_scheduled_onto_a_kwok_node_runs() -> Result<()> {
    let fleet = Fleet::get().await?;
    let spoke = fleet.state.spokes().next().context("no spoke")?;
    let client = fleet.spoke(&spoke.name)?.clone();
    let ns = TempNamespace::create(&client, "kmm-e2e-pod").await?;
    let target = &spoke.nodes[0].name;
    let pods: Api<Pod> = Api::namespaced(client.clone(), &ns.name);
    let pod: Pod = serde_json::from_value(json!({
        "metadata": { "name": "hello" },
        "spec": {
            "nodeSelector": { "kubernetes.io/hostname": target },
            "containers": [{ "name": "hello", "image": "registry.invalid/hello:1" }],
        },
    }))?;
    pods.create(&PostParams::default(), &pod).await?;
    let running = wait_until("the pod to be Running on its KWOK node", WAIT, || {
        let pods = pods.clone();
        async move {
            let pod = pods.get("hello").await.map_err(|e| e.to_string())?;
            let phase = pod
                .status
                .as_ref()
                .and_then(|s| s.phase.clone())
                .unwrap_or_default();
            if phase == "Running" {
                Ok(pod)
            } else {
                Err(format!("phase {phase:?}"))
            }
        }
    })
    .await?;
    let bound = running.spec.as_ref().and_then(|s| s.node_name.clone());
    ensure!(
        bound.as_ref() == Some(target),
        "scheduled to {bound:?}, expected {target}"
    );
    ns.delete().await?;
    Ok(())
}

#[tokio::test]
async fn a_manifestwork_lands_on_its_spoke_and_reports_status_feedback() -> Result<()> {
    let fleet = Fleet::get().await?;
    let names = fleet.spoke_names();
    let (target, other) = (&names[0], &names[1]);
    let namespace = unique("kmm-e2e-work");
    let works: Api<DynamicObject> =
        Api::namespaced_with(fleet.hub.clone(), target, &MANIFEST_WORK.api_resource());
    let work: DynamicObject = serde_json::from_value(json!({
        "apiVersion": MANIFEST_WORK.api_version(),
        "kind": MANIFEST_WORK.kind,
        "metadata": { "name": namespace },
        "spec": {
            "workload": { "manifests": [
                { "apiVersion": "v1", "kind": "Namespace", "metadata": { "name": namespace } },
                {
                    "apiVersion": "apps/v1", "kind": "Deployment",
                    "metadata": { "name": "hello", "namespace": namespace },
                    "spec": {
                        "replicas": 1,
                        "selector": { "matchLabels": { "app": "hello" } },
                        "template": {
                            "metadata": { "labels": { "app": "hello" } },
                            // KWOK runs the pod without pulling; a real node could not.
                            "spec": {
                                "nodeSelector": { NODE_TYPE_LABEL: "kwok" },
                                "containers": [{ "name": "hello", "image": "registry.invalid/hello:1" }],
                            },
                        },
                    },
                },
            ]},
            "manifestConfigs": [{
                "resourceIdentifier": { "group": "apps", "resource": "deployments", "name": "hello", "namespace": namespace },
                "feedbackRules": [{ "type": "WellKnownStatus" }],
            }],
        },
    }))?;
    works.create(&PostParams::default(), &work).await?;

    let ready = wait_until("status feedback readyReplicas=1 on the hub", WAIT, || {
        let works = works.clone();
        let namespace = namespace.clone();
        async move {
            let work = works.get(&namespace).await.map_err(|e| e.to_string())?;
            let manifests = work.data["status"]["resourceStatus"]["manifests"]
                .as_array()
                .cloned()
                .unwrap_or_default();
            let values = manifests
                .iter()
                .find(|m| m["resourceMeta"]["kind"] == "Deployment")
                .map(|m| m["statusFeedback"]["values"].clone())
                .unwrap_or(Value::Null);
            let ready = values
                .as_array()
                .and_then(|vs| vs.iter().find(|v| v["name"] == "ReadyReplicas"))
                .and_then(|v| v["fieldValue"]["integer"].as_i64());
            if ready == Some(1) {
                Ok(values)
            } else {
                Err(format!("feedback {values}"))
            }
        }
    })
    .await?;

    let landed: Api<Deployment> = Api::namespaced(fleet.spoke(target)?.clone(), &namespace);
    landed
        .get("hello")
        .await
        .with_context(|| format!("Deployment {namespace}/hello on {target}"))?;
    let elsewhere: Api<Deployment> = Api::namespaced(fleet.spoke(other)?.clone(), &namespace);
    ensure!(
        elsewhere.get_opt("hello").await?.is_none(),
        "the work also landed on {other}"
    );
    eprintln!("status feedback: {ready}");

    works.delete(&namespace, &DeleteParams::default()).await?;
    wait_until(
        "the spoke objects to be removed with the ManifestWork",
        WAIT,
        || {
            let landed = landed.clone();
            async move {
                match landed.get_opt("hello").await {
                    Ok(None) => Ok(()),
                    Ok(Some(_)) => Err("Deployment still present".into()),
                    Err(e) => Err(e.to_string()),
                }
            }
        },
    )
    .await?;
    Ok(())
}

#[tokio::test]
async fn the_registry_serves_a_sample_image_per_kernel_with_real_modules() -> Result<()> {
    let fleet = Fleet::get().await?;
    let versions = Versions::pinned();
    let client = oci_client::Client::new(ClientConfig {
        protocol: ClientProtocol::Http,
        ..Default::default()
    });
    for kernel in &versions.kernels.with_image {
        let image = format!("{}/{REPOSITORY}:{kernel}", fleet.state.registry);
        let reference = image.parse()?;
        let pulled = client
            .pull(
                &reference,
                &RegistryAuth::Anonymous,
                vec![oci_client::manifest::IMAGE_LAYER_GZIP_MEDIA_TYPE],
            )
            .await
            .with_context(|| format!("pulling {image}"))?;
        let layer = &pulled.layers.first().context("no layer")?.data;
        let mut archive = tar::Archive::new(flate2::read::GzDecoder::new(&layer[..]));
        let mut paths = vec![];
        let mut modules_dep = String::new();
        for entry in archive.entries()? {
            let mut entry = entry?;
            let path = entry.path()?.to_string_lossy().into_owned();
            if path.ends_with("modules.dep") {
                std::io::Read::read_to_string(&mut entry, &mut modules_dep)?;
            }
            paths.push(path);
        }
        let dir = format!("opt/lib/modules/{kernel}/");
        for module in MODULES {
            let ko = format!("{dir}extra/{module}.ko");
            ensure!(paths.contains(&ko), "{image} lacks {ko}: {paths:?}");
        }
        ensure!(
            modules_dep.contains("extra/kmm_hello_dep.ko: extra/kmm_hello.ko"),
            "{image}: modules.dep does not record the dependency:\n{modules_dep}"
        );
    }
    let missing = format!(
        "{}/{REPOSITORY}:{}",
        fleet.state.registry, versions.kernels.without_image
    );
    let reference = missing.parse()?;
    ensure!(
        client
            .pull_image_manifest(&reference, &RegistryAuth::Anonymous)
            .await
            .is_err(),
        "{missing} exists but should not"
    );
    Ok(())
}

#[tokio::test]
async fn the_generated_mcm_crd_is_structural_and_an_mcm_round_trips() -> Result<()> {
    let fleet = Fleet::get().await?;
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../addon-manifests/crds/hub.kmm.sigs.x-k8s.io_managedclustermodules.yaml"
    );
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {path}"))?;
    let crd: Value = serde_yaml_ng::from_str(&text)?;
    // Applying fails unless the schema is structural; apply_crd also waits for Established.
    apply_crd(&fleet.hub, &crd).await?;

    let gvk = GroupVersionKind::gvk("hub.kmm.sigs.x-k8s.io", "v1beta1", "ManagedClusterModule");
    let mcms: Api<DynamicObject> = Api::all_with(
        fleet.hub.clone(),
        &ApiResource::from_gvk_with_plural(&gvk, "managedclustermodules"),
    );
    let name = unique("kmm-e2e-mcm");
    // Shaped like an upstream KMM ManagedClusterModule.
    let spec = json!({
        "spokeNamespace": "kmm-hello",
        "selector": { "name": "spoke1" },
        "moduleSpec": {
            "moduleLoader": { "container": {
                "modprobe": { "moduleName": "kmm_hello_dep" },
                "kernelMappings": [{
                    "regexp": "^.+-amd64$",
                    "containerImage": format!("{}/{REPOSITORY}:${{KERNEL_FULL_VERSION}}", fleet.state.registry),
                }],
            }},
            "selector": { "kubernetes.io/os": "linux" },
        },
    });
    let mcm: DynamicObject = serde_json::from_value(json!({
        "apiVersion": "hub.kmm.sigs.x-k8s.io/v1beta1",
        "kind": "ManagedClusterModule",
        "metadata": { "name": name },
        "spec": spec,
    }))?;
    mcms.create(&PostParams::default(), &mcm).await?;
    let back = mcms.get(&name).await?;
    mcms.delete(&name, &DeleteParams::default()).await?;
    let back_spec = &back.data["spec"];
    for pointer in [
        "/spokeNamespace",
        "/selector/name",
        "/moduleSpec/moduleLoader/container/modprobe/moduleName",
        "/moduleSpec/moduleLoader/container/kernelMappings/0/regexp",
        "/moduleSpec/moduleLoader/container/kernelMappings/0/containerImage",
        "/moduleSpec/selector",
    ] {
        ensure!(
            back_spec.pointer(pointer) == spec.pointer(pointer),
            "{pointer} did not round-trip: sent {:?}, got {:?}",
            spec.pointer(pointer),
            back_spec.pointer(pointer)
        );
    }
    Ok(())
}

#[tokio::test]
async fn the_addon_apis_convert_between_versions_through_the_webhook() -> Result<()> {
    let fleet = Fleet::get().await?;
    let name = unique("kmm-e2e-addon");
    let in_version = |version| ocm::Resource {
        version,
        ..CLUSTER_MANAGEMENT_ADD_ON
    };
    let (alpha, beta) = (in_version("v1alpha1"), in_version("v1beta1"));
    let api = |resource: ocm::Resource| {
        Api::<DynamicObject>::all_with(fleet.hub.clone(), &resource.api_resource())
    };
    let (v1alpha1, v1beta1) = (api(alpha), api(beta));
    let addon: DynamicObject = serde_json::from_value(json!({
        "apiVersion": alpha.api_version(),
        "kind": alpha.kind,
        "metadata": { "name": name },
        "spec": {
            "addOnMeta": { "displayName": "e2e conversion probe" },
            "installStrategy": { "type": "Manual" },
        },
    }))?;
    v1alpha1.create(&PostParams::default(), &addon).await?;
    // Stored as v1alpha1; reading v1beta1 only works through the conversion webhook.
    let converted = v1beta1
        .get(&name)
        .await
        .context("reading the add-on as v1beta1")?;
    v1alpha1.delete(&name, &DeleteParams::default()).await?;
    ensure!(
        converted.types.as_ref().map(|t| t.api_version.as_str())
            == Some(beta.api_version().as_str()),
        "not converted: {:?}",
        converted.types
    );
    ensure!(
        converted.data["spec"]["addOnMeta"]["displayName"] == "e2e conversion probe",
        "lost in conversion: {}",
        converted.data["spec"]
    );
    Ok(())
}

#[tokio::test]
async fn a_placement_selects_every_spoke() -> Result<()> {
    let fleet = Fleet::get().await?;
    let ns = TempNamespace::create(&fleet.hub, "kmm-e2e-placement").await?;
    let api = |resource: ocm::Resource| {
        Api::<DynamicObject>::namespaced_with(fleet.hub.clone(), &ns.name, &resource.api_resource())
    };
    let bindings = api(MANAGED_CLUSTER_SET_BINDING);
    let binding: DynamicObject = serde_json::from_value(json!({
        "apiVersion": MANAGED_CLUSTER_SET_BINDING.api_version(),
        "kind": MANAGED_CLUSTER_SET_BINDING.kind,
        "metadata": { "name": "global" },
        "spec": { "clusterSet": "global" },
    }))?;
    bindings.create(&PostParams::default(), &binding).await?;
    let placements = api(PLACEMENT);
    let placement: DynamicObject = serde_json::from_value(json!({
        "apiVersion": PLACEMENT.api_version(),
        "kind": PLACEMENT.kind,
        "metadata": { "name": "all" },
        "spec": { "clusterSets": ["global"] },
    }))?;
    placements
        .create(&PostParams::default(), &placement)
        .await?;
    let decisions = api(PLACEMENT_DECISION);
    let mut expected = fleet.spoke_names();
    expected.sort();
    let chosen = wait_until("a PlacementDecision naming every spoke", WAIT, || {
        let decisions = decisions.clone();
        let expected = expected.clone();
        async move {
            let list = decisions
                .list(&kube::api::ListParams::default().labels(&format!("{PLACEMENT_LABEL}=all")))
                .await
                .map_err(|e| e.to_string())?;
            let mut chosen: Vec<String> = list
                .items
                .iter()
                .flat_map(|d| {
                    d.data["status"]["decisions"]
                        .as_array()
                        .cloned()
                        .unwrap_or_default()
                })
                .filter_map(|d| d["clusterName"].as_str().map(String::from))
                .collect();
            chosen.sort();
            if chosen == expected {
                Ok(chosen)
            } else {
                Err(format!("decisions {chosen:?}"))
            }
        }
    })
    .await?;
    eprintln!("placement chose {chosen:?}");
    ns.delete().await?;
    Ok(())
}

#[tokio::test]
async fn clusteradm_addon_enable_deploys_an_addon_template_to_the_chosen_spoke() -> Result<()> {
    let fleet = Fleet::get().await?;
    let names = fleet.spoke_names();
    let (target, other) = (&names[0], &names[1]);
    let name = unique("e2e-probe");
    let addon_api = |resource: ocm::Resource| {
        Api::<DynamicObject>::all_with(fleet.hub.clone(), &resource.api_resource())
    };
    let templates = addon_api(ADD_ON_TEMPLATE);
    let cmas = addon_api(CLUSTER_MANAGEMENT_ADD_ON);
    let template: DynamicObject = serde_json::from_value(json!({
        "apiVersion": ADD_ON_TEMPLATE.api_version(),
        "kind": ADD_ON_TEMPLATE.kind,
        "metadata": { "name": name },
        "spec": {
            "addonName": name,
            "agentSpec": { "workload": { "manifests": [{
                "apiVersion": "v1",
                "kind": "ConfigMap",
                "metadata": { "name": name, "namespace": "open-cluster-management-agent-addon" },
                "data": { "cluster": "{{CLUSTER_NAME}}" },
            }]}},
        },
    }))?;
    templates.create(&PostParams::default(), &template).await?;
    let cma: DynamicObject = serde_json::from_value(json!({
        "apiVersion": CLUSTER_MANAGEMENT_ADD_ON.api_version(),
        "kind": CLUSTER_MANAGEMENT_ADD_ON.kind,
        "metadata": {
            "name": name,
            "annotations": { "addon.open-cluster-management.io/lifecycle": "addon-manager" },
        },
        "spec": {
            "addOnMeta": { "displayName": "e2e probe" },
            "supportedConfigs": [{
                "group": ADD_ON_TEMPLATE.group,
                "resource": ADD_ON_TEMPLATE.plural,
                "defaultConfig": { "name": name },
            }],
            "installStrategy": { "type": "Manual" },
        },
    }))?;
    cmas.create(&PostParams::default(), &cma).await?;

    let toolchain = Toolchain::locate(
        &Versions::pinned(),
        Settings::from_env()?.bin_dir.as_deref(),
    )?;
    let hub_kubeconfig = &fleet.state.cluster("hub")?.kubeconfig;
    let out = tokio::process::Command::new(toolchain.bin("clusteradm"))
        .args([
            "addon",
            "enable",
            "--names",
            &name,
            "--clusters",
            target,
            "--kubeconfig",
        ])
        .arg(hub_kubeconfig)
        .output()
        .await?;
    ensure!(
        out.status.success(),
        "clusteradm addon enable: {}",
        String::from_utf8_lossy(&out.stderr)
    );

    let configmaps: Api<ConfigMap> = Api::namespaced(
        fleet.spoke(target)?.clone(),
        "open-cluster-management-agent-addon",
    );
    wait_until(
        "the add-on's ConfigMap, rendered for its cluster, on the spoke",
        WAIT,
        || {
            let configmaps = configmaps.clone();
            let name = name.clone();
            let target = target.clone();
            async move {
                let cm = configmaps.get_opt(&name).await.map_err(|e| e.to_string())?;
                let cluster = cm
                    .and_then(|cm| cm.data)
                    .and_then(|d| d.get("cluster").cloned());
                if cluster.as_ref() == Some(&target) {
                    Ok(())
                } else {
                    Err(format!("data.cluster {cluster:?}"))
                }
            }
        },
    )
    .await?;
    let mcas: Api<DynamicObject> = Api::namespaced_with(
        fleet.hub.clone(),
        target,
        &MANAGED_CLUSTER_ADD_ON.api_resource(),
    );
    wait_until("the ManagedClusterAddOn to be Available", WAIT, || {
        let mcas = mcas.clone();
        let name = name.clone();
        async move {
            let mca = mcas.get(&name).await.map_err(|e| e.to_string())?;
            if condition_true(&mca.data, "Available") {
                Ok(())
            } else {
                Err(format!("status {}", mca.data["status"]))
            }
        }
    })
    .await?;
    let elsewhere: Api<ConfigMap> = Api::namespaced(
        fleet.spoke(other)?.clone(),
        "open-cluster-management-agent-addon",
    );
    ensure!(
        elsewhere.get_opt(&name).await?.is_none(),
        "the add-on also landed on {other}"
    );

    cmas.delete(&name, &DeleteParams::default()).await?;
    wait_until(
        "the add-on's objects to be removed from the spoke",
        WAIT,
        || {
            let configmaps = configmaps.clone();
            let name = name.clone();
            async move {
                match configmaps.get_opt(&name).await {
                    Ok(None) => Ok(()),
                    Ok(Some(_)) => Err("ConfigMap still present".into()),
                    Err(e) => Err(e.to_string()),
                }
            }
        },
    )
    .await?;
    templates.delete(&name, &DeleteParams::default()).await?;
    Ok(())
}
