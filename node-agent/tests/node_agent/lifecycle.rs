//! Load, restart, reboot, version change and unload with the simulated kernel backend
//! (real modprobe dry-run resolution and modinfo checks of the pulled images).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use kmm_node_agent::control::{AgentEvent, EventAction, Kept, Outcome};
use kmm_node_agent::desired::{DesiredModule, DesiredSnapshot, Modprobe, RegistryTls};
use kmm_node_agent::image::cache::Cache;
use kmm_node_agent::image::{ImageStore, Limits};
use kmm_node_agent::kernel::{Kernel, SimulatedKernel};
use kmm_node_agent::modprobe::ModprobeCommand;
use kmm_node_agent::reconcile::Reconciler;
use kmm_node_agent::state::StateStore;

use crate::support::*;

/// A simulated node: its kernel, state, cache and firmware directories.
pub struct Node {
    pub dir: tempfile::TempDir,
    pub kernel: Arc<SimulatedKernel>,
}

impl Node {
    pub fn new(release: &str) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let kernel = Arc::new(SimulatedKernel::open(dir.path().join("kernel"), release).unwrap());
        Self { dir, kernel }
    }

    pub fn firmware_dir(&self) -> PathBuf {
        self.dir.path().join("firmware")
    }

    pub fn cache_dir(&self) -> PathBuf {
        self.dir.path().join("cache")
    }

    /// A fresh agent (as after a restart) over the node's directories.
    pub fn agent(&self) -> Reconciler {
        Reconciler::new(
            self.kernel.clone(),
            ImageStore::new(Cache::open(self.cache_dir()).unwrap(), Limits::default()),
            StateStore::new(self.dir.path().join("run-kmm")),
            self.firmware_dir(),
        )
        .unwrap()
    }

    pub fn loaded(&self) -> Vec<String> {
        self.kernel.loaded_modules().unwrap().into_iter().collect()
    }
}

pub fn desired(image: String, version: &str) -> DesiredModule {
    DesiredModule {
        key: "kmm-ops/hello".into(),
        version: Some(version.into()),
        image,
        digest: None,
        modprobe: Modprobe {
            module_name: Some(DEP_MODULE.into()),
            firmware_path: Some("/firmware".into()),
            ..Default::default()
        },
        in_tree_modules_to_remove: vec![],
        registry_tls: RegistryTls {
            insecure: true,
            insecure_skip_tls_verify: false,
        },
        pull_secret: None,
    }
}

/// A snapshot asking for `modules` (revision 1).
pub fn load(modules: &[DesiredModule]) -> DesiredSnapshot {
    DesiredSnapshot {
        revision: 1,
        modules: modules.to_vec(),
        unload: vec![],
    }
}

/// A snapshot asking to unload `key` (revision 2).
pub fn unload(key: &str) -> DesiredSnapshot {
    DesiredSnapshot {
        revision: 2,
        modules: vec![],
        unload: vec![key.into()],
    }
}

fn summary(events: &[AgentEvent]) -> Vec<(EventAction, bool)> {
    events.iter().map(|e| (e.action, e.is_success())).collect()
}

fn assert_success(events: &[AgentEvent], expected: &[EventAction]) {
    let wanted: Vec<(EventAction, bool)> = expected.iter().map(|a| (*a, true)).collect();
    assert_eq!(summary(events), wanted, "{events:#?}");
}

