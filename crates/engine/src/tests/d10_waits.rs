//! D10 for time: a wait step runs no Pod and holds no place; the time it
//! wakes is fixed in status when it starts, so a restart, an edit or a long
//! downtime never moves it; the run is requeued for it, and cancelling the
//! run ends it at once.

use super::*;
use agentrun_api::{StepSpec, WaitSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

fn wait_for(name: &str, d: &str) -> StepSpec {
    StepSpec {
        name: name.into(),
        wait: Some(Box::new(WaitSpec {
            for_: Some(Duration::from(d)),
            until: None,
            signal: None,
        })),
        effect: Effect::None,
        ..StepSpec::default()
    }
}

fn wait_until(name: &str, at: i64) -> StepSpec {
    StepSpec {
        name: name.into(),
        wait: Some(Box::new(WaitSpec {
            for_: None,
            until: Some(Time(t(at))),
            signal: None,
        })),
        ..StepSpec::default()
    }
}

/// a → cool-off (10m) → b.
fn cool_off() -> World {
    World::new(AgentRun::test().with_steps([step("a"), wait_for("cool-off", "10m"), step("b")]))
}

#[test]
fn a_wait_runs_no_pod_and_the_next_step_starts_when_it_wakes() {
    let mut w = cool_off();
    w.settle();
    w.advance(5);
    w.succeed("run-a-2b8d3c-r1-a1", "");
    let c = cp(&w, "cool-off", 1);
    assert_eq!(c.phase, StepPhase::Waiting);
    assert_eq!(c.started_at.map(|s| s.0), Some(t(5)));
    assert_eq!(c.wake_at.map(|s| s.0), Some(t(605)));
    assert_eq!(c.pod, None);
    assert_eq!(w.created, ["run-a-2b8d3c-r1-a1"], "no Pod for a wait");
    assert_eq!(w.status().phase, Some(RunPhase::Waiting));
    let cond = condition(&w, ConditionType::Succeeded);
    assert_eq!(cond.reason, Reason::Waiting);
    assert!(
        cond.message
            .ends_with(&format!("step cool-off waits until {}", t(605))),
        "{}",
        cond.message
    );
    let d = w.decide();
    assert_eq!(d.requeue_after, secs(600), "requeued for the wake (D10)");
    w.advance(599);
    w.settle();
    assert_eq!(cp(&w, "cool-off", 1).phase, StepPhase::Waiting);
    assert_eq!(w.decide().requeue_after, secs(1));
    w.advance(1);
    let d = w.step();
    assert!(events(&d).contains(&Reason::StepWoke), "{:?}", events(&d));
    let c = cp(&w, "cool-off", 1);
    assert_eq!(
        (c.phase, c.checkpoint, c.effect, c.finished_at.map(|f| f.0)),
        (
            StepPhase::Succeeded,
            CheckpointState::Committed,
            Some(EffectOutcome::NotApplied),
            Some(t(605))
        )
    );
    assert_eq!(
        creates(&d),
        ["run-b-59c772-r1-a1"],
        "b starts in the write that records the wake (D4)"
    );
    w.succeed("run-b-59c772-r1-a1", "");
    assert_eq!(w.status().phase, Some(RunPhase::Succeeded));
    assert_eq!(w.status().step_executions, 2, "a wait is not an execution");
    assert_eq!(w.status().progress.as_deref(), Some("3/3"));
}

#[test]
fn neither_an_edit_nor_a_long_downtime_moves_the_wake() {
    let mut w = cool_off();
    w.settle();
    w.succeed("run-a-2b8d3c-r1-a1", "");
    let before = cp(&w, "cool-off", 1).wake_at;
    // The spec is edited to wait an hour: the wait that started stands.
    w.run.spec.steps[1] = wait_for("cool-off", "1h");
    w.run.metadata.generation = Some(2);
    w.settle();
    assert_eq!(cp(&w, "cool-off", 1).wake_at, before);
    // The operator is down for three days: the wake is taken at once, as of
    // when it was due.
    w.advance(3 * 86400);
    w.settle();
    let c = cp(&w, "cool-off", 1);
    assert_eq!(
        (c.phase, c.finished_at),
        (StepPhase::Succeeded, before.clone())
    );
    assert_eq!(w.created.len(), 2, "b started: {:?}", w.created);
}

#[test]
fn a_time_already_past_wakes_at_once() {
    let mut w = World::new(AgentRun::test().with_steps([wait_until("go", 0), step("b")]));
    w.advance(60);
    w.settle();
    let c = cp(&w, "go", 1);
    assert_eq!(
        (c.phase, c.wake_at.map(|t| t.0)),
        (StepPhase::Succeeded, Some(t(0)))
    );
    assert_eq!(w.created, ["run-b-59c772-r1-a1"]);
}

#[test]
fn a_time_with_a_fraction_of_a_second_wakes_after_it_never_before() {
    let mut s = wait_until("go", 10);
    s.wait.as_mut().unwrap().until = Some(Time(t(10) + SignedDuration::from_millis(500)));
    let mut w = World::new(AgentRun::test().with_steps([s, step("b")]));
    w.settle();
    assert_eq!(cp(&w, "go", 1).wake_at.map(|t| t.0), Some(t(11)));
    w.advance(10);
    w.settle();
    assert!(w.created.is_empty(), "not at 10 s: the wake is 10.5 s");
    w.advance(1);
    w.settle();
    assert_eq!(w.created, ["run-b-59c772-r1-a1"]);
}

#[test]
fn cancelling_the_run_ends_the_wait_at_once() {
    let mut w = cool_off();
    w.settle();
    w.succeed("run-a-2b8d3c-r1-a1", "");
    w.run.spec.cancel = true;
    w.settle();
    let c = cp(&w, "cool-off", 1);
    assert_eq!(c.phase, StepPhase::Failed);
    assert_says(c.message.as_deref(), "stopped waiting: spec.cancel is set");
    assert_eq!(w.status().phase, Some(RunPhase::Cancelled));
    assert_eq!(
        w.decide().requeue_after,
        None,
        "nothing is left to wake for"
    );
}

#[test]
fn a_wait_beside_a_running_branch_leaves_the_run_running_and_holds_no_place() {
    // a ∥ hold (10m) → join; parallelism 1: the wait does not hold the slot.
    let mut run = AgentRun::test().with_steps([
        step("a"),
        wait_for("hold", "10m"),
        StepSpec {
            depends_on: Some(["a".to_string(), "hold".to_string()].into()),
            ..step("join")
        },
    ]);
    run.spec.parallelism = Some(1);
    let mut w = World::new(run);
    w.settle();
    assert_eq!(cp(&w, "hold", 1).phase, StepPhase::Waiting);
    assert_eq!(cp(&w, "a", 1).phase, StepPhase::Running);
    assert_eq!(w.status().phase, Some(RunPhase::Running));
    w.succeed("run-a-2b8d3c-r1-a1", "");
    assert_eq!(w.status().phase, Some(RunPhase::Waiting));
    assert_eq!(w.created.len(), 1, "the join waits for the wait");
    w.advance(600);
    w.settle();
    assert_eq!(w.created.len(), 2, "{:?}", w.created);
}

#[test]
fn a_wait_step_is_checked_like_the_rest_of_the_spec() {
    let mut both = wait_for("w", "1m");
    both.container = Some(container("x:1"));
    let mut retried = wait_for("w", "1m");
    retried.retry = step("x").with_retry(1, "1s", "1s").retry;
    let mut zero = wait_for("w", "0s");
    zero.effect = Effect::None;
    let neither = StepSpec {
        name: "w".into(),
        ..StepSpec::default()
    };
    let cases = [
        (
            both,
            "a step has a container or a wait, exactly one of them",
        ),
        (
            neither,
            "a step has a container or a wait, exactly one of them",
        ),
        (
            retried,
            "spec.steps[0].retry: a wait step runs no container",
        ),
        (zero, "spec.steps[0].wait.for: must be longer than 0s"),
    ];
    for (s, want) in cases {
        let mut w = World::new(AgentRun::test().with_steps([s]));
        w.settle();
        let c = condition(&w, ConditionType::Succeeded);
        assert_eq!(c.reason, Reason::InvalidSpec, "{want}");
        assert!(c.message.contains(want), "{want}: {}", c.message);
    }
}

#[test]
fn a_planner_may_propose_a_wait() {
    let pause: StepSpec =
        serde_json::from_value(json!({"name": "pause", "wait": {"for": "30s"}})).unwrap();
    let mut w = World::new(
        AgentRun::test()
            .with_planner(step("plan"))
            .with_steps([pause, step("go")]),
    );
    w.settle();
    let plan = json!({"plan": [{"name": "pause"}, {"name": "go"}]});
    w.succeed("run-plan-dbdf1c-r1-p1", &plan.to_string());
    assert_eq!(cp(&w, "pause", 2).phase, StepPhase::Waiting);
    w.advance(30);
    w.settle();
    assert_eq!(cp(&w, "pause", 2).phase, StepPhase::Succeeded);
    assert_eq!(cp(&w, "go", 2).phase, StepPhase::Running);
}
