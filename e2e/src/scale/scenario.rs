//! One run of the harness: setup (images, ManagedClusters, the hub, the proxies), the
//! scenarios of issue 14 in order, the unload audit, and teardown.
//!
//! Every wait has a deadline and names what it last saw. Convergence is what the hub
//! says: each module's status (generation observed, every cluster converged, every node
//! loaded, Ready) and, where a scenario changes no module, the hub's own metrics first
//! (every cluster connected again and sent its snapshot).

use std::cell::Cell;
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{Namespace, Secret};
use kmm_api::ManagedClusterModule;
use kmm_runtime::pki::{CertificateAuthority, Leaf};
use kube::Api;
use kube::api::{DeleteParams, ObjectMeta, PostParams};

use super::clusters::{self, RUN_LABEL};
use super::hostile::{self, HostileTraffic};
use super::hub_process::{HubConfig, HubFigures, HubProcess, Profile, binary};
use super::modules::{self, Expected};
use super::proxy::{self, LoadKey, Proxies, ProxyIdentity};
use super::report::{FleetCpu, IdleFigures, ScenarioFigures, SetupFigures, UnloadAudit};
use super::{Error, Result, Shape, io, poll_until};
use crate::fixture::Fleet;
use crate::watched::Watched;

/// How long a deleted module may wait for its unloads before the hub releases it
/// anyway: far beyond any wait of the run, so a release always means every unload was
/// confirmed.
const UNLOAD_TIMEOUT: Duration = Duration::from_secs(3600);
const CERTIFICATE_VALIDITY: Duration = Duration::from_secs(24 * 3600);
const METRICS_POLL: Duration = Duration::from_millis(100);
/// How long the hub must do nothing before its idle CPU is measured: longer than
/// the status write interval, so a pending coalesced write is not mistaken for quiet.
const QUIET: Duration = Duration::from_secs(3);
/// Most of a core the hub may use over [`QUIET`] and still count as quiet.
const QUIET_CPU: f64 = 0.10;

/// What [`Harness::wait_quiet`] last saw change: the hub's (status writes, snapshots
/// sent), when, and the CPU seconds it had used by then.
#[derive(Clone, Copy)]
struct QuietSince {
    counts: (u64, u64),
    at: Instant,
    cpu: f64,
}

/// What [`Harness::hostile`] measured.
#[derive(Clone, Debug)]
pub struct HostileFigures {
    /// The hub's RSS, quiet, before the attack.
    pub baseline_rss_kib: u64,
    /// The highest RSS sampled during the attack.
    pub attack_rss_kib: u64,
    /// The hub's `VmHWM` after it.
    pub peak_rss_kib: u64,
    pub connected_clusters: u64,
    /// How long the well-behaved clusters took to converge on the change made during it.
    pub change_converge_s: f64,
    pub traffic: HostileTraffic,
}

/// What a run does.
#[derive(Clone, Debug)]
pub struct Options {
    pub shape: Shape,
    pub profile: Profile,
    /// Deadline of each wait: a scenario not converged by then fails the run.
    pub converge_timeout: Duration,
    /// How long the idle hub's CPU is measured.
    pub idle: Duration,
}

/// A run of the harness on the fleet.
#[derive(Debug)]
pub struct Harness {
    fleet: Fleet,
    options: Options,
    run: String,
    workdir: PathBuf,
    hub: Option<HubProcess>,
    proxies: Option<Proxies>,
    watch: Watched<ManagedClusterModule>,
    clusters: Vec<String>,
    /// The run's modules and their latest generation.
    modules: BTreeMap<String, i64>,
    wave: u32,
    version: u32,
}

/// What the figures of a scenario are measured from.
struct Mark {
    started: Instant,
    hub: HubFigures,
    bytes: u64,
    fleet: FleetCpu,
}

impl Harness {
    /// A run with a fresh name; nothing is created before [`Harness::setup`].
    pub fn new(fleet: &Fleet, options: Options) -> Self {
        let run = super::run_id();
        Self {
            fleet: fleet.clone(),
            workdir: std::env::temp_dir().join(format!("kmm-fleet-scale-{run}")),
            watch: modules::watch(&fleet.hub, &run),
            run,
            options,
            hub: None,
            proxies: None,
            clusters: Vec::new(),
            modules: BTreeMap::new(),
            wave: 0,
            version: 1,
        }
    }

