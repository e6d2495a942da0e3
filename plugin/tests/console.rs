//! The console's pure parts: the timeline's lanes and geometry from a run's
//! status and Events, and the pages rendered from objects captured on the
//! plane (`fixtures/`, as in render.rs). Expected values are literals. The
//! history pages' tests are in `console/history.rs`, the retry section's in
//! `console/retry.rs`.

#[path = "console/history.rs"]
mod history;
#[path = "console/journal.rs"]
mod journal;
#[path = "support/journal_fixtures.rs"]
mod journal_fixtures;
#[path = "console/retry.rs"]
mod retry;

use std::path::PathBuf;

use agentrun_api::{AgentRun, Approval, Signal};
use jiff::{SignedDuration, Timestamp};
use k8s_openapi::api::events::v1::Event;
use kubectl_agentrun::console::filter::RunFilter;
use kubectl_agentrun::console::timeline::{self, BarKind};
use kubectl_agentrun::console::{pages, run_page};
use kubectl_agentrun::identity::Identity;
use serde_json::json;

fn fixture(name: &str) -> (AgentRun, Vec<Approval>) {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(format!("{name}.json"));
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    (
        serde_json::from_value(v["run"].clone()).unwrap(),
        serde_json::from_value(v["approvals"].clone()).unwrap(),
    )
}

/// The run's Signals in a fixture.
fn fixture_signals(name: &str) -> Vec<Signal> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(format!("{name}.json"));
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    serde_json::from_value(v["signals"].clone()).unwrap()
}

fn me(user: &str) -> Identity {
    Identity {
        user: user.into(),
        groups: vec!["system:authenticated".into()],
    }
}

const T0: &str = "2026-12-02T01:00:00Z";

fn at(secs: i64) -> Timestamp {
    T0.parse::<Timestamp>().unwrap() + SignedDuration::from_secs(secs)
}

fn event(secs: i64, reason: &str, note: &str) -> Event {
    serde_json::from_value(json!({
        "metadata": {"name": format!("e{secs}{reason}"), "namespace": "shop"},
        "eventTime": at(secs).to_string(),
        "reason": reason, "note": note, "type": "Normal",
        "reportingController": "agentrun.dev/operator", "reportingInstance": "op",
        "action": note, "regarding": {"kind": "AgentRun", "name": "crawl"},
    }))
    .unwrap()
}

/// A step evicted 10 s into attempt 1, run again and succeeded at 20 s,
/// fresh for an hour.
fn evicted_run() -> (AgentRun, Vec<Event>) {
    let run: AgentRun = serde_json::from_value(json!({
        "apiVersion": "agentrun.dev/v1alpha1", "kind": "AgentRun",
        "metadata": {"name": "crawl", "namespace": "shop", "uid": "u1", "creationTimestamp": at(0).to_string()},
        "spec": {"steps": []},
        "status": {
            "phase": "Succeeded", "completedAt": at(20).to_string(), "progress": "1/1",
            "steps": [{
                "name": "crawl", "planRevision": 1, "attempt": 2, "idempotencyKey": "k1",
                "pod": "crawl-crawl-0960e3-r1-a2", "phase": "Succeeded", "effect": "Applied",
                "startedAt": at(10).to_string(), "finishedAt": at(20).to_string(),
                "freshUntil": at(3600).to_string(), "disruptions": 1, "result": {"pages": 12},
            }],
        },
    }))
    .unwrap();
    let events = vec![
        event(
            0,
            "StepStarted",
            "step crawl: attempt 1 as Pod crawl-crawl-0960e3-r1-a1",
        ),
        event(
            10,
            "StepDisrupted",
            "step crawl: attempt 1 was disrupted (EvictionByEvictionAPI); it runs again with the same key",
        ),
        event(
            10,
            "StepStarted",
            "step crawl: attempt 2 as Pod crawl-crawl-0960e3-r1-a2",
        ),
        event(20, "StepSucceeded", "step crawl succeeded on attempt 2"),
    ];
    (run, events)
}

