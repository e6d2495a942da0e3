//! The console's history pages (D18): the list and one record rendered from
//! records built the way the operator builds them (from the captured runs in
//! `fixtures/`), every string a person or a step wrote escaped, no write
//! anywhere on them, the filters the same `history::Query` as
//! `kubectl agentrun history`'s flags, and the run page's link to its record.

use agentrun_api::{AlreadyRan, RunPhase, RunRecordSpec};
use agentrun_history::{self as history, Query};
use jiff::{SignedDuration, Timestamp};
use kubectl_agentrun::console::filter::HistoryFilter;
use kubectl_agentrun::console::history_page::{self, Listed};
use kubectl_agentrun::console::namespace::Scope;
use kubectl_agentrun::console::{pages, run_page};
use serde_json::json;

use super::{fixture, me};

/// The record the operator writes for a captured run.
fn record_of(name: &str) -> RunRecordSpec {
    let (run, approvals) = fixture(name);
    let status = run.status.clone().unwrap();
    history::build(&run, &status, &approvals, &[])
}

/// Two hours after the fixtures' runs finished.
fn now() -> Timestamp {
    "2026-12-02T03:12:39Z".parse().unwrap()
}

/// A record whose every free-text field carries markup, as a step, a run
/// author or an approver could write it.
fn hostile() -> RunRecordSpec {
    serde_json::from_value(json!({
        "run": {
            "namespace": "shop", "name": "<script>alert('run')</script>", "uid": "0bad0bad-1111",
            "specDigests": ["d1"], "rerun": "<i>again</i>",
            "requestedBy": "eve\"><img src=x onerror=alert(2)>",
            "forkedFrom": "src\"><b>x</b>",
            "createdAt": "2026-12-02T01:00:00Z",
        },
        "outcome": {
            "phase": "Failed", "reason": "<u>StepFailed</u>",
            "message": "step <b>charge</b> failed: exit 3 & \"more\"",
            "startedAt": "2026-12-02T01:00:01Z", "completedAt": "2026-12-02T01:00:09Z",
            "duration": "8s", "tokensUsed": 12, "stepExecutions": 2, "planRevision": 1,
        },
        "steps": [{
            "name": "<svg onload=alert(3)>", "planRevision": 1, "attempt": 2, "phase": "Failed",
            "effect": "Unknown", "idempotencyKey": "<key>", "decidedBy": "<em>bob</em>",
            "startedAt": "2026-12-02T01:00:02Z", "finishedAt": "2026-12-02T01:00:08Z",
        }],
        "approvals": [{
            "name": "a-1", "step": "<s>charge</s>", "planRevision": 1, "kind": "Approve",
            "phase": "Approved", "decision": "Approved", "decidedBy": "<strong>carol</strong>",
            "decidedAt": "2026-12-02T01:00:05Z",
            "comment": "</li><script>alert('comment')</script>",
            "votes": ["dave<script>=Approved"],
        }],
        "signals": [{
            "name": "sig-1", "step": "wait", "phase": "Received",
            "id": "<id>", "sentBy": "<ci-bot>",
        }],
    }))
    .unwrap()
}

#[test]
fn the_history_table_lists_records_newest_first_each_linking_to_its_record() {
    let approved = record_of("refund-approved");
    let mut rejected = record_of("charge-rejected");
    // The rejected run finished a minute later: it comes first.
    rejected.outcome.completed_at.0 += SignedDuration::from_secs(60);
    let records = Query::default().arrange(vec![approved, rejected]);
    let html = history_page::history_table(&records, false, now()).into_string();
    for want in [
        "<caption>2 records</caption>",
        r#"<tr data-record="charge-c9e0efce" data-run="charge" data-namespace="plugin-approve-uyx3za"><th scope="row"><a href="/ns/plugin-approve-uyx3za/history/charge-c9e0efce">charge</a>"#,
        r#"<td data-label="Outcome"><span class="phase phase-failed">Failed</span> <small>ApprovalRejected</small></td>"#,
        r#"<td data-label="Requested by">agentrun-e2e-admin</td><td data-label="Step Pods">1</td><td data-label="Tokens">0</td><td data-label="Duration">-</td>"#,
        r#"<td data-label="Finished"><time datetime="2026-12-02T01:13:40Z" title="2026-12-02T01:13:40Z">118m ago</time></td>"#,
        r#"<a href="/ns/plugin-approve-uyx3za/history/refund-968c6877">refund</a>"#,
        r#"<td data-label="Outcome"><span class="phase phase-succeeded">Succeeded</span></td>"#,
    ] {
        assert!(html.contains(want), "the table lacks {want}:\n{html}");
    }
    let charge = html.find("data-run=\"charge\"").unwrap();
    let refund = html.find("data-run=\"refund\"").unwrap();
    assert!(charge < refund, "newest first:\n{html}");
    let more = history_page::history_table(&records[..1], true, now()).into_string();
    assert!(
        more.contains("1 records, the newest 1; more with"),
        "{more}"
    );
    let none = history_page::history_table(&[], false, now()).into_string();
    assert!(none.contains("No records match."), "{none}");
}

