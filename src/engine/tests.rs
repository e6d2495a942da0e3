//! Named cases for every rule of the engine, by durability guarantee.

use jiff::SignedDuration;
use serde_json::json;

use super::reasons::{ConditionType, Reason};
use super::testing::*;
use super::{Action, Decision, EventType, Refusal, RefusalCause, Tally};
use crate::api::{
    AgentRun, ApprovalKind, ApprovalPhase, CheckpointState, Decision as Answer, Duration, Effect,
    EffectOutcome, OnTimeout, PlanSource, RunPhase, StepCheckpoint, StepPhase, StepRole,
};
use crate::labels;

/// The idempotency key of step `a` at plan revision 1 of the test run (UID
/// `run-uid`), computed outside the code under test:
/// `python3 -c "import hashlib; print(hashlib.sha256(b'run-uid\\x00a\\x001').hexdigest()[:32])"`.
const KEY_A_R1: &str = "4f5e1fac634d7b33a6e863ae81245ce6";

fn creates(d: &Decision) -> Vec<String> {
    d.actions
        .iter()
        .filter_map(|a| match a {
            Action::CreatePod(p) => p.metadata.name.clone(),
            _ => None,
        })
        .collect()
}

fn releases(d: &Decision) -> Vec<String> {
    d.actions
        .iter()
        .filter_map(|a| match a {
            Action::ReleaseFinalizer { pod } => Some(pod.clone()),
            _ => None,
        })
        .collect()
}

fn deletes(d: &Decision) -> Vec<String> {
    d.actions
        .iter()
        .filter_map(|a| match a {
            Action::DeletePod { name, .. } => Some(name.clone()),
            _ => None,
        })
        .collect()
}

fn events(d: &Decision) -> Vec<Reason> {
    d.actions
        .iter()
        .filter_map(|a| match a {
            Action::Event { reason, .. } => Some(*reason),
            _ => None,
        })
        .collect()
}

fn cp(w: &World, name: &str, rev: i64) -> StepCheckpoint {
    w.status()
        .steps
        .into_iter()
        .find(|c| c.name == name && c.plan_revision == rev && c.role == StepRole::Step)
        .unwrap_or_else(|| panic!("no checkpoint {name}@{rev}"))
}

fn condition_of(w: &World, type_: ConditionType) -> (String, String) {
    let c = w
        .status()
        .conditions
        .into_iter()
        .find(|c| c.type_ == type_)
        .unwrap_or_else(|| panic!("no {type_}"));
    (c.status, c.reason)
}

fn secs(n: i64) -> Option<SignedDuration> {
    Some(SignedDuration::from_secs(n))
}

fn two_steps() -> AgentRun {
    AgentRun::test().with_steps([step("a"), step("b")])
}

// ---------------------------------------------------------------------------
// Launching: D1 keys, D2 names, the Pod object
// ---------------------------------------------------------------------------

#[test]
fn first_decision_records_the_plan_and_launches_the_first_step() {
    let mut w = World::new(two_steps());
    let d = w.step();
    let s = w.status();
    assert_eq!(
        s.plan.as_ref().map(|p| (p.revision, p.source)),
        Some((1, PlanSource::Spec))
    );
    assert_eq!(s.phase, Some(RunPhase::Running));
    assert_eq!(creates(&d), ["run-a-2b8d3c-r1-a1"]);
    let a = cp(&w, "a", 1);
    assert_eq!(
        (a.attempt, a.phase, a.pod.as_deref()),
        (1, StepPhase::Running, Some("run-a-2b8d3c-r1-a1"))
    );
    assert_eq!(a.idempotency_key, KEY_A_R1);
    assert_eq!(s.step_executions, 1);
    assert_eq!(s.progress.as_deref(), Some("0/2"));
    assert_eq!(s.current_step.as_deref(), Some("a"));
    assert_eq!(
        d.requeue_after,
        secs(0),
        "status changed: continue after the write"
    );
}

#[test]
fn step_pods_carry_identity_context_finalizer_and_a_restricted_security_context() {
    let mut w = World::new(two_steps());
    w.step();
    let pod = w.pod("run-a-2b8d3c-r1-a1");
    let key = KEY_A_R1.to_owned();
    let l = pod.metadata.labels.clone().unwrap();
    for (k, v) in [
        (labels::RUN, "run"),
        (labels::STEP, "a"),
        (labels::PLAN_REVISION, "1"),
        (labels::ATTEMPT, "1"),
        (labels::ROLE, "step"),
        (labels::IDEMPOTENCY_KEY, key.as_str()),
    ] {
        assert_eq!(l.get(k).map(String::as_str), Some(v), "label {k}");
    }
    let ann = pod.metadata.annotations.clone().unwrap();
    assert_eq!(ann.get(labels::IDEMPOTENCY_KEY), Some(&key));
    let ctx: serde_json::Value = serde_json::from_str(&ann[labels::CONTEXT]).unwrap();
    assert_eq!(
        (ctx["step"].as_str(), ctx["attempt"].as_i64()),
        (Some("a"), Some(1))
    );
    assert_eq!(
        pod.metadata.finalizers,
        Some(vec![labels::RESULT_FINALIZER.to_owned()])
    );
    let owner = &pod.metadata.owner_references.as_ref().unwrap()[0];
    assert_eq!((owner.uid.as_str(), owner.controller), (UID, Some(true)));
    let spec = pod.spec.unwrap();
    assert_eq!(spec.restart_policy.as_deref(), Some("Never"));
    assert_eq!(spec.automount_service_account_token, Some(false));
    let c = &spec.containers[0];
    let env: Vec<(String, String)> = c
        .env
        .clone()
        .unwrap()
        .into_iter()
        .map(|e| (e.name, e.value.unwrap_or_default()))
        .collect();
    for (k, v) in [
        (labels::env::IDEMPOTENCY_KEY, key.as_str()),
        (labels::env::RUN, "run"),
        (labels::env::STEP, "a"),
        (labels::env::ATTEMPT, "1"),
        (labels::env::PLAN_REVISION, "1"),
        (labels::env::CONTEXT_FILE, labels::CONTEXT_PATH),
    ] {
        assert!(env.contains(&(k.to_owned(), v.to_owned())), "env {k}");
    }
    let sc = c.security_context.clone().unwrap();
    assert_eq!(sc.allow_privilege_escalation, Some(false));
    assert_eq!(sc.run_as_non_root, Some(true));
    assert_eq!(sc.capabilities.unwrap().drop, Some(vec!["ALL".to_owned()]));
    assert_eq!(sc.seccomp_profile.unwrap().type_, "RuntimeDefault");
    let mount = &c.volume_mounts.as_ref().unwrap()[0];
    assert_eq!(mount.mount_path, "/agentrun");
    let vol = &spec.volumes.unwrap()[0];
    let item = &vol.downward_api.as_ref().unwrap().items.as_ref().unwrap()[0];
    assert_eq!(item.path, "context.json");
    assert_eq!(
        item.field_ref.as_ref().unwrap().field_path,
        "metadata.annotations['agentrun.dev/context']"
    );
}

#[test]
fn a_pod_missing_from_the_cache_is_created_again_under_the_same_name() {
    let mut w = World::new(two_steps());
    w.step();
    // The cache has not seen the Pod yet: the same create is repeated.
    let d = w.decide_with(&[]);
    assert_eq!(creates(&d), ["run-a-2b8d3c-r1-a1"]);
    assert_eq!(d.status, w.status(), "no new attempt, no status change");
}

