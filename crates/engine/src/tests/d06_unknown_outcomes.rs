//! D6: an attempt that may have acted is never retried blindly. A timeout, a
//! failure without `"effect": "NotApplied"`, an unreadable result: a
//! NonIdempotent step asks a person (Reconcile), and only their `Retry` runs
//! it again, with the same key. Disruptions back off, and a step disrupted
//! again and again says so (D16).

use super::*;

const REFUND: &str = "run-refund-d5e7dc";

fn refund(retries: i32) -> World {
    World::new(
        AgentRun::test().with_steps([step("refund")
            .with_effect(Effect::NonIdempotent)
            .with_timeout("3s")
            .with_retry(retries, "1s", "1s")]),
    )
}

#[test]
fn a_timed_out_non_idempotent_attempt_asks_a_person_instead_of_retrying() {
    let mut w = refund(1);
    w.settle();
    w.update_pod(&format!("{REFUND}-r1-a1"), |p| p.running());
    w.settle();
    w.advance(5);
    w.settle();
    let c = cp(&w, "refund", 1);
    assert_eq!(
        (c.phase, c.effect, c.failures),
        (
            StepPhase::WaitingForApproval,
            Some(EffectOutcome::Unknown),
            1
        )
    );
    let name = c.approval.clone().unwrap();
    assert_eq!(w.approvals[&name].spec.kind, ApprovalKind::Reconcile);
    assert!(c.message.unwrap().contains("timed out after 3s"));
    // The stopped Pod ends; nothing else starts, however long it waits.
    w.update_pod(&format!("{REFUND}-r1-a1"), |p| p.exited(137, ""));
    w.advance(3600);
    w.settle();
    assert_eq!(w.created, [format!("{REFUND}-r1-a1")], "no blind retry");
    // A person says it did not act: attempt 2, same key.
    assert!(w.decide_approval(&name, Answer::Retry, "alice"));
    w.settle();
    assert_eq!(w.created.len(), 2);
    let again = w.pod(&format!("{REFUND}-r1-a2"));
    assert_eq!(
        again.metadata.labels.unwrap()[labels::IDEMPOTENCY_KEY],
        cp(&w, "refund", 1).idempotency_key
    );
}

#[test]
fn a_failed_attempt_is_retried_only_if_it_said_it_did_not_act() {
    struct Case {
        name: &'static str,
        message: &'static str,
        retried: bool,
    }
    let cases = [
        Case {
            name: "exit 1 with no message",
            message: "",
            retried: false,
        },
        Case {
            name: "exit 1 with an error but no effect",
            message: r#"{"result": {"error": "gateway timeout"}}"#,
            retried: false,
        },
        Case {
            name: "exit 1, NotApplied",
            message: NOT_APPLIED,
            retried: true,
        },
    ];
    for c in cases {
        let mut w = refund(2);
        w.settle();
        w.update_pod(&format!("{REFUND}-r1-a1"), |p| p.exited(1, c.message));
        w.settle();
        w.advance(2);
        w.settle();
        let cp = cp(&w, "refund", 1);
        if c.retried {
            assert_eq!(cp.phase, StepPhase::Running, "{}", c.name);
            assert!(
                w.pods.contains_key(&format!("{REFUND}-r1-a2")),
                "{}",
                c.name
            );
            assert_eq!(cp.effect, None, "{}: nothing acted", c.name);
        } else {
            assert_eq!(
                (cp.phase, cp.effect),
                (StepPhase::WaitingForApproval, Some(EffectOutcome::Unknown)),
                "{}",
                c.name
            );
            assert_eq!(w.created.len(), 1, "{}: no blind retry", c.name);
        }
    }
}

