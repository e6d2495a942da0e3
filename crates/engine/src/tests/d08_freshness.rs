//! D8: no step starts on stale input. The run re-plans: the stale reads and
//! the steps after them that have not acted run again with new keys; a step
//! that acted keeps its checkpoint and is never run again unless a person
//! approves it; re-plans are bounded.

use super::*;

#[test]
fn a_stale_read_runs_again_and_a_step_that_acted_keeps_its_checkpoint() {
    // quote (a read, true for 3 s) → charge (moves money, takes 6 s) → ship.
    let mut w = World::new(AgentRun::test().with_steps([
        step("quote").with_effect(Effect::None).with_fresh_for("3s"),
        step("charge").with_effect(Effect::NonIdempotent),
        step("ship"),
    ]));
    w.settle();
    w.succeed(
        "run-quote-85b807-r1-a1",
        &ok_message(json!({"price": 42}), 0),
    );
    w.update_pod("run-charge-09c6a7-r1-a1", |p| p.running());
    w.advance(6);
    let charge_key = cp(&w, "charge", 1).idempotency_key;
    w.succeed("run-charge-09c6a7-r1-a1", &ok_message(json!("charged"), 0));
    // ship may not start on the 6-second-old quote: the quote runs again,
    // and charge, which acted, keeps its checkpoint.
    let plan = w.status().plan.unwrap();
    assert_eq!(plan.revision, 2);
    assert_eq!(plan.rerun, ["quote", "ship"]);
    assert!(
        plan.reason
            .contains("charge acted and keep their checkpoints"),
        "{}",
        plan.reason
    );
    w.succeed(
        "run-quote-85b807-r2-a1",
        &ok_message(json!({"price": 42}), 0),
    );
    w.succeed("run-ship-c7dd65-r2-a1", "");
    assert_eq!(w.status().phase, Some(RunPhase::Succeeded));
    assert_eq!(w.status().progress.as_deref(), Some("3/3"));
    let charges: Vec<&String> = w
        .created
        .iter()
        .filter(|n| n.starts_with("run-charge-"))
        .collect();
    assert_eq!(charges, ["run-charge-09c6a7-r1-a1"], "charged once");
    let c = cp(&w, "charge", 1);
    assert_eq!(
        (c.phase, c.effect, c.idempotency_key),
        (
            StepPhase::Succeeded,
            Some(EffectOutcome::Applied),
            charge_key
        )
    );
    assert!(
        !w.status()
            .steps
            .iter()
            .any(|c| c.name == "charge" && c.plan_revision == 2),
        "no checkpoint of charge at revision 2"
    );
    // ship's context holds the quote of revision 2 and the charge of revision 1.
    let ctx = context_of(&w.pod("run-ship-c7dd65-r2-a1"));
    assert_eq!(
        ctx["results"],
        json!([{"step": "quote", "result": {"price": 42}}, {"step": "charge", "result": "charged"}])
    );
}

