//! What the monitoring tests read from `addon-manifests/monitoring/` (the alerting rules
//! as `promtool` takes them, the dashboard's queries), and a real Prometheus to ask.

use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use serde_json::Value as Json;
use serde_yaml_ng::Value as Yaml;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::wait::wait_until;
use crate::{Error, IoContext, Result};

/// `addon-manifests/monitoring/`.
pub fn manifests_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../addon-manifests/monitoring")
}

/// The PrometheusRule's `spec`: a plain rule-groups file, which is what `promtool` and
/// a Prometheus without the Operator read. Extracted rather than kept twice, so that
/// what is tested is what is installed.
pub fn rule_groups() -> Result<String> {
    let path = manifests_dir().join("prometheus-rule.yaml");
    let text = std::fs::read_to_string(&path).context(|| format!("reading {}", path.display()))?;
    let rule: Yaml = serde_yaml_ng::from_str(&text)
        .map_err(|e| Error::Invalid(format!("{}: {e}", path.display())))?;
    if rule["kind"].as_str() != Some("PrometheusRule") {
        return Err(Error::Invalid(format!(
            "{} is not a PrometheusRule",
            path.display()
        )));
    }
    serde_yaml_ng::to_string(&rule["spec"])
        .map_err(|e| Error::Invalid(format!("{}: spec: {e}", path.display())))
}

/// One panel target of the dashboard.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PanelQuery {
    pub panel: String,
    pub expr: String,
}

/// Every query of `dashboard.json`'s panels (rows' nested panels included), with the
/// dashboard's `$__rate_interval` replaced by a fixed window a plain Prometheus
/// understands.
pub fn dashboard_queries() -> Result<Vec<PanelQuery>> {
    let path = manifests_dir().join("dashboard.json");
    let text = std::fs::read_to_string(&path).context(|| format!("reading {}", path.display()))?;
    let dashboard: Json = serde_json::from_str(&text)
        .map_err(|e| Error::Invalid(format!("{}: {e}", path.display())))?;
    let mut queries = Vec::new();
    collect_queries(&dashboard["panels"], &mut queries);
    Ok(queries)
}

fn collect_queries(panels: &Json, into: &mut Vec<PanelQuery>) {
    for panel in panels.as_array().into_iter().flatten() {
        collect_queries(&panel["panels"], into);
        let title = panel["title"].as_str().unwrap_or_default();
        for target in panel["targets"].as_array().into_iter().flatten() {
            if let Some(expr) = target["expr"].as_str() {
                into.push(PanelQuery {
                    panel: title.to_owned(),
                    expr: expr.replace("$__rate_interval", "5m"),
                });
            }
        }
    }
}

/// The toolchain's `prometheus`, on 127.0.0.1 with `config` (JSON is YAML: Prometheus
/// reads it as is) and a data directory of its own; killed when dropped.
#[derive(Debug)]
pub struct Prometheus {
    child: Child,
    address: SocketAddr,
    dir: tempfile::TempDir,
}

impl Prometheus {
    /// Starts it and waits until it answers `/-/ready`.
    pub async fn start(binary: &Path, config: &Json) -> Result<Self> {
        let dir = tempfile::tempdir().context(|| "creating Prometheus' directory".into())?;
        let config_file = dir.path().join("prometheus.yaml");
        let text = serde_json::to_vec_pretty(config)
            .map_err(|e| Error::Invalid(format!("Prometheus configuration: {e}")))?;
        std::fs::write(&config_file, text)
            .context(|| format!("writing {}", config_file.display()))?;
        let port = std::net::TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
            .and_then(|l| l.local_addr())
            .context(|| "finding a free port".into())?
            .port();
        let address = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
        let log_file = dir.path().join("prometheus.log");
        let log = std::fs::File::create(&log_file)
            .context(|| format!("creating {}", log_file.display()))?;
        let child = Command::new(binary)
            .arg(format!("--config.file={}", config_file.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.path().join("data").display()
            ))
            .arg(format!("--web.listen-address={address}"))
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .context(|| format!("starting {}", binary.display()))?;
        let prometheus = Self {
            child,
            address,
            dir,
        };
        wait_until(
            "Prometheus to be ready",
            Duration::from_secs(60),
            || async {
                match prometheus.get("/-/ready").await {
                    Ok((200, _)) => Ok(()),
                    Ok((status, body)) => Err(format!("{status}: {body}")),
                    Err(e) => Err(e.to_string()),
                }
            },
        )
        .await?;
        Ok(prometheus)
    }

    /// Its log so far, for a failure's message.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("prometheus.log")).unwrap_or_default()
    }

    /// The result of an instant query (a vector's samples, a scalar's value); an error
    /// for a query Prometheus refuses.
    pub async fn query(&self, expr: &str) -> Result<Vec<Json>> {
        let (_, body) = self
            .get(&format!("/api/v1/query?query={}", form_encode(expr)))
            .await?;
        let answer: Json = serde_json::from_str(&body)
            .map_err(|e| Error::Invalid(format!("{expr}: not JSON ({e}): {body}")))?;
        if answer["status"] != "success" {
            return Err(Error::Invalid(format!("{expr}: {answer}")));
        }
        Ok(match &answer["data"]["result"] {
            Json::Array(samples) => samples.clone(),
            Json::Null => vec![],
            scalar => vec![scalar.clone()],
        })
    }

    /// A plain HTTP/1.0 GET: its status and body.
    async fn get(&self, path_and_query: &str) -> Result<(u16, String)> {
        let what = || format!("GET {path_and_query} from Prometheus at {}", self.address);
        let mut stream = tokio::net::TcpStream::connect(self.address)
            .await
            .context(what)?;
        let request = format!(
            "GET {path_and_query} HTTP/1.0\r\nHost: {}\r\n\r\n",
            self.address
        );
        stream.write_all(request.as_bytes()).await.context(what)?;
        let mut response = String::new();
        stream.read_to_string(&mut response).await.context(what)?;
        let (head, body) = response
            .split_once("\r\n\r\n")
            .ok_or_else(|| Error::Invalid(format!("{}: no HTTP response", what())))?;
        let status = head
            .split_whitespace()
            .nth(1)
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| Error::Invalid(format!("{}: {head}", what())))?;
        Ok((status, body.to_owned()))
    }
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `application/x-www-form-urlencoded`, for a query parameter.
fn form_encode(value: &str) -> String {
    value
        .bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_rule_groups_are_the_prometheus_rules_spec() {
        let groups: Yaml = serde_yaml_ng::from_str(&rule_groups().unwrap()).unwrap();
        let names: Vec<_> = groups["groups"]
            .as_sequence()
            .unwrap()
            .iter()
            .map(|g| g["name"].as_str().unwrap())
            .collect();
        assert_eq!(names, ["kmm-hub", "kmm-spoke", "kmm-components"]);
    }

    #[test]
    fn query_parameters_are_form_encoded() {
        assert_eq!(
            form_encode(r#"sum by (le) (x{a="b"}[5m])"#),
            "sum%20by%20%28le%29%20%28x%7Ba%3D%22b%22%7D%5B5m%5D%29"
        );
    }

    #[test]
    fn every_panel_has_a_query() {
        let queries = dashboard_queries().unwrap();
        assert!(!queries.is_empty());
        for q in &queries {
            assert!(!q.expr.contains("$__"), "{q:?}");
        }
    }
}
