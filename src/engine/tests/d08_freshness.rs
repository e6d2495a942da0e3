//! D8: no step starts on stale input; the run re-plans from the stale step.

use super::*;

#[test]
fn a_stale_input_replans_from_the_stale_step_with_new_keys() {
    let mut w = World::new(AgentRun::test().with_steps([
        step("a"),
        step("b").with_fresh_for("1m"),
        step("c"),
    ]));
    w.settle();
    w.succeed("run-a-2b8d3c-r1-a1", "");
    w.succeed("run-b-59c772-r1-a1", &ok_message(json!("quote"), 0));
    let b = cp(&w, "b", 1);
    assert_eq!(b.fresh_until.as_ref().map(|t| t.0), Some(t(60)));
    // c started in time; it fails once and its retry comes after b went stale.
    w.run.spec.steps[2] = step("c").with_retry(1, "2m", "2m");
    w.update_pod("run-c-aa03bb-r1-a1", |p| p.exited(1, ""));
    w.settle();
    w.advance(120);
    let d = w.step();
    assert_replanned_first(&d);
    let plan = w.status().plan.unwrap();
    assert_eq!((plan.revision, plan.rerun_from.as_deref()), (2, Some("b")));
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
fn a_launch_recorded_before_a_crash_is_not_created_on_inputs_stale_since() {
    let mut w =
        World::new(AgentRun::test().with_steps([step("quote").with_fresh_for("3s"), step("buy")]));
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
