//! The console's History pages in headless Chromium against the real plane
//! (D18): a run the operator ran leaves a record that the list and the
//! record's page show after the TTL deleted the run; the same manifest
//! created again runs nothing and its page links that record; a record
//! written by hand with markup in every free-text field shows it as text;
//! a user who may not read records is told so; no history route takes a
//! write, in the console that decides too.

use std::time::{Duration, Instant};

use agentrun_e2e::kubectl_ok;
use agentrun_e2e::support::scenario::{Scenario, phase, sim_step, status};
use agentrun_operator::api::{RunPhase, RunRecord, RunRecordSpec};
use agentrun_operator::history::record_name;
use jiff::{SignedDuration, Timestamp};
use kube::ResourceExt;
use kube::api::{ObjectMeta, PostParams};
use serde_json::json;

use super::{PAGE_TIMEOUT, RUN_TIMEOUT, browser, console, console_with, post};

/// What a person or a step could write into a record, each with markup.
const REQUESTER: &str = "eve\"><img src=x id=injected-img>";
const COMMENT: &str = "</li><script>window.__pwned = 1</script>checked";
const MESSAGE: &str = "step <b id=injected-b>charge</b> failed: exit 3 & more";

/// A record of a run `audit` that failed three days ago, as an operator
/// would have stored it, with markup wherever a person writes.
fn hand_made(ns: &str) -> RunRecord {
    let done = Timestamp::now() - SignedDuration::from_hours(72);
    let spec: RunRecordSpec = serde_json::from_value(json!({
        "run": {
            "namespace": ns, "name": "audit", "uid": "0bad0bad-0000-4000-8000-000000000001",
            "specDigests": ["0123456789abcdef0123456789abcdef"],
            "requestedBy": REQUESTER,
            "createdAt": (done - SignedDuration::from_secs(30)).to_string(),
        },
        "outcome": {
            "phase": "Failed", "reason": "StepFailed", "message": MESSAGE,
            "completedAt": done.to_string(), "duration": "30s",
            "tokensUsed": 7, "stepExecutions": 2, "planRevision": 1,
        },
        "steps": [{
            "name": "charge", "planRevision": 1, "attempt": 2, "phase": "Failed",
            "effect": "Unknown", "idempotencyKey": "k-audit-charge",
            "startedAt": (done - SignedDuration::from_secs(20)).to_string(),
            "finishedAt": done.to_string(),
        }],
        "approvals": [{
            "name": "audit-charge-r1-approve", "step": "charge", "planRevision": 1,
            "kind": "Approve", "phase": "Approved", "decision": "Approved",
            "decidedBy": "carol", "decidedAt": (done - SignedDuration::from_secs(25)).to_string(),
            "comment": COMMENT, "votes": ["carol=Approved", "dave=Approved"],
        }],
    }))
    .expect("the hand-made record deserializes");
    RunRecord {
        metadata: ObjectMeta {
            name: Some(record_name("audit", &spec.run.uid)),
            namespace: Some(ns.to_owned()),
            labels: Some([("agentrun.dev/run".to_owned(), "audit".to_owned())].into()),
            ..ObjectMeta::default()
        },
        spec,
    }
}

