//! kmod image builds as kmm-hub runs them: `kmm_hub::build::BuildJobs` on the local
//! fleet's hub cluster, as the hub's ServiceAccount (impersonated, so the RBAC of
//! `addon-manifests/hub` is what allows it), in the builds namespace those manifests
//! create. The builds are real Pods on the hub's real node, running the builder image
//! (`hub/builder`, buildah) and pulling `kmm-fleet/kmod-builder-base:<kernel>` from the
//! fleet's registry: Debian's headers for a kernel no sample image exists for, compiled
//! against with no network.
//!
//! * a real build compiles kmm_hello for that kernel and pushes the image, which holds
//!   the module;
//! * a failing Dockerfile reports `Failed` with the end of its log;
//! * the same request twice makes one Job, a changed build argument exactly one more,
//!   and `cleanup` deletes the one no longer wanted;
//! * deleting the owning ManagedClusterModule deletes its Jobs and their copied inputs.
//!
//! Each test owns a real ManagedClusterModule labelled for no hub of the fleet's. The
//! tests run one at a time: builds are heavy for 2 cores. Figures start with `builds:`.

use std::collections::{BTreeMap, BTreeSet};
use std::io::Read;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use k8s_openapi::ByteString;
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::{ConfigMap, Namespace, Secret};
use k8s_openapi::api::rbac::v1::{Role, RoleBinding};
use kmm_api::ManagedClusterModule;
use kmm_e2e::fixture::{Fleet, wait_until};
use kmm_e2e::kmod_builder;
use kmm_e2e::versions::Versions;
use kmm_hub::build::job::{FINGERPRINT_LABEL, MODULE_UID_LABEL};
use kmm_hub::build::{BuildJobs, BuildProgress, BuildRequest};
use kmm_registry::RegistryCas;
use kmm_resolver::ModuleIdentity;
use kmm_resolver::Resolver;
use kube::api::{DeleteParams, ListParams, ObjectMeta, Patch, PatchParams, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Api, Client, ResourceExt};
use oci_client::client::{ClientConfig, ClientProtocol};
use oci_client::secrets::RegistryAuth;
use serde_json::json;
use tokio::sync::{Mutex, OnceCell};

/// The hub's namespace as the fleet installs it; the builds run in `kmm-hub-builds`.
const HUB_NAMESPACE: &str = "kmm-hub";
const HUB_SERVICE_ACCOUNT: &str = "system:serviceaccount:kmm-hub:kmm-hub";
/// Modules with this label are left alone by the fleet's hub.
const TEST_LABEL: &str = "test.kmm.sigs.x-k8s.io/hub";
/// A real build: pulling the base (~90 MiB compressed) into vfs storage and compiling.
const BUILD_TIMEOUT: Duration = Duration::from_secs(600);
const WAIT: Duration = Duration::from_secs(120);

/// One test at a time.
static SERIAL: Mutex<()> = Mutex::const_new(());
static SETUP: OnceCell<Setup> = OnceCell::const_new();

/// What every test builds with.
#[derive(Debug)]
struct Setup {
    /// The builder as the node pulls it, pinned by digest.
    builder: String,
    /// `kmm-fleet/kmod-builder-base:<kernel>` as the node pulls it.
    base: String,
    /// The kernel the base has headers for: a Debian kernel without a sample image.
    kernel: String,
    /// The registry from this machine and from the nodes.
    registry: String,
    node_registry: String,
}

