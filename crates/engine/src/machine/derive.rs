//! What the status says of itself: phase, progress, current step and
//! conditions, derived from the checkpoints (D16: every stall shows); and the
//! compaction that keeps the status under its size budget (D11).

use crate::Action;
use crate::conditions::{self as cond, FALSE, TRUE, UNKNOWN};
use crate::plan::{CheckpointIndex, Plan};
use crate::reasons::{ConditionType, Reason};
use agentrun_api::{
    AgentRunStatus, CheckpointState, RunPhase, StepCheckpoint, StepPhase, StepRole,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};

use super::{COMPACT_STATUS_ABOVE, Machine, STALL_AFTER_DISRUPTIONS};

impl<'a> Machine<'_, 'a> {
    /// Derives what the status says of itself from the checkpoints, after
    /// every other stage of the decision: each part below reads what it
    /// names in its signature and writes only its own field or condition.
    pub(super) fn derive(&mut self, plan: &Plan<'_>) {
        let seen = Seen::of(&self.draft.status, plan);
        self.draft.status.progress = Some(format!("{}/{}", seen.done, plan.steps.len()));
        if let Some(text) = current_step(&self.draft.status, plan, &seen.effective) {
            self.draft.status.current_step = Some(text);
        }
        let phase = match self.draft.status.phase {
            Some(p) if p.is_terminal() => p,
            _ if self.failing() => RunPhase::Compensating,
            _ if self.planning().is_some() => RunPhase::Planning,
            _ if seen.waiting.is_some() && !seen.running => RunPhase::WaitingForApproval,
            _ if seen.timer.is_some() && !seen.running => RunPhase::Waiting,
            _ => RunPhase::Running,
        };
        self.draft.status.phase = Some(phase);
        if self.draft.stalled.is_none() && !phase.is_terminal() {
            self.draft.stalled = repeatedly_disrupted(&self.draft.status);
        }
        let stalled = self.draft.stalled.take().filter(|_| !phase.is_terminal());
        let creating = self
            .draft
            .actions
            .iter()
            // Whatever a refusal stalls is sent again: the stall stands
            // until it lands (a settlement is written, not created, but
            // the same).
            .any(|a| {
                matches!(
                    a,
                    Action::CreatePod(_)
                        | Action::CreateApproval(_)
                        | Action::CreateSignal(_)
                        | Action::SettleCall { .. }
                )
            });
        let at = Stamp {
            generation: self.view.run.metadata.generation,
            now: self.view.now,
        };
        let conds = &mut self.draft.status.conditions;
        succeeded(conds, phase, &seen, plan.steps.len(), at);
        stalled_condition(conds, stalled, phase, creating, at);
        // Progressing follows Stalled as it stands after this decision: a
        // decision that sends again what was refused is still stalled, and
        // flipping Progressing back and forth would write the status twice
        // a reconcile, each write waking the next, past every backoff.
        let still_stalled = cond::get(conds, ConditionType::Stalled)
            .filter(|c| c.status == TRUE && !phase.is_terminal())
            .map(|c| c.reason.parse::<Reason>().unwrap_or(Reason::FailedCreate));
        progressing(conds, phase, still_stalled, self.view.run.spec.suspend, at);
        awaiting_approval(conds, seen.waiting.as_ref(), phase, at);
        ready_and_reconciling(conds, phase, at);
        self.stale(plan, at);
    }

    /// `Stale`, for a revision that reruns steps: fresh again once every
    /// step it runs again is done.
    fn stale(&mut self, plan: &Plan<'_>, at: Stamp) {
        let Some(plan_status) = &self.draft.status.plan else {
            return;
        };
        if plan_status.rerun.is_empty() && plan_status.rerun_from.is_none() {
            return;
        }
        let index = CheckpointIndex::new(&self.draft.status.steps);
        let rerun_done = (0..plan.steps.len())
            .filter(|&i| plan.runs_at_revision(i))
            .all(|i| {
                index
                    .effective(&self.draft.status.steps, plan, i)
                    .is_some_and(|c| self.draft.status.steps[c].phase.is_done())
            });
        let (s, r) = if rerun_done {
            (FALSE, Reason::InputsFresh)
        } else {
            (TRUE, Reason::InputStale)
        };
        let reason = plan_status.reason.clone();
        cond::set(
            &mut self.draft.status.conditions,
            ConditionType::Stale,
            s,
            r,
            reason,
            at.generation,
            at.now,
        );
    }

    /// D11: keeps the status under its size budget whatever the names and
    /// the number of steps. Only finished checkpoints are touched, and only
    /// what no rule reads again: the facts of every outcome stay.
    pub(super) fn compact_status(&mut self) {
        if self.draft.status == self.view.committed {
            return; // nothing is written: nothing grows
        }
        // Measured with every checkpoint inline, as before the archive
        // (`agentrun_api::archive::inline`): the archive makes writes cheaper,
        // it does not change what a long run keeps.
        let size = |s: &AgentRunStatus| {
            agentrun_api::archive::inline(|| serde_json::to_vec(s).map_or(0, |v| v.len()))
        };
        let mut excess = size(&self.draft.status).saturating_sub(COMPACT_STATUS_ABOVE);
        if excess == 0 {
            return;
        }
        // The newest compactor that succeeded marks where the summary ends:
        // the results before it are in the summary and left out of every
        // context. It stays, or every later step would compact again.
        let boundary = self
            .draft
            .status
            .steps
            .iter()
            .rposition(|c| c.role == StepRole::Compactor && c.phase == StepPhase::Succeeded);
        // Compactors whose step has started: their summary is in the status.
        let started: std::collections::HashSet<(String, i64)> = self
            .draft
            .status
            .steps
            .iter()
            .filter(|c| c.role == StepRole::Step)
            .map(|c| (c.name.clone(), c.plan_revision))
            .collect();
        let mut position = 0;
        self.draft.status.steps.retain(|c| {
            let at = position;
            position += 1;
            let drop = excess > 0
                && Some(at) != boundary
                && c.role == StepRole::Compactor
                && c.phase.is_terminal()
                && !c.stopping
                && started.contains(&(c.name.clone(), c.plan_revision));
            if drop {
                excess = excess.saturating_sub(serde_json::to_vec(c).map_or(0, |v| v.len()));
            }
            !drop
        });
        for c in self.draft.status.steps.iter_mut() {
            if excess == 0 {
                break;
            }
            if !c.phase.is_terminal()
                || c.checkpoint != CheckpointState::Committed
                || c.stopping
                || c.compacted
            {
                continue;
            }
            let before = serde_json::to_vec(&*c).map_or(0, |v| v.len());
            c.pod = None;
            c.pod_uid = None;
            c.started_at = None;
            c.tokens = None;
            c.message = None;
            c.compacted = true;
            let after = serde_json::to_vec(&*c).map_or(0, |v| v.len());
            excess = excess.saturating_sub(before.saturating_sub(after));
        }
    }
}

