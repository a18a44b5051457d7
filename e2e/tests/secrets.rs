//! Secrets never leave the hub's API. A module pulls from a registry behind a password
//! (its pull secret) and is signed by the hub (its signing key). Once its node has loaded
//! it (which takes both secrets), no file of the fleet (logs, the nodes' state, what the
//! agents wrote), no Pod log and no API object of any cluster, the hub's Secrets aside,
//! holds any of the secrets' values, in any of the forms they travel in.

mod support;

use std::io::Read as _;
use std::net::IpAddr;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, ensure};
use base64::Engine as _;
use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::{Pod, Secret};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kmm_e2e::fixture::{Fleet, wait_until};
use kmm_e2e::guest::module_signing::TestKey;
use kmm_e2e::kmod;
use kmm_registry_fixture::RegistryServer;
use kube::api::{DeleteParams, DynamicObject, ListParams, LogParams, PostParams};
use kube::discovery::{Discovery, verbs};
use kube::{Api, Client};
use serde_json::{Value, json};
use support::*;

/// A needle and what it stands for, for the failure message.
struct Needle {
    what: String,
    bytes: Vec<u8>,
}

#[tokio::test]
async fn neither_the_pull_secret_nor_the_signing_key_leaves_the_hubs_api() -> Result<()> {
    let fleet = Fleet::get().await?;
    let kmm = kmm(&fleet)?;
    let gateway = fleet
        .state
        .network
        .as_ref()
        .context("the fleet has no bridge")?
        .gateway;
    // Random, so that finding it anywhere means this run leaked it.
    let password = random_hex(16)?;
    let user = "kmm-e2e-leak";
    let registry = RegistryServer::plain_with_auth_on(IpAddr::V4(gateway), user, &password)?;

    let spoke = kmm.spokes.first().context("a spoke with kmm")?.clone();
    let (node, kernel) = nodes_with_images(&fleet, &spoke)?
        .into_iter()
        .find(|(node, _)| kmm.agents.iter().any(|a| a.node == *node && a.simulated))
        .context("a KWOK node with a sample image")?;
    let agent = kmm
        .agents
        .iter()
        .find(|a| a.node == node)
        .context("the node's agent")?;

    // The unsigned sample, only behind the password.
    let built = {
        let kernel = kernel.clone();
        tokio::task::spawn_blocking(move || kmod::build(&kernel)).await??
    };
    let files = files_below(&built)?;
    let refs: Vec<(&str, &[u8])> = files
        .iter()
        .map(|(path, bytes)| (path.as_str(), bytes.as_slice()))
        .collect();
    registry
        .push_files(&format!("kmm-e2e/leak-unsigned:{kernel}"), &refs)
        .await?;

    let name = unique("leak");
    let dir = tempfile::tempdir()?;
    let key = TestKey::generate(dir.path(), "leak", "kmm-e2e secrets test")?;
    let docker_config = registry.docker_config_json(user, &password);
    let key_pem = std::fs::read(&key.key)?;
    let secrets: Api<Secret> = Api::namespaced(fleet.hub.clone(), HUB_NAMESPACE);
    let (pull, key_secret, cert_secret) = (
        format!("{name}-pull"),
        format!("{name}-key"),
        format!("{name}-cert"),
    );
    for (secret, type_, field, bytes) in [
        (
            &pull,
            "kubernetes.io/dockerconfigjson",
            ".dockerconfigjson",
            docker_config.clone().into_bytes(),
        ),
        (&key_secret, "Opaque", "key", key_pem.clone()),
        (&cert_secret, "Opaque", "cert", std::fs::read(&key.cert)?),
    ] {
        let object = Secret {
            metadata: ObjectMeta {
                name: Some(secret.clone()),
                ..ObjectMeta::default()
            },
            type_: Some(type_.to_owned()),
            data: Some([(field.to_owned(), ByteString(bytes))].into()),
            ..Secret::default()
        };
        secrets.create(&PostParams::default(), &object).await?;
    }

    let extra = "/opt/lib/modules/${KERNEL_FULL_VERSION}/extra";
    let mapping = json!([{
        "literal": kernel,
        "containerImage": registry.image("kmm-e2e/leak-signed:${KERNEL_FULL_VERSION}"),
        "sign": {
            "keySecret": { "name": key_secret },
            "certSecret": { "name": cert_secret },
            "unsignedImage": registry.image("kmm-e2e/leak-unsigned:${KERNEL_FULL_VERSION}"),
            "unsignedImageRegistryTLS": { "insecure": true },
            "filesToSign": [
                format!("{extra}/kmm_hello_dep.ko"),
                format!("{extra}/kmm_hello.ko"),
            ],
        },
    }]);
    let mut module = module(&name, &name, mapping)?;
    module.spec.module_spec.image_repo_secret =
        Some(serde_json::from_value(json!({ "name": pull }))?);
    label_cluster(&fleet.hub, &spoke, &name, true).await?;
    label_node(fleet.spoke(&spoke)?, &node, &name, true).await?;
    create(&fleet.hub, &module).await?;
    wait_labelled(&fleet, &name, &[(spoke.clone(), node.clone())]).await?;

    // Both secrets were used: the node loaded the hub's signed image, which only the
    // password lets anyone pull.
    let signed = registry
        .client()
        .fetch_manifest_digest(
            &registry
                .image(&format!("kmm-e2e/leak-signed:{kernel}"))
                .parse()?,
            &registry.auth(),
        )
        .await?;
    let loaded = wait_until("the agent's record of the load", WAIT, || async {
        let state: Value = std::fs::read(agent.state_file())
            .ok()
            .and_then(|b| serde_json::from_slice(&b).ok())
            .ok_or("no state yet")?;
        state["modules"][format!("{NAMESPACE}/{name}")]["digest"]
            .as_str()
            .map(str::to_owned)
            .ok_or_else(|| state.to_string())
    })
    .await?;
    ensure!(
        loaded == signed,
        "the node loaded {loaded}, the hub signed {signed}"
    );

    let needles = needles(user, &password, &docker_config, &key_pem);
    // The search finds the secrets where they are meant to be: in the hub's Secrets.
    let stored = serde_json::to_vec(&secrets.get(&pull).await?)?;
    ensure!(
        found_in(&stored, &needles).is_some(),
        "the search does not find the pull secret in its own Secret"
    );
    let stored = serde_json::to_vec(&secrets.get(&key_secret).await?)?;
    ensure!(
        found_in(&stored, &needles).is_some(),
        "the search does not find the key in its own Secret"
    );

    let mut leaks = vec![];
    let mut searched = Searched::default();
    // Every file of the fleet: process logs, the nodes' kubelet state and Pod logs, the
    // KWOK nodes' agents' files. etcd's data is the API's own storage, searched below
    // object by object.
    let state_dir = settings()?.state_dir;
    search_files(
        &state_dir,
        &[state_dir.join("etcd")],
        &needles,
        &mut leaks,
        &mut searched,
    )?;
    // What the real nodes' agents wrote, in those nodes' private mounts.
    for agent in kmm.agents.iter().filter(|a| !a.simulated) {
        for dir in ["run/kmm", "var/cache/kmm", "var/lib/kmm", "var/log"] {
            search_files(
                &agent.root.join(dir),
                &[],
                &needles,
                &mut leaks,
                &mut searched,
            )?;
        }
    }
    // Every Pod log and every API object of every cluster.
    for (cluster, client) in std::iter::once(("hub".to_owned(), fleet.hub.clone())).chain(
        fleet
            .spoke_names()
            .into_iter()
            .map(|s| Ok::<_, anyhow::Error>((s.clone(), fleet.spoke(&s)?.clone())))
            .collect::<Result<Vec<_>>>()?,
    ) {
        search_pod_logs(&cluster, &client, &needles, &mut leaks, &mut searched).await?;
        search_objects(&cluster, &client, &needles, &mut leaks, &mut searched).await?;
    }
    ensure!(
        searched.files > 100 && searched.pod_logs > 0 && searched.objects > 100,
        "searched too little to mean anything: {searched:?}"
    );
    ensure!(
        leaks.is_empty(),
        "secrets found outside the hub's API: {leaks:#?}"
    );
    eprintln!("secrets: none found in {searched:?}");

    label_node(fleet.spoke(&spoke)?, &node, &name, false).await?;
    delete(&fleet.hub, &name).await?;
    label_cluster(&fleet.hub, &spoke, &name, false).await?;
    for secret in [&pull, &key_secret, &cert_secret] {
        secrets.delete(secret, &DeleteParams::default()).await?;
    }
    Ok(())
}

