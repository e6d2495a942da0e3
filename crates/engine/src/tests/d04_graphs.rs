//! Plans that branch and join: `dependsOn` (D4 per edge), `when`, and
//! `parallelism`; failure and compensation across branches.

use super::*;
use agentrun_api::StepSpec;

fn after(s: StepSpec, deps: &[&str]) -> StepSpec {
    StepSpec {
        depends_on: Some(deps.iter().map(|d| d.to_string()).collect()),
        ..s
    }
}

fn when(s: StepSpec, expr: &str) -> StepSpec {
    StepSpec {
        when: Some(expr.into()),
        ..s
    }
}

fn live(w: &World) -> Vec<String> {
    let mut v = w.live_pods();
    v.sort();
    v
}

#[test]
fn fan_out_runs_branches_together_and_the_join_waits_for_both() {
    // parse → physicist ∥ chemist → aggregate
    let mut w = World::new(AgentRun::test().with_steps([
        step("parse"),
        after(step("physicist"), &["parse"]),
        after(step("chemist"), &["parse"]),
        after(step("aggregate"), &["physicist", "chemist"]),
    ]));
    w.settle();
    assert_eq!(live(&w), ["run-parse-71d03a-r1-a1"]);
    w.succeed("run-parse-71d03a-r1-a1", &ok_message(json!("q"), 0));
    assert_eq!(
        live(&w),
        ["run-chemist-d7adb9-r1-a1", "run-physicist-7ba2df-r1-a1"],
        "both branches start in the write that commits parse"
    );
    assert_eq!(w.status().phase, Some(RunPhase::Running));
    assert_eq!(
        w.status().current_step.as_deref(),
        Some("physicist,chemist")
    );
    w.succeed("run-chemist-d7adb9-r1-a1", &ok_message(json!("c"), 0));
    assert!(
        !w.pods.contains_key("run-aggregate-e1c72e-r1-a1"),
        "the join waits for every branch"
    );
    w.succeed("run-physicist-7ba2df-r1-a1", &ok_message(json!("p"), 0));
    let ctx = context_of(&w.pod("run-aggregate-e1c72e-r1-a1"));
    assert_eq!(
        ctx["results"],
        json!([
            {"step": "parse", "result": "q"},
            {"step": "physicist", "result": "p"},
            {"step": "chemist", "result": "c"}
        ]),
        "the join sees what it comes after, by name"
    );
    w.succeed("run-aggregate-e1c72e-r1-a1", "");
    assert_eq!(w.status().phase, Some(RunPhase::Succeeded));
    assert_eq!(w.status().progress.as_deref(), Some("4/4"));
}

#[test]
fn several_checkpoints_commit_in_one_write_without_losing_any() {
    let mut w = World::new(AgentRun::test().with_steps([
        step("x"),
        after(step("y"), &[]),
        after(step("join"), &["x", "y"]),
    ]));
    w.settle();
    assert_eq!(live(&w), ["run-x-dc2dd4-r1-a1", "run-y-ac1459-r1-a1"]);
    // Both finish before the operator looks: one decision records both.
    w.update_pod("run-x-dc2dd4-r1-a1", |p| {
        p.succeeded(&ok_message(json!(1), 3))
    });
    w.update_pod("run-y-ac1459-r1-a1", |p| {
        p.succeeded(&ok_message(json!(2), 4))
    });
    let d = w.step();
    let s = &d.status;
    assert_eq!(cp(&w, "x", 1).phase, StepPhase::Succeeded);
    assert_eq!(cp(&w, "y", 1).phase, StepPhase::Succeeded);
    assert_eq!(s.tokens_used, 7);
    assert_eq!(creates(&d), ["run-join-877c46-r1-a1"]);
}

#[test]
fn a_false_when_skips_the_step_and_the_steps_after_it_go_on() {
    // detect → spam-handler (when spam) ∥ assistant (when not) → done
    let plan = |spam: bool| {
        let mut w = World::new(AgentRun::test().with_steps([
            step("detect"),
            when(
                after(step("spam-handler"), &["detect"]),
                "steps.detect.result.isSpam",
            ),
            when(
                after(step("assistant"), &["detect"]),
                "!steps.detect.result.isSpam",
            ),
            after(step("join"), &["spam-handler", "assistant"]),
        ]));
        w.settle();
        w.succeed(
            "run-detect-ca60b8-r1-a1",
            &ok_message(json!({"isSpam": spam}), 0),
        );
        w
    };
    let mut w = plan(true);
    assert_eq!(live(&w), ["run-spam-handler-3bebe0-r1-a1"]);
    let skipped = cp(&w, "assistant", 1);
    assert_eq!(
        (skipped.phase, skipped.effect, skipped.attempt),
        (StepPhase::Skipped, Some(EffectOutcome::NotApplied), 0)
    );
    assert_eq!(
        skipped.message.as_deref(),
        Some("skipped: when \"!steps.detect.result.isSpam\" is false")
    );
    w.succeed(
        "run-spam-handler-3bebe0-r1-a1",
        &ok_message(json!("binned"), 0),
    );
    let ctx = context_of(&w.pod("run-join-877c46-r1-a1"));
    assert_eq!(
        ctx["results"],
        json!([{"step": "detect", "result": {"isSpam": true}}, {"step": "spam-handler", "result": "binned"}]),
        "a skipped step has no result"
    );
    w.succeed("run-join-877c46-r1-a1", "");
    assert_eq!(w.status().phase, Some(RunPhase::Succeeded));
    assert_eq!(w.status().progress.as_deref(), Some("4/4"));

    let w = plan(false);
    assert_eq!(live(&w), ["run-assistant-0268a3-r1-a1"]);
    assert_eq!(cp(&w, "spam-handler", 1).phase, StepPhase::Skipped);
}

