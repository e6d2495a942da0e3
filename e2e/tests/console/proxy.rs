//! What one person can make the cluster's console do, both ways, against the
//! API server, with the chart's ServiceAccount (it may only impersonate):
//!
//! ```text
//!   X-Forwarded-Groups: staff,readers           ─▶ impersonates the user in both groups
//!   X-Forwarded-Groups: staff ⏎ …: readers       ─▶ 401 (a proxy that appends to the browser's header)
//!   a 5th namespace cookie / sign-in, 4 pages open ─▶ 429; one page closes ─▶ served
//!   who may list every namespace: one view, whatever cookie
//! ```

use std::time::{Duration, Instant};

use agentrun_e2e::support::scenario::{Scenario, sim_step};
use agentrun_e2e::{client_as, kubectl_ok};
use agentrun_operator::api::AgentRun;
use serde_json::json;

use super::PAGE_TIMEOUT;
use super::auth::{Answer, Stream, request};
use super::in_cluster::{ChartConsole, login_with};

const LO: [u8; 4] = [127, 0, 0, 1];

/// The chart's proxy-mode objects and a console as its ServiceAccount, with
/// `--auth` `modes`, trusting 127.0.0.1: the process and its port.
async fn proxy_console(
    ns: &str,
    modes: &str,
) -> (ChartConsole, agentrun_e2e::support::processes::Process, u16) {
    let chart = ChartConsole::install(
        ns,
        &[
            "--set",
            "console.auth.mode=proxy",
            "--set",
            "console.auth.proxy.trustedCIDRs={127.0.0.1/32}",
        ],
    )
    .await;
    let (process, port) = chart
        .start(ns, &["--auth", modes, "--trusted-proxy", "127.0.0.1/32"])
        .await;
    (chart, process, port)
}