#[test]
fn an_evicted_and_rerun_step_has_two_attempts_the_first_disrupted() {
    let (run, events) = evicted_run();
    let tl = timeline::build(&run, &[], &events, &[], at(30));
    assert_eq!(tl.lanes.len(), 1);
    let lane = &tl.lanes[0];
    assert_eq!(lane.label, "crawl r1");
    let bars: Vec<(BarKind, Timestamp, Timestamp, &str)> = lane
        .bars
        .iter()
        .map(|b| (b.kind, b.start, b.end, b.label.as_str()))
        .collect();
    assert_eq!(
        bars,
        [
            (BarKind::Disrupted, at(0), at(10), "attempt 1 disrupted"),
            (BarKind::Succeeded, at(10), at(20), "attempt 2 succeeded"),
        ]
    );
    assert_eq!(lane.fresh, Some((at(20), at(3600))));
}

#[test]
fn the_axis_spans_the_run_plus_a_quarter_for_a_long_freshness_window() {
    let (run, events) = evicted_run();
    let tl = timeline::build(&run, &[], &events, &[], at(30));
    // A finished run's axis ends with it (20 s), plus 5 s of the fresh window.
    assert_eq!((tl.from, tl.to), (at(0), at(25)));
    // 820 units of axis from x = 170: 32.8 per second.
    let xs: Vec<f64> = [0, 10, 20, 25, 3600].iter().map(|s| tl.x(at(*s))).collect();
    assert_eq!(xs, [170.0, 498.0, 826.0, 990.0, 990.0]);
    let svg = tl.svg().into_string();
    for want in [
        r#"<rect class="bar bar-disrupted" x="170.0" y="29.0" width="328.0" height="20.0""#,
        r#"<rect class="bar bar-succeeded" x="498.0" y="29.0" width="328.0" height="20.0""#,
        r#"<rect class="fresh" x="826.0" y="26.0" width="164.0" height="26.0""#,
        "fresh →",
        r#"viewBox="0 0 1000 62""#,
    ] {
        assert!(svg.contains(want), "the SVG lacks {want}:\n{svg}");
    }
}

#[test]
fn a_running_attempt_reaches_now_and_a_replan_is_marked() {
    let (mut run, mut events) = evicted_run();
    let st = run.status.as_mut().unwrap();
    st.phase = Some(agentrun_api::RunPhase::Running);
    st.completed_at = None;
    st.steps[0].phase = agentrun_api::StepPhase::Running;
    st.steps[0].finished_at = None;
    st.steps[0].fresh_until = None;
    events.truncate(3);
    events.push(event(
        12,
        "Replanned",
        "plan revision 2 from planner plan: 3 steps",
    ));
    let tl = timeline::build(&run, &[], &events, &[], at(40));
    let last = tl.lanes[0].bars.last().unwrap();
    assert_eq!(
        (last.kind, last.start, last.end),
        (BarKind::Running, at(10), at(40))
    );
    assert_eq!(tl.replans, [(at(12), "r2".to_owned())]);
    assert_eq!(tl.to, at(40));
}

#[test]
fn the_approval_wait_is_a_bar_naming_who_decided() {
    let (run, approvals) = fixture("refund-approved");
    let tl = timeline::build(
        &run,
        &approvals,
        &[],
        &[],
        "2026-12-02T01:17:39Z".parse().unwrap(),
    );
    let labels: Vec<(BarKind, &str)> = tl.lanes[0]
        .bars
        .iter()
        .map(|b| (b.kind, b.label.as_str()))
        .collect();
    assert_eq!(
        labels,
        [
            (BarKind::Approval, "approval: Approved by alice"),
            (BarKind::Succeeded, "attempt 1 succeeded"),
        ]
    );
}

#[test]
fn the_runs_table_shows_phase_progress_and_who_may_decide() {
    let (run, approvals) = fixture("refund-waiting");
    let now: Timestamp = "2026-12-02T01:17:39Z".parse().unwrap();
    let html = pages::runs_table(&[run], &approvals, &RunFilter::default(), now).into_string();
    for want in [
        r#"<tr data-run="refund""#,
        r#"<span class="phase phase-waitingforapproval">WaitingForApproval</span>"#,
        "approval (user alice)",
        r#"<progress value="0" max="1" aria-label="0 of 1 steps">"#,
        "1 of 1 runs",
    ] {
        assert!(html.contains(want), "the table lacks {want}:\n{html}");
    }
    let none = RunFilter {
        phase: "Failed".into(),
        ..Default::default()
    };
    let (run, approvals) = fixture("refund-waiting");
    let html = pages::runs_table(&[run], &approvals, &none, now).into_string();
    assert!(
        html.contains("No runs match.") && html.contains("0 of 1 runs"),
        "{html}"
    );
}