#[tokio::test]
async fn load_restart_reboot_upgrade_and_unload() {
    let k = kernel();
    let registry = Registry::plain();
    let v1 = registry
        .push_sample("samples/hello:v1", &Sample::good(k))
        .await;
    let mut second = Sample::good(k);
    second.firmware = vec![("kmm/hello.bin".into(), b"firmware v2".to_vec())];
    let v2 = registry.push_sample("samples/hello:v2", &second).await;

    let node = Node::new(k);
    node.kernel.add_in_tree("old_driver").unwrap();
    let mut one = desired(registry.image("samples/hello:v1"), "1");
    one.in_tree_modules_to_remove = vec!["old-driver".into()];

    // First load: the dependency first, the in-tree module removed, firmware installed.
    let mut agent = node.agent();
    let events = agent.reconcile(&load(std::slice::from_ref(&one))).await;
    assert_success(&events, &[EventAction::Load]);
    assert_eq!(events[0].digest.as_deref(), Some(v1.as_str()));
    assert!(events[0].pull_ms > 0 || events[0].duration_ms > 0);
    assert_eq!(node.loaded(), [MODULE, DEP_MODULE]);
    let dep = node.kernel.module(DEP_MODULE).unwrap().unwrap();
    assert_eq!(dep.depends, [MODULE]);
    let firmware = node.firmware_dir().join("kmm/hello.bin");
    assert_eq!(std::fs::read(&firmware).unwrap(), b"firmware v1");
    assert_eq!(
        node.kernel.firmware_class_path().as_deref(),
        Some(node.firmware_dir().to_str().unwrap())
    );

    // Restart: nothing is loaded again.
    drop(agent);
    let mut agent = node.agent();
    let hello = agent.hello("node-1");
    assert_eq!(hello.loaded.len(), 1);
    assert_eq!(hello.loaded[0].digest, v1);
    assert!(
        agent
            .reconcile(&load(std::slice::from_ref(&one)))
            .await
            .is_empty()
    );

    // Removed behind the agent's back: loaded again.
    node.kernel
        .modprobe(&ModprobeCommand {
            args: vec!["-r".into(), DEP_MODULE.into()],
        })
        .unwrap();
    assert!(node.loaded().is_empty());
    assert_success(
        &agent.reconcile(&load(std::slice::from_ref(&one))).await,
        &[EventAction::Load],
    );
    assert_eq!(node.loaded(), [MODULE, DEP_MODULE]);

    // Reboot: the boot ID changes, the state is discarded, everything loads again.
    // (This agent keeps no unused image, so that what it stops using leaves the cache.)
    drop(agent);
    node.kernel.reboot().unwrap();
    assert!(node.loaded().is_empty());
    let mut agent = node.agent().with_unused_image_retention(Duration::ZERO);
    assert!(agent.hello("node-1").loaded.is_empty());
    assert_success(
        &agent.reconcile(&load(std::slice::from_ref(&one))).await,
        &[EventAction::Load],
    );
    assert_eq!(node.loaded(), [MODULE, DEP_MODULE]);

    // Version change: the old one is unloaded, the new one loaded.
    let two = desired(registry.image("samples/hello:v2"), "2");
    let events = agent.reconcile(&load(std::slice::from_ref(&two))).await;
    assert_success(&events, &[EventAction::Unload, EventAction::Load]);
    assert_eq!(events[0].version.as_deref(), Some("1"));
    assert_eq!(events[1].digest.as_deref(), Some(v2.as_str()));
    assert_eq!(std::fs::read(&firmware).unwrap(), b"firmware v2");
    assert_eq!(node.loaded(), [MODULE, DEP_MODULE]);

    // No longer mentioned: left alone.
    assert!(agent.reconcile(&load(&[])).await.is_empty());
    assert_eq!(node.loaded(), [MODULE, DEP_MODULE]);

    // Unload asked for: unloaded in reverse order, firmware removed, cache collected.
    let events = agent.reconcile(&unload("kmm-ops/hello")).await;
    assert_success(&events, &[EventAction::Unload]);
    assert!(node.loaded().is_empty());
    assert!(!firmware.exists());
    assert!(tree(&node.cache_dir().join("extracted")).is_empty());
    assert!(
        tree(&node.cache_dir().join("blobs"))
            .iter()
            .all(|p| p.is_dir())
    );
    assert!(agent.state().modules.is_empty());
    assert_eq!(events[0].revision, 2);
    // Asked again: nothing left to do.
    assert!(agent.reconcile(&unload("kmm-ops/hello")).await.is_empty());
    let confirmed = agent.confirm_already_unloaded(&unload("kmm-ops/hello"));
    assert_success(&confirmed, &[EventAction::Unload]);
}