#[test]
fn an_unchanged_world_gives_back_the_same_status() {
    struct Case {
        name: &'static str,
        world: fn() -> World,
    }
    let cases = [
        Case {
            name: "step running",
            world: || {
                let mut w = World::new(two_steps());
                w.settle();
                w.update_pod("run-a-2b8d3c-r1-a1", |p| p.running());
                w.settle();
                w
            },
        },
        Case {
            name: "backoff wait",
            world: || {
                let mut w =
                    World::new(AgentRun::test().with_steps([step("a").with_retry(2, "10s", "1m")]));
                w.settle();
                w.update_pod("run-a-2b8d3c-r1-a1", |p| p.exited(1, ""));
                w.settle();
                w
            },
        },
        Case {
            name: "approval wait",
            world: || {
                let mut w = World::new(
                    AgentRun::test()
                        .with_steps([step("a").with_approval(Some("1h"), OnTimeout::Reject)]),
                );
                w.settle();
                w
            },
        },
        Case {
            name: "succeeded with TTL",
            world: || {
                let mut w = World::new(AgentRun::test().with_steps([step("a")]).with_ttl(60));
                w.settle();
                w.succeed("run-a-2b8d3c-r1-a1", "");
                w
            },
        },
    ];
    for c in cases {
        let w = (c.world)();
        let d = w.decide();
        assert_eq!(d.status, w.status(), "{}", c.name);
        assert_ne!(d.requeue_after, secs(0), "{}: no hot loop", c.name);
        assert!(creates(&d).is_empty(), "{}", c.name);
    }
}

// ---------------------------------------------------------------------------
// D3/D4/D5: outcomes once, commit before the next effect, finalizers after commit
// ---------------------------------------------------------------------------

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

// ---------------------------------------------------------------------------
// D6/D7: failure, disruption, timeouts, retries with backoff
// ---------------------------------------------------------------------------

#[test]
fn failures_consume_retries_with_exponential_backoff() {
    let mut w = World::new(AgentRun::test().with_steps([step("a").with_retry(2, "10s", "15s")]));
    w.settle();
    w.update_pod("run-a-2b8d3c-r1-a1", |p| {
        p.exited(1, &ok_message(json!(null), 5))
    });
    let d = w.step();
    let a = cp(&w, "a", 1);
    assert_eq!((a.phase, a.failures, a.attempt), (StepPhase::Pending, 1, 1));
    assert_eq!(a.next_attempt_at.as_ref().map(|t| t.0), Some(t(10)));
    assert_eq!(
        w.status().tokens_used,
        5,
        "D9: a failed attempt's tokens count"
    );
    assert!(events(&d).contains(&Reason::StepRetrying));
    let wait = w.step();
    assert!(creates(&wait).is_empty(), "no attempt before the backoff");
    assert_eq!(
        wait.requeue_after,
        secs(10),
        "requeue exactly at the backoff"
    );
    w.advance(10);
    let d = w.step();
    assert_eq!(creates(&d), ["run-a-2b8d3c-r1-a2"]);
    assert_eq!(
        cp(&w, "a", 1).idempotency_key,
        a.idempotency_key,
        "D1: same key across attempts"
    );
    w.settle();
    w.update_pod("run-a-2b8d3c-r1-a2", |p| p.exited(2, ""));
    w.settle();
    assert_eq!(
        cp(&w, "a", 1).next_attempt_at.as_ref().map(|t| t.0),
        Some(t(25)),
        "doubled to 20s, capped at 15s"
    );
    w.advance(15);
    w.settle();
    w.update_pod("run-a-2b8d3c-r1-a3", |p| p.exited(1, ""));
    w.settle();
    let a = cp(&w, "a", 1);
    assert_eq!((a.phase, a.failures), (StepPhase::Failed, 3));
    assert!(a.message.unwrap().contains("no retries left"));
    assert_eq!(w.status().phase, Some(RunPhase::Failed));
    assert_eq!(
        condition_of(&w, ConditionType::Succeeded),
        ("False".into(), Reason::StepFailed.into())
    );
}

#[test]
fn disruptions_do_not_consume_retries() {
    struct Case {
        name: &'static str,
        disrupt: fn(&mut World),
    }
    let cases = [
        Case {
            name: "evicted",
            disrupt: |w| w.update_pod("run-a-2b8d3c-r1-a1", |p| p.evicted(true)),
        },
        Case {
            name: "preempted",
            disrupt: |w| {
                w.update_pod("run-a-2b8d3c-r1-a1", |p| {
                    let mut p = p.exited(137, "");
                    p.status.as_mut().unwrap().reason = Some("Preempted".into());
                    p
                })
            },
        },
        Case {
            name: "deleted before finishing",
            disrupt: |w| {
                let now = w.now;
                w.update_pod("run-a-2b8d3c-r1-a1", |p| p.exited(143, "").deleting(now))
            },
        },
    ];
    for c in cases {
        let mut w = World::new(AgentRun::test().with_steps([step("a")]));
        w.settle();
        w.update_pod("run-a-2b8d3c-r1-a1", |p| p.running());
        w.settle();
        (c.disrupt)(&mut w);
        w.settle();
        let a = cp(&w, "a", 1);
        assert_eq!(
            (a.failures, a.disruptions, a.attempt),
            (0, 1, 2),
            "{}",
            c.name
        );
        assert_eq!(a.phase, StepPhase::Running, "{}: runs again", c.name);
        assert!(w.pods.contains_key("run-a-2b8d3c-r1-a2"), "{}", c.name);
        assert_eq!(
            w.pod("run-a-2b8d3c-r1-a2").metadata.labels.unwrap()[labels::IDEMPOTENCY_KEY],
            a.idempotency_key,
            "{}: same key",
            c.name
        );
    }
}

/// A Reconcile question superseded while the run still waits on it (a
/// deposed operator acting on an old copy of the run did this) is asked
/// again as a Reconcile question; it never turns into an approval gate for a
/// step that has none (D6).
#[test]
fn a_superseded_reconcile_question_is_asked_again_as_one() {
    let mut w =
        World::new(AgentRun::test().with_steps([step("a").with_effect(Effect::NonIdempotent)]));
    w.settle();
    w.update_pod("run-a-2b8d3c-r1-a1", |p| p.running());
    w.settle();
    w.update_pod("run-a-2b8d3c-r1-a1", |p| p.evicted(true));
    w.settle();
    let first = "run-a-2b8d3c-r1-reconcile-a1";
    let a = w.approvals.get_mut(first).expect("the Reconcile question");
    a.status = Some(crate::api::ApprovalStatus {
        phase: ApprovalPhase::Superseded,
        ..Default::default()
    });
    w.settle();
    let again = "run-a-2b8d3c-r1-reconcile-a1-2";
    assert_eq!(
        w.approvals.keys().map(String::as_str).collect::<Vec<_>>(),
        [first, again],
        "no Approve question is opened"
    );
    assert_eq!(w.approvals[again].spec.kind, ApprovalKind::Reconcile);
    let a = cp(&w, "a", 1);
    assert_eq!(
        (a.phase, a.effect, a.approval.as_deref()),
        (
            StepPhase::WaitingForApproval,
            Some(EffectOutcome::Unknown),
            Some(again)
        )
    );
    assert!(w.decide_approval(again, Answer::Retry, "someone"));
    w.settle();
    assert_eq!(cp(&w, "a", 1).attempt, 2, "the person's answer is acted on");
    assert_eq!(w.created.len(), 2);
}

