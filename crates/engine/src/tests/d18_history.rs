//! D18: a run created again after its TTL runs nothing; a finished run is
//! deleted by its TTL only once its record is stored; a run whose history
//! cannot be read waits, visibly; the spec digests a record is matched by.

use super::*;
use crate::History;
use agentrun_api::AlreadyRan;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

fn prior(outcome: &str) -> AlreadyRan {
    AlreadyRan {
        record: "run-0ld0uid0".into(),
        run_uid: "0ld0uid0-1".into(),
        outcome: outcome.into(),
        completed_at: Time(t(-3600)),
    }
}

#[test]
fn a_run_created_again_after_it_ran_runs_nothing_and_says_so() {
    let mut w = World::new(AgentRun::test().with_steps([step("a")]).with_ttl(0));
    w.history = History::AlreadyRan(prior("Succeeded"));
    let d = w.step();
    assert!(creates(&d).is_empty(), "{:?}", d.actions);
    let s = w.status();
    assert_eq!(s.phase, Some(RunPhase::AlreadyRan));
    assert_eq!(s.already_ran, Some(Box::new(prior("Succeeded"))));
    assert!(s.steps.is_empty() && s.plan.is_none() && s.started_at.is_none());
    let (status, reason) = condition_of(&w, ConditionType::Ready);
    assert_eq!((status.as_str(), reason.as_str()), ("True", "AlreadyRan"));
    let (status, _) = condition_of(&w, ConditionType::Succeeded);
    assert_eq!(status, "True", "it mirrors how the earlier run ended");
    assert!(
        d.actions.iter().any(|a| matches!(a,
            Action::Event { reason: Reason::AlreadyRan, message, .. }
                if message.contains("RunRecord run-0ld0uid0") && message.contains("agentrun.dev/rerun"))),
        "{:?}",
        d.actions
    );
    // Sticky, and never deleted by its TTL: a re-sync would only create it again.
    w.history = History::On;
    w.advance(3600);
    let d = w.step();
    assert!(d.actions.is_empty(), "{:?}", d.actions);
    assert_eq!(w.status().phase, Some(RunPhase::AlreadyRan));
    assert!(!w.run_deleted);
}

#[test]
fn a_run_whose_earlier_run_failed_is_not_run_again_either() {
    let mut w = World::new(AgentRun::test().with_steps([step("a")]));
    w.history = History::AlreadyRan(prior("Failed"));
    let d = w.step();
    assert!(creates(&d).is_empty());
    assert_eq!(w.status().phase, Some(RunPhase::AlreadyRan));
    let (status, reason) = condition_of(&w, ConditionType::Succeeded);
    assert_eq!((status.as_str(), reason.as_str()), ("False", "AlreadyRan"));
}

#[test]
fn a_run_whose_history_cannot_be_read_waits_visibly_then_starts() {
    let mut w = World::new(AgentRun::test().with_steps([step("a")]));
    w.history = History::Unavailable("connection refused".into());
    let warned = |d: &Decision| {
        d.actions.iter().any(|a| {
            matches!(a,
            Action::Event { type_: EventType::Warning, reason: Reason::HistoryUnavailable, message }
                if message.contains("connection refused"))
        })
    };
    let d = w.step();
    assert!(creates(&d).is_empty(), "{:?}", d.actions);
    assert!(
        warned(&d),
        "a Warning Event when the wait begins: {:?}",
        d.actions
    );
    let d = w.step();
    assert!(creates(&d).is_empty(), "{:?}", d.actions);
    assert!(!warned(&d), "not again at every look");
    assert_eq!(
        d.requeue_after,
        Some(SignedDuration::from_secs(15)),
        "looked up again soon"
    );
    let s = w.status();
    assert_eq!(s.phase, Some(RunPhase::Pending));
    assert!(
        s.spec_digests.is_empty(),
        "not looked up yet: looked up again"
    );
    assert!(crate::needs_lookup(&w.run));
    let (status, reason) = condition_of(&w, ConditionType::Stalled);
    assert_eq!(
        (status.as_str(), reason.as_str()),
        ("True", "HistoryUnavailable")
    );
    w.history = History::On;
    let d = w.settle();
    assert_eq!(w.created, ["run-a-2b8d3c-r1-a1"], "{d:?}");
    assert_eq!(w.status().spec_digests.len(), 1);
    assert!(!crate::needs_lookup(&w.run));
    let (status, _) = condition_of(&w, ConditionType::Stalled);
    assert_eq!(status, "False");
}

#[test]
fn the_ttl_deletes_a_finished_run_only_once_its_record_is_stored() {
    let mut w = World::new(AgentRun::test().with_steps([step("a")]).with_ttl(0));
    w.history = History::On;
    w.settle();
    w.succeed("run-a-2b8d3c-r1-a1", "");
    assert_eq!(w.status().phase, Some(RunPhase::Succeeded));
    // The record could not be stored (the controller left status.record unset).
    let d = w.step();
    assert!(!d.actions.contains(&Action::DeleteRun), "{:?}", d.actions);
    assert_eq!(d.requeue_after, Some(SignedDuration::from_secs(15)));
    assert!(!w.run_deleted);
    // D16: the TTL is due and the run stays: it says why.
    let (status, reason) = condition_of(&w, ConditionType::Stalled);
    assert_eq!((status.as_str(), reason.as_str()), ("True", "RecordFailed"));
    // Stored, and named by the status: now the TTL applies.
    let mut s = w.status();
    s.record = Some("run-runuid".into());
    w.run.status = Some(s);
    assert_eq!(w.step().actions, [Action::DeleteRun]);
    assert!(w.run_deleted);
}

#[test]
fn without_history_the_ttl_does_not_wait_for_a_record() {
    let mut w = World::new(AgentRun::test().with_steps([step("a")]).with_ttl(0));
    w.settle();
    w.succeed("run-a-2b8d3c-r1-a1", "");
    assert_eq!(w.step().actions, [Action::DeleteRun]);
}

#[test]
fn each_version_of_the_spec_the_run_ran_is_noted_once() {
    let mut w = World::new(AgentRun::test().with_steps([step("a"), step("b")]));
    w.history = History::On;
    w.settle();
    let first = w.status().spec_digests;
    assert_eq!(first, [agentrun_api::spec_digest(&w.run.spec)]);
    // A control is not what runs: no new digest.
    w.run.spec.suspend = true;
    w.run.metadata.generation = Some(2);
    w.settle();
    assert_eq!(w.status().spec_digests, first);
    // An edit of a step not started is: the record will match either.
    w.run.spec.suspend = false;
    w.run.spec.steps[1].container.as_mut().unwrap().image = "b:2".into();
    w.run.metadata.generation = Some(3);
    w.settle();
    let digests = w.status().spec_digests;
    assert_eq!(digests.len(), 2);
    assert_eq!(digests[0], first[0]);
    assert_eq!(digests[1], agentrun_api::spec_digest(&w.run.spec));
}
