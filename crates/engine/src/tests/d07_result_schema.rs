//! D7 at the boundary: a result that does not match its step's `resultSchema`
//! is not committed as success. The attempt fails with the mismatch and
//! follows the retry policy; the effect it reported is recorded all the same,
//! and a NonIdempotent step that applied its effect is never run again for it.

use super::*;

fn schema() -> serde_json::Value {
    json!({
        "type": "object",
        "required": ["orderId"],
        "properties": {"orderId": {"type": "string"}}
    })
}

fn checked(effect: Effect, retries: i32) -> World {
    let mut s = step("a")
        .with_effect(effect)
        .with_retry(retries, "1s", "1s")
        .with_compensate();
    s.result_schema = Some(Box::new(schema()));
    World::new(AgentRun::test().with_steps([s, step("b")]))
}

/// The current attempt's Pod of step `a`.
fn pod_of_a(w: &World) -> String {
    cp(w, "a", 1).pod.unwrap()
}

/// A message with a result the schema refuses and the given effect.
fn bad(effect: Option<&str>) -> String {
    let mut m = json!({"result": {"order": 7}, "tokens": {"input": 5, "output": 0}});
    if let Some(e) = effect {
        m["effect"] = json!(e);
    }
    m.to_string()
}

#[test]
fn a_result_that_does_not_match_is_retried_and_a_matching_one_committed() {
    let mut w = checked(Effect::None, 1);
    w.settle();
    let first = pod_of_a(&w);
    w.update_pod(&first, |p| p.succeeded(&bad(None)));
    let d = w.step();
    assert!(
        events(&d).contains(&Reason::ResultInvalid),
        "{:?}",
        events(&d)
    );
    let a = cp(&w, "a", 1);
    assert_eq!((a.phase, a.failures), (StepPhase::Pending, 1));
    assert_eq!(a.result, None, "nothing is committed");
    let message = a.message.unwrap();
    assert!(
        message.contains("attempt 1 returned a result that does not match its resultSchema: at /:")
            && message.contains("retry 1 of 1"),
        "{message}"
    );
    assert_eq!(w.status().tokens_used, 5, "its tokens were spent (D9)");
    assert!(
        !w.created.iter().any(|n| n.contains("-b-")),
        "b does not start on a refused result"
    );
    w.advance(2);
    w.settle();
    let second = pod_of_a(&w);
    assert_ne!(first, second);
    w.succeed(&second, &ok_message(json!({"orderId": "o-1"}), 1));
    let a = cp(&w, "a", 1);
    assert_eq!(
        (a.phase, a.result, a.effect),
        (
            StepPhase::Succeeded,
            Some(json!({"orderId": "o-1"})),
            Some(EffectOutcome::NotApplied)
        )
    );
    assert_eq!(cp(&w, "b", 1).phase, StepPhase::Running);
}

#[test]
fn a_non_idempotent_step_that_applied_its_effect_is_not_run_again() {
    let mut w = checked(Effect::NonIdempotent, 3);
    w.settle();
    let pod = pod_of_a(&w);
    w.update_pod(&pod, |p| p.succeeded(&bad(None)));
    w.settle();
    w.advance(3600);
    w.settle();
    let a = cp(&w, "a", 1);
    assert_eq!(
        (a.phase, a.effect, a.failures),
        (StepPhase::Failed, Some(EffectOutcome::Applied), 1),
        "retries were left, but the effect happened (D7): it is not repeated"
    );
    assert!(
        a.message
            .unwrap()
            .ends_with("not retried: its NonIdempotent effect was applied")
    );
    let steps: Vec<&String> = w.created.iter().filter(|n| !n.ends_with("-c1")).collect();
    assert_eq!(steps, [&pod], "one attempt, nothing after it");
    // The applied effect is compensated, and the run fails for the step.
    assert!(
        w.created.iter().any(|n| n.ends_with("-c1")),
        "{:?}",
        w.created
    );
}

#[test]
fn the_effect_the_attempt_reported_decides_what_follows() {
    // An attempt that said it did not act is retried, even NonIdempotent.
    let mut w = checked(Effect::NonIdempotent, 1);
    w.settle();
    let pod = pod_of_a(&w);
    w.update_pod(&pod, |p| p.succeeded(&bad(Some("NotApplied"))));
    w.settle();
    let a = cp(&w, "a", 1);
    assert_eq!((a.phase, a.effect), (StepPhase::Pending, None));

    // One that does not know asks a person, as any attempt that may have acted.
    let mut w = checked(Effect::NonIdempotent, 1);
    w.settle();
    let pod = pod_of_a(&w);
    w.update_pod(&pod, |p| p.succeeded(&bad(Some("Unknown"))));
    w.settle();
    let a = cp(&w, "a", 1);
    assert_eq!(
        (a.phase, a.effect),
        (StepPhase::WaitingForApproval, Some(EffectOutcome::Unknown))
    );
    let approval = a.approval.unwrap();
    assert_eq!(w.approvals[&approval].spec.kind, ApprovalKind::Reconcile);

    // An Idempotent step records the effect and runs again with the same key.
    let mut w = checked(Effect::Idempotent, 1);
    w.settle();
    let first = pod_of_a(&w);
    w.update_pod(&first, |p| p.succeeded(&bad(Some("Applied"))));
    w.settle();
    let a = cp(&w, "a", 1);
    assert_eq!(
        (a.phase, a.effect),
        (StepPhase::Pending, Some(EffectOutcome::Applied))
    );
    w.advance(2);
    w.settle();
    let second = pod_of_a(&w);
    assert_ne!(first, second);
    let key = |p: &str| w.pod(p).metadata.labels.unwrap()[labels::IDEMPOTENCY_KEY].clone();
    assert_eq!(key(&first), key(&second));
}

#[test]
fn a_schema_that_cannot_be_used_fails_the_run_before_anything_starts() {
    let mut s = step("a");
    s.result_schema = Some(Box::new(json!({"type": "no-such-type"})));
    let mut w = World::new(AgentRun::test().with_steps([s]));
    w.settle();
    assert!(w.created.is_empty());
    assert_eq!(w.status().phase, Some(RunPhase::Failed));
    let c = condition(&w, ConditionType::Succeeded);
    assert_eq!(c.reason, Reason::InvalidSpec);
    assert!(
        c.message
            .starts_with("spec.steps[0].resultSchema: is not a usable JSON Schema"),
        "{}",
        c.message
    );
}

#[test]
fn a_planner_proposing_its_own_schema_proposes_an_invalid_plan() {
    // D17: the schema a step's result must match is the author's.
    let mut w = World::new(
        AgentRun::test()
            .with_planner(step("plan"))
            .with_steps([step("x")]),
    );
    w.settle();
    let planner = "run-plan-dbdf1c-r1-p1";
    let plan = json!({"plan": [{
        "name": "x",
        "resultSchema": {"$ref": "https://example.com/x.json"}
    }]});
    w.succeed(planner, &plan.to_string());
    assert_eq!(w.status().phase, Some(RunPhase::Failed));
    let c = condition(&w, ConditionType::Succeeded);
    assert_eq!(c.reason, Reason::InvalidPlan);
    assert!(
        c.message
            .contains("plan[0].resultSchema: step x uses catalog step x, whose resultSchema is the run author's"),
        "{}",
        c.message
    );
}