#[test]
fn the_record_page_is_the_run_page_of_a_finished_run_read_only() {
    let r = record_of("refund-approved");
    let alice = me("alice");
    let frame = pages::Frame {
        me: &alice,
        warnings: vec![],
        sign_out: false,
        namespace: None,
    };
    let html = history_page::record_page(&frame, &r, false, now()).into_string();
    for want in [
        r#"<a href="/history" aria-current="page">History</a>"#,
        r#"<h1>refund <span class="phase phase-succeeded">Succeeded</span></h1>"#,
        "record <code>refund-968c6877</code>",
        r#"<dd><code>968c6877-ccf7-4228-addb-91ef4978983e</code></dd>"#,
        r#"<dd class="requested-by">agentrun-e2e-admin</dd>"#,
        r#"<dd class="reason">RunSucceeded</dd><dt>Message</dt><dd class="message">1 steps succeeded</dd>"#,
        r#"<tr data-step="refund"><th scope="row">refund <small>r1</small></th>"#,
        r#"<td data-label="Effect">Applied</td><td data-label="Key"><code class="key">2b5af51c51d36c210ad28adb15635d20</code></td><td data-label="How">by <strong class="decider">alice</strong></td>"#,
        r#"<li data-approval="refund-refund-a9aff4-r1-approve"><code>refund-refund-a9aff4-r1-approve</code> Approve · step refund r1 · <span class="phase phase-approved">Approved</span> · Approved by <strong class="decider">alice</strong> at <time datetime="2026-12-02T01:12:39Z">2026-12-02T01:12:39Z</time> · <span class="comment">“checked”</span>"#,
        "It keeps no Pods, logs, step results or Events: those went with the run.",
        r#"<rect class="bar bar-succeeded""#,
        "(deleted; a run of this name now, if any, is another run)",
    ] {
        assert!(html.contains(want), "the record page lacks {want}:\n{html}");
    }
    let live = history_page::record_detail(&r, true, now()).into_string();
    assert!(
        live.contains(
            r#"<a href="/ns/plugin-approve-uyx3za/runs/refund">refund</a> (still there)"#
        ),
        "{live}"
    );
    // No Events, no logs, no Pods: not sections left empty.
    assert!(!html.contains("Events</h2>"), "{html}");
}

