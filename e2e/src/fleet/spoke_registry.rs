//! The fleet's second OCI registry: the spokes reach it, the hub does not, as edge and
//! air-gapped clusters keep registries of their own. The same registry program as the
//! first ([`kmm_registry_fixture::registry_binary`]), on the bridge address (a port of
//! its own), HTTPS with a certificate issued by a CA of its own
//! ([`kmm_registry_fixture::internal_ca`]) that nothing trusts by default, and only one
//! user may pull or push (basic auth).
//!
//! The hub cannot reach it: its real node's network namespace rejects connections to
//! that address and port, for the node's own traffic (`OUTPUT`) and its Pods'
//! (`FORWARD`, which kmm-hub's Pods go through), while every spoke's real node, its Pods
//! and the KWOK agents in its network reach it. [`spoke_registry`] proves both before it
//! returns.
//!
//! Started on first use by a test that needs it, not on every `env up`: it outlives the
//! test (later tests and test binaries find it through `spoke-registry.json` in the
//! fleet's state directory) and is one of the fleet's recorded processes, which
//! `cargo xtask env down` stops by its PID; the node rules go with the nodes' network
//! namespaces.

use std::net::{Ipv4Addr, SocketAddr, TcpListener};
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use kmm_registry_fixture::{internal_ca, registry_binary, tls_with_auth_config};
use oci_client::client::{ClientConfig, ClientProtocol, Config};
use oci_client::secrets::RegistryAuth;
use oci_client::{Client, Reference};
use serde::{Deserialize, Serialize};

use super::disruption::iptables;
use super::{Settings, State};
use crate::process::{Tracked, spawn};
use crate::{Error, IoContext, Result};

/// The fleet process name (`env status` lists it).
const PROCESS: &str = "spoke-registry";
/// Its directory and record under the fleet's state directory.
const DIR: &str = "spoke-registry";
const RECORD: &str = "spoke-registry.json";
/// How long it gets to listen, and a probe to connect.
const START_TIMEOUT: Duration = Duration::from_secs(30);
const PROBE_TIMEOUT: Duration = Duration::from_secs(3);

/// The running second registry, as tests use it.
#[derive(Clone, Serialize, Deserialize)]
pub struct SpokeRegistry {
    /// `<bridge address>:<port>`: how the spokes' nodes and Pods name it, and images in it.
    pub address: String,
    /// The CA its certificate chains to (PEM): what a cluster's `REGISTRY_CA_BUNDLE_n`
    /// must carry.
    pub ca_pem: String,
    /// The one user it lets in, and the password.
    pub user: String,
    pub password: String,
    pid: i32,
}

impl std::fmt::Debug for SpokeRegistry {
    /// Without the password.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SpokeRegistry")
            .field("address", &self.address)
            .field("user", &self.user)
            .field("pid", &self.pid)
            .finish_non_exhaustive()
    }
}

impl SpokeRegistry {
    /// `<address>/<name>`
    pub fn image(&self, name: &str) -> String {
        format!("{}/{name}", self.address)
    }

    /// A client for pushing from this machine (which reaches the bridge address): HTTPS,
    /// its certificate accepted as the test's own.
    pub fn client(&self) -> Client {
        Client::new(ClientConfig {
            protocol: ClientProtocol::Https,
            accept_invalid_certificates: true,
            ..ClientConfig::default()
        })
    }

    pub fn auth(&self) -> RegistryAuth {
        RegistryAuth::Basic(self.user.clone(), self.password.clone())
    }

    /// A `.dockerconfigjson` with its user's credentials.
    pub fn docker_config_json(&self) -> String {
        kmm_registry_fixture::docker_config_json(&self.address, &self.user, &self.password)
    }

    /// Copies `image` of the fleet's first registry (plain HTTP, open) into this one as
    /// `name`; returns the digest this registry serves for it.
    pub async fn copy_from_fleet(&self, image: &str, name: &str) -> Result<String> {
        let source = Client::new(ClientConfig {
            protocol: ClientProtocol::Http,
            ..ClientConfig::default()
        });
        let reference = |image: &str| {
            image
                .parse::<Reference>()
                .map_err(|e| Error::Invalid(format!("image {image}: {e}")))
        };
        let pulled = source
            .pull(
                &reference(image)?,
                &RegistryAuth::Anonymous,
                vec![
                    oci_client::manifest::IMAGE_LAYER_GZIP_MEDIA_TYPE,
                    oci_client::manifest::IMAGE_LAYER_MEDIA_TYPE,
                    oci_client::manifest::IMAGE_DOCKER_LAYER_GZIP_MEDIA_TYPE,
                ],
            )
            .await?;
        let target = reference(&self.image(name))?;
        let client = self.client();
        client
            .push(
                &target,
                &pulled.layers,
                Config::new(
                    pulled.config.data.clone(),
                    pulled.config.media_type.clone(),
                    pulled.config.annotations.clone(),
                ),
                &self.auth(),
                pulled.manifest,
            )
            .await?;
        Ok(client.fetch_manifest_digest(&target, &self.auth()).await?)
    }