#[test]
fn a_disrupted_non_idempotent_step_asks_a_person_instead_of_rerunning() {
    let mut w = World::new(
        AgentRun::test().with_steps([step("a").with_effect(Effect::NonIdempotent), step("b")]),
    );
    w.settle();
    w.update_pod("run-a-2b8d3c-r1-a1", |p| p.running());
    w.settle();
    w.update_pod("run-a-2b8d3c-r1-a1", |p| p.evicted(true));
    w.settle();
    let a = cp(&w, "a", 1);
    assert_eq!(
        (a.phase, a.effect),
        (StepPhase::WaitingForApproval, Some(EffectOutcome::Unknown))
    );
    assert_eq!(w.status().phase, Some(RunPhase::WaitingForApproval));
    assert!(w.live_pods().is_empty(), "a durable wait runs no Pods");
    let name = "run-a-2b8d3c-r1-reconcile-a1";
    assert_eq!(w.approvals[name].spec.kind, ApprovalKind::Reconcile);
    assert_eq!(w.created.len(), 1, "no rerun");

    struct Case {
        name: &'static str,
        decision: Answer,
        check: fn(&World),
    }
    let cases = [
        Case {
            name: "Retry reruns with the same key",
            decision: Answer::Retry,
            check: |w| {
                let a = cp(w, "a", 1);
                assert_eq!((a.attempt, a.phase), (2, StepPhase::Running));
                assert_eq!(a.idempotency_key, KEY_A_R1);
            },
        },
        Case {
            name: "MarkSucceeded records it applied and goes on",
            decision: Answer::MarkSucceeded,
            check: |w| {
                let a = cp(w, "a", 1);
                assert_eq!(
                    (a.phase, a.effect),
                    (StepPhase::Succeeded, Some(EffectOutcome::Applied))
                );
                assert!(w.pods.contains_key("run-b-59c772-r1-a1"));
            },
        },
        Case {
            name: "MarkFailed fails the run",
            decision: Answer::MarkFailed,
            check: |w| assert_eq!(w.status().phase, Some(RunPhase::Failed)),
        },
    ];
    for c in cases {
        let mut w2 = w.clone();
        w2.decide_approval(name, c.decision, "kubectl-patch");
        w2.settle();
        (c.check)(&w2);
        let st = w2.approvals[name].status.clone().unwrap();
        assert_eq!(
            (st.phase, st.decided_by.as_deref()),
            (ApprovalPhase::Resolved, Some("kubectl-patch")),
            "{}",
            c.name
        );
    }
}

#[test]
fn a_vanished_pod_reruns_with_the_same_key_or_asks_a_person() {
    // An Idempotent step's Pod costs no write while it runs: if it vanishes
    // (finalizer stripped, then deleted) it is created again, same name, same key.
    let mut w = World::new(AgentRun::test().with_steps([step("a")]));
    w.settle();
    let launched = w.status();
    w.update_pod("run-a-2b8d3c-r1-a1", |p| p.running());
    let seen = w.step();
    assert_eq!(seen.status, launched, "no write just because the Pod runs");
    w.pods.remove("run-a-2b8d3c-r1-a1");
    let again = w.step();
    assert_eq!(creates(&again), ["run-a-2b8d3c-r1-a1"]);
    assert_eq!(cp(&w, "a", 1).attempt, 1);

    // A NonIdempotent step's Pod UID is recorded once seen, so its vanishing
    // is told apart from a create that never happened (D6).
    let mut w =
        World::new(AgentRun::test().with_steps([step("a").with_effect(Effect::NonIdempotent)]));
    w.settle();
    w.update_pod("run-a-2b8d3c-r1-a1", |p| p.running());
    w.settle();
    assert!(cp(&w, "a", 1).pod_uid.is_some());
    w.pods.remove("run-a-2b8d3c-r1-a1");
    w.settle();
    let a = cp(&w, "a", 1);
    assert_eq!(
        (a.phase, a.disruptions, a.effect),
        (
            StepPhase::WaitingForApproval,
            1,
            Some(EffectOutcome::Unknown)
        )
    );
    assert!(w.approvals.contains_key("run-a-2b8d3c-r1-reconcile-a1"));
    assert_eq!(w.created.len(), 1, "not run again without a person");
}

#[test]
fn a_non_idempotent_step_evicted_before_it_started_simply_reruns() {
    let mut w =
        World::new(AgentRun::test().with_steps([step("a").with_effect(Effect::NonIdempotent)]));
    w.settle();
    w.update_pod("run-a-2b8d3c-r1-a1", |p| p.evicted(false));
    w.settle();
    assert_eq!(cp(&w, "a", 1).attempt, 2);
    assert!(w.approvals.is_empty());
}

#[test]
fn a_timed_out_attempt_is_stopped_counted_and_not_overlapped() {
    let mut w = World::new(
        AgentRun::test().with_steps([step("a").with_timeout("30s").with_retry(1, "1s", "1s")]),
    );
    w.settle();
    w.update_pod("run-a-2b8d3c-r1-a1", |p| p.running());
    let d = w.settle();
    assert_eq!(
        d.requeue_after,
        secs(31),
        "at the timeout counted from the end of the whole second startedAt names"
    );
    w.advance(30);
    assert!(deletes(&w.step()).is_empty(), "never before the timeout");
    w.advance(1);
    let d = w.step();
    assert_eq!(deletes(&d), ["run-a-2b8d3c-r1-a1"]);
    assert!(events(&d).contains(&Reason::StepTimedOut));
    assert_eq!(cp(&w, "a", 1).failures, 1);
    w.advance(5);
    let d = w.step();
    assert!(
        creates(&d).is_empty(),
        "D2: attempt 2 waits while attempt 1 is still live"
    );
    w.update_pod("run-a-2b8d3c-r1-a1", |p| p.exited(137, ""));
    w.settle();
    assert!(w.pods.contains_key("run-a-2b8d3c-r1-a2"));
    assert!(
        !w.pods.contains_key("run-a-2b8d3c-r1-a1"),
        "attempt 1 released and gone"
    );
}

#[test]
fn unusable_results_fail_the_attempt_with_the_problem_quoted() {
    let cases = [
        ("not JSON", "all good!".to_owned(), "not JSON"),
        ("wrong shape", "[1]".to_owned(), "must be a JSON object"),
        (
            "too large",
            format!("{{\"result\": \"{}\"}}", "x".repeat(5000)),
            "over the 4096-byte limit",
        ),
        (
            "bad tokens",
            r#"{"tokens": "many"}"#.to_owned(),
            "tokens must be",
        ),
    ];
    for (name, message, want) in cases {
        let mut w = World::new(AgentRun::test().with_steps([step("a")]));
        w.settle();
        w.update_pod("run-a-2b8d3c-r1-a1", |p| p.succeeded(&message));
        w.settle();
        let a = cp(&w, "a", 1);
        assert_eq!(a.phase, StepPhase::Failed, "{name}");
        assert!(
            a.message.as_deref().unwrap_or("").contains(want),
            "{name}: {:?}",
            a.message
        );
    }
    let mut w = World::new(AgentRun::test().with_steps([step("a")]));
    w.settle();
    w.succeed("run-a-2b8d3c-r1-a1", "");
    assert_eq!(
        (cp(&w, "a", 1).phase, cp(&w, "a", 1).result),
        (StepPhase::Succeeded, None),
        "empty message: null result"
    );
}

// ---------------------------------------------------------------------------
// D10: approvals
// ---------------------------------------------------------------------------

