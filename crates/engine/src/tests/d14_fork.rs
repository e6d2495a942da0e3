//! Retry and fork from a checkpoint (`spec.forkOf`): what a fork carries over
//! from its source run, what runs again, and what it refuses.

use super::*;
use agentrun_api::{ForkSource, Provenance};

/// a → b (a read, fresh for `fresh`) → c (fails for good) → d, run to its end.
fn failed_source(fresh: &str) -> AgentRun {
    let mut w = World::new(AgentRun::test().with_steps([
        step("a").with_effect(Effect::NonIdempotent),
        step("b").with_effect(Effect::None).with_fresh_for(fresh),
        step("c"),
        step("d"),
    ]));
    w.settle();
    w.succeed("run-a-2b8d3c-r1-a1", &ok_message(json!({"charged": 1}), 5));
    w.succeed("run-b-59c772-r1-a1", &ok_message(json!({"quote": 2}), 0));
    w.update_pod("run-c-aa03bb-r1-a1", |p| p.exited(1, NOT_APPLIED));
    w.settle();
    assert_eq!(w.status().phase, Some(RunPhase::Failed));
    w.run
}

fn fork(source: &AgentRun, from: &str, rerun_acted: bool) -> World {
    let mut run = AgentRun::test().with_steps(source.spec.steps.clone());
    run.metadata.name = Some("run-retry".into());
    run.metadata.uid = Some("fork-uid".into());
    run.spec.fork_of = Some(Box::new(ForkSource {
        run_name: "run".into(),
        run_uid: UID.into(),
        from_step: from.into(),
        rerun_acted,
    }));
    let mut w = World::new(run);
    w.source = Some(source.clone());
    w
}

#[test]
fn a_fork_carries_over_what_came_before_and_runs_the_rest_with_new_keys() {
    let source = failed_source("1h");
    let mut w = fork(&source, "c", false);
    w.settle();
    let s = w.status();
    let a = s.steps.iter().find(|c| c.name == "a").unwrap();
    assert_eq!(
        (a.plan_revision, a.phase, a.effect, a.provenance),
        (
            0,
            StepPhase::Succeeded,
            Some(EffectOutcome::Applied),
            Some(Provenance::Inherited)
        )
    );
    assert_eq!(
        a.idempotency_key, KEY_A_R1,
        "the key it acted under, as history"
    );
    assert_eq!(s.forked_from.as_ref().unwrap().inherited, ["a", "b"]);
    assert_eq!(s.plan.as_ref().unwrap().rerun, ["c", "d"]);
    // Only c and d run, under the fork's own keys.
    let c_pod: Vec<&String> = w.created.iter().collect();
    assert_eq!(c_pod.len(), 1);
    assert!(c_pod[0].starts_with("run-retry-c-"), "{c_pod:?}");
    let ctx = context_of(&w.pod(c_pod[0]));
    assert_eq!(
        ctx["results"],
        json!([{"step": "a", "result": {"charged": 1}}, {"step": "b", "result": {"quote": 2}}])
    );
    let c = cp(&w, "c", 1);
    assert_ne!(
        c.idempotency_key,
        source
            .status
            .as_ref()
            .unwrap()
            .steps
            .iter()
            .find(|x| x.name == "c")
            .unwrap()
            .idempotency_key,
        "a new run, new keys"
    );
    w.succeed(&c.pod.unwrap(), "");
    let d = cp(&w, "d", 1).pod.unwrap();
    w.succeed(&d, "");
    assert_eq!(w.status().phase, Some(RunPhase::Succeeded));
    assert_eq!(w.status().progress.as_deref(), Some("4/4"));
    assert!(
        !w.created.iter().any(|n| n.starts_with("run-retry-a-")),
        "a never ran again"
    );
}

#[test]
fn an_expired_read_is_not_carried_over_and_runs_again() {
    let source = failed_source("1m");
    let mut w = fork(&source, "c", false);
    w.advance(120);
    w.settle();
    let s = w.status();
    assert_eq!(s.forked_from.as_ref().unwrap().inherited, ["a"]);
    assert_eq!(s.plan.as_ref().unwrap().rerun, ["b", "c", "d"]);
    assert!(w.created[0].starts_with("run-retry-b-"), "{:?}", w.created);
}

#[test]
fn forking_from_a_step_that_acted_needs_the_flag_and_then_a_person() {
    let source = failed_source("1h");
    let mut w = fork(&source, "a", false);
    w.settle();
    assert_eq!(w.status().phase, Some(RunPhase::Failed));
    assert_eq!(condition_of(&w, ConditionType::Succeeded).1, "ForkRefused");
    assert!(w.created.is_empty());

    let mut w = fork(&source, "a", true);
    w.settle();
    let a = cp(&w, "a", 1);
    assert_eq!(a.phase, StepPhase::WaitingForApproval);
    let asked = &w.approvals[a.approval.as_deref().unwrap()];
    let repeats = asked
        .spec
        .context
        .as_ref()
        .unwrap()
        .repeats
        .clone()
        .unwrap();
    assert_eq!(
        (repeats.effect, repeats.idempotency_key.as_str()),
        (EffectOutcome::Applied, KEY_A_R1)
    );
    assert!(w.created.is_empty(), "nothing acts before the answer");
}

#[test]
fn a_fork_of_a_run_that_is_gone_says_so() {
    let source = failed_source("1h");
    let mut w = fork(&source, "c", false);
    w.source = None;
    w.settle();
    assert_eq!(w.status().phase, Some(RunPhase::Failed));
    let s = w.status();
    let c = crate::conditions::get(&s.conditions, ConditionType::Succeeded).unwrap();
    assert_eq!(c.reason, "ForkSourceGone");
    assert!(c.message.contains("no longer exists"), "{}", c.message);
}

#[test]
fn approvals_are_never_carried_over_a_gated_step_asks_again() {
    let mut w = World::new(AgentRun::test().with_steps([
        step("a").with_effect(Effect::None),
        step("b").with_approval(None, OnTimeout::Reject),
    ]));
    w.settle();
    w.succeed("run-a-2b8d3c-r1-a1", "");
    assert!(w.decide_approval("run-b-59c772-r1-approve", Answer::Approved, "alice"));
    w.settle();
    w.update_pod("run-b-59c772-r1-a1", |p| p.exited(1, NOT_APPLIED));
    w.settle();
    let mut f = fork(&w.run, "b", false);
    f.settle();
    assert_eq!(cp(&f, "b", 1).phase, StepPhase::WaitingForApproval);
    assert!(f.created.is_empty());
}

#[test]
fn a_step_the_fork_changed_is_not_carried_over() {
    let source = failed_source("1h");
    let mut steps = source.spec.steps.clone();
    steps[1].container.as_mut().unwrap().args = vec!["--another-question".into()];
    let mut run = AgentRun::test().with_steps(steps);
    run.metadata.name = Some("run-retry".into());
    run.metadata.uid = Some("fork-uid".into());
    run.spec.fork_of = Some(Box::new(ForkSource {
        run_name: "run".into(),
        run_uid: UID.into(),
        from_step: "c".into(),
        rerun_acted: false,
    }));
    let mut w = World::new(run);
    w.source = Some(source);
    w.settle();
    let s = w.status();
    assert_eq!(s.forked_from.as_ref().unwrap().inherited, ["a"]);
    assert_eq!(s.plan.as_ref().unwrap().rerun, ["b", "c", "d"]);
    assert!(w.created[0].starts_with("run-retry-b-"), "{:?}", w.created);
}