/// Until the TTL deleted run `uid` (the name is free, or another run holds it).
async fn wait_deleted(s: &Scenario, name: &str, uid: &str) {
    let deadline = Instant::now() + RUN_TIMEOUT;
    while s
        .runs()
        .get_opt(name)
        .await
        .unwrap()
        .is_some_and(|r| r.uid().as_deref() == Some(uid))
    {
        assert!(
            Instant::now() < deadline,
            "run {name} ({uid}) was not deleted by its TTL within {RUN_TIMEOUT:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// A script returning the `data-record` of each row of the history table.
fn records_shown() -> &'static str {
    "const t = document.querySelector('#history table'); return t && [...t.querySelectorAll('tbody tr[data-record]')].map(r => r.getAttribute('data-record'))"
}

#[tokio::test]
async fn history_shows_a_finished_runs_record_and_the_run_created_again_links_it() {
    let s = Scenario::start("console-history").await;
    let ns = s.namespace().to_owned();
    // A user who may read runs and approvals here, not records: granted
    // first, so RBAC has reached the authorizer when the console starts.
    let reader = format!("history-reader-{}", ns.rsplit('-').next().unwrap());
    kubectl_ok([
        "-n",
        &ns,
        "create",
        "role",
        "runs-only",
        "--verb=get,list,watch",
        "--resource=agentruns.agentrun.dev,approvals.agentrun.dev",
    ])
    .await;
    kubectl_ok([
        "-n",
        &ns,
        "create",
        "rolebinding",
        "runs-only",
        "--role=runs-only",
        &format!("--user={reader}"),
    ])
    .await;

    let spec = json!({"ttlSecondsAfterFinished": 2, "steps": [
        sim_step("refund", "NonIdempotent", json!({"runMs": 50, "result": {"refund": "r-1"},
            "tokens": {"input": 30, "output": 12}})),
    ]});
    s.create_run("refund", spec.clone()).await;
    let first = s.wait_finished("refund", RUN_TIMEOUT).await;
    assert_eq!(
        phase(&first),
        Some(RunPhase::Succeeded),
        "{:#?}",
        first.status
    );
    let first_uid = first.uid().unwrap();
    let key = status(&first).steps[0].idempotency_key.clone();
    let record = status(&first)
        .record
        .expect("the finished run names its record");
    assert_eq!(record, record_name("refund", &first_uid));
    wait_deleted(&s, "refund", &first_uid).await;
    s.create_run("refund", spec).await;
    let again = s
        .wait_run("refund", "AlreadyRan", RUN_TIMEOUT, |r| {
            phase(r) == Some(RunPhase::AlreadyRan)
        })
        .await;
    assert_eq!(status(&again).already_ran.unwrap().record, record);
    let audit = hand_made(&ns);
    let audit_record = audit.name_any();
    s.env()
        .api::<RunRecord>()
        .create(&PostParams::default(), &audit)
        .await
        .expect("creating the hand-made RunRecord");

    // The console that decides (not --read-only), as the plane's admin.
    let c = console(&ns, None).await;
    let b = browser(&ns).await;
    b.goto(&c.at("history")).await;
    let shown = b
        .wait_js(
            "both records in the history",
            PAGE_TIMEOUT,
            &format!(
                "const r = (function () {{ {} }})(); return r && r.length === 2 && r",
                records_shown()
            ),
        )
        .await;
    assert_eq!(shown, json!([record, audit_record]), "newest first");
    let nav = b
        .wait_js("the History link", PAGE_TIMEOUT,
            "const a = document.querySelector('header.top nav a[aria-current=page]'); return a && [a.textContent, a.getAttribute('href')]")
        .await;
    assert_eq!(nav, json!(["History", "/history"]));
    let cells = |rec: &str| {
        format!(
            "return [...document.querySelectorAll('tr[data-record=\"{rec}\"] > *')].map(c => c.innerText.trim())"
        )
    };
    // As the API server holds it (the requester is stamped by the chart's
    // admission policy, where one is installed).
    let stored = s.env().api::<RunRecord>().get(&record).await.unwrap().spec;
    let requester = stored.run.requested_by.as_deref().unwrap_or("-");
    let row = b.client.execute(&cells(&record), vec![]).await.unwrap();
    let row: Vec<String> = serde_json::from_value(row).unwrap();
    assert_eq!(row[0], format!("refund\n{record}"), "{row:?}");
    assert_eq!(
        &row[1..6],
        [ns.as_str(), "Succeeded", requester, "1", "42"],
        "{row:?}"
    );
    assert!(row[7].ends_with(" ago"), "{row:?}");
    let row = b
        .client
        .execute(&cells(&audit_record), vec![])
        .await
        .unwrap();
    let row: Vec<String> = serde_json::from_value(row).unwrap();
    assert_eq!(
        &row[1..7],
        [ns.as_str(), "Failed StepFailed", REQUESTER, "2", "7", "30s"],
        "the requester as text: {row:?}"
    );
    assert_eq!(
        b.client.execute("return document.querySelectorAll('#injected-img, #injected-b').length + (window.__pwned || 0)", vec![]).await.unwrap(),
        json!(0),
        "no markup from a record became an element"
    );

    // Filters are links, and the form makes them.
    for (query, want) in [
        ("outcome=Failed", json!([audit_record])),
        ("since=24h", json!([record])),
        ("outcome=Succeeded&run=refund", json!([record])),
        ("run=audit&since=720h", json!([audit_record])),
    ] {
        b.goto(&c.at(&format!("history?{query}"))).await;
        let got = b
            .wait_js(
                &format!("the records of ?{query}"),
                PAGE_TIMEOUT,
                records_shown(),
            )
            .await;
        assert_eq!(got, want, "?{query}");
    }
    b.goto(&c.at("history")).await;
    b.wait_js("the filter form", PAGE_TIMEOUT,
        "const s = document.querySelector('form.filters select[name=outcome]'); if (!s) return null; s.value = 'Failed'; document.querySelector('form.filters button[type=submit]').click(); return true").await;
    let got = b
        .wait_js("the filtered page", PAGE_TIMEOUT,
            "return location.search.includes('outcome=Failed') && document.querySelector('#history table') && [...document.querySelectorAll('#history tbody tr[data-record]')].map(r => r.getAttribute('data-record'))")
        .await;
    assert_eq!(got, json!([audit_record]));
    b.goto(&c.at("history?outcome=Running")).await;
    let refused = b
        .wait_js(
            "the refused filter",
            PAGE_TIMEOUT,
            "const p = document.querySelector('#history .warning'); return p && p.textContent",
        )
        .await;
    assert_eq!(
        refused,
        "outcome Running: a record ends Succeeded, Failed or Cancelled"
    );

    // The record's page, from its row.
    b.goto(&c.at("history")).await;
    b.wait_js("the record's link", PAGE_TIMEOUT, &format!(
        "const a = document.querySelector('tr[data-record=\"{record}\"] a'); if (!a) return null; a.click(); return true")).await;
    let page = b
        .wait_js("the record page", PAGE_TIMEOUT, &format!(
            "const d = document.querySelector('#record[data-record=\"{record}\"]'); return d && [location.pathname, d.querySelector('h1').innerText, d.querySelector('tr[data-step=refund]').innerText, d.querySelectorAll('svg.timeline rect.bar-succeeded').length, d.querySelector('.run').innerText]"))
        .await;
    assert_eq!(page[0], format!("/ns/{ns}/history/{record}"));
    assert_eq!(page[1], "refund Succeeded");
    let step = page[2].as_str().unwrap();
    assert!(
        step.contains(&key) && step.contains("Applied") && step.contains("Succeeded"),
        "the step's key, effect and phase: {step}"
    );
    assert_eq!(page[3], 1, "the step's attempt on the timeline");
    assert!(page[4].as_str().unwrap().contains("deleted"), "{page}");
    b.screenshot("console-record.png").await;
    let writes = "return [document.querySelectorAll('[hx-post], [hx-put], [hx-patch], [hx-delete], textarea').length, [...document.querySelectorAll('form')].map(f => f.getAttribute('method'))]";
    assert_eq!(
        b.client.execute(writes, vec![]).await.unwrap(),
        json!([0, ["dialog"]]),
        "the record page offers nothing to write"
    );
    // The hand-made one: what people wrote, as text.
    b.goto(&c.at(&format!("ns/{ns}/history/{audit_record}")))
        .await;
    let audit_page = b
        .wait_js("the hand-made record's page", PAGE_TIMEOUT,
            "const d = document.querySelector('#record'); return d && [d.querySelector('.comment').textContent, d.querySelector('.outcome .message').textContent, d.querySelector('.requested-by').textContent, d.querySelector('.decider').textContent, [...d.querySelectorAll('.vote')].map(v => v.textContent)]")
        .await;
    assert_eq!(
        audit_page,
        json!([
            format!("“{COMMENT}”"),
            MESSAGE,
            REQUESTER,
            "carol",
            ["carol=Approved", "dave=Approved"]
        ])
    );
    assert_eq!(
        b.client.execute("return document.querySelectorAll('#record script, #injected-img, #injected-b').length + (window.__pwned || 0)", vec![]).await.unwrap(),
        json!(0)
    );

    // The run created again: it ran nothing, and says whose record it is.
    b.goto(&c.at(&format!("ns/{ns}/runs/refund"))).await;
    let notice = b
        .wait_js("the AlreadyRan notice", PAGE_TIMEOUT,
            "const n = document.querySelector('.notice.already-ran'); return n && [n.innerText, n.querySelector('a.record-link').getAttribute('href')]")
        .await;
    let text = notice[0].as_str().unwrap();
    assert!(
        text.contains("This run ran nothing.")
            && text.contains(&first_uid)
            && text.contains("Succeeded"),
        "{text}"
    );
    assert_eq!(notice[1], format!("/ns/{ns}/history/{record}"));
    // The live stream swaps the run's fragment in again: find and click at once.
    b.wait_js("the record link clicked", PAGE_TIMEOUT,
        "const a = document.querySelector('.notice.already-ran a.record-link'); if (!a) return null; a.click(); return true").await;
    b.wait_js(
        "the earlier run's record",
        PAGE_TIMEOUT,
        &format!("return document.querySelector('#record[data-record=\"{record}\"]') !== null"),
    )
    .await;
    b.close().await;

    // No history route takes a write, in the console that decides.
    let headers = format!(
        "Host: 127.0.0.1:{}\r\nHX-Request: true\r\n{}",
        c.port,
        c.cookie()
    );
    for path in ["/history".to_owned(), format!("/ns/{ns}/history/{record}")] {
        assert_eq!(post(c.port, &path, &headers).await, 405, "POST {path}");
    }

    // Who may not read records is told so, with the API server's words.
    let r = console_with(&ns, Some(&reader), &["-n", &ns]).await;
    let refusal = format!(
        "runrecords.agentrun.dev is forbidden: User &quot;{reader}&quot; cannot list resource &quot;runrecords&quot;"
    );
    let list = r.get_ok("/history").await;
    assert!(
        list.contains("You may not read the run history here: ") && list.contains(&refusal),
        "{list}"
    );
    let one = r.get_ok(&format!("/ns/{ns}/history/{record}")).await;
    assert!(
        one.contains("You may not read the run history here: ")
            && one.contains(&format!(
                "runrecords.agentrun.dev &quot;{record}&quot; is forbidden"
            )),
        "{one}"
    );
    s.finish().await;
}
