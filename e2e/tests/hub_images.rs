//! The hub's kmod images on the fleet: the installed kmm-hub asks the registry for every
//! image the fleet needs, pins each to the digest it found, and sends that digest to
//! every node; an image the registry lacks never reaches a node as a pull error but as
//! the hub's reason, and status lists every image with its state. The build-and-sign
//! example (`docs/examples/local-fleet-build-sign.yaml`) converges: a build Job on the
//! hub's real node, the hub's native signing, the signed bytes on every node.

mod support;

use std::time::Duration;

use anyhow::{Context, Result, ensure};
use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::{ConfigMap, Secret};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kmm_e2e::fixture::{Fleet, wait_until};
use kmm_e2e::guest::module_signing::TestKey;
use kmm_e2e::versions::Versions;
use kube::api::{DeleteParams, PostParams};
use kube::{Api, ResourceExt};
use serde_json::Value;
use support::*;

/// A build (~1 min on the fleet) then a signing.
const BUILD_WAIT: Duration = Duration::from_secs(420);

#[tokio::test]
async fn every_node_loads_the_digest_the_hub_pinned_and_a_missing_image_is_the_hubs_reason()
-> Result<()> {
    let fleet = Fleet::get().await?;
    let kmm = kmm(&fleet)?;
    let missing_kernel = Versions::pinned().kernels.without_image;
    // A cluster with a node whose kernel has a sample image and one whose kernel has none.
    let (spoke, with_image, without_image) = fleet
        .spoke_names()
        .into_iter()
        .find_map(|spoke| {
            let nodes = fleet.state.cluster(&spoke).ok()?.nodes.clone();
            let missing = nodes.iter().find(|n| n.kernel == missing_kernel)?.clone();
            let present = nodes_with_images(&fleet, &spoke).ok()?.into_iter().next()?;
            Some((spoke, present, missing))
        })
        .context("a spoke with a node of the kernel without a sample image")?;
    let (id, name) = (unique("kmm-e2e.dev/images"), unique("images"));
    label_cluster(&fleet.hub, &spoke, &id, true).await?;
    for node in [&with_image.0, &without_image.name] {
        label_node(fleet.spoke(&spoke)?, node, &id, true).await?;
    }
    create(&fleet.hub, &module(&name, &id, sample_mapping(&fleet))?).await?;

    let image = format!(
        "{}/samples/kmm-hello:{}",
        fleet.state.node_registry, with_image.1
    );
    let absent = format!(
        "{}/samples/kmm-hello:{missing_kernel}",
        fleet.state.node_registry
    );
    let images = wait_until("both images in the module's status", WAIT, || async {
        let status = status(&fleet.hub, &name).await.map_err(|e| e.to_string())?;
        let find = |image: &str| -> Option<Value> {
            status["images"]
                .as_array()?
                .iter()
                .find(|i| i["image"] == image)
                .cloned()
        };
        match (find(&image), find(&absent)) {
            (Some(found), Some(lost))
                if found["state"] == "Exists" && lost["state"] == "NotFound" =>
            {
                Ok((found, lost))
            }
            _ => Err(status.to_string()),
        }
    })
    .await?;
    let (found, lost) = images;
    let pinned = found["digest"].as_str().context("a digest")?.to_owned();
    let registry_digest = registry_digest(&format!(
        "{}/samples/kmm-hello:{}",
        fleet.state.registry, with_image.1
    ))
    .await?;
    ensure!(
        pinned == registry_digest,
        "status pins {pinned}, the registry has {registry_digest}"
    );
    ensure!(
        lost["reason"] == "ImageNotFound" && lost["kernels"][0] == missing_kernel.as_str(),
        "the missing image names its kernel and reason: {lost}"
    );

    // The node loads exactly the pinned bytes (the agent's own record) ...
    let agent = kmm
        .agents
        .iter()
        .find(|a| a.cluster == spoke && a.node == with_image.0)
        .context("the agent of the node with an image")?;
    let recorded = loaded_digest(agent, &format!("{NAMESPACE}/{name}")).await?;
    ensure!(
        recorded == pinned,
        "the agent loaded {recorded}, the hub pinned {pinned}"
    );

    // ... and the node without an image reports the hub's reason, not a pull error.
    let failure = wait_until(
        "the hub's reason for the node without image",
        WAIT,
        || async {
            let status = status(&fleet.hub, &name).await.map_err(|e| e.to_string())?;
            status["failures"]
                .as_array()
                .and_then(|f| {
                    f.iter()
                        .find(|f| f["node"] == without_image.name.as_str())
                        .cloned()
                })
                .ok_or_else(|| status.to_string())
        },
    )
    .await?;
    ensure!(
        failure["reason"] == "ImageNotFound"
            && failure["message"]
                .as_str()
                .is_some_and(|m| m.contains(&absent)),
        "{failure}"
    );

    delete(&fleet.hub, &name).await?;
    wait_labelled(&fleet, &name, &[]).await?;
    label_cluster(&fleet.hub, &spoke, &id, false).await?;
    Ok(())
}

