//! D9 and the other run limits: the tokens of every attempt, budgets, deadline, cancel, suspend, and the tally the metrics read.

use super::*;

#[test]
fn run_limits() {
    struct Case {
        name: &'static str,
        run: AgentRun,
        act: fn(&mut World),
        reason: Reason,
        budget_condition: bool,
    }
    let cases = [
        Case {
            name: "token budget counts every attempt",
            run: AgentRun::test()
                .with_steps([step("a").with_retry(3, "1s", "1s"), step("b")])
                .with_budget(Some(100), None),
            act: |w| {
                w.update_pod("run-a-2b8d3c-r1-a1", |p| {
                    p.exited(1, &ok_message(json!(null), 60))
                });
                w.settle();
                w.advance(1);
                w.settle();
                w.succeed("run-a-2b8d3c-r1-a2", &ok_message(json!(null), 60));
            },
            reason: Reason::TokenBudgetExceeded,
            budget_condition: true,
        },
        Case {
            name: "step execution budget",
            run: AgentRun::test()
                .with_steps([step("a").with_retry(3, "1s", "1s")])
                .with_budget(None, Some(1)),
            act: |w| {
                w.update_pod("run-a-2b8d3c-r1-a1", |p| p.exited(1, ""));
                w.settle();
                w.advance(1);
                w.settle();
            },
            reason: Reason::StepExecutionBudgetExceeded,
            budget_condition: true,
        },
        Case {
            name: "active deadline stops the running step",
            run: AgentRun::test().with_steps([step("a")]).with_deadline(600),
            act: |w| {
                w.update_pod("run-a-2b8d3c-r1-a1", |p| p.running());
                assert_eq!(w.settle().requeue_after, secs(600));
                w.advance(600);
                let d = w.step();
                assert_eq!(deletes(&d), ["run-a-2b8d3c-r1-a1"]);
                w.update_pod("run-a-2b8d3c-r1-a1", |p| p.exited(137, ""));
                w.settle();
            },
            reason: Reason::DeadlineExceeded,
            budget_condition: false,
        },
    ];
    for c in cases {
        let mut w = World::new(c.run);
        w.settle();
        (c.act)(&mut w);
        w.settle();
        assert_eq!(w.status().phase, Some(RunPhase::Failed), "{}", c.name);
        assert_eq!(
            condition_of(&w, ConditionType::Succeeded),
            ("False".into(), c.reason.into()),
            "{}",
            c.name
        );
        let budget = w
            .status()
            .conditions
            .iter()
            .any(|x| x.type_ == ConditionType::BudgetExceeded && x.status == "True");
        assert_eq!(budget, c.budget_condition, "{}", c.name);
        assert!(w.live_pods().is_empty(), "{}", c.name);
    }
}

#[test]
fn suspend_starts_no_pods_and_lets_a_running_step_finish() {
    let mut w = World::new(two_steps());
    w.settle();
    w.run.spec.suspend = true;
    w.succeed("run-a-2b8d3c-r1-a1", "");
    assert_eq!(
        cp(&w, "a", 1).phase,
        StepPhase::Succeeded,
        "the running step is checkpointed"
    );
    assert!(!w.pods.contains_key("run-b-59c772-r1-a1"));
    assert_eq!(
        condition_of(&w, ConditionType::Progressing),
        ("False".into(), Reason::Suspended.into())
    );
    assert_eq!(w.decide().requeue_after, None, "nothing to wait for");
    w.run.spec.suspend = false;
    w.settle();
    assert!(w.pods.contains_key("run-b-59c772-r1-a1"));
}

#[test]
fn tokens_of_compensations_and_of_unusable_results_count() {
    let mut w = World::new(AgentRun::test().with_steps([step("a").with_compensate(), step("b")]));
    w.settle();
    w.succeed("run-a-2b8d3c-r1-a1", &ok_message(json!(1), 10));
    // Exit 0, but a message the contract refuses: the tokens it names still count.
    w.succeed(
        "run-b-59c772-r1-a1",
        r#"{"tokens": {"input": 5}, "plan": 3}"#,
    );
    w.succeed("run-a-2b8d3c-r1-c1", &ok_message(json!("reversed"), 100));
    let s = w.status();
    assert_eq!(s.phase, Some(RunPhase::Failed));
    assert_eq!(s.compensations[0].tokens.map(|t| t.total()), Some(100));
    assert_eq!(s.tokens_used, 115);
}

#[test]
fn a_pod_on_a_lost_node_does_not_hold_a_run_past_its_deadline() {
    let mut w = World::new(
        AgentRun::test()
            .with_steps([step("a").with_compensate(), step("b")])
            .with_deadline(60),
    );
    w.settle();
    w.succeed("run-a-2b8d3c-r1-a1", &ok_message(json!(1), 0));
    w.update_pod("run-b-59c772-r1-a1", |p| p.running());
    w.advance(61);
    w.settle();
    // The node never reports the deleted Pod stopped.
    assert!(
        w.pod("run-b-59c772-r1-a1")
            .metadata
            .deletion_timestamp
            .is_some()
    );
    w.advance(crate::testing::GRACE_SECONDS);
    w.settle();
    w.succeed("run-a-2b8d3c-r1-c1", &ok_message(json!("undone"), 0));
    let s = w.status();
    assert_eq!(s.phase, Some(RunPhase::Failed));
    assert_eq!(cp(&w, "b", 1).effect, Some(EffectOutcome::Unknown));
}

