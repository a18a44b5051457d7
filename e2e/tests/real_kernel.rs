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
//!    and the agent loads again; then an image relying on the kernel's own
//!    `crc-itu-t.ko` through upstream's in-tree dependency link loads and unloads
//!    (`kmm_e2e::guest::in_tree_image`);
//! 3. a boot under UEFI (OVMF) whose `db` holds a test certificate made for this run,
//!    with `module.sig_enforce=1`: the kernel loads that certificate into its
//!    `.platform` keyring (dmesg). The modules of this boot are the installed kmm-hub's
//!    work on the fleet: a ManagedClusterModule for this kernel with `build` and `sign`
//!    makes the hub build them in a Job on its node and sign them with the test key
//!    ([`HubBuilt`]). The kernel refuses the hub's intermediate unsigned image and the
//!    same image signed with another key, each with a failed event from the agent that
//!    carries the kernel's refusal, and loads the image the hub built, signed and
//!    pinned, by the digest the hub pinned. Debian's stock kernel is used as it is:
//!    `.platform` is the only keyring a test key can reach without building a kernel
//!    (see `kmm_e2e::guest::uefi`).
//!
//! Boots 1 and 2 start the kernel from SeaBIOS, boot 3 from OVMF; both with qemu's
//! `-kernel`. The images of boot 3 are made per run, named after the test key's ID.
//!
//! A second test boots the guest alone and keeps its command channel busy while
//! processes a command left behind exit (the agent is one).
//!
//! Figures are printed with the prefix `real-kernel:`; a failure leaves the consoles and
//! the agent's logs in the work directory it names.

mod support;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use kmm_e2e::fixture::Fleet;
use kmm_e2e::guest::agent_peer::{AgentPeer, Session};
use kmm_e2e::guest::firmware_image::{self, FIRMWARE_FILE, FIRMWARE_PATH};
use kmm_e2e::guest::in_tree_image;
use kmm_e2e::guest::initramfs::{AGENT, GuestFile};
use kmm_e2e::guest::machine::Machine;
use kmm_e2e::guest::module_signing::TestKey;
use kmm_e2e::guest::{HOST_FROM_GUEST, KERNEL, Rig};
use kmm_e2e::kmod::SampleImage;
use kmm_hub::images::{SignPlan, unsigned_image_name};
use kmm_hub::serve::signing::{MAX_IMAGE_BYTES, sign_image};
use kmm_proto::v1 as pb;
use kmm_signing::SigningKey;
use support::HubBuildSign;

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
/// A build Job (about a minute on the fleet), then the signing.
const BUILD_WAIT: Duration = Duration::from_secs(420);

