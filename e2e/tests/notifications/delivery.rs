//! What arrives: each notification once, signed, with a stable delivery id; exactly
//! the retries a failing receiver is owed; the expiry told; the decision of a run
//! deleted as soon as it finished.

use std::time::Duration;

use agentrun_e2e::support::receiver::{Receiver, Reply};
use agentrun_e2e::support::scenario::{sim_step, status};
use agentrun_operator::api::{DeliveryState, RunPhase};
use kube::ResourceExt;
use serde_json::json;

use super::{
    TIMEOUT, assert_no_more, assert_signed, deliveries, delivery, gated_run, id, notified, setup,
    wait_approval, wait_state,
};

/// The request goes to the named and the default channels, the reminder to
/// the escalation channel after its delay, the decision to the first ones:
/// each exactly once, signed, with a stable delivery id, in its format.
#[tokio::test]
async fn request_escalation_and_decision_arrive_once_each_signed() {
    let r = Receiver::start().await;
    let s = setup(
        "notify-once-each",
        &r,
        "channels:\n\
         - {name: team, url: '{R}/team', hmacKeyRef: hmac, default: true}\n\
         - {name: boss, url: '{R}/boss', format: slack}\n\
         - {name: ops, url: '{R}/ops', format: msteams, headers: {X-Team: payments}}\n",
        true,
        None,
    )
    .await;
    let ns = s.namespace().to_owned();
    let name = gated_run(
        &s,
        "refund",
        json!({
            "question": "Refund order 4711?",
            "timeout": "10m",
            "notify": ["ops"],
            "escalate": {"after": "4s", "notify": ["boss"]},
        }),
    )
    .await;
    let a = s.approvals().get(&name).await.unwrap();

    let team = r.wait_for("/team", 1, TIMEOUT).await;
    let req = &team[0];
    assert_signed(req);
    assert_eq!(
        req.header("x-agentrun-delivery"),
        Some(id(&a, "requested", "team").as_str())
    );
    assert_eq!(req.header("x-agentrun-event"), Some("requested"));
    let body = req.json();
    assert_eq!(body["kind"], "ApprovalNotification");
    assert_eq!(body["event"], "requested");
    assert_eq!(body["namespace"], ns.as_str());
    assert_eq!(body["run"]["name"], "refund");
    assert_eq!(body["step"], "refund");
    assert_eq!(body["approval"]["question"], "Refund order 4711?");
    assert_eq!(body["approval"]["phase"], "Pending");
    assert!(body["approval"]["expiresAt"].is_string(), "{body}");
    assert_eq!(
        body["commands"]["approve"],
        format!("kubectl agentrun approve refund refund -n {ns}").as_str()
    );
    assert_eq!(
        body["consoleUrl"],
        format!("https://console.example/ns/{ns}/runs/refund").as_str()
    );
    assert_eq!(
        body["whoMayDecide"],
        format!("anyone allowed to update approvals in namespace {ns}").as_str()
    );
    let ops = r.wait_for("/ops", 1, TIMEOUT).await;
    assert_eq!(ops[0].header("x-team"), Some("payments"));
    assert!(
        ops[0].header("x-agentrun-signature").is_none(),
        "a channel without a key does not sign"
    );
    let card = ops[0].json();
    assert_eq!(
        card["attachments"][0]["contentType"],
        "application/vnd.microsoft.card.adaptive"
    );
    assert!(card.to_string().contains("Approval needed: run"), "{card}");

    // The reminder comes after its delay, in Slack's format.
    let boss = r.wait_for("/boss", 1, TIMEOUT).await;
    let slack = boss[0].json();
    // Not before the approval was 4 s old (its creation time is kept to the second).
    let created = a.metadata.creation_timestamp.clone().unwrap().0;
    let due = created
        .checked_add(jiff::SignedDuration::from_secs(4))
        .unwrap();
    assert!(
        boss[0].wall >= due,
        "the reminder came at {}, before it was due at {due}",
        boss[0].wall
    );
    let mut ids = Vec::new();
    for r in team.iter().chain(&ops).chain(&boss) {
        ids.push(r.header("x-agentrun-delivery").unwrap().to_owned());
    }
    assert_eq!(
        ids[2],
        id(&a, "escalated", "boss"),
        "the reminder has its own delivery id"
    );
    assert!(
        slack["text"]
            .as_str()
            .unwrap()
            .starts_with("Still waiting for approval: run"),
        "{slack}"
    );
    assert!(slack["blocks"].is_array());

    s.decide(&name, "Approved", "checked the order").await;
    let team = r.wait_for("/team", 2, TIMEOUT).await;
    assert_signed(&team[1]);
    assert_eq!(team[1].header("x-agentrun-event"), Some("decided"));
    let decided = team[1].json();
    assert_eq!(decided["approval"]["decision"], "Approved");
    assert_eq!(decided["approval"]["comment"], "checked the order");
    r.wait_for("/ops", 2, TIMEOUT).await;
    assert_no_more(&r, "/team", 2).await;
    assert_no_more(&r, "/ops", 2).await;
    assert_no_more(&r, "/boss", 1).await;

    let a = wait_approval(&s, &name, "5 delivered notifications", |a| {
        deliveries(a).len() == 5
            && deliveries(a)
                .iter()
                .all(|d| d.state == DeliveryState::Delivered)
    })
    .await;
    for d in deliveries(&a) {
        assert_eq!(d.attempts, 1, "{d:?}");
        assert!(d.delivered_at.is_some() && d.last_error.is_none(), "{d:?}");
    }
    let c = notified(&a).expect("a Notified condition");
    assert_eq!(
        (c.status.as_str(), c.reason.as_str()),
        ("True", "Delivered")
    );
    s.wait_run("refund", "Succeeded", TIMEOUT, |r| {
        status(r).phase == Some(RunPhase::Succeeded)
    })
    .await;
    s.finish().await;
}