#[tokio::test]
async fn an_unused_image_stays_cached_for_its_retention_then_goes() {
    let k = kernel();
    let registry = Registry::plain();
    registry
        .push_sample("samples/hello:v1", &Sample::good(k))
        .await;
    let node = Node::new(k);
    let one = desired(registry.image("samples/hello:v1"), "1");
    let mut agent = node
        .agent()
        .with_unused_image_retention(Duration::from_secs(300));
    let events = agent.reconcile(&load(std::slice::from_ref(&one))).await;
    assert_success(&events, &[EventAction::Load]);
    assert!(events[0].pull_ms > 0, "the first load pulls");
    let timing = events[0].timing;
    assert!(
        timing.pull.is_some() && timing.extract.is_some() && timing.modprobe.is_some(),
        "every step ran and was timed: {timing:?}"
    );
    let first_finished = timing.finished.expect("the end of the load");

    // Unloaded: the image stays, and loading it again pulls and extracts nothing.
    let extracted = || {
        std::fs::read_dir(node.cache_dir().join("extracted"))
            .unwrap()
            .count()
    };
    assert_success(
        &agent.reconcile(&unload("kmm-ops/hello")).await,
        &[EventAction::Unload],
    );
    assert_eq!(extracted(), 1, "kept within its retention");
    let events = agent.reconcile(&load(std::slice::from_ref(&one))).await;
    assert_success(&events, &[EventAction::Load]);
    assert_eq!(events[0].pull_ms, 0, "loaded from the cache");
    let timing = events[0].timing;
    assert_eq!(
        (timing.pull, timing.extract),
        (None, None),
        "neither pulled nor extracted"
    );
    assert!(timing.modprobe.is_some(), "{timing:?}");
    assert!(timing.finished.expect("the end of the load") > first_finished);
    assert_eq!(node.loaded(), [MODULE, DEP_MODULE]);

    // Unloaded again, and last used longer ago than the retention: the next pass
    // collects it.
    assert_success(
        &agent.reconcile(&unload("kmm-ops/hello")).await,
        &[EventAction::Unload],
    );
    assert_eq!(extracted(), 1);
    let long_ago = SystemTime::now() - Duration::from_secs(600);
    for manifest in std::fs::read_dir(node.cache_dir().join("manifests/sha256")).unwrap() {
        std::fs::File::open(manifest.unwrap().path())
            .unwrap()
            .set_modified(long_ago)
            .unwrap();
    }
    assert!(agent.reconcile(&unload("kmm-ops/hello")).await.is_empty());
    assert_eq!(extracted(), 0, "collected after its retention");
    assert!(
        tree(&node.cache_dir().join("blobs"))
            .iter()
            .all(|p| p.is_dir())
    );
}

#[tokio::test]
async fn loading_order_and_depmod_when_modules_dep_is_missing() {
    let k = kernel();
    let registry = Registry::plain();
    let mut sample = Sample::good(k);
    sample.depmod = false;
    sample.firmware.clear();
    registry.push_sample("samples/nodep:v1", &sample).await;
    let node = Node::new(k);
    let mut d = desired(registry.image("samples/nodep:v1"), "1");
    d.modprobe.firmware_path = None;
    d.modprobe.module_name = Some(DEP_MODULE.into());
    d.modprobe.modules_loading_order = vec![DEP_MODULE.into(), MODULE.into()];
    let mut agent = node.agent();
    let events = agent.reconcile(&load(std::slice::from_ref(&d))).await;
    assert_success(&events, &[EventAction::Load]);
    assert_eq!(
        agent.state().modules["kmm-ops/hello"].loaded,
        [MODULE, DEP_MODULE]
    );
    let module_dir = &agent.state().modules["kmm-ops/hello"].module_dir;
    assert!(
        module_dir
            .join("lib/modules")
            .join(k)
            .join("modules.dep")
            .is_file()
    );
    assert_success(
        &agent.reconcile(&unload("kmm-ops/hello")).await,
        &[EventAction::Unload],
    );
    assert!(node.loaded().is_empty());
}