    /// The run's name: prefix of its clusters and modules, value of its labels.
    pub fn run(&self) -> &str {
        &self.run
    }

    /// The hub's log.
    pub fn hub_log(&self) -> PathBuf {
        self.workdir.join("kmm-hub.log")
    }

    fn shape(&self) -> &Shape {
        &self.options.shape
    }

    /// Deadline of waits on OCM's controllers, which work through clusters at a rate
    /// of their own (about 8 a second here).
    fn fleet_timeout(&self) -> Duration {
        self.options.converge_timeout + Duration::from_millis(500) * self.shape().clusters as u32
    }

    fn namespace(&self) -> String {
        format!("kmm-scale-{}", self.run)
    }

    fn hub(&self) -> Result<&HubProcess> {
        self.hub
            .as_ref()
            .ok_or_else(|| Error::Invalid("the hub is not running".into()))
    }

    fn proxies(&self) -> Result<&Proxies> {
        self.proxies
            .as_ref()
            .ok_or_else(|| Error::Invalid("the proxies are not running".into()))
    }

    /// Pushes the images, creates the ManagedClusters (measured: OCM's controllers work
    /// on each), starts the hub and connects every proxy.
    pub async fn setup(&mut self) -> Result<SetupFigures> {
        let n = self.shape().clusters;
        raise_open_files(n as u64 + 4096)?;
        std::fs::create_dir_all(&self.workdir)
            .map_err(io(format!("creating {}", self.workdir.display())))?;
        let profile = self.options.profile;
        let binary = tokio::task::spawn_blocking(move || binary(profile))
            .await
            .map_err(|e| Error::Invalid(format!("locating kmm-hub: {e}")))??;
        modules::apply_crds(&self.fleet.hub).await?;
        let kernels = proxy::fleet_kernels(self.shape(), 0)
            .into_iter()
            .chain(proxy::fleet_kernels(self.shape(), 1))
            .collect();
        modules::push_images(&self.fleet.state.registry, &kernels).await?;
        Api::<Namespace>::all(self.fleet.hub.clone())
            .create(
                &PostParams::default(),
                &Namespace {
                    metadata: ObjectMeta {
                        name: Some(self.namespace()),
                        labels: Some([(RUN_LABEL.to_owned(), self.run.clone())].into()),
                        ..ObjectMeta::default()
                    },
                    ..Namespace::default()
                },
            )
            .await?;

        let before = FleetCpu::sample(&self.fleet.state);
        let started = Instant::now();
        self.clusters = clusters::create(&self.fleet.hub, &self.run, n).await?;
        let create_s = started.elapsed().as_secs_f64();
        // OCM's registration controller accepts each cluster (a condition, finalizers, a
        // taint, RBAC, a namespace): the hub starts once it is done, so that its figures
        // are its own.
        let (hub_client, run) = (&self.fleet.hub, &self.run);
        poll_until(
            "OCM's registration controller to accept every cluster",
            self.fleet_timeout(),
            Duration::from_secs(1),
            || async {
                Ok(match clusters::ocm_pending(hub_client, run, n).await? {
                    None => Ok(()),
                    Some(pending) => Err(pending),
                })
            },
        )
        .await?;
        let setup = SetupFigures {
            clusters: n,
            create_s,
            ocm_settled_s: started.elapsed().as_secs_f64(),
            fleet: FleetCpu::sample(&self.fleet.state).since(&before),
        };

        let hub = HubProcess::start(HubConfig {
            binary,
            kubeconfig: self.fleet.state.cluster("hub")?.kubeconfig.clone(),
            namespace: self.namespace(),
            addon_name: self.namespace(),
            module_selector: modules::module_selector(&self.run),
            unload_timeout: UNLOAD_TIMEOUT,
            log: self.hub_log(),
        })
        .await?;
        let grpc = hub.grpc;
        self.hub = Some(hub);
        let ca = self.hub_ca().await?;
        let ca_pem = ca.cert_pem().to_owned();
        let identities = self.identities(ca).await?;
        self.proxies = Some(Proxies::start(
            grpc,
            &ca_pem,
            identities,
            self.shape().nodes_per_cluster,
        )?);
        self.wait_connected("every proxy connected", 0).await?;
        Ok(setup)
    }

