//! The pages rendered from a small fleet view a test feeds as the watches and proxies
//! would: what each page says, that every value is escaped, that no credential is ever
//! rendered, how requests are answered, and how live pages are told of changes.

use std::time::Duration;

use http::StatusCode;
use kmm_api::ocm;
use kmm_proto::v1::ModuleState;
use kube::core::DynamicObject;
use kube::runtime::reflector::store::{Writer, store};
use tokio::sync::watch;

use super::cluster_grid::GridFilter;
use super::cluster_page::cluster_page;
use super::fleet_page::fleet_page;
use super::live::{Live, MIN_INTERVAL};
use super::module_page::module_page;
use super::node_page::node_page;
use super::render::{self, Chrome, StandbyPage};
use super::replica::Role;
use super::routes::route;
use super::server::{Answer, leader_answer};
use super::testing::{Fleet, TOKEN, module};
use crate::fleet::cluster_states::ClusterState;
use crate::fleet::module_events::RecentEvent;
use crate::serve::fleet_view::{FleetView, Stores};
use crate::serve::metrics::Metrics;
use crate::serve::outbound::Outbound;
const MESSAGE: &str = "insmod: <script>alert(1)</script> & more";

/// Module `hello` on two clusters: loaded on spoke1's n1, failing on spoke2's n1.
fn two_clusters() -> Fleet {
    let mut fleet = Fleet::new();
    fleet.add_cluster("spoke1");
    fleet.add_cluster("spoke2");
    fleet.add_module(module("hello").build());
    let one = fleet.connect("spoke1");
    fleet.report(
        "spoke1",
        &one,
        &[("hello", "n1", ModuleState::Loaded, "", "")],
    );
    let two = fleet.connect("spoke2");
    fleet.report(
        "spoke2",
        &two,
        &[("hello", "n1", ModuleState::Failed, "LoadFailed", MESSAGE)],
    );
    fleet
}

fn chrome() -> Chrome {
    Chrome {
        instance: "kmm-hub-0".into(),
        note: None,
    }
}

fn page(fleet: &Fleet, path: &str, query: Option<&str>) -> (StatusCode, String) {
    match leader_answer(&fleet.view, &chrome(), route(path, query)) {
        Answer::Page(status, html) => (status, html),
        other => panic!("{path}: not a page: {other:?}"),
    }
}

/// Asserts `html` shows [`MESSAGE`] escaped and never as markup.
fn assert_escaped(html: &str) {
    assert!(
        html.contains("insmod: &#60;script&#62;alert(1)&#60;/script&#62; &#38; more"),
        "{html}"
    );
    assert!(!html.contains("<script>alert"), "{html}");
}

