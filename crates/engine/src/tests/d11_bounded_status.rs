//! D11: context and status stay bounded: the compactor, trimming, results left out, compaction, the checkpoint cap.

use super::*;

fn big_result(i: usize) -> String {
    ok_message(json!({"i": i, "text": "y".repeat(700)}), 0)
}

/// Steps a, b and c with a 1 KiB context; a and b returned 700 bytes each.
fn two_big_results_before_c(compactor: bool) -> World {
    let mut w = World::new(
        AgentRun::test()
            .with_steps([step("a"), step("b"), step("c")])
            .with_context(1024, compactor),
    );
    w.settle();
    w.succeed("run-a-2b8d3c-r1-a1", &big_result(0));
    w.succeed("run-b-59c772-r1-a1", &big_result(1));
    w
}

#[test]
fn context_past_max_bytes_runs_the_compactor_at_the_checkpoint_boundary() {
    let mut w = two_big_results_before_c(true);
    assert!(
        w.pods.contains_key("run-c-aa03bb-r1-s1"),
        "the compactor runs before c"
    );
    assert!(!w.pods.contains_key("run-c-aa03bb-r1-a1"));
    let compactor = w.pod("run-c-aa03bb-r1-s1");
    assert_eq!(
        compactor.metadata.labels.as_ref().unwrap()[labels::ROLE],
        "compactor"
    );
    w.succeed(
        "run-c-aa03bb-r1-s1",
        r#"{"summary": "a and b found 2 things", "tokens": {"input": 3}}"#,
    );
    assert_eq!(
        w.status().summary.as_deref(),
        Some("a and b found 2 things")
    );
    let ctx: serde_json::Value = serde_json::from_str(
        &w.pod("run-c-aa03bb-r1-a1").metadata.annotations.unwrap()[labels::CONTEXT],
    )
    .unwrap();
    assert_eq!(ctx["summary"], "a and b found 2 things");
    assert_eq!(
        ctx["results"],
        json!([]),
        "the summary replaces the raw results"
    );
    assert_eq!(w.status().tokens_used, 3);
}

#[test]
fn without_a_compactor_the_context_is_trimmed_to_max_bytes() {
    let w = two_big_results_before_c(false);
    let ctx = w.pod("run-c-aa03bb-r1-a1").metadata.annotations.unwrap()[labels::CONTEXT].clone();
    assert!(ctx.len() <= 1024, "{} bytes", ctx.len());
    let v: serde_json::Value = serde_json::from_str(&ctx).unwrap();
    assert_eq!(v["results"][0]["step"], "b", "the newest result is kept");
    assert_eq!(v["omittedResults"], 1);
}

