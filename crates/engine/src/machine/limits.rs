//! Run limits: cancel, the active deadline and the token and step budgets
//! (D9). Crossing one closes the running attempts (their effect Unknown
//! when they may have acted) and sends the run into its wind-down.

use std::collections::HashMap;

use jiff::{SignedDuration, Timestamp};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

use crate::conditions::TRUE;
use crate::observe::{self};
use crate::reasons::{ConditionType, Reason};
use crate::{Action, EventType};
use agentrun_api::{CheckpointState, Effect, EffectOutcome, StepPhase, StepRole};

use super::Machine;

impl<'a> Machine<'_, 'a> {
    pub(super) fn enforce_limits(&mut self) {
        if self.failing() {
            return;
        }
        let spec = &self.view.run.spec;
        if spec.cancel {
            return self.fail_run(Reason::Cancelled, "spec.cancel is set".into());
        }
        if let (Some(secs), Some(started)) = (
            spec.active_deadline_seconds,
            self.draft.status.started_at.as_ref(),
        ) {
            let at = started
                .0
                .checked_add(SignedDuration::from_secs(secs.max(0)))
                .unwrap_or(Timestamp::MAX);
            if at <= self.view.now {
                return self.fail_run(
                    Reason::DeadlineExceeded,
                    format!("the run exceeded activeDeadlineSeconds ({secs})"),
                );
            }
            self.draft.deadlines.push(at);
        }
        if let Some(budget) = spec.budget.as_ref().and_then(|b| b.tokens)
            && self.draft.status.tokens_used > budget
        {
            self.budget_exceeded(
                Reason::TokenBudgetExceeded,
                format!(
                    "{} tokens used, over the budget of {budget}",
                    self.draft.status.tokens_used
                ),
            );
        }
    }

    pub(super) fn budget_exceeded(&mut self, why: Reason, message: String) {
        self.set_condition(ConditionType::BudgetExceeded, TRUE, why, message.clone());
        self.fail_run(why, message);
    }

    /// The run is bound to fail (or be cancelled): record why, close what has
    /// not started, and wind down through compensation. A cancel, a deadline,
    /// a budget or a spec that cannot run stops what runs; any other failure
    /// (a step failed for good, a refusal) lets the steps already running in
    /// other branches finish, so their effects are recorded, not guessed.
    pub(super) fn fail_run(&mut self, why: Reason, message: String) {
        self.set_condition(ConditionType::FailureTarget, TRUE, why, message.clone());
        self.draft.recorded = true;
        let stop_running = matches!(
            why,
            Reason::Cancelled
                | Reason::DeadlineExceeded
                | Reason::TokenBudgetExceeded
                | Reason::StepExecutionBudgetExceeded
                | Reason::StatusBudgetExceeded
                | Reason::InvalidSpec
        );
        let now = self.view.now;
        let effects: HashMap<String, Effect> = self
            .view
            .run
            .spec
            .steps
            .iter()
            .chain(self.draft.status.plan.iter().flat_map(|p| p.steps.iter()))
            .map(|s| (s.name.clone(), s.effect))
            .collect();
        for i in 0..self.draft.status.steps.len() {
            let cp = &self.draft.status.steps[i];
            if cp.phase.is_terminal() {
                continue;
            }
            let mut effect = cp.effect;
            let mut closing = format!("stopped: {message}");
            if cp.phase == StepPhase::Running {
                let pod_name = cp.pod.clone().unwrap_or_default();
                let pod = self.view.pods.get(pod_name.as_str()).copied();
                // A Pod seen live runs on to its end and is recorded then.
                if !stop_running && pod.is_some_and(observe::is_live) {
                    continue;
                }
                // Unseen Pods may exist: assume they started.
                let started = pod.is_none_or(observe::started);
                if cp.role == StepRole::Step
                    && effects.get(&cp.name).is_some_and(|e| *e != Effect::None)
                {
                    effect = Some(if started {
                        EffectOutcome::Unknown
                    } else {
                        cp.effect.unwrap_or(EffectOutcome::NotApplied)
                    });
                }
                // An attempt this very decision launched (another branch of
                // a graph) is taken back before its Pod is ever created.
                let launched_now = self.draft.actions.iter().position(|a| {
                    matches!(a, Action::CreatePod(p) if p.metadata.name.as_deref() == Some(pod_name.as_str()))
                });
                if let Some(k) = launched_now {
                    self.draft.actions.remove(k);
                    effect = cp.effect.or(Some(EffectOutcome::NotApplied)).filter(|_| {
                        cp.role == StepRole::Step
                            && effects.get(&cp.name).is_some_and(|e| *e != Effect::None)
                    });
                    if cp.role == StepRole::Step && effect.is_none() {
                        effect = Some(EffectOutcome::NotApplied);
                    }
                } else if pod
                    .is_none_or(|p| p.metadata.deletion_timestamp.is_none() && observe::is_live(p))
                {
                    self.draft.actions.push(Action::DeletePod {
                        name: pod_name,
                        reason: format!("stopping: {message}"),
                    });
                }
                // A Pod that is still running may yet report a result (which
                // its compensation needs) and tokens: they are still recorded.
                self.draft.status.steps[i].stopping = pod.is_some_and(observe::is_live);
            } else {
                if cp.role == StepRole::Step && effect.is_none() {
                    effect = Some(EffectOutcome::NotApplied);
                }
                if cp.phase == StepPhase::Waiting {
                    closing = format!("stopped waiting: {message}");
                } else if !stop_running {
                    closing = format!("not started: {message}");
                }
            }
            let cp = &mut self.draft.status.steps[i];
            cp.effect = if cp.role == StepRole::Step {
                effect
            } else {
                None
            };
            cp.phase = StepPhase::Failed;
            cp.checkpoint = CheckpointState::Committed;
            cp.finished_at = Some(Time(now));
            cp.pod_uid = None;
            cp.next_attempt_at = None;
            cp.message = Some(closing);
        }
        let type_ = if why == Reason::Cancelled {
            EventType::Normal
        } else {
            EventType::Warning
        };
        self.event(type_, why, message);
    }
}
