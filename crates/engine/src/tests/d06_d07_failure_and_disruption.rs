//! D6/D7: a failure spends retries, a disruption does not; timeouts; the three facts of an attempt that may have acted.

use super::*;

#[test]
fn failures_consume_retries_with_exponential_backoff() {
    let mut w = World::new(AgentRun::test().with_steps([step("a").with_retry(2, "10s", "15s")]));
    w.settle();
    w.update_pod("run-a-2b8d3c-r1-a1", |p| {
        p.exited(1, &ok_message(json!(null), 5))
    });
    let d = w.step();
    let a = cp(&w, "a", 1);
    assert_eq!((a.phase, a.failures, a.attempt), (StepPhase::Pending, 1, 1));
    assert_eq!(a.next_attempt_at.as_ref().map(|t| t.0), Some(t(10)));
    assert_eq!(
        w.status().tokens_used,
        5,
        "D9: a failed attempt's tokens count"
    );
    assert!(events(&d).contains(&Reason::StepRetrying));
    let wait = w.step();
    assert!(creates(&wait).is_empty(), "no attempt before the backoff");
    assert_eq!(
        wait.requeue_after,
        secs(10),
        "requeue exactly at the backoff"
    );
    w.advance(10);
    let d = w.step();
    assert_eq!(creates(&d), ["run-a-2b8d3c-r1-a2"]);
    assert_eq!(
        cp(&w, "a", 1).idempotency_key,
        a.idempotency_key,
        "D1: same key across attempts"
    );
    w.settle();
    w.update_pod("run-a-2b8d3c-r1-a2", |p| p.exited(2, ""));
    w.settle();
    assert_eq!(
        cp(&w, "a", 1).next_attempt_at.as_ref().map(|t| t.0),
        Some(t(25)),
        "doubled to 20s, capped at 15s"
    );
    w.advance(15);
    w.settle();
    w.update_pod("run-a-2b8d3c-r1-a3", |p| p.exited(1, ""));
    w.settle();
    let a = cp(&w, "a", 1);
    assert_eq!((a.phase, a.failures), (StepPhase::Failed, 3));
    assert!(a.message.unwrap().contains("no retries left"));
    assert_ended(&w, RunPhase::Failed, Reason::StepFailed);
}

#[test]
fn disruptions_do_not_consume_retries() {
    struct Case {
        name: &'static str,
        disrupt: fn(&mut World),
    }
    let cases = [
        Case {
            name: "evicted",
            disrupt: |w| w.update_pod("run-a-2b8d3c-r1-a1", |p| p.evicted(true)),
        },
        Case {
            name: "preempted",
            disrupt: |w| {
                w.update_pod("run-a-2b8d3c-r1-a1", |p| {
                    let mut p = p.exited(137, "");
                    p.status.as_mut().unwrap().reason = Some("Preempted".into());
                    p
                })
            },
        },
        Case {
            name: "deleted before finishing",
            disrupt: |w| {
                let now = w.now;
                w.update_pod("run-a-2b8d3c-r1-a1", |p| p.exited(143, "").deleting(now))
            },
        },
    ];
    for c in cases {
        let mut w = World::new(AgentRun::test().with_steps([step("a")]));
        w.settle();
        w.update_pod("run-a-2b8d3c-r1-a1", |p| p.running());
        w.settle();
        (c.disrupt)(&mut w);
        w.settle();
        let a = cp(&w, "a", 1);
        assert_eq!(
            (a.failures, a.disruptions, a.attempt),
            (0, 1, 2),
            "{}",
            c.name
        );
        assert_eq!(a.phase, StepPhase::Running, "{}: runs again", c.name);
        assert!(w.pods.contains_key("run-a-2b8d3c-r1-a2"), "{}", c.name);
        assert_eq!(
            w.pod("run-a-2b8d3c-r1-a2").metadata.labels.unwrap()[labels::IDEMPOTENCY_KEY],
            a.idempotency_key,
            "{}: same key",
            c.name
        );
    }
}