/// The digest the registry serves for `image` now (plain HTTP, as the fleet's is).
async fn registry_digest(image: &str) -> Result<String> {
    let client = kmm_registry::client(kmm_registry::RegistryTls {
        insecure: true,
        insecure_skip_tls_verify: false,
    });
    Ok(kmm_registry::resolve_digest(&client, image, None).await?)
}

/// The label the build-and-sign example selects clusters by.
const SIGNED_DEMO: &str = "kmm.fleet/demo-signed";

#[tokio::test]
async fn the_build_and_sign_example_converges_with_modules_the_hub_built_and_signed() -> Result<()>
{
    let fleet = Fleet::get().await?;
    let kmm = kmm(&fleet)?;
    let kernel = Versions::pinned().kernels.without_image;
    let spoke = spoke_with_kernel(&fleet, &kernel)?;
    let example = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../docs/examples/local-fleet-build-sign.yaml"
    ))?
    .replace("registry.example.com", &fleet.state.node_registry);
    let documents: Vec<Value> = serde_yaml_ng::Deserializer::from_str(&example)
        .map(|d| serde::Deserialize::deserialize(d).map_err(anyhow::Error::from))
        .collect::<Result<_>>()?;
    let config_map: ConfigMap = serde_json::from_value(documents[0].clone())?;
    let module: kmm_api::ManagedClusterModule = serde_json::from_value(documents[1].clone())?;
    let name = module.name_any();
    // A run that failed half-way leaves the example's module behind.
    if Api::<kmm_api::ManagedClusterModule>::all(fleet.hub.clone())
        .get_opt(&name)
        .await?
        .is_some()
    {
        delete(&fleet.hub, &name).await?;
    }

    // The key pair, made per run as the example tells a user to.
    let work = std::env::temp_dir().join(format!("kmm-hub-images-{}", std::process::id()));
    let key = TestKey::generate(&work, "demo", "kmm demo")?;
    let secrets: Api<Secret> = Api::namespaced(fleet.hub.clone(), HUB_NAMESPACE);
    for (secret, field, path) in [
        ("kmm-hello-signing-key", "key", &key.key),
        ("kmm-hello-signing-cert", "cert", &key.cert),
    ] {
        let object = Secret {
            metadata: ObjectMeta {
                name: Some(secret.to_owned()),
                ..ObjectMeta::default()
            },
            data: Some([(field.to_owned(), ByteString(std::fs::read(path)?))].into()),
            ..Secret::default()
        };
        apply(&secrets, secret, &object).await?;
    }
    let config_maps: Api<ConfigMap> = Api::namespaced(fleet.hub.clone(), HUB_NAMESPACE);
    apply(&config_maps, "kmm-hello-build", &config_map).await?;
    create(&fleet.hub, &module).await?;
    label_cluster_with(&fleet.hub, &spoke, SIGNED_DEMO, Some("true")).await?;

    let started = std::time::Instant::now();
    let image = format!(
        "{}/kmm-demo/kmm-hello-signed:{kernel}",
        fleet.state.node_registry
    );
    let pinned = wait_until("the built and signed image pinned", BUILD_WAIT, || async {
        let status = status(&fleet.hub, &name).await.map_err(|e| e.to_string())?;
        let entry = status["images"]
            .as_array()
            .and_then(|i| i.iter().find(|i| i["image"] == image.as_str()).cloned())
            .ok_or_else(|| status.to_string())?;
        match (entry["state"].as_str(), entry["digest"].as_str()) {
            (Some("Exists"), Some(digest)) => Ok(digest.to_owned()),
            _ => Err(entry.to_string()),
        }
    })
    .await?;
    println!(
        "hub-images: module created -> built and signed image pinned in {:.1}s",
        started.elapsed().as_secs_f64()
    );

    // Every node on that kernel loads exactly the signed bytes.
    let agents: Vec<_> = kmm
        .agents
        .iter()
        .filter(|a| a.cluster == spoke)
        .filter(|a| {
            fleet.state.cluster(&spoke).is_ok_and(|c| {
                c.nodes
                    .iter()
                    .any(|n| n.name == a.node && n.kernel == kernel)
            })
        })
        .collect();
    ensure!(!agents.is_empty(), "no agent on {kernel} in {spoke}");
    for agent in agents {
        let recorded = loaded_digest(agent, &format!("kmm-demo/{name}")).await?;
        ensure!(
            recorded == pinned,
            "{} loaded {recorded}, the hub pinned {pinned}",
            agent.node
        );
    }

    // The signed image's modules end with a signature (what the agent extracted).
    let signed = signed_modules(&format!(
        "{}/kmm-demo/kmm-hello-signed:{kernel}",
        fleet.state.registry
    ))
    .await?;
    ensure!(
        signed == 2,
        "both modules signed in the pushed image, found {signed}"
    );

    label_cluster_with(&fleet.hub, &spoke, SIGNED_DEMO, None).await?;
    delete(&fleet.hub, &name).await?;
    let _ = config_maps
        .delete("kmm-hello-build", &DeleteParams::default())
        .await;
    for secret in ["kmm-hello-signing-key", "kmm-hello-signing-cert"] {
        let _ = secrets.delete(secret, &DeleteParams::default()).await;
    }
    std::fs::remove_dir_all(&work)?;
    Ok(())
}