/// The fleet, with the builder image and the kmod builder base in its registry (built
/// once per test binary; unchanged images are not rebuilt) and the builds namespace
/// and RBAC of `addon-manifests/hub/builds.yaml` applied (as `env up` does).
async fn setup(fleet: &Fleet) -> Result<&'static Setup> {
    SETUP
        .get_or_try_init(|| async {
            let registry = fleet.state.registry.clone();
            let kernel = Versions::pinned().kernels.without_image;
            let started = Instant::now();
            let (builder, base) = tokio::task::spawn_blocking({
                let (registry, kernel) = (registry.clone(), kernel.clone());
                move || -> Result<_> {
                    let builder =
                        kmm_images::builder(&kmm_images::Options::new(Some(registry.clone())))?;
                    let base = kmod_builder::ensure(&kernel, Some(&registry))?;
                    Ok((builder, base))
                }
            })
            .await??;
            const MIB: f64 = 1024.0 * 1024.0;
            for image in [&builder, &base] {
                eprintln!(
                    "builds: image {} size_mib={:.1} compressed_mib={:.1} {}",
                    image.pushed.as_deref().unwrap_or(&image.reference),
                    image.size as f64 / MIB,
                    image.compressed_size as f64 / MIB,
                    if image.rebuilt { "built" } else { "unchanged" },
                );
            }
            eprintln!(
                "builds: images ready in {:.1}s",
                started.elapsed().as_secs_f64()
            );
            let pushed = builder.pushed.context("the builder was not pushed")?;
            let digest = oci()
                .fetch_manifest_digest(&pushed.parse()?, &RegistryAuth::Anonymous)
                .await
                .with_context(|| format!("the digest of {pushed}"))?;
            let repository = pushed.rsplit_once(':').context("a tag")?.0;
            let node_registry = fleet.state.node_registry.clone();
            apply_builds_manifests(&fleet.hub).await?;
            Ok(Setup {
                builder: format!(
                    "{}@{digest}",
                    repository.replacen(&registry, &node_registry, 1)
                ),
                base: format!("{node_registry}/{}", kmod_builder::repository(&kernel)),
                kernel,
                registry,
                node_registry,
            })
        })
        .await
}

fn oci() -> oci_client::Client {
    oci_client::Client::new(ClientConfig {
        protocol: ClientProtocol::Http,
        ..Default::default()
    })
}

/// Server-side applies the Namespace, Role and RoleBinding of `builds.yaml`.
async fn apply_builds_manifests(hub: &Client) -> Result<()> {
    let text = include_str!("../../addon-manifests/hub/builds.yaml");
    let params = PatchParams::apply("kmm-e2e-builds").force();
    for document in serde_yaml_ng::Deserializer::from_str(text) {
        let value: serde_json::Value = serde::Deserialize::deserialize(document)?;
        let name = value["metadata"]["name"]
            .as_str()
            .context("a name")?
            .to_owned();
        let namespace = value["metadata"]["namespace"].as_str().map(str::to_owned);
        match value["kind"].as_str() {
            Some("Namespace") => {
                Api::<Namespace>::all(hub.clone())
                    .patch(&name, &params, &Patch::Apply(&value))
                    .await?;
            }
            Some("Role") => {
                Api::<Role>::namespaced(hub.clone(), &namespace.context("a namespace")?)
                    .patch(&name, &params, &Patch::Apply(&value))
                    .await?;
            }
            Some("RoleBinding") => {
                Api::<RoleBinding>::namespaced(hub.clone(), &namespace.context("a namespace")?)
                    .patch(&name, &params, &Patch::Apply(&value))
                    .await?;
            }
            other => bail!("builds.yaml: unexpected kind {other:?}"),
        }
    }
    Ok(())
}

/// A client acting as kmm-hub's ServiceAccount.
async fn as_hub(fleet: &Fleet) -> Result<Client> {
    let kubeconfig = Kubeconfig::read_from(&fleet.state.cluster("hub")?.kubeconfig)?;
    let mut config =
        kube::Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default()).await?;
    config.auth_info.impersonate = Some(HUB_SERVICE_ACCOUNT.to_owned());
    Ok(Client::try_from(config)?)
}

fn unique(prefix: &str) -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or_default();
    format!("{prefix}-{nanos:x}")
}

