//! A run's page follows the run live in headless Chromium: opened while the
//! run waits before a step, the step's row, its timeline lane and the run's
//! phase move through Running to Succeeded without a reload, each within
//! [`BOUND`] of the API server showing the change. What moves them is the
//! page's Server-Sent Events stream `/events/ns/NS/runs/RUN`: every change
//! seen arrived as one of its messages, the page made no request of its own,
//! and a marker set in the page survives.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use agentrun_e2e::support::scenario::{Scenario, sim_step};
use agentrun_operator::api::{AgentRun, RunPhase, StepPhase};
use serde_json::{Value, json};

use super::{PAGE_TIMEOUT, RUN_TIMEOUT, browser, console};

/// How long after the API server shows a change the page may show it.
const BOUND: Duration = Duration::from_secs(5);

/// What the test compares: the `fetch` step's phase and the run's phase.
fn api_view(run: &AgentRun) -> Vec<String> {
    let st = run.status.clone().unwrap_or_default();
    let step = st
        .steps
        .iter()
        .rfind(|c| c.name == "fetch")
        .map(|c| c.phase);
    let mut seen = Vec::new();
    if step == Some(StepPhase::Running) {
        seen.push("step Running".to_owned());
    }
    if step == Some(StepPhase::Succeeded) {
        seen.push("step Succeeded".to_owned());
    }
    match st.phase {
        Some(RunPhase::Running) => seen.push("run Running".to_owned()),
        Some(RunPhase::Succeeded) => seen.push("run Succeeded".to_owned()),
        _ => {}
    }
    seen
}

/// The page's view of the same, as the JavaScript below reports it.
const PAGE_VIEW: &str = r#"
    const row = document.querySelector('#run tr[data-step="fetch"] td[data-label="Phase"]');
    const run = document.querySelector('#run h1 .phase');
    const lane = [...document.querySelectorAll('#run svg.timeline g.lane')]
        .find(g => g.querySelector('.lane-label').textContent.startsWith('fetch'));
    const bars = lane ? [...lane.querySelectorAll('rect.bar')].map(r => r.getAttribute('data-kind')) : [];
    return {step: row ? row.textContent : null, run: run ? run.textContent : null,
            bar: bars.length ? bars[bars.length - 1] : null,
            marker: window.__marker === 1};
"#;

fn page_view(v: &Value) -> Vec<String> {
    let mut seen = Vec::new();
    for (what, key) in [("step", "step"), ("run", "run"), ("bar", "bar")] {
        if let Some(s) = v[key].as_str() {
            seen.push(format!("{what} {s}"));
        }
    }
    seen
}

