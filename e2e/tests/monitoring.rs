//! `addon-manifests/monitoring/` against the real `promtool` and `prometheus` (built from
//! the Go module proxy on first use, then cached): the alerting rules are checked and
//! unit-tested, and every dashboard query is valid PromQL. Needs no fleet; that the
//! queries return data from one is `monitoring_dashboard`'s job.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, ensure};
use kmm_e2e::monitoring::{Prometheus, dashboard_queries, manifests_dir, rule_groups};
use kmm_e2e::toolchain::{BIN_DIR_ENV, Toolchain};
use kmm_e2e::versions::Versions;
use serde_yaml_ng::Value;

fn toolchain() -> Result<Toolchain> {
    Ok(Toolchain::ensure_monitoring(
        &Versions::pinned(),
        std::env::var_os(BIN_DIR_ENV).map(PathBuf::from).as_deref(),
    )?)
}

fn promtool(toolchain: &Toolchain, dir: &Path, args: &[&str]) -> Result<()> {
    let out = Command::new(toolchain.bin("promtool"))
        .args(args)
        .current_dir(dir)
        .output()
        .context("running promtool")?;
    ensure!(
        out.status.success(),
        "promtool {} failed ({}):\n{}{}",
        args.join(" "),
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(())
}

/// The rules as promtool reads them, beside their tests, in a directory of their own.
fn rules_with_tests() -> Result<tempfile::TempDir> {
    let dir = tempfile::tempdir()?;
    std::fs::write(dir.path().join("rules.yaml"), rule_groups()?)?;
    std::fs::copy(
        manifests_dir().join("tests/rules-test.yaml"),
        dir.path().join("rules-test.yaml"),
    )?;
    Ok(dir)
}

fn alerts(groups: &Value) -> Vec<&Value> {
    groups["groups"]
        .as_sequence()
        .into_iter()
        .flatten()
        .flat_map(|g| g["rules"].as_sequence().into_iter().flatten())
        .filter(|r| r["alert"].is_string())
        .collect()
}

#[test]
fn promtool_checks_the_rules_and_their_unit_tests_pass() -> Result<()> {
    let toolchain = toolchain()?;
    let dir = rules_with_tests()?;
    promtool(&toolchain, dir.path(), &["check", "rules", "rules.yaml"])?;
    promtool(
        &toolchain,
        dir.path(),
        &["test", "rules", "rules-test.yaml"],
    )
}

#[test]
fn every_alert_is_tested_and_has_a_runbook_section() -> Result<()> {
    let groups: Value = serde_yaml_ng::from_str(&rule_groups()?)?;
    let tests: Value = serde_yaml_ng::from_str(&std::fs::read_to_string(
        manifests_dir().join("tests/rules-test.yaml"),
    )?)?;
    let tested: BTreeSet<&str> = tests["tests"]
        .as_sequence()
        .into_iter()
        .flatten()
        .flat_map(|t| t["alert_rule_test"].as_sequence().into_iter().flatten())
        .filter(|t| t["exp_alerts"].as_sequence().is_some_and(|a| !a.is_empty()))
        .filter_map(|t| t["alertname"].as_str())
        .collect();
    let docs = std::fs::read_to_string(manifests_dir().join("../../docs/monitoring.md"))?;
    // GitHub's anchor of a `### Name` heading made of letters only: its lowercase.
    let anchors: BTreeSet<String> = docs
        .lines()
        .filter_map(|l| l.strip_prefix("### "))
        .map(str::to_lowercase)
        .collect();
    let alerts = alerts(&groups);
    ensure!(!alerts.is_empty(), "no alert in the rules");
    for alert in alerts {
        let name = alert["alert"].as_str().unwrap_or_default();
        ensure!(tested.contains(name), "{name}: no test case fires it");
        for key in ["summary", "description", "runbook_url"] {
            ensure!(
                alert["annotations"][key].is_string(),
                "{name}: no {key} annotation"
            );
        }
        ensure!(
            ["warning", "critical"].contains(&alert["labels"]["severity"].as_str().unwrap_or("")),
            "{name}: severity is neither warning nor critical"
        );
        let runbook = alert["annotations"]["runbook_url"]
            .as_str()
            .unwrap_or_default();
        let anchor = runbook
            .strip_prefix("https://github.com/example/kmm-fleet/blob/main/docs/monitoring.md#")
            .with_context(|| format!("{name}: runbook_url {runbook} is not docs/monitoring.md"))?;
        ensure!(
            anchors.contains(anchor),
            "{name}: docs/monitoring.md has no `### ` heading for #{anchor}"
        );
    }
    Ok(())
}

/// A query Prometheus cannot parse (or that names a function it lacks) is refused; with
/// nothing scraped, every valid one answers with an empty result.
#[tokio::test]
async fn every_dashboard_query_is_valid_promql() -> Result<()> {
    let prometheus =
        Prometheus::start(toolchain()?.bin("prometheus"), &serde_json::json!({})).await?;
    let mut refused = vec![];
    for q in dashboard_queries()? {
        if let Err(e) = prometheus.query(&q.expr).await {
            refused.push(format!("{}: {e}", q.panel));
        }
    }
    ensure!(
        refused.is_empty(),
        "refused:\n  {}\n{}",
        refused.join("\n  "),
        prometheus.log()
    );
    Ok(())
}
