//! An operator that dies around a send: the one repeat the contract allows, with the
//! same delivery id, and a pending retry resumed after a restart.

use std::time::Duration;

use agentrun_e2e::support::receiver::{Receiver, Reply};
use agentrun_operator::api::DeliveryState;
use serde_json::json;

use super::{
    TIMEOUT, assert_no_more, assert_signed, deliveries, delivery, gated_run, id, setup,
    wait_approval, wait_state,
};

/// The operator dies right after a send, before recording it: the restarted
/// operator sends again with the same delivery id (the one repeat the
/// contract allows), and records one delivered attempt.
#[tokio::test]
async fn a_crash_between_send_and_record_repeats_it_with_the_same_id() {
    let r = Receiver::start().await;
    let mut s = setup(
        "notify-crash-send",
        &r,
        "channels:\n- {name: team, url: '{R}/team', default: true, hmacKeyRef: hmac}\n",
        true,
        Some("after-notify-send:1"),
    )
    .await;
    let name = gated_run(&s, "refund", json!({"question": "ok?"})).await;
    s.wait_operator_crash(TIMEOUT).await;
    let first = r.wait_for("/team", 1, TIMEOUT).await;
    let a = s.approvals().get(&name).await.unwrap();
    assert!(
        deliveries(&a).iter().all(|d| d.attempts == 0),
        "the send was not recorded before the crash: {:?}",
        deliveries(&a)
    );
    s.start_operator(None);
    let got = r.wait_for("/team", 2, TIMEOUT).await;
    assert_no_more(&r, "/team", 2).await;
    assert_eq!(
        got[1].header("x-agentrun-delivery"),
        first[0].header("x-agentrun-delivery"),
        "the repeat carries the same delivery id"
    );
    assert_eq!(got[0].body, got[1].body);
    assert_signed(&got[1]);
    let want = id(&a, "requested", "team");
    let a = wait_state(&s, &name, &want, DeliveryState::Delivered).await;
    assert_eq!(delivery(&a, &want).unwrap().attempts, 1);
    s.finish().await;
}

/// SIGKILLed while a retry waits: the restarted operator reads the record,
/// waits out the recorded time and delivers with the same id; nothing
/// delivered is sent again.
#[tokio::test]
async fn a_killed_operator_resumes_a_pending_delivery_after_restart() {
    let r = Receiver::start().await;
    r.script("/team", [Reply::RetryAfter(503, 6)]);
    let mut s = setup(
        "notify-kill-resume",
        &r,
        "channels:\n- {name: team, url: '{R}/team', default: true}\n- {name: audit, url: '{R}/audit', default: true}\n",
        true,
        None,
    )
    .await;
    let name = gated_run(&s, "refund", json!({"question": "ok?"})).await;
    let a = s.approvals().get(&name).await.unwrap();
    let (team, audit) = (id(&a, "requested", "team"), id(&a, "requested", "audit"));
    let recorded = wait_approval(&s, &name, "attempt 1 recorded", |a| {
        delivery(a, &team).is_some_and(|d| d.attempts == 1)
            && delivery(a, &audit).is_some_and(|d| d.state == DeliveryState::Delivered)
    })
    .await;
    let d = delivery(&recorded, &team).unwrap();
    assert_eq!(d.state, DeliveryState::Pending);
    assert!(
        d.last_error.as_deref().unwrap().starts_with("HTTP 503"),
        "{d:?}"
    );
    assert!(d.next_attempt_at.is_some());
    s.kill_operator().await;
    let killed = std::time::Instant::now();
    assert_eq!(r.received("/team").len(), 1, "no retry before the kill");
    s.start_operator(None);
    let got = r.wait_for("/team", 2, TIMEOUT).await;
    assert_eq!(got[1].header("x-agentrun-delivery"), Some(team.as_str()));
    let gap = got[1].at.duration_since(got[0].at);
    assert!(
        gap >= Duration::from_secs(5),
        "the retry came {gap:?} after the first attempt; Retry-After asked for 6 s"
    );
    assert!(got[1].at > killed);
    assert_no_more(&r, "/team", 2).await;
    assert_no_more(&r, "/audit", 1).await;
    let a = wait_state(&s, &name, &team, DeliveryState::Delivered).await;
    assert_eq!(delivery(&a, &team).unwrap().attempts, 2);
    s.finish().await;
}
