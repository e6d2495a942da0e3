//! `kubectl agentrun console` in headless Chromium (chromedriver, WebDriver)
//! against a real operator and simulated kubelet on the plane: the runs
//! table is live, the timeline shows what happened to each attempt, and a
//! decision in the inbox is the API server's to take or refuse, as the
//! impersonated user.
//!
//! ```text
//!   test ──WebDriver──▶ chromedriver ──▶ chromium --headless=new
//!                                            │ HTTP + SSE
//!                                            ▼
//!        kubectl-agentrun --as alice -n NS console --port P ──▶ kube-apiserver (+ policies)
//! ```
//!
//! Needs `chromium` and `chromedriver` on PATH (`e2e/cluster browser` installs
//! them) and fails, never skips, without them. With
//! `AGENTRUN_CONSOLE_SCREENSHOTS=DIR` the tests write the screenshots in
//! docs/images there. The History pages' test is in `console/history.rs`; who
//! the local console serves (the printed token) in `console/auth.rs`; the
//! cluster's sign-in modes in `console/in_cluster.rs`, and what one person
//! can make it do (group headers, views) in `console/proxy.rs`; the console process,
//! raw HTTP and Chromium in `console/harness.rs`.

#[path = "console/auth.rs"]
mod auth;
#[path = "console/harness.rs"]
mod harness;
#[path = "console/history.rs"]
mod history;
#[path = "console/in_cluster.rs"]
mod in_cluster;
#[path = "console/live.rs"]
mod live;
#[path = "console/proxy.rs"]
mod proxy;
#[path = "console/retry.rs"]
mod retry;

use std::time::{Duration, Instant};

use agentrun_e2e::client_as;
use agentrun_e2e::support::policies::Policies;
use agentrun_e2e::support::scenario::{Scenario, phase, sim_step, status};
use agentrun_operator::api::{Approval, ApprovalPhase, RunPhase, StepPhase};
use fantoccini::Locator;
use kube::api::{EvictParams, Patch, PatchParams};
use serde_json::{Value, json};

use harness::{Browser, browser, console, console_with, gated, post, raw, started};

const RUN_TIMEOUT: Duration = Duration::from_secs(90);
const PAGE_TIMEOUT: Duration = Duration::from_secs(20);