/// When a condition is set: the run's generation and the decision's time.
#[derive(Clone, Copy)]
struct Stamp {
    generation: Option<i64>,
    now: jiff::Timestamp,
}

/// What the checkpoints show, read once for every part of `derive`.
struct Seen {
    /// Each plan step's checkpoint at this revision, if it has one.
    effective: Vec<Option<usize>>,
    /// Plan steps done.
    done: usize,
    /// The latest checkpoint waiting for an approval.
    waiting: Option<StepCheckpoint>,
    /// Some attempt runs.
    running: bool,
    /// The wait step that ends first (a wait for a signal without a
    /// deadline last): its name, its wake or deadline, its Signal.
    timer: Option<(String, Option<Time>, Option<String>)>,
}

impl Seen {
    fn of(status: &AgentRunStatus, plan: &Plan<'_>) -> Self {
        let index = CheckpointIndex::new(&status.steps);
        let effective: Vec<Option<usize>> = (0..plan.steps.len())
            .map(|i| index.effective(&status.steps, plan, i))
            .collect();
        let done = effective
            .iter()
            .filter(|c| c.is_some_and(|c| status.steps[c].phase.is_done()))
            .count();
        let steps = &status.steps;
        Seen {
            done,
            waiting: steps
                .iter()
                .rfind(|c| c.phase == StepPhase::WaitingForApproval)
                .cloned(),
            running: steps.iter().any(|c| c.phase == StepPhase::Running),
            timer: steps
                .iter()
                .filter(|c| c.phase == StepPhase::Waiting)
                .min_by_key(|c| c.wake_at.as_ref().map_or(jiff::Timestamp::MAX, |t| t.0))
                .map(|c| (c.name.clone(), c.wake_at.clone(), c.signal.clone())),
            effective,
        }
    }
}

