//! A kmod image relying on the node's own modules, as upstream documents it (issue 29,
//! item 5): `kmm_crc_user` calls `crc_itu_t()`, which the kernel's in-tree `crc-itu-t.ko`
//! exports and the image does not carry. The image holds upstream's in-tree dependency
//! link, `opt/lib/modules/<kernel>/host -> /lib/modules/<kernel>`, and the `modules.dep`
//! that `depmod -b /opt` wrote through it on a machine holding that kernel's modules (here
//! the guest kernel's package), so `modprobe` on the node resolves the dependency in the
//! node's tree. Pushed as `samples/kmm-crc-user:<kernel>`.

use std::path::Path;
use std::process::Command;

use super::kernel_package::KernelPackage;
use crate::kmod::{self, SampleImage};
use crate::process::run;
use crate::{IoContext, Result};

pub const REPOSITORY: &str = "samples/kmm-crc-user";
/// The module the image carries.
pub const MODULE: &str = "kmm_crc_user";
/// The in-tree module it depends on, as the kernel names it, and its file in the tree.
pub const IN_TREE_DEPENDENCY: &str = "crc_itu_t";
pub const IN_TREE_FILE: &str = "kernel/lib/crc-itu-t.ko";
/// The link's name in the image's module directory (upstream's example calls it so too).
pub const LINK: &str = "host";

const SOURCES: &[(&str, &str)] = &[
    ("Kbuild", include_str!("../../kmod/in_tree/Kbuild")),
    (
        "kmm_crc_user.c",
        include_str!("../../kmod/in_tree/kmm_crc_user.c"),
    ),
];

/// Builds the image for `kernel` in `work` and pushes it to `registry` (`host:port`,
/// plain HTTP); the pushed reference's tag is the kernel release.
pub async fn push(registry: &str, kernel: &KernelPackage, work: &Path) -> Result<SampleImage> {
    let root = work.join("in-tree-image");
    if root.exists() {
        std::fs::remove_dir_all(&root).context(|| format!("removing {}", root.display()))?;
    }
    let modules = root.join("opt/lib/modules").join(&kernel.release);
    std::fs::create_dir_all(modules.join("extra"))
        .context(|| format!("creating {}", modules.display()))?;
    let compiled = kmod::compile(&kernel.release, SOURCES, &[MODULE])?;
    let ko = format!("extra/{MODULE}.ko");
    std::fs::copy(
        compiled
            .join("opt/lib/modules")
            .join(&kernel.release)
            .join(&ko),
        modules.join(&ko),
    )
    .context(|| format!("copying {ko}"))?;
    for (file, contents) in [
        ("modules.order", format!("{ko}\n")),
        ("modules.builtin", String::new()),
        ("modules.builtin.modinfo", String::new()),
    ] {
        std::fs::write(modules.join(file), contents).context(|| format!("writing {file}"))?;
    }

    // depmod reads the kernel's modules through the link, as on upstream's build node,
    // whose /lib/modules/<kernel> this machine lacks: the link points at the package's
    // tree while depmod runs, then at the node's tree, where the image ships it to.
    let link = modules.join(LINK);
    std::os::unix::fs::symlink(kernel.modules_dir(), &link)
        .context(|| format!("linking {}", link.display()))?;
    run(Command::new("depmod")
        .arg("-b")
        .arg(root.join("opt"))
        .arg(&kernel.release))?;
    std::fs::remove_file(&link).context(|| format!("removing {}", link.display()))?;
    let on_node = format!("/lib/modules/{}", kernel.release);
    std::os::unix::fs::symlink(&on_node, &link)
        .context(|| format!("linking {}", link.display()))?;

    let dep = std::fs::read_to_string(modules.join("modules.dep"))
        .context(|| "reading the image's modules.dep".into())?;
    let through_link = format!("{ko}: {LINK}/{IN_TREE_FILE}");
    if !dep.lines().any(|line| line == through_link) {
        return Err(crate::Error::Invalid(format!(
            "depmod did not resolve {MODULE}'s dependency through the link: no `{through_link}` in modules.dep"
        )));
    }
    kmod::push_root(
        registry,
        REPOSITORY,
        &kernel.release,
        &kernel.release,
        &root,
        &[],
    )
    .await
}