    /// The CA the hub made in its namespace.
    async fn hub_ca(&self) -> Result<CertificateAuthority> {
        let secrets: Api<Secret> = Api::namespaced(self.fleet.hub.clone(), &self.namespace());
        let secret = poll_until(
            "the hub's CA Secret kmm-hub-ca",
            self.options.converge_timeout,
            METRICS_POLL,
            || async {
                Ok(secrets
                    .get_opt("kmm-hub-ca")
                    .await?
                    .ok_or_else(|| "absent".to_owned()))
            },
        )
        .await?;
        let data = secret.data.unwrap_or_default();
        let text = |key: &str| {
            data.get(key)
                .and_then(|b| String::from_utf8(b.0.clone()).ok())
                .ok_or_else(|| Error::Invalid(format!("the hub's CA Secret has no {key}")))
        };
        Ok(CertificateAuthority::from_pem(
            &text("tls.crt")?,
            &text("tls.key")?,
        )?)
    }

    /// A client certificate per cluster, as OCM's add-on registration issues them.
    async fn identities(&self, ca: CertificateAuthority) -> Result<Vec<ProxyIdentity>> {
        self.identities_of(ca, self.clusters.clone()).await
    }

    async fn identities_of(
        &self,
        ca: CertificateAuthority,
        clusters: Vec<String>,
    ) -> Result<Vec<ProxyIdentity>> {
        let addon = self.namespace();
        tokio::task::spawn_blocking(move || {
            clusters
                .into_iter()
                .map(|cluster| {
                    let cn = format!(
                        "system:open-cluster-management:cluster:{cluster}:addon:{addon}:agent:{addon}-agent"
                    );
                    let groups = [
                        format!("system:open-cluster-management:cluster:{cluster}:addon:{addon}"),
                        format!("system:open-cluster-management:addon:{addon}"),
                        "system:authenticated".to_owned(),
                    ];
                    let issued = ca.issue(&Leaf::client(&cn, &groups, CERTIFICATE_VALIDITY))?;
                    Ok(ProxyIdentity {
                        cluster,
                        cert_pem: issued.cert_pem,
                        key_pem: issued.key_pem.to_string(),
                    })
                })
                .collect()
        })
        .await
        .map_err(|e| Error::Invalid(format!("issuing client certificates: {e}")))?
    }

    /// The run of the hostile proxy's cluster: not the run's, so that no module selects
    /// it and the run's convergence counts only the well-behaved clusters.
    fn hostile_run(&self) -> String {
        format!("{}x", self.run)
    }

