//! D3/D4/D5: an outcome recorded once, committed before the next effect, finalizers released after the commit.

use super::*;

#[test]
fn a_step_outcome_and_the_next_launch_share_one_write() {
    let mut w = World::new(two_steps());
    w.settle();
    w.update_pod("run-a-2b8d3c-r1-a1", |p| {
        p.succeeded(&ok_message(json!({"rows": 3}), 7))
    });
    let hand_off = w.decide();
    let a = hand_off
        .status
        .steps
        .iter()
        .find(|c| c.name == "a")
        .cloned()
        .unwrap();
    assert_eq!(
        (a.phase, a.checkpoint),
        (StepPhase::Succeeded, CheckpointState::Committed)
    );
    assert_eq!(a.result, Some(json!({"rows": 3})));
    assert_eq!(a.effect, Some(EffectOutcome::Applied));
    assert_eq!(hand_off.status.tokens_used, 7);
    // D4: b's Pod is an action of the decision whose status holds a's outcome;
    // actions are applied only once that status is acknowledged.
    assert_eq!(creates(&hand_off), ["run-b-59c772-r1-a1"]);
    let b = hand_off
        .status
        .steps
        .iter()
        .find(|c| c.name == "b")
        .unwrap();
    assert_eq!(
        (b.phase, b.pod.as_deref()),
        (StepPhase::Running, Some("run-b-59c772-r1-a1")),
        "b's launch is recorded in the same write as a's outcome"
    );
    assert!(
        releases(&hand_off).is_empty(),
        "D5: the finalizer stays until the outcome is committed"
    );
    assert_eq!(
        hand_off.requeue_after,
        secs(0),
        "the next decision releases a's finalizer"
    );
    w.commit(&hand_off);
    let next = w.step();
    assert!(creates(&next).is_empty(), "b is not launched twice");
    assert_eq!(releases(&next), ["run-a-2b8d3c-r1-a1"]);
    assert_eq!(next.status, w.status(), "no further write");
    assert_eq!(cp(&w, "a", 1), a, "D3: the checkpoint does not change");
}

#[test]
fn a_failed_status_write_starts_nothing_and_reports_no_success() {
    let mut w = World::new(two_steps());
    w.settle();
    w.update_pod("run-a-2b8d3c-r1-a1", |p| p.succeeded(""));
    // The write of this decision fails (409): nothing is applied, the world is unchanged.
    let lost = w.decide();
    assert_eq!(creates(&lost), ["run-b-59c772-r1-a1"]);
    assert!(
        !w.pods.contains_key("run-b-59c772-r1-a1"),
        "D4: b does not start"
    );
    assert_eq!(w.status().phase, Some(RunPhase::Running));
    let again = w.step();
    assert_eq!(
        again.status.steps, lost.status.steps,
        "the same outcome is recorded again"
    );
    w.update_pod("run-b-59c772-r1-a1", |p| p.succeeded(""));
    let last = w.decide();
    assert_eq!(
        last.status.phase,
        Some(RunPhase::Succeeded),
        "the last outcome and Succeeded are one write"
    );
    assert_eq!(
        w.status().phase,
        Some(RunPhase::Running),
        "D4: not Succeeded until that write is acknowledged"
    );
    w.settle();
    assert_eq!(w.status().phase, Some(RunPhase::Succeeded));
    for pod in ["run-a-2b8d3c-r1-a1", "run-b-59c772-r1-a1"] {
        assert!(
            w.pods[pod].metadata.finalizers.is_none(),
            "{pod} released after the commit"
        );
    }
}

#[test]
fn a_recorded_outcome_is_never_regressed_by_a_stale_pod_view() {
    let mut w = World::new(two_steps());
    w.settle();
    let running = w.pod("run-a-2b8d3c-r1-a1").running();
    w.succeed("run-a-2b8d3c-r1-a1", "");
    let a = cp(&w, "a", 1);
    // A lagging cache still shows a running again.
    let d = w.decide_with(&[running]);
    let after = d.status.steps.iter().find(|c| c.name == "a").unwrap();
    assert_eq!(after, &a);
}