/// A timed-out attempt's Pod is stopped, not forgotten: it keeps its result
/// finalizer until it has stopped, and what it reports then — here a refund
/// it did make, and its tokens — is recorded and reaches the compensation.
#[test]
fn a_timed_out_attempt_still_reports_what_its_pod_says_when_it_stops() {
    let mut w = World::new(
        AgentRun::test().with_steps([step("a")
            .with_effect(Effect::NonIdempotent)
            .with_timeout("1m")
            .with_compensate()]),
    );
    w.settle();
    w.update_pod("run-a-2b8d3c-r1-a1", |p| p.running());
    w.advance(62);
    let d = w.step();
    assert_eq!(deletes(&d), ["run-a-2b8d3c-r1-a1"]);
    assert!(releases(&d).is_empty(), "the Pod keeps its finalizer");
    w.settle();
    let a = cp(&w, "a", 1);
    assert_eq!((a.phase, a.stopping), (StepPhase::Failed, true));
    assert!(
        creates(&w.decide()).is_empty(),
        "no compensation while it stops"
    );
    // SIGTERM arrives after the refund was made: the step finishes anyway.
    w.advance(5);
    w.update_pod("run-a-2b8d3c-r1-a1", |p| {
        p.succeeded(&ok_message(json!({"refund": "re_123"}), 40))
    });
    let d = w.step();
    assert_eq!(
        releases(&d),
        ["run-a-2b8d3c-r1-a1"],
        "released once recorded"
    );
    let a = cp(&w, "a", 1);
    assert_eq!(a.phase, StepPhase::Failed, "the outcome stays as committed");
    assert!(!a.stopping);
    assert_eq!(a.result, Some(json!({"refund": "re_123"})));
    assert_eq!(a.tokens.map(|t| t.total()), Some(40));
    assert_eq!(w.status().tokens_used, 40);
    w.settle();
    let ctx: serde_json::Value = serde_json::from_str(
        &w.pod("run-a-2b8d3c-r1-c1").metadata.annotations.unwrap()[labels::CONTEXT],
    )
    .unwrap();
    assert_eq!(ctx["results"][0]["result"], json!({"refund": "re_123"}));
}

/// A stopping attempt whose Pod is force-removed has nothing left to report:
/// the checkpoint stops saying it waits for one.
#[test]
fn a_stopping_attempt_whose_pod_is_removed_stops_waiting_for_its_report() {
    let mut w = World::new(AgentRun::test().with_steps([step("a").with_timeout("1m")]));
    w.settle();
    w.update_pod("run-a-2b8d3c-r1-a1", |p| p.running());
    w.advance(62);
    w.settle();
    assert!(cp(&w, "a", 1).stopping);
    w.pods.remove("run-a-2b8d3c-r1-a1");
    w.settle();
    let a = cp(&w, "a", 1);
    assert!(!a.stopping);
    assert!(
        a.message
            .as_deref()
            .is_some_and(|m| m.ends_with("its Pod was removed before it reported")),
        "{:?}",
        a.message
    );
    assert_eq!(w.status().phase, Some(RunPhase::Failed));
}

/// Cancel, deadline and budget close a running attempt the same way: the
/// tokens its Pod reports while it stops still count (D9).
#[test]
fn a_cancelled_attempt_still_counts_the_tokens_its_pod_reports() {
    let mut w = World::new(AgentRun::test().with_steps([step("a"), step("b")]));
    w.settle();
    w.update_pod("run-a-2b8d3c-r1-a1", |p| p.running());
    w.run.spec.cancel = true;
    w.settle();
    assert!(cp(&w, "a", 1).stopping);
    assert!(
        w.pod("run-a-2b8d3c-r1-a1")
            .metadata
            .deletion_timestamp
            .is_some()
    );
    assert_ne!(
        w.status().phase,
        Some(RunPhase::Cancelled),
        "not while it stops"
    );
    w.update_pod("run-a-2b8d3c-r1-a1", |p| {
        p.exited(143, r#"{"tokens": {"input": 7, "output": 5}}"#)
    });
    w.settle();
    let a = cp(&w, "a", 1);
    assert_eq!(
        (a.phase, a.stopping, a.result),
        (StepPhase::Failed, false, None)
    );
    assert_eq!(w.status().tokens_used, 12);
    assert_eq!(w.status().phase, Some(RunPhase::Cancelled));
    assert!(w.pods.is_empty(), "released and gone: {:?}", w.pods.keys());
}

/// The metrics read what the engine decided, once per decision: a step's
/// success and the next launch in one tally; a timed-out attempt is one
/// failure (it used to count twice, once per Event it caused).
#[test]
fn each_decision_tallies_what_it_did() {
    let tally = |started, succeeded, failed, disrupted, tokens| Tally {
        started,
        succeeded,
        failed,
        disrupted,
        replans: 0,
        tokens,
        ..Tally::default()
    };
    let mut w = World::new(AgentRun::test().with_steps([
        step("a"),
        step("b").with_timeout("1m").with_retry(1, "1s", "1s"),
        step("c"),
    ]));
    assert_eq!(w.step().tally, tally(1, 0, 0, 0, 0), "a launched");
    w.update_pod("run-a-2b8d3c-r1-a1", |p| {
        p.succeeded(&ok_message(json!(1), 7))
    });
    assert_eq!(
        w.step().tally,
        tally(1, 1, 0, 0, 7),
        "a succeeded, b launched"
    );
    w.update_pod("run-b-59c772-r1-a1", |p| p.running());
    w.advance(62);
    assert_eq!(w.step().tally, tally(0, 0, 1, 0, 0), "b timed out once");
    assert_eq!(
        w.decide().tally,
        Tally::default(),
        "nothing new: nothing counted"
    );
}