#[tokio::test]
async fn broken_images_fail_as_on_a_node_and_are_retried() {
    let k = kernel();
    let registry = Registry::plain();
    // Built for this kernel but filed under another: the node runs the other one.
    let mut other = Sample::good(k);
    other.kernel_dir = "6.1.0-99-amd64".into();
    registry.push_sample("broken/other-kernel:v1", &other).await;
    // The dependency is missing from the image.
    let mut missing = Sample::good(k);
    missing.modules = vec![DEP_MODULE];
    registry
        .push_sample("broken/missing-dep:v1", &missing)
        .await;
    registry
        .push_sample("samples/hello:v1", &Sample::good(k))
        .await;

    let wrong_kernel = Node::new("6.1.0-99-amd64");
    let mut agent = wrong_kernel.agent();
    let events = agent
        .reconcile(&load(&[desired(
            registry.image("broken/other-kernel:v1"),
            "1",
        )]))
        .await;
    assert_eq!(summary(&events), [(EventAction::Load, false)]);
    let Outcome::Failure(error) = &events[0].outcome else {
        unreachable!()
    };
    assert!(
        error.contains("Exec format error") && error.contains(k),
        "{error}"
    );
    assert!(wrong_kernel.loaded().is_empty());

    let node = Node::new(k);
    let mut agent = node.agent();
    let events = agent
        .reconcile(&load(&[desired(
            registry.image("broken/other-kernel:v1"),
            "1",
        )]))
        .await;
    let Outcome::Failure(error) = &events[0].outcome else {
        panic!("{events:?}")
    };
    assert!(
        error.contains("no modules for this node's kernel"),
        "{error}"
    );

    let events = agent
        .reconcile(&load(&[desired(
            registry.image("broken/missing-dep:v1"),
            "1",
        )]))
        .await;
    let Outcome::Failure(error) = &events[0].outcome else {
        panic!("{events:?}")
    };
    assert!(
        error.contains("Unknown symbol") && error.contains(MODULE),
        "{error}"
    );
    assert!(node.loaded().is_empty());
    assert!(agent.state().modules.is_empty());
    assert!(
        !node.firmware_dir().join("kmm/hello.bin").exists(),
        "firmware left after a failure"
    );

    // The same intent is retried on the next pass; a fixed image loads.
    let events = agent
        .reconcile(&load(&[desired(
            registry.image("broken/missing-dep:v1"),
            "1",
        )]))
        .await;
    assert_eq!(summary(&events), [(EventAction::Load, false)]);
    let events = agent
        .reconcile(&load(&[desired(registry.image("samples/hello:v1"), "1")]))
        .await;
    assert_success(&events, &[EventAction::Load]);
    assert_eq!(node.loaded(), [MODULE, DEP_MODULE]);
}

/// The agent loop through the control seam: failures are retried until they succeed,
/// also after the control plane is gone, and losing it unloads nothing.
#[tokio::test]
async fn agent_loop_retries_and_keeps_the_last_intent_on_silence() {
    use kmm_node_agent::agent::{self, LoopTiming};
    use kmm_node_agent::control;
    use std::time::Duration;

    let k = kernel();
    let registry = Registry::plain();
    let node = Node::new(k);
    let ((intents, intent_rx), (event_tx, mut events)) = control::channels();
    let timing = LoopTiming {
        retry_initial: Duration::from_millis(50),
        retry_max: Duration::from_millis(200),
        resync: Duration::from_secs(3600),
    };
    let task = tokio::spawn(agent::run(node.agent(), intent_rx, event_tx, timing));
    // The image does not exist yet: the load fails, and is retried.
    intents
        .send(Some(load(&[desired(registry.image("late/hello:v1"), "1")])))
        .unwrap();
    let failed = next(&mut events).await;
    let Outcome::Failure(error) = &failed.outcome else {
        panic!("{failed:?}")
    };
    assert!(error.contains("not found"), "{error}");

    // The control plane goes away while the load is failing. The loop sees the closed
    // channel at its next wake and keeps retrying the last intent: the load succeeds
    // once the image exists, which it does only after the drop.
    drop(intents);
    registry
        .push_sample("late/hello:v1", &Sample::good(k))
        .await;
    let loaded = loop {
        let event = next(&mut events).await;
        if event.is_success() {
            break event;
        }
    };
    assert_eq!(loaded.action, EventAction::Load);
    assert_eq!(node.loaded(), [MODULE, DEP_MODULE]);
    assert!(!task.is_finished(), "the loop ended with its control plane");
    task.abort();
    assert!(task.await.unwrap_err().is_cancelled());
    assert_eq!(
        node.loaded(),
        [MODULE, DEP_MODULE],
        "stopping the agent unloaded modules"
    );
}

async fn next(events: &mut kmm_node_agent::control::EventReceiver) -> AgentEvent {
    tokio::time::timeout(std::time::Duration::from_secs(60), events.recv())
        .await
        .expect("an event within the deadline")
        .expect("the agent is running")
}