/// Every form a value of the two Secrets travels or could be stored in: as text, as the
/// base64 of a Secret's data or an `auth` field, and as the numbers a derived `Debug` of
/// bytes (prost's included) prints.
fn needles(user: &str, password: &str, docker_config: &str, key_pem: &[u8]) -> Vec<Needle> {
    let b64 = |bytes: &[u8]| base64::engine::general_purpose::STANDARD.encode(bytes);
    let numbers = |bytes: &[u8]| {
        let text = format!("{:?}", &bytes[..bytes.len().min(48)]);
        text.trim_matches(|c| c == '[' || c == ']').to_owned()
    };
    // A line from the middle of the key's PEM: its body, whatever the framing.
    let key_text = String::from_utf8_lossy(key_pem).into_owned();
    let key_lines: Vec<&str> = key_text
        .lines()
        .filter(|l| !l.starts_with("-----"))
        .collect();
    let key_line = key_lines[key_lines.len() / 2].to_owned();
    let needles = vec![
        ("the registry password", password.as_bytes().to_vec()),
        (
            "the pull secret's auth field",
            b64(format!("{user}:{password}").as_bytes()).into_bytes(),
        ),
        (
            "the pull secret as Secret data",
            b64(docker_config.as_bytes()).into_bytes(),
        ),
        (
            "the pull secret as Debug bytes",
            numbers(docker_config.as_bytes()).into_bytes(),
        ),
        ("a line of the signing key", key_line.into_bytes()),
        ("the signing key as Secret data", b64(key_pem).into_bytes()),
        (
            "the signing key as Debug bytes",
            numbers(key_pem).into_bytes(),
        ),
        (
            "the password as Debug bytes",
            numbers(password.as_bytes()).into_bytes(),
        ),
    ];
    needles
        .into_iter()
        .map(|(what, bytes)| Needle {
            what: what.to_owned(),
            bytes,
        })
        .collect()
}