/// A Reconcile question superseded while the run still waits on it (a
/// deposed operator acting on an old copy of the run did this) is asked
/// again as a Reconcile question; it never turns into an approval gate for a
/// step that has none (D6).
#[test]
fn a_superseded_reconcile_question_is_asked_again_as_one() {
    let mut w = non_idempotent_a_running();
    w.settle();
    w.update_pod("run-a-2b8d3c-r1-a1", |p| p.evicted(true));
    w.settle();
    let first = "run-a-2b8d3c-r1-reconcile-a1";
    let a = w.approvals.get_mut(first).expect("the Reconcile question");
    a.status = Some(agentrun_api::ApprovalStatus {
        phase: ApprovalPhase::Superseded,
        ..Default::default()
    });
    w.settle();
    let again = "run-a-2b8d3c-r1-reconcile-a1-2";
    assert_eq!(
        w.approvals.keys().map(String::as_str).collect::<Vec<_>>(),
        [first, again],
        "no Approve question is opened"
    );
    assert_eq!(w.approvals[again].spec.kind, ApprovalKind::Reconcile);
    let a = cp(&w, "a", 1);
    assert_eq!(
        (a.phase, a.effect, a.approval.as_deref()),
        (
            StepPhase::WaitingForApproval,
            Some(EffectOutcome::Unknown),
            Some(again)
        )
    );
    assert!(w.decide_approval(again, Answer::Retry, "someone"));
    w.settle();
    assert_eq!(cp(&w, "a", 1).attempt, 2, "the person's answer is acted on");
    assert_eq!(w.created.len(), 2);
}

#[test]
fn a_disrupted_non_idempotent_step_asks_a_person_instead_of_rerunning() {
    let mut w = World::new(
        AgentRun::test().with_steps([step("a").with_effect(Effect::NonIdempotent), step("b")]),
    );
    w.settle();
    w.update_pod("run-a-2b8d3c-r1-a1", |p| p.running());
    w.settle();
    w.update_pod("run-a-2b8d3c-r1-a1", |p| p.evicted(true));
    w.settle();
    let a = cp(&w, "a", 1);
    assert_eq!(
        (a.phase, a.effect),
        (StepPhase::WaitingForApproval, Some(EffectOutcome::Unknown))
    );
    assert_eq!(w.status().phase, Some(RunPhase::WaitingForApproval));
    assert!(w.live_pods().is_empty(), "a durable wait runs no Pods");
    let name = "run-a-2b8d3c-r1-reconcile-a1";
    assert_eq!(w.approvals[name].spec.kind, ApprovalKind::Reconcile);
    assert_eq!(w.created.len(), 1, "no rerun");

    struct Case {
        name: &'static str,
        decision: Answer,
        check: fn(&World),
    }
    let cases = [
        Case {
            name: "Retry reruns with the same key",
            decision: Answer::Retry,
            check: |w| {
                let a = cp(w, "a", 1);
                assert_eq!((a.attempt, a.phase), (2, StepPhase::Running));
                assert_eq!(a.idempotency_key, KEY_A_R1);
            },
        },
        Case {
            name: "MarkSucceeded records it applied, by a person's word, and goes on",
            decision: Answer::MarkSucceeded,
            check: |w| {
                let a = cp(w, "a", 1);
                assert_eq!(
                    (a.phase, a.effect, a.provenance),
                    (
                        StepPhase::Succeeded,
                        Some(EffectOutcome::Applied),
                        Some(agentrun_api::Provenance::Marked)
                    )
                );
                assert!(w.pods.contains_key("run-b-59c772-r1-a1"));
            },
        },
        Case {
            name: "MarkFailed fails the run",
            decision: Answer::MarkFailed,
            check: |w| assert_eq!(w.status().phase, Some(RunPhase::Failed)),
        },
    ];
    for c in cases {
        let mut w2 = w.clone();
        w2.decide_approval(name, c.decision, "kubectl-patch");
        w2.settle();
        (c.check)(&w2);
        let st = w2.approvals[name].status.clone().unwrap();
        assert_eq!(
            (st.phase, st.decided_by.as_deref()),
            (ApprovalPhase::Resolved, Some("kubectl-patch")),
            "{}",
            c.name
        );
    }
}

#[test]
fn a_vanished_pod_reruns_with_the_same_key_or_asks_a_person() {
    // An Idempotent step's Pod costs no write while it runs: if it vanishes
    // (finalizer stripped, then deleted) it is created again, same name, same key.
    let mut w = World::new(AgentRun::test().with_steps([step("a")]));
    w.settle();
    let launched = w.status();
    w.update_pod("run-a-2b8d3c-r1-a1", |p| p.running());
    let seen = w.step();
    assert_eq!(seen.status, launched, "no write just because the Pod runs");
    w.pods.remove("run-a-2b8d3c-r1-a1");
    let again = w.step();
    assert_eq!(creates(&again), ["run-a-2b8d3c-r1-a1"]);
    assert_eq!(cp(&w, "a", 1).attempt, 1);

    // A NonIdempotent step's Pod UID is recorded once seen, so its vanishing
    // is told apart from a create that never happened (D6).
    let mut w = non_idempotent_a_running();
    w.settle();
    assert!(cp(&w, "a", 1).pod_uid.is_some());
    w.pods.remove("run-a-2b8d3c-r1-a1");
    w.settle();
    let a = cp(&w, "a", 1);
    assert_eq!(
        (a.phase, a.disruptions, a.effect),
        (
            StepPhase::WaitingForApproval,
            1,
            Some(EffectOutcome::Unknown)
        )
    );
    assert!(w.approvals.contains_key("run-a-2b8d3c-r1-reconcile-a1"));
    assert_eq!(w.created.len(), 1, "not run again without a person");
}

