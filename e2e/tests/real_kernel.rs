//! Issue 6: the node agent's host backend on a real kernel. Debian's cloud kernel boots
//! under qemu with the workspace's `kmm-node-agent`, which attaches over TLS with a
//! bearer token to a test peer of kmm-spoke-proxy's agent endpoint on the host
//! (`kmm_e2e::guest::agent_peer`), exactly as it would to the proxy. The peer sends
//! `DesiredModules`; the agent pulls the sample kmod image from the fleet's registry
//! (through qemu's user network) and loads and unloads the modules with Debian's
//! modprobe. What the agent did is read from its `ModuleEvent`s and hellos; what the
//! kernel did is read from the guest kernel's own view: `/sys/module`, `/proc/modules`,
//! the firmware_class search path, dmesg.
//!
//! Three boots share one disk holding the agent's state and cache:
//! 1. load (parameters, dependency order, firmware, in-tree removal), restart the
//!    agent (its hello lists the module, nothing is reloaded), unload, load again;
//! 2. a reboot: the state of boot 1 is from another boot, so the hello lists nothing
//!    and the agent loads again;
//! 3. a boot with `module.sig_enforce=1`: the unsigned module is refused by the kernel
//!    and the agent's failed event names that refusal.
//!
//! Figures are printed with the prefix `real-kernel:`; a failure leaves the consoles and
//! the agent's logs in the work directory it names.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use kmm_e2e::fixture::Fleet;
use kmm_e2e::guest::agent_peer::{AgentPeer, Session};
use kmm_e2e::guest::firmware_image::{self, FIRMWARE_FILE, FIRMWARE_PATH};
use kmm_e2e::guest::initramfs::{AGENT, GuestFile};
use kmm_e2e::guest::machine::Machine;
use kmm_e2e::guest::{HOST_FROM_GUEST, KERNEL, Rig};
use kmm_proto::v1 as pb;

const NAMESPACE: &str = "kmm-demo";
const NAME: &str = "kmm-hello";
const VERSION: &str = "1";
const MODULE: &str = "kmm_hello_dep";
const DEPENDENCY: &str = "kmm_hello";
const PARAMETER: &str = "who=real-kernel";
const IN_TREE: &str = "dummy";
const FIRMWARE_DIR: &str = "/var/lib/firmware";
const NODE: &str = "guest";
/// The agent's bearer token: fixed, the peer accepts only this one.
const TOKEN: &str = "kmm-real-kernel-test-token";
const CA_FILE: &str = "/etc/kmm/ca.crt";
const TOKEN_FILE: &str = "/etc/kmm/token";
const AGENT_LOG: &str = "/run/agent.log";
const METRICS: &str = "http://127.0.0.1:8082";
const WAIT: Duration = Duration::from_secs(90);

#[tokio::test(flavor = "multi_thread")]
async fn the_agent_loads_and_unloads_real_modules_on_a_real_kernel() -> Result<()> {
    let fleet = Fleet::get().await.context("the fleet's registry")?;
    let pushed = firmware_image::push(&fleet.state.registry, KERNEL).await?;
    let port = fleet
        .state
        .registry
        .rsplit_once(':')
        .map(|(_, port)| port.to_string())
        .context("registry port")?;
    let image = format!(
        "{HOST_FROM_GUEST}:{port}/{}:{KERNEL}",
        firmware_image::REPOSITORY
    );
    let mut peer = AgentPeer::start(TOKEN).await?;
    let work = std::env::temp_dir().join(format!("kmm-real-kernel-{}", std::process::id()));
    let prepared = Instant::now();
    let rig = Rig::prepare(
        work.clone(),
        &[
            GuestFile {
                path: CA_FILE.into(),
                mode: 0o644,
                contents: peer.ca_pem.clone().into_bytes(),
            },
            GuestFile {
                path: TOKEN_FILE.into(),
                mode: 0o600,
                contents: TOKEN.as_bytes().to_vec(),
            },
        ],
    )?;
    println!(
        "real-kernel: guest prepared in {:.1}s (kernel, agent build, initramfs {} MiB)",
        prepared.elapsed().as_secs_f64(),
        std::fs::metadata(&rig.initramfs)?.len() / (1024 * 1024)
    );
    let address = peer.address_from_guest();

    let mut guest = rig.boot("boot1", &[]).await?;
    report_boot("boot 1", &guest);
    let result = first_boot(&mut guest, &mut peer, &address, &image, &pushed.digest).await;
    let boot1 = finish(guest, result, &work, "boot1").await?;

    let mut guest = rig.boot("boot2", &[]).await?;
    report_boot("boot 2 (reboot)", &guest);
    let result = after_reboot(&mut guest, &mut peer, &address, &image, &boot1).await;
    finish(guest, result, &work, "boot2").await?;

    let mut guest = rig.boot("boot3", &["module.sig_enforce=1"]).await?;
    report_boot("boot 3 (sig_enforce)", &guest);
    let result = signatures_enforced(&mut guest, &mut peer, &address, &image).await;
    finish(guest, result, &work, "boot3").await?;

    std::fs::remove_dir_all(&work).ok();
    Ok(())
}

