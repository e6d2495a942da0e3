//! What one committed status write changed, as facts with their times (pure).
//!
//! The controller calls [`between`] with the status a decision started from
//! and the status the API server acknowledged. Each attempt, approval wait,
//! re-plan and run ends in exactly one acknowledged write, so every fact here
//! is seen once, by the process that wrote it, and never again after a
//! restart (the next process starts from the status that already holds it).
//! The times come from status, not from memory: an attempt launched by one
//! process and ended in another still has its true start.
//!
//! ```text
//!   old status ─┐
//!               ├─▶ between ─▶ [AttemptEnded, ApprovalWaitEnded, Replanned, RunEnded]
//!   new status ─┘                 └─▶ metrics (histograms) and trace spans
//! ```

use jiff::Timestamp;

use crate::api::{
    AgentRunStatus, CompensationCheckpoint, EffectOutcome, RunPhase, StepCheckpoint, StepPhase,
    StepRole,
};
use crate::engine::PodRole;

/// One fact of one write.
#[derive(Clone, Debug, PartialEq)]
pub enum Transition {
    AttemptEnded(AttemptEnded),
    ApprovalWaitEnded(ApprovalWait),
    Replanned {
        revision: i64,
        reason: String,
        at: Timestamp,
    },
    RunEnded {
        phase: RunPhase,
        started: Option<Timestamp>,
        ended: Timestamp,
    },
}

/// How an attempt ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum AttemptOutcome {
    Succeeded,
    /// Counted against the step's retries.
    Failed,
    /// Lost to eviction, preemption or deletion (D6).
    Disrupted,
    /// Closed otherwise: superseded by a re-plan, the run cancelled or out of budget.
    Stopped,
}

impl AttemptOutcome {
    pub fn as_str(self) -> &'static str {
        match self {
            AttemptOutcome::Succeeded => "Succeeded",
            AttemptOutcome::Failed => "Failed",
            AttemptOutcome::Disrupted => "Disrupted",
            AttemptOutcome::Stopped => "Stopped",
        }
    }
}

/// One attempt's Pod, from launch to the checkpoint of its outcome.
#[derive(Clone, Debug, PartialEq)]
pub struct AttemptEnded {
    pub role: PodRole,
    /// The step (for a compactor, the step it ran before; for a
    /// compensation, the step it compensates).
    pub step: String,
    pub plan_revision: i64,
    pub attempt: i32,
    pub idempotency_key: String,
    pub pod: Option<String>,
    pub outcome: AttemptOutcome,
    pub effect: Option<EffectOutcome>,
    /// Tokens this write added to the checkpoint.
    pub tokens: i64,
    pub started: Timestamp,
    pub ended: Timestamp,
}

/// A step's wait for a person.
#[derive(Clone, Debug, PartialEq)]
pub struct ApprovalWait {
    pub step: String,
    pub plan_revision: i64,
    pub approval: String,
    /// What the step did next: Running (released), Failed (refused or
    /// expired), Pending, Superseded.
    pub then: StepPhase,
    pub started: Timestamp,
    pub ended: Timestamp,
}

fn ts(t: &Option<k8s_openapi::apimachinery::pkg::apis::meta::v1::Time>) -> Option<Timestamp> {
    t.as_ref().map(|t| t.0)
}

fn tokens(t: &Option<crate::api::TokenUsage>) -> i64 {
    t.map_or(0, |t| t.total())
}

