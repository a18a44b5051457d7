//! The narrow interface through which the `Hub.Sync` service reads and feeds the view:
//! defined here, beside its implementation, so the service depends on the view and the
//! view never on the service.

use kmm_proto::v1::{DevicePluginReport, KernelInventory, NodeStatusReport, SpokeImageReport};
use tokio::sync::watch;

use super::SessionId;
use crate::fleet::outbox::Held;
use crate::serve::outbound::OutboundSender;

/// What the service may do with the fleet view: open and close a cluster's session and
/// hand it what the proxy reports.
pub trait ClusterStreams: Send + Sync + std::fmt::Debug + 'static {
    /// Set once, with the reason, when the hub ends every stream.
    fn ending(&self) -> watch::Receiver<Option<String>>;
    /// True once every watch has listed.
    fn synced(&self) -> watch::Receiver<bool>;
    /// Whether the cluster is one the hub accepts; `None` until the watches listed.
    fn accepts_cluster(&self, cluster: &str) -> Option<bool>;
    fn open_session(&self, cluster: &str, held: Held, outbound: OutboundSender) -> SessionId;
    fn close_session(&self, cluster: &str, id: SessionId);
    fn inventory(&self, cluster: &str, id: SessionId, inventory: KernelInventory);
    fn status(&self, cluster: &str, id: SessionId, report: NodeStatusReport);
    fn device_plugins(&self, cluster: &str, id: SessionId, report: DevicePluginReport);
    fn spoke_images(&self, cluster: &str, id: SessionId, report: SpokeImageReport);
}