/// The agent outlives the command that starts it, so it is re-parented to the guest's
/// PID 1 and signals it when it exits. That signal once restarted the shell's `read` of
/// the next request and dropped the part already read: the channel then failed on a
/// request whose start was gone. Here every command leaves a process behind that exits
/// a few milliseconds later, spread over the next request's arrival.
#[tokio::test(flavor = "multi_thread")]
async fn the_guests_channel_keeps_every_request_whole_while_orphans_exit() -> Result<()> {
    const ROUNDS: u32 = 60;
    let work = std::env::temp_dir().join(format!("kmm-guest-channel-{}", std::process::id()));
    let rig = Rig::prepare(work.clone(), &[])?;
    let mut guest = rig.boot("channel", &[]).await?;
    let result = async {
        for round in 0..ROUNDS {
            let delay_us = (round * 7919) % 20_000;
            let out = guest
                .check(&format!(
                    "setsid usleep {delay_us} </dev/null >/dev/null 2>&1 & \
                     echo round {round}; head -c 300 /proc/cpuinfo >/dev/null"
                ))
                .await
                .with_context(|| format!("round {round} (orphan exiting after {delay_us} us)"))?;
            ensure!(
                out == format!("round {round}\n"),
                "round {round} answered {out:?}"
            );
        }
        Ok(())
    }
    .await;
    finish(guest, result, &work, "channel").await?;
    std::fs::remove_dir_all(&work).ok();
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn the_agent_loads_and_unloads_real_modules_on_a_real_kernel() -> Result<()> {
    let fleet = Fleet::get().await.context("the fleet's registry")?;
    let registry = fleet.state.registry.as_str();
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

    // Pushed after the slow preparation, right before the boots pull them.
    let unsigned = GuestImage::of(&firmware_image::push(registry, KERNEL).await?, registry)?;
    let in_tree = GuestImage::of(
        &in_tree_image::push(registry, &rig.kernel, &work).await?,
        registry,
    )?;
    // Keys of this run only, in the work directory (removed when the test passes).
    let keys = work.join("keys");
    let trusted = TestKey::generate(&keys, "trusted", "kmm-fleet real-kernel test key")?;
    let other = TestKey::generate(&keys, "other", "kmm-fleet real-kernel other key")?;
    let hub = HubBuilt::make(&fleet, &trusted, &other).await?;

    let image = unsigned.reference.as_str();
    let mut guest = rig.boot("boot1", &[]).await?;
    report_boot("boot 1", &guest);
    let result = first_boot(&mut guest, &mut peer, &address, image, &unsigned.digest).await;
    let boot1 = finish(guest, result, &work, "boot1").await?;

    let mut guest = rig.boot("boot2", &[]).await?;
    report_boot("boot 2 (reboot)", &guest);
    let result = after_reboot(&mut guest, &mut peer, &address, image, &boot1, &in_tree).await;
    finish(guest, result, &work, "boot2").await?;

    let mut guest = rig
        .boot_uefi("boot3", &["module.sig_enforce=1"], &trusted)
        .await?;
    report_boot("boot 3 (UEFI, test key in db, sig_enforce)", &guest);
    let result = signatures_enforced(
        &mut guest,
        &mut peer,
        &address,
        [&hub.unsigned, &hub.wrongly_signed, &hub.signed],
    )
    .await;
    finish(guest, result, &work, "boot3").await?;
    hub.clean_up(&fleet).await?;

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
    in_tree: &GuestImage,
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
    in_tree_dependency(guest, &mut session, image, in_tree).await?;
    report_rss(guest, pid, "boot 2 idle after its round").await
}

/// Issue 29 item 5: the image's module needs `crc_itu_t`, which only the guest kernel's
/// own tree holds, reached through the image's link to the node's tree. modprobe loads
/// the in-tree module first; the unload takes the image's module away. `image` is the
/// sample module boot 2 loaded, which stays.
async fn in_tree_dependency(
    guest: &mut Machine,
    session: &mut Session,
    image: &str,
    in_tree: &GuestImage,
) -> Result<()> {
    use in_tree_image::{IN_TREE_DEPENDENCY, MODULE as USER};
    ensure!(
        !module_present(guest, IN_TREE_DEPENDENCY).await?,
        "{IN_TREE_DEPENDENCY} was loaded before the image asked for it"
    );
    session
        .send(
            6,
            vec![
                node_module(image, false),
                in_tree_module(&in_tree.reference, false),
            ],
        )
        .await?;
    let event = in_tree_event(session).await?;
    ensure!(
        event.action() == pb::Action::Load
            && event.outcome() == pb::Outcome::Succeeded
            && event.image_digest == in_tree.digest,
        "expected the load of {USER} from {}, got {event:?}",
        in_tree.digest
    );
    ensure!(module_present(guest, USER).await?, "{USER} not loaded");
    let holders = guest
        .check(&format!("ls /sys/module/{IN_TREE_DEPENDENCY}/holders"))
        .await?;
    ensure!(
        holders.split_whitespace().any(|h| h == USER),
        "the kernel does not record {USER} as using the in-tree {IN_TREE_DEPENDENCY}: holders `{holders}`"
    );
    let dmesg = guest.check("dmesg").await?;
    ensure!(
        dmesg.contains("kmm_crc_user: crc-itu-t of \"kmm-fleet\" is 0x"),
        "{USER} never called into {IN_TREE_DEPENDENCY}:\n{dmesg}"
    );
    ensure!(
        module_present(guest, MODULE).await?,
        "{MODULE} went away while another module loaded"
    );

    session
        .send(
            7,
            vec![
                node_module(image, false),
                in_tree_module(&in_tree.reference, true),
            ],
        )
        .await?;
    let event = in_tree_event(session).await?;
    ensure!(
        event.action() == pb::Action::Unload && event.outcome() == pb::Outcome::Succeeded,
        "expected the unload of {USER}, got {event:?}"
    );
    ensure!(!module_present(guest, USER).await?, "{USER} still loaded");
    Ok(())
}

const IN_TREE_NAME: &str = "kmm-crc-user";

fn in_tree_key() -> pb::ModuleKey {
    module_key(IN_TREE_NAME)
}

/// The image relying on the in-tree dependency link; or its explicit unload.
fn in_tree_module(image: &str, unload: bool) -> pb::NodeModule {
    let modprobe = pb::Modprobe {
        module_name: in_tree_image::MODULE.into(),
        ..Default::default()
    };
    desired(in_tree_key(), image, modprobe, vec![], unload)
}

/// The next event about the in-tree dependency's module; an event about another module
/// in between may only be a success (nothing else was asked of it).
async fn in_tree_event(session: &mut Session) -> Result<pb::ModuleEvent> {
    let asked = Instant::now();
    loop {
        let event = session
            .next_event(WAIT.saturating_sub(asked.elapsed()))
            .await?;
        if event.key.as_ref() == Some(&in_tree_key()) {
            return Ok(event);
        }
        ensure!(
            event.outcome() == pb::Outcome::Succeeded,
            "while {IN_TREE_NAME} was asked for: {event:?}"
        );
    }
}

/// An image as the guest pulls it, and the manifest digest its push returned.
struct GuestImage {
    reference: String,
    digest: String,
}

impl GuestImage {
    /// `image` (`<registry>/<path>`, as this machine reaches it) at `digest`.
    fn at(registry: &str, image: &str, digest: String) -> Result<Self> {
        Self::of(
            &SampleImage {
                kernel: KERNEL.to_owned(),
                image: image.to_owned(),
                digest,
            },
            registry,
        )
    }

    /// `pushed` to `registry` (the host's loopback), through qemu's user network.
    fn of(pushed: &SampleImage, registry: &str) -> Result<Self> {
        let (_, port) = registry.rsplit_once(':').context("registry port")?;
        let path = pushed
            .image
            .strip_prefix(&format!("{registry}/"))
            .with_context(|| format!("{} is not in {registry}", pushed.image))?;
        Ok(Self {
            reference: format!("{HOST_FROM_GUEST}:{port}/{path}"),
            digest: pushed.digest.clone(),
        })
    }
}

/// The sample modules for [`KERNEL`] as the installed kmm-hub makes them on the fleet,
/// for boot 3 ([`HubBuildSign`]): built by a build Job on the hub's node and signed
/// natively by the hub with the key the guest's UEFI `db` holds; the intermediate
/// unsigned image that build pushed; and that same unsigned image signed with another
/// key. The last is signed here, with the hub's own signing code
/// (`kmm_hub::serve::signing::sign_image`) rather than by a second module: a second
/// module would build the same bytes again (a minute more) to prove nothing more.
struct HubBuilt {
    made: HubBuildSign,
    signed: GuestImage,
    unsigned: GuestImage,
    wrongly_signed: GuestImage,
}

impl HubBuilt {
    async fn make(fleet: &Fleet, trusted: &TestKey, other: &TestKey) -> Result<Self> {
        let (registry, node_registry) = (&fleet.state.registry, &fleet.state.node_registry);
        let created = Instant::now();
        let made = HubBuildSign::create(fleet, KERNEL, trusted).await?;
        let digest = made.pinned(fleet, BUILD_WAIT).await?;
        println!(
            "real-kernel: module created -> built by the hub's Job, signed by kmm-hub and pinned in {:.1}s",
            created.elapsed().as_secs_f64()
        );

        // The same images as this machine reaches them.
        let on_host = |image: &str| image.replacen(node_registry.as_str(), registry, 1);
        let signed = on_host(&made.image);
        let unsigned = on_host(&unsigned_image_name(
            &made.image,
            support::NAMESPACE,
            &made.module,
        ));
        let plain = kmm_registry::RegistryTls {
            insecure: true,
            insecure_skip_tls_verify: false,
        };
        let client = kmm_registry::client(plain);
        let unsigned_digest = kmm_registry::resolve_digest(&client, &unsigned, None).await?;
        let plan = SignPlan {
            unsigned_image: unsigned.clone(),
            unsigned_tls: plain,
            key_secret: String::new(),
            cert_secret: String::new(),
            files: [DEPENDENCY, MODULE]
                .map(|m| format!("/opt/lib/modules/{KERNEL}/extra/{m}.ko"))
                .into(),
        };
        let other_key =
            SigningKey::from_pem(&std::fs::read(&other.key)?, &std::fs::read(&other.cert)?)?;
        let other_signed = format!("{signed}-other-key");
        let other_digest = sign_image(
            &plan,
            other_key,
            &other_signed,
            plain,
            None,
            &kmm_registry::RegistryCas::default(),
            MAX_IMAGE_BYTES,
        )
        .await?;
        Ok(Self {
            signed: GuestImage::at(registry, &signed, digest)?,
            unsigned: GuestImage::at(registry, &unsigned, unsigned_digest)?,
            wrongly_signed: GuestImage::at(registry, &other_signed, other_digest)?,
            made,
        })
    }

    async fn clean_up(self, fleet: &Fleet) -> Result<()> {
        self.made.clean_up(fleet).await
    }
}

/// With the test key in UEFI db and signatures enforced, the kernel refuses the unsigned
/// module and the one signed with another key, and the agent's events say so; the
/// module signed with the test key loads. The images, in order: the sample image
/// unsigned, signed with a key the kernel does not trust, signed with the key in db.
async fn signatures_enforced(
    guest: &mut Machine,
    peer: &mut AgentPeer,
    address: &str,
    [unsigned, wrongly_signed, signed]: [&GuestImage; 3],
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

    let (event, _) = load(&mut session, 8, &unsigned.reference).await?;
    expect_refused(
        guest,
        &event,
        8,
        unsigned,
        "unsigned",
        "Loading of unsigned module is rejected",
    )
    .await?;
    // ENOKEY inside the kernel: no keyring it checks holds the signer.
    let (event, _) = load(&mut session, 9, &wrongly_signed.reference).await?;
    expect_refused(
        guest,
        &event,
        9,
        wrongly_signed,
        "other-key-signed",
        "Loading of module with unavailable key is rejected",
    )
    .await?;

    let (event, took) = load(&mut session, 10, &signed.reference).await?;
    expect_event(&event, pb::Action::Load, pb::Outcome::Succeeded, 10)?;
    ensure!(
        event.image_digest == signed.digest,
        "the agent loaded from {}, not the test-signed image {}",
        event.image_digest,
        signed.digest
    );
    println!(
        "real-kernel: boot 3 time to loaded {:.2}s, test-signed image under sig_enforce (agent: {} ms)",
        took.as_secs_f64(),
        event.duration_ms
    );
    ensure!(
        module_present(guest, DEPENDENCY).await?,
        "{DEPENDENCY} signed with the test key is not loaded"
    );
    ensure!(
        module_present(guest, MODULE).await?,
        "{MODULE} signed with the test key is not loaded"
    );
    expect_parameter(guest, "after the test-signed load").await?;
    Ok(())
}

/// `event` is the failed load of `image` for `revision` with the kernel's signature
/// refusal; nothing was loaded and the kernel logged `kernel_says`.
async fn expect_refused(
    guest: &mut Machine,
    event: &pb::ModuleEvent,
    revision: u64,
    image: &GuestImage,
    what: &str,
    kernel_says: &str,
) -> Result<()> {
    expect_event(event, pb::Action::Load, pb::Outcome::Failed, revision)?;
    println!(
        "real-kernel: boot 3 the agent reported for the {what} module: {}",
        event.error
    );
    ensure!(
        event.image_digest == image.digest,
        "the failed load was of {}, not of the {what} image {}",
        event.image_digest,
        image.digest
    );
    ensure!(
        event
            .error
            .starts_with("the kernel refused the module's signature"),
        "the agent's error for the {what} module does not lead with the signature refusal: {}",
        event.error
    );
    ensure!(
        event.error.contains("Key was rejected by service"),
        "the kernel's refusal (EKEYREJECTED) of the {what} module is not in the agent's error: {}",
        event.error
    );
    ensure!(
        !module_present(guest, DEPENDENCY).await?,
        "the {what} {DEPENDENCY} loaded under sig_enforce"
    );
    let dmesg = guest.check("dmesg").await?;
    ensure!(
        dmesg.contains(kernel_says),
        "the kernel did not log `{kernel_says}` for the {what} module:\n{dmesg}"
    );
    Ok(())
}

fn key() -> pb::ModuleKey {
    module_key(NAME)
}

fn module_key(name: &str) -> pb::ModuleKey {
    pb::ModuleKey {
        namespace: NAMESPACE.into(),
        name: name.into(),
    }
}

/// The sample image with firmware, `dummy` to remove first; or its explicit unload.
fn node_module(image: &str, unload: bool) -> pb::NodeModule {
    let modprobe = pb::Modprobe {
        module_name: MODULE.into(),
        parameters: vec![PARAMETER.into()],
        firmware_path: FIRMWARE_PATH.into(),
        ..Default::default()
    };
    desired(key(), image, modprobe, vec![IN_TREE.into()], unload)
}

/// `key` loading `image` from the fleet's plain-HTTP registry with `modprobe`, after
/// removing `in_tree` modules; or its explicit unload.
fn desired(
    key: pb::ModuleKey,
    image: &str,
    modprobe: pb::Modprobe,
    in_tree: Vec<String>,
    unload: bool,
) -> pb::NodeModule {
    pb::NodeModule {
        key: Some(key),
        load: Some(pb::ModuleLoad {
            image: image.into(),
            registry_tls: Some(pb::RegistryTls {
                insecure: true,
                insecure_skip_tls_verify: false,
            }),
            modprobe: Some(modprobe),
            in_tree_modules_to_remove: in_tree,
            version: VERSION.into(),
            ..Default::default()
        }),
        credential: None,
        unload,
    }
}

/// Ask for the load as `revision`; the event it produced and the time from sending to
/// receiving it. Failed events of earlier revisions are passed over: the agent retries
/// a failed load until the new revision reaches it.
async fn load(
    session: &mut Session,
    revision: u64,
    image: &str,
) -> Result<(pb::ModuleEvent, Duration)> {
    let asked = Instant::now();
    session
        .send(revision, vec![node_module(image, false)])
        .await?;
    loop {
        let event = session
            .next_event(WAIT.saturating_sub(asked.elapsed()))
            .await?;
        let earlier_failure =
            event.desired_revision < revision && event.outcome() == pb::Outcome::Failed;
        if !earlier_failure {
            return Ok((event, asked.elapsed()));
        }
    }
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
        .check(&format!(
            "grep -E '^(Vm(RSS|HWM)|Rss(Anon|File))' /proc/{pid}/status"
        ))
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
