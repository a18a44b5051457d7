//! Open Cluster Management in the fleet: the hub controllers (registration, add-on
//! manager and its conversion webhook, placement), a klusterlet agent per spoke, and
//! acceptance as `clusteradm accept` does it.

use std::path::{Path, PathBuf};

use base64::Engine as _;
use k8s_openapi::api::authentication::v1::{TokenRequest, TokenRequestSpec};
use k8s_openapi::api::core::v1::ServiceAccount;
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding};
use kmm_api::ocm::{CLUSTER_SET_LABEL, MANAGED_CLUSTER};
use kube::api::{DynamicObject, Patch, PatchParams, PostParams};
use kube::{Api, Client};
use serde_json::{Value, json};

use super::control_plane::{
    ControlPlane, Credentials, OCM_ADDON_MANAGER, OCM_ADDON_WEBHOOK, OCM_AGENT, OCM_PLACEMENT,
    OCM_REGISTRATION, apply_crd, ensure_namespaces, wait_healthz, write_kubeconfig,
};
use super::{MANAGER, Starting, wait_for};
use crate::{Error, IoContext, Result};

/// Namespaces the OCM hub controllers and the klusterlet agent expect.
const HUB_NAMESPACES: &[&str] = &["open-cluster-management", "open-cluster-management-hub"];
const SPOKE_NAMESPACES: &[&str] = &[
    "open-cluster-management-agent",
    "open-cluster-management-agent-addon",
];
/// The add-on CRDs the OCM addon manager serves in two versions through its conversion webhook.
const CONVERTED_CRDS: &[&str] = &[
    "clustermanagementaddons.addon.open-cluster-management.io",
    "managedclusteraddons.addon.open-cluster-management.io",
];
/// CRDs the klusterlet agent needs on a managed cluster.
const SPOKE_CRDS: &[&str] = &[
    "clusterclaims.cluster.open-cluster-management.io",
    "appliedmanifestworks.work.open-cluster-management.io",
];

impl Starting {
    /// The OCM hub controllers; returns the bootstrap kubeconfig for klusterlet agents.
    pub(super) async fn ocm_hub(&mut self, hub: &ControlPlane, crds: &[Value]) -> Result<PathBuf> {
        ensure_namespaces(&hub.client, HUB_NAMESPACES).await?;
        let webhook_port = self.ports.cluster(hub.index, OCM_ADDON_WEBHOOK);
        let webhook_dir = hub.dir.join("addon-webhook");
        std::fs::create_dir_all(&webhook_dir)
            .context(|| format!("creating {}", webhook_dir.display()))?;
        // Named tls.crt/tls.key: the file names controller-runtime's webhook server reads.
        hub.ca
            .serving(&webhook_dir, "tls", &["localhost"], &["127.0.0.1"])?;
        let ca_bundle = base64::engine::general_purpose::STANDARD.encode(&hub.ca.pem);
        for crd in crds {
            let mut crd = crd.clone();
            if CONVERTED_CRDS.contains(&crd_name(&crd)) {
                crd["spec"]["conversion"] = json!({
                    "strategy": "Webhook",
                    "webhook": {
                        "clientConfig": {
                            "url": format!("https://127.0.0.1:{webhook_port}/convert"),
                            "caBundle": ca_bundle,
                        },
                        "conversionReviewVersions": ["v1", "v1beta1"],
                    },
                });
            }
            apply_crd(&hub.client, &crd).await?;
        }
        let kc = hub.kubeconfig.display().to_string();
        let webhook = self.start(
            "hub/ocm-addon-webhook",
            "addon",
            vec![
                "webhook-server".into(),
                format!("--port={webhook_port}"),
                format!("--certdir={}", webhook_dir.display()),
            ],
            // This subcommand has no --kubeconfig; controller-runtime reads $KUBECONFIG.
            &[("KUBECONFIG", kc.clone())],
        )?;
        wait_for(
            &webhook,
            "OCM addon conversion webhook to listen",
            || async move {
                tokio::net::TcpStream::connect(("127.0.0.1", webhook_port))
                    .await
                    .is_ok()
            },
        )
        .await?;
        for (component, bin, subcommand, offset) in [
            (
                "hub/ocm-registration",
                "registration",
                "controller",
                OCM_REGISTRATION,
            ),
            (
                "hub/ocm-addon-manager",
                "addon",
                "manager",
                OCM_ADDON_MANAGER,
            ),
            (
                "hub/ocm-placement",
                "placement",
                "controller",
                OCM_PLACEMENT,
            ),
        ] {
            let port = self.ports.cluster(hub.index, offset);
            let tracked = self.start(
                component,
                bin,
                vec![
                    subcommand.into(),
                    format!("--kubeconfig={kc}"),
                    "--namespace=open-cluster-management-hub".into(),
                    format!("--listen=127.0.0.1:{port}"),
                    "--disable-leader-election".into(),
                ],
                &[],
            )?;
            wait_healthz(&tracked, port, "/healthz").await?;
        }
        bootstrap_kubeconfig(hub).await
    }