#[test]
fn a_compactor_that_returns_no_summary_keeps_the_one_there_was() {
    let mut w = World::new(
        AgentRun::test()
            .with_steps([step("a"), step("b"), step("c"), step("d"), step("e")])
            .with_context(1024, true),
    );
    w.settle();
    w.succeed("run-a-2b8d3c-r1-a1", &big_result(0));
    w.succeed("run-b-59c772-r1-a1", &big_result(1));
    w.succeed(
        "run-c-aa03bb-r1-s1",
        r#"{"summary": "a and b found 2 things"}"#,
    );
    w.succeed("run-c-aa03bb-r1-a1", &big_result(2));
    w.succeed("run-d-49574a-r1-a1", &big_result(3));
    assert!(
        w.pods.contains_key("run-e-b2b094-r1-s1"),
        "{:?}",
        w.pods.keys()
    );
    w.succeed("run-e-b2b094-r1-s1", r#"{"result": null}"#);
    assert_eq!(
        w.status().summary.as_deref(),
        Some("a and b found 2 things")
    );
}

/// A result the run-wide inline cap leaves out of status is not dropped
/// silently: the checkpoint says so and a Warning Event tells people (D16).
#[test]
fn a_result_left_out_of_status_says_so() {
    let steps: Vec<_> = (0..14).map(|i| step(&format!("s{i:02}"))).collect();
    let mut w = World::new(AgentRun::test().with_steps(steps));
    w.settle();
    let mut warned = Vec::new();
    for i in 0..14 {
        let pod = w.status().steps[i].pod.clone().expect("launched");
        w.update_pod(&pod, |p| {
            p.succeeded(&ok_message(json!("x".repeat(3900)), 0))
        });
        let d = w.step();
        if events(&d).contains(&Reason::ResultNotKept) {
            warned.push(i);
        }
        w.settle();
    }
    // 12 results of 3,902 bytes fit in 48 KiB; the 13th and 14th do not.
    assert_eq!(warned, [12, 13]);
    let s = w.status();
    assert_eq!(s.phase, Some(RunPhase::Succeeded));
    assert!(s.steps[11].result.is_some() && !s.steps[11].result_truncated);
    let c = &s.steps[12];
    assert!(c.result.is_none() && c.result_truncated);
    assert_says(c.message.as_deref(), "its result was not kept");
}

/// A plan of 500 steps with a 63-character run name and 48-character step
/// names, with fresh, near-limit results.
fn maximal_run(fresh_for_first: &str) -> World {
    let steps: Vec<_> = (0..500)
        .map(|i| {
            let s = step(&format!("{i:03}-{}", "s".repeat(44)));
            s.with_fresh_for(if i == 0 { fresh_for_first } else { "24h" })
        })
        .collect();
    let mut run = AgentRun::test().with_steps(steps);
    run.metadata.name = Some("r".repeat(63));
    let mut w = World::new(run);
    w.settle();
    w
}

/// The Pod of step `i`'s current attempt.
fn launched(w: &World, i: usize) -> String {
    w.status().steps[i]
        .pod
        .clone()
        .unwrap_or_else(|| panic!("step {i} launched"))
}

#[test]
fn status_of_a_500_step_run_with_maximal_names_stays_under_256_kib() {
    let mut w = maximal_run("24h");
    for i in 0..500 {
        let pod = launched(&w, i);
        w.succeed(&pod, &ok_message(json!("z".repeat(1000)), 10));
    }
    let s = w.status();
    assert_eq!(s.phase, Some(RunPhase::Succeeded));
    // With every checkpoint inline (an AgentRun CRD without the archive), and as stored.
    let size = agentrun_api::archive::inline(|| serde_json::to_vec(&s).unwrap().len());
    let stored = serde_json::to_vec(&s).unwrap().len();
    eprintln!("500-step status with maximal names: {size} bytes inline, {stored} stored");
    assert!(size < 256 * 1024, "status is {size} bytes");
    assert!(
        stored < size / 2,
        "the archive holds most of it: {stored} bytes stored"
    );
    assert_eq!(
        s.tokens_used, 5000,
        "compaction keeps the run's token count"
    );
    assert!(
        s.steps.iter().all(|c| c.compacted),
        "with such names every finished checkpoint is cut to its facts"
    );
    assert!(
        s.steps.iter().any(|c| c.result_truncated),
        "later results are kept out of status (48 KiB inline)"
    );
    // Compaction keeps every outcome's facts.
    assert_eq!(s.steps.len(), 500);
    for c in &s.steps {
        assert_eq!(
            (c.phase, c.checkpoint, c.effect, c.attempt),
            (
                StepPhase::Succeeded,
                CheckpointState::Committed,
                Some(EffectOutcome::Applied),
                1
            ),
            "{}",
            c.name
        );
        assert!(c.fresh_until.is_some() && c.finished_at.is_some());
    }
}

#[test]
fn a_replan_that_would_overflow_the_status_fails_the_run_and_says_why() {
    let mut w = maximal_run("1m");
    // Reads, every one: a re-plan runs each of them again (steps that
    // acted would keep their checkpoints instead).
    for s in w.run.spec.steps.iter_mut() {
        s.effect = Effect::None;
    }
    for i in 0..30 {
        let pod = launched(&w, i);
        if i == 29 {
            w.advance(120); // step 0's result is stale before step 30 starts
        }
        w.succeed(&pod, &ok_message(json!(i), 1));
    }
    let s = w.status();
    assert_eq!(s.phase, Some(RunPhase::Failed));
    assert_eq!(s.plan.as_ref().map(|p| p.revision), Some(1), "no re-plan");
    assert_eq!(s.steps.len(), 30, "step 30 never started");
    let (status, why) = condition_of(&w, ConditionType::Succeeded);
    assert_eq!(
        (status.as_str(), why.as_str()),
        ("False", Reason::StatusBudgetExceeded.as_str())
    );
    let message = &crate::conditions::get(&s.conditions, ConditionType::Succeeded)
        .unwrap()
        .message;
    assert!(
        message.contains("would keep 530 checkpoints in status, more than the 520"),
        "{message}"
    );
}

/// The compactor's checkpoint marks where the summary ends. Compacting the
/// status must keep the newest one, or every later step finds all results
/// since an older boundary in its context and runs the compactor again.
#[test]
fn compacting_the_status_keeps_the_summary_boundary() {
    let steps: Vec<_> = (0..300)
        .map(|i| step(&format!("{i:03}-{}", "s".repeat(44))))
        .collect();
    let mut run = AgentRun::test().with_steps(steps).with_context(2048, true);
    run.metadata.name = Some("r".repeat(63));
    let mut w = World::new(run);
    w.settle();
    let mut compactions = Vec::new();
    for i in 0..300 {
        // Run the compactor before step i as often as it is asked.
        let mut n = 0;
        loop {
            let cp = w.status().steps.last().cloned().unwrap();
            let pod = cp.pod.clone().unwrap();
            if cp.role == StepRole::Compactor {
                n += 1;
                w.succeed(&pod, &format!(r#"{{"summary": "through step {i}"}}"#));
                continue;
            }
            w.succeed(
                &pod,
                &ok_message(json!({"i": i, "text": "z".repeat(500)}), 0),
            );
            break;
        }
        compactions.push(n);
    }
    assert_eq!(w.status().phase, Some(RunPhase::Succeeded));
    let size = agentrun_api::archive::inline(|| serde_json::to_vec(&w.status()).unwrap().len());
    assert!(size > 128 * 1024, "the status was compacted: {size} bytes");
    let late: usize = compactions[200..].iter().sum();
    assert!(
        late <= 10,
        "the compactor ran {late} times before the last 100 steps: {:?}",
        &compactions[200..]
    );
}