#[test]
fn a_stale_input_reruns_the_reads_after_it_with_new_keys() {
    let mut w = World::new(AgentRun::test().with_steps([
        step("a"),
        step("b").with_effect(Effect::None).with_fresh_for("1m"),
        step("c").with_retry(1, "2m", "2m"),
    ]));
    w.settle();
    w.succeed("run-a-2b8d3c-r1-a1", "");
    w.succeed("run-b-59c772-r1-a1", &ok_message(json!("quote"), 0));
    let b = cp(&w, "b", 1);
    assert_eq!(b.fresh_until.as_ref().map(|t| t.0), Some(t(60)));
    // c started in time; it fails once, saying it did not act, and its retry
    // comes after b went stale.
    w.update_pod("run-c-aa03bb-r1-a1", |p| p.exited(1, NOT_APPLIED));
    w.settle();
    w.advance(120);
    let d = w.step();
    assert_replanned_first(&d);
    let plan = w.status().plan.unwrap();
    assert_eq!(
        (plan.revision, plan.rerun.clone()),
        (2, vec!["b".into(), "c".into()])
    );
    assert!(plan.reason.contains("step b went stale"), "{}", plan.reason);
    assert_eq!(cp(&w, "c", 1).phase, StepPhase::Superseded);
    assert_eq!(
        condition_of(&w, ConditionType::Stale),
        ("True".into(), Reason::InputStale.into())
    );
    w.settle();
    assert!(
        w.pods.contains_key("run-b-59c772-r2-a1"),
        "b runs again at revision 2"
    );
    assert_ne!(
        cp(&w, "b", 2).idempotency_key,
        b.idempotency_key,
        "with a new key"
    );
    assert_eq!(cp(&w, "b", 1), b, "the old checkpoint is kept as it was");
    w.succeed("run-b-59c772-r2-a1", "");
    assert!(w.pods.contains_key("run-c-aa03bb-r2-a1"));
    assert!(
        !w.pods.contains_key("run-a-2b8d3c-r2-a1"),
        "a, still fresh, is not run again"
    );
    w.succeed("run-c-aa03bb-r2-a1", "");
    assert_eq!(w.status().phase, Some(RunPhase::Succeeded));
    assert_eq!(w.status().progress.as_deref(), Some("3/3"));
    assert_eq!(condition_of(&w, ConditionType::Stale).0, "False");
}

#[test]
fn a_step_that_acted_and_went_stale_runs_again_only_when_a_person_approves() {
    // A reservation holds for a minute; pay comes after a slow check.
    let run = || {
        World::new(AgentRun::test().with_steps([
            step("reserve").with_fresh_for("1m"),
            step("check").with_effect(Effect::None),
            step("pay").with_effect(Effect::NonIdempotent),
        ]))
    };
    let mut w = run();
    w.settle();
    w.succeed(
        "run-reserve-c19482-r1-a1",
        &ok_message(json!({"hold": 1}), 0),
    );
    w.advance(90);
    w.succeed("run-check-78778d-r1-a1", "");
    let plan = w.status().plan.unwrap();
    assert_eq!(
        (plan.revision, plan.rerun.clone()),
        (2, vec!["reserve".into(), "check".into(), "pay".into()])
    );
    let asked = cp(&w, "reserve", 2);
    assert_eq!(asked.phase, StepPhase::WaitingForApproval);
    let name = asked.approval.clone().unwrap();
    let a = w.approvals[&name].clone();
    let repeats = a
        .spec
        .context
        .as_ref()
        .and_then(|c| c.repeats.clone())
        .expect("repeats");
    assert_eq!(
        (
            repeats.plan_revision,
            repeats.effect,
            repeats.idempotency_key
        ),
        (
            1,
            EffectOutcome::Applied,
            cp(&w, "reserve", 1).idempotency_key
        )
    );
    assert!(
        a.spec.question.contains("already acted at plan revision 1"),
        "{}",
        a.spec.question
    );
    assert_eq!(
        a.spec.on_timeout,
        OnTimeout::Reject,
        "a timeout never consents to acting twice"
    );
    assert!(
        !w.pods.contains_key("run-reserve-c19482-r2-a1"),
        "nothing runs before the answer"
    );

    // Approved: the reservation is made again, under a new key.
    let mut approved = w.clone();
    assert!(approved.decide_approval(&name, Answer::Approved, "alice"));
    approved.settle();
    assert!(approved.pods.contains_key("run-reserve-c19482-r2-a1"));
    assert_ne!(
        cp(&approved, "reserve", 2).idempotency_key,
        cp(&approved, "reserve", 1).idempotency_key
    );

    // Rejected: the run fails, and the reservation is not made again.
    assert!(w.decide_approval(&name, Answer::Rejected, "alice"));
    w.settle();
    assert_eq!(w.status().phase, Some(RunPhase::Failed));
    assert_eq!(
        w.created
            .iter()
            .filter(|n| n.starts_with("run-reserve-"))
            .count(),
        1
    );
}