    pub(super) async fn ocm_agent(
        &mut self,
        spoke: &ControlPlane,
        hub: &ControlPlane,
        bootstrap: &Path,
        crds: &[Value],
    ) -> Result<()> {
        ensure_namespaces(&spoke.client, SPOKE_NAMESPACES).await?;
        for crd in crds.iter().filter(|c| SPOKE_CRDS.contains(&crd_name(c))) {
            apply_crd(&spoke.client, crd).await?;
        }
        let hub_kubeconfig_dir = spoke.dir.join("hub-kubeconfig");
        std::fs::create_dir_all(&hub_kubeconfig_dir)
            .context(|| format!("creating {}", hub_kubeconfig_dir.display()))?;
        let kc = spoke.kubeconfig.display().to_string();
        let port = self.ports.cluster(spoke.index, OCM_AGENT);
        let agent = self.start(
            &format!("{}/ocm-agent", spoke.name),
            "registration-operator",
            vec![
                "agent".into(),
                format!("--spoke-cluster-name={}", spoke.name),
                format!("--spoke-external-server-urls={}", spoke.server),
                format!("--bootstrap-kubeconfig={}", bootstrap.display()),
                format!("--hub-kubeconfig-dir={}", hub_kubeconfig_dir.display()),
                // The work agent reads the hub kubeconfig the registration agent writes.
                format!(
                    "--workload-source-config={}",
                    hub_kubeconfig_dir.join("kubeconfig").display()
                ),
                format!("--spoke-kubeconfig={kc}"),
                format!("--kubeconfig={kc}"),
                "--namespace=open-cluster-management-agent".into(),
                format!("--listen=127.0.0.1:{port}"),
                "--disable-leader-election".into(),
            ],
            &[],
        )?;
        let clusters = managed_clusters(&hub.client);
        let name = spoke.name.clone();
        wait_for(
            &agent,
            "the agent to register its ManagedCluster on the hub",
            || {
                let clusters = clusters.clone();
                let name = name.clone();
                async move { clusters.get_opt(&name).await.ok().flatten().is_some() }
            },
        )
        .await
    }