/// Load, check everything from the kernel, restart the agent, unload, load again; the
/// boot ID the agent reported. `digest` is the pushed image's manifest digest.
async fn first_boot(
    guest: &mut Machine,
    peer: &mut AgentPeer,
    address: &str,
    image: &str,
    digest: &str,
) -> Result<String> {
    guest.check(&format!("modprobe {IN_TREE}")).await?;
    ensure!(
        module_present(guest, IN_TREE).await?,
        "{IN_TREE} did not load"
    );
    let pid = start_agent(guest, address).await?;
    let mut session = peer.session(WAIT).await?;
    check_hello(guest, &session.hello).await?;
    ensure!(
        session.hello.loaded.is_empty(),
        "a fresh agent reports loaded modules: {:?}",
        session.hello.loaded
    );
    let boot_id = session.hello.boot_id.clone();
    let (event, took) = load(&mut session, 1, image).await?;
    expect_event(&event, pb::Action::Load, pb::Outcome::Succeeded, 1)?;
    ensure!(
        event.image_digest == digest,
        "the agent loaded from {}, not the pushed image {digest}",
        event.image_digest
    );
    println!(
        "real-kernel: boot 1 time to loaded {:.2}s from DesiredModules sent to event received (agent: {} ms)",
        took.as_secs_f64(),
        event.duration_ms
    );

    // The kernel's own view of what the agent did.
    ensure!(module_present(guest, MODULE).await?, "{MODULE} not loaded");
    ensure!(
        module_present(guest, DEPENDENCY).await?,
        "{DEPENDENCY} not loaded"
    );
    let holders = guest
        .check(&format!("ls /sys/module/{DEPENDENCY}/holders"))
        .await?;
    ensure!(
        holders.split_whitespace().any(|h| h == MODULE),
        "the kernel does not record {MODULE} as using {DEPENDENCY}: holders `{holders}`"
    );
    let value = expect_parameter(guest, "after the load").await?;
    let dmesg = guest.check("dmesg").await?;
    let loaded_at = dmesg
        .find("kmm_hello: loaded")
        .context("no `kmm_hello: loaded` in dmesg")?;
    let greeted_at = dmesg
        .find(&format!("kmm_hello: hello, {value}"))
        .with_context(|| {
            format!("{MODULE} never called into kmm_hello with {PARAMETER}:\n{dmesg}")
        })?;
    ensure!(
        loaded_at < greeted_at,
        "kmm_hello initialised after kmm_hello_dep used it"
    );
    let search_path = guest
        .check("cat /sys/module/firmware_class/parameters/path")
        .await?;
    ensure!(
        search_path.trim() == FIRMWARE_DIR,
        "firmware_class searches `{}`, not {FIRMWARE_DIR}",
        search_path.trim()
    );
    let firmware = guest
        .check(&format!("cat {FIRMWARE_DIR}/{FIRMWARE_FILE}"))
        .await?;
    ensure!(
        firmware.as_bytes() == firmware_image::firmware_contents(KERNEL),
        "firmware content in the guest: {firmware:?}"
    );
    ensure!(
        !module_present(guest, IN_TREE).await?,
        "the in-tree module {IN_TREE} listed for removal is still loaded"
    );
    report_rss(guest, pid, "boot 1 after the load").await?;

    // A restart in the same boot reloads nothing: the new stream's hello lists the
    // module with the digest it was loaded from, the same desired modules are acted on
    // without a load (the restarted agent counts none), the first event is the unload
    // asked next, and the kernel initialised kmm_hello exactly once.
    drop(session);
    stop_agent(guest, pid).await?;
    start_agent(guest, address).await?;
    let mut session = peer.session(WAIT).await?;
    check_hello(guest, &session.hello).await?;
    let loaded: Vec<(Option<&pb::ModuleKey>, &str, &str)> = session
        .hello
        .loaded
        .iter()
        .map(|m| (m.key.as_ref(), m.version.as_str(), m.image_digest.as_str()))
        .collect();
    ensure!(
        loaded == [(Some(&key()), VERSION, event.image_digest.as_str())],
        "the restarted agent's hello does not list exactly {NAMESPACE}/{NAME} as loaded from {}: {:?}",
        event.image_digest,
        session.hello.loaded
    );
    ensure!(
        session.hello.boot_id == boot_id,
        "the boot ID changed without a reboot"
    );
    session.send(2, vec![node_module(image, false)]).await?;
    await_in_guest(
        guest,
        "the restarted agent to act on revision 2 (/readyz)",
        &format!("wget -q -O /dev/null {METRICS}/readyz"),
    )
    .await?;
    let metrics = guest
        .check(&format!("wget -q -O - {METRICS}/metrics"))
        .await?;
    ensure!(
        metric_sum(&metrics, "kmm_agent_loads_total") == 0.0
            && metric_sum(&metrics, "kmm_agent_modules_loaded") == 1.0,
        "the restarted agent loaded again, or lost the loaded module:\n{metrics}"
    );
    session.send(3, vec![node_module(image, true)]).await?;
    let event = session.next_event(WAIT).await?;
    expect_event(&event, pb::Action::Unload, pb::Outcome::Succeeded, 3)?;
    let dmesg = guest.check("dmesg").await?;
    ensure!(
        dmesg.matches("kmm_hello: loaded").count() == 1,
        "kmm_hello was initialised again after the restart:\n{dmesg}"
    );
    ensure!(
        !module_present(guest, MODULE).await?,
        "{MODULE} still loaded"
    );
    ensure!(
        !module_present(guest, DEPENDENCY).await?,
        "{DEPENDENCY} still loaded"
    );
    ensure!(
        guest
            .run(&format!("test -e {FIRMWARE_DIR}/{FIRMWARE_FILE}"), WAIT)
            .await?
            .code
            != 0,
        "the firmware stayed after the unload"
    );

    // Loaded again, so that the reboot finds it recorded in the agent's state.
    let (event, _) = load(&mut session, 4, image).await?;
    expect_event(&event, pb::Action::Load, pb::Outcome::Succeeded, 4)?;
    ensure!(
        module_present(guest, MODULE).await?,
        "{MODULE} not reloaded"
    );
    Ok(boot_id)
}