/// A module owning the test's builds: a build section naming `secrets`, a mapping for
/// every kernel to `image`, both registries plain HTTP. It selects nothing.
fn module(
    name: &str,
    image: &str,
    build_args: serde_json::Value,
    secrets: &[&str],
) -> Result<ManagedClusterModule> {
    let secrets: Vec<_> = secrets.iter().map(|s| json!({ "name": s })).collect();
    Ok(serde_json::from_value(json!({
        "apiVersion": "hub.kmm.sigs.x-k8s.io/v1beta1",
        "kind": "ManagedClusterModule",
        "metadata": { "name": name, "labels": { TEST_LABEL: "builds" } },
        "spec": {
            "spokeNamespace": "kmm-e2e",
            "selector": { "kmm-e2e.dev/builds": "none" },
            "moduleSpec": {
                "selector": { "kmm-e2e.dev/builds": "none" },
                "moduleLoader": { "container": {
                    "modprobe": { "moduleName": "kmm_hello" },
                    "registryTLS": { "insecure": true },
                    "build": {
                        "dockerfileConfigMap": { "name": format!("{name}-dockerfile") },
                        "baseImageRegistryTLS": { "insecure": true },
                        "buildArgs": build_args,
                        "secrets": secrets,
                    },
                    "kernelMappings": [{ "regexp": "^.+$", "containerImage": image }],
                }},
            },
        },
    }))?)
}

/// Creates `module` and returns it as stored (with its uid).
async fn create(hub: &Client, module: &ManagedClusterModule) -> Result<ManagedClusterModule> {
    Api::<ManagedClusterModule>::all(hub.clone())
        .create(&PostParams::default(), module)
        .await
        .with_context(|| format!("creating ManagedClusterModule {}", module.name_any()))
}

/// The request the hub's pipeline makes for `module` on `kernel`: the resolver's merged
/// build, image and registry TLS.
fn request(
    module: &ManagedClusterModule,
    kernel: &str,
    dockerfile: &str,
    push_secret: Option<&str>,
) -> Result<BuildRequest> {
    let spec = &module.spec.module_spec;
    let identity = ModuleIdentity {
        name: &module.name_any(),
        namespace: &module.spec.spoke_namespace,
        spec_path: "spec.moduleSpec",
    };
    let resolution = Resolver::new(spec, identity)
        .map_err(|e| anyhow::anyhow!("{e}"))?
        .resolve(kernel)?;
    Ok(BuildRequest {
        module: module.name_any(),
        module_uid: module.uid().context("a uid")?,
        spoke_namespace: module.spec.spoke_namespace.clone(),
        kernel: kernel.to_owned(),
        image: resolution.container_image,
        build: resolution.build.context("the mapping has a build")?,
        registry_tls: resolution.registry_tls,
        push_secret: push_secret.map(str::to_owned),
        dockerfile: dockerfile.to_owned(),
        rebuild_generation: spec.image_rebuild_trigger_generation.unwrap_or(0),
    })
}

/// A Secret in the hub's namespace.
async fn secret(hub: &Client, name: &str, type_: &str, data: &[(&str, &str)]) -> Result<()> {
    let secret = Secret {
        metadata: ObjectMeta {
            name: Some(name.to_owned()),
            ..ObjectMeta::default()
        },
        type_: Some(type_.to_owned()),
        data: Some(
            data.iter()
                .map(|(k, v)| ((*k).to_owned(), ByteString(v.as_bytes().to_vec())))
                .collect(),
        ),
        ..Secret::default()
    };
    Api::<Secret>::namespaced(hub.clone(), HUB_NAMESPACE)
        .create(&PostParams::default(), &secret)
        .await
        .with_context(|| format!("creating Secret {HUB_NAMESPACE}/{name}"))?;
    Ok(())
}

async fn delete_secrets(hub: &Client, names: &[&str]) -> Result<()> {
    let api = Api::<Secret>::namespaced(hub.clone(), HUB_NAMESPACE);
    for name in names {
        api.delete(name, &DeleteParams::default()).await?;
    }
    Ok(())
}

/// Calls `ensure` until the build has finished; the outcome and how long it took.
async fn finished(builds: &BuildJobs, request: &BuildRequest) -> Result<(BuildProgress, Duration)> {
    let started = Instant::now();
    let progress = wait_until("the build to finish", BUILD_TIMEOUT, || async {
        match builds.ensure(request, &RegistryCas::default()).await {
            Ok(BuildProgress::Running { job }) => Err(format!("{job} running")),
            Ok(BuildProgress::Retrying { job }) => Err(format!("{job} being replaced")),
            Ok(done) => Ok(done),
            Err(e) => Err(e.to_string()),
        }
    })
    .await?;
    Ok((progress, started.elapsed()))
}