/// The steps under way, in the plan's order: one name for a sequence, the
/// names of the parallel branches for a graph (three, then `+N`); else the
/// last unfinished step or compensation.
fn current_step(
    status: &AgentRunStatus,
    plan: &Plan<'_>,
    effective: &[Option<usize>],
) -> Option<String> {
    let mut active: Vec<String> = plan
        .order
        .iter()
        .filter_map(|&i| effective[i])
        .map(|c| &status.steps[c])
        .filter(|c| !c.phase.is_terminal())
        .map(|c| c.name.clone())
        .collect();
    if active.is_empty()
        && let Some(c) = status.steps.iter().rfind(|c| !c.phase.is_terminal())
    {
        active.push(c.name.clone());
    }
    if active.is_empty()
        && let Some(c) = status
            .compensations
            .iter()
            .rfind(|c| !c.phase.is_terminal())
    {
        active.push(c.name.clone());
    }
    if active.is_empty() {
        return None;
    }
    const SHOWN: usize = 3;
    let more = active.len().saturating_sub(SHOWN);
    active.truncate(SHOWN);
    let mut text = active.join(",");
    if more > 0 {
        text.push_str(&format!(",+{more}"));
    }
    Some(text)
}

/// D16: a step disrupted again and again is a stall people must see, even
/// though it resumes on its own once the cluster heals.
fn repeatedly_disrupted(status: &AgentRunStatus) -> Option<(Reason, String)> {
    let c = status
        .steps
        .iter()
        .find(|c| !c.phase.is_terminal() && c.disruptions >= STALL_AFTER_DISRUPTIONS)?;
    let next = c
        .next_attempt_at
        .as_ref()
        .map(|t| format!("; its next attempt starts at {}", t.0))
        .unwrap_or_default();
    Some((
        Reason::RepeatedlyDisrupted,
        format!(
            "step {} was disrupted {} times{next}; {}",
            c.name,
            c.disruptions,
            c.message.as_deref().unwrap_or("")
        ),
    ))
}

/// `Succeeded`: true once the run succeeded, false with the failure's
/// reason, unknown while it runs (what it waits for, if a wait step).
fn succeeded(conds: &mut Vec<Condition>, phase: RunPhase, seen: &Seen, steps: usize, at: Stamp) {
    let (g, now) = (at.generation, at.now);
    let done = seen.done;
    let target = cond::get(conds, ConditionType::FailureTarget).cloned();
    match phase {
        RunPhase::Succeeded => cond::set(
            conds,
            ConditionType::Succeeded,
            TRUE,
            Reason::RunSucceeded,
            format!("{done} steps succeeded"),
            g,
            now,
        ),
        RunPhase::Failed | RunPhase::Cancelled => {
            let (r, m) = target.map_or((String::from(Reason::RunFailed), String::new()), |c| {
                (c.reason, c.message)
            });
            cond::set(conds, ConditionType::Succeeded, FALSE, &r, m, g, now)
        }
        p => {
            let r = match p {
                RunPhase::Planning => Reason::Planning,
                RunPhase::WaitingForApproval => Reason::WaitingForApproval,
                RunPhase::Waiting => Reason::Waiting,
                RunPhase::Compensating => Reason::Compensating,
                RunPhase::Pending => Reason::Pending,
                _ => Reason::Running,
            };
            let mut message = format!("{done}/{steps} steps done");
            if let (RunPhase::Waiting, Some((name, at, signal))) = (p, &seen.timer) {
                let until = at.as_ref().map(|t| format!(" until {}", t.0));
                match signal {
                    Some(sig) => message.push_str(&format!(
                        "; step {name} waits for Signal {sig}{}",
                        until.unwrap_or_default()
                    )),
                    None => {
                        if let Some(until) = until {
                            message.push_str(&format!("; step {name} waits{until}"));
                        }
                    }
                }
            }
            cond::set(conds, ConditionType::Succeeded, UNKNOWN, r, message, g, now)
        }
    }
}

