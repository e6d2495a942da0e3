//! D7: a failing or cancelled run compensates what was applied, latest first.

use super::*;

#[test]
fn cancel_stops_the_step_then_compensates_applied_steps_in_reverse() {
    let mut w = World::new(AgentRun::test().with_steps([
        step("a").with_compensate(),
        step("b").with_effect(Effect::None).with_compensate(),
        step("c").with_compensate(),
        step("d").with_compensate(),
    ]));
    w.settle();
    w.succeed("run-a-2b8d3c-r1-a1", "");
    w.succeed("run-b-59c772-r1-a1", "");
    w.succeed("run-c-aa03bb-r1-a1", "");
    w.update_pod("run-d-49574a-r1-a1", |p| p.running());
    w.settle();
    w.run.spec.cancel = true;
    let d = w.step();
    assert_eq!(deletes(&d), ["run-d-49574a-r1-a1"]);
    assert_eq!(
        cp(&w, "d", 1).effect,
        Some(EffectOutcome::Unknown),
        "it was running: it may have acted"
    );
    assert_eq!(w.status().phase, Some(RunPhase::Compensating));
    w.settle();
    assert!(
        !w.created.iter().any(|n| n.contains("-c1")),
        "no compensation while d's Pod still runs"
    );
    w.update_pod("run-d-49574a-r1-a1", |p| p.exited(143, ""));
    w.settle();
    w.succeed("run-d-49574a-r1-c1", "");
    w.succeed("run-c-aa03bb-r1-c1", "");
    w.succeed("run-a-2b8d3c-r1-c1", "");
    let order: Vec<&String> = w.created.iter().filter(|n| n.ends_with("-c1")).collect();
    assert_eq!(
        order,
        [
            "run-d-49574a-r1-c1",
            "run-c-aa03bb-r1-c1",
            "run-a-2b8d3c-r1-c1"
        ],
        "reverse order; b had no effect"
    );
    let pod = w.pod("run-a-2b8d3c-r1-c1");
    assert_eq!(
        pod.metadata.labels.as_ref().unwrap()[labels::ROLE],
        "compensate"
    );
    assert_ne!(
        pod.metadata.labels.as_ref().unwrap()[labels::IDEMPOTENCY_KEY],
        cp(&w, "a", 1).idempotency_key
    );
    assert_ended(&w, RunPhase::Cancelled, Reason::Cancelled);
}

#[test]
fn a_run_failing_after_side_effects_compensates_first() {
    let mut w = World::new(AgentRun::test().with_steps([step("a").with_compensate(), step("b")]));
    w.settle();
    w.succeed("run-a-2b8d3c-r1-a1", "");
    w.update_pod("run-b-59c772-r1-a1", |p| p.exited(1, ""));
    w.settle();
    assert_eq!(w.status().phase, Some(RunPhase::Compensating));
    w.update_pod("run-a-2b8d3c-r1-c1", |p| p.exited(1, ""));
    w.settle();
    assert_eq!(
        w.status().phase,
        Some(RunPhase::Failed),
        "a failed compensation is reported, not retried forever"
    );
    assert_eq!(w.status().compensations[0].phase, StepPhase::Failed);
}
