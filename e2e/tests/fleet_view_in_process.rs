//! The fleet view in a real browser, with no fleet: kmm-hub's UI server runs in this
//! process over the hub's test fixture (`kmm_hub::fleet_ui::testing`, fed as the
//! watches and proxies would), and Debian's headless Chromium opens its pages. A change
//! of the fixture's state must reach an open page through its event stream, without a
//! reload; the pages are also read with JavaScript off, as served.
//!
//! Needs `/usr/bin/chromium` (`cargo xtask env setup` installs it): without it the test
//! fails and says so. Its screenshots go to `<target>/tmp/fleet-view-in-process/`;
//! `KMM_REFRESH_DOCS_IMAGES=1` also writes them over `docs/images/fleet-view-*.png`.

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use kmm_e2e::browser::{Browser, Page, Screenshots};
use kmm_hub::fleet_ui::replica::{Replica, Role};
use kmm_hub::fleet_ui::server::serve;
use kmm_hub::fleet_ui::testing::{Fleet, Stream, module};
use kmm_proto::v1::ModuleState::{Failed, Loaded, Pending};
use kmm_runtime::http_server::ConnectionMetrics;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

/// The view promises a change on screen within a second; a loaded 2-core machine gets
/// a few.
const LIVE: Duration = Duration::from_secs(5);
/// A page as served: it is complete when it has loaded.
const SHOWN: Duration = Duration::from_secs(10);

const REASON: &str = "LoadFailed";
const MESSAGE: &str = "modprobe: ERROR: could not insert 'hello': Exec format error";
/// Clusters where `hello` is loaded from the start, beside the three the test changes.
const SETTLED: [&str; 5] = ["edge-01", "edge-02", "edge-03", "edge-04", "edge-05"];

/// The module `hello` at `version`, with one mapping for every kernel.
fn hello(version: &str, generation: i64) -> kmm_api::ManagedClusterModule {
    module("hello")
        .generation(generation)
        .with("/spec/moduleSpec/moduleLoader/container/version", version)
        .build()
}

/// The fleet page's row of `hello`, split into its cells: name, bar (no text), loaded,
/// pending, failed, held, disconnected, rollout.
fn cells(row: &str) -> Vec<&str> {
    row.split('\t').map(str::trim).collect()
}

/// Whether the fleet page's `hello` row counts (loaded, pending, failed) clusters.
fn counts(row: &str, expected: [&str; 3]) -> bool {
    let cells = cells(row);
    cells.first() == Some(&"hello") && cells.get(2..5) == Some(&expected[..])
}

/// The UI server on 127.0.0.1, leading over `fleet`'s view, stopped when dropped.
struct Server {
    url: String,
    stop: CancellationToken,
    /// Kept: a closed role channel ends every page's event stream.
    _role: watch::Sender<Role>,
}