/// The runs table shows a new run soon after its creation (2 s on a quiet
/// machine), without a reload: the Server-Sent Events stream from the
/// watch brings it.
#[tokio::test]
async fn runs_table_shows_a_new_run_without_reload() {
    let s = Scenario::start("console-live").await;
    let ns = s.namespace().to_owned();
    let c = console(&ns, None).await;
    let b = browser(&ns).await;
    s.create_run(
        "earlier",
        json!({"steps": [sim_step("fetch", "Idempotent", json!({}))]}),
    )
    .await;
    b.goto(&c.at("")).await;
    b.wait_js(
        "the earlier run's row",
        PAGE_TIMEOUT,
        "return document.querySelector('tr[data-run=\"earlier\"]') !== null",
    )
    .await;
    // The page is open and connected; from here on nothing reloads it.
    b.client
        .execute(
            "window.__loadedOnce = performance.timeOrigin; return true",
            vec![],
        )
        .await
        .unwrap();
    b.wait_js("the live stream connected", PAGE_TIMEOUT,
        "const e = document.getElementById('runs'); return e && e.getAttribute('data-live') === 'open'").await;
    let created = Instant::now();
    s.create_run(
        "fresh",
        json!({"steps": [
            sim_step("plan", "None", json!({"runMs": 3000})),
            sim_step("act", "Idempotent", json!({})),
        ]}),
    )
    .await;
    // What is proven here is that the stream brings the row without a
    // reload; the 2 s is the target on a quiet machine (docs/console.md). On
    // the shared 2-core CI machine a build beside the browser delays it by
    // seconds, so the bound is 10 s and the time is printed.
    b.wait_js(
        "the new run's row",
        Duration::from_secs(10),
        "return document.querySelector('tr[data-run=\"fresh\"]') !== null",
    )
    .await;
    let took = created.elapsed();
    println!("the new run's row showed {took:?} after its creation");
    assert!(
        took < Duration::from_secs(10),
        "the new run showed after {took:?}"
    );
    let same_page = b
        .client
        .execute(
            "return window.__loadedOnce === performance.timeOrigin",
            vec![],
        )
        .await
        .unwrap();
    assert_eq!(same_page, Value::Bool(true), "the page was reloaded");
    // Its row follows the run: the phase cell moves on without a reload too.
    b.wait_js("the new run running", RUN_TIMEOUT,
        "const r = document.querySelector('tr[data-run=\"fresh\"]'); return r && /Running|Succeeded/.test(r.innerText)").await;
    // The other columns, live too: tokens against the budget, what a run
    // waits for and who may decide it, a failed run.
    s.create_run("summarise", json!({"budget": {"tokens": 5000}, "steps": [
        sim_step("read", "None", json!({"tokens": {"input": 1200, "output": 300}, "result": {"pages": 4}})),
    ]}))
    .await;
    let mut gate = sim_step("refund", "NonIdempotent", json!({}));
    gate["approval"] = json!({"question": "Refund order 4711?"});
    s.create_run("refund", json!({"steps": [gate]})).await;
    s.create_run(
        "charge",
        json!({"steps": [
            {"name": "charge", "effect": "Idempotent", "retry": {"limit": 0},
             "container": {"image": "registry.example/pay:1", "env": [{"name": "SIM_STEP",
                "value": json!({"exitCode": 3}).to_string()}]}},
        ]}),
    )
    .await;
    let row = |run: &str, want: &str| {
        format!(
            "const r = document.querySelector('tr[data-run=\"{run}\"]'); return r && r.innerText.includes('{want}') && r.innerText"
        )
    };
    for (run, want) in [
        ("summarise", "1500/5000"),
        ("refund", "approval (anyone)"),
        ("charge", "Failed"),
    ] {
        b.wait_js(
            &format!("run {run} showing {want}"),
            RUN_TIMEOUT,
            &row(run, want),
        )
        .await;
    }
    b.screenshot("console-runs.png").await;
    // `?` opens the help overlay from the keyboard.
    b.client
        .find(Locator::Css("body"))
        .await
        .unwrap()
        .send_keys("?")
        .await
        .unwrap();
    b.wait_js(
        "the help overlay",
        PAGE_TIMEOUT,
        "return document.getElementById('help').open",
    )
    .await;
    // A filter is a link: phase=Succeeded shows only finished runs.
    s.wait_finished("earlier", RUN_TIMEOUT).await;
    b.goto(&c.at("?phase=Succeeded")).await;
    b.wait_js("the filtered table", PAGE_TIMEOUT,
        "return document.querySelector('tr[data-run=\"earlier\"]') !== null && document.querySelector('tr[data-run=\"fresh\"]') === null").await;
    b.close().await;
    s.finish().await;
}