#[tokio::test]
async fn the_run_page_follows_a_step_through_running_to_succeeded_without_reload() {
    let s = Scenario::start("console-live-run").await;
    let ns = s.namespace().to_owned();
    // `fetch` waits for an approval: the run is pending that step for as
    // long as the test needs to open the page.
    let mut fetch = sim_step(
        "fetch",
        "Idempotent",
        json!({"runMs": 3000, "result": {"pages": 3}}),
    );
    fetch["approval"] = json!({"question": "Fetch the pages?"});
    s.create_run("crawl", json!({"steps": [fetch]})).await;
    let apv = s.approval_of("crawl", Some("fetch"), RUN_TIMEOUT).await;

    let c = console(&ns, None).await;
    let b = browser(&ns).await;
    b.goto(&c.at(&format!("ns/{ns}/runs/crawl"))).await;
    b.wait_js(
        "the run's stream connected",
        PAGE_TIMEOUT,
        "const e = document.getElementById('run'); return e && e.getAttribute('data-live') === 'open'",
    )
    .await;
    let stream = b
        .client
        .execute(
            "return document.getElementById('run').getAttribute('sse-connect')",
            vec![],
        )
        .await
        .unwrap();
    assert_eq!(stream, format!("/events/ns/{ns}/runs/crawl"));
    // The marker, and a log of what the stream brings and of any request
    // the page makes itself.
    b.client
        .execute(
            r#"window.__marker = 1; window.__messages = []; window.__requests = 0;
            document.body.addEventListener('htmx:sseMessage', e => {
                const row = document.querySelector('#run tr[data-step="fetch"] td[data-label="Phase"]');
                window.__messages.push({event: e.detail.type, url: e.detail.target ? e.detail.target.url : null,
                                        step: row ? row.textContent : null});
            });
            document.body.addEventListener('htmx:beforeRequest', () => window.__requests++);
            return true"#,
            vec![],
        )
        .await
        .unwrap();
    let before = page_view(&b.client.execute(PAGE_VIEW, vec![]).await.unwrap());
    assert_eq!(
        before,
        [
            "step WaitingForApproval",
            "run WaitingForApproval",
            "bar approval"
        ],
        "the page opened on the pending step"
    );

    // The API server's view, read every 50 ms: when each change first showed.
    let api_seen: Arc<Mutex<BTreeMap<String, Instant>>> = Arc::default();
    let watcher = {
        let (runs, seen) = (s.runs(), api_seen.clone());
        tokio::spawn(async move {
            let deadline = Instant::now() + RUN_TIMEOUT;
            while Instant::now() < deadline {
                if let Ok(r) = runs.get("crawl").await {
                    let now = Instant::now();
                    let mut m = seen.lock().unwrap();
                    for v in api_view(&r) {
                        m.entry(v).or_insert(now);
                    }
                    if m.contains_key("run Succeeded") {
                        return;
                    }
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        })
    };
    s.decide(&apv, "Approved", "fetch them").await;

    // The page's view, read every 50 ms until the run succeeded there, and
    // no longer than the bound after every change the API server showed.
    let mut page_seen: BTreeMap<String, Instant> = BTreeMap::new();
    let deadline = Instant::now() + RUN_TIMEOUT;
    let last = loop {
        let v = b.client.execute(PAGE_VIEW, vec![]).await.unwrap();
        let now = Instant::now();
        for k in page_view(&v) {
            page_seen.entry(k).or_insert(now);
        }
        if page_seen.contains_key("run Succeeded") && page_seen.contains_key("step Succeeded") {
            break v;
        }
        let late: Vec<String> = api_seen
            .lock()
            .unwrap()
            .iter()
            .filter(|(change, at)| !page_seen.contains_key(*change) && now > **at + BOUND)
            .map(|(change, at)| format!("{change} (the API server showed it {:?} ago)", now - *at))
            .collect();
        assert!(
            late.is_empty(),
            "the page did not show {late:?} within {BOUND:?}; it showed {page_seen:?}"
        );
        assert!(
            now < deadline,
            "the run did not succeed within {RUN_TIMEOUT:?}; the page showed {page_seen:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    watcher.await.unwrap();
    let api_seen = api_seen.lock().unwrap().clone();

    // Through Running to Succeeded, the step row and its timeline bar too.
    for want in [
        "step Running",
        "step Succeeded",
        "run Running",
        "run Succeeded",
        "bar running",
        "bar succeeded",
    ] {
        assert!(
            page_seen.contains_key(want),
            "the page never showed {want}: {page_seen:?}"
        );
    }
    assert!(page_seen["step Running"] < page_seen["step Succeeded"]);
    assert!(page_seen["run Running"] < page_seen["run Succeeded"]);
    // Each within the bound of the API server showing it.
    for change in [
        "step Running",
        "step Succeeded",
        "run Running",
        "run Succeeded",
    ] {
        let api = api_seen
            .get(change)
            .unwrap_or_else(|| panic!("the API server never showed {change}: {api_seen:?}"));
        let lag = page_seen[change].saturating_duration_since(*api);
        eprintln!("{change}: on the page {lag:?} after the API server");
        assert!(
            lag <= BOUND,
            "the page showed {change} {lag:?} after the API server (bound {BOUND:?})"
        );
    }

    // No reload: the marker survived. No polling: the page made no request;
    // what it showed came in messages of the run's stream.
    assert_eq!(last["marker"], json!(true), "the page was reloaded");
    let log = b
        .client
        .execute("return [window.__requests, window.__messages]", vec![])
        .await
        .unwrap();
    assert_eq!(log[0], json!(0), "the page made requests of its own: {log}");
    let messages = log[1].as_array().unwrap();
    let url = format!("{}events/ns/{ns}/runs/crawl", c.url);
    assert!(
        messages
            .iter()
            .all(|m| m["event"] == "run" && m["url"] == url.as_str()),
        "every message came from {url}: {log}"
    );
    for phase in ["Running", "Succeeded"] {
        assert!(
            messages.iter().any(|m| m["step"] == phase),
            "no message of the stream brought the step {phase}: {log}"
        );
    }
    b.close().await;
    s.finish().await;
}