    /// The digest `name` points at now.
    pub async fn digest(&self, name: &str) -> Result<String> {
        let target = self
            .image(name)
            .parse::<Reference>()
            .map_err(|e| Error::Invalid(format!("image {name}: {e}")))?;
        Ok(self
            .client()
            .fetch_manifest_digest(&target, &self.auth())
            .await?)
    }
}

/// The fleet's second registry, started if it does not run yet; fails naming what is
/// wrong when it cannot start, or when the hub reaches it or a spoke does not.
pub async fn spoke_registry(settings: &Settings, state: &State) -> Result<SpokeRegistry> {
    let dir = &settings.state_dir;
    let lock_path = dir.join(format!("{RECORD}.lock"));
    let lock = std::fs::File::create(&lock_path)
        .context(|| format!("creating {}", lock_path.display()))?;
    // Test binaries run at once: one starts it, the others wait and find it.
    lock.lock()
        .context(|| format!("locking {}", lock_path.display()))?;
    let registry = match running(dir)? {
        Some(registry) => registry,
        None => start(settings, state).await?,
    };
    let network = state
        .network
        .as_ref()
        .ok_or_else(|| Error::Invalid("the fleet has no bridge: no real nodes".into()))?;
    let gateway = network.gateway;
    let port = registry
        .address
        .parse::<SocketAddr>()
        .map_err(|e| Error::Invalid(format!("{RECORD}: address {}: {e}", registry.address)))?
        .port();
    hide_from_hub(state, gateway, port)?;
    prove_reachability(state, gateway, port)?;
    drop(lock);
    Ok(registry)
}

/// The recorded registry, if its process still runs.
fn running(dir: &Path) -> Result<Option<SpokeRegistry>> {
    let path = dir.join(RECORD);
    let registry: SpokeRegistry = match std::fs::read(&path) {
        Ok(bytes) => serde_json::from_slice(&bytes)
            .map_err(|e| Error::Invalid(format!("{}: {e}", path.display())))?,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => {
            return Err(Error::Io {
                context: format!("reading {}", path.display()),
                source: e,
            });
        }
    };
    let alive = State::load(dir)?.is_some_and(|state| {
        state
            .processes
            .iter()
            .any(|p| p.name == PROCESS && p.pid == registry.pid && p.alive())
    });
    Ok(alive.then_some(registry))
}

async fn start(settings: &Settings, state: &State) -> Result<SpokeRegistry> {
    let dir = &settings.state_dir;
    let network = state
        .network
        .as_ref()
        .ok_or_else(|| Error::Invalid("the fleet has no bridge: no real nodes".into()))?;
    let port = TcpListener::bind((network.gateway, 0))
        .and_then(|l| l.local_addr())
        .context(|| format!("finding a free port on {}", network.gateway))?
        .port();
    let address = SocketAddr::from((network.gateway, port)).to_string();
    let registry_dir = dir.join(DIR);
    // A registry of an earlier run of this fleet is gone: start afresh.
    if registry_dir.exists() {
        std::fs::remove_dir_all(&registry_dir)
            .context(|| format!("removing {}", registry_dir.display()))?;
    }
    std::fs::create_dir_all(&registry_dir)
        .context(|| format!("creating {}", registry_dir.display()))?;
    let (ca_pem, ca_key) = internal_ca("kmm-fleet spoke registry CA");
    let user = "kmm-spoke".to_owned();
    let password = random_hex(16)?;
    let config = tls_with_auth_config(
        &registry_dir,
        &address,
        (&ca_pem, &ca_key),
        (&user, &password),
    )?;
    let log = dir.join("logs").join(format!("{PROCESS}.log"));
    std::fs::create_dir_all(dir.join("logs")).context(|| "creating the logs directory".into())?;
    let tracked = spawn(
        PROCESS,
        &registry_binary()?,
        &["serve".to_owned(), config.display().to_string()],
        &[],
        &log,
        None,
    )?;
    record_process(dir, &tracked)?;
    wait_listening(&tracked, network.gateway, port, &log).await?;
    let registry = SpokeRegistry {
        address,
        ca_pem,
        user,
        password,
        pid: tracked.pid,
    };
    let path = dir.join(RECORD);
    let text = serde_json::to_vec_pretty(&registry)
        .map_err(|e| Error::Invalid(format!("{RECORD}: {e}")))?;
    std::fs::write(&path, text).context(|| format!("writing {}", path.display()))?;
    Ok(registry)
}