/// The names of the module's build Jobs.
async fn jobs_of(hub: &Client, builds: &BuildJobs, uid: &str) -> Result<BTreeSet<String>> {
    let jobs = Api::<Job>::namespaced(hub.clone(), builds.namespace())
        .list(&ListParams::default().labels(&format!("{MODULE_UID_LABEL}={uid}")))
        .await?;
    Ok(jobs.iter().map(|j| j.name_any()).collect())
}

/// The files of the image's last layer: what the Dockerfile's last step added.
async fn last_layer_files(image: &str) -> Result<BTreeMap<String, Vec<u8>>> {
    let reference = image.parse()?;
    let client = oci();
    let (manifest, _) = client
        .pull_image_manifest(&reference, &RegistryAuth::Anonymous)
        .await
        .with_context(|| format!("{image} is not in the registry"))?;
    let layer = manifest.layers.last().context("the image has no layer")?;
    let mut blob = vec![];
    client.pull_blob(&reference, layer, &mut blob).await?;
    let mut files = BTreeMap::new();
    let mut archive = tar::Archive::new(flate2::read::GzDecoder::new(&blob[..]));
    for entry in archive.entries()? {
        let mut entry = entry?;
        let path = entry.path()?.to_string_lossy().into_owned();
        let mut contents = vec![];
        entry.read_to_end(&mut contents)?;
        files.insert(path, contents);
    }
    Ok(files)
}

#[tokio::test]
async fn a_build_compiles_the_module_for_a_debian_kernel_and_pushes_the_image() -> Result<()> {
    let _serial = SERIAL.lock().await;
    let fleet = Fleet::get().await?;
    let setup = setup(&fleet).await?;
    let name = unique("builds-real");
    let (token, push) = (format!("{name}-token"), format!("{name}-push"));
    let image = format!(
        "{}/kmm-e2e/builds/{name}:${{KERNEL_FULL_VERSION}}",
        setup.node_registry
    );
    let module = create(
        &fleet.hub,
        &module(
            &name,
            &image,
            json!([{ "name": "GREETING", "value": "hello" }]),
            &[&token],
        )?,
    )
    .await?;
    secret(&fleet.hub, &token, "Opaque", &[("token", "s3cret")]).await?;
    // The registry takes anonymous pushes: this proves the auth file reaches buildah
    // well-formed, not that it authenticates.
    let auth = json!({ "auths": { setup.node_registry.clone(): { "auth": "a21tOmttbQ==" } } });
    secret(
        &fleet.hub,
        &push,
        "kubernetes.io/dockerconfigjson",
        &[(".dockerconfigjson", &auth.to_string())],
    )
    .await?;
    let dockerfile = format!(
        "FROM {base} AS build\n\
         ARG KERNEL_FULL_VERSION\n\
         ARG GREETING\n\
         RUN test \"$GREETING\" = hello && test \"$(cat /run/secrets/{token}/token)\" = s3cret\n\
         RUN make -C /usr/src/linux-headers-${{KERNEL_FULL_VERSION}} M={sources} modules\n\
         RUN mkdir -p /opt/lib/modules/${{KERNEL_FULL_VERSION}}/extra \\\n  \
             && cp {sources}/kmm_hello.ko {sources}/kmm_hello_dep.ko /opt/lib/modules/${{KERNEL_FULL_VERSION}}/extra/ \\\n  \
             && depmod -b /opt ${{KERNEL_FULL_VERSION}}\n\
         FROM scratch\n\
         COPY --from=build /opt /opt\n",
        base = setup.base,
        sources = kmod_builder::SAMPLE_SOURCES,
    );
    let request = request(&module, &setup.kernel, &dockerfile, Some(&push))?;
    let builds = BuildJobs::new(as_hub(&fleet).await?, HUB_NAMESPACE, &setup.builder);
    let (progress, took) = finished(&builds, &request).await?;
    let BuildProgress::Succeeded { job } = progress else {
        bail!("the build did not succeed: {progress:?}");
    };
    eprintln!(
        "builds: {job}: Job created -> Succeeded in {:.1}s (compiles kmm_hello for {} from {})",
        took.as_secs_f64(),
        setup.kernel,
        setup.base
    );

    let pushed = request
        .image
        .replacen(&setup.node_registry, &setup.registry, 1);
    let files = last_layer_files(&pushed).await?;
    let modules = format!("opt/lib/modules/{}", setup.kernel);
    for module in ["kmm_hello", "kmm_hello_dep"] {
        let path = format!("{modules}/extra/{module}.ko");
        let ko = files
            .get(&path)
            .with_context(|| format!("{pushed} lacks {path}: {:?}", files.keys()))?;
        let vermagic = format!("vermagic={} ", setup.kernel);
        ensure!(
            ko.windows(vermagic.len()).any(|w| w == vermagic.as_bytes()),
            "{path} was not built for {}",
            setup.kernel
        );
    }
    let dep = String::from_utf8_lossy(&files[&format!("{modules}/modules.dep")]).into_owned();
    ensure!(
        dep.contains("extra/kmm_hello_dep.ko: extra/kmm_hello.ko"),
        "modules.dep: {dep}"
    );
    ensure!(
        files.keys().all(|p| !p.contains("run/secrets")),
        "a build secret reached the image: {:?}",
        files.keys()
    );

    Api::<ManagedClusterModule>::all(fleet.hub.clone())
        .delete(&name, &DeleteParams::default())
        .await?;
    delete_secrets(&fleet.hub, &[&token, &push]).await
}