/// A receiver failing three times gets exactly three retries, spaced by
/// the backoff, all with the same delivery id.
#[tokio::test]
async fn a_failing_receiver_gets_exactly_the_retries() {
    let r = Receiver::start().await;
    r.script(
        "/team",
        [Reply::Status(500), Reply::Status(502), Reply::Status(429)],
    );
    let s = setup(
        "notify-retries",
        &r,
        "channels:\n- {name: team, url: '{R}/team', default: true}\n",
        true,
        None,
    )
    .await;
    let name = gated_run(&s, "refund", json!({"question": "ok?"})).await;
    let got = r.wait_for("/team", 4, TIMEOUT).await;
    assert_no_more(&r, "/team", 4).await;
    let a = s.approvals().get(&name).await.unwrap();
    let want = id(&a, "requested", "team");
    for g in &got {
        assert_eq!(g.header("x-agentrun-delivery"), Some(want.as_str()));
    }
    assert_eq!(
        got[0].body, got[3].body,
        "a retry sends the same body as the first attempt"
    );
    // Backoff 1 s, 2 s, 4 s, each ±20%.
    for (i, pair) in got.windows(2).enumerate() {
        let gap = pair[1].at.duration_since(pair[0].at).as_secs_f64();
        let exp = f64::from(1u32 << i);
        assert!(
            gap >= 0.75 * exp && gap <= 1.2 * exp + 1.5,
            "retry {} came {gap:.2} s after the previous attempt (expected about {exp} s)",
            i + 1
        );
    }
    let a = wait_state(&s, &name, &want, DeliveryState::Delivered).await;
    let d = delivery(&a, &want).unwrap();
    assert_eq!(d.attempts, 4, "{d:?}");
    assert_eq!(d.last_error, None);
    // And the operator counts them so.
    let metrics = agentrun_e2e::get_ok(s.operator_config.metrics_port, "/metrics").await;
    for line in [
        r#"agentrun_notifications_total{channel="team",outcome="retry"} 3"#,
        r#"agentrun_notifications_total{channel="team",outcome="delivered"} 1"#,
        r#"agentrun_notification_latency_seconds_count{channel="team"} 1"#,
    ] {
        assert!(
            metrics.lines().any(|l| l == line),
            "no {line} in:\n{metrics}"
        );
    }
    s.finish().await;
}

