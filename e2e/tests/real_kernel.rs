//! Issue 6: the node agent's host backend on a real kernel. Debian's cloud kernel boots
//! under qemu with the workspace's `kmm-node-agent`; the agent pulls the sample kmod
//! image from the fleet's registry (through qemu's user network) and loads and unloads
//! the modules with Debian's modprobe. Every assertion reads the guest kernel's own
//! view: `/sys/module`, `/proc/modules`, the firmware_class search path, dmesg.
//!
//! Three boots share one disk holding the agent's state and cache:
//! 1. load (parameters, dependency order, firmware, in-tree removal), restart the
//!    agent (nothing reloaded), unload, load again;
//! 2. a reboot: the state of boot 1 is stale, so the agent loads again;
//! 3. a boot with `module.sig_enforce=1`: the unsigned module is refused by the kernel
//!    and the agent reports that refusal.
//!
//! Figures are printed with the prefix `real-kernel:`.

use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use kmm_e2e::fixture::Fleet;
use kmm_e2e::guest::firmware_image::{self, FIRMWARE_FILE, FIRMWARE_PATH};
use kmm_e2e::guest::initramfs::AGENT;
use kmm_e2e::guest::machine::Machine;
use kmm_e2e::guest::{HOST_FROM_GUEST, KERNEL, Rig};
use serde_json::{Value, json};

const KEY: &str = "kmm-demo/kmm-hello";
const MODULE: &str = "kmm_hello_dep";
const DEPENDENCY: &str = "kmm_hello";
const PARAMETER: &str = "who=real-kernel";
const IN_TREE: &str = "dummy";
const FIRMWARE_DIR: &str = "/var/lib/firmware";
const DESIRED: &str = "/run/desired.json";
const EVENTS: &str = "/run/agent.out";
const AGENT_LOG: &str = "/run/agent.log";
const WAIT: Duration = Duration::from_secs(90);

#[tokio::test(flavor = "multi_thread")]
async fn the_agent_loads_and_unloads_real_modules_on_a_real_kernel() -> Result<()> {
    let fleet = Fleet::get().await.context("the fleet's registry")?;
    firmware_image::push(&fleet.state.registry, KERNEL).await?;
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
    let work = std::env::temp_dir().join(format!("kmm-real-kernel-{}", std::process::id()));
    let prepared = Instant::now();
    let rig = Rig::prepare(work.clone(), &[])?;
    println!(
        "real-kernel: guest prepared in {:.1}s (kernel, agent build, initramfs {} MiB)",
        prepared.elapsed().as_secs_f64(),
        std::fs::metadata(&rig.initramfs)?.len() / (1024 * 1024)
    );

    let mut guest = rig.boot("boot1", &[]).await?;
    report_boot("boot 1", &guest);
    let result = first_boot(&mut guest, &image).await;
    finish(guest, result).await?;

    let mut guest = rig.boot("boot2", &[]).await?;
    report_boot("boot 2 (reboot)", &guest);
    let result = after_reboot(&mut guest, &image).await;
    finish(guest, result).await?;

    let mut guest = rig.boot("boot3", &["module.sig_enforce=1"]).await?;
    report_boot("boot 3 (sig_enforce)", &guest);
    let result = signatures_enforced(&mut guest, &image).await;
    finish(guest, result).await?;

    std::fs::remove_dir_all(&work).ok();
    Ok(())
}