#[test]
fn an_approval_gate_waits_with_zero_pods_and_requeues_at_expiry() {
    let mut w = World::new(
        AgentRun::test().with_steps([step("a").with_approval(Some("1h"), OnTimeout::Reject)]),
    );
    let d = w.settle();
    let name = "run-a-2b8d3c-r1-approve";
    let a = &w.approvals[name];
    assert_eq!(
        (a.spec.kind, a.spec.run_uid.as_str(), a.spec.plan_revision),
        (ApprovalKind::Approve, UID, 1)
    );
    assert_eq!(a.spec.expires_at.as_ref().map(|t| t.0), Some(t(3600)));
    assert_eq!(a.spec.question, "run a?");
    assert_eq!(a.metadata.owner_references.as_ref().unwrap()[0].uid, UID);
    assert!(w.pods.is_empty());
    assert_eq!(w.status().phase, Some(RunPhase::WaitingForApproval));
    assert_eq!(condition_of(&w, ConditionType::AwaitingApproval).0, "True");
    assert_eq!(d.requeue_after, secs(3600));
    w.advance(1000);
    assert_eq!(
        w.decide().requeue_after,
        secs(2600),
        "after a restart too: the timer is in the Approval"
    );
}

#[test]
fn approval_answers() {
    struct Case {
        name: &'static str,
        on_timeout: OnTimeout,
        act: fn(&mut World),
        phase: RunPhase,
        approval: ApprovalPhase,
        decided_by: &'static str,
    }
    let cases = [
        Case {
            name: "approved: the step runs",
            on_timeout: OnTimeout::Reject,
            act: |w| {
                w.decide_approval("run-a-2b8d3c-r1-approve", Answer::Approved, "alice-ui");
            },
            phase: RunPhase::Running,
            approval: ApprovalPhase::Approved,
            decided_by: "alice-ui",
        },
        Case {
            name: "rejected: the run fails",
            on_timeout: OnTimeout::Reject,
            act: |w| {
                w.decide_approval("run-a-2b8d3c-r1-approve", Answer::Rejected, "bob");
            },
            phase: RunPhase::Failed,
            approval: ApprovalPhase::Rejected,
            decided_by: "bob",
        },
        Case {
            name: "expired, onTimeout Reject: the run fails",
            on_timeout: OnTimeout::Reject,
            act: |w| w.advance(3600),
            phase: RunPhase::Failed,
            approval: ApprovalPhase::Expired,
            decided_by: "agentrun-operator",
        },
        Case {
            name: "expired, onTimeout Approve: the step runs",
            on_timeout: OnTimeout::Approve,
            act: |w| w.advance(3600),
            phase: RunPhase::Running,
            approval: ApprovalPhase::Expired,
            decided_by: "agentrun-operator",
        },
    ];
    for c in cases {
        let mut w = World::new(
            AgentRun::test().with_steps([step("a").with_approval(Some("1h"), c.on_timeout)]),
        );
        w.settle();
        (c.act)(&mut w);
        w.settle();
        assert_eq!(w.status().phase, Some(c.phase), "{}", c.name);
        let st = w.approvals["run-a-2b8d3c-r1-approve"]
            .status
            .clone()
            .unwrap();
        assert_eq!(
            (st.phase, st.decided_by.as_deref()),
            (c.approval, Some(c.decided_by)),
            "{}",
            c.name
        );
        assert_eq!(
            w.pods.contains_key("run-a-2b8d3c-r1-a1"),
            c.phase == RunPhase::Running,
            "{}",
            c.name
        );
    }
}

fn gated(timeout: Option<&str>, on_timeout: OnTimeout) -> World {
    let mut w =
        World::new(AgentRun::test().with_steps([step("a").with_approval(timeout, on_timeout)]));
    w.settle();
    w
}

/// A user edits the step (`kubectl apply`): a new generation.
fn edit_args(w: &mut World, args: &[&str]) {
    w.run.spec.steps[0].container.args = args.iter().map(|a| a.to_string()).collect();
    w.run.metadata.generation = w.run.metadata.generation.map(|g| g + 1);
}

fn args_of(w: &World, pod: &str) -> Vec<String> {
    w.pod(pod).spec.unwrap().containers[0]
        .args
        .clone()
        .unwrap_or_default()
}

#[test]
fn a_step_changed_while_its_approval_waits_needs_a_new_decision() {
    let mut w = gated(None, OnTimeout::Reject);
    let first = "run-a-2b8d3c-r1-approve";
    let asked = w.approvals[first].spec.step_digest.clone();
    assert_eq!(asked.as_ref().map(String::len), Some(64));
    assert_eq!(cp(&w, "a", 1).step_digest, asked);
    edit_args(&mut w, &["refund", "--amount=9999"]);
    // The person approves what they were shown, after the edit.
    assert!(w.decide_approval(first, Answer::Approved, "alice"));
    w.settle();
    assert!(w.pods.is_empty(), "the old approval released nothing");
    let second = "run-a-2b8d3c-r1-approve-2";
    let a2 = &w.approvals[second];
    assert_ne!(a2.spec.step_digest, asked, "bound to the step as it is now");
    let old = w.approvals[first].status.clone().unwrap();
    assert_eq!(old.phase, ApprovalPhase::Superseded);
    assert!(
        old.message
            .as_deref()
            .is_some_and(|m| m.contains(second) && m.contains("decision Approved was not applied")),
        "{old:?}"
    );
    let a = cp(&w, "a", 1);
    assert_eq!(
        (a.phase, a.approval.as_deref()),
        (StepPhase::WaitingForApproval, Some(second))
    );
    assert!(w.decide_approval(second, Answer::Approved, "alice"));
    w.settle();
    assert_eq!(
        args_of(&w, "run-a-2b8d3c-r1-a1"),
        ["refund", "--amount=9999"]
    );
    assert_eq!(
        w.approvals[second].status.as_ref().map(|s| s.phase),
        Some(ApprovalPhase::Approved)
    );
}

#[test]
fn a_step_changed_after_approval_but_before_its_pod_exists_is_asked_again() {
    let mut w = gated(None, OnTimeout::Reject);
    assert!(w.decide_approval("run-a-2b8d3c-r1-approve", Answer::Approved, "alice"));
    // The launch is written, then the operator dies before creating the Pod.
    let d = w.decide();
    assert_eq!(creates(&d), ["run-a-2b8d3c-r1-a1"]);
    w.run.status = Some(d.status);
    edit_args(&mut w, &["something-else"]);
    let d = w.step();
    assert!(creates(&d).is_empty(), "{:?}", d.actions);
    w.settle();
    assert!(w.pods.is_empty());
    let a = cp(&w, "a", 1);
    assert_eq!(
        (a.phase, a.approval.as_deref()),
        (
            StepPhase::WaitingForApproval,
            Some("run-a-2b8d3c-r1-approve-2")
        )
    );
    assert!(
        a.message
            .as_deref()
            .is_some_and(|m| m.contains("changed after it was approved")),
        "{a:?}"
    );
    assert!(w.decide_approval("run-a-2b8d3c-r1-approve-2", Answer::Approved, "alice"));
    w.settle();
    // A new attempt: the first one's Pod never existed, and never will.
    assert_eq!(args_of(&w, "run-a-2b8d3c-r1-a2"), ["something-else"]);
    assert_eq!(w.created, ["run-a-2b8d3c-r1-a2"]);
}

#[test]
fn a_decision_the_api_server_took_after_the_deadline_does_not_release_the_step() {
    let mut w = gated(Some("4s"), OnTimeout::Reject);
    // The operator is down past the deadline; then a person approves.
    w.advance(10);
    assert!(w.decide_approval("run-a-2b8d3c-r1-approve", Answer::Approved, "alice"));
    w.settle();
    assert_eq!(w.status().phase, Some(RunPhase::Failed));
    assert!(w.created.is_empty(), "the step never ran");
    let st = w.approvals["run-a-2b8d3c-r1-approve"]
        .status
        .clone()
        .unwrap();
    assert_eq!(st.phase, ApprovalPhase::Expired);
    assert!(
        st.message
            .as_deref()
            .is_some_and(|m| m.contains("after the deadline")),
        "{st:?}"
    );
}