/// The timeline of a step whose Pod was evicted and that ran again shows
/// both attempts on one axis, the first drawn as disrupted.
#[tokio::test]
async fn timeline_of_an_evicted_and_rerun_step_shows_two_attempts_the_first_disrupted() {
    let s = Scenario::start("console-timeline").await;
    let ns = s.namespace().to_owned();
    let spec = json!({"steps": [
        sim_step("search", "None", json!({"result": {"hits": 3}})),
        {"name": "crawl", "effect": "Idempotent", "retry": {"limit": 0}, "freshFor": "10m",
         "container": {"image": "registry.example/crawler:1", "env": [{"name": "SIM_STEP",
            "value": json!({"attempts": [{"runMs": 30000}, {"runMs": 1500, "result": {"pages": 12}}]}).to_string()}]}},
    ]});
    s.create_run("crawl", spec).await;
    let (_, pod) = s.wait_step_running("crawl", "crawl", RUN_TIMEOUT).await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    s.pods()
        .evict(&pod, &EvictParams::default())
        .await
        .expect("eviction accepted");
    let done = s.wait_finished("crawl", RUN_TIMEOUT).await;
    assert_eq!(phase(&done), Some(RunPhase::Succeeded));
    let c = console(&ns, None).await;
    let b = browser(&ns).await;
    b.goto(&c.at(&format!("ns/{ns}/runs/crawl"))).await;
    let lanes = b
        .wait_js(
            "the timeline's lanes",
            PAGE_TIMEOUT,
            r#"
            const lanes = [...document.querySelectorAll('svg.timeline g.lane')];
            if (lanes.length < 2) return null;
            return lanes.map(g => ({
                label: g.querySelector('.lane-label').textContent,
                bars: [...g.querySelectorAll('rect.bar')].map(r => ({
                    kind: r.getAttribute('data-kind'),
                    x: parseFloat(r.getAttribute('x')),
                    w: parseFloat(r.getAttribute('width')),
                    title: r.querySelector('title').textContent,
                })),
                fresh: g.querySelector('rect.fresh') !== null,
            }));"#,
        )
        .await;
    let crawl = lanes
        .as_array()
        .unwrap()
        .iter()
        .find(|l| l["label"] == "crawl r1")
        .unwrap_or_else(|| panic!("no lane for crawl: {lanes:#}"));
    let bars = crawl["bars"].as_array().unwrap();
    let kinds: Vec<&str> = bars.iter().map(|b| b["kind"].as_str().unwrap()).collect();
    if kinds != ["disrupted", "succeeded"] {
        let events = agentrun_e2e::kubectl([
            "-n",
            &ns,
            "get",
            "events.events.k8s.io",
            "-o",
            "custom-columns=TIME:.eventTime,REASON:.reason,NOTE:.note",
        ])
        .await;
        eprintln!("the run's Events:\n{}", events.stdout);
    }
    assert_eq!(kinds, ["disrupted", "succeeded"], "{crawl:#}");
    assert!(
        bars[0]["title"]
            .as_str()
            .unwrap()
            .contains("attempt 1 disrupted"),
        "{crawl:#}"
    );
    assert!(
        bars[1]["title"]
            .as_str()
            .unwrap()
            .contains("attempt 2 succeeded"),
        "{crawl:#}"
    );
    let end_of_first = bars[0]["x"].as_f64().unwrap() + bars[0]["w"].as_f64().unwrap();
    assert!(
        end_of_first <= bars[1]["x"].as_f64().unwrap() + 0.5,
        "attempt 2 starts after attempt 1 ends, on one axis: {crawl:#}"
    );
    assert_eq!(
        crawl["fresh"], true,
        "freshFor shades the freshness window: {crawl:#}"
    );
    // The step table says the same: attempt 2, one disruption, and the result.
    let row = b
        .wait_js("the step table", PAGE_TIMEOUT,
            "const r = document.querySelector('table.steps tr[data-step=\"crawl\"]'); return r && r.innerText")
        .await;
    let row = row.as_str().unwrap();
    assert!(
        row.contains("2 (1 disrupted)") && row.contains("Succeeded"),
        "{row}"
    );
    b.wait_js("the disruption Event", PAGE_TIMEOUT,
        "return [...document.querySelectorAll('table.events td')].some(td => td.textContent === 'StepDisrupted')").await;
    b.screenshot("console-run.png").await;
    b.close().await;
    s.finish().await;
}

