//! Winding down: once no step Pod is live, compensate the steps whose effect
//! was applied or may have been (D7), latest first, each as an attempt with
//! its own key and retries; then the terminal phase.

use jiff::SignedDuration;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

use crate::EventType;
use crate::conditions::{self as cond};
use crate::names::PodRole;
use crate::observe::{self};
use crate::plan::Plan;
use crate::reasons::{ConditionType, Reason};
use crate::result;
use agentrun_api::{EffectOutcome, RunPhase, StepContainer, StepPhase, StepRole};

use super::Machine;
use super::slot::{Acted, Slot};

impl<'a> Machine<'_, 'a> {
    pub(super) fn wind_down(&mut self, plan: &Plan<'_>) {
        // Nothing new starts while a step Pod of this run is still live. Past
        // the run's active deadline, a Pod still not stopped when its grace
        // period ended is on a lost node: its effect is already recorded as
        // Unknown, and waiting for it would hang the run past its deadline.
        let past_deadline = cond::get(&self.draft.status.conditions, ConditionType::FailureTarget)
            .is_some_and(|c| c.reason == Reason::DeadlineExceeded);
        let mut step_pod_live = false;
        for p in self.view.pods.values() {
            if !observe::is_live(p)
                || observe::coords(p).is_none_or(|c| c.role == PodRole::Compensate)
            {
                continue;
            }
            match p.metadata.deletion_timestamp.as_ref() {
                Some(gone_by) if past_deadline && gone_by.0 <= self.view.now => {}
                Some(gone_by) if past_deadline => {
                    self.draft.deadlines.push(gone_by.0);
                    step_pod_live = true;
                }
                _ => step_pod_live = true,
            }
        }
        if step_pod_live {
            return;
        }
        let targets = self.compensation_targets(plan);
        for (name, rev, _container) in targets {
            let existing = self
                .draft
                .status
                .compensations
                .iter()
                .position(|c| c.name == name && c.plan_revision == rev);
            let Some(k) = existing else {
                self.launch(plan, PodRole::Compensate, &name, rev, 1);
                return;
            };
            let cp = self.draft.status.compensations[k].clone();
            match cp.phase {
                StepPhase::Running => return,
                StepPhase::Pending => {
                    if self.due(cp.next_attempt_at.as_ref()) {
                        self.launch(plan, PodRole::Compensate, &name, rev, cp.attempt + 1);
                    }
                    return;
                }
                _ => continue,
            }
        }
        self.finish_failed();
    }

    /// Applied (or possibly applied) steps with a compensation, latest first.
    pub(super) fn compensation_targets(
        &self,
        plan: &Plan<'_>,
    ) -> Vec<(String, i64, StepContainer)> {
        self.draft
            .status
            .steps
            .iter()
            .rev()
            .filter(|c| c.role == StepRole::Step)
            // Inherited effects are the source run's to undo.
            .filter(|c| c.provenance != Some(agentrun_api::Provenance::Inherited))
            .filter(|c| {
                matches!(
                    c.effect,
                    Some(EffectOutcome::Applied | EffectOutcome::Unknown)
                )
            })
            .filter_map(|c| {
                let container = *self.step_spec(plan, &c.name)?.compensate?;
                Some((c.name.clone(), c.plan_revision, container))
            })
            .collect()
    }

    /// A compensation's Pod succeeded: with a usable report it is done,
    /// and the next compensation (or the run's end) follows.
    pub(super) fn compensation_succeeded(
        &mut self,
        plan: &Plan<'_>,
        k: usize,
        message: Option<&str>,
    ) {
        let slot = Slot::Compensation(k);
        let report = match result::parse(message) {
            Ok(report) => report,
            Err(e) => {
                let why = format!(
                    "attempt {} returned an unusable result: {e}",
                    self.draft.status.compensations[k].attempt
                );
                let tokens = result::tokens_best_effort(message);
                return self.attempt_failed(plan, slot, why, tokens, Acted::No);
            }
        };
        self.add_tokens(slot, report.tokens);
        self.draft.tally.succeeded += 1;
        let now = Time(self.view.now);
        let c = &mut self.draft.status.compensations[k];
        c.phase = StepPhase::Succeeded;
        c.finished_at = Some(now);
        c.pod_uid = None;
        self.draft.recorded = true;
        let message = format!("compensation of step {} succeeded", c.name);
        self.event(EventType::Normal, Reason::CompensationSucceeded, message);
    }

    pub(super) fn finish_failed(&mut self) {
        let target =
            cond::get(&self.draft.status.conditions, ConditionType::FailureTarget).cloned();
        let why: Reason = target
            .as_ref()
            .and_then(|c| c.reason.parse().ok())
            .unwrap_or(Reason::RunFailed);
        let message = target.map(|c| c.message).unwrap_or_default();
        let cancelled = why == Reason::Cancelled;
        self.draft.status.phase = Some(if cancelled {
            RunPhase::Cancelled
        } else {
            RunPhase::Failed
        });
        self.complete();
        let failed_compensations: Vec<String> = self
            .draft
            .status
            .compensations
            .iter()
            .filter(|c| c.phase == StepPhase::Failed)
            .map(|c| c.name.clone())
            .collect();
        let mut text = message;
        if !failed_compensations.is_empty() {
            text.push_str(&format!(
                "; compensation failed for: {}",
                failed_compensations.join(", ")
            ));
        }
        if cancelled {
            self.event(EventType::Normal, Reason::RunCancelled, text);
        } else {
            self.event(EventType::Warning, Reason::RunFailed, text);
        }
        if let Some(ttl) = self.view.run.spec.ttl_seconds_after_finished {
            self.draft
                .deadlines
                .push(self.at(SignedDuration::from_secs(ttl.max(0).into())));
        }
    }
}