#[test]
fn a_non_idempotent_step_evicted_before_it_started_simply_reruns() {
    let mut w =
        World::new(AgentRun::test().with_steps([step("a").with_effect(Effect::NonIdempotent)]));
    w.settle();
    w.update_pod("run-a-2b8d3c-r1-a1", |p| p.evicted(false));
    w.settle();
    assert_eq!(cp(&w, "a", 1).attempt, 2);
    assert!(w.approvals.is_empty());
}

#[test]
fn a_timed_out_attempt_is_stopped_counted_and_not_overlapped() {
    let mut w = World::new(
        AgentRun::test().with_steps([step("a").with_timeout("30s").with_retry(1, "1s", "1s")]),
    );
    w.settle();
    w.update_pod("run-a-2b8d3c-r1-a1", |p| p.running());
    let d = w.settle();
    assert_eq!(
        d.requeue_after,
        secs(31),
        "at the timeout counted from the end of the whole second startedAt names"
    );
    w.advance(30);
    assert!(deletes(&w.step()).is_empty(), "never before the timeout");
    w.advance(1);
    let d = w.step();
    assert_eq!(deletes(&d), ["run-a-2b8d3c-r1-a1"]);
    assert!(events(&d).contains(&Reason::StepTimedOut));
    assert_eq!(cp(&w, "a", 1).failures, 1);
    w.advance(5);
    let d = w.step();
    assert!(
        creates(&d).is_empty(),
        "D2: attempt 2 waits while attempt 1 is still live"
    );
    w.update_pod("run-a-2b8d3c-r1-a1", |p| p.exited(137, ""));
    w.settle();
    assert!(w.pods.contains_key("run-a-2b8d3c-r1-a2"));
    assert!(
        !w.pods.contains_key("run-a-2b8d3c-r1-a1"),
        "attempt 1 released and gone"
    );
}

#[test]
fn unusable_results_fail_the_attempt_with_the_problem_quoted() {
    let cases = [
        ("not JSON", "all good!".to_owned(), "not JSON"),
        ("wrong shape", "[1]".to_owned(), "must be a JSON object"),
        (
            "too large",
            format!("{{\"result\": \"{}\"}}", "x".repeat(5000)),
            "over the 4096-byte limit",
        ),
        (
            "bad tokens",
            r#"{"tokens": "many"}"#.to_owned(),
            "tokens must be",
        ),
    ];
    for (name, message, want) in cases {
        let mut w = World::new(AgentRun::test().with_steps([step("a")]));
        w.settle();
        w.update_pod("run-a-2b8d3c-r1-a1", |p| p.succeeded(&message));
        w.settle();
        let a = cp(&w, "a", 1);
        assert_eq!(a.phase, StepPhase::Failed, "{name}");
        assert!(
            a.message.as_deref().unwrap_or("").contains(want),
            "{name}: {:?}",
            a.message
        );
    }
    let mut w = World::new(AgentRun::test().with_steps([step("a")]));
    w.settle();
    w.succeed("run-a-2b8d3c-r1-a1", "");
    assert_eq!(
        (cp(&w, "a", 1).phase, cp(&w, "a", 1).result),
        (StepPhase::Succeeded, None),
        "empty message: null result"
    );
}

#[test]
fn a_pod_created_late_is_timed_from_its_creation_not_from_the_launch() {
    let mut w = World::new(AgentRun::test().with_steps([step("a").with_timeout("10s")]));
    // The launch is written; the operator dies before creating the Pod.
    let d = w.decide();
    w.run.status = Some(d.status);
    w.advance(60);
    let d = w.step();
    assert_eq!(
        creates(&d),
        ["run-a-2b8d3c-r1-a1"],
        "created after the restart"
    );
    w.update_pod("run-a-2b8d3c-r1-a1", |p| p.running());
    w.advance(5);
    w.settle();
    assert_eq!(cp(&w, "a", 1).phase, StepPhase::Running, "5s of 10s used");
    w.advance(7);
    w.settle();
    assert_eq!(
        cp(&w, "a", 1).phase,
        StepPhase::Failed,
        "timed out 10s after its Pod was created"
    );
}