/// The facts `new` adds to `old`; `now` is the decision's time, used where
/// status holds no time of its own for the end.
pub fn between(old: &AgentRunStatus, new: &AgentRunStatus, now: Timestamp) -> Vec<Transition> {
    let mut out = Vec::new();
    if old == new {
        return out;
    }
    // By (role, name, revision): a 500-step status is looked up, not scanned.
    let index: std::collections::HashMap<(StepRole, &str, i64), &StepCheckpoint> = new
        .steps
        .iter()
        .map(|n| ((n.role, n.name.as_str(), n.plan_revision), n))
        .collect();
    for o in &old.steps {
        if !matches!(o.phase, StepPhase::Running | StepPhase::WaitingForApproval) {
            continue;
        }
        let n = index
            .get(&(o.role, o.name.as_str(), o.plan_revision))
            .copied();
        if o.phase == StepPhase::Running
            && let Some(started) = ts(&o.started_at)
        {
            let ended_attempt = match n {
                None => true,
                Some(n) => n.attempt != o.attempt || n.phase != StepPhase::Running,
            };
            if ended_attempt {
                let outcome = match n {
                    Some(n) if n.attempt == o.attempt && n.phase == StepPhase::Succeeded => {
                        AttemptOutcome::Succeeded
                    }
                    Some(n) if n.failures > o.failures => AttemptOutcome::Failed,
                    Some(n) if n.disruptions > o.disruptions => AttemptOutcome::Disrupted,
                    _ => AttemptOutcome::Stopped,
                };
                let ended = n
                    .filter(|n| n.attempt == o.attempt)
                    .and_then(|n| ts(&n.finished_at))
                    .unwrap_or(now);
                out.push(Transition::AttemptEnded(AttemptEnded {
                    role: o.role.into(),
                    step: o.name.clone(),
                    plan_revision: o.plan_revision,
                    attempt: o.attempt,
                    idempotency_key: o.idempotency_key.clone(),
                    pod: o.pod.clone(),
                    outcome,
                    effect: n.and_then(|n| n.effect),
                    tokens: n.map_or(0, |n| tokens(&n.tokens) - tokens(&o.tokens)),
                    started,
                    ended,
                }));
            }
        }
        if o.phase == StepPhase::WaitingForApproval
            && let (Some(started), Some(approval)) = (ts(&o.started_at), o.approval.clone())
        {
            let then = n.map_or(StepPhase::Superseded, |n| n.phase);
            let still = n.is_some_and(|n| {
                n.phase == StepPhase::WaitingForApproval && n.approval.as_ref() == Some(&approval)
            });
            if !still {
                out.push(Transition::ApprovalWaitEnded(ApprovalWait {
                    step: o.name.clone(),
                    plan_revision: o.plan_revision,
                    approval,
                    then,
                    started,
                    ended: now,
                }));
            }
        }
    }
    let same_comp = |a: &CompensationCheckpoint, b: &CompensationCheckpoint| {
        a.name == b.name && a.plan_revision == b.plan_revision
    };
    for o in &old.compensations {
        let Some(started) = ts(&o.started_at) else {
            continue;
        };
        if o.phase != StepPhase::Running {
            continue;
        }
        let n = new.compensations.iter().find(|n| same_comp(o, n));
        if n.is_some_and(|n| n.attempt == o.attempt && n.phase == StepPhase::Running) {
            continue;
        }
        let outcome = match n {
            Some(n) if n.attempt == o.attempt && n.phase == StepPhase::Succeeded => {
                AttemptOutcome::Succeeded
            }
            Some(n) if n.failures > o.failures => AttemptOutcome::Failed,
            Some(n) if n.disruptions > o.disruptions => AttemptOutcome::Disrupted,
            _ => AttemptOutcome::Stopped,
        };
        out.push(Transition::AttemptEnded(AttemptEnded {
            role: PodRole::Compensate,
            step: o.name.clone(),
            plan_revision: o.plan_revision,
            attempt: o.attempt,
            idempotency_key: o.idempotency_key.clone(),
            pod: o.pod.clone(),
            outcome,
            effect: None,
            tokens: n.map_or(0, |n| tokens(&n.tokens) - tokens(&o.tokens)),
            started,
            ended: n
                .filter(|n| n.attempt == o.attempt)
                .and_then(|n| ts(&n.finished_at))
                .unwrap_or(now),
        }));
    }
    let revision = |s: &AgentRunStatus| s.plan.as_ref().map_or(0, |p| p.revision);
    if revision(old) > 0 && revision(new) > revision(old) {
        out.push(Transition::Replanned {
            revision: revision(new),
            reason: new
                .plan
                .as_ref()
                .map(|p| p.reason.clone())
                .unwrap_or_default(),
            at: now,
        });
    }
    let terminal = |s: &AgentRunStatus| s.phase.filter(|p| p.is_terminal());
    if terminal(old).is_none()
        && let Some(phase) = terminal(new)
    {
        out.push(Transition::RunEnded {
            phase,
            started: ts(&new.started_at),
            ended: ts(&new.completed_at).unwrap_or(now),
        });
    }
    out
}

