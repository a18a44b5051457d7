//! The pages' HTML, rendered by askama from the page models. Templates (hub/templates/)
//! are checked at compile time and escape every value as HTML; none marks a value safe.

use askama::Template;

use super::cluster_page::ClusterPage;
use super::fleet_page::{BAR_WIDTH, FleetPage};
use super::module_page::ModulePage;
use super::node_page::NodePage;
use crate::fleet::cluster_states::ClusterState;

/// What every page shows around its content: which replica serves it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Chrome {
    /// This replica's name (its Pod).
    pub instance: String,
    /// Said above the content, e.g. that the caches are still syncing.
    pub note: Option<String>,
}

#[derive(Template)]
#[template(path = "fleet.html")]
struct FleetHtml<'a> {
    chrome: &'a Chrome,
    page: &'a FleetPage,
    bar_width: u32,
}

#[derive(Template)]
#[template(path = "module.html")]
struct ModuleHtml<'a> {
    chrome: &'a Chrome,
    page: &'a ModulePage,
    states: [ClusterState; 5],
}

#[derive(Template)]
#[template(path = "cluster.html")]
struct ClusterHtml<'a> {
    chrome: &'a Chrome,
    page: &'a ClusterPage,
}

#[derive(Template)]
#[template(path = "node.html")]
struct NodeHtml<'a> {
    chrome: &'a Chrome,
    page: &'a NodePage,
}

/// What a standby replica shows instead of the fleet.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StandbyPage {
    /// `<namespace>/<name>` of the leader Lease.
    pub lease: String,
    pub namespace: String,
    /// The Pod holding the Lease, when one does.
    pub leader: Option<String>,
    /// The port replicas serve the UI on (as this one does).
    pub port: u16,
    /// Why the Lease could not be read, when it could not.
    pub lookup_error: Option<String>,
}

#[derive(Template)]
#[template(path = "standby.html")]
struct StandbyHtml<'a> {
    chrome: &'a Chrome,
    page: &'a StandbyPage,
}

#[derive(Template)]
#[template(path = "problem.html")]
struct ProblemHtml<'a> {
    chrome: &'a Chrome,
    title: &'a str,
    detail: &'a str,
}

pub fn fleet(chrome: &Chrome, page: &FleetPage) -> askama::Result<String> {
    FleetHtml {
        chrome,
        page,
        bar_width: BAR_WIDTH,
    }
    .render()
}

pub fn module(chrome: &Chrome, page: &ModulePage) -> askama::Result<String> {
    ModuleHtml {
        chrome,
        page,
        states: ClusterState::ALL,
    }
    .render()
}

pub fn cluster(chrome: &Chrome, page: &ClusterPage) -> askama::Result<String> {
    ClusterHtml { chrome, page }.render()
}

pub fn node(chrome: &Chrome, page: &NodePage) -> askama::Result<String> {
    NodeHtml { chrome, page }.render()
}

pub fn standby(chrome: &Chrome, page: &StandbyPage) -> askama::Result<String> {
    StandbyHtml { chrome, page }.render()
}

/// A page saying what went wrong (not found, a bad name).
pub fn problem(chrome: &Chrome, title: &str, detail: &str) -> askama::Result<String> {
    ProblemHtml {
        chrome,
        title,
        detail,
    }
    .render()
}