/// The state on disk comes from another boot: the hello lists nothing and the agent
/// loads again.
async fn after_reboot(
    guest: &mut Machine,
    peer: &mut AgentPeer,
    address: &str,
    image: &str,
    previous_boot_id: &str,
) -> Result<()> {
    ensure!(
        !module_present(guest, MODULE).await?,
        "{MODULE} loaded before the agent ran"
    );
    let pid = start_agent(guest, address).await?;
    let mut session = peer.session(WAIT).await?;
    check_hello(guest, &session.hello).await?;
    ensure!(
        session.hello.boot_id != previous_boot_id,
        "the agent reports the previous boot's ID {previous_boot_id} after a reboot"
    );
    ensure!(
        session.hello.loaded.is_empty(),
        "after a reboot the agent still reports modules of the previous boot: {:?}",
        session.hello.loaded
    );
    let (event, took) = load(&mut session, 5, image).await?;
    expect_event(&event, pb::Action::Load, pb::Outcome::Succeeded, 5)?;
    println!(
        "real-kernel: boot 2 time to loaded {:.2}s with the image cached (agent: {} ms)",
        took.as_secs_f64(),
        event.duration_ms
    );
    ensure!(
        module_present(guest, MODULE).await?,
        "{MODULE} not loaded after the reboot"
    );
    ensure!(
        module_present(guest, DEPENDENCY).await?,
        "{DEPENDENCY} not loaded after the reboot"
    );
    expect_parameter(guest, "after the reboot").await?;
    report_rss(guest, pid, "boot 2 after the load").await?;
    Ok(())
}