#[test]
fn a_decision_made_in_time_wins_over_an_expiry_seen_late() {
    let mut w = gated(Some("4s"), OnTimeout::Reject);
    w.advance(2);
    assert!(w.decide_approval("run-a-2b8d3c-r1-approve", Answer::Approved, "alice"));
    // The operator looks only after the deadline.
    w.advance(60);
    w.settle();
    assert_eq!(w.status().phase, Some(RunPhase::Running));
    assert_eq!(w.created, ["run-a-2b8d3c-r1-a1"]);
}

#[test]
fn an_expiry_decided_on_a_stale_cache_never_overwrites_a_decision() {
    let mut w = gated(Some("4s"), OnTimeout::Reject);
    w.advance(3);
    let stale = w.clone();
    assert!(w.decide_approval("run-a-2b8d3c-r1-approve", Answer::Approved, "alice"));
    // The operator's cache does not show the decision yet; it is past the deadline.
    let mut late = stale;
    late.advance(10);
    let d = late.decide();
    assert!(
        d.actions
            .iter()
            .any(|a| matches!(a, Action::SetApprovalStatus { status, .. } if status.phase == ApprovalPhase::Expired)),
        "the stale view asks to expire it"
    );
    assert_eq!(
        d.status,
        w.status(),
        "nothing is refused before the expiry is written"
    );
    w.now = late.now;
    w.commit(&d); // the guarded write meets the decision and fails
    assert_eq!(w.approvals["run-a-2b8d3c-r1-approve"].status, None);
    w.settle();
    assert_eq!(w.status().phase, Some(RunPhase::Running));
}

#[test]
fn approvals_the_run_no_longer_waits_on_are_superseded_and_refuse_decisions() {
    let mut w = gated(None, OnTimeout::Reject);
    w.run.spec.cancel = true;
    w.settle();
    assert_eq!(w.status().phase, Some(RunPhase::Cancelled));
    let st = w.approvals["run-a-2b8d3c-r1-approve"]
        .status
        .clone()
        .unwrap();
    assert_eq!(st.phase, ApprovalPhase::Superseded);
    assert!(!w.decide_approval("run-a-2b8d3c-r1-approve", Answer::Approved, "alice"));
    assert!(w.created.is_empty());
}

// ---------------------------------------------------------------------------
// D16: refused creations show on the run
// ---------------------------------------------------------------------------

fn refusal(name: &str, cause: RefusalCause) -> Refusal {
    Refusal {
        name: name.into(),
        cause,
        message: format!("pods \"{name}\" is forbidden: violates PodSecurity"),
    }
}

#[test]
fn a_refused_step_pod_stalls_the_run_visibly() {
    struct Case {
        name: &'static str,
        cause: RefusalCause,
        reason: Reason,
        /// The step's phase after the refusal.
        phase: StepPhase,
        failures: i32,
    }
    let cases = [
        Case {
            name: "rejected: a failed attempt, retried as a new one",
            cause: RefusalCause::Rejected,
            reason: Reason::FailedCreate,
            phase: StepPhase::Pending,
            failures: 1,
        },
        Case {
            name: "transient: the same attempt waits, visibly",
            cause: RefusalCause::Transient,
            reason: Reason::FailedCreate,
            phase: StepPhase::Running,
            failures: 0,
        },
        Case {
            name: "a foreign object holds the name",
            cause: RefusalCause::NameTaken,
            reason: Reason::NameTaken,
            phase: StepPhase::Running,
            failures: 0,
        },
    ];
    for c in cases {
        let mut w = World::new(AgentRun::test().with_steps([step("a").with_retry(1, "10s", "1m")]));
        // The launch is written; the create is refused.
        let d = w.decide();
        w.run.status = Some(d.status);
        w.refused = vec![refusal("run-a-2b8d3c-r1-a1", c.cause)];
        let d = w.step();
        assert!(creates(&d).is_empty(), "{}: not sent again at once", c.name);
        assert!(
            d.actions.iter().any(|a| matches!(a, Action::Event { type_: EventType::Warning, reason, message } if *reason == Reason::FailedCreate && message.contains("violates PodSecurity"))),
            "{}: a Warning Event with the API's message: {:?}",
            c.name,
            d.actions
        );
        let stalled = w
            .status()
            .conditions
            .into_iter()
            .find(|x| x.type_ == ConditionType::Stalled)
            .expect("Stalled");
        assert_eq!(
            (stalled.status.as_str(), stalled.reason.as_str()),
            ("True", c.reason.as_str()),
            "{}",
            c.name
        );
        assert!(stalled.message.contains("run-a-2b8d3c-r1-a1"), "{}", c.name);
        let a = cp(&w, "a", 1);
        assert_eq!((a.phase, a.failures), (c.phase, c.failures), "{}", c.name);
        // The cause goes away: the next try creates the Pod and the stall clears.
        w.refused.clear();
        w.advance(20);
        w.settle();
        let want = if c.cause == RefusalCause::Rejected {
            "run-a-2b8d3c-r1-a2"
        } else {
            "run-a-2b8d3c-r1-a1"
        };
        assert_eq!(w.created, [want], "{}", c.name);
        assert_eq!(
            condition_of(&w, ConditionType::Stalled).0,
            "False",
            "{}",
            c.name
        );
    }
}

#[test]
fn a_step_pod_rejected_past_its_retries_fails_the_run_with_the_api_message() {
    let mut w = World::new(AgentRun::test().with_steps([step("a")]));
    let d = w.decide();
    w.run.status = Some(d.status);
    w.refused = vec![refusal("run-a-2b8d3c-r1-a1", RefusalCause::Rejected)];
    w.settle();
    assert_eq!(w.status().phase, Some(RunPhase::Failed));
    let a = cp(&w, "a", 1);
    assert!(
        a.message
            .as_deref()
            .is_some_and(|m| m.contains("violates PodSecurity")),
        "{a:?}"
    );
    assert_eq!(
        a.effect,
        Some(EffectOutcome::NotApplied),
        "its Pod never existed"
    );
}

#[test]
fn a_foreign_approval_holding_the_name_stalls_the_gate_visibly() {
    let mut w =
        World::new(AgentRun::test().with_steps([step("a").with_approval(None, OnTimeout::Reject)]));
    let d = w.decide();
    w.run.status = Some(d.status);
    w.refused = vec![refusal("run-a-2b8d3c-r1-approve", RefusalCause::NameTaken)];
    let d = w.step();
    assert!(
        !d.actions
            .iter()
            .any(|a| matches!(a, Action::CreateApproval(_))),
        "{:?}",
        d.actions
    );
    assert_eq!(
        condition_of(&w, ConditionType::Stalled),
        ("True".into(), Reason::NameTaken.into())
    );
}

#[test]
fn a_pod_created_late_is_timed_from_its_creation_not_from_the_launch() {
    let mut w = World::new(AgentRun::test().with_steps([step("a").with_timeout("10s")]));
    // The launch is written; the operator dies before creating the Pod.
    let d = w.decide();
    w.run.status = Some(d.status);
    w.advance(60);
    let d = w.step();
    assert_eq!(
        creates(&d),
        ["run-a-2b8d3c-r1-a1"],
        "created after the restart"
    );
    w.update_pod("run-a-2b8d3c-r1-a1", |p| p.running());
    w.advance(5);
    w.settle();
    assert_eq!(cp(&w, "a", 1).phase, StepPhase::Running, "5s of 10s used");
    w.advance(7);
    w.settle();
    assert_eq!(
        cp(&w, "a", 1).phase,
        StepPhase::Failed,
        "timed out 10s after its Pod was created"
    );
}