/// Load, check everything from the kernel, restart the agent, unload, load again.
async fn first_boot(guest: &mut Machine, image: &str) -> Result<()> {
    guest.check(&format!("modprobe {IN_TREE}")).await?;
    ensure!(
        module_present(guest, IN_TREE).await?,
        "{IN_TREE} did not load"
    );
    write_desired(guest, &snapshot(1, image, false)).await?;
    let pid = start_agent(guest).await?;
    let asked = Instant::now();
    let event = wait_event(guest, 1).await?;
    let host_observed = asked.elapsed();
    expect_success(&event, "load")?;
    println!(
        "real-kernel: boot 1 time to loaded {:.2}s (agent: pull {} ms, kernel side {} ms)",
        host_observed.as_secs_f64(),
        event["pullMs"],
        event["durationMs"]
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
    let dmesg = guest.check("dmesg").await?;
    let loaded_at = dmesg
        .find("kmm_hello: loaded")
        .context("no `kmm_hello: loaded` in dmesg")?;
    let greeted_at = dmesg
        .find("kmm_hello: hello, kmm_hello_dep")
        .context("kmm_hello_dep never called into kmm_hello")?;
    ensure!(
        loaded_at < greeted_at,
        "kmm_hello initialised after kmm_hello_dep used it"
    );
    let (name, _) = PARAMETER.split_once('=').context("parameter")?;
    ensure!(
        dmesg.contains(&format!("{MODULE}: unknown parameter '{name}' ignored")),
        "the kernel never saw the parameter {PARAMETER} for {MODULE}:\n{dmesg}"
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

    // A restart in the same boot reloads nothing: the agent finds the module in its
    // state for this boot, acts on the same snapshot without an event, and its first
    // event is the unload asked next; the kernel initialised kmm_hello exactly once.
    guest.check(&format!("kill {pid}")).await?;
    guest
        .check(&format!(
            "while kill -0 {pid} 2>/dev/null; do usleep 20000; done"
        ))
        .await?;
    start_agent(guest).await?;
    let hello = wait_line(guest, "hello", 1).await?;
    ensure!(
        hello["loaded"]
            .as_array()
            .is_some_and(|l| l.iter().any(|m| m["key"] == KEY)),
        "the restarted agent does not know {KEY} is loaded: {hello}"
    );
    await_in_guest(
        guest,
        "the restarted agent to read the desired modules",
        &format!("grep -q 'new desired modules' {AGENT_LOG}"),
    )
    .await?;
    write_desired(guest, &snapshot(2, image, true)).await?;
    let event = wait_event(guest, 1).await?;
    ensure!(
        event["action"] == "unload",
        "after a restart in the same boot the agent did {event} before the unload"
    );
    expect_success(&event, "unload")?;
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
    write_desired(guest, &snapshot(3, image, false)).await?;
    let event = wait_event(guest, 2).await?;
    expect_success(&event, "load")?;
    ensure!(
        module_present(guest, MODULE).await?,
        "{MODULE} not reloaded"
    );
    Ok(())
}

/// The state on disk comes from another boot: the agent loads again.
async fn after_reboot(guest: &mut Machine, image: &str) -> Result<()> {
    ensure!(
        !module_present(guest, MODULE).await?,
        "{MODULE} loaded before the agent ran"
    );
    write_desired(guest, &snapshot(3, image, false)).await?;
    let pid = start_agent(guest).await?;
    let asked = Instant::now();
    let hello = wait_line(guest, "hello", 1).await?;
    ensure!(
        hello["loaded"].as_array().is_some_and(Vec::is_empty),
        "after a reboot the agent still reports modules of the previous boot: {hello}"
    );
    let event = wait_event(guest, 1).await?;
    expect_success(&event, "load")?;
    let log = guest.check(&format!("cat {AGENT_LOG}")).await?;
    ensure!(
        log.contains("boot ID changed since the state was saved"),
        "the agent did not see its saved state come from another boot:\n{log}"
    );
    println!(
        "real-kernel: boot 2 time to loaded {:.2}s with the image cached (agent: pull {} ms, kernel side {} ms)",
        asked.elapsed().as_secs_f64(),
        event["pullMs"],
        event["durationMs"]
    );
    ensure!(
        module_present(guest, MODULE).await?,
        "{MODULE} not loaded after the reboot"
    );
    ensure!(
        module_present(guest, DEPENDENCY).await?,
        "{DEPENDENCY} not loaded after the reboot"
    );
    report_rss(guest, pid, "boot 2 after the load").await?;
    Ok(())
}

/// The kernel refuses the unsigned module and the agent says so.
async fn signatures_enforced(guest: &mut Machine, image: &str) -> Result<()> {
    let enforced = guest
        .check("cat /sys/module/module/parameters/sig_enforce")
        .await?;
    ensure!(
        enforced.trim() == "Y",
        "sig_enforce is `{}`",
        enforced.trim()
    );
    write_desired(guest, &snapshot(4, image, false)).await?;
    start_agent(guest).await?;
    let event = wait_event(guest, 1).await?;
    ensure!(
        event["action"] == "load" && event["outcome"]["result"] == "failure",
        "an unsigned module loaded under sig_enforce: {event}"
    );
    let error = event["outcome"]["error"].as_str().unwrap_or_default();
    println!("real-kernel: boot 3 the agent reported: {error}");
    ensure!(
        error.contains("Key was rejected by service"),
        "the kernel's refusal (EKEYREJECTED) is not in the agent's error: {error}"
    );
    ensure!(
        error.to_lowercase().contains("signature"),
        "the agent's error does not say the signature was refused: {error}"
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

/// What the agent is asked: the sample image with firmware, `dummy` to remove first.
fn snapshot(revision: u64, image: &str, unload: bool) -> Value {
    let module = json!({
        "key": KEY,
        "image": image,
        "registryTls": { "insecure": true },
        "modprobe": {
            "moduleName": MODULE,
            "parameters": [PARAMETER],
            "firmwarePath": FIRMWARE_PATH,
        },
        "inTreeModulesToRemove": [IN_TREE],
    });
    if unload {
        json!({ "revision": revision, "modules": [], "unload": [KEY] })
    } else {
        json!({ "revision": revision, "modules": [module] })
    }
}

async fn write_desired(guest: &mut Machine, snapshot: &Value) -> Result<()> {
    // Written aside and renamed, so the agent never reads half a file.
    guest
        .check(&format!(
            "cat > {DESIRED}.new <<'EOF'\n{snapshot}\nEOF\nmv {DESIRED}.new {DESIRED}"
        ))
        .await?;
    Ok(())
}

/// Start the agent in the background (its output and log start empty); its PID.
async fn start_agent(guest: &mut Machine) -> Result<u32> {
    let pid = guest
        .check(&format!(
            "setsid {AGENT} run --node-name guest --kernel-backend host \
             --state-dir /persist/state --cache-dir /persist/cache \
             --firmware-dir {FIRMWARE_DIR} --desired-file {DESIRED} --desired-poll-ms 100 \
             --retry-seconds 1 >{EVENTS} 2>{AGENT_LOG} </dev/null & echo $!"
        ))
        .await?;
    pid.trim()
        .parse()
        .with_context(|| format!("agent PID `{pid}`"))
}

/// The `n`th event (1-based) the running agent printed.
async fn wait_event(guest: &mut Machine, n: usize) -> Result<Value> {
    wait_line(guest, "event", n).await
}

/// The `n`th line `{"<kind>": ...}` (1-based) the running agent printed, waiting for
/// it in the guest.
async fn wait_line(guest: &mut Machine, kind: &str, n: usize) -> Result<Value> {
    let pattern = format!("^{{\"{kind}\"");
    await_in_guest(
        guest,
        &format!("{kind} {n} from the agent"),
        &format!("[ \"$(grep -c '{pattern}' {EVENTS})\" -ge {n} ]"),
    )
    .await?;
    let lines = guest.check(&format!("grep '{pattern}' {EVENTS}")).await?;
    let line = lines.lines().nth(n - 1).context("agent output line")?;
    let parsed: Value =
        serde_json::from_str(line).with_context(|| format!("agent line `{line}`"))?;
    Ok(parsed[kind].clone())
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

fn expect_success(event: &Value, action: &str) -> Result<()> {
    ensure!(
        event["action"] == action && event["outcome"]["result"] == "success",
        "expected a successful {action}, got {event}"
    );
    Ok(())
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

/// Power the guest off; on failure, add the agent's log and the console.
async fn finish(mut guest: Machine, result: Result<()>) -> Result<()> {
    if let Err(e) = result {
        let log = guest
            .run(&format!("cat {AGENT_LOG}"), Duration::from_secs(10))
            .await
            .map(|o| o.output)
            .unwrap_or_default();
        let console = guest.console_tail(40);
        guest.poweroff().await.ok();
        bail!("{e:#}\nagent log:\n{log}\nconsole:\n{console}");
    }
    guest.poweroff().await?;
    Ok(())
}
