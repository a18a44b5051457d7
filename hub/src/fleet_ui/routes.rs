//! The fleet UI's routes: a request's path and query, parsed and checked before any
//! page is built. Names are Kubernetes object names; anything else is refused.

use thiserror::Error;

use super::cluster_grid::GridFilter;
use crate::fleet::cluster_states::ClusterState;

/// What a request asks for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Route {
    /// `/`
    Fleet,
    /// `/modules/{name}`, its grid filtered by `?state=&q=`.
    Module { name: String, filter: GridFilter },
    /// `/clusters/{name}`, its nodes filtered by `?q=`.
    Cluster {
        name: String,
        filter: Option<String>,
    },
    /// `/clusters/{name}/nodes/{node}`
    Node { cluster: String, node: String },
    /// `/events`: server-sent events telling pages that the view changed.
    Events,
    /// `/assets/...`: the embedded stylesheet and script.
    Asset(Asset),
}

/// The files the pages load, embedded in the binary (clusters are often offline).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Asset {
    Stylesheet,
    Script,
}

impl Asset {
    pub fn content_type(self) -> &'static str {
        match self {
            Self::Stylesheet => "text/css; charset=utf-8",
            Self::Script => "text/javascript; charset=utf-8",
        }
    }

    pub fn body(self) -> &'static str {
        match self {
            Self::Stylesheet => include_str!("assets/fleet.css"),
            Self::Script => include_str!("assets/live.js"),
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum RouteError {
    #[error("no such page")]
    NotFound,
    #[error("{0:?} is not a Kubernetes object name")]
    BadName(String),
    #[error("bad query parameter {0:?}")]
    BadQuery(String),
}

/// Longest name accepted: a DNS subdomain's.
const MAX_NAME: usize = 253;

/// Whether `name` can name a module, cluster or node: a DNS subdomain (lower-case
/// letters, digits, `-` and `.`).
fn is_object_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= MAX_NAME
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.')
}

fn object_name(name: &str) -> Result<String, RouteError> {
    if is_object_name(name) {
        Ok(name.to_owned())
    } else {
        Err(RouteError::BadName(name.to_owned()))
    }
}

/// The query's parameters; each value must be empty or a name part (nothing to decode).
fn parameters(query: Option<&str>) -> Result<Vec<(&str, &str)>, RouteError> {
    query
        .unwrap_or_default()
        .split('&')
        .filter(|pair| !pair.is_empty())
        .map(|pair| {
            let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
            if value.is_empty() || is_object_name(value) {
                Ok((key, value))
            } else {
                Err(RouteError::BadQuery(pair.to_owned()))
            }
        })
        .collect()
}

/// The name part to filter by (`q`), when given.
fn name_filter(parameters: &[(&str, &str)]) -> Option<String> {
    parameters
        .iter()
        .find(|(key, value)| *key == "q" && !value.is_empty())
        .map(|(_, value)| (*value).to_owned())
}

/// Parses a GET request's path and query.
pub fn route(path: &str, query: Option<&str>) -> Result<Route, RouteError> {
    let segments: Vec<&str> = path.strip_prefix('/').unwrap_or(path).split('/').collect();
    let parameters = parameters(query)?;
    match segments.as_slice() {
        [""] => Ok(Route::Fleet),
        ["events"] => Ok(Route::Events),
        ["assets", "fleet.css"] => Ok(Route::Asset(Asset::Stylesheet)),
        ["assets", "live.js"] => Ok(Route::Asset(Asset::Script)),
        ["modules", name] => {
            let state = match parameters.iter().find(|(key, _)| *key == "state") {
                None | Some((_, "")) => None,
                Some((_, value)) => Some(
                    ClusterState::parse(value)
                        .ok_or_else(|| RouteError::BadQuery(format!("state={value}")))?,
                ),
            };
            Ok(Route::Module {
                name: object_name(name)?,
                filter: GridFilter {
                    state,
                    name: name_filter(&parameters),
                },
            })
        }
        ["clusters", name] => Ok(Route::Cluster {
            name: object_name(name)?,
            filter: name_filter(&parameters),
        }),
        ["clusters", cluster, "nodes", node] => Ok(Route::Node {
            cluster: object_name(cluster)?,
            node: object_name(node)?,
        }),
        _ => Err(RouteError::NotFound),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pages_are_routed_by_path_and_query() {
        assert_eq!(route("/", None), Ok(Route::Fleet));
        assert_eq!(route("/events", None), Ok(Route::Events));
        assert_eq!(
            route("/modules/hello", Some("state=failed&q=spoke-1")),
            Ok(Route::Module {
                name: "hello".into(),
                filter: GridFilter {
                    state: Some(ClusterState::Failed),
                    name: Some("spoke-1".into()),
                },
            })
        );
        assert_eq!(
            route("/modules/hello", Some("state=&q=")),
            Ok(Route::Module {
                name: "hello".into(),
                filter: GridFilter::default(),
            }),
            "the filter form's empty fields filter nothing"
        );
        assert_eq!(
            route("/clusters/spoke1/nodes/n1.example", None),
            Ok(Route::Node {
                cluster: "spoke1".into(),
                node: "n1.example".into(),
            })
        );
        assert_eq!(
            route("/assets/live.js", None),
            Ok(Route::Asset(Asset::Script))
        );
    }

    #[test]
    fn unknown_paths_are_not_found() {
        for path in [
            "/nope",
            "/modules",
            "/modules/a/b",
            "/clusters/a/nodes",
            "/assets/x.js",
            "//",
        ] {
            assert_eq!(route(path, None), Err(RouteError::NotFound), "{path}");
        }
    }

    #[test]
    fn names_and_filters_that_are_not_object_names_are_refused() {
        for path in [
            "/modules/%3Cscript%3E",
            "/modules/Hello",
            "/clusters/a_b",
            "/modules/..%2F",
        ] {
            assert!(
                matches!(route(path, None), Err(RouteError::BadName(_))),
                "{path}"
            );
        }
        let long = format!("/clusters/{}", "a".repeat(254));
        assert!(matches!(route(&long, None), Err(RouteError::BadName(_))));
        assert!(matches!(
            route("/modules/hello", Some("state=gone")),
            Err(RouteError::BadQuery(_))
        ));
        assert!(matches!(
            route("/modules/hello", Some("q=%3Cb%3E")),
            Err(RouteError::BadQuery(_))
        ));
    }
}