#[test]
fn the_fleet_page_counts_each_modules_clusters_and_the_fleets_kernels() {
    let fleet = two_clusters();
    let page = fleet_page(&fleet.view);
    assert_eq!((page.clusters, page.connected), (2, 2));
    let hello = &page.modules[0];
    assert_eq!(hello.name, "hello");
    assert_eq!(
        (
            hello.counts.loaded,
            hello.counts.failed,
            hello.counts.pending
        ),
        (1, 1, 0)
    );
    assert_eq!(page.kernels.len(), 1);
    let kernel = &page.kernels[0];
    assert_eq!((kernel.release.as_str(), kernel.nodes), ("6.1", 2));
    assert_eq!(kernel.resolving, ["hello"]);
    assert!(kernel.lacking.is_empty());

    let html = render::fleet(&chrome(), &page).unwrap();
    assert!(
        html.contains(r#"<a href="/modules/hello">hello</a>"#),
        "{html}"
    );
    assert!(html.contains("2 of 2 clusters connected"), "{html}");
}

#[test]
fn the_kernel_chart_names_modules_lacking_an_image_but_not_those_that_do_not_apply() {
    let mut fleet = Fleet::new();
    fleet.add_cluster("spoke1");
    fleet.add_module(module("hello").build());
    fleet.add_module(
        module("pulls")
            .with("/spec/moduleSpec/imageRepoSecret/name", "absent")
            .build(),
    );
    fleet.connect_with("spoke1", &["6.1", "5.14"]);
    let kernels = fleet_page(&fleet.view).kernels;
    let releases: Vec<_> = kernels.iter().map(|k| k.release.as_str()).collect();
    assert_eq!(releases, ["5.14", "6.1"]);
    assert!(
        kernels[0].resolving.is_empty() && kernels[0].lacking.is_empty(),
        "no mapping for 5.14: {:?}",
        kernels[0]
    );
    assert_eq!(kernels[1].resolving, ["hello"]);
    assert_eq!(
        kernels[1].lacking,
        [("pulls".to_owned(), "PullSecretNotFound".to_owned())]
    );
}

#[test]
fn the_module_page_groups_clusters_by_state_and_shows_failures_escaped() {
    let fleet = two_clusters();
    let module = fleet.view.known_module("hello").unwrap();
    let page = module_page(&fleet.view, &module, GridFilter::default());
    assert_eq!((page.counts.loaded, page.counts.failed), (1, 1));
    let groups: Vec<_> = page
        .grid
        .iter()
        .map(|g| (g.state, g.shown.clone()))
        .collect();
    assert_eq!(
        groups,
        [
            (ClusterState::Failed, vec!["spoke2".to_owned()]),
            (ClusterState::Loaded, vec!["spoke1".to_owned()]),
        ]
    );
    let failure = &page.failures[0];
    assert_eq!(
        (
            failure.cluster.as_str(),
            failure.node.as_deref(),
            failure.kernel.as_str()
        ),
        ("spoke2", Some("n1"), "6.1")
    );
    assert_eq!(failure.reason, "LoadFailed");
    assert_eq!(page.images[0].digest.as_deref(), Some("sha256:0123"));

    let html = render::module(&chrome(), &page).unwrap();
    assert!(html.contains("LoadFailed"));
    assert!(html.contains("sha256:0123"));
    assert_escaped(&html);

    let failed_only = module_page(
        &fleet.view,
        &module,
        GridFilter {
            state: Some(ClusterState::Failed),
            name: None,
        },
    );
    assert_eq!(failed_only.grid.len(), 1);
}

#[test]
fn the_module_page_lists_its_recent_events_newest_first_escaped() {
    let fleet = two_clusters();
    let module = fleet.view.known_module("hello").unwrap();
    let mut changes = fleet.view.changes();
    changes.mark_seen();
    let event = |uid: &str, at: i64, reason: &str| RecentEvent {
        uid: uid.into(),
        type_: "Warning".into(),
        reason: reason.into(),
        note: "<b>not bold</b>".into(),
        count: 2,
        last: k8s_openapi::jiff::Timestamp::from_second(at).unwrap(),
        reporter: "kmm-hub".into(),
    };
    fleet
        .view
        .note_event("hello", event("a", 1_000, "BuildFailed"));
    fleet
        .view
        .note_event("hello", event("b", 2_000, "SignFailed"));
    fleet
        .view
        .note_event("other", event("c", 3_000, "ImageExists"));
    assert!(
        futures::FutureExt::now_or_never(changes.changed()).is_some(),
        "live pages are told"
    );
    let page = module_page(&fleet.view, &module, GridFilter::default());
    let reasons: Vec<&str> = page.events.iter().map(|e| e.reason.as_str()).collect();
    assert_eq!(reasons, ["SignFailed", "BuildFailed"]);
    let html = render::module(&chrome(), &page).unwrap();
    assert!(html.contains("SignFailed"), "{html}");
    assert!(html.contains("&#60;b&#62;not bold"), "{html}");
    assert_escaped(&html);
}

#[test]
fn cluster_and_node_pages_show_each_nodes_modules_with_state_version_and_reason() {
    let fleet = two_clusters();
    let cluster = cluster_page(&fleet.view, "spoke2", None).unwrap();
    let session = cluster.session.as_ref().unwrap();
    assert!(session.connected);
    assert_eq!(session.kernels, ["6.1"]);
    let n1 = &session.nodes[0];
    assert_eq!((n1.name.as_str(), n1.failed, n1.loaded), ("n1", 1, 0));
    assert_eq!(n1.problems[0].reason, "LoadFailed");
    assert_escaped(&render::cluster(&chrome(), &cluster).unwrap());

    let node = node_page(&fleet.view, "spoke2", "n1").unwrap();
    assert_eq!(node.kernel, "6.1");
    let hello = &node.modules[0];
    assert_eq!(
        (hello.module.as_str(), hello.state, hello.reason.as_str()),
        ("hello", "failed", "LoadFailed")
    );
    assert!(hello.version.is_some(), "the version sent for kernel 6.1");
    let since = hello
        .since
        .as_deref()
        .expect("the hub stamps what it applies");
    assert!(since.ends_with(" UTC"), "{since}");
    assert_eq!(
        n1.changed.as_deref(),
        Some(since),
        "the node's latest change"
    );
    let html = render::node(&chrome(), &node).unwrap();
    assert!(html.contains(since), "{html}");
    assert_escaped(&html);
    assert!(node_page(&fleet.view, "spoke2", "n9").is_none());
}

#[test]
fn a_module_name_that_is_markup_is_escaped() {
    let mut fleet = Fleet::new();
    fleet.add_module(module("<script>x</script>").build());
    let html = render::fleet(&chrome(), &fleet_page(&fleet.view)).unwrap();
    assert!(
        html.contains("&#60;script&#62;x&#60;/script&#62;"),
        "{html}"
    );
    assert!(!html.contains("<script>x"), "{html}");
    assert!(
        html.contains("/modules/%3Cscript%3Ex%3C%2Fscript%3E"),
        "the link is URL-encoded: {html}"
    );
}

#[test]
fn no_page_renders_a_pull_credential() {
    let mut fleet = Fleet::new();
    fleet.add_pull_secret();
    fleet.add_cluster("spoke1");
    fleet.add_module(
        module("hello")
            .with("/spec/moduleSpec/imageRepoSecret/name", "pull")
            .build(),
    );
    let stream = fleet.connect("spoke1");
    fleet.report(
        "spoke1",
        &stream,
        &[("hello", "n1", ModuleState::Loaded, "", "")],
    );
    // The state holds the credential: the snapshot sent to the cluster carries it.
    let carried = match &*stream.1.borrow() {
        Outbound::Snapshot(snapshot) => format!("{:?}", snapshot.credentials),
        other => panic!("no snapshot: {other:?}"),
    };
    let token_bytes = format!("{:?}", TOKEN.as_bytes());
    let inner = &token_bytes[1..token_bytes.len() - 1];
    assert!(carried.contains(inner), "the snapshot carries the token");

    for (path, query) in [
        ("/", None),
        ("/modules/hello", None),
        ("/modules/hello", Some("state=loaded")),
        ("/clusters/spoke1", None),
        ("/clusters/spoke1/nodes/n1", None),
    ] {
        let (status, html) = page(&fleet, path, query);
        assert_eq!(status, StatusCode::OK, "{path}");
        assert!(!html.contains(TOKEN), "{path} renders the credential");
        assert!(!html.contains("auths"), "{path} renders the Docker config");
    }
}

#[test]
fn unknown_pages_are_not_found_and_bad_names_bad_requests() {
    let fleet = two_clusters();
    assert_eq!(page(&fleet, "/", None).0, StatusCode::OK);
    for path in [
        "/nope",
        "/modules/gone",
        "/clusters/gone",
        "/clusters/spoke1/nodes/gone",
    ] {
        assert_eq!(page(&fleet, path, None).0, StatusCode::NOT_FOUND, "{path}");
    }
    assert_eq!(
        page(&fleet, "/modules/Hello", None).0,
        StatusCode::BAD_REQUEST
    );
    let (status, html) = page(&fleet, "/modules/hello", Some("q=%3Cscript%3E"));
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert!(!html.contains("<script>"), "{html}");
}

#[test]
fn a_standby_says_so_and_names_the_leaders_pod() {
    let page = StandbyPage {
        lease: "kmm-hub/kmm-hub".into(),
        namespace: "kmm-hub".into(),
        leader: Some("kmm-hub-7d9f-x2".into()),
        port: 8090,
        lookup_error: None,
    };
    let html = render::standby(&chrome(), &page).unwrap();
    assert!(html.contains("This replica is the standby"), "{html}");
    assert!(
        html.contains("kubectl -n kmm-hub port-forward pod/kmm-hub-7d9f-x2 8090"),
        "{html}"
    );
}

#[test]
fn a_syncing_leader_says_its_pages_may_be_incomplete() {
    let stores = Stores {
        modules: store().0,
        clusters: Writer::<DynamicObject>::new(ocm::MANAGED_CLUSTER.api_resource()).as_reader(),
        secrets: store().0,
        revisions: store().0,
        preflights: store().0,
        decisions: Writer::<DynamicObject>::new(ocm::PLACEMENT_DECISION.api_resource()).as_reader(),
    };
    let view = FleetView::new(stores, Metrics::default());
    let Answer::Page(_, html) = leader_answer(&view, &chrome(), route("/", None)) else {
        panic!("not a page");
    };
    assert!(html.contains("still listing its watches"), "{html}");
}

#[tokio::test(start_paused = true)]
async fn live_pages_are_told_of_a_burst_of_changes_at_most_four_times_a_second() {
    let fleet = two_clusters();
    let (_role, role) = watch::channel(Role::Leading(fleet.view.clone()));
    let mut live = Live::new(role);
    let view = fleet.view.clone();
    let burst = tokio::spawn(async move {
        for _ in 0..200 {
            view.touched().add(["hello".to_owned()]);
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    });
    let start = tokio::time::Instant::now();
    let mut events = 0;
    while let Ok(true) = tokio::time::timeout_at(start + Duration::from_secs(1), live.next()).await
    {
        events += 1;
    }
    burst.abort();
    assert!((3..=5).contains(&events), "{events} events in a second");
}

#[tokio::test(start_paused = true)]
async fn a_lone_change_is_told_within_the_interval_and_so_is_a_new_leader() {
    let fleet = two_clusters();
    let (role_sender, role) = watch::channel(Role::Standby);
    let mut live = Live::new(role);
    role_sender.send_replace(Role::Leading(fleet.view.clone()));
    tokio::time::timeout(MIN_INTERVAL, live.next())
        .await
        .expect("a new leader is told");
    tokio::time::sleep(Duration::from_secs(5)).await;
    fleet.view.touched().add(["hello".to_owned()]);
    let told = tokio::time::Instant::now();
    assert!(live.next().await);
    assert!(told.elapsed() <= MIN_INTERVAL);
}
