//! The fleet UI: a read-only web view of the hub's live state, on a port of its own that
//! no Service exposes (reached with `kubectl port-forward`; see docs/fleet-view.md).
//!
//! Each page is built in two steps: a page model, computed from the fleet view's reads
//! (each cluster's lock held only while that cluster is read), then its HTML, rendered
//! from the model by askama templates that escape every value. The models are the only
//! input of the templates and have no field a credential could be put in: what reaches
//! a page is names, counts, states, reasons and messages. Pages are complete without
//! JavaScript; the embedded script only follows [`live`] to fetch them again.

pub mod cluster_grid;
pub mod cluster_page;
pub mod fleet_page;
pub mod live;
pub mod module_page;
pub mod node_page;
pub mod render;
pub mod replica;
pub mod routes;
pub mod server;
#[cfg(any(test, feature = "testing"))]
pub mod testing;

#[cfg(test)]
mod tests;
