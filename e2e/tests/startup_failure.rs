//! `up` with a component that cannot start fails naming it and its log, and stops
//! everything it had started. Runs its own fleet on separate ports and state, with the
//! real binaries except a kube-controller-manager that exits at once.

use std::os::unix::fs::{PermissionsExt, symlink};
use std::path::PathBuf;

use anyhow::{Context, Result, bail, ensure};
use kmm_e2e::Error;
use kmm_e2e::fleet::network::Network;
use kmm_e2e::fleet::{self, Options, Settings, State};
use kmm_e2e::toolchain::{Toolchain, components};
use kmm_e2e::versions::Versions;

const BROKEN: &str = "kube-controller-manager";

#[tokio::test]
async fn up_names_the_component_that_failed_and_its_log_and_stops_the_rest() -> Result<()> {
    let versions = Versions::pinned();
    let real = Toolchain::locate(&versions, Settings::from_env()?.bin_dir.as_deref())?;
    let root = std::env::temp_dir().join(format!("kmm-e2e-startup-failure-{}", std::process::id()));
    let bin_dir = root.join("bin");
    std::fs::create_dir_all(&bin_dir)?;
    for binary in components(&versions).iter().flat_map(|c| c.binaries()) {
        let link = bin_dir.join(binary);
        if binary == BROKEN {
            std::fs::write(
                &link,
                "#!/bin/sh\necho 'kmm-e2e: deliberately broken' >&2\nexit 3\n",
            )?;
            std::fs::set_permissions(&link, std::fs::Permissions::from_mode(0o755))?;
        } else {
            symlink(real.bin(binary), &link)?;
        }
    }
    let settings = Settings {
        state_dir: root.join("state"),
        base_port: 26000,
        bin_dir: Some(bin_dir),
    };

    let outcome = fleet::up(
        &settings,
        &Options {
            spokes: 1,
            nodes_per_spoke: 1,
            real_nodes_per_cluster: 1,
            ocm: true,
            kmm: false,
        },
    )
    .await;
    let state = State::load(&settings.state_dir)?.context("up left no state behind")?;
    let logs: PathBuf = settings.state_dir.join("logs");
    let bridge_left = std::path::Path::new("/sys/class/net")
        .join(Network::of(settings.base_port).bridge())
        .exists();
    fleet::down(&settings)?;
    std::fs::remove_dir_all(&root)?;

    let Err(Error::Component {
        component,
        reason,
        log,
    }) = outcome
    else {
        bail!("expected a component failure, got {outcome:?}");
    };
    ensure!(component == format!("hub/{BROKEN}"), "blamed {component}");
    ensure!(
        log.starts_with(&logs),
        "log {} is not in {}",
        log.display(),
        logs.display()
    );
    ensure!(
        reason.contains("deliberately broken"),
        "the reason does not quote the log: {reason}"
    );
    ensure!(
        state.processes.is_empty(),
        "processes left running: {:?}",
        state.processes
    );
    ensure!(
        !bridge_left,
        "the real nodes' bridge (created first) is still there"
    );
    // etcd and the hub apiserver had started; nothing may still listen on their ports.
    for port in [settings.base_port + 1, settings.base_port + 43] {
        ensure!(
            tokio::net::TcpStream::connect(("127.0.0.1", port))
                .await
                .is_err(),
            "something still listens on {port}"
        );
    }
    Ok(())
}