#[test]
fn re_plans_are_bounded_so_no_freshness_setting_can_loop() {
    // The quote is true for 3 s, but the read after it takes 6 s: every
    // re-plan goes stale again before ship can start.
    let mut run = AgentRun::test().with_steps([
        step("quote").with_effect(Effect::None).with_fresh_for("3s"),
        step("slow").with_effect(Effect::None),
        step("ship"),
    ]);
    run.spec.budget = Some(agentrun_api::Budget {
        replans: Some(2),
        ..Default::default()
    });
    let mut w = World::new(run);
    w.settle();
    for rev in 1..=3 {
        w.succeed(&format!("run-quote-85b807-r{rev}-a1"), "");
        w.advance(6);
        w.succeed(&format!("run-slow-4d39ac-r{rev}-a1"), "");
    }
    let s = w.status();
    assert_eq!(s.phase, Some(RunPhase::Failed));
    assert_eq!(s.plan.as_ref().map(|p| p.revision), Some(3));
    assert_eq!(
        condition_of(&w, ConditionType::Succeeded),
        ("False".into(), Reason::InputStale.into())
    );
    let message = crate::conditions::get(&s.conditions, ConditionType::Succeeded)
        .unwrap()
        .message
        .clone();
    assert!(
        message.contains("re-planned 2 times, the limit of budget.replans (2)"),
        "{message}"
    );
    assert!(
        !w.created.iter().any(|n| n.starts_with("run-ship-")),
        "ship never ran on a stale quote"
    );
}

#[test]
fn freshness_counts_from_the_containers_finish_not_from_when_the_operator_saw_it() {
    let mut w = World::new(AgentRun::test().with_steps([
        step("quote").with_effect(Effect::None).with_fresh_for("8s"),
        step("buy"),
    ]));
    w.settle();
    // The quote finished at t(0); the operator was down and looks at t(14).
    w.update_pod("run-quote-85b807-r1-a1", |p| {
        p.succeeded(&ok_message(json!(10), 0)).finished_at(t(0))
    });
    w.advance(14);
    w.settle();
    let q = cp(&w, "quote", 1);
    assert_eq!(
        (q.finished_at.map(|t| t.0), q.fresh_until.map(|t| t.0)),
        (Some(t(0)), Some(t(8)))
    );
    assert!(
        !w.created.contains(&"run-buy-6c0d28-r1-a1".to_owned()),
        "buy never starts on the 14-second-old quote"
    );
    assert_eq!(w.status().plan.unwrap().revision, 2);
    assert!(w.pods.contains_key("run-quote-85b807-r2-a1"));
}

#[test]
fn a_launch_recorded_before_a_crash_is_not_created_on_inputs_stale_since() {
    let mut w = World::new(AgentRun::test().with_steps([
        step("quote").with_effect(Effect::None).with_fresh_for("3s"),
        step("buy"),
    ]));
    w.settle();
    w.update_pod("run-quote-85b807-r1-a1", |p| {
        p.succeeded(&ok_message(json!(10), 0))
    });
    // quote's outcome and buy's launch are written together; the operator
    // dies before it creates buy's Pod, and comes back after quote went stale.
    let hand_off = w.decide();
    assert_eq!(creates(&hand_off), ["run-buy-6c0d28-r1-a1"]);
    w.run.status = Some(hand_off.status);
    w.advance(4);
    let d = w.step();
    assert_replanned_first(&d);
    assert_eq!(cp(&w, "buy", 1).phase, StepPhase::Superseded);
    w.settle();
    assert!(
        w.pods.contains_key("run-quote-85b807-r2-a1"),
        "quote runs again"
    );
    assert!(
        !w.pods.contains_key("run-buy-6c0d28-r1-a1"),
        "buy never ran on the old quote"
    );
}