    /// Run `clusteradm accept` (approve the agent's CSR, set hubAcceptsClient) until
    /// the ManagedCluster is joined and available. `accept` fails until the CSR exists
    /// and again once nothing is left to approve, so its exit status is only logged.
    pub(super) async fn accept(&mut self, hub: &ControlPlane, spoke: &str) -> Result<()> {
        let agent = self
            .state
            .processes
            .iter()
            .find(|p| p.name == format!("{spoke}/ocm-agent"))
            .cloned()
            .expect("the agent was started before accepting");
        let clusteradm = self.toolchain.bin("clusteradm").to_path_buf();
        let log = self
            .dir
            .join("logs")
            .join(format!("{spoke}-clusteradm-accept.log"));
        let kubeconfig = hub.kubeconfig.clone();
        let clusters = managed_clusters(&hub.client);
        let name = spoke.to_string();
        wait_for(
            &agent,
            "the ManagedCluster to be accepted, joined and available",
            || {
                let (clusteradm, kubeconfig, clusters, name, log) = (
                    clusteradm.clone(),
                    kubeconfig.clone(),
                    clusters.clone(),
                    name.clone(),
                    log.clone(),
                );
                async move {
                    if let Ok(Some(mc)) = clusters.get_opt(&name).await
                        && condition_true(&mc.data, "ManagedClusterJoined")
                        && condition_true(&mc.data, "ManagedClusterConditionAvailable")
                    {
                        return true;
                    }
                    if let Ok(out) = tokio::process::Command::new(&clusteradm)
                        .args(["accept", "--clusters", &name, "--kubeconfig"])
                        .arg(&kubeconfig)
                        .output()
                        .await
                    {
                        use std::io::Write as _;
                        if let Ok(mut file) = std::fs::File::options()
                            .create(true)
                            .append(true)
                            .open(&log)
                        {
                            let _ = writeln!(file, "--- clusteradm accept: {}", out.status);
                            let _ = file.write_all(&out.stdout);
                            let _ = file.write_all(&out.stderr);
                        }
                    }
                    false
                }
            },
        )
        .await?;
        // What OCM's registration webhook would do on creation. Its webhook-server is
        // not run: OCM hard-codes the health probe of every webhook-server to :8000, so
        // only one (the add-on conversion webhook, which is required) fits on a host.
        let label = json!({ "metadata": { "labels": { CLUSTER_SET_LABEL: "default" } } });
        clusters
            .patch(spoke, &PatchParams::default(), &Patch::Merge(&label))
            .await?;
        Ok(())
    }
}

/// The identity klusterlet agents bootstrap with, as OCM's cluster-manager sets it up:
/// the ServiceAccount open-cluster-management/agent-registration-bootstrap, allowed only
/// to create its ManagedCluster and CSR (`clusteradm accept` approves CSRs from exactly
/// this requester). Its token goes into `<hub>/bootstrap.kubeconfig`.
async fn bootstrap_kubeconfig(hub: &ControlPlane) -> Result<PathBuf> {
    const SA: &str = "agent-registration-bootstrap";
    const ROLE: &str = "system:open-cluster-management:bootstrap";
    let apply = PatchParams::apply(MANAGER).force();
    let sas: Api<ServiceAccount> = Api::namespaced(hub.client.clone(), "open-cluster-management");
    let sa = json!({ "apiVersion": "v1", "kind": "ServiceAccount", "metadata": { "name": SA } });
    sas.patch(SA, &apply, &Patch::Apply(&sa)).await?;
    let role = json!({
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRole",
        "metadata": { "name": ROLE },
        "rules": [
            { "apiGroups": [""], "resources": ["configmaps"], "verbs": ["get"] },
            { "apiGroups": ["certificates.k8s.io"], "resources": ["certificatesigningrequests"],
              "verbs": ["create", "get", "list", "watch"] },
            { "apiGroups": ["cluster.open-cluster-management.io"], "resources": ["managedclusters"],
              "verbs": ["get", "create", "list", "watch"] },
            { "apiGroups": ["cluster.open-cluster-management.io"], "resources": ["managedclustersets/join"],
              "verbs": ["create"] },
        ],
    });
    Api::<ClusterRole>::all(hub.client.clone())
        .patch(ROLE, &apply, &Patch::Apply(&role))
        .await?;
    let binding = json!({
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRoleBinding",
        "metadata": { "name": ROLE },
        "roleRef": { "apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": ROLE },
        "subjects": [{ "kind": "ServiceAccount", "name": SA, "namespace": "open-cluster-management" }],
    });
    Api::<ClusterRoleBinding>::all(hub.client.clone())
        .patch(ROLE, &apply, &Patch::Apply(&binding))
        .await?;
    let request = TokenRequest {
        spec: TokenRequestSpec {
            // Long enough for any test session; agents switch to their signed
            // certificate right after joining.
            expiration_seconds: Some(7 * 24 * 3600),
            ..Default::default()
        },
        ..Default::default()
    };
    let token = sas
        .create_token_request(SA, &PostParams::default(), &request)
        .await?;
    let token = token
        .status
        .map(|s| s.token)
        .ok_or_else(|| Error::Invalid("the bootstrap TokenRequest returned no token".into()))?;
    let path = hub.dir.join("bootstrap.kubeconfig");
    write_kubeconfig(
        &path,
        &hub.name,
        &hub.server,
        &hub.ca.pem,
        Credentials::Token(&token),
    )?;
    Ok(path)
}

