//! Test fixture: attaches to the running fleet, or starts one (once per test binary)
//! when none runs, and hands out typed clients, temporary namespaces and deadlines.
//!
//! A test that cannot get a fleet fails with the reason; it never skips. A fleet the
//! fixture started is left running for the next test run; `cargo xtask env down`
//! stops it.

use std::collections::BTreeMap;
use std::sync::OnceLock;

use k8s_openapi::api::core::v1::Namespace;
use kube::api::{DeleteParams, ObjectMeta, PostParams};
use kube::{Api, Client};

use crate::fleet::{self, Options, Settings, State};
use crate::{Error, Result};

/// Here too, for the tests that wait on the fleet they attach to.
pub use crate::wait::wait_until;

/// Clients for every cluster of a running fleet.
#[derive(Clone)]
pub struct Fleet {
    pub state: State,
    pub hub: Client,
    spokes: BTreeMap<String, Client>,
}

impl std::fmt::Debug for Fleet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Fleet")
            .field("state", &self.state)
            .finish_non_exhaustive()
    }
}

static STARTED: OnceLock<std::result::Result<State, String>> = OnceLock::new();

impl Fleet {
    /// The running fleet, starting one with default options if none runs.
    pub async fn get() -> Result<Self> {
        let state = STARTED
            .get_or_init(|| {
                // `up` runs on its own runtime: each #[tokio::test] has its own, and
                // the first one to get here may end before the others.
                std::thread::spawn(|| {
                    let rt = tokio::runtime::Builder::new_multi_thread()
                        .enable_all()
                        .build()
                        .map_err(|e| e.to_string())?;
                    rt.block_on(async {
                        let settings = Settings::from_env().map_err(|e| e.to_string())?;
                        match fleet::running(&settings) {
                            Ok(state) => Ok(state),
                            Err(not_running) => {
                                eprintln!("fixture: {not_running}; starting a fleet");
                                fleet::up(&settings, &Options::default())
                                    .await
                                    .map_err(|e| e.to_string())
                            }
                        }
                    })
                })
                .join()
                .unwrap_or_else(|_| Err("starting the fleet panicked".into()))
            })
            .clone()
            .map_err(|e| Error::Invalid(format!("the local fleet cannot start: {e}")))?;
        let hub = fleet::client_for(&state.cluster("hub")?.kubeconfig).await?;
        let mut spokes = BTreeMap::new();
        for spoke in state.spokes() {
            spokes.insert(
                spoke.name.clone(),
                fleet::client_for(&spoke.kubeconfig).await?,
            );
        }
        Ok(Self { state, hub, spokes })
    }

    /// The client of spoke `name` (`spoke1`, ...).
    pub fn spoke(&self, name: &str) -> Result<&Client> {
        self.spokes.get(name).ok_or_else(|| {
            Error::Invalid(format!("no spoke {name}; spokes: {:?}", self.spokes.keys()))
        })
    }

    pub fn spoke_names(&self) -> Vec<String> {
        self.spokes.keys().cloned().collect()
    }

    /// The fleet's second registry, which the spokes reach and the hub does not, started
    /// on first use (see [`fleet::spoke_registry`]).
    pub async fn spoke_registry(&self) -> Result<fleet::spoke_registry::SpokeRegistry> {
        let settings = Settings::from_env()?;
        fleet::spoke_registry::spoke_registry(&settings, &self.state).await
    }
}

/// A namespace with a generated name, deleted by [`TempNamespace::delete`].
pub struct TempNamespace {
    pub name: String,
    client: Client,
}

impl std::fmt::Debug for TempNamespace {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TempNamespace")
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

impl TempNamespace {
    pub async fn create(client: &Client, prefix: &str) -> Result<Self> {
        let api: Api<Namespace> = Api::all(client.clone());
        let ns = Namespace {
            metadata: ObjectMeta {
                generate_name: Some(format!("{prefix}-")),
                ..Default::default()
            },
            ..Default::default()
        };
        let created = api.create(&PostParams::default(), &ns).await?;
        let name = created
            .metadata
            .name
            .ok_or_else(|| Error::Invalid("created namespace has no name".into()))?;
        Ok(Self {
            name,
            client: client.clone(),
        })
    }

    pub async fn delete(self) -> Result<()> {
        let api: Api<Namespace> = Api::all(self.client.clone());
        api.delete(&self.name, &DeleteParams::background()).await?;
        Ok(())
    }
}