#[tokio::test]
async fn a_failing_dockerfile_reports_the_end_of_its_log_and_is_built_again_only_on_retry()
-> Result<()> {
    let _serial = SERIAL.lock().await;
    let fleet = Fleet::get().await?;
    let setup = setup(&fleet).await?;
    let name = unique("builds-failing");
    let image = format!(
        "{}/kmm-e2e/builds/{name}:${{KERNEL_FULL_VERSION}}",
        setup.node_registry
    );
    let module = create(&fleet.hub, &module(&name, &image, json!([]), &[])?).await?;
    let dockerfile = format!(
        "FROM {base}\n\
         RUN printf 'int kmm_broken(void) {{ return undeclared_symbol; }}\\n' > /tmp/broken.c \\\n  \
             && gcc -c -o /tmp/broken.o /tmp/broken.c\n",
        base = setup.base
    );
    let request = request(&module, &setup.kernel, &dockerfile, None)?;
    let builds = BuildJobs::new(as_hub(&fleet).await?, HUB_NAMESPACE, &setup.builder);
    let (progress, took) = finished(&builds, &request).await?;
    let BuildProgress::Failed { job, log_tail } = &progress else {
        bail!("the build did not fail: {progress:?}");
    };
    eprintln!(
        "builds: {job}: Job created -> Failed in {:.1}s; log tail {} bytes:\n{log_tail}",
        took.as_secs_f64(),
        log_tail.len()
    );
    ensure!(log_tail.len() <= 2048, "{} bytes", log_tail.len());
    ensure!(
        log_tail.contains("'undeclared_symbol' undeclared"),
        "the compiler's error is not in the tail:\n{log_tail}"
    );
    ensure!(
        log_tail.contains("kmm-builder: the build of") && log_tail.contains(&request.image),
        "the builder's verdict is not in the tail:\n{log_tail}"
    );
    // Asked again, the failed build is reported, not started again.
    ensure!(
        builds.ensure(&request, &RegistryCas::default()).await? == progress,
        "a second answer differs"
    );
    let uid = module.uid().context("a uid")?;
    let jobs = jobs_of(&fleet.hub, &builds, &uid).await?;
    ensure!(jobs.len() == 1, "Jobs {jobs:?}");

    // A retry (the hub's, after the backoff) replaces the failed Job by a new attempt.
    let job_uid = |name: String| {
        let jobs = Api::<Job>::namespaced(fleet.hub.clone(), builds.namespace());
        async move { anyhow::Ok(jobs.get(&name).await?.uid()) }
    };
    let first_uid = job_uid(job.clone()).await?;
    ensure!(
        builds.retry(&request, &RegistryCas::default()).await?
            == BuildProgress::Retrying { job: job.clone() },
        "the failed build is not being replaced"
    );
    let (again, took) = finished(&builds, &request).await?;
    ensure!(
        matches!(&again, BuildProgress::Failed { job: j, .. } if j == job),
        "the retry ended {again:?}"
    );
    let second_uid = job_uid(job.clone()).await?;
    ensure!(
        second_uid != first_uid,
        "the retry reported the first attempt's Job ({first_uid:?})"
    );
    eprintln!(
        "builds: {job}: retry -> a new attempt Failed in {:.1}s",
        took.as_secs_f64()
    );

    Api::<ManagedClusterModule>::all(fleet.hub.clone())
        .delete(&name, &DeleteParams::default())
        .await?;
    Ok(())
}