    /// `hostile` (issue 28): one more accepted cluster's proxy, with a valid certificate,
    /// sends junk for `duration` (see [`hostile`]) while the first module changes on the
    /// well-behaved clusters. Measures the hub's RSS before and (sampled every
    /// [`METRICS_POLL`]) during the attack, and how long the change took to converge.
    pub async fn hostile(&mut self, duration: Duration) -> Result<HostileFigures> {
        let run = self.hostile_run();
        clusters::create(&self.fleet.hub, &run, 1).await?;
        let hub_client = &self.fleet.hub;
        poll_until(
            "OCM's registration controller to accept the hostile cluster",
            self.fleet_timeout(),
            Duration::from_secs(1),
            || async {
                Ok(match clusters::ocm_pending(hub_client, &run, 1).await? {
                    None => Ok(()),
                    Some(pending) => Err(pending),
                })
            },
        )
        .await?;
        let ca = self.hub_ca().await?;
        let ca_pem = ca.cert_pem().to_owned();
        let identity = self
            .identities_of(ca, vec![clusters::cluster_name(&run, 0)])
            .await?
            .pop()
            .ok_or_else(|| Error::Invalid("no identity issued".into()))?;
        self.wait_quiet().await?;
        let hub = self.hub()?;
        let (grpc, pid) = (hub.grpc, hub.pid()?);
        let baseline_rss_kib = hub.figures().await?.rss_kib;

        let module = kmm_proto::v1::ModuleKey {
            namespace: modules::SPOKE_NAMESPACE.to_owned(),
            name: modules::module_name(&self.run, 0),
        };
        let until = Instant::now() + duration;
        let attack =
            tokio::spawn(
                async move { hostile::run(grpc, &ca_pem, &identity, &module, until).await },
            );
        let (stop_sampling, mut stopped) = tokio::sync::watch::channel(false);
        let sampler = tokio::spawn(async move {
            let mut max = 0;
            loop {
                if let Some((rss, _)) = crate::process::memory_kib(pid) {
                    max = u64::max(max, rss);
                }
                tokio::select! {
                    () = tokio::time::sleep(METRICS_POLL) => {}
                    _ = stopped.changed() => break max,
                }
            }
        });
        // Into the attack, so that the hub is busy refusing when the change arrives.
        tokio::time::sleep(duration / 4).await;
        let change = self.spec_edit().await;
        let traffic = attack
            .await
            .map_err(|e| Error::Invalid(format!("the hostile proxy failed: {e}")))?;
        let _ = stop_sampling.send(true);
        let attack_rss_kib = sampler
            .await
            .map_err(|e| Error::Invalid(format!("sampling the hub's RSS failed: {e}")))?;
        let after = self.hub()?.figures().await?;
        Ok(HostileFigures {
            baseline_rss_kib,
            attack_rss_kib,
            peak_rss_kib: after.peak_rss_kib,
            connected_clusters: after.connected_clusters,
            change_converge_s: change?.converge_s,
            traffic: traffic?,
        })
    }

    /// Waits until the hub reports every cluster connected and has given streams their
    /// intents (sent a snapshot, or found the proxy holding it) at least `given` times.
    async fn wait_connected(&self, what: &str, given: u64) -> Result<()> {
        let hub = self.hub()?;
        let n = self.shape().clusters as u64;
        poll_until(what, self.options.converge_timeout, METRICS_POLL, || async {
            let m = hub.metrics().await?;
            Ok(if m.connected_clusters == n && m.intents_given() >= given {
                Ok(())
            } else {
                Err(format!(
                    "hub: {} of {n} clusters connected, {} snapshots sent and {} resumed (want {given} together)",
                    m.connected_clusters, m.snapshots_sent, m.snapshots_resumed
                ))
            })
        })
        .await
    }

    /// Until the hub has written no status, sent no snapshot and used less than
    /// [`QUIET_CPU`] of a core for [`QUIET`]. A hub that never goes quiet fails the run:
    /// with nothing changing it must not work. CPU counts too because a scenario's tail
    /// (say, image needs recomputed as 3,500 reconnected inventories arrive) can run for
    /// seconds without writing anything.
    async fn wait_quiet(&self) -> Result<()> {
        let hub = self.hub()?;
        let since: Cell<Option<QuietSince>> = Cell::new(None);
        poll_until(
            "the hub quiet (no status write, no snapshot, idle CPU)",
            self.options.converge_timeout,
            METRICS_POLL,
            || {
                let since = &since;
                async move {
                    let m = hub.metrics().await?;
                    let (counts, now) = ((m.status_writes, m.snapshots_sent), Instant::now());
                    let cpu = hub.cpu_seconds()?;
                    Ok(match since.get() {
                        Some(QuietSince {
                            counts: seen,
                            at,
                            cpu: cpu_at,
                        }) if seen == counts => {
                            let quiet = now.duration_since(at);
                            let busy = (cpu - cpu_at) / quiet.as_secs_f64().max(f64::EPSILON);
                            if quiet < QUIET {
                                Err(format!("quiet for {quiet:?}"))
                            } else if busy >= QUIET_CPU {
                                since.set(Some(QuietSince {
                                    counts,
                                    at: now,
                                    cpu,
                                }));
                                Err(format!(
                                    "writing nothing but busy: {:.0} % of a core",
                                    busy * 100.0
                                ))
                            } else {
                                Ok(())
                            }
                        }
                        _ => {
                            since.set(Some(QuietSince {
                                counts,
                                at: now,
                                cpu,
                            }));
                            Err(format!(
                                "still working: {} status writes, {} snapshots sent",
                                counts.0, counts.1
                            ))
                        }
                    })
                }
            },
        )
        .await
    }