#[test]
fn the_inbox_offers_the_decisions_and_says_who_may_take_them() {
    let (_, approvals) = fixture("refund-waiting");
    let now: Timestamp = "2026-12-02T01:17:39Z".parse().unwrap();
    let alice = pages::inbox(&me("alice"), &approvals, now, true).into_string();
    for want in [
        "May refund run?",
        r#"<dd class="you">may decide</dd>"#,
        r#"<button type="submit" name="decision" value="Approved" class="">Approve</button>"#,
        r#"value="Rejected" class="danger">Reject</button>"#,
        r#"<label for="approval-refund-refund-a9aff4-r1-approve-comment">Comment</label>"#,
        "user alice",
    ] {
        assert!(alice.contains(want), "alice's inbox lacks {want}:\n{alice}");
    }
    let mallory = pages::inbox(&me("mallory"), &approvals, now, true).into_string();
    assert!(
        mallory.contains("mallory is not an approver; approvers: user alice"),
        "{mallory}"
    );
    let read_only = pages::inbox(&me("alice"), &approvals, now, false).into_string();
    assert!(
        !read_only.contains("hx-post") && read_only.contains("This console is read-only"),
        "{read_only}"
    );
    let (_, decided) = fixture("refund-approved");
    let empty = pages::inbox(&me("alice"), &decided, now, true).into_string();
    assert!(
        empty.contains("No approvals wait for a decision."),
        "{empty}"
    );
}