/// A build that pulls nothing: the Dockerfile copied onto scratch, labelled with the
/// build argument.
const TRIVIAL: &str = "FROM scratch\nARG FLAVOUR\nLABEL dev.kmm-fleet.flavour=$FLAVOUR\nCOPY Dockerfile /Dockerfile\n";

#[tokio::test]
async fn a_request_makes_one_job_and_a_changed_build_arg_exactly_one_more() -> Result<()> {
    let _serial = SERIAL.lock().await;
    let fleet = Fleet::get().await?;
    let setup = setup(&fleet).await?;
    let name = unique("builds-once");
    let image = format!(
        "{}/kmm-e2e/builds/{name}:${{KERNEL_FULL_VERSION}}",
        setup.node_registry
    );
    let flavour = |value: &str| json!([{ "name": "FLAVOUR", "value": value }]);
    let first = create(&fleet.hub, &module(&name, &image, flavour("debug"), &[])?).await?;
    let uid = first.uid().context("a uid")?;
    let builds = BuildJobs::new(as_hub(&fleet).await?, HUB_NAMESPACE, &setup.builder);

    let debug = request(&first, &setup.kernel, TRIVIAL, None)?;
    let job = |p: BuildProgress| match p {
        BuildProgress::Running { job } | BuildProgress::Succeeded { job } => Ok(job),
        BuildProgress::Failed { job, log_tail } => Err(anyhow::anyhow!("{job} failed: {log_tail}")),
        BuildProgress::Retrying { job } => Err(anyhow::anyhow!("{job} is being retried")),
    };
    let debug_job = job(builds.ensure(&debug, &RegistryCas::default()).await?)?;
    ensure!(
        job(builds.ensure(&debug, &RegistryCas::default()).await?)? == debug_job,
        "a second Job"
    );
    ensure!(jobs_of(&fleet.hub, &builds, &uid).await? == BTreeSet::from([debug_job.clone()]));

    // The user changes the build argument: the module's new spec, the same uid.
    let modules = Api::<ManagedClusterModule>::all(fleet.hub.clone());
    let patch = json!({ "spec": { "moduleSpec": { "moduleLoader": { "container": {
        "build": { "buildArgs": flavour("release") } } } } } });
    let changed = modules
        .patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
        .await?;
    let release = request(&changed, &setup.kernel, TRIVIAL, None)?;
    ensure!(release.fingerprint(&setup.builder) != debug.fingerprint(&setup.builder));
    let release_job = job(builds.ensure(&release, &RegistryCas::default()).await?)?;
    for _ in 0..3 {
        ensure!(
            job(builds.ensure(&release, &RegistryCas::default()).await?)? == release_job,
            "another Job"
        );
    }
    let both = BTreeSet::from([debug_job.clone(), release_job.clone()]);
    ensure!(
        jobs_of(&fleet.hub, &builds, &uid).await? == both,
        "Jobs besides {both:?}"
    );
    let (progress, took) = finished(&builds, &release).await?;
    ensure!(
        matches!(progress, BuildProgress::Succeeded { .. }),
        "{progress:?}"
    );
    eprintln!(
        "builds: {release_job}: trivial build, Job resumed -> Succeeded seen {:.1}s later",
        took.as_secs_f64()
    );

    // Only the release build is wanted now.
    let keep = BTreeSet::from([release.fingerprint(&setup.builder)]);
    let deleted = builds.cleanup(&uid, &keep).await?;
    ensure!(
        deleted == [debug_job.clone()],
        "cleanup deleted {deleted:?}"
    );
    wait_until("only the wanted build to remain", WAIT, || async {
        let jobs = jobs_of(&fleet.hub, &builds, &uid)
            .await
            .map_err(|e| e.to_string())?;
        (jobs == BTreeSet::from([release_job.clone()]))
            .then_some(())
            .ok_or(format!("{jobs:?}"))
    })
    .await?;
    let labels = Api::<Job>::namespaced(fleet.hub.clone(), builds.namespace())
        .get(&release_job)
        .await?
        .labels()
        .clone();
    ensure!(labels[FINGERPRINT_LABEL] == release.fingerprint(&setup.builder));

    modules.delete(&name, &DeleteParams::default()).await?;
    Ok(())
}