    async fn mark(&self) -> Result<Mark> {
        Ok(Mark {
            hub: self.hub()?.figures().await?,
            bytes: self.proxies()?.bytes_received(),
            fleet: FleetCpu::sample(&self.fleet.state),
            started: Instant::now(),
        })
    }

    async fn figures(&self, scenario: &'static str, mark: Mark) -> Result<ScenarioFigures> {
        let converge_s = mark.started.elapsed().as_secs_f64();
        let hub = self.hub()?.figures().await?;
        Ok(ScenarioFigures {
            scenario,
            shape: self.shape().clone(),
            converge_s,
            hub_rss_kib: hub.rss_kib,
            hub_cpu_s: hub.cpu_seconds - mark.hub.cpu_seconds,
            sent_bytes: self.proxies()?.bytes_received() - mark.bytes,
            status_writes: hub.status_writes - mark.hub.status_writes,
            snapshots_sent: hub.snapshots_sent - mark.hub.snapshots_sent,
            snapshots_resumed: hub.snapshots_resumed - mark.hub.snapshots_resumed,
            fleet: FleetCpu::sample(&self.fleet.state).since(&mark.fleet),
        })
    }

    fn expected(&self, kernels: bool) -> Expected {
        Expected {
            modules: self.modules.clone(),
            clusters: self.shape().clusters as i32,
            nodes: self.shape().nodes() as i32,
            kernels: kernels.then(|| proxy::fleet_kernels(self.shape(), self.wave)),
        }
    }

    async fn wait_converged(&mut self, what: &str, kernels: bool) -> Result<()> {
        let expected = self.expected(kernels);
        let timeout = self.options.converge_timeout;
        self.watch
            .wait_for(what, timeout, |modules| {
                modules::converged(modules, &expected)
            })
            .await?;
        Ok(())
    }

    /// Creates the modules at once (see [`modules::delete_all`] for why not one after
    /// the other).
    async fn create_modules(&mut self, indices: std::ops::Range<usize>) -> Result<()> {
        let version = self.version.to_string();
        let objects = indices
            .map(|index| {
                let name = modules::module_name(&self.run, index);
                let module =
                    modules::module(&self.run, &name, &self.fleet.state.registry, &version)?;
                Ok((name, module))
            })
            .collect::<Result<Vec<_>>>()?;
        let hub = &self.fleet.hub;
        let created =
            futures::future::try_join_all(objects.into_iter().map(|(name, module)| async move {
                modules::create(hub, &module)
                    .await
                    .map(|generation| (name, generation))
            }))
            .await?;
        self.modules.extend(created);
        Ok(())
    }

    /// `create`: one module over the whole fleet.
    pub async fn create(&mut self) -> Result<ScenarioFigures> {
        let mark = self.mark().await?;
        self.create_modules(0..1).await?;
        self.wait_converged("the first module loaded on every node", false)
            .await?;
        self.figures("create", mark).await
    }

    /// `modules`: the other K-1 modules at once; `None` when K is 1.
    pub async fn more_modules(&mut self) -> Result<Option<ScenarioFigures>> {
        let k = self.shape().modules;
        if k < 2 {
            return Ok(None);
        }
        let mark = self.mark().await?;
        self.create_modules(1..k).await?;
        self.wait_converged("every module loaded on every node", false)
            .await?;
        self.figures("modules", mark).await.map(Some)
    }

    /// `spec-edit`: a new version of the first module, to be loaded on every node.
    pub async fn spec_edit(&mut self) -> Result<ScenarioFigures> {
        let mark = self.mark().await?;
        self.version += 1;
        let name = modules::module_name(&self.run, 0);
        let generation =
            modules::set_version(&self.fleet.hub, &name, &self.version.to_string()).await?;
        self.modules.insert(name, generation);
        self.wait_converged("the new version loaded on every node", false)
            .await?;
        self.figures("spec-edit", mark).await
    }