/// Approving in the inbox (the console started as alice) releases the step,
/// and the decider the run page shows is alice, as the API server recorded.
#[tokio::test]
async fn approving_in_the_inbox_releases_the_step_as_the_impersonated_user() {
    let s = Scenario::start("console-approve").await;
    let ns = s.namespace().to_owned();
    let _policies = Policies::with_approvers(&ns, &["alice", "mallory"]).await;
    s.create_run("refund", json!({"steps": [sim_step("lookup", "None", json!({"result": {"order": 42}})), gated("refund")]}))
        .await;
    let apv = s.approval_of("refund", None, RUN_TIMEOUT).await;
    let c = console(&ns, Some("alice")).await;
    let b = browser(&ns).await;
    b.goto(&c.at("approvals")).await;
    let card = format!("article[data-approval=\"{apv}\"]");
    let you = b
        .wait_js("the approval in the inbox", PAGE_TIMEOUT,
            &format!("const a = document.querySelector('{card}'); return a && a.querySelector('dd.you').textContent"))
        .await;
    assert_eq!(you, "may decide");
    assert_eq!(
        b.client
            .find(Locator::Id("whoami"))
            .await
            .unwrap()
            .text()
            .await
            .unwrap(),
        "alice"
    );
    b.screenshot("console-inbox.png").await;
    let article = b.client.find(Locator::Css(&card)).await.unwrap();
    article
        .find(Locator::Css("textarea[name=comment]"))
        .await
        .unwrap()
        .send_keys("checked in the console")
        .await
        .unwrap();
    article
        .find(Locator::Css("button[value=Approved]"))
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
    let said = b
        .wait_js("the decision's outcome", PAGE_TIMEOUT,
            &format!("const p = document.querySelector('#decisions [data-approval=\"{apv}\"]'); return p && (p.classList.contains('ok') ? 'ok' : p.className) + ': ' + p.textContent"))
        .await;
    assert_eq!(said, format!("ok: approval {apv}: Approved by alice"));
    let done = s.wait_finished("refund", RUN_TIMEOUT).await;
    assert_eq!(phase(&done), Some(RunPhase::Succeeded));
    let refund = status(&done)
        .steps
        .into_iter()
        .find(|c| c.name == "refund")
        .unwrap();
    assert_eq!(
        (refund.phase, refund.decided_by.as_deref()),
        (StepPhase::Succeeded, Some("alice"))
    );
    let a = s.approvals().get(&apv).await.unwrap();
    assert_eq!(a.spec.decided_by.as_deref(), Some("alice"));
    assert_eq!(a.spec.comment.as_deref(), Some("checked in the console"));
    // The inbox empties by itself; the run page names the decider.
    b.wait_js(
        "the inbox emptied",
        PAGE_TIMEOUT,
        &format!("return document.querySelector('{card}') === null"),
    )
    .await;
    b.goto(&c.at(&format!("ns/{ns}/runs/refund"))).await;
    let decider = b
        .wait_js("the decider", PAGE_TIMEOUT,
            &format!("const e = document.querySelector('li[data-approval=\"{apv}\"] .decider'); return e && e.textContent"))
        .await;
    assert_eq!(decider, "alice");
    b.wait_js("the approval bar naming alice", PAGE_TIMEOUT,
        "return [...document.querySelectorAll('svg.timeline rect.bar-approval title')].some(t => t.textContent.includes('approval: Approved by alice'))").await;
    b.close().await;
    s.finish().await;
}

/// A NonIdempotent step whose Pod vanished mid-run asks what it did; Retry
/// in the inbox (with the key and the interrupted Pod shown) runs it again
/// with the same idempotency key.
#[tokio::test]
async fn retry_in_the_inbox_answers_a_reconcile_question_and_reruns_with_the_same_key() {
    let s = Scenario::start("console-reconcile").await;
    let ns = s.namespace().to_owned();
    let pay = json!({"name": "pay", "effect": "NonIdempotent",
        "container": {"image": "registry.example/pay:1", "env": [{"name": "SIM_STEP",
            "value": json!({"attempts": [{"runMs": 30000}, {"runMs": 50, "result": {"paid": true}}]}).to_string()}]}});
    s.create_run("pay", json!({"steps": [pay]})).await;
    let (running, pod) = s.wait_step_running("pay", "pay", RUN_TIMEOUT).await;
    let key = status(&running).steps[0].idempotency_key.clone();
    s.pods()
        .delete(&pod, &Default::default())
        .await
        .expect("deleting the step Pod");
    let apv = s.approval_of("pay", None, RUN_TIMEOUT).await;
    let c = console(&ns, None).await;
    let b = browser(&ns).await;
    b.goto(&c.at("approvals")).await;
    let card = format!("article[data-approval=\"{apv}\"]");
    let text = b
        .wait_js(
            "the Reconcile question in the inbox",
            PAGE_TIMEOUT,
            &format!("const a = document.querySelector('{card}'); return a && a.innerText"),
        )
        .await;
    let text = text.as_str().unwrap();
    assert!(
        text.contains("Reconcile") && text.contains(&key) && text.contains(&pod),
        "the key and the interrupted Pod are shown: {text}"
    );
    let buttons = b
        .client
        .execute(
            &format!(
                "return [...document.querySelectorAll('{card} button')].map(b => b.textContent)"
            ),
            vec![],
        )
        .await
        .unwrap();
    assert_eq!(buttons, json!(["Retry", "Mark succeeded", "Mark failed"]));
    b.client
        .find(Locator::Css(&format!("{card} button[value=Retry]")))
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
    let done = s.wait_finished("pay", RUN_TIMEOUT).await;
    assert_eq!(phase(&done), Some(RunPhase::Succeeded));
    let after = status(&done).steps[0].clone();
    assert_eq!(
        (after.attempt, after.idempotency_key.as_str()),
        (2, key.as_str())
    );
    assert_eq!(s.ledger().executions_by_key().get(&key), Some(&2));
    b.close().await;
    s.finish().await;
}

