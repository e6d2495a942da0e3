//! D12/D13: terminal phases and TTL, deletion, the planner, refusal of bad specs and plans, and the words and times status uses.

use super::*;

/// D5 and D12 whatever the deletion mode: a run being deleted releases its
/// Pods' finalizers and deletes none of them — the garbage collector deletes
/// them (foreground) or keeps them (`kubectl delete --cascade=orphan`).
#[test]
fn a_run_being_deleted_releases_its_pods_and_leaves_them_to_the_garbage_collector() {
    let mut w = World::new(AgentRun::test().with_steps([step("a"), step("b")]));
    w.settle();
    w.update_pod("run-a-2b8d3c-r1-a1", |p| p.running());
    w.run.metadata.deletion_timestamp =
        Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(w.now));
    w.run.metadata.finalizers = Some(vec!["orphan".into()]);
    let d = w.step();
    assert_eq!(releases(&d), ["run-a-2b8d3c-r1-a1"]);
    assert!(deletes(&d).is_empty(), "{:?}", d.actions);
    assert!(creates(&d).is_empty());
}

#[test]
fn terminal_phases_are_sticky_and_ttl_deletes_the_run() {
    let mut w = World::new(AgentRun::test().with_steps([step("a")]).with_ttl(300));
    w.settle();
    w.succeed("run-a-2b8d3c-r1-a1", "");
    assert_eq!(w.status().phase, Some(RunPhase::Succeeded));
    assert_eq!(
        condition_of(&w, ConditionType::Succeeded),
        ("True".into(), Reason::RunSucceeded.into())
    );
    assert!(w.pods["run-a-2b8d3c-r1-a1"].metadata.finalizers.is_none());
    let done = w.status();
    // New Pod events, a cancel, a clock jump: nothing moves a finished run.
    w.run.spec.cancel = true;
    w.update_pod("run-a-2b8d3c-r1-a1", |p| p.exited(1, ""));
    w.advance(100);
    let d = w.step();
    assert_eq!(d.status, done);
    assert_eq!(d.requeue_after, secs(200), "requeue exactly at the TTL");
    w.advance(200);
    assert_eq!(w.step().actions, [Action::DeleteRun]);
    assert!(w.run_deleted);
}

#[test]
fn the_planner_runs_first_and_its_plan_becomes_revision_2() {
    // The catalog (spec.steps) holds what may run; the plan picks and orders.
    let plan = json!({"plan": [
        {"name": "search", "args": ["--query", "refunds"]},
        {"name": "write"},
    ], "tokens": {"input": 100, "output": 20}});
    let catalog = [
        step("write"),
        agentrun_api::StepSpec {
            effect: agentrun_api::Effect::None,
            ..step("search")
        },
    ];
    let mut w = World::new(
        AgentRun::test()
            .with_planner(step("plan"))
            .with_steps(catalog),
    );
    w.settle();
    assert_eq!(w.status().phase, Some(RunPhase::Planning));
    assert_eq!(
        w.pod("run-plan-dbdf1c-r1-p1").metadata.labels.unwrap()[labels::ROLE],
        "planner"
    );
    w.succeed("run-plan-dbdf1c-r1-p1", &plan.to_string());
    let p = w.status().plan.unwrap();
    assert_eq!(
        (p.revision, p.source, p.step_names.clone()),
        (
            2,
            PlanSource::Planner,
            vec!["search".into(), "write".into()]
        )
    );
    assert_eq!(w.status().tokens_used, 120);
    assert!(w.pods.contains_key("run-search-102366-r2-a1"));
    let search = &w.status().plan.unwrap().steps[0];
    assert_eq!(
        search.container.as_ref().unwrap().args,
        ["--query", "refunds"]
    );
    assert_eq!(
        search.effect,
        agentrun_api::Effect::None,
        "from the catalog"
    );
    w.succeed("run-search-102366-r2-a1", "");
    w.succeed("run-write-9b1405-r2-a1", "");
    assert_eq!(w.status().phase, Some(RunPhase::Succeeded));
    assert_eq!(w.status().progress.as_deref(), Some("2/2"));
}

#[test]
fn a_bad_plan_fails_the_run_with_a_clear_condition() {
    let mut w = World::new(
        AgentRun::test()
            .with_planner(step("plan"))
            .with_steps([step("x")]),
    );
    w.settle();
    w.succeed(
        "run-plan-dbdf1c-r1-p1",
        r#"{"plan": [{"name": "Not A Name", "uses": "x"}]}"#,
    );
    assert_eq!(w.status().phase, Some(RunPhase::Failed));
    let c = condition(&w, ConditionType::Succeeded);
    assert_eq!(c.reason, Reason::InvalidPlan);
    assert!(c.message.contains("must be a DNS label"), "{}", c.message);
}

