//! Starting what comes next: the planner, an approval gate, a re-plan on
//! stale input (D8, bounded by D11), a compactor, or the next attempt with
//! its stable key (D1) and never beside a live one (D2); the step Pod built
//! with its context.

use jiff::{SignedDuration, Timestamp};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use serde_json::Value;

use crate::api::{
    DEFAULT_CONTEXT_BYTES, MAX_CONTEXT_BYTES, PlanSource, RunPhase, StepPhase, StepRole, StepSpec,
};
use crate::engine::EventType;
use crate::engine::context::{self, Identity, PriorResult};
use crate::engine::names::PodRole;
use crate::engine::plan::{CheckpointIndex, Plan};
use crate::engine::reasons::Reason;

use super::{MAX_CHECKPOINTS, MAX_REPLANS, Machine};

impl<'a> Machine<'a> {
    pub(super) fn advance(&mut self, plan: &Plan<'_>) {
        if self.run.spec.suspend {
            return;
        }
        if let Some(planner) = self.planning() {
            let rev = plan.revision;
            match self
                .status
                .steps
                .iter()
                .position(|c| c.role == StepRole::Planner && c.plan_revision == rev)
            {
                None => self.launch(plan, PodRole::Planner, &planner.name, rev, 1),
                Some(i) => {
                    let cp = self.status.steps[i].clone();
                    if cp.phase == StepPhase::Pending && self.due(cp.next_attempt_at.as_ref()) {
                        self.launch(plan, PodRole::Planner, &planner.name, rev, cp.attempt + 1);
                    }
                }
            }
            return;
        }
        let index = CheckpointIndex::new(&self.status.steps);
        let cursor = (0..plan.steps.len()).find_map(|i| {
            match index.effective(&self.status.steps, plan, i) {
                Some(c) if self.status.steps[c].phase == StepPhase::Succeeded => None,
                other => Some((i, other)),
            }
        });
        let Some((i, slot)) = cursor else {
            return self.succeed_run(plan);
        };
        let name = plan.steps[i].name.clone();
        let Some(c) = slot else {
            return self.start_step(plan, i);
        };
        let cp = self.status.steps[c].clone();
        match cp.phase {
            StepPhase::Pending if self.due(cp.next_attempt_at.as_ref()) => {
                self.launch(plan, PodRole::Step, &name, plan.revision, cp.attempt + 1)
            }
            StepPhase::WaitingForApproval => self.wait_for_approval(plan, i, c),
            _ => {}
        }
    }

    pub(super) fn planning(&self) -> Option<StepSpec> {
        let plan = self.status.plan.as_ref()?;
        (plan.source == PlanSource::Spec && plan.revision == 1)
            .then(|| self.run.spec.planner.clone())
            .flatten()
    }

    pub(super) fn succeed_run(&mut self, plan: &Plan) {
        self.status.phase = Some(RunPhase::Succeeded);
        self.status.completed_at = Some(Time(self.now));
        self.event(
            EventType::Normal,
            Reason::RunSucceeded,
            format!(
                "all {} steps of plan revision {} succeeded",
                plan.steps.len(),
                plan.revision
            ),
        );
        if let Some(ttl) = self.run.spec.ttl_seconds_after_finished {
            self.deadlines
                .push(self.at(SignedDuration::from_secs(ttl.max(0).into())));
        }
    }

    /// Step `i` has no checkpoint at this revision yet.
    pub(super) fn start_step(&mut self, plan: &Plan<'_>, i: usize) {
        if self.replan_if_stale(plan, i) {
            return;
        }
        let step = plan.steps[i];
        let Some(gate) = step.approval.as_ref().filter(|g| g.required) else {
            return self.launch(plan, PodRole::Step, &step.name, plan.revision, 1);
        };
        if self.compaction_blocks(plan, i) {
            return;
        }
        if gate.required {
            self.ask_approval(plan, i, None, None);
        }
    }