impl Server {
    async fn start(fleet: &Fleet) -> Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let url = format!("http://{}", listener.local_addr()?);
        let (role_sender, role) = watch::channel(Role::Leading(fleet.view.clone()));
        let replica = Replica {
            instance: "kmm-hub-7d9f-x2".into(),
            role,
            lease: None,
        };
        let stop = CancellationToken::new();
        tokio::spawn(serve(
            listener,
            replica,
            ConnectionMetrics::default(),
            stop.clone().cancelled_owned(),
        ));
        Ok(Self {
            url,
            stop,
            _role: role_sender,
        })
    }

    fn url(&self, path: &str) -> String {
        format!("{}{path}", self.url)
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// Waits until `page`'s `selector` text holds `holds`, then checks that the page was
/// not reloaded to show it; how long the change took to appear.
async fn live_change(
    page: &Page,
    what: &str,
    selector: &str,
    holds: impl FnMut(&str) -> bool,
) -> Result<Duration> {
    let loaded_at = page.loaded_at().await?;
    let changed = Instant::now();
    page.wait_for_text(what, selector, LIVE, holds).await?;
    let took = changed.elapsed();
    ensure!(
        page.loaded_at().await? == loaded_at,
        "{}: the page was reloaded to show {what}",
        page.url()
    );
    eprintln!("{what}: on screen {} ms after the change", took.as_millis());
    Ok(took)
}

/// Eight clusters: spoke1 loading `hello` on two nodes (one still pending), spoke2 and
/// the [`SETTLED`] loaded, spoke3 failing to load it on its node.
fn fleet() -> (Fleet, [Stream; 3]) {
    let mut fleet = Fleet::new();
    for cluster in ["spoke1", "spoke2", "spoke3"].iter().chain(&SETTLED) {
        fleet.add_cluster(cluster);
    }
    fleet.add_module(hello("1.0", 1));
    for cluster in SETTLED {
        let stream = fleet.connect(cluster);
        fleet.report(cluster, &stream, &[("hello", "worker-1", Loaded, "", "")]);
    }
    let streams = [
        fleet.connect("spoke1"),
        fleet.connect("spoke2"),
        fleet.connect("spoke3"),
    ];
    fleet.report(
        "spoke1",
        &streams[0],
        &[
            ("hello", "worker-1", Loaded, "", ""),
            ("hello", "worker-2", Pending, "", ""),
        ],
    );
    fleet.report(
        "spoke2",
        &streams[1],
        &[("hello", "worker-1", Loaded, "", "")],
    );
    fleet.report(
        "spoke3",
        &streams[2],
        &[("hello", "worker-1", Failed, REASON, MESSAGE)],
    );
    fleet.count();
    (fleet, streams)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_pages_follow_the_fleet_without_a_reload_and_read_without_javascript() -> Result<()> {
    let started = Instant::now();
    let (mut fleet, streams) = fleet();
    let server = Server::start(&fleet).await?;
    let browser = Browser::start()
        .await
        .context("this test needs Debian's headless Chromium")?;
    let shots = Screenshots::new(
        Path::new(env!("CARGO_TARGET_TMPDIR")),
        "fleet-view-in-process",
    );
    let row = "table.modules tbody tr";

    // The fleet page: hello's clusters by state, then spoke1's last node loads.
    let fleet_page = browser.open(&server.url("/")).await?;
    fleet_page
        .wait_for_text("hello: 6 loaded, 1 pending, 1 failed", row, SHOWN, |r| {
            counts(r, ["6", "1", "1"])
        })
        .await?;
    fleet.report(
        "spoke1",
        &streams[0],
        &[
            ("hello", "worker-1", Loaded, "", ""),
            ("hello", "worker-2", Loaded, "", ""),
        ],
    );
    fleet.count();
    live_change(
        &fleet_page,
        "hello: 7 clusters loaded, none pending",
        row,
        |r| counts(r, ["7", "0", "1"]),
    )
    .await?;
    shots.take(&fleet_page, "fleet").await?;

    // The cluster page lists each node with its modules by state.
    let cluster_page = browser.open(&server.url("/clusters/spoke1")).await?;
    let nodes = cluster_page.texts("main table tbody tr").await?;
    let nodes: Vec<Vec<&str>> = nodes.iter().map(|n| cells(n)).collect();
    // The last column is when the node's statuses last changed, as the hub heard it.
    let (counted, changed): (Vec<&[&str]>, Vec<Option<&&str>>) = nodes
        .iter()
        .map(|n| (&n[..n.len().min(7)], n.get(7)))
        .unzip();
    ensure!(
        counted
            == [
                &["worker-1", "6.1", "1", "0", "0", "0", ""][..],
                &["worker-2", "6.1", "1", "0", "0", "0", ""][..],
            ]
            && changed
                .iter()
                .all(|c| c.is_some_and(|c| c.ends_with(" UTC"))),
        "spoke1's nodes, each with hello loaded and when it last changed: {nodes:?}"
    );
    shots.take(&cluster_page, "cluster").await?;

    // A version change: the node page shows the version the node is sent, live.
    let node_page = browser
        .open(&server.url("/clusters/spoke1/nodes/worker-1"))
        .await?;
    let version = "main table tbody tr";
    node_page
        .wait_for_text("hello at 1.0 on worker-1", version, SHOWN, |r| {
            cells(r).get(3) == Some(&"1.0")
        })
        .await?;
    fleet.add_module(hello("2.0", 2));
    fleet.find_images();
    live_change(&node_page, "hello at 2.0 on worker-1", version, |r| {
        cells(r).get(3) == Some(&"2.0")
    })
    .await?;
    shots.take(&node_page, "node").await?;

    // The failure's reason and message on the module page, with and without JavaScript.
    let failures = "table.failures tbody tr";
    let failure = |r: &str| {
        let cells = cells(r);
        cells.first() == Some(&"spoke3") && cells.get(3) == Some(&REASON)
    };
    let module_page = browser.open(&server.url("/modules/hello")).await?;
    let shown = module_page
        .wait_for_text("spoke3's failure", failures, SHOWN, failure)
        .await?;
    ensure!(shown.contains(MESSAGE), "the message shown: {shown:?}");
    shots.take(&module_page, "module").await?;
    let served = browser
        .open_without_javascript(&server.url("/modules/hello"))
        .await?;
    served
        .wait_for_text(
            "spoke3's failure, without JavaScript",
            failures,
            SHOWN,
            failure,
        )
        .await?;
    let pid = browser.pid();
    drop(browser);
    ensure!(
        !Path::new(&format!("/proc/{pid}")).exists(),
        "Chromium (pid {pid}) outlived its driver"
    );
    eprintln!("the test took {} ms", started.elapsed().as_millis());
    Ok(())
}