#[test]
fn the_inbox_says_whether_people_were_told() {
    let (_, mut approvals) = fixture("refund-waiting");
    let now: Timestamp = "2026-12-02T01:17:39Z".parse().unwrap();
    let st = approvals[0].status.get_or_insert_with(Default::default);
    st.conditions = vec![
        serde_json::from_value(serde_json::json!({
            "type": "Notified", "status": "False", "reason": "Retrying",
            "message": "requested notification to channel team: HTTP 503: busy",
            "lastTransitionTime": "2026-12-02T01:00:00Z",
        }))
        .unwrap(),
    ];
    let page = pages::inbox(&me("alice"), &approvals, now, true).into_string();
    assert!(
        page.contains(r#"<dt>Told</dt><dd class="notified">not yet (Retrying): requested notification to channel team: HTTP 503: busy</dd>"#),
        "{page}"
    );
    let st = approvals[0].status.as_mut().unwrap();
    st.conditions[0].status = "True".into();
    st.notifications = vec![serde_json::from_value(serde_json::json!({
        "id": "u.requested.team", "channel": "team", "event": "Requested", "state": "Delivered", "attempts": 2,
    }))
    .unwrap()];
    let page = pages::inbox(&me("alice"), &approvals, now, true).into_string();
    assert!(page.contains(">notified on team</dd>"), "{page}");
}

#[test]
fn a_refusal_is_shown_verbatim_and_escaped() {
    let html = pages::decision_result("a1", &Err("deciding approval a1: <b>no</b> & never".into()))
        .into_string();
    assert_eq!(
        html,
        r#"<p class="refused" role="alert" data-approval="a1"><strong>Refused: </strong><span class="message">deciding approval a1: &lt;b&gt;no&lt;/b&gt; &amp; never</span></p>"#
    );
}

#[test]
fn the_run_page_shows_steps_decider_and_events() {
    let (run, approvals) = fixture("refund-approved");
    let now: Timestamp = "2026-12-02T01:17:39Z".parse().unwrap();
    let alice = me("alice");
    let frame = pages::Frame {
        me: &alice,
        warnings: vec!["watching Approvals: forbidden".into()],
        sign_out: false,
        namespace: None,
    };
    let html = run_page::run_page(
        &frame,
        &run,
        &kubectl_agentrun::render::Related {
            approvals: &approvals,
            ..Default::default()
        },
        true,
        now,
    )
    .into_string();
    for want in [
        r#"sse-connect="/events/ns/plugin-approve-uyx3za/runs/refund""#,
        r#"<tr data-step="refund">"#,
        r#"released by <strong>alice</strong>"#,
        r#"decided by <strong class="decider">alice</strong>"#,
        r#"<svg class="timeline""#,
        "No Events (they expire after an hour).",
        r#"<dialog id="help""#,
        r#"<p class="warning" role="alert">watching Approvals: forbidden</p>"#,
    ] {
        assert!(html.contains(want), "the run page lacks {want}:\n{html}");
    }
    // Signed in with a token (in the cluster), a page offers to sign out.
    assert!(!html.contains("/logout"), "{html}");
    let signed_in = pages::Frame {
        me: &alice,
        warnings: vec![],
        sign_out: true,
        namespace: None,
    };
    let html = run_page::run_page(
        &signed_in,
        &run,
        &kubectl_agentrun::render::Related {
            approvals: &approvals,
            ..Default::default()
        },
        true,
        now,
    )
    .into_string();
    assert!(
        html.contains(r#"<form class="signout" method="post" action="/logout"><button type="submit">Sign out</button></form>"#),
        "{html}"
    );
}

/// parse → physicist ∥ chemist, with the chemist skipped by its condition:
/// the two experts overlap on their own lanes, and the skipped step is a
/// mark on its lane saying why.
#[test]
fn parallel_branches_get_lanes_of_their_own_and_a_skipped_step_a_mark() {
    let run: AgentRun = serde_json::from_value(json!({
        "apiVersion": "agentrun.dev/v1alpha1", "kind": "AgentRun",
        "metadata": {"name": "q", "namespace": "shop", "uid": "u2", "creationTimestamp": at(0).to_string()},
        "spec": {"steps": []},
        "status": {
            "phase": "Running", "progress": "2/4",
            "steps": [
                {"name": "parse", "planRevision": 1, "attempt": 1, "idempotencyKey": "k1", "pod": "q-parse-a1",
                 "phase": "Succeeded", "checkpoint": "Committed", "startedAt": at(0).to_string(), "finishedAt": at(2).to_string()},
                {"name": "physicist", "planRevision": 1, "attempt": 1, "idempotencyKey": "k2", "pod": "q-physicist-a1",
                 "phase": "Running", "startedAt": at(2).to_string()},
                {"name": "chemist", "planRevision": 1, "attempt": 0, "idempotencyKey": "k3",
                 "phase": "Skipped", "checkpoint": "Committed", "finishedAt": at(2).to_string(),
                 "message": "skipped: when \"steps.parse.result.chem\" is false"},
                {"name": "biologist", "planRevision": 1, "attempt": 1, "idempotencyKey": "k4", "pod": "q-biologist-a1",
                 "phase": "Running", "startedAt": at(2).to_string()}
            ]
        }
    }))
    .unwrap();
    let tl = timeline::build(&run, &[], &[], &[], at(10));
    let labels: Vec<&str> = tl.lanes.iter().map(|l| l.label.as_str()).collect();
    assert_eq!(
        labels,
        ["parse r1", "physicist r1", "chemist r1", "biologist r1"]
    );
    let physicist = &tl.lanes[1].bars[0];
    let biologist = &tl.lanes[3].bars[0];
    assert_eq!((physicist.start, physicist.end), (at(2), at(10)));
    assert_eq!(
        (biologist.start, biologist.end),
        (at(2), at(10)),
        "side by side in time"
    );
    let skipped = &tl.lanes[2].bars;
    assert_eq!(skipped.len(), 1);
    assert_eq!(skipped[0].kind, BarKind::Skipped);
    assert_eq!((skipped[0].start, skipped[0].end), (at(2), at(2)));
    assert_eq!(
        skipped[0].label,
        "skipped: when \"steps.parse.result.chem\" is false"
    );
    let svg = tl.svg().into_string();
    assert!(svg.contains(r#"data-kind="skipped""#), "{svg}");
}

/// A queued run says its place, in the table and on its page; a wait step
/// says when it wakes.
#[test]
fn queued_runs_and_wait_steps_say_when_they_move() {
    use agentrun_api::{RunPhase, StepCheckpoint, StepPhase};
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
    let (mut run, approvals) = fixture("refund-waiting");
    let now: Timestamp = "2026-12-02T01:17:39Z".parse().unwrap();
    let st = run.status.as_mut().unwrap();
    st.phase = Some(RunPhase::Queued);
    st.queue_position = Some(3);
    for c in st.conditions.iter_mut().filter(|c| c.type_ == "Succeeded") {
        c.message = "queued at position 3: 2 of 2 runs active in namespace payments (maxActiveRunsPerNamespace)".into();
    }
    let table = pages::runs_table(
        std::slice::from_ref(&run),
        &approvals,
        &RunFilter::default(),
        now,
    )
    .into_string();
    assert!(
        table.contains(r#"<small class="queue">#3 in queue</small>"#),
        "{table}"
    );
    let page = run_page::run_detail(
        &run,
        &kubectl_agentrun::render::Related {
            approvals: &approvals,
            ..Default::default()
        },
        true,
        now,
    )
    .into_string();
    assert!(
        page.contains("Waiting for a place to start: queued at position 3: 2 of 2 runs active"),
        "{page}"
    );

    let st = run.status.as_mut().unwrap();
    st.phase = Some(RunPhase::Waiting);
    st.queue_position = None;
    st.steps.push(StepCheckpoint {
        name: "cool-off".into(),
        plan_revision: 1,
        phase: StepPhase::Waiting,
        started_at: Some(Time(now)),
        wake_at: Some(Time(now + SignedDuration::from_hours(3))),
        ..StepCheckpoint::default()
    });
    let page = run_page::run_detail(
        &run,
        &kubectl_agentrun::render::Related {
            approvals: &approvals,
            ..Default::default()
        },
        true,
        now,
    )
    .into_string();
    assert!(
        page.contains(r#"Step <strong>cool-off</strong> wakes at <time datetime="2026-12-02T04:17:39Z">2026-12-02T04:17:39Z</time> (in 3h)"#),
        "{page}"
    );
}

/// A step waiting on a signal shows what it waits for, its deadline and the
/// exact command that sends it (with the namespace: a browser has no
/// kubeconfig context); once received, the id and the sender.
#[test]
fn a_signal_wait_shows_how_to_send_it_and_then_who_sent_what() {
    let (run, approvals) = fixture("signal-waiting");
    let now: Timestamp = "2026-12-04T06:26:55Z".parse().unwrap();
    let signals = fixture_signals("signal-waiting");
    let page = run_page::run_detail(
        &run,
        &kubectl_agentrun::render::Related {
            approvals: &approvals,
            signals: &signals,
            ..Default::default()
        },
        true,
        now,
    )
    .into_string();
    for want in [
        r#"<div class="waiting signal" data-signal="pay-settle-3329c0-r1-signal">"#,
        r#"Step <strong>settle</strong> waits for a signal: <span class="signal-what">payment settled</span>"#,
        r#"expires at <time datetime="2026-12-04T06:31:54Z">2026-12-04T06:31:54Z</time> (in 4m)"#,
        "Send it with: <code class=\"send\">kubectl agentrun signal pay settle -n plugin-signal-s4rff6 --data '{…}'</code>",
    ] {
        assert!(page.contains(want), "the run page lacks {want}:\n{page}");
    }
    let table = pages::runs_table(
        std::slice::from_ref(&run),
        &approvals,
        &RunFilter::default(),
        now,
    )
    .into_string();
    assert!(table.contains("signal (payment settled)"), "{table}");

    let (run, approvals) = fixture("signal-received");
    let signals = fixture_signals("signal-received");
    let page = run_page::run_detail(
        &run,
        &kubectl_agentrun::render::Related {
            approvals: &approvals,
            signals: &signals,
            ..Default::default()
        },
        true,
        now,
    )
    .into_string();
    assert!(
        page.contains(r#"<div class="decided signal-received">signal <code>pay-1</code> from <strong>ci-bot</strong></div>"#),
        "{page}"
    );
    assert!(!page.contains("Send it with"), "{page}");
    assert!(!page.contains("released by"), "{page}");
    let tl = timeline::build(&run, &approvals, &[], &[], now);
    let settle = &tl.lanes[0];
    assert_eq!(settle.label, "settle r1");
    assert_eq!(
        settle
            .bars
            .iter()
            .map(|b| (b.kind, b.label.as_str()))
            .collect::<Vec<_>>(),
        [(
            BarKind::Signal,
            "signal: Signal pay-settle-3329c0-r1-signal: pay-1 from ci-bot"
        )],
        "a signal wait, not an approval"
    );
}