/// `GET path` until it answers 200 with `want` in the page (RBAC takes a
/// moment to reach the authorizer's cache).
async fn until_served(port: u16, path: &str, headers: &str, want: &str) -> Answer {
    let deadline = Instant::now() + PAGE_TIMEOUT;
    loop {
        let a = request(LO, port, "GET", path, headers).await;
        if a.code == 200 && a.body.contains(want) {
            return a;
        }
        assert!(
            Instant::now() < deadline,
            "GET {path} with {headers:?}: HTTP {}\n{}",
            a.code,
            a.body
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
}

/// Dana may list the runs only through a group. Named in one group header,
/// comma-separated, she is served as a member of it; the same groups in two
/// headers (what a proxy that appends its header to the browser's sends) are
/// refused, on every route.
#[tokio::test]
async fn the_proxy_mode_console_refuses_a_repeated_group_header() {
    let s = Scenario::start_without_operator("console-groups").await;
    let ns = s.namespace().to_owned();
    s.create_run(
        "report",
        json!({"steps": [sim_step("fetch", "Idempotent", json!({}))]}),
    )
    .await;
    let readers = format!("readers-{ns}");
    kubectl_ok([
        "-n",
        &ns,
        "create",
        "role",
        "reader",
        "--verb=get,list,watch",
        "--resource=agentruns.agentrun.dev,approvals.agentrun.dev",
    ])
    .await;
    kubectl_ok([
        "-n",
        &ns,
        "create",
        "rolebinding",
        "readers",
        "--role=reader",
        &format!("--group={readers}"),
    ])
    .await;
    let (_chart, _process, port) = proxy_console(&ns, "proxy").await;
    let cookie = format!("Cookie: agentrun_namespace={ns}\r\n");

    let one = format!("X-Forwarded-User: dana\r\nX-Forwarded-Groups: staff, {readers}\r\n{cookie}");
    let page = until_served(port, "/", &one, r#"data-run="report""#).await;
    assert!(
        page.body.contains(r#"<strong id="whoami">dana</strong>"#),
        "{}",
        page.body
    );

    let decide = format!("/ns/{ns}/approvals/nope/decide");
    for (case, groups) in [
        (
            "two group headers",
            format!("X-Forwarded-Groups: staff\r\nX-Forwarded-Groups: {readers}\r\n"),
        ),
        (
            "an empty one and another",
            format!("X-Forwarded-Groups: \r\nX-Forwarded-Groups: {readers}\r\n"),
        ),
    ] {
        let headers = format!("HX-Request: true\r\nX-Forwarded-User: dana\r\n{groups}{cookie}");
        for (method, path) in [
            ("GET", "/"),
            ("GET", "/events/runs"),
            ("POST", decide.as_str()),
        ] {
            let a = request(LO, port, method, path, &headers).await;
            assert!(
                a.code == 401 && a.body.contains("group header is repeated"),
                "{case}: {method} {path}: HTTP {}\n{}",
                a.code,
                a.body
            );
            assert!(!a.body.contains("data-run="), "{case}: {}", a.body);
        }
    }
    s.finish().await;
}

/// Erin, named by the proxy, opens pages in four namespaces (a cookie each);
/// a fifth namespace is refused with `429` while those four stream, and
/// served once one of them closes. The reader ServiceAccount, signing in
/// again and again, is bound the same way. Frank, who may list every
/// namespace, is served one view whatever namespace cookie he sends.
#[tokio::test]
async fn one_user_holds_at_most_four_views_whatever_cookies_they_send() {
    let s = Scenario::start_without_operator("console-views").await;
    let ns = s.namespace().to_owned();
    s.create_run(
        "report",
        json!({"steps": [sim_step("fetch", "Idempotent", json!({}))]}),
    )
    .await;
    let suffix = ns.rsplit('-').next().expect("a suffix").to_owned();
    let everywhere = format!("console-views-all-{suffix}");
    kubectl_ok([
        "create",
        "clusterrole",
        &everywhere,
        "--verb=get,list,watch",
        "--resource=agentruns.agentrun.dev,approvals.agentrun.dev",
    ])
    .await;
    kubectl_ok([
        "create",
        "clusterrolebinding",
        &everywhere,
        &format!("--clusterrole={everywhere}"),
        &format!("--user=frank-{suffix}"),
    ])
    .await;
    kubectl_ok(["-n", &ns, "create", "serviceaccount", "reader"]).await;
    let token = kubectl_ok(["-n", &ns, "create", "token", "reader"]).await;
    let (_chart, process, port) = proxy_console(&ns, "proxy,token").await;
    let as_erin = |namespace: &str| {
        format!("X-Forwarded-User: erin\r\nCookie: agentrun_namespace={namespace}\r\n")
    };

    // Four namespaces, each page streaming: four views.
    let mut open = Vec::new();
    for n in 0..4 {
        let mut live = Stream::open(port, "/events/runs", &as_erin(&format!("{ns}-{n}"))).await;
        live.until("event: runs", PAGE_TIMEOUT).await;
        open.push(live);
    }
    let fifth = as_erin(&format!("{ns}-4"));
    for path in ["/", "/events/runs"] {
        let a = request(LO, port, "GET", path, &fifth).await;
        assert!(
            a.code == 429 && a.body.contains("You have 4 views of the cluster open"),
            "a fifth namespace, {path}: HTTP {}\n{}",
            a.code,
            a.body
        );
    }
    // Another person is not held back by erin's views.
    request_ok(
        port,
        &format!("X-Forwarded-User: grace\r\nCookie: agentrun_namespace={ns}-4\r\n"),
    )
    .await;
    // One page closes: its view goes, and the fifth namespace is served
    // (the console sees the stream closed at its next keep-alive).
    drop(open.remove(0));
    let served = until_code(port, &fifth, 200, Duration::from_secs(40)).await;
    assert!(served.body.contains(r#"<strong id="whoami">erin</strong>"#));

    // Signing in again and again opens sessions, not more views.
    let origin = format!("Origin: http://127.0.0.1:{port}\r\n");
    let mut sessions = Vec::new();
    for _ in 0..5 {
        let ok = login_with(port, token.trim(), &origin).await;
        assert_eq!(ok.code, 303, "{}\n{}", ok.head, ok.body);
        let id = ok
            .head
            .split("set-cookie: agentrun_session=")
            .nth(1)
            .and_then(|rest| rest.split(';').next())
            .expect("a session cookie")
            .to_owned();
        sessions.push(format!("Cookie: agentrun_session={id}\r\n"));
    }
    for cookie in &sessions[..4] {
        let mut live = Stream::open(port, "/events/runs", cookie).await;
        live.until("event: runs", PAGE_TIMEOUT).await;
        open.push(live);
    }
    let a = request(LO, port, "GET", "/", &sessions[4]).await;
    assert_eq!(a.code, 429, "a fifth sign-in's view: {}", a.body);

    // Frank may list every namespace (once RBAC says so to the authorizer,
    // before his first page): one view, whatever he chose.
    let frank = format!("frank-{suffix}");
    let his = kube::Api::<AgentRun>::all(client_as(&frank).await);
    let deadline = Instant::now() + PAGE_TIMEOUT;
    while his.list(&Default::default()).await.is_err() {
        assert!(
            Instant::now() < deadline,
            "frank may not list every namespace yet"
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    let as_frank = |namespace: &str| {
        format!("X-Forwarded-User: {frank}\r\nCookie: agentrun_namespace={namespace}\r\n")
    };
    until_served(port, "/", &as_frank("a"), r#"data-run="report""#).await;
    for n in 0..8 {
        let mut live = Stream::open(port, "/events/runs", &as_frank(&format!("{ns}-{n}"))).await;
        live.until(r#"data-run="report""#, PAGE_TIMEOUT).await;
        open.push(live);
    }
    let log = std::fs::read_to_string(process.log_path()).expect("the console's log");
    let made = log
        .lines()
        .filter(|l| *l == format!("console: serving {frank} (as themselves)"))
        .count();
    assert_eq!(made, 1, "frank's views:\n{log}");

    drop(open);
    kubectl_ok(["delete", "clusterrolebinding,clusterrole", &everywhere]).await;
    s.finish().await;
}

async fn request_ok(port: u16, headers: &str) {
    let a = request(LO, port, "GET", "/", headers).await;
    assert_eq!(a.code, 200, "{headers:?}: {}", a.body);
}

/// `GET /` with `headers` until it answers `code`.
async fn until_code(port: u16, headers: &str, code: u16, timeout: Duration) -> Answer {
    let deadline = Instant::now() + timeout;
    loop {
        let a = request(LO, port, "GET", "/", headers).await;
        if a.code == code {
            return a;
        }
        assert!(
            Instant::now() < deadline,
            "no HTTP {code} within {timeout:?}: HTTP {}\n{}",
            a.code,
            a.body
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}
