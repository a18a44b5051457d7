//! The fleet's OCI registry: on loopback for the host, forwarded to the bridge for the
//! real nodes, holding the nodes' own images and the sample kmod images.

use kmm_registry_fixture::{registry_binary, registry_config};

use super::control_plane::{LOOPBACK, http_get_plain};
use super::{Starting, nodes, wait_for};
use crate::Result;

impl Starting {
    /// The registry, its forwarder to the bridge, and the real nodes' images.
    pub(super) async fn registry(&mut self) -> Result<()> {
        let port = self.ports.registry();
        let dir = self.dir.join("registry");
        let config = registry_config(&dir, port)?;
        let program = registry_binary()?;
        let registry = self.start_program(
            "registry",
            &program,
            vec!["serve".into(), config.display().to_string()],
            &[],
        )?;
        wait_for(&registry, "the OCI registry /v2/", || async move {
            http_get_plain(LOOPBACK, port, "/v2/").await.is_some()
        })
        .await?;
        self.forward("registry-forward", port).await?;
        self.state.registry = format!("127.0.0.1:{port}");
        self.state.node_registry = format!("{}:{port}", self.network.gateway);
        self.state.node_images = Some(
            nodes::images::push(
                &self.state.registry,
                &self.state.node_registry,
                &self.versions.kubernetes.version,
            )
            .await?,
        );
        self.state.save(&self.dir)
    }
}