#[test]
fn an_effect_that_may_have_happened_is_unknown_and_compensated() {
    // Timed out while running, no retries left: it may have acted.
    let mut w =
        World::new(AgentRun::test().with_steps([step("a").with_timeout("10s").with_compensate()]));
    w.settle();
    w.update_pod("run-a-2b8d3c-r1-a1", |p| p.running());
    w.advance(20);
    w.settle();
    assert_eq!(cp(&w, "a", 1).effect, Some(EffectOutcome::Unknown));
    // The kubelet stops the deleted Pod; then the saga winds down.
    w.update_pod("run-a-2b8d3c-r1-a1", |p| p.exited(137, ""));
    w.settle();
    assert!(
        w.created.contains(&"run-a-2b8d3c-r1-c1".to_owned()),
        "the compensation runs for an unknown effect: {:?}",
        w.created
    );

    // A non-zero exit says nothing of what the step did: it may have
    // acted, and its compensation runs (D6, D7).
    let mut w = World::new(AgentRun::test().with_steps([step("a").with_compensate()]));
    w.settle();
    w.update_pod("run-a-2b8d3c-r1-a1", |p| p.exited(1, ""));
    w.settle();
    assert_eq!(cp(&w, "a", 1).effect, Some(EffectOutcome::Unknown));
    assert_eq!(w.created, ["run-a-2b8d3c-r1-a1", "run-a-2b8d3c-r1-c1"]);

    // One that reports NotApplied did not act: not compensated.
    let mut w = World::new(AgentRun::test().with_steps([step("a").with_compensate()]));
    w.settle();
    w.update_pod("run-a-2b8d3c-r1-a1", |p| p.exited(1, NOT_APPLIED));
    w.settle();
    assert_eq!(cp(&w, "a", 1).effect, Some(EffectOutcome::NotApplied));
    assert_eq!(w.created, ["run-a-2b8d3c-r1-a1"]);

    // An Idempotent step evicted after it started: unknown until the rerun succeeds.
    let mut w = World::new(AgentRun::test().with_steps([step("a"), step("b")]));
    w.settle();
    w.update_pod("run-a-2b8d3c-r1-a1", |p| p.evicted(true));
    w.step();
    assert_eq!(cp(&w, "a", 1).effect, Some(EffectOutcome::Unknown));
    w.settle();
    w.succeed("run-a-2b8d3c-r1-a2", &ok_message(json!(1), 0));
    assert_eq!(cp(&w, "a", 1).effect, Some(EffectOutcome::Applied));
}

#[test]
fn a_deleted_pod_that_traps_sigterm_and_exits_1_is_a_disruption() {
    let mut w = non_idempotent_a_running();
    w.step();
    // A user deletes the Pod; its container catches SIGTERM and exits 1.
    let now = w.now;
    w.update_pod("run-a-2b8d3c-r1-a1", |p| {
        let mut p = p.deleting(now).exited(1, "interrupted");
        p.metadata.deletion_grace_period_seconds = Some(0);
        p
    });
    w.settle();
    let a = cp(&w, "a", 1);
    assert_eq!((a.failures, a.disruptions), (0, 1), "{a:?}");
    assert_eq!(
        a.phase,
        StepPhase::WaitingForApproval,
        "a person says what happened"
    );
}

/// A failed attempt's checkpoint says what the step said about its failure:
/// the `error` its SDK wrote, or the start of a message that is not JSON.
#[test]
fn a_failed_attempt_says_what_the_step_said() {
    let cases = [
        (
            r#"{"result": {"error": "upstream tool returned 503 after 2 of 5 pages", "pagesDone": 2}, "tokens": {"input": 10, "output": 5}}"#,
            r#"attempt 1 exited with code 3 (Error): "upstream tool returned 503 after 2 of 5 pages"; no retries left (limit 0)"#,
        ),
        (
            "panic: index out of range",
            r#"attempt 1 exited with code 3 (Error): "panic: index out of range"; no retries left (limit 0)"#,
        ),
        (
            r#"{"tokens": {"input": 1}}"#,
            "attempt 1 exited with code 3 (Error); no retries left (limit 0)",
        ),
    ];
    for (message, want) in cases {
        let mut w = World::new(AgentRun::test().with_steps([step("a")]));
        w.settle();
        w.update_pod("run-a-2b8d3c-r1-a1", |p| p.exited(3, message));
        w.settle();
        assert_eq!(cp(&w, "a", 1).message.as_deref(), Some(want), "{message}");
    }
}