/// A non-approver (the console started as mallory) may press Approve; the
/// API server refuses, and the page shows its refusal word for word.
#[tokio::test]
async fn a_non_approver_sees_the_api_servers_refusal_verbatim() {
    let s = Scenario::start("console-refused").await;
    let ns = s.namespace().to_owned();
    let _policies = Policies::with_approvers(&ns, &["alice", "mallory"]).await;
    s.create_run("refund", json!({"steps": [gated("refund")]}))
        .await;
    let apv = s.approval_of("refund", None, RUN_TIMEOUT).await;
    // What the API server says to mallory, asked directly (a dry run).
    let as_mallory: kube::Api<Approval> = kube::Api::namespaced(client_as("mallory").await, &ns);
    let patch = json!({"spec": {"decision": "Approved", "decidedBy": "mallory", "decidedByGroups": ["system:authenticated"]}});
    let refusal = match as_mallory
        .patch(
            &apv,
            &PatchParams {
                dry_run: true,
                ..Default::default()
            },
            &Patch::Merge(&patch),
        )
        .await
    {
        Err(kube::Error::Api(s)) => s.message,
        other => panic!("the API server should refuse mallory: {other:?}"),
    };
    assert!(refusal.contains("mallory is not an approver"), "{refusal}");
    let c = console(&ns, Some("mallory")).await;
    let b = browser(&ns).await;
    b.goto(&c.at("approvals")).await;
    let card = format!("article[data-approval=\"{apv}\"]");
    b.wait_js(
        "the approval in the inbox",
        PAGE_TIMEOUT,
        &format!("return document.querySelector('{card}') !== null"),
    )
    .await;
    b.client
        .find(Locator::Css(&format!("{card} button[value=Approved]")))
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
    let shown = b
        .wait_js("the refusal", PAGE_TIMEOUT,
            &format!("const p = document.querySelector('#decisions .refused[data-approval=\"{apv}\"] .message'); return p && p.textContent"))
        .await;
    let shown = shown.as_str().unwrap();
    assert_eq!(
        shown,
        format!("deciding approval {apv}: {refusal}"),
        "the API server's words, unchanged"
    );
    // Another page in the browser cannot decide as the user: a write must be
    // the console's own htmx request, to the console's own address.
    let decide = format!("/ns/{ns}/approvals/{apv}/decide");
    let host = format!("Host: 127.0.0.1:{}\r\n", c.port);
    let cases = [
        (
            "a plain cross-site form post",
            format!("{host}Origin: http://evil.example\r\n"),
            403,
        ),
        ("no htmx header", host.clone(), 403),
        (
            "htmx, but from another origin",
            format!("{host}HX-Request: true\r\nOrigin: http://evil.example\r\n"),
            403,
        ),
        (
            "another host name (DNS rebinding)",
            "Host: evil.example\r\nHX-Request: true\r\n".into(),
            421,
        ),
    ];
    for (case, headers, want) in cases {
        assert_eq!(post(c.port, &decide, &headers).await, want, "{case}");
    }
    // The read-only view offers no decision and has no route for one.
    let ro = console_with(&ns, Some("mallory"), &["-n", &ns, "--read-only"]).await;
    let inbox = ro.get_ok("/approvals").await;
    assert!(
        inbox.contains(&apv)
            && !inbox.contains("hx-post")
            && inbox.contains("This console is read-only"),
        "{inbox}"
    );
    let host = format!(
        "Host: 127.0.0.1:{}\r\nHX-Request: true\r\n{}",
        ro.port,
        ro.cookie()
    );
    assert_eq!(
        post(ro.port, &decide, &host).await,
        404,
        "the read-only console has no write route"
    );
    let a = s.approvals().get(&apv).await.unwrap();
    assert_eq!(a.spec.decision, None);
    assert_eq!(a.status.unwrap_or_default().phase, ApprovalPhase::Pending);
    b.close().await;
    s.finish().await;
}

