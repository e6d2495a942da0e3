//! D6 with a verify probe: an attempt that may have acted is settled by asking
//! the system it changed, with the step's own key, before any person is woken.

use super::*;
use agentrun_api::{Provenance, StepContainer};

const PAY: &str = "run-pay-7fe073";

fn pay(retries: i32) -> World {
    let mut s = step("pay")
        .with_effect(Effect::NonIdempotent)
        .with_timeout("30s")
        .with_retry(retries, "5s", "5s");
    s.verify = Some(Box::new(StepContainer {
        image: "tool:1".into(),
        args: vec!["verify".into()],
        ..StepContainer::default()
    }));
    World::new(AgentRun::test().with_steps([s, step("ship")]))
}

/// The step's attempt 1 is evicted after it started: it may have acted.
fn lost_attempt(retries: i32) -> World {
    let mut w = pay(retries);
    w.settle();
    w.update_pod(&format!("{PAY}-r1-a1"), |p| p.running());
    w.settle();
    w.update_pod(&format!("{PAY}-r1-a1"), |p| p.evicted(true));
    w.settle();
    w
}

#[test]
fn a_probe_that_finds_the_effect_applied_records_the_step_and_wakes_nobody() {
    let mut w = lost_attempt(1);
    let c = cp(&w, "pay", 1);
    assert_eq!(
        (c.phase, c.effect),
        (StepPhase::Verifying, Some(EffectOutcome::Unknown))
    );
    let probe = w.pod(&format!("{PAY}-r1-v1"));
    let l = probe.metadata.labels.clone().unwrap();
    assert_eq!(l[labels::ROLE], "verify");
    assert_eq!(
        l[labels::IDEMPOTENCY_KEY],
        c.idempotency_key,
        "the step's own key"
    );
    assert_eq!(
        probe.spec.unwrap().containers[0].args,
        Some(vec!["verify".to_owned()])
    );
    w.succeed(
        &format!("{PAY}-r1-v1"),
        r#"{"effect": "Applied", "result": {"paymentId": "p-9"}, "tokens": {"input": 4}}"#,
    );
    let c = cp(&w, "pay", 1);
    assert_eq!(
        (c.phase, c.effect, c.provenance, c.result.clone()),
        (
            StepPhase::Succeeded,
            Some(EffectOutcome::Applied),
            Some(Provenance::Verified),
            Some(json!({"paymentId": "p-9"}))
        )
    );
    assert!(w.approvals.is_empty(), "nobody was asked");
    assert_eq!(w.status().tokens_used, 4, "the probe's tokens count");
    assert!(
        w.pods.contains_key("run-ship-c7dd65-r1-a1"),
        "the run goes on"
    );
    assert!(
        !w.created.contains(&format!("{PAY}-r1-a2")),
        "the step never ran again"
    );
}

#[test]
fn a_probe_that_finds_nothing_done_lets_the_step_retry_with_the_same_key() {
    let mut w = lost_attempt(1);
    w.succeed(&format!("{PAY}-r1-v1"), r#"{"effect": "NotApplied"}"#);
    let c = cp(&w, "pay", 1);
    assert_eq!(c.phase, StepPhase::Running);
    let a2 = w.pod(&format!("{PAY}-r1-a2"));
    assert_eq!(
        a2.metadata.labels.unwrap()[labels::IDEMPOTENCY_KEY],
        c.idempotency_key
    );
    assert!(w.approvals.is_empty());
}

#[test]
fn a_probe_that_cannot_tell_asks_a_person_with_what_it_saw() {
    let mut w = lost_attempt(1);
    w.succeed(
        &format!("{PAY}-r1-v1"),
        r#"{"effect": "Unknown", "result": {"gateway": "timeout"}}"#,
    );
    let c = cp(&w, "pay", 1);
    assert_eq!(c.phase, StepPhase::WaitingForApproval);
    let a = &w.approvals[c.approval.as_deref().unwrap()];
    assert_eq!(a.spec.kind, ApprovalKind::Reconcile);
    let reason = &a.spec.context.as_ref().unwrap().reason;
    assert!(
        reason.contains(
            r#"its verify probe could not tell (it answered Unknown: {"gateway":"timeout"})"#
        ),
        "{reason}"
    );
}

#[test]
fn a_probe_that_keeps_failing_asks_a_person_and_is_bounded() {
    let mut w = lost_attempt(1);
    for n in 1..=3 {
        let pod = format!("{PAY}-r1-v{n}");
        w.update_pod(&pod, |p| p.exited(1, "connection refused"));
        w.settle();
        w.advance(10);
        w.settle();
    }
    let probes = w.created.iter().filter(|n| n.contains("-r1-v")).count();
    assert_eq!(probes, 3, "three probe attempts: {:?}", w.created);
    let c = cp(&w, "pay", 1);
    assert_eq!(c.phase, StepPhase::WaitingForApproval);
    let reason = &w.approvals[c.approval.as_deref().unwrap()]
        .spec
        .context
        .as_ref()
        .unwrap()
        .reason;
    assert!(reason.contains("its verify probe failed"), "{reason}");
}

#[test]
fn a_second_unknown_outcome_asks_a_person_the_probe_ran_once() {
    let mut w = lost_attempt(2);
    w.succeed(&format!("{PAY}-r1-v1"), r#"{"effect": "NotApplied"}"#);
    // Attempt 2 fails without saying it did not act.
    w.update_pod(&format!("{PAY}-r1-a2"), |p| p.exited(1, ""));
    w.settle();
    let c = cp(&w, "pay", 1);
    assert_eq!(c.phase, StepPhase::WaitingForApproval);
    assert_eq!(
        w.created.iter().filter(|n| n.contains("-r1-v")).count(),
        1,
        "one probe per step and revision"
    );
}

#[test]
fn the_probe_waits_until_the_timed_out_attempt_has_stopped() {
    let mut w = pay(1);
    w.settle();
    w.update_pod(&format!("{PAY}-r1-a1"), |p| p.running());
    w.advance(40);
    w.settle();
    assert_eq!(cp(&w, "pay", 1).phase, StepPhase::Verifying);
    assert!(
        !w.pods.contains_key(&format!("{PAY}-r1-v1")),
        "nothing with the key runs while the attempt stops (D2)"
    );
    w.update_pod(&format!("{PAY}-r1-a1"), |p| p.exited(137, ""));
    w.settle();
    assert!(w.pods.contains_key(&format!("{PAY}-r1-v1")));
}