#[test]
fn a_when_that_cannot_be_evaluated_fails_the_step_with_the_cel_error() {
    let mut w = World::new(AgentRun::test().with_steps([
        step("detect"),
        when(
            after(step("spam-handler"), &["detect"]),
            "steps.detect.result.isSpam",
        ),
    ]));
    w.settle();
    w.succeed(
        "run-detect-ca60b8-r1-a1",
        &ok_message(json!({"score": 3}), 0),
    );
    let s = w.status();
    assert_eq!(s.phase, Some(RunPhase::Failed));
    let (status, reason) = condition_of(&w, ConditionType::Succeeded);
    assert_eq!((status.as_str(), reason.as_str()), ("False", "WhenFailed"));
    let c = cp(&w, "spam-handler", 1);
    assert_eq!(c.phase, StepPhase::Failed);
    assert!(
        c.message.unwrap().contains("CEL error"),
        "never a silent skip"
    );
}

/// D22: a `when` that loops over a result again for each of its elements
/// spends its cost budget: the step fails with that reason, the run ends
/// (WhenFailed), and nothing after it starts. 700 × 700 iterations of a
/// body of several nodes is millions of units, past the budget of one
/// million.
#[test]
fn a_when_past_its_cost_budget_fails_the_step_and_ends_the_run() {
    let mut w = World::new(AgentRun::test().with_steps([
        step("detect"),
        when(
            after(step("spam-handler"), &["detect"]),
            "steps.detect.result.items.all(x, steps.detect.result.items.all(y, x != y || x == y))",
        ),
    ]));
    w.settle();
    let items: Vec<u32> = (0..700).collect();
    w.succeed(
        "run-detect-ca60b8-r1-a1",
        &ok_message(json!({ "items": items }), 0),
    );
    let s = w.status();
    assert_eq!(s.phase, Some(RunPhase::Failed));
    let (status, reason) = condition_of(&w, ConditionType::Succeeded);
    assert_eq!((status.as_str(), reason.as_str()), ("False", "WhenFailed"));
    let c = cp(&w, "spam-handler", 1);
    assert_eq!(c.phase, StepPhase::Failed);
    assert!(
        c.message
            .unwrap()
            .contains("exceeds the cost budget of 1000000 an expression may spend"),
    );
    assert_eq!(w.created, ["run-detect-ca60b8-r1-a1"]);
}

#[test]
fn parallelism_bounds_the_pods_in_flight() {
    let mut steps = vec![step("a")];
    steps.extend((0..5).map(|i| after(step(&format!("b{i}")), &["a"])));
    let mut run = AgentRun::test().with_steps(steps);
    run.spec.parallelism = Some(2);
    let mut w = World::new(run);
    w.settle();
    w.succeed("run-a-2b8d3c-r1-a1", "");
    assert_eq!(w.live_pods().len(), 2);
    let first = live(&w);
    w.succeed(&first[0], "");
    assert_eq!(w.live_pods().len(), 2, "a finished branch frees its slot");
    while !w.live_pods().is_empty() {
        let next = live(&w)[0].clone();
        w.succeed(&next, "");
        assert!(w.live_pods().len() <= 2);
    }
    assert_eq!(w.status().phase, Some(RunPhase::Succeeded));
    assert_eq!(w.created.len(), 6);
}

