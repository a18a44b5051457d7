//! Writes (or checks) the CRD YAML generated from `kmm-api`: addon-manifests/crds/, and
//! the chart's copies in charts/kmm-fleet/crds/.

use std::{fs, path::Path};

use anyhow::{Context, bail};

/// Where the chart keeps its CRDs: Helm installs `crds/` before the templates, never
/// templates them, and never deletes them on uninstall.
const CHART_CRDS: &str = "charts/kmm-fleet/crds";

pub fn run(root: &Path, check: bool) -> anyhow::Result<()> {
    for (path, generated) in [
        (
            kmm_api::CRD_PATH,
            kmm_api::managed_cluster_module_crd_yaml(),
        ),
        (
            kmm_api::PREFLIGHT_CRD_PATH,
            kmm_api::preflight_validation_crd_yaml(),
        ),
    ] {
        let file_name = Path::new(path)
            .file_name()
            .context("a CRD path names a file")?;
        let chart_copy = chart_crd(&generated)?;
        for (path, generated) in [
            (root.join(path), generated),
            (root.join(CHART_CRDS).join(file_name), chart_copy),
        ] {
            if check {
                let committed = fs::read_to_string(&path)
                    .with_context(|| format!("reading {}", path.display()))?;
                if committed != generated {
                    bail!(
                        "{} is out of date with the Rust types in api/; run `cargo xtask crdgen`",
                        path.display()
                    );
                }
                println!("{} is up to date", path.display());
                continue;
            }
            fs::create_dir_all(path.parent().expect("a CRD path has a directory"))?;
            fs::write(&path, generated).with_context(|| format!("writing {}", path.display()))?;
            println!("wrote {}", path.display());
        }
    }
    Ok(())
}

/// The chart's copy of a CRD: with the label addon-manifests/hub's kustomization adds to
/// every object, since Helm does not template `crds/` (e2e/tests/helm_chart.rs holds the
/// two installs equal).
fn chart_crd(generated: &str) -> anyhow::Result<String> {
    let metadata = "kind: CustomResourceDefinition\nmetadata:\n";
    if generated.matches(metadata).count() != 1 {
        bail!("the generated CRD has not exactly one `{metadata}`");
    }
    Ok(generated.replacen(
        metadata,
        &format!("{metadata}  labels:\n    app.kubernetes.io/part-of: kmm-fleet\n"),
        1,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_chart_copy_carries_the_part_of_label() {
        let copy = chart_crd(&kmm_api::managed_cluster_module_crd_yaml()).unwrap();
        assert!(copy.contains(
            "kind: CustomResourceDefinition\nmetadata:\n  labels:\n    app.kubernetes.io/part-of: kmm-fleet\n  name: managedclustermodules."
        ));
        assert!(chart_crd("kind: Other\n").is_err());
    }
}