/// The kernel refuses the unsigned module and the agent's event says so.
async fn signatures_enforced(
    guest: &mut Machine,
    peer: &mut AgentPeer,
    address: &str,
    image: &str,
) -> Result<()> {
    let enforced = guest
        .check("cat /sys/module/module/parameters/sig_enforce")
        .await?;
    ensure!(
        enforced.trim() == "Y",
        "sig_enforce is `{}`",
        enforced.trim()
    );
    start_agent(guest, address).await?;
    let mut session = peer.session(WAIT).await?;
    check_hello(guest, &session.hello).await?;
    let (event, _) = load(&mut session, 6, image).await?;
    expect_event(&event, pb::Action::Load, pb::Outcome::Failed, 6)?;
    println!("real-kernel: boot 3 the agent reported: {}", event.error);
    ensure!(
        event
            .error
            .starts_with("the kernel refused the module's signature"),
        "the agent's error does not lead with the signature refusal: {}",
        event.error
    );
    ensure!(
        event.error.contains("Key was rejected by service"),
        "the kernel's refusal (EKEYREJECTED) is not in the agent's error: {}",
        event.error
    );
    ensure!(
        !module_present(guest, DEPENDENCY).await?,
        "{DEPENDENCY} loaded under sig_enforce"
    );
    let dmesg = guest.check("dmesg").await?;
    ensure!(
        dmesg.contains("Loading of unsigned module is rejected"),
        "the kernel logged no refusal of the unsigned module:\n{dmesg}"
    );
    Ok(())
}

fn key() -> pb::ModuleKey {
    pb::ModuleKey {
        namespace: NAMESPACE.into(),
        name: NAME.into(),
    }
}

/// The sample image with firmware, `dummy` to remove first; or its explicit unload.
fn node_module(image: &str, unload: bool) -> pb::NodeModule {
    pb::NodeModule {
        key: Some(key()),
        load: Some(pb::ModuleLoad {
            image: image.into(),
            registry_tls: Some(pb::RegistryTls {
                insecure: true,
                insecure_skip_tls_verify: false,
            }),
            modprobe: Some(pb::Modprobe {
                module_name: MODULE.into(),
                parameters: vec![PARAMETER.into()],
                firmware_path: FIRMWARE_PATH.into(),
                ..Default::default()
            }),
            in_tree_modules_to_remove: vec![IN_TREE.into()],
            version: VERSION.into(),
            pull_credential_id: String::new(),
            digest: String::new(),
        }),
        credential: None,
        unload,
    }
}

/// Ask for the load as `revision`; the event it produced and the time from sending to
/// receiving it.
async fn load(
    session: &mut Session,
    revision: u64,
    image: &str,
) -> Result<(pb::ModuleEvent, Duration)> {
    let asked = Instant::now();
    session
        .send(revision, vec![node_module(image, false)])
        .await?;
    let event = session.next_event(WAIT).await?;
    Ok((event, asked.elapsed()))
}

fn expect_event(
    event: &pb::ModuleEvent,
    action: pb::Action,
    outcome: pb::Outcome,
    revision: u64,
) -> Result<()> {
    ensure!(
        event.key.as_ref() == Some(&key())
            && event.action() == action
            && event.outcome() == outcome
            && event.desired_revision == revision,
        "expected {action:?} {outcome:?} of {NAMESPACE}/{NAME} for revision {revision}, got {event:?}"
    );
    if outcome == pb::Outcome::Succeeded {
        ensure!(
            event.version == VERSION && event.error.is_empty(),
            "a successful event with version `{}` and error `{}`",
            event.version,
            event.error
        );
    }
    Ok(())
}

/// The hello names this node, the guest's kernel and boot, and an agent version.
async fn check_hello(guest: &mut Machine, hello: &pb::AgentHello) -> Result<()> {
    let release = guest.check("uname -r").await?;
    let boot_id = guest.check("cat /proc/sys/kernel/random/boot_id").await?;
    ensure!(
        hello.node_name == NODE
            && hello.kernel_release == release.trim()
            && hello.kernel_release == KERNEL
            && hello.boot_id == boot_id.trim()
            && !hello.agent_version.is_empty(),
        "the hello does not describe node {NODE}, kernel {} and boot {}: {hello:?}",
        release.trim(),
        boot_id.trim()
    );
    Ok(())
}

/// Start the agent in the background, attached to the test peer (its log starts
/// empty); its PID.
async fn start_agent(guest: &mut Machine, address: &str) -> Result<u32> {
    let pid = guest
        .check(&format!(
            "setsid {AGENT} run --node-name {NODE} --kernel-backend host \
             --proxy-address {address} --proxy-ca-file {CA_FILE} --token-file {TOKEN_FILE} \
             --state-dir /persist/state --cache-dir /persist/cache \
             --firmware-dir {FIRMWARE_DIR} --retry-seconds 1 \
             >/dev/null 2>{AGENT_LOG} </dev/null & echo $!"
        ))
        .await?;
    pid.trim()
        .parse()
        .with_context(|| format!("agent PID `{pid}`"))
}