    /// D8: before a step starts, every input must be within its freshness
    /// budget; otherwise re-plan from the earliest stale step.
    pub(super) fn replan_if_stale(&mut self, plan: &Plan<'_>, i: usize) -> bool {
        let index = CheckpointIndex::new(&self.status.steps);
        let stale = (0..i).find_map(|j| {
            let c = &self.status.steps[index.effective(&self.status.steps, plan, j)?];
            let until = c.fresh_until.as_ref()?;
            (until.0 <= self.now).then_some((j, until.0))
        });
        // No timer for freshness: it only matters when a step is about to start.
        let Some((j, since)) = stale else {
            return false;
        };
        let revision = plan.revision + 1;
        let stale_name = plan.steps[j].name.clone();
        let replans = self.status.plan.as_ref().map_or(0, |p| p.revision) - 1;
        if replans >= MAX_REPLANS {
            self.fail_run(
                Reason::InputStale,
                format!(
                    "the result of step {stale_name} went stale again after {replans} re-plans; its freshFor is shorter than what must happen before the steps that use it"
                ),
            );
            return true;
        }
        let rerun = plan.steps.len() - j;
        let kept = self.status.steps.len();
        if kept + rerun > MAX_CHECKPOINTS {
            self.fail_run(
                Reason::StatusBudgetExceeded,
                format!(
                    "the result of step {stale_name} went stale, but running the {rerun} steps from it again would keep {} checkpoints in status, more than the {MAX_CHECKPOINTS} a run may hold",
                    kept + rerun
                ),
            );
            return true;
        }
        let reason_text = format!(
            "the result of step {stale_name} went stale at {since}; steps from {stale_name} on run again at plan revision {revision}"
        );
        for cp in self.status.steps.iter_mut() {
            if !cp.phase.is_terminal() && cp.plan_revision < revision {
                cp.phase = StepPhase::Superseded;
                cp.message = Some(format!("superseded by plan revision {revision}"));
            }
        }
        if let Some(p) = self.status.plan.as_mut() {
            p.revision = revision;
            p.reason = reason_text.clone();
            p.rerun_from = Some(stale_name);
        }
        self.recorded = true;
        self.tally.replans += 1;
        self.event(EventType::Normal, Reason::Replanned, reason_text);
        true
    }

    /// D11: when the context of step `i` would exceed `maxBytes` and a
    /// compactor is configured, it runs first. Returns whether it blocks.
    pub(super) fn compaction_blocks(&mut self, plan: &Plan<'_>, i: usize) -> bool {
        if self
            .run
            .spec
            .context
            .as_ref()
            .and_then(|c| c.compactor.as_ref())
            .is_none()
        {
            return false;
        }
        let name = plan.steps[i].name.clone();
        let index = CheckpointIndex::new(&self.status.steps);
        match index.at(
            &self.status.steps,
            StepRole::Compactor,
            &name,
            plan.revision,
        ) {
            Some(c) => {
                let cp = self.status.steps[c].clone();
                match cp.phase {
                    StepPhase::Running => true,
                    StepPhase::Pending => {
                        if self.due(cp.next_attempt_at.as_ref()) {
                            self.launch(
                                plan,
                                PodRole::Compactor,
                                &name,
                                plan.revision,
                                cp.attempt + 1,
                            );
                        }
                        true
                    }
                    _ => false,
                }
            }
            None => {
                let key = self.key(PodRole::Step, &name, plan.revision);
                let results = self.prior_results(plan, i, self.now);
                let summary = self.status.summary.clone();
                let identity = Identity {
                    run: self.name,
                    run_uid: self.uid,
                    step: &name,
                    role: PodRole::Step.label(),
                    attempt: 1,
                    idempotency_key: &key,
                    plan_revision: plan.revision,
                };
                let refs: Vec<PriorResult> = results
                    .iter()
                    .map(|(s, r)| PriorResult { step: s, result: r })
                    .collect();
                if context::full_size(&identity, summary.as_deref(), &refs)
                    <= self.max_context_bytes()
                {
                    return false;
                }
                self.launch(plan, PodRole::Compactor, &name, plan.revision, 1);
                true
            }
        }
    }

    pub(super) fn max_context_bytes(&self) -> usize {
        let max = self
            .run
            .spec
            .context
            .as_ref()
            .and_then(|c| c.max_bytes)
            .unwrap_or(DEFAULT_CONTEXT_BYTES);
        max.clamp(1024, MAX_CONTEXT_BYTES) as usize
    }

    /// Fresh results of the steps before `i` not yet folded into the summary.
    pub(super) fn prior_results(
        &self,
        plan: &Plan,
        i: usize,
        at: Timestamp,
    ) -> Vec<(String, Value)> {
        let compacted_before = self
            .status
            .steps
            .iter()
            .rposition(|c| c.role == StepRole::Compactor && c.phase == StepPhase::Succeeded);
        let index = CheckpointIndex::new(&self.status.steps);
        (0..i.min(plan.steps.len()))
            .filter_map(|j| {
                let c = index.effective(&self.status.steps, plan, j)?;
                if compacted_before.is_some_and(|k| c < k) {
                    return None;
                }
                let cp = &self.status.steps[c];
                let fresh = cp.fresh_until.as_ref().is_none_or(|t| t.0 > at);
                (cp.phase == StepPhase::Succeeded && fresh)
                    .then(|| cp.result.clone().map(|r| (cp.name.clone(), r)))
                    .flatten()
            })
            .collect()
    }
}