#[tokio::test]
async fn deleting_the_module_deletes_its_jobs_and_their_inputs() -> Result<()> {
    let _serial = SERIAL.lock().await;
    let fleet = Fleet::get().await?;
    let setup = setup(&fleet).await?;
    let name = unique("builds-owned");
    let push = format!("{name}-push");
    let image = format!(
        "{}/kmm-e2e/builds/{name}:${{KERNEL_FULL_VERSION}}",
        setup.node_registry
    );
    let flavour = json!([{ "name": "FLAVOUR", "value": "owned" }]);
    let module = create(&fleet.hub, &module(&name, &image, flavour, &[])?).await?;
    let uid = module.uid().context("a uid")?;
    secret(
        &fleet.hub,
        &push,
        "kubernetes.io/dockerconfigjson",
        &[(".dockerconfigjson", "{\"auths\":{}}")],
    )
    .await?;
    let builds = BuildJobs::new(as_hub(&fleet).await?, HUB_NAMESPACE, &setup.builder);
    let request = request(&module, &setup.kernel, TRIVIAL, Some(&push))?;
    let job = match builds.ensure(&request, &RegistryCas::default()).await? {
        BuildProgress::Running { job } => job,
        other => bail!("a new build is running, not {other:?}"),
    };
    let config_maps = Api::<ConfigMap>::namespaced(fleet.hub.clone(), builds.namespace());
    let copies = Api::<Secret>::namespaced(fleet.hub.clone(), builds.namespace());
    let selector = ListParams::default().labels(&format!("{MODULE_UID_LABEL}={uid}"));
    ensure!(
        config_maps.list(&selector).await?.items.len() == 1,
        "no Dockerfile copy"
    );
    ensure!(
        copies.list(&selector).await?.items.len() == 1,
        "no push Secret copy"
    );

    let deleted = Instant::now();
    Api::<ManagedClusterModule>::all(fleet.hub.clone())
        .delete(&name, &DeleteParams::background())
        .await?;
    wait_until(
        "the module's Job and its inputs to be gone",
        WAIT,
        || async {
            let left = (
                jobs_of(&fleet.hub, &builds, &uid)
                    .await
                    .map_err(|e| e.to_string())?,
                config_maps
                    .list(&selector)
                    .await
                    .map_err(|e| e.to_string())?
                    .items
                    .len(),
                copies
                    .list(&selector)
                    .await
                    .map_err(|e| e.to_string())?
                    .items
                    .len(),
            );
            match left {
                (jobs, 0, 0) if jobs.is_empty() => Ok(()),
                (jobs, maps, secrets) => Err(format!(
                    "Jobs {jobs:?}, {maps} ConfigMaps, {secrets} Secrets"
                )),
            }
        },
    )
    .await?;
    eprintln!(
        "builds: {job} and its inputs collected {:.1}s after the module's deletion",
        deleted.elapsed().as_secs_f64()
    );
    delete_secrets(&fleet.hub, &[&push]).await
}