#[test]
fn an_effect_that_may_have_happened_is_unknown_and_compensated() {
    // Timed out while running, no retries left: it may have acted.
    let mut w =
        World::new(AgentRun::test().with_steps([step("a").with_timeout("10s").with_compensate()]));
    w.settle();
    w.update_pod("run-a-2b8d3c-r1-a1", |p| p.running());
    w.advance(20);
    w.settle();
    assert_eq!(cp(&w, "a", 1).effect, Some(EffectOutcome::Unknown));
    // The kubelet stops the deleted Pod; then the saga winds down.
    w.update_pod("run-a-2b8d3c-r1-a1", |p| p.exited(137, ""));
    w.settle();
    assert!(
        w.created.contains(&"run-a-2b8d3c-r1-c1".to_owned()),
        "the compensation runs for an unknown effect: {:?}",
        w.created
    );

    // A non-zero exit reports that the step did not act: not compensated.
    let mut w = World::new(AgentRun::test().with_steps([step("a").with_compensate()]));
    w.settle();
    w.update_pod("run-a-2b8d3c-r1-a1", |p| p.exited(1, ""));
    w.settle();
    assert_eq!(cp(&w, "a", 1).effect, Some(EffectOutcome::NotApplied));
    assert_eq!(w.created, ["run-a-2b8d3c-r1-a1"]);

    // An Idempotent step evicted after it started: unknown until the rerun succeeds.
    let mut w = World::new(AgentRun::test().with_steps([step("a"), step("b")]));
    w.settle();
    w.update_pod("run-a-2b8d3c-r1-a1", |p| p.evicted(true));
    w.step();
    assert_eq!(cp(&w, "a", 1).effect, Some(EffectOutcome::Unknown));
    w.settle();
    w.succeed("run-a-2b8d3c-r1-a2", &ok_message(json!(1), 0));
    assert_eq!(cp(&w, "a", 1).effect, Some(EffectOutcome::Applied));
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

#[test]
fn an_invalid_plan_is_a_failed_attempt_within_the_planner_retries() {
    let mut w = World::new(AgentRun::test().with_planner(step("plan").with_retry(1, "1s", "1s")));
    w.settle();
    let bad = r#"{"plan": [{"name": "Not A Name", "container": {"image": "x"}}], "tokens": {"input": 7}}"#;
    w.succeed("run-plan-dbdf1c-r1-p1", bad);
    w.advance(2);
    w.settle();
    assert_eq!(w.status().tokens_used, 7, "the bad plan's tokens count");
    w.succeed(
        "run-plan-dbdf1c-r1-p2",
        r#"{"plan": [{"name": "x", "container": {"image": "x"}}]}"#,
    );
    assert_eq!(w.status().plan.map(|p| p.revision), Some(2));
    assert_eq!(w.status().phase, Some(RunPhase::Running));
}

#[test]
fn tokens_of_compensations_and_of_unusable_results_count() {
    let mut w = World::new(AgentRun::test().with_steps([step("a").with_compensate(), step("b")]));
    w.settle();
    w.succeed("run-a-2b8d3c-r1-a1", &ok_message(json!(1), 10));
    // Exit 0, but a message the contract refuses: the tokens it names still count.
    w.succeed(
        "run-b-59c772-r1-a1",
        r#"{"tokens": {"input": 5}, "plan": 3}"#,
    );
    w.succeed("run-a-2b8d3c-r1-c1", &ok_message(json!("reversed"), 100));
    let s = w.status();
    assert_eq!(s.phase, Some(RunPhase::Failed));
    assert_eq!(s.compensations[0].tokens.map(|t| t.total()), Some(100));
    assert_eq!(s.tokens_used, 115);
}

#[test]
fn a_deleted_pod_that_traps_sigterm_and_exits_1_is_a_disruption() {
    let mut w =
        World::new(AgentRun::test().with_steps([step("a").with_effect(Effect::NonIdempotent)]));
    w.settle();
    w.update_pod("run-a-2b8d3c-r1-a1", |p| p.running());
    w.step();
    // A user deletes the Pod; its container catches SIGTERM and exits 1.
    let now = w.now;
    w.update_pod("run-a-2b8d3c-r1-a1", |p| {
        let mut p = p.deleting(now).exited(1, "interrupted");
        p.metadata.deletion_grace_period_seconds = Some(0);
        p
    });
    w.settle();
    let a = cp(&w, "a", 1);
    assert_eq!((a.failures, a.disruptions), (0, 1), "{a:?}");
    assert_eq!(
        a.phase,
        StepPhase::WaitingForApproval,
        "a person says what happened"
    );
}

#[test]
fn a_pod_on_a_lost_node_does_not_hold_a_run_past_its_deadline() {
    let mut w = World::new(
        AgentRun::test()
            .with_steps([step("a").with_compensate(), step("b")])
            .with_deadline(60),
    );
    w.settle();
    w.succeed("run-a-2b8d3c-r1-a1", &ok_message(json!(1), 0));
    w.update_pod("run-b-59c772-r1-a1", |p| p.running());
    w.advance(61);
    w.settle();
    // The node never reports the deleted Pod stopped.
    assert!(
        w.pod("run-b-59c772-r1-a1")
            .metadata
            .deletion_timestamp
            .is_some()
    );
    w.advance(super::testing::GRACE_SECONDS);
    w.settle();
    w.succeed("run-a-2b8d3c-r1-c1", &ok_message(json!("undone"), 0));
    let s = w.status();
    assert_eq!(s.phase, Some(RunPhase::Failed));
    assert_eq!(cp(&w, "b", 1).effect, Some(EffectOutcome::Unknown));
}

/// A timed-out attempt's Pod is stopped, not forgotten: it keeps its result
/// finalizer until it has stopped, and what it reports then — here a refund
/// it did make, and its tokens — is recorded and reaches the compensation.
#[test]
fn a_timed_out_attempt_still_reports_what_its_pod_says_when_it_stops() {
    let mut w = World::new(
        AgentRun::test().with_steps([step("a")
            .with_effect(Effect::NonIdempotent)
            .with_timeout("1m")
            .with_compensate()]),
    );
    w.settle();
    w.update_pod("run-a-2b8d3c-r1-a1", |p| p.running());
    w.advance(62);
    let d = w.step();
    assert_eq!(deletes(&d), ["run-a-2b8d3c-r1-a1"]);
    assert!(releases(&d).is_empty(), "the Pod keeps its finalizer");
    w.settle();
    let a = cp(&w, "a", 1);
    assert_eq!((a.phase, a.stopping), (StepPhase::Failed, true));
    assert!(
        creates(&w.decide()).is_empty(),
        "no compensation while it stops"
    );
    // SIGTERM arrives after the refund was made: the step finishes anyway.
    w.advance(5);
    w.update_pod("run-a-2b8d3c-r1-a1", |p| {
        p.succeeded(&ok_message(json!({"refund": "re_123"}), 40))
    });
    let d = w.step();
    assert_eq!(
        releases(&d),
        ["run-a-2b8d3c-r1-a1"],
        "released once recorded"
    );
    let a = cp(&w, "a", 1);
    assert_eq!(a.phase, StepPhase::Failed, "the outcome stays as committed");
    assert!(!a.stopping);
    assert_eq!(a.result, Some(json!({"refund": "re_123"})));
    assert_eq!(a.tokens.map(|t| t.total()), Some(40));
    assert_eq!(w.status().tokens_used, 40);
    w.settle();
    let ctx: serde_json::Value = serde_json::from_str(
        &w.pod("run-a-2b8d3c-r1-c1").metadata.annotations.unwrap()[labels::CONTEXT],
    )
    .unwrap();
    assert_eq!(ctx["results"][0]["result"], json!({"refund": "re_123"}));
}

/// A stopping attempt whose Pod is force-removed has nothing left to report:
/// the checkpoint stops saying it waits for one.
#[test]
fn a_stopping_attempt_whose_pod_is_removed_stops_waiting_for_its_report() {
    let mut w = World::new(AgentRun::test().with_steps([step("a").with_timeout("1m")]));
    w.settle();
    w.update_pod("run-a-2b8d3c-r1-a1", |p| p.running());
    w.advance(62);
    w.settle();
    assert!(cp(&w, "a", 1).stopping);
    w.pods.remove("run-a-2b8d3c-r1-a1");
    w.settle();
    let a = cp(&w, "a", 1);
    assert!(!a.stopping);
    assert!(
        a.message
            .as_deref()
            .is_some_and(|m| m.ends_with("its Pod was removed before it reported")),
        "{:?}",
        a.message
    );
    assert_eq!(w.status().phase, Some(RunPhase::Failed));
}

/// Cancel, deadline and budget close a running attempt the same way: the
/// tokens its Pod reports while it stops still count (D9).
#[test]
fn a_cancelled_attempt_still_counts_the_tokens_its_pod_reports() {
    let mut w = World::new(AgentRun::test().with_steps([step("a"), step("b")]));
    w.settle();
    w.update_pod("run-a-2b8d3c-r1-a1", |p| p.running());
    w.run.spec.cancel = true;
    w.settle();
    assert!(cp(&w, "a", 1).stopping);
    assert!(
        w.pod("run-a-2b8d3c-r1-a1")
            .metadata
            .deletion_timestamp
            .is_some()
    );
    assert_ne!(
        w.status().phase,
        Some(RunPhase::Cancelled),
        "not while it stops"
    );
    w.update_pod("run-a-2b8d3c-r1-a1", |p| {
        p.exited(143, r#"{"tokens": {"input": 7, "output": 5}}"#)
    });
    w.settle();
    let a = cp(&w, "a", 1);
    assert_eq!(
        (a.phase, a.stopping, a.result),
        (StepPhase::Failed, false, None)
    );
    assert_eq!(w.status().tokens_used, 12);
    assert_eq!(w.status().phase, Some(RunPhase::Cancelled));
    assert!(w.pods.is_empty(), "released and gone: {:?}", w.pods.keys());
}

// ---------------------------------------------------------------------------
// D8: freshness
// ---------------------------------------------------------------------------

#[test]
fn a_stale_input_replans_from_the_stale_step_with_new_keys() {
    let mut w = World::new(AgentRun::test().with_steps([
        step("a"),
        step("b").with_fresh_for("1m"),
        step("c"),
    ]));
    w.settle();
    w.succeed("run-a-2b8d3c-r1-a1", "");
    w.succeed("run-b-59c772-r1-a1", &ok_message(json!("quote"), 0));
    let b = cp(&w, "b", 1);
    assert_eq!(b.fresh_until.as_ref().map(|t| t.0), Some(t(60)));
    // c started in time; it fails once and its retry comes after b went stale.
    w.run.spec.steps[2] = step("c").with_retry(1, "2m", "2m");
    w.update_pod("run-c-aa03bb-r1-a1", |p| p.exited(1, ""));
    w.settle();
    w.advance(120);
    let d = w.step();
    assert!(
        creates(&d).is_empty(),
        "the re-plan is committed before anything runs"
    );
    assert!(events(&d).contains(&Reason::Replanned));
    let plan = w.status().plan.unwrap();
    assert_eq!((plan.revision, plan.rerun_from.as_deref()), (2, Some("b")));
    assert!(plan.reason.contains("step b went stale"), "{}", plan.reason);
    assert_eq!(cp(&w, "c", 1).phase, StepPhase::Superseded);
    assert_eq!(
        condition_of(&w, ConditionType::Stale),
        ("True".into(), Reason::InputStale.into())
    );
    w.settle();
    assert!(
        w.pods.contains_key("run-b-59c772-r2-a1"),
        "b runs again at revision 2"
    );
    assert_ne!(
        cp(&w, "b", 2).idempotency_key,
        b.idempotency_key,
        "with a new key"
    );
    assert_eq!(cp(&w, "b", 1), b, "the old checkpoint is kept as it was");
    w.succeed("run-b-59c772-r2-a1", "");
    assert!(w.pods.contains_key("run-c-aa03bb-r2-a1"));
    assert!(
        !w.pods.contains_key("run-a-2b8d3c-r2-a1"),
        "a, still fresh, is not run again"
    );
    w.succeed("run-c-aa03bb-r2-a1", "");
    assert_eq!(w.status().phase, Some(RunPhase::Succeeded));
    assert_eq!(w.status().progress.as_deref(), Some("3/3"));
    assert_eq!(condition_of(&w, ConditionType::Stale).0, "False");
}

#[test]
fn a_launch_recorded_before_a_crash_is_not_created_on_inputs_stale_since() {
    let mut w =
        World::new(AgentRun::test().with_steps([step("quote").with_fresh_for("3s"), step("buy")]));
    w.settle();
    w.update_pod("run-quote-85b807-r1-a1", |p| {
        p.succeeded(&ok_message(json!(10), 0))
    });
    // quote's outcome and buy's launch are written together; the operator
    // dies before it creates buy's Pod, and comes back after quote went stale.
    let hand_off = w.decide();
    assert_eq!(creates(&hand_off), ["run-buy-6c0d28-r1-a1"]);
    w.run.status = Some(hand_off.status);
    w.advance(4);
    let d = w.step();
    assert!(
        creates(&d).is_empty(),
        "D8: buy does not start on a stale quote"
    );
    assert!(events(&d).contains(&Reason::Replanned));
    assert_eq!(cp(&w, "buy", 1).phase, StepPhase::Superseded);
    w.settle();
    assert!(
        w.pods.contains_key("run-quote-85b807-r2-a1"),
        "quote runs again"
    );
    assert!(
        !w.pods.contains_key("run-buy-6c0d28-r1-a1"),
        "buy never ran on the old quote"
    );
}

// ---------------------------------------------------------------------------
// D9 and other limits: budgets, deadline, suspend
// ---------------------------------------------------------------------------

#[test]
fn run_limits() {
    struct Case {
        name: &'static str,
        run: AgentRun,
        act: fn(&mut World),
        reason: Reason,
        budget_condition: bool,
    }
    let cases = [
        Case {
            name: "token budget counts every attempt",
            run: AgentRun::test()
                .with_steps([step("a").with_retry(3, "1s", "1s"), step("b")])
                .with_budget(Some(100), None),
            act: |w| {
                w.update_pod("run-a-2b8d3c-r1-a1", |p| {
                    p.exited(1, &ok_message(json!(null), 60))
                });
                w.settle();
                w.advance(1);
                w.settle();
                w.succeed("run-a-2b8d3c-r1-a2", &ok_message(json!(null), 60));
            },
            reason: Reason::TokenBudgetExceeded,
            budget_condition: true,
        },
        Case {
            name: "step execution budget",
            run: AgentRun::test()
                .with_steps([step("a").with_retry(3, "1s", "1s")])
                .with_budget(None, Some(1)),
            act: |w| {
                w.update_pod("run-a-2b8d3c-r1-a1", |p| p.exited(1, ""));
                w.settle();
                w.advance(1);
                w.settle();
            },
            reason: Reason::StepExecutionBudgetExceeded,
            budget_condition: true,
        },
        Case {
            name: "active deadline stops the running step",
            run: AgentRun::test().with_steps([step("a")]).with_deadline(600),
            act: |w| {
                w.update_pod("run-a-2b8d3c-r1-a1", |p| p.running());
                assert_eq!(w.settle().requeue_after, secs(600));
                w.advance(600);
                let d = w.step();
                assert_eq!(deletes(&d), ["run-a-2b8d3c-r1-a1"]);
                w.update_pod("run-a-2b8d3c-r1-a1", |p| p.exited(137, ""));
                w.settle();
            },
            reason: Reason::DeadlineExceeded,
            budget_condition: false,
        },
    ];
    for c in cases {
        let mut w = World::new(c.run);
        w.settle();
        (c.act)(&mut w);
        w.settle();
        assert_eq!(w.status().phase, Some(RunPhase::Failed), "{}", c.name);
        assert_eq!(
            condition_of(&w, ConditionType::Succeeded),
            ("False".into(), c.reason.into()),
            "{}",
            c.name
        );
        let budget = w
            .status()
            .conditions
            .iter()
            .any(|x| x.type_ == ConditionType::BudgetExceeded && x.status == "True");
        assert_eq!(budget, c.budget_condition, "{}", c.name);
        assert!(w.live_pods().is_empty(), "{}", c.name);
    }
}

#[test]
fn suspend_starts_no_pods_and_lets_a_running_step_finish() {
    let mut w = World::new(two_steps());
    w.settle();
    w.run.spec.suspend = true;
    w.succeed("run-a-2b8d3c-r1-a1", "");
    assert_eq!(
        cp(&w, "a", 1).phase,
        StepPhase::Succeeded,
        "the running step is checkpointed"
    );
    assert!(!w.pods.contains_key("run-b-59c772-r1-a1"));
    assert_eq!(
        condition_of(&w, ConditionType::Progressing),
        ("False".into(), Reason::Suspended.into())
    );
    assert_eq!(w.decide().requeue_after, None, "nothing to wait for");
    w.run.spec.suspend = false;
    w.settle();
    assert!(w.pods.contains_key("run-b-59c772-r1-a1"));
}

// ---------------------------------------------------------------------------
// Cancel and compensation (the saga)
// ---------------------------------------------------------------------------

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
    assert_eq!(w.status().phase, Some(RunPhase::Cancelled));
    assert_eq!(
        condition_of(&w, ConditionType::Succeeded),
        ("False".into(), Reason::Cancelled.into())
    );
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

// ---------------------------------------------------------------------------
// D11: context and compaction; D12: terminal and TTL; planner; D13
// ---------------------------------------------------------------------------

fn big_result(i: usize) -> String {
    ok_message(json!({"i": i, "text": "y".repeat(700)}), 0)
}

#[test]
fn context_past_max_bytes_runs_the_compactor_at_the_checkpoint_boundary() {
    let mut w = World::new(
        AgentRun::test()
            .with_steps([step("a"), step("b"), step("c")])
            .with_context(1024, true),
    );
    w.settle();
    w.succeed("run-a-2b8d3c-r1-a1", &big_result(0));
    w.succeed("run-b-59c772-r1-a1", &big_result(1));
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
    let mut w = World::new(
        AgentRun::test()
            .with_steps([step("a"), step("b"), step("c")])
            .with_context(1024, false),
    );
    w.settle();
    w.succeed("run-a-2b8d3c-r1-a1", &big_result(0));
    w.succeed("run-b-59c772-r1-a1", &big_result(1));
    let ctx = w.pod("run-c-aa03bb-r1-a1").metadata.annotations.unwrap()[labels::CONTEXT].clone();
    assert!(ctx.len() <= 1024, "{} bytes", ctx.len());
    let v: serde_json::Value = serde_json::from_str(&ctx).unwrap();
    assert_eq!(v["results"][0]["step"], "b", "the newest result is kept");
    assert_eq!(v["omittedResults"], 1);
}

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
    let plan = json!({"plan": [
        {"name": "search", "container": {"image": "search:1"}, "effect": "None"},
        {"name": "write", "container": {"image": "write:1"}},
    ], "tokens": {"input": 100, "output": 20}});
    let mut w = World::new(AgentRun::test().with_planner(step("plan")));
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
    w.succeed("run-search-102366-r2-a1", "");
    w.succeed("run-write-9b1405-r2-a1", "");
    assert_eq!(w.status().phase, Some(RunPhase::Succeeded));
    assert_eq!(w.status().progress.as_deref(), Some("2/2"));
}

#[test]
fn a_bad_plan_fails_the_run_with_a_clear_condition() {
    let mut w = World::new(AgentRun::test().with_planner(step("plan")));
    w.settle();
    w.succeed(
        "run-plan-dbdf1c-r1-p1",
        r#"{"plan": [{"name": "Not A Name", "container": {"image": "x"}}]}"#,
    );
    assert_eq!(w.status().phase, Some(RunPhase::Failed));
    let c = w
        .status()
        .conditions
        .into_iter()
        .find(|c| c.type_ == ConditionType::Succeeded)
        .unwrap();
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
        let c = w
            .status()
            .conditions
            .into_iter()
            .find(|c| c.type_ == ConditionType::Succeeded)
            .unwrap();
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
    assert!(
        c.message
            .as_deref()
            .is_some_and(|m| m.contains("its result was not kept")),
        "{:?}",
        c.message
    );
}

/// The metrics read what the engine decided, once per decision: a step's
/// success and the next launch in one tally; a timed-out attempt is one
/// failure (it used to count twice, once per Event it caused).
#[test]
fn each_decision_tallies_what_it_did() {
    let tally = |started, succeeded, failed, disrupted, tokens| Tally {
        started,
        succeeded,
        failed,
        disrupted,
        replans: 0,
        tokens,
    };
    let mut w = World::new(AgentRun::test().with_steps([
        step("a"),
        step("b").with_timeout("1m").with_retry(1, "1s", "1s"),
        step("c"),
    ]));
    assert_eq!(w.step().tally, tally(1, 0, 0, 0, 0), "a launched");
    w.update_pod("run-a-2b8d3c-r1-a1", |p| {
        p.succeeded(&ok_message(json!(1), 7))
    });
    assert_eq!(
        w.step().tally,
        tally(1, 1, 0, 0, 7),
        "a succeeded, b launched"
    );
    w.update_pod("run-b-59c772-r1-a1", |p| p.running());
    w.advance(62);
    assert_eq!(w.step().tally, tally(0, 0, 1, 0, 0), "b timed out once");
    assert_eq!(
        w.decide().tally,
        Tally::default(),
        "nothing new: nothing counted"
    );
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
    World::new(run)
}

#[test]
fn status_of_a_500_step_run_with_maximal_names_stays_under_256_kib() {
    let mut w = maximal_run("24h");
    w.settle();
    for i in 0..500 {
        let pod = w.status().steps[i].pod.clone().expect("step {i} launched");
        w.succeed(&pod, &ok_message(json!("z".repeat(1000)), 10));
    }
    let s = w.status();
    assert_eq!(s.phase, Some(RunPhase::Succeeded));
    let size = serde_json::to_vec(&s).unwrap().len();
    eprintln!("500-step status with maximal names: {size} bytes");
    assert!(size < 256 * 1024, "status is {size} bytes");
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
    w.settle();
    for i in 0..30 {
        let pod = w.status().steps[i].pod.clone().expect("step {i} launched");
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
    let message = &super::conditions::get(&s.conditions, ConditionType::Succeeded)
        .unwrap()
        .message;
    assert!(
        message.contains("would keep 530 checkpoints in status, more than the 520"),
        "{message}"
    );
}