/// The OCM CRDs of the api module (operator CRDs excluded). The module ships some CRDs
/// twice (a single-version file and a multi-version one); the file with the most
/// versions wins.
pub(super) fn ocm_crds(api_dir: &Path) -> Result<Vec<Value>> {
    let mut files = vec![];
    for group in ["addon", "cluster", "work"] {
        collect_crd_files(&api_dir.join(group), &mut files)?;
    }
    files.sort();
    let mut parsed = vec![];
    for file in files {
        let text =
            std::fs::read_to_string(&file).context(|| format!("reading {}", file.display()))?;
        parsed.push(
            serde_yaml_ng::from_str(&text)
                .map_err(|e| Error::Invalid(format!("{}: {e}", file.display())))?,
        );
    }
    Ok(most_versions_per_crd(parsed))
}

/// One CRD per name: the one serving the most versions.
fn most_versions_per_crd(all: Vec<Value>) -> Vec<Value> {
    let versions = |c: &Value| c["spec"]["versions"].as_array().map_or(0, Vec::len);
    let mut crds: Vec<Value> = vec![];
    for crd in all {
        match crds.iter_mut().find(|c| crd_name(c) == crd_name(&crd)) {
            Some(existing) if versions(existing) < versions(&crd) => *existing = crd,
            Some(_) => {}
            None => crds.push(crd),
        }
    }
    crds
}

fn collect_crd_files(dir: &Path, out: &mut Vec<PathBuf>) -> Result<()> {
    for entry in std::fs::read_dir(dir).context(|| format!("reading {}", dir.display()))? {
        let path = entry
            .context(|| format!("reading {}", dir.display()))?
            .path();
        if path.is_dir() {
            collect_crd_files(&path, out)?;
        } else if path.to_string_lossy().ends_with(".crd.yaml") {
            out.push(path);
        }
    }
    Ok(())
}

pub(super) fn crd_name(crd: &Value) -> &str {
    crd["metadata"]["name"].as_str().unwrap_or_default()
}

/// `ManagedCluster`s on the hub, as dynamic objects.
pub fn managed_clusters(hub: &Client) -> Api<DynamicObject> {
    Api::all_with(hub.clone(), &MANAGED_CLUSTER.api_resource())
}

/// Whether `status.conditions` of a dynamic object has `type` with status True.
pub fn condition_true(data: &Value, type_: &str) -> bool {
    data["status"]["conditions"].as_array().is_some_and(|cs| {
        cs.iter()
            .any(|c| c["type"] == type_ && c["status"] == "True")
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_multi_version_copy_of_a_crd_wins() {
        let crd = |versions: &[&str]| {
            json!({
                "metadata": { "name": "things.example.io" },
                "spec": { "versions": versions.iter().map(|v| json!({ "name": v })).collect::<Vec<_>>() },
            })
        };
        let other =
            json!({ "metadata": { "name": "others.example.io" }, "spec": { "versions": [] } });
        let merged = most_versions_per_crd(vec![
            crd(&["v1alpha1"]),
            other.clone(),
            crd(&["v1alpha1", "v1beta1"]),
            crd(&["v1beta1"]),
        ]);
        assert_eq!(merged, vec![crd(&["v1alpha1", "v1beta1"]), other]);
    }
}