fn found_in<'n>(haystack: &[u8], needles: &'n [Needle]) -> Option<&'n str> {
    needles
        .iter()
        .find(|n| memchr::memmem::find(haystack, &n.bytes).is_some())
        .map(|n| n.what.as_str())
}

#[derive(Debug, Default)]
struct Searched {
    files: usize,
    bytes: u64,
    pod_logs: usize,
    objects: usize,
}

/// Searches every regular file below `dir` (if it exists), except below `skip`.
fn search_files(
    dir: &Path,
    skip: &[PathBuf],
    needles: &[Needle],
    leaks: &mut Vec<String>,
    searched: &mut Searched,
) -> Result<()> {
    if !dir.exists() || skip.iter().any(|s| dir.starts_with(s)) {
        return Ok(());
    }
    for entry in std::fs::read_dir(dir).with_context(|| format!("reading {}", dir.display()))? {
        let entry = entry?;
        let path = entry.path();
        let kind = entry.file_type()?;
        if kind.is_dir() {
            search_files(&path, skip, needles, leaks, searched)?;
        } else if kind.is_file() {
            let mut bytes = vec![];
            // A file may go while the fleet runs (a rotated log, a finished container).
            let Ok(mut file) = std::fs::File::open(&path) else {
                continue;
            };
            if file.read_to_end(&mut bytes).is_err() {
                continue;
            }
            searched.files += 1;
            searched.bytes += bytes.len() as u64;
            if let Some(what) = found_in(&bytes, needles) {
                leaks.push(format!("{what} in {}", path.display()));
            }
        }
    }
    Ok(())
}

/// The logs of every container of every Pod that has any (KWOK's Pods have none).
async fn search_pod_logs(
    cluster: &str,
    client: &Client,
    needles: &[Needle],
    leaks: &mut Vec<String>,
    searched: &mut Searched,
) -> Result<()> {
    let pods: Api<Pod> = Api::all(client.clone());
    for pod in pods.list(&ListParams::default()).await? {
        let (Some(namespace), Some(name)) = (pod.metadata.namespace, pod.metadata.name) else {
            continue;
        };
        let containers = pod.spec.map(|s| s.containers).unwrap_or_default();
        let api: Api<Pod> = Api::namespaced(client.clone(), &namespace);
        for container in containers {
            let params = LogParams {
                container: Some(container.name.clone()),
                ..LogParams::default()
            };
            let Ok(log) = api.logs(&name, &params).await else {
                continue;
            };
            searched.pod_logs += 1;
            if let Some(what) = found_in(log.as_bytes(), needles) {
                leaks.push(format!(
                    "{what} in the log of {cluster}/{namespace}/{name}/{}",
                    container.name
                ));
            }
        }
    }
    Ok(())
}

/// Every object of every listable resource, the hub's Secrets aside (the API is where
/// secrets belong).
async fn search_objects(
    cluster: &str,
    client: &Client,
    needles: &[Needle],
    leaks: &mut Vec<String>,
    searched: &mut Searched,
) -> Result<()> {
    let discovery = Discovery::new(client.clone()).run().await?;
    for group in discovery.groups() {
        for (resource, capabilities) in group.recommended_resources() {
            if !capabilities.supports_operation(verbs::LIST)
                || (cluster == "hub" && resource.group.is_empty() && resource.kind == "Secret")
            {
                continue;
            }
            // All namespaces at once for namespaced resources.
            let api: Api<DynamicObject> = Api::all_with(client.clone(), &resource);
            let Ok(list) = api.list(&ListParams::default()).await else {
                continue;
            };
            for object in list {
                searched.objects += 1;
                let bytes = serde_json::to_vec(&object)?;
                if let Some(what) = found_in(&bytes, needles) {
                    leaks.push(format!(
                        "{what} in {cluster}: {} {}/{}",
                        resource.kind,
                        object.metadata.namespace.unwrap_or_default(),
                        object.metadata.name.unwrap_or_default()
                    ));
                }
            }
        }
    }
    Ok(())
}

/// `(path inside the image, contents)` of every file below `root`.
fn files_below(root: &Path) -> Result<Vec<(String, Vec<u8>)>> {
    let mut files = vec![];
    let mut dirs = vec![root.to_path_buf()];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir)? {
            let path = entry?.path();
            if path.is_dir() {
                dirs.push(path);
            } else {
                let inside = path.strip_prefix(root)?.display().to_string();
                files.push((inside, std::fs::read(&path)?));
            }
        }
    }
    Ok(files)
}

fn random_hex(bytes: usize) -> Result<String> {
    let mut buffer = vec![0u8; bytes];
    std::fs::File::open("/dev/urandom")?.read_exact(&mut buffer)?;
    Ok(buffer.iter().map(|b| format!("{b:02x}")).collect())
}