/// `Progressing`: false once finished, stalled, suspended or waiting for a
/// person; true while it runs, compensates or waits on a timer.
fn progressing(
    conds: &mut Vec<Condition>,
    phase: RunPhase,
    stalled: Option<Reason>,
    suspended: bool,
    at: Stamp,
) {
    let (status, r) = if phase.is_terminal() {
        (FALSE, Reason::Finished)
    } else if let Some(why) = stalled {
        (FALSE, why)
    } else if suspended {
        (FALSE, Reason::Suspended)
    } else if phase == RunPhase::WaitingForApproval {
        (FALSE, Reason::WaitingForApproval)
    } else if phase == RunPhase::Compensating {
        (TRUE, Reason::Compensating)
    } else if phase == RunPhase::Waiting {
        (TRUE, Reason::Waiting)
    } else {
        (TRUE, Reason::Running)
    };
    cond::set(
        conds,
        ConditionType::Progressing,
        status,
        r,
        String::new(),
        at.generation,
        at.now,
    );
}

/// `Stalled` (D16): set with the stall this decision found; cleared once
/// what was refused exists (nothing is being created again), the step
/// disrupted again and again got through, or the run is over.
fn stalled_condition(
    conds: &mut Vec<Condition>,
    stalled: Option<(Reason, String)>,
    phase: RunPhase,
    creating: bool,
    at: Stamp,
) {
    let (g, now) = (at.generation, at.now);
    match stalled {
        Some((why, message)) => {
            cond::set(conds, ConditionType::Stalled, TRUE, why, message, g, now)
        }
        None if cond::is_true(conds, ConditionType::Stalled)
            && (phase.is_terminal()
                || !creating
                || cond::get(conds, ConditionType::Stalled).is_some_and(|c| {
                    c.reason == Reason::RepeatedlyDisrupted || c.reason == Reason::PodNotStopping
                })) =>
        {
            cond::set(
                conds,
                ConditionType::Stalled,
                FALSE,
                Reason::Unblocked,
                String::new(),
                g,
                now,
            )
        }
        None => {}
    }
}

/// `AwaitingApproval`: which step waits for which Approval, while the run
/// is not over.
fn awaiting_approval(
    conds: &mut Vec<Condition>,
    waiting: Option<&StepCheckpoint>,
    phase: RunPhase,
    at: Stamp,
) {
    let (g, now) = (at.generation, at.now);
    match waiting {
        Some(w) if !phase.is_terminal() => cond::set(
            conds,
            ConditionType::AwaitingApproval,
            TRUE,
            Reason::WaitingForApproval,
            format!(
                "step {} waits for Approval {}",
                w.name,
                w.approval.clone().unwrap_or_default()
            ),
            g,
            now,
        ),
        _ => cond::set(
            conds,
            ConditionType::AwaitingApproval,
            FALSE,
            Reason::NoApprovalPending,
            String::new(),
            g,
            now,
        ),
    }
}

/// kstatus (Flux) and `kubectl wait --for=condition=Ready`: `Ready` once the
/// run succeeded; `Reconciling` while it is under way and not stalled.
fn ready_and_reconciling(conds: &mut Vec<Condition>, phase: RunPhase, at: Stamp) {
    let (g, now) = (at.generation, at.now);
    let (ready, reason, message) = cond::get(conds, ConditionType::Succeeded).map_or(
        (FALSE, String::new(), String::new()),
        |c| {
            let ready = if c.status == TRUE { TRUE } else { FALSE };
            (ready, c.reason.clone(), c.message.clone())
        },
    );
    cond::set(conds, ConditionType::Ready, ready, &reason, message, g, now);
    let reconciling = !phase.is_terminal() && !cond::is_true(conds, ConditionType::Stalled);
    let status = if reconciling { TRUE } else { FALSE };
    cond::set(
        conds,
        ConditionType::Reconciling,
        status,
        &reason,
        String::new(),
        g,
        now,
    );
}