#[test]
fn parallel_approvals_are_asked_and_decided_independently() {
    // manager → prepare → budget ∥ compliance (each gated) → reimburse
    let gated = |name: &str| step(name).with_approval(None, OnTimeout::Reject);
    let mut w = World::new(AgentRun::test().with_steps([
        gated("manager"),
        after(step("prepare"), &["manager"]),
        after(gated("budget"), &["prepare"]),
        after(gated("compliance"), &["prepare"]),
        after(step("reimburse"), &["budget", "compliance"]),
    ]));
    w.settle();
    assert!(w.decide_approval("run-manager-84cbd2-r1-approve", Answer::Approved, "mia"));
    w.settle();
    w.succeed("run-manager-84cbd2-r1-a1", "");
    w.succeed("run-prepare-084dfd-r1-a1", "");
    assert!(w.approvals.contains_key("run-budget-c04667-r1-approve"));
    assert!(w.approvals.contains_key("run-compliance-83afec-r1-approve"));
    assert_eq!(w.status().phase, Some(RunPhase::WaitingForApproval));
    assert!(w.decide_approval("run-compliance-83afec-r1-approve", Answer::Approved, "carl"));
    w.settle();
    assert_eq!(live(&w), ["run-compliance-83afec-r1-a1"]);
    assert_eq!(
        w.status().phase,
        Some(RunPhase::Running),
        "one branch runs while the other waits"
    );
    w.succeed("run-compliance-83afec-r1-a1", "");
    assert!(!w.pods.contains_key("run-reimburse-84e052-r1-a1"));
    assert!(w.decide_approval("run-budget-c04667-r1-approve", Answer::Approved, "bea"));
    w.settle();
    w.succeed("run-budget-c04667-r1-a1", "");
    w.succeed("run-reimburse-84e052-r1-a1", "");
    assert_eq!(w.status().phase, Some(RunPhase::Succeeded));
    assert_eq!(cp(&w, "budget", 1).decided_by.as_deref(), Some("bea"));
    assert_eq!(cp(&w, "compliance", 1).decided_by.as_deref(), Some("carl"));
}

#[test]
fn a_failure_lets_running_branches_finish_then_compensates_in_reverse() {
    // root → left ∥ right; right fails for good while left still runs.
    let mut w = World::new(AgentRun::test().with_steps([
        step("a").with_compensate(),
        after(step("left").with_compensate(), &["a"]),
        after(step("right").with_compensate(), &["a"]),
        after(step("join"), &["left", "right"]),
    ]));
    w.settle();
    w.succeed("run-a-2b8d3c-r1-a1", "");
    w.update_pod("run-left-9f4b10-r1-a1", |p| p.running());
    w.update_pod("run-right-0620e3-r1-a1", |p| p.exited(1, NOT_APPLIED));
    w.settle();
    assert_eq!(w.status().phase, Some(RunPhase::Compensating));
    assert_eq!(
        cp(&w, "left", 1).phase,
        StepPhase::Running,
        "left is not stopped"
    );
    assert!(
        !w.created.iter().any(|n| n.contains("-c1")),
        "no compensation while left runs"
    );
    w.succeed("run-left-9f4b10-r1-a1", &ok_message(json!("done"), 0));
    let l = cp(&w, "left", 1);
    assert_eq!(
        (l.phase, l.effect),
        (StepPhase::Succeeded, Some(EffectOutcome::Applied)),
        "its effect is recorded, not guessed"
    );
    // Compensations: left (applied last), then a; right did not act.
    w.succeed("run-left-9f4b10-r1-c1", "");
    w.succeed("run-a-2b8d3c-r1-c1", "");
    let comps: Vec<&String> = w.created.iter().filter(|n| n.contains("-c1")).collect();
    assert_eq!(comps, ["run-left-9f4b10-r1-c1", "run-a-2b8d3c-r1-c1"]);
    assert_eq!(w.status().phase, Some(RunPhase::Failed));
    assert!(!w.created.iter().any(|n| n.starts_with("run-join-")));
}

#[test]
fn a_cycle_or_an_unknown_name_is_refused_with_a_clear_condition() {
    let cases: [(&str, Vec<StepSpec>, &str); 3] = [
        (
            "cycle",
            vec![after(step("a"), &["b"]), after(step("b"), &["a"])],
            "the dependsOn of steps a, b form a cycle",
        ),
        (
            "unknown",
            vec![after(step("a"), &["nope"])],
            "spec.steps[0].dependsOn: step \"nope\" is not a step of the plan",
        ),
        (
            "when names a step it does not depend on",
            vec![step("a"), when(after(step("b"), &[]), "steps.a.result")],
            "spec.steps[1].when: names step \"a\", which this step does not depend on",
        ),
    ];
    for (name, steps, want) in cases {
        let mut w = World::new(AgentRun::test().with_steps(steps));
        w.settle();
        assert_eq!(w.status().phase, Some(RunPhase::Failed), "{name}");
        assert!(w.created.is_empty(), "{name}");
        let s = w.status();
        let c = crate::conditions::get(&s.conditions, ConditionType::Succeeded).unwrap();
        assert_eq!(c.reason, "InvalidSpec", "{name}");
        assert!(c.message.contains(want), "{name}: {}", c.message);
    }
}
