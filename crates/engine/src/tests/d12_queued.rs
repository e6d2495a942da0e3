//! A run that has not started waits while the caps on active runs are
//! reached: phase `Queued` with its place, nothing created, no `startedAt`;
//! once it may start it runs as any run, and it is never queued again.

use super::*;
use crate::Queued;

fn held(position: u32) -> Option<Queued> {
    Some(Queued {
        position,
        why: "2 of 2 runs active in namespace default (maxActiveRunsPerNamespace)".into(),
    })
}

#[test]
fn a_queued_run_starts_nothing_and_says_where_it_waits() {
    let mut w = World::new(two_steps());
    w.queued = held(3);
    let d = w.settle();
    assert!(w.created.is_empty() && w.approvals.is_empty());
    let st = w.status();
    assert_eq!(
        (st.phase, st.queue_position, st.started_at),
        (Some(RunPhase::Queued), Some(3), None)
    );
    let c = condition(&w, ConditionType::Succeeded);
    assert_eq!(
        (c.status.as_str(), c.reason.as_str()),
        ("Unknown", "Queued")
    );
    assert_eq!(
        c.message,
        "queued at position 3: 2 of 2 runs active in namespace default (maxActiveRunsPerNamespace)"
    );
    assert_eq!(
        condition_of(&w, ConditionType::Progressing),
        ("False".into(), "Queued".into())
    );
    assert_eq!(d.requeue_after, Some(crate::QUEUE_RECHECK));
    // It moves up the queue.
    w.queued = held(1);
    w.settle();
    assert_eq!(w.status().queue_position, Some(1));
    // A place frees: it starts, and says nothing of the queue any more.
    w.advance(60);
    w.queued = None;
    w.settle();
    let st = w.status();
    assert_eq!(
        (st.phase, st.queue_position, st.started_at.map(|t| t.0)),
        (Some(RunPhase::Running), None, Some(t(60)))
    );
    assert_eq!(w.created, ["run-a-2b8d3c-r1-a1"]);
    assert_eq!(
        condition_of(&w, ConditionType::Succeeded),
        ("Unknown".into(), "Running".into())
    );
}

#[test]
fn a_started_run_is_never_queued_again() {
    let mut w = World::new(two_steps());
    w.settle();
    // The controller never says so for a started run; the engine holds
    // even if it did.
    w.queued = held(1);
    w.succeed("run-a-2b8d3c-r1-a1", "");
    assert_eq!(w.status().phase, Some(RunPhase::Running));
    assert_eq!(w.created.len(), 2);
}

#[test]
fn a_queued_run_that_is_cancelled_ends_at_once() {
    let mut w = World::new(two_steps());
    w.queued = held(2);
    w.settle();
    w.run.spec.cancel = true;
    w.settle();
    assert_eq!(w.status().phase, Some(RunPhase::Cancelled));
    assert!(w.created.is_empty());
}