#[test]
fn an_invalid_spec_ends_the_run_without_a_hot_loop() {
    let cases = [
        (
            "bad duration",
            step("a").with_timeout("5 minutes"),
            "spec.steps[0].timeout: invalid duration",
        ),
        ("bad name", step("A_b"), "must be a DNS label"),
    ];
    for (name, s, want) in cases {
        let mut w = World::new(AgentRun::test().with_steps([s]));
        let d = w.settle();
        assert_eq!(w.status().phase, Some(RunPhase::Failed), "{name}");
        let c = condition(&w, ConditionType::Succeeded);
        assert_eq!(c.reason, Reason::InvalidSpec, "{name}");
        assert!(c.message.contains(want), "{name}: {}", c.message);
        assert_eq!(
            d.requeue_after, None,
            "{name}: waits for a change, no requeue"
        );
        assert!(w.created.is_empty(), "{name}");
    }
}

#[test]
fn an_invalid_plan_is_a_failed_attempt_within_the_planner_retries() {
    let mut w = World::new(
        AgentRun::test()
            .with_planner(step("plan").with_retry(1, "1s", "1s"))
            .with_steps([step("x")]),
    );
    w.settle();
    let bad = r#"{"plan": [{"name": "Not A Name", "uses": "x"}], "tokens": {"input": 7}}"#;
    w.succeed("run-plan-dbdf1c-r1-p1", bad);
    w.advance(2);
    w.settle();
    assert_eq!(w.status().tokens_used, 7, "the bad plan's tokens count");
    w.succeed("run-plan-dbdf1c-r1-p2", r#"{"plan": [{"name": "x"}]}"#);
    assert_eq!(w.status().plan.map(|p| p.revision), Some(2));
    assert_eq!(w.status().phase, Some(RunPhase::Running));
}

#[test]
fn condition_transition_times_move_only_on_status_changes() {
    let mut w = World::new(two_steps());
    w.settle();
    let before = w.status().conditions;
    w.advance(50);
    w.update_pod("run-a-2b8d3c-r1-a1", |p| p.running());
    w.settle();
    assert_eq!(
        w.status().conditions,
        before,
        "same statuses: same conditions"
    );
    w.run.metadata.generation = Some(2);
    w.settle();
    let after = w.status().conditions;
    assert!(after.iter().all(|c| c.observed_generation == Some(2)));
    for (a, b) in before.iter().zip(&after) {
        assert_eq!(
            a.last_transition_time, b.last_transition_time,
            "{}",
            a.type_
        );
    }
    assert_eq!(w.status().observed_generation, Some(2));
}

#[test]
fn events_use_pascal_case_reasons() {
    let mut w = World::new(two_steps());
    let d = w.step();
    for a in &d.actions {
        if let Action::Event { type_, reason, .. } = a {
            assert_eq!(*type_, EventType::Normal);
            assert!(
                reason.as_str().chars().next().unwrap().is_ascii_uppercase()
                    && !reason.as_str().contains(['_', ' '])
            );
        }
    }
}

#[test]
fn durations_in_status_messages_use_the_manifest_form() {
    // Sanity check of the Duration type the engine relies on.
    assert_eq!(
        "90s".parse::<Duration>().unwrap().parse().unwrap(),
        SignedDuration::from_secs(90)
    );
}

#[test]
fn a_backoff_is_never_shortened_by_the_whole_second_status_clock() {
    // Status keeps whole seconds; a failure seen at 0.7 s with a 1 s backoff
    // must not be retried before 1.7 s (so not at the 1 s boundary).
    let mut w = World::new(AgentRun::test().with_steps([step("a").with_retry(2, "1s", "1m")]));
    w.settle();
    w.now = t(0) + SignedDuration::from_millis(700);
    w.update_pod("run-a-2b8d3c-r1-a1", |p| {
        p.exited(1, &ok_message(json!(null), 0))
    });
    w.step();
    let a = cp(&w, "a", 1);
    assert_eq!(a.phase, StepPhase::Pending);
    assert_eq!(
        a.next_attempt_at.as_ref().map(|t| t.0),
        Some(t(2)),
        "0.7 s + 1 s, rounded up to the next whole second"
    );
    w.now = t(1) + SignedDuration::from_millis(900);
    assert!(creates(&w.step()).is_empty(), "not due at 1.9 s");
    w.now = t(2);
    assert_eq!(creates(&w.step()), ["run-a-2b8d3c-r1-a2"], "due at 2 s");
}

#[test]
fn a_finished_run_says_how_long_it_took() {
    let mut w = World::new(two_steps());
    w.settle();
    w.advance(30);
    w.succeed("run-a-2b8d3c-r1-a1", "");
    assert_eq!(w.status().duration, None, "not while it runs");
    w.advance(162);
    w.succeed("run-b-59c772-r1-a1", "");
    assert_eq!(w.status().duration.as_deref(), Some("3m12s"));
    let cases = [
        (45, "45s"),
        (119, "119s"),
        (192, "3m12s"),
        (300, "5m"),
        (5700, "95m"),
        (19200, "5h20m"),
        (108_000, "30h"),
        (273_600, "3d4h"),
        (1_036_800, "12d"),
    ];
    for (secs, want) in cases {
        assert_eq!(crate::human_duration(SignedDuration::from_secs(secs)), want);
    }
}