/// Nobody decides in time: the expiry is told to the request's channels,
/// and the request is not sent again.
#[tokio::test]
async fn an_expiry_is_told() {
    let r = Receiver::start().await;
    let s = setup(
        "notify-expiry",
        &r,
        "channels:\n- {name: team, url: '{R}/team', default: true}\n",
        true,
        None,
    )
    .await;
    let name = gated_run(
        &s,
        "refund",
        json!({"question": "ok?", "timeout": "3s", "onTimeout": "Reject"}),
    )
    .await;
    let got = r.wait_for("/team", 2, TIMEOUT).await;
    assert_eq!(got[0].header("x-agentrun-event"), Some("requested"));
    assert_eq!(got[1].header("x-agentrun-event"), Some("expired"));
    let body = got[1].json();
    assert_eq!(body["event"], "expired");
    assert_eq!(body["approval"]["phase"], "Expired");
    assert_eq!(body["approval"]["decidedBy"], "agentrun-operator");
    assert_no_more(&r, "/team", 2).await;
    let a = s.approvals().get(&name).await.unwrap();
    assert_eq!(
        delivery(&a, &id(&a, "expired", "team")).map(|d| d.state),
        Some(DeliveryState::Delivered)
    );
    s.wait_run("refund", "Failed", TIMEOUT, |r| {
        status(r).phase == Some(RunPhase::Failed)
    })
    .await;
    s.finish().await;
}

/// A run deleted as soon as it finishes (`ttlSecondsAfterFinished: 0`)
/// still has its decision told, even when the first attempt fails: the
/// notifier's finalizer keeps the Approval until the retry delivers, then
/// lets it go.
#[tokio::test]
async fn a_run_deleted_at_once_still_has_its_decision_told() {
    let r = Receiver::start().await;
    // The request, then the decision's first attempt fails.
    r.script("/team", [Reply::Status(200), Reply::Status(503)]);
    let s = setup(
        "notify-ttl-zero",
        &r,
        "channels:\n- {name: team, url: '{R}/team', default: true}\n",
        true,
        None,
    )
    .await;
    let mut step = sim_step("refund", "NonIdempotent", json!({}));
    step["approval"] = json!({"question": "ok?"});
    s.create_run(
        "refund",
        json!({"ttlSecondsAfterFinished": 0, "steps": [step]}),
    )
    .await;
    let name = s.approval_of("refund", None, TIMEOUT).await;
    r.wait_for("/team", 1, TIMEOUT).await;
    let a = wait_approval(&s, &name, "the notifier's finalizer", |a| {
        a.finalizers()
            .iter()
            .any(|f| f == "agentrun.dev/notifications")
    })
    .await;
    s.decide(&name, "Approved", "ok").await;
    // The run finishes and is deleted; the decision arrives on the retry.
    let got = r.wait_for("/team", 3, TIMEOUT).await;
    assert_eq!(got[1].header("x-agentrun-event"), Some("decided"));
    assert_eq!(got[2].header("x-agentrun-event"), Some("decided"));
    assert_eq!(
        got[2].header("x-agentrun-delivery"),
        Some(id(&a, "decided", "team").as_str())
    );
    assert_eq!(got[2].json()["approval"]["decision"], "Approved");
    // Then nothing holds the Approval or the run any more.
    let deadline = tokio::time::Instant::now() + TIMEOUT;
    loop {
        let run_gone = s.runs().get_opt("refund").await.unwrap().is_none();
        let apv_gone = s.approvals().get_opt(&name).await.unwrap().is_none();
        if run_gone && apv_gone {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "run gone: {run_gone}, approval gone: {apv_gone}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_no_more(&r, "/team", 3).await;
    s.finish().await;
}