/// A raw HTTP/1.0 GET to the console: the status line and headers.
async fn get_head(port: u16, path: &str, host: &str, extra: &str) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .expect("connecting to the console");
    let req = format!("GET {path} HTTP/1.0\r\nHost: {host}\r\n{extra}Connection: close\r\n\r\n");
    s.write_all(req.as_bytes()).await.unwrap();
    let mut buf = Vec::new();
    s.read_to_end(&mut buf).await.unwrap();
    let text = String::from_utf8_lossy(&buf).to_string();
    text.split("\r\n\r\n")
        .next()
        .unwrap_or_default()
        .to_ascii_lowercase()
}

/// Every response — a page, an asset, a refusal — forbids framing (CSP
/// frame-ancestors 'none' and X-Frame-Options DENY), and a page on another
/// origin that frames the console shows nothing of it in Chromium.
#[tokio::test]
async fn no_page_may_frame_the_console() {
    let s = Scenario::start("console-frame").await;
    let ns = s.namespace().to_owned();
    let c = console(&ns, None).await;
    let host = format!("127.0.0.1:{}", c.port);
    let cookie = c.cookie();
    for (path, host, extra, status) in [
        ("/", host.as_str(), cookie.as_str(), "200"),
        ("/assets/console.css", host.as_str(), "", "200"),
        ("/approvals", host.as_str(), "", "401"),
        ("/approvals", "evil.example", cookie.as_str(), "421"),
    ] {
        let head = get_head(c.port, path, host, extra).await;
        assert!(
            head.starts_with(&format!("http/1.0 {status}"))
                || head.starts_with(&format!("http/1.1 {status}")),
            "{path}: {head}"
        );
        assert!(
            head.contains("content-security-policy: default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; form-action 'self'; base-uri 'none'; frame-ancestors 'none'"),
            "{path}: {head}"
        );
        assert!(head.contains("x-frame-options: deny"), "{path}: {head}");
    }
    // A page on another origin (localhost is not 127.0.0.1 to the browser)
    // that frames the console.
    let framer = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let framer_port = framer.local_addr().unwrap().port();
    let page = format!(
        "<!doctype html><title>framer</title><iframe id=f width=800 height=600 src='http://127.0.0.1:{}/approvals'></iframe>",
        c.port
    );
    tokio::spawn(async move {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        loop {
            let Ok((mut conn, _)) = framer.accept().await else {
                continue;
            };
            let mut buf = [0u8; 4096];
            let _ = conn.read(&mut buf).await;
            let res = format!(
                "HTTP/1.1 200 OK\r\ncontent-type: text/html\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{page}",
                page.len()
            );
            let _ = conn.write_all(res.as_bytes()).await;
        }
    });
    let b = browser(&ns).await;
    b.goto(&format!("http://localhost:{framer_port}/")).await;
    b.wait_js(
        "the framing page",
        PAGE_TIMEOUT,
        "return document.getElementById('f') !== null",
    )
    .await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    b.client.enter_frame(0).await.expect("entering the frame");
    let inside = b
        .client
        .execute(
            "return [document.title, document.querySelector('main') !== null, document.body ? document.body.innerText : '']",
            vec![],
        )
        .await
        .unwrap();
    assert_eq!(
        inside[1],
        Value::Bool(false),
        "the console rendered inside the frame: {inside}"
    );
    assert!(
        !inside[0]
            .as_str()
            .unwrap_or_default()
            .contains("agentrun console"),
        "the console rendered inside the frame: {inside}"
    );
    b.close().await;
    s.finish().await;
}
