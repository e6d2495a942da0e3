//! D16: a creation the API server refuses shows on the run.

use super::*;

fn refusal(name: &str, cause: RefusalCause) -> Refusal {
    Refusal {
        name: name.into(),
        cause,
        message: format!("pods \"{name}\" is forbidden: violates PodSecurity"),
    }
}

#[test]
fn a_refused_step_pod_stalls_the_run_visibly() {
    struct Case {
        name: &'static str,
        cause: RefusalCause,
        reason: Reason,
        /// The step's phase after the refusal.
        phase: StepPhase,
        failures: i32,
    }
    let cases = [
        Case {
            name: "rejected: a failed attempt, retried as a new one",
            cause: RefusalCause::Rejected,
            reason: Reason::FailedCreate,
            phase: StepPhase::Pending,
            failures: 1,
        },
        Case {
            name: "transient: the same attempt waits, visibly",
            cause: RefusalCause::Transient,
            reason: Reason::FailedCreate,
            phase: StepPhase::Running,
            failures: 0,
        },
        Case {
            name: "a foreign object holds the name",
            cause: RefusalCause::NameTaken,
            reason: Reason::NameTaken,
            phase: StepPhase::Running,
            failures: 0,
        },
    ];
    for c in cases {
        let mut w = World::new(AgentRun::test().with_steps([step("a").with_retry(1, "10s", "1m")]));
        // The launch is written; the create is refused.
        let d = w.decide();
        w.run.status = Some(d.status);
        w.refused = vec![refusal("run-a-2b8d3c-r1-a1", c.cause)];
        let d = w.step();
        assert!(creates(&d).is_empty(), "{}: not sent again at once", c.name);
        assert!(
            d.actions.iter().any(|a| matches!(a, Action::Event { type_: EventType::Warning, reason, message } if *reason == Reason::FailedCreate && message.contains("violates PodSecurity"))),
            "{}: a Warning Event with the API's message: {:?}",
            c.name,
            d.actions
        );
        let stalled = w
            .status()
            .conditions
            .into_iter()
            .find(|x| x.type_ == ConditionType::Stalled)
            .expect("Stalled");
        assert_eq!(
            (stalled.status.as_str(), stalled.reason.as_str()),
            ("True", c.reason.as_str()),
            "{}",
            c.name
        );
        assert!(stalled.message.contains("run-a-2b8d3c-r1-a1"), "{}", c.name);
        let a = cp(&w, "a", 1);
        assert_eq!((a.phase, a.failures), (c.phase, c.failures), "{}", c.name);
        // The cause goes away: the next try creates the Pod and the stall clears.
        w.refused.clear();
        w.advance(20);
        w.settle();
        let want = if c.cause == RefusalCause::Rejected {
            "run-a-2b8d3c-r1-a2"
        } else {
            "run-a-2b8d3c-r1-a1"
        };
        assert_eq!(w.created, [want], "{}", c.name);
        assert_eq!(
            condition_of(&w, ConditionType::Stalled).0,
            "False",
            "{}",
            c.name
        );
    }
}

#[test]
fn a_step_pod_rejected_past_its_retries_fails_the_run_with_the_api_message() {
    let mut w = World::new(AgentRun::test().with_steps([step("a")]));
    let d = w.decide();
    w.run.status = Some(d.status);
    w.refused = vec![refusal("run-a-2b8d3c-r1-a1", RefusalCause::Rejected)];
    w.settle();
    assert_eq!(w.status().phase, Some(RunPhase::Failed));
    let a = cp(&w, "a", 1);
    assert!(
        a.message
            .as_deref()
            .is_some_and(|m| m.contains("violates PodSecurity")),
        "{a:?}"
    );
    assert_eq!(
        a.effect,
        Some(EffectOutcome::NotApplied),
        "its Pod never existed"
    );
}

#[test]
fn a_foreign_approval_holding_the_name_stalls_the_gate_visibly() {
    let mut w =
        World::new(AgentRun::test().with_steps([step("a").with_approval(None, OnTimeout::Reject)]));
    let d = w.decide();
    w.run.status = Some(d.status);
    w.refused = vec![refusal("run-a-2b8d3c-r1-approve", RefusalCause::NameTaken)];
    let d = w.step();
    assert!(
        !d.actions
            .iter()
            .any(|a| matches!(a, Action::CreateApproval(_))),
        "{:?}",
        d.actions
    );
    assert_eq!(
        condition_of(&w, ConditionType::Stalled),
        ("True".into(), Reason::NameTaken.into())
    );
}

#[test]
fn a_pod_that_does_not_stop_past_its_grace_period_is_a_visible_stall() {
    let mut w = World::new(
        AgentRun::test().with_steps([step("a").with_timeout("10s").with_retry(1, "1s", "1s")]),
    );
    w.settle();
    w.update_pod("run-a-2b8d3c-r1-a1", |p| p.running());
    w.advance(12);
    w.settle();
    // Timed out: deleted, with a 30 s grace period; its node does not answer.
    assert!(
        w.pod("run-a-2b8d3c-r1-a1")
            .metadata
            .deletion_timestamp
            .is_some()
    );
    w.advance(10);
    w.settle();
    assert!(
        !crate::conditions::is_true(&w.status().conditions, ConditionType::Stalled),
        "within its grace period"
    );
    w.advance(30);
    w.settle();
    let (status, reason) = condition_of(&w, ConditionType::Stalled);
    assert_eq!(
        (status.as_str(), reason.as_str()),
        ("True", "PodNotStopping")
    );
    assert_eq!(
        w.created,
        ["run-a-2b8d3c-r1-a1"],
        "D2: no attempt beside it"
    );
    // The node comes back and the Pod stops: attempt 2 starts, the stall clears.
    w.update_pod("run-a-2b8d3c-r1-a1", |p| p.exited(137, ""));
    w.settle();
    assert!(w.pods.contains_key("run-a-2b8d3c-r1-a2"));
    assert_eq!(condition_of(&w, ConditionType::Stalled).0, "False");
}

/// A stalled run whose next reconcile sends the refused creation again
/// writes no status: its conditions stand until the creation lands. (They
/// flipped — Progressing True, then False again once refused — so every
/// reconcile wrote the status twice, and each write woke the next
/// reconcile at once, past every backoff: 40 reconciles a second for one
/// run whose Pod the API server kept refusing.)
#[test]
fn sending_a_refused_creation_again_writes_no_status() {
    for cause in [RefusalCause::Transient, RefusalCause::NameTaken] {
        let mut w = World::new(AgentRun::test().with_steps([step("a")]));
        let d = w.decide();
        w.run.status = Some(d.status);
        w.refused = vec![refusal("run-a-2b8d3c-r1-a1", cause)];
        w.step();
        assert_eq!(condition_of(&w, ConditionType::Stalled).0, "True");
        // Backoff over: the next reconcile sends the Pod again.
        w.refused.clear();
        w.advance(1);
        let d = w.decide();
        assert_eq!(creates(&d), ["run-a-2b8d3c-r1-a1"], "{cause:?}");
        assert_eq!(
            d.status.conditions,
            w.status().conditions,
            "{cause:?}: the conditions stand while it is sent again"
        );
    }
}