/// When the old version cannot be unloaded (in use), the new one is not "loaded" on
/// top of it; both succeed once the module is free.
#[tokio::test]
async fn a_version_change_waits_for_the_old_version_to_unload() {
    let k = kernel();
    let registry = Registry::plain();
    registry
        .push_sample("samples/hello:v1", &Sample::good(k))
        .await;
    let mut second = Sample::good(k);
    second.firmware = vec![("kmm/hello.bin".into(), b"firmware v2".to_vec())];
    registry.push_sample("samples/hello:v2", &second).await;
    let node = Node::new(k);
    let mut agent = node.agent();
    let one = desired(registry.image("samples/hello:v1"), "1");
    assert_success(
        &agent.reconcile(&load(std::slice::from_ref(&one))).await,
        &[EventAction::Load],
    );

    // Something else on the node holds the module.
    let holder = node.dir.path().join("kernel/modules/holder.json");
    std::fs::write(
        &holder,
        serde_json::json!({ "name": "holder", "depends": [DEP_MODULE], "inTree": true })
            .to_string(),
    )
    .unwrap();
    let two = desired(registry.image("samples/hello:v2"), "2");
    let events = agent.reconcile(&load(std::slice::from_ref(&two))).await;
    assert_eq!(
        summary(&events),
        [(EventAction::Unload, false), (EventAction::Load, false)]
    );
    let Outcome::Failure(error) = &events[0].outcome else {
        unreachable!()
    };
    assert!(error.contains("in use"), "{error}");
    assert_eq!(
        agent.state().modules["kmm-ops/hello"].version.as_deref(),
        Some("1")
    );
    let firmware = node.firmware_dir().join("kmm/hello.bin");
    assert_eq!(std::fs::read(&firmware).unwrap(), b"firmware v1");

    std::fs::remove_file(&holder).unwrap();
    let events = agent.reconcile(&load(std::slice::from_ref(&two))).await;
    assert_success(&events, &[EventAction::Unload, EventAction::Load]);
    assert_eq!(
        agent.state().modules["kmm-ops/hello"].version.as_deref(),
        Some("2")
    );
    assert_eq!(std::fs::read(&firmware).unwrap(), b"firmware v2");
}

/// A second module loading, by name, the kernel module the first one's depends on.
fn second(image: String) -> DesiredModule {
    let mut second = desired(image, "1");
    second.key = "kmm-ops/second".into();
    second.modprobe.module_name = Some(MODULE.into());
    second.modprobe.firmware_path = None;
    second
}

/// Two served modules share `kmm_hello` (one loads it by name, the other loads
/// `kmm_hello_dep`, which depends on it): either unload completes without taking it from
/// the other, in either order, and its event names what it kept and for whom.
#[tokio::test]
async fn an_unload_never_takes_a_kernel_module_another_served_module_needs() {
    let k = kernel();
    let registry = Registry::plain();
    registry
        .push_sample("samples/hello:v1", &Sample::good(k))
        .await;
    let first = desired(registry.image("samples/hello:v1"), "1");
    let second = second(registry.image("samples/hello:v1"));
    for (unloaded, stays, left) in [
        (&second, &first, vec![MODULE, DEP_MODULE]),
        (&first, &second, vec![MODULE]),
    ] {
        let node = Node::new(k);
        let mut agent = node.agent();
        assert_success(
            &agent
                .reconcile(&load(&[first.clone(), second.clone()]))
                .await,
            &[EventAction::Load, EventAction::Load],
        );
        let events = agent
            .reconcile(&DesiredSnapshot {
                revision: 2,
                modules: vec![stays.clone()],
                unload: vec![unloaded.key.clone()],
            })
            .await;
        assert_success(&events, &[EventAction::Unload]);
        assert_eq!(
            events[0].kept,
            [Kept {
                module: MODULE.into(),
                needed_by: vec![stays.key.clone()],
            }],
            "after unloading {}",
            unloaded.key
        );
        assert_eq!(node.loaded(), left, "after unloading {}", unloaded.key);
        assert!(
            agent
                .reconcile(&load(std::slice::from_ref(stays)))
                .await
                .is_empty(),
            "{} still runs as loaded",
            stays.key
        );
    }
}