/// Where the hand-off to a step's first attempt starts: the latest outcome
/// committed before it (the checkpoint its Pod waited for). `None` for the
/// run's first step, and for a retry (that wait is the backoff).
pub fn handoff_start(
    status: &AgentRunStatus,
    role: PodRole,
    step: &str,
    attempt: i32,
) -> Option<Timestamp> {
    if attempt != 1 || role != PodRole::Step {
        return None;
    }
    let cp = status
        .steps
        .iter()
        .rev()
        .find(|c| c.role == StepRole::Step && c.name == step)?;
    if cp.failures > 0 || cp.disruptions > 0 {
        return None;
    }
    status
        .steps
        .iter()
        .filter(|c| c.phase == StepPhase::Succeeded)
        .filter_map(|c| ts(&c.finished_at))
        .max()
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

    fn at(s: i64) -> Option<Time> {
        Some(Time(Timestamp::from_second(1_800_000_000 + s).unwrap()))
    }

    fn running(name: &str, attempt: i32, started: i64) -> StepCheckpoint {
        StepCheckpoint {
            name: name.into(),
            plan_revision: 1,
            attempt,
            idempotency_key: format!("key-{name}"),
            pod: Some(format!("run-{name}-a{attempt}")),
            phase: StepPhase::Running,
            started_at: at(started),
            ..StepCheckpoint::default()
        }
    }

    fn status(steps: Vec<StepCheckpoint>) -> AgentRunStatus {
        AgentRunStatus {
            phase: Some(RunPhase::Running),
            started_at: at(0),
            steps,
            ..AgentRunStatus::default()
        }
    }

    fn now() -> Timestamp {
        at(100).unwrap().0
    }

    #[test]
    fn a_success_ends_its_attempt_at_the_checkpoint_time() {
        let old = status(vec![running("a", 1, 10)]);
        let mut done = running("a", 1, 10);
        done.phase = StepPhase::Succeeded;
        done.finished_at = at(25);
        done.tokens = Some(crate::api::TokenUsage {
            input: 3,
            output: 4,
        });
        done.effect = Some(EffectOutcome::Applied);
        let new = status(vec![done, running("b", 1, 25)]);
        let t = between(&old, &new, now());
        assert_eq!(t.len(), 1, "{t:?}");
        let Transition::AttemptEnded(e) = &t[0] else {
            panic!("{t:?}")
        };
        assert_eq!(e.outcome, AttemptOutcome::Succeeded);
        assert_eq!((e.started, e.ended), (at(10).unwrap().0, at(25).unwrap().0));
        assert_eq!(e.tokens, 7);
        assert_eq!(e.attempt, 1);
        assert_eq!(e.effect, Some(EffectOutcome::Applied));
    }

    #[test]
    fn a_timed_out_attempt_ends_once_and_its_retry_is_a_new_attempt() {
        let old = status(vec![running("b", 1, 10)]);
        let mut retry = running("b", 1, 10);
        retry.phase = StepPhase::Pending;
        retry.failures = 1;
        retry.stopping = true;
        let new = status(vec![retry.clone()]);
        let t = between(&old, &new, now());
        assert_eq!(t.len(), 1);
        assert!(matches!(&t[0], Transition::AttemptEnded(e)
            if e.outcome == AttemptOutcome::Failed && e.ended == now()));
        // The stopping Pod reports later: no second end.
        let mut reported = retry.clone();
        reported.stopping = false;
        reported.tokens = Some(crate::api::TokenUsage {
            input: 1,
            output: 1,
        });
        assert_eq!(
            between(&new, &status(vec![reported.clone()]), now()),
            vec![]
        );
        // Attempt 2 starts: nothing ends.
        assert_eq!(
            between(
                &status(vec![reported]),
                &status(vec![running("b", 2, 50)]),
                now()
            ),
            vec![]
        );
    }

    #[test]
    fn a_disruption_and_a_wait_for_a_person_are_told_apart() {
        let old = status(vec![running("c", 1, 10)]);
        let mut lost = running("c", 1, 10);
        lost.phase = StepPhase::WaitingForApproval;
        lost.disruptions = 1;
        lost.approval = Some("run-c-reconcile-a1".into());
        let new = status(vec![lost.clone()]);
        let t = between(&old, &new, now());
        assert!(
            matches!(&t[..], [Transition::AttemptEnded(e)] if e.outcome == AttemptOutcome::Disrupted),
            "{t:?}"
        );
        let released = running("c", 2, 100);
        let t = between(&new, &status(vec![released]), now());
        assert!(
            matches!(&t[..], [Transition::ApprovalWaitEnded(w)]
                if w.approval == "run-c-reconcile-a1" && w.then == StepPhase::Running
                    && w.started == at(10).unwrap().0 && w.ended == now()),
            "{t:?}"
        );
    }

    #[test]
    fn a_compensation_attempt_and_a_replan_are_facts_too() {
        let comp = |phase, attempt, failures| CompensationCheckpoint {
            name: "pay".into(),
            plan_revision: 1,
            attempt,
            idempotency_key: "ck".into(),
            pod: Some(format!("run-pay-c{attempt}")),
            phase,
            started_at: at(30),
            failures,
            ..CompensationCheckpoint::default()
        };
        let mut old = status(vec![]);
        old.plan = Some(crate::api::PlanStatus {
            revision: 1,
            ..Default::default()
        });
        old.compensations = vec![comp(StepPhase::Running, 1, 0)];
        let mut new = old.clone();
        new.compensations = vec![comp(StepPhase::Pending, 1, 1)];
        new.plan = Some(crate::api::PlanStatus {
            revision: 2,
            reason: "step lookup stale".into(),
            ..Default::default()
        });
        let t = between(&old, &new, now());
        assert!(
            matches!(&t[..], [Transition::AttemptEnded(e), Transition::Replanned { revision: 2, .. }]
                if e.role == PodRole::Compensate && e.outcome == AttemptOutcome::Failed
                    && e.started == at(30).unwrap().0 && e.ended == now()),
            "{t:?}"
        );
    }

    #[test]
    fn the_run_ends_once() {
        let old = status(vec![]);
        let mut new = status(vec![]);
        new.phase = Some(RunPhase::Succeeded);
        new.completed_at = at(90);
        let t = between(&old, &new, now());
        assert_eq!(
            t,
            vec![Transition::RunEnded {
                phase: RunPhase::Succeeded,
                started: Some(at(0).unwrap().0),
                ended: at(90).unwrap().0
            }]
        );
        assert_eq!(between(&new, &new, now()), vec![]);
    }

    #[test]
    fn handoff_starts_at_the_last_committed_outcome() {
        let mut a = running("a", 1, 10);
        a.phase = StepPhase::Succeeded;
        a.finished_at = at(20);
        let s = status(vec![a, running("b", 1, 20)]);
        assert_eq!(
            handoff_start(&s, PodRole::Step, "b", 1),
            Some(at(20).unwrap().0)
        );
        assert_eq!(handoff_start(&s, PodRole::Step, "b", 2), None, "a retry");
        assert_eq!(
            handoff_start(&status(vec![running("a", 1, 0)]), PodRole::Step, "a", 1),
            None
        );
    }
}