#[test]
fn an_unreadable_result_of_a_non_idempotent_step_asks_a_person() {
    let mut w = refund(1);
    w.settle();
    w.update_pod(&format!("{REFUND}-r1-a1"), |p| p.succeeded("refunded!"));
    w.settle();
    let c = cp(&w, "refund", 1);
    assert_eq!(
        (c.phase, c.effect),
        (StepPhase::WaitingForApproval, Some(EffectOutcome::Unknown))
    );
    assert_eq!(w.created.len(), 1);
}

#[test]
fn a_failure_of_an_idempotent_step_is_retried_with_the_same_key() {
    let mut w = World::new(AgentRun::test().with_steps([step("a").with_retry(1, "1s", "1s")]));
    w.settle();
    w.update_pod("run-a-2b8d3c-r1-a1", |p| p.exited(1, ""));
    w.settle();
    w.advance(2);
    w.settle();
    let a = cp(&w, "a", 1);
    assert_eq!(
        (a.phase, a.effect),
        (StepPhase::Running, Some(EffectOutcome::Unknown))
    );
    assert!(w.pods.contains_key("run-a-2b8d3c-r1-a2"));
}

#[test]
fn a_reconcile_retry_runs_exactly_the_step_it_was_asked_about() {
    let mut w = refund(1);
    w.settle();
    w.update_pod(&format!("{REFUND}-r1-a1"), |p| p.exited(1, ""));
    w.settle();
    let first = cp(&w, "refund", 1).approval.unwrap();
    assert_eq!(
        w.approvals[&first].spec.step_digest,
        cp(&w, "refund", 1).step_digest,
        "the Reconcile question is bound to the step as it is"
    );
    // The step is edited while the question is open: it is asked again.
    w.run.spec.steps[0].container.as_mut().unwrap().args = vec!["--amount=900".into()];
    w.run.metadata.generation = Some(2);
    w.settle();
    let second = cp(&w, "refund", 1).approval.unwrap();
    assert_ne!(second, first);
    assert_eq!(
        w.approvals[&first].status.as_ref().unwrap().phase,
        ApprovalPhase::Superseded
    );
    assert!(
        !w.decide_approval(&first, Answer::Retry, "alice"),
        "the old question is closed"
    );
    assert!(w.decide_approval(&second, Answer::Retry, "alice"));
    w.settle();
    let pod = w.pod(&format!("{REFUND}-r1-a2"));
    assert_eq!(
        pod.spec.unwrap().containers[0].args,
        Some(vec!["--amount=900".into()])
    );
}

#[test]
fn repeated_disruptions_back_off_and_the_run_says_it_is_stalled() {
    let mut w = World::new(AgentRun::test().with_steps([step("a").with_retry(0, "10s", "40s")]));
    w.settle();
    // Evicted before it ever starts, again and again.
    let mut created_at = Vec::new();
    for n in 1..=4 {
        let pod = format!("run-a-2b8d3c-r1-a{n}");
        w.update_pod(&pod, |p| p.evicted(false));
        w.settle();
        let a = cp(&w, "a", 1);
        assert_eq!(a.disruptions, n, "disruption {n}");
        // Wait for its next attempt, whenever that is.
        let mut waited = 0;
        while !w.pods.contains_key(&format!("run-a-2b8d3c-r1-a{}", n + 1)) {
            w.advance(1);
            waited += 1;
            w.settle();
            assert!(waited < 120, "attempt {} never came", n + 1);
        }
        created_at.push(waited);
    }
    // At once after the first, then the retry backoff: 10 s, 20 s, 40 s.
    assert_eq!(created_at, [0, 10, 20, 40]);
    let (status, reason) = condition_of(&w, ConditionType::Stalled);
    assert_eq!(
        (status.as_str(), reason.as_str()),
        ("True", "RepeatedlyDisrupted")
    );
    // The cluster heals: the step gets through and the stall clears.
    w.succeed("run-a-2b8d3c-r1-a5", "");
    assert_eq!(w.status().phase, Some(RunPhase::Succeeded));
    assert_eq!(condition_of(&w, ConditionType::Stalled).0, "False");
}