/// A kernel no node of the fleet runs.
const FUTURE_KERNEL: &str = "6.1.0-99-amd64";

#[tokio::test]
async fn a_preflight_builds_and_signs_ahead_for_a_kernel_no_node_runs_and_sends_nothing()
-> Result<()> {
    let fleet = Fleet::get().await?;
    kmm(&fleet)?;
    let versions = Versions::pinned();
    ensure!(
        !versions.kernels.all().iter().any(|k| k == FUTURE_KERNEL),
        "{FUTURE_KERNEL} is a fleet kernel"
    );
    let (id, built) = (unique("kmm-e2e.dev/preflight"), unique("preflight-built"));
    let sample = unique("preflight-sample");
    // The fleet's builder base has headers for one kernel: the build compiles against
    // those and installs the result for the future kernel, which nothing ever loads.
    let headers = &versions.kernels.without_image;
    let dockerfile = format!(
        "FROM {registry}/kmm-fleet/kmod-builder-base:{headers} AS build\n\
         ARG KERNEL_FULL_VERSION\n\
         RUN make -C /usr/src/linux-headers-{headers} M=/usr/src/kmm-hello modules\n\
         RUN mkdir -p /opt/lib/modules/${{KERNEL_FULL_VERSION}}/extra \\\n\
           && cp /usr/src/kmm-hello/kmm_hello.ko /usr/src/kmm-hello/kmm_hello_dep.ko \
         /opt/lib/modules/${{KERNEL_FULL_VERSION}}/extra/ \\\n\
           && depmod -b /opt ${{KERNEL_FULL_VERSION}}\n\
         FROM scratch\n\
         COPY --from=build /opt /opt\n",
        registry = fleet.state.node_registry
    );
    let work = std::env::temp_dir().join(format!("kmm-preflight-{}", std::process::id()));
    let key = TestKey::generate(&work, "preflight", "kmm preflight")?;
    let secrets: Api<Secret> = Api::namespaced(fleet.hub.clone(), HUB_NAMESPACE);
    for (field, path) in [("key", &key.key), ("cert", &key.cert)] {
        let object = Secret {
            metadata: ObjectMeta {
                name: Some(format!("{built}-{field}")),
                ..ObjectMeta::default()
            },
            data: Some([(field.to_owned(), ByteString(std::fs::read(path)?))].into()),
            ..Secret::default()
        };
        apply(&secrets, &format!("{built}-{field}"), &object).await?;
    }
    let config_maps: Api<ConfigMap> = Api::namespaced(fleet.hub.clone(), HUB_NAMESPACE);
    let config_map: ConfigMap = serde_json::from_value(serde_json::json!({
        "metadata": { "name": built },
        "data": { "dockerfile": dockerfile },
    }))?;
    apply(&config_maps, &built, &config_map).await?;
    let image = format!("{}/kmm-preflight/{built}", fleet.state.node_registry);
    let with_recipe = module(
        &built,
        &id,
        serde_json::json!([{
            "literal": FUTURE_KERNEL,
            "containerImage": format!("{image}:${{KERNEL_FULL_VERSION}}"),
            "build": {
                "dockerfileConfigMap": { "name": built },
                "baseImageRegistryTLS": { "insecure": true },
            },
            "sign": {
                "keySecret": { "name": format!("{built}-key") },
                "certSecret": { "name": format!("{built}-cert") },
                "unsignedImageRegistryTLS": { "insecure": true },
                "filesToSign": [
                    "/opt/lib/modules/${KERNEL_FULL_VERSION}/extra/kmm_hello.ko",
                    "/opt/lib/modules/${KERNEL_FULL_VERSION}/extra/kmm_hello_dep.ko",
                ],
            },
        }]),
    )?;
    create(&fleet.hub, &with_recipe).await?;
    create(&fleet.hub, &module(&sample, &id, sample_mapping(&fleet))?).await?;
    // A cluster runs both modules on its own kernels meanwhile.
    let spoke = fleet.spoke_names()[0].clone();
    label_cluster(&fleet.hub, &spoke, &id, true).await?;

    let preflights = Api::<kmm_api::PreflightValidation>::all(fleet.hub.clone());
    let preflight: kmm_api::PreflightValidation = serde_json::from_value(serde_json::json!({
        "apiVersion": "hub.kmm.sigs.x-k8s.io/v1beta1",
        "kind": "PreflightValidation",
        "metadata": { "name": built },
        "spec": { "kernelVersion": FUTURE_KERNEL, "pushBuiltImage": true },
    }))?;
    preflights
        .create(&PostParams::default(), &preflight)
        .await?;
    let started = std::time::Instant::now();
    let verdicts = wait_until(
        "the preflight's verdict on both modules",
        BUILD_WAIT,
        || async {
            let status = preflights
                .get(&built)
                .await
                .map_err(|e| e.to_string())?
                .status
                .ok_or("no status")?;
            let find = |name: &str| status.modules.iter().find(|m| m.name == name).cloned();
            match (find(&built), find(&sample)) {
                (Some(b), Some(s))
                    if b.verification_stage == "Done" && s.verification_stage == "Done" =>
                {
                    Ok((b, s))
                }
                other => Err(format!("{other:?}")),
            }
        },
    )
    .await?;
    println!(
        "preflight: built and signed ahead for {FUTURE_KERNEL} in {:.1}s",
        started.elapsed().as_secs_f64()
    );
    let (built_verdict, sample_verdict) = verdicts;
    ensure!(
        built_verdict.verification_status == "True",
        "the built module verifies: {built_verdict:?}"
    );
    ensure!(
        sample_verdict.verification_status == "False"
            && sample_verdict.status_reason.contains("ImageNotFound"),
        "the sample module has no image for the kernel: {sample_verdict:?}"
    );
    let signed = signed_modules(&format!(
        "{}/kmm-preflight/{built}:{FUTURE_KERNEL}",
        fleet.state.registry
    ))
    .await?;
    ensure!(
        signed == 2,
        "both modules signed in the pushed image, found {signed}"
    );
    // No cluster got the kernel: the spoke's nodes resolve nothing for the built module.
    let status = status(&fleet.hub, &built).await?;
    ensure!(
        status["kernels"]["resolved"] == 0 && status["nodes"]["loaded"] == 0,
        "the preflight reached a cluster: {status}"
    );

    label_cluster(&fleet.hub, &spoke, &id, false).await?;
    preflights.delete(&built, &DeleteParams::default()).await?;
    for name in [&built, &sample] {
        delete(&fleet.hub, name).await?;
    }
    let _ = config_maps.delete(&built, &DeleteParams::default()).await;
    for field in ["key", "cert"] {
        let _ = secrets
            .delete(&format!("{built}-{field}"), &DeleteParams::default())
            .await;
    }
    std::fs::remove_dir_all(&work)?;
    Ok(())
}