/// Adds the registry to the fleet's processes, which `env down` stops.
fn record_process(dir: &Path, tracked: &Tracked) -> Result<()> {
    let mut state =
        State::load(dir)?.ok_or_else(|| Error::Invalid("no fleet is running".into()))?;
    state.processes.retain(|p| p.name != PROCESS);
    state.processes.push(tracked.clone());
    state.save(dir)
}

async fn wait_listening(tracked: &Tracked, ip: Ipv4Addr, port: u16, log: &Path) -> Result<()> {
    let deadline = tokio::time::Instant::now() + START_TIMEOUT;
    loop {
        if tokio::net::TcpStream::connect((ip, port)).await.is_ok() {
            return Ok(());
        }
        if !tracked.alive() {
            return Err(Error::Component {
                component: PROCESS.into(),
                reason: "exited".into(),
                log: log.to_owned(),
            });
        }
        if tokio::time::Instant::now() >= deadline {
            return Err(Error::Timeout {
                what: format!("the spoke registry to listen on {ip}:{port}"),
                seconds: START_TIMEOUT.as_secs(),
            });
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The rules in the hub's real nodes that reject the registry's address and port.
fn hub_rules(gateway: Ipv4Addr, port: u16) -> Vec<Vec<String>> {
    ["OUTPUT", "FORWARD"]
        .into_iter()
        .map(|chain| {
            [
                chain,
                "-p",
                "tcp",
                "-d",
                &gateway.to_string(),
                "--dport",
                &port.to_string(),
                "-j",
                "REJECT",
                "--reject-with",
                "tcp-reset",
            ]
            .map(str::to_owned)
            .to_vec()
        })
        .collect()
}

/// Inserts the hub nodes' rules unless they are there (a registry found running).
fn hide_from_hub(state: &State, gateway: Ipv4Addr, port: u16) -> Result<()> {
    for node in &state.cluster("hub")?.real_nodes {
        for rule in hub_rules(gateway, port) {
            if iptables(&node.netns, "-C", &rule).is_err() {
                iptables(&node.netns, "-I", &rule)?;
            }
        }
    }
    Ok(())
}

/// Fails unless no hub node and every spoke node reaches the registry.
fn prove_reachability(state: &State, gateway: Ipv4Addr, port: u16) -> Result<()> {
    for cluster in &state.clusters {
        let hub = cluster.name == "hub";
        for node in &cluster.real_nodes {
            let reached = connects_from(&node.netns, gateway, port)?;
            if reached == hub {
                return Err(Error::Invalid(format!(
                    "the spoke registry {gateway}:{port} is {} from {} (network namespace {}): \
                     it must be reachable from every spoke and from no hub node",
                    if reached { "reachable" } else { "unreachable" },
                    node.name,
                    node.netns,
                )));
            }
        }
    }
    Ok(())
}

/// Whether a TCP connection from the network namespace `netns` to `ip:port` opens.
fn connects_from(netns: &str, ip: Ipv4Addr, port: u16) -> Result<bool> {
    let status = Command::new("ip")
        .args(["netns", "exec", netns, "timeout"])
        .arg(PROBE_TIMEOUT.as_secs().to_string())
        .args(["bash", "-c", &format!("exec 3<>/dev/tcp/{ip}/{port}")])
        .status()
        .context(|| format!("probing {ip}:{port} from network namespace {netns}"))?;
    Ok(status.success())
}

fn random_hex(bytes: usize) -> Result<String> {
    use std::io::Read as _;
    let mut buffer = vec![0u8; bytes];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut buffer))
        .context(|| "reading /dev/urandom".into())?;
    Ok(buffer.iter().map(|b| format!("{b:02x}")).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_hub_rules_reject_only_the_registry_for_the_node_and_its_pods() {
        let rules = hub_rules(Ipv4Addr::new(198, 18, 16, 1), 40123);
        assert_eq!(rules.len(), 2);
        assert_eq!(
            rules[0].join(" "),
            "OUTPUT -p tcp -d 198.18.16.1 --dport 40123 -j REJECT --reject-with tcp-reset"
        );
        assert_eq!(rules[1][0], "FORWARD");
    }
}