async fn stop_agent(guest: &mut Machine, pid: u32) -> Result<()> {
    guest.check(&format!("kill {pid}")).await?;
    await_in_guest(
        guest,
        "the agent to exit",
        &format!("! kill -0 {pid} 2>/dev/null"),
    )
    .await
}

/// Wait in the guest (polling every 50 ms) until the shell `condition` holds.
async fn await_in_guest(guest: &mut Machine, what: &str, condition: &str) -> Result<()> {
    let waited = guest
        .run(
            &format!(
                "i=0; until {condition}; do \
                 i=$((i + 1)); [ $i -gt {} ] && exit 1; usleep 50000; done",
                WAIT.as_secs() * 20
            ),
            WAIT + Duration::from_secs(10),
        )
        .await?;
    if waited.code != 0 {
        let log = guest.check(&format!("tail -n 30 {AGENT_LOG}")).await?;
        bail!("no {what} within {}s; agent log:\n{log}", WAIT.as_secs());
    }
    Ok(())
}

/// The sum of a metric's samples (all label sets) in Prometheus text.
fn metric_sum(text: &str, name: &str) -> f64 {
    text.lines()
        .filter(|l| {
            l.strip_prefix(name)
                .is_some_and(|rest| rest.starts_with(' ') || rest.starts_with('{'))
        })
        .filter_map(|l| l.rsplit_once(' ')?.1.parse::<f64>().ok())
        .sum()
}

/// The kernel holds the parameter value that was sent; that value.
async fn expect_parameter(guest: &mut Machine, when: &str) -> Result<&'static str> {
    let (name, value) = PARAMETER.split_once('=').context("parameter")?;
    let held = guest
        .check(&format!("cat /sys/module/{MODULE}/parameters/{name}"))
        .await?;
    ensure!(
        held.trim() == value,
        "{when}, {MODULE}'s parameter {name} is `{}` in the kernel, not the `{value}` sent",
        held.trim()
    );
    Ok(value)
}

async fn module_present(guest: &mut Machine, module: &str) -> Result<bool> {
    let sys = guest
        .run(&format!("test -d /sys/module/{module}"), WAIT)
        .await?
        .code
        == 0;
    let proc = guest.check("cat /proc/modules").await?;
    let listed = proc
        .lines()
        .any(|l| l.split_whitespace().next() == Some(module));
    ensure!(
        sys == listed,
        "/sys/module and /proc/modules disagree about {module}"
    );
    Ok(sys)
}

async fn report_rss(guest: &mut Machine, pid: u32, when: &str) -> Result<()> {
    let status = guest
        .check(&format!("grep -E '^Vm(RSS|HWM)' /proc/{pid}/status"))
        .await?;
    println!(
        "real-kernel: agent memory in the guest, {when}: {}",
        status.split_whitespace().collect::<Vec<_>>().join(" ")
    );
    Ok(())
}

fn report_boot(which: &str, guest: &Machine) {
    println!(
        "real-kernel: {which} ready in {:.2}s wall ({:?}), guest uptime {:.2}s",
        guest.boot_time.as_secs_f64(),
        guest.accelerator,
        guest.guest_uptime.as_secs_f64()
    );
}

/// Power the guest off. On failure, keep the agent's log as `<work>/<boot>.agent.log`
/// beside the console log, and name them.
async fn finish<T>(mut guest: Machine, result: Result<T>, work: &Path, boot: &str) -> Result<T> {
    match result {
        Ok(value) => {
            guest.poweroff().await?;
            Ok(value)
        }
        Err(e) => {
            let log = guest
                .run(&format!("cat {AGENT_LOG}"), Duration::from_secs(10))
                .await
                .map(|o| o.output)
                .unwrap_or_default();
            let kept: PathBuf = work.join(format!("{boot}.agent.log"));
            std::fs::write(&kept, &log).ok();
            let console = guest.console_tail(40);
            guest.poweroff().await.ok();
            bail!(
                "{e:#}\nagent log ({}):\n{log}\nconsole ({}):\n{console}",
                kept.display(),
                work.join(format!("{boot}.console.log")).display()
            );
        }
    }
}