    /// `kernel-upgrade`: every cluster's nodes reboot into the next wave's kernels.
    pub async fn kernel_upgrade(&mut self) -> Result<ScenarioFigures> {
        let mark = self.mark().await?;
        self.wave += 1;
        self.proxies()?.upgrade_kernels(self.wave);
        self.wait_converged("every node loaded on its new kernel", true)
            .await?;
        self.figures("kernel-upgrade", mark).await
    }

    /// `reconnect-10pct`: every tenth cluster's stream breaks at once.
    pub async fn reconnect(&mut self) -> Result<ScenarioFigures> {
        let mark = self.mark().await?;
        let dropped: Vec<usize> = (0..self.shape().clusters).step_by(10).collect();
        self.proxies()?.drop_streams(dropped.iter().copied());
        self.wait_connected(
            "the dropped clusters reconnected and were given their intents",
            mark.hub.snapshots_sent + mark.hub.snapshots_resumed + dropped.len() as u64,
        )
        .await?;
        self.wait_converged("every node loaded after the reconnections", false)
            .await?;
        self.figures("reconnect-10pct", mark).await
    }

    /// `hub-restart`: SIGTERM to the hub, started again; every cluster reconnects.
    pub async fn hub_restart(&mut self) -> Result<ScenarioFigures> {
        let mark = self.mark().await?;
        self.hub
            .as_mut()
            .ok_or_else(|| Error::Invalid("the hub is not running".into()))?
            .restart()
            .await?;
        // The new process's counters start at zero: every cluster must be given its
        // intents (sent, or resumed from what its proxy holds).
        let n = self.shape().clusters as u64;
        self.wait_connected("every cluster reconnected to the new hub", n)
            .await?;
        self.wait_converged("every node loaded after the hub restart", false)
            .await?;
        self.figures("hub-restart", mark).await
    }

    /// The hub's CPU with every stream open and nothing changing, over
    /// [`Options::idle`]. Measured only once the hub has gone quiet: a scenario
    /// converges before its last counts are written, and those writes are the
    /// scenario's cost, not the idle hub's.
    pub async fn idle(&mut self) -> Result<IdleFigures> {
        self.wait_connected("every cluster connected before idling", 0)
            .await?;
        self.wait_quiet().await?;
        let hub = self.hub()?;
        let (cpu, writes) = (hub.cpu_seconds()?, hub.metrics().await?.status_writes);
        let started = Instant::now();
        tokio::time::sleep(self.options.idle).await;
        let metrics = hub.metrics().await?;
        Ok(IdleFigures {
            shape: self.shape().clone(),
            connected: metrics.connected_clusters,
            seconds: started.elapsed().as_secs_f64(),
            hub_cpu_s: hub.cpu_seconds()? - cpu,
            status_writes: metrics.status_writes - writes,
        })
    }

    /// `delete`: every module deleted; converged once the hub released them all. Then
    /// the proxies stop and their nodes' unloads are audited: every (cluster, node,
    /// module) unloaded exactly once.
    pub async fn delete(&mut self) -> Result<(ScenarioFigures, UnloadAudit)> {
        let mark = self.mark().await?;
        modules::delete_all(&self.fleet.hub, &self.run).await?;
        let timeout = self.options.converge_timeout;
        self.watch
            .wait_for(
                "every module unloaded and released",
                timeout,
                |modules| match modules.values().next() {
                    None => Ok(()),
                    Some(m) => Err(format!(
                        "{} modules left; {}: {:?}",
                        modules.len(),
                        kube::ResourceExt::name_any(m),
                        m.status
                            .as_ref()
                            .and_then(|s| s.conditions.first())
                            .map(|c| &c.message)
                    )),
                },
            )
            .await?;
        let figures = self.figures("delete", mark).await?;
        // The audit reads the nodes once the hub has told every cluster to forget.
        let proxies = self.proxies()?;
        poll_until(
            "every cluster's snapshot without the deleted modules",
            timeout,
            METRICS_POLL,
            || async {
                let left = proxies.clusters_with_modules();
                Ok(if left == 0 {
                    Ok(())
                } else {
                    Err(format!("{left} clusters still list a module"))
                })
            },
        )
        .await?;
        let outcome = self.proxies.take().expect("checked above").stop().await?;
        let mut expected: Vec<LoadKey> = Vec::new();
        for cluster in &self.clusters {
            for node in (0..self.shape().nodes_per_cluster).map(proxy::node_name) {
                for module in self.modules.keys() {
                    expected.push((cluster.clone(), node.clone(), module.clone()));
                }
            }
        }
        let audit = UnloadAudit::new(&expected, &outcome.unloads, &outcome.loaded);
        self.modules.clear();
        Ok((figures, audit))
    }