/// How many `.ko` files of `image`'s last layer end with Linux's signature marker.
async fn signed_modules(image: &str) -> Result<usize> {
    let client = kmm_registry::client(kmm_registry::RegistryTls {
        insecure: true,
        insecure_skip_tls_verify: false,
    });
    let reference = kmm_registry::parse_reference(image)?;
    let data = client
        .pull(
            &reference,
            &oci_client::secrets::RegistryAuth::Anonymous,
            vec![
                oci_client::manifest::IMAGE_LAYER_GZIP_MEDIA_TYPE,
                oci_client::manifest::IMAGE_LAYER_MEDIA_TYPE,
                oci_client::manifest::IMAGE_DOCKER_LAYER_GZIP_MEDIA_TYPE,
            ],
        )
        .await?;
    // Layers arrive in download order; the manifest says which is the top one.
    let manifest = data.manifest.as_ref().context("a manifest")?;
    let top = &manifest.layers.last().context("a layer")?.digest;
    let last = data
        .layers
        .iter()
        .find(|layer| layer.sha256_digest() == *top)
        .context("the top layer downloaded")?;
    let mut archive = tar::Archive::new(flate2::read::GzDecoder::new(last.data.as_slice()));
    let mut signed = 0;
    for entry in archive.entries()? {
        let mut entry = entry?;
        let path = entry.path()?.to_string_lossy().into_owned();
        if path.ends_with(".ko") {
            let mut bytes = vec![];
            std::io::Read::read_to_end(&mut entry, &mut bytes)?;
            if bytes.ends_with(b"~Module signature appended~\n") {
                signed += 1;
            }
        }
    }
    Ok(signed)
}

/// Creates `object`, or replaces the one a failed earlier run left.
async fn apply<K>(api: &Api<K>, name: &str, object: &K) -> Result<()>
where
    K: kube::Resource + Clone + serde::Serialize + serde::de::DeserializeOwned + std::fmt::Debug,
{
    let _ = api.delete(name, &DeleteParams::default()).await;
    wait_until("the old object gone", WAIT, || async {
        match api.get_opt(name).await {
            Ok(None) => Ok(()),
            other => Err(format!("{other:?}")),
        }
    })
    .await?;
    api.create(&PostParams::default(), object).await?;
    Ok(())
}