/// Whatever the console's mode, the history pages offer no write: no POST,
/// no htmx request, no form but the filter's GET and the help's dialog.
#[test]
fn the_history_pages_have_no_form_that_writes() {
    let alice = me("alice");
    let frame = pages::Frame {
        me: &alice,
        warnings: vec![],
        sign_out: false,
        namespace: None,
    };
    let records = [record_of("refund-approved"), hostile()];
    let list = history_page::history_page(
        &frame,
        Listed::Records {
            records: &records,
            more: false,
        },
        &HistoryFilter::default(),
        true,
        &["shop".into()],
        now(),
    )
    .into_string();
    let detail = history_page::record_page(&frame, &records[0], true, now()).into_string();
    for (page, html) in [("list", &list), ("record", &detail)] {
        let lower = html.to_lowercase();
        for banned in [
            "hx-post",
            "hx-put",
            "hx-patch",
            "hx-delete",
            "method=\"post\"",
            "sse-connect",
            "<textarea",
            "<button type=\"submit\" name=\"decision\"",
        ] {
            assert!(
                !lower.contains(banned),
                "the {page} page has {banned}:\n{html}"
            );
        }
        let forms: Vec<&str> = lower
            .match_indices("<form")
            .map(|(i, _)| &lower[i..i + lower[i..].find('>').unwrap()])
            .collect();
        for f in &forms {
            assert!(
                f.contains("method=\"get\"") || f.contains("method=\"dialog\""),
                "the {page} page has a form that is not a GET or the help dialog: {f}"
            );
        }
        assert_eq!(
            forms.len(),
            if page == "list" { 2 } else { 1 },
            "the {page} page's forms: {forms:?}"
        );
    }
    assert!(
        list.contains(r#"<form class="filters" method="get" action="/history" role="search">"#),
        "{list}"
    );
}

#[test]
fn every_string_from_a_record_is_escaped_and_every_link_encoded() {
    let r = hostile();
    let table = history_page::history_table(std::slice::from_ref(&r), false, now()).into_string();
    let detail = history_page::record_detail(&r, false, now()).into_string();
    for (what, html) in [("table", &table), ("detail", &detail)] {
        for injected in [
            "<script",
            "<img",
            "<b>",
            "<i>",
            "<u>",
            "<svg onload",
            "<em>",
            "<strong>carol",
            "<s>",
            "<key>",
            "<id>",
            "<ci-bot>",
        ] {
            assert!(
                !html.contains(injected),
                "the {what} renders {injected} as markup:\n{html}"
            );
        }
    }
    for want in [
        r#"<a href="/ns/shop/history/%3Cscript%3Ealert%28%27run%27%29%3C%2Fscript%3E-0bad0bad">&lt;script&gt;alert('run')&lt;/script&gt;</a>"#,
        r#"<td data-label="Requested by">eve&quot;&gt;&lt;img src=x onerror=alert(2)&gt;</td>"#,
        r#"<small>&lt;u&gt;StepFailed&lt;/u&gt;</small>"#,
    ] {
        assert!(table.contains(want), "the table lacks {want}:\n{table}");
    }
    for want in [
        r#"<dd class="message">step &lt;b&gt;charge&lt;/b&gt; failed: exit 3 &amp; &quot;more&quot;</dd>"#,
        r#"<span class="comment">“&lt;/li&gt;&lt;script&gt;alert('comment')&lt;/script&gt;”</span>"#,
        r#"<span class="vote">dave&lt;script&gt;=Approved</span>"#,
        r#"by <strong class="decider">&lt;strong&gt;carol&lt;/strong&gt;</strong>"#,
        r#"<code class="key">&lt;key&gt;</code>"#,
        r#"<a href="/history?namespace=shop&amp;run=src%22%3E%3Cb%3Ex%3C%2Fb%3E">src&quot;&gt;&lt;b&gt;x&lt;/b&gt;</a>"#,
        r#"from <strong class="sender">&lt;ci-bot&gt;</strong>"#,
        r#"<code>&lt;i&gt;again&lt;/i&gt;</code>"#,
    ] {
        assert!(detail.contains(want), "the detail lacks {want}:\n{detail}");
    }
    // The store's refusal is the API server's text: escaped too.
    let alice = me("alice");
    let frame = pages::Frame {
        me: &alice,
        warnings: vec![],
        sign_out: false,
        namespace: None,
    };
    let why = "runrecords is forbidden: User \"<b>eve</b>\"";
    let page = history_page::history_page(
        &frame,
        Listed::Trouble(why),
        &HistoryFilter {
            run: "\"><script>".into(),
            ..Default::default()
        },
        false,
        &[],
        now(),
    )
    .into_string();
    assert!(
        page.contains(r#"<p class="warning" role="alert">runrecords is forbidden: User &quot;&lt;b&gt;eve&lt;/b&gt;&quot;</p>"#)
            && page.contains(r#"<input name="run" value="&quot;&gt;&lt;script&gt;""#),
        "{page}"
    );
}

fn api_error(code: u16, message: &str) -> history::Error {
    let status: kube::core::Status =
        serde_json::from_value(json!({"status": "Failure", "code": code, "message": message}))
            .unwrap();
    history::Error::Api(kube::Error::Api(status.boxed()))
}

#[test]
fn a_refusal_or_a_missing_crd_says_what_to_do() {
    let forbidden = history_page::trouble(&api_error(
        403,
        "runrecords.agentrun.dev is forbidden: User \"eve\" cannot list resource \"runrecords\" in API group \"agentrun.dev\" in the namespace \"shop\"",
    ));
    assert_eq!(
        forbidden,
        "You may not read the run history here: runrecords.agentrun.dev is forbidden: User \"eve\" cannot list resource \"runrecords\" in API group \"agentrun.dev\" in the namespace \"shop\". Reading it takes get and list on runrecords.agentrun.dev (the chart's viewer role has them)."
    );
    let missing = history_page::trouble(&api_error(
        404,
        "the server could not find the requested resource",
    ));
    assert_eq!(
        missing,
        "The API server does not serve RunRecords (the server could not find the requested resource): the RunRecord CRD is not installed. Install the CRDs of an operator with the history (docs/install.md)."
    );
    let db = history_page::trouble(&history::Error::Database("connection refused".into()));
    assert_eq!(
        db,
        "Reading the run history: PostgreSQL: connection refused"
    );
}

/// The console's filter and `kubectl agentrun history`'s flags, given the
/// same words, ask the store the same question.
#[test]
fn the_filters_map_to_the_query_the_cli_asks() {
    use clap::Parser;
    let now = now();
    let cli = |args: &[&str], ns: &str| {
        let mut argv = vec!["kubectl-agentrun", "history"];
        argv.extend(args);
        let parsed = kubectl_agentrun::cli::Cli::try_parse_from(argv).unwrap();
        let kubectl_agentrun::cli::Command::History(h) = parsed.command else {
            panic!("parsed as history");
        };
        kubectl_agentrun::commands::history::query(&h, ns, now).unwrap()
    };
    let shop = || Scope::Namespace("shop".into());
    let at = |t: &str| Some(t.parse::<Timestamp>().unwrap());
    let cases: Vec<(&str, HistoryFilter, Scope, Query, Query)> = vec![
        (
            "nothing set, all namespaces: the newest 500",
            HistoryFilter::default(),
            Scope::All,
            Query {
                limit: Some(500),
                ..Query::default()
            },
            cli(&["-A", "--limit", "500"], "default"),
        ),
        (
            "every filter",
            HistoryFilter {
                outcome: "Failed".into(),
                namespace: "shop".into(),
                requested_by: "alice".into(),
                since: "24h".into(),
                run: "refund".into(),
                limit: "20".into(),
            },
            Scope::All,
            Query {
                namespace: Some("shop".into()),
                run: Some("refund".into()),
                outcome: Some(RunPhase::Failed),
                requested_by: Some("alice".into()),
                since: at("2026-12-01T03:12:39Z"),
                until: None,
                limit: Some(20),
            },
            cli(
                &[
                    "refund",
                    "--outcome",
                    "Failed",
                    "--requested-by",
                    "alice",
                    "--since",
                    "24h",
                    "--limit",
                    "20",
                ],
                "shop",
            ),
        ),
        (
            "the last 7 days, in the console's one namespace",
            HistoryFilter {
                since: "168h".into(),
                outcome: "Cancelled".into(),
                ..Default::default()
            },
            shop(),
            Query {
                namespace: Some("shop".into()),
                outcome: Some(RunPhase::Cancelled),
                since: at("2026-11-25T03:12:39Z"),
                limit: Some(500),
                ..Query::default()
            },
            cli(
                &[
                    "--since",
                    "168h",
                    "--outcome",
                    "Cancelled",
                    "--limit",
                    "500",
                ],
                "shop",
            ),
        ),
        (
            "since a day, from midnight UTC",
            HistoryFilter {
                since: "2026-12-01".into(),
                ..Default::default()
            },
            shop(),
            Query {
                namespace: Some("shop".into()),
                since: at("2026-12-01T00:00:00Z"),
                limit: Some(500),
                ..Query::default()
            },
            cli(&["--since", "2026-12-01", "--limit", "500"], "shop"),
        ),
        (
            "since a time",
            HistoryFilter {
                since: " 2026-12-01T08:30:00Z ".into(),
                namespace: "shop".into(),
                ..Default::default()
            },
            shop(),
            Query {
                namespace: Some("shop".into()),
                since: at("2026-12-01T08:30:00Z"),
                limit: Some(500),
                ..Query::default()
            },
            cli(
                &["--since", "2026-12-01T08:30:00Z", "--limit", "500"],
                "shop",
            ),
        ),
    ];
    for (case, f, scope, want, from_cli) in cases {
        let got = f
            .to_query(&scope, now)
            .unwrap_or_else(|e| panic!("{case}: {e}"));
        assert_eq!(got, want, "{case}");
        assert_eq!(got, from_cli, "{case}: the CLI's query");
    }
    let refused: [(&str, HistoryFilter, Scope, &str); 5] = [
        (
            "an outcome a record cannot have",
            HistoryFilter {
                outcome: "Running".into(),
                ..Default::default()
            },
            Scope::All,
            "outcome Running: a record ends Succeeded, Failed or Cancelled",
        ),
        (
            "a time it cannot read",
            HistoryFilter {
                since: "3 days".into(),
                ..Default::default()
            },
            Scope::All,
            "since 3 days: a duration back from now (24h, 30m), a time (2026-12-01T08:00:00Z) or a day (2026-12-01)",
        ),
        (
            "no records",
            HistoryFilter {
                limit: "0".into(),
                ..Default::default()
            },
            Scope::All,
            "limit 0: a number of records, at least 1",
        ),
        (
            "a limit that is no number",
            HistoryFilter {
                limit: "all".into(),
                ..Default::default()
            },
            Scope::All,
            "limit all: a number of records, at least 1",
        ),
        (
            "another namespace than the console's",
            HistoryFilter {
                namespace: "lab".into(),
                ..Default::default()
            },
            shop(),
            "namespace lab: this console shows namespace shop only",
        ),
    ];
    for (case, f, scope, want) in refused {
        assert_eq!(f.to_query(&scope, now), Err(want.to_owned()), "{case}");
    }
    let f = HistoryFilter {
        outcome: "Failed".into(),
        requested_by: "a b&c".into(),
        ..Default::default()
    };
    assert_eq!(f.query(), "outcome=Failed&requested_by=a%20b%26c");
}

#[test]
fn the_run_page_links_its_record_or_says_it_already_ran_nothing() {
    let (mut run, approvals) = fixture("refund-approved");
    let html = run_page::run_detail(
        &run,
        &kubectl_agentrun::render::Related {
            approvals: &approvals,
            ..Default::default()
        },
        true,
        now(),
    )
    .into_string();
    assert!(
        !html.contains("record-link"),
        "no record named yet:\n{html}"
    );
    run.status.as_mut().unwrap().record = Some("refund-968c6877".into());
    let html = run_page::run_detail(
        &run,
        &kubectl_agentrun::render::Related {
            approvals: &approvals,
            ..Default::default()
        },
        true,
        now(),
    )
    .into_string();
    assert!(
        html.contains(r#"<p class="recorded">Recorded: <a class="record-link" href="/ns/plugin-approve-uyx3za/history/refund-968c6877">refund-968c6877</a>"#),
        "{html}"
    );
    let status = run.status.as_mut().unwrap();
    status.record = None;
    status.phase = Some(RunPhase::AlreadyRan);
    status.already_ran = Some(Box::new(AlreadyRan {
        record: "refund-0ld0a1d0".into(),
        run_uid: "0ld0a1d0-2222".into(),
        outcome: "Failed".into(),
        completed_at: k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
            "2026-12-01T09:00:00Z".parse().unwrap(),
        ),
    }));
    let html = run_page::run_detail(
        &run,
        &kubectl_agentrun::render::Related {
            approvals: &approvals,
            ..Default::default()
        },
        true,
        now(),
    )
    .into_string();
    for want in [
        r#"<div class="notice already-ran" role="status"><p><strong>This run ran nothing.</strong> A run refund with the same spec already ran in plugin-approve-uyx3za (UID <code>0ld0a1d0-2222</code>) and ended <span class="phase phase-failed">Failed</span> at <time datetime="2026-12-01T09:00:00Z">2026-12-01T09:00:00Z</time>. Its record: <a class="record-link" href="/ns/plugin-approve-uyx3za/history/refund-0ld0a1d0">refund-0ld0a1d0</a>.</p>"#,
        "<code>agentrun.dev/rerun</code> set to a new value.",
        r#"<span class="phase phase-alreadyran">AlreadyRan</span>"#,
    ] {
        assert!(html.contains(want), "the run page lacks {want}:\n{html}");
    }
}