    /// The highest resident memory of every hub process of the run (`VmHWM`).
    pub async fn peak_rss_kib(&self) -> Result<u64> {
        Ok(self.hub()?.figures().await?.peak_rss_kib)
    }

    /// Every scenario in order, each line handed to `out` as soon as it is measured;
    /// the unload audit last.
    pub async fn run_all(&mut self, mut out: impl FnMut(String)) -> Result<UnloadAudit> {
        let mut scenario = |f: ScenarioFigures| {
            out(f.line());
            out(f.detail_line());
        };
        scenario(self.create().await?);
        if let Some(f) = self.more_modules().await? {
            scenario(f);
        }
        scenario(self.spec_edit().await?);
        scenario(self.kernel_upgrade().await?);
        scenario(self.reconnect().await?);
        scenario(self.hub_restart().await?);
        let idle = self.idle().await?;
        let (deleted, audit) = self.delete().await?;
        scenario(deleted);
        out(super::report::peak_line(
            self.shape(),
            self.peak_rss_kib().await?,
        ));
        out(idle.line());
        out(audit.line());
        Ok(audit)
    }

    /// Removes everything the run made, whatever state it is in: modules (released by
    /// hand once the hub is gone), proxies, the hub, the ManagedClusters with what OCM
    /// made for them, the hub's namespace; the work directory too unless `keep_logs`.
    /// Every step is tried; the first failure is returned.
    pub async fn teardown(mut self, keep_logs: bool) -> Result<()> {
        let mut first: Option<Error> = None;
        let mut note = |r: Result<()>| {
            if let Err(e) = r
                && first.is_none()
            {
                first = Some(e);
            }
        };
        if let Some(proxies) = self.proxies.take() {
            note(proxies.stop().await.map(drop));
        }
        if let Some(mut hub) = self.hub.take() {
            note(hub.stop().await);
        }
        note(modules::delete_all(&self.fleet.hub, &self.run).await);
        note(modules::release_leftovers(&self.fleet.hub, &self.run).await);
        note(clusters::delete(&self.fleet.hub, &self.run, self.fleet_timeout()).await);
        note(clusters::delete(&self.fleet.hub, &self.hostile_run(), self.fleet_timeout()).await);
        let namespaces: Api<Namespace> = Api::all(self.fleet.hub.clone());
        note(
            match namespaces
                .delete(&self.namespace(), &DeleteParams::background())
                .await
            {
                Ok(_) => Ok(()),
                Err(kube::Error::Api(s)) if s.code == 404 => Ok(()),
                Err(e) => Err(e.into()),
            },
        );
        if !keep_logs {
            note(
                std::fs::remove_dir_all(&self.workdir)
                    .or_else(|e| match e.kind() {
                        std::io::ErrorKind::NotFound => Ok(()),
                        _ => Err(e),
                    })
                    .map_err(io(format!("removing {}", self.workdir.display()))),
            );
        }
        first.map_or(Ok(()), Err)
    }
}

/// Raises this process's open-file limit (inherited by the hub it starts) to at least
/// `needed`: one socket per simulated proxy here, one per stream in the hub.
fn raise_open_files(needed: u64) -> Result<()> {
    use nix::sys::resource::{Resource, getrlimit, setrlimit};
    let (soft, hard) = getrlimit(Resource::RLIMIT_NOFILE)
        .map_err(|e| Error::Invalid(format!("reading RLIMIT_NOFILE: {e}")))?;
    if soft >= needed {
        return Ok(());
    }
    if hard < needed {
        return Err(Error::Invalid(format!(
            "RLIMIT_NOFILE's hard limit {hard} is below the {needed} open files this run needs"
        )));
    }
    setrlimit(Resource::RLIMIT_NOFILE, needed, hard)
        .map_err(|e| Error::Invalid(format!("raising RLIMIT_NOFILE to {needed}: {e}")))
}
