//! Writes (or checks) the CRD YAML generated from `kmm-api`.

use std::{fs, path::Path};

use anyhow::{Context, bail};

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
        let path = root.join(path);
        if check {
            let committed =
                fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
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
    Ok(())
}
