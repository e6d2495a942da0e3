//! Starting what comes next: the planner, then every step whose dependencies
//! have committed (D4 per edge) — its `when` evaluated, an approval gate or a
//! repeat asked, a re-plan on stale input (D8, bounded), a compactor (D11), or
//! the next attempt with its stable key (D1), never beside a live one (D2) and
//! never more than `parallelism` at once.

use std::collections::{BTreeSet, HashSet};

use jiff::{SignedDuration, Timestamp};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use serde_json::Value;

use crate::EventType;
use crate::context::{self, Identity, PriorResult};
use crate::names::PodRole;
use crate::plan::{CheckpointIndex, Plan};
use crate::reasons::Reason;
use crate::when;
use agentrun_api::{
    CheckpointState, DEFAULT_CONTEXT_BYTES, DEFAULT_PARALLELISM, DEFAULT_REPLANS, EffectOutcome,
    MAX_CONTEXT_BYTES, PlanSource, RepeatedEffect, RunPhase, StepCheckpoint, StepPhase, StepRole,
    StepSpec,
};

use super::{MAX_CHECKPOINTS, Machine};

impl<'a> Machine<'_, 'a> {
    pub(super) fn advance(&mut self, plan: &Plan<'_>) {
        if self.view.run.spec.suspend {
            return;
        }
        if let Some(planner) = self.planning() {
            let rev = plan.revision;
            match self
                .draft
                .status
                .steps
                .iter()
                .position(|c| c.role == StepRole::Planner && c.plan_revision == rev)
            {
                None => self.launch(plan, PodRole::Planner, &planner.name, rev, 1),
                Some(i) => {
                    let cp = self.draft.status.steps[i].clone();
                    if cp.phase == StepPhase::Pending && self.due(cp.next_attempt_at.as_ref()) {
                        self.launch(plan, PodRole::Planner, &planner.name, rev, cp.attempt + 1);
                    }
                }
            }
            return;
        }
        let index = CheckpointIndex::new(&self.draft.status.steps);
        let mut effective: Vec<Option<usize>> = (0..plan.steps.len())
            .map(|i| index.effective(&self.draft.status.steps, plan, i))
            .collect();
        drop(index);
        let done = |m: &Self, e: &[Option<usize>], i: usize| {
            e[i].is_some_and(|c| m.draft.status.steps[c].phase.is_done())
        };
        if (0..plan.steps.len()).all(|i| done(self, &effective, i)) {
            return self.succeed_run(plan);
        }
        // Settled: done, and so is every step it comes after. A step starts
        // once the steps it depends on are settled — a step kept from an
        // earlier revision is done, but not settled while a step before it
        // runs again.
        let mut settled = vec![false; plan.steps.len()];
        for &i in &plan.order {
            if self.draft.recorded || self.failing() {
                return;
            }
            let name = plan.steps[i].name.clone();
            let ready = plan.deps[i].iter().all(|&d| settled[d]);
            // A step kept from an earlier revision that has yet to run an
            // attempt, when a step before it runs again or ran again since:
            // it joins this revision rather than run under its old key on
            // other inputs (D8). Had it acted, running it again asks a person
            // (`repeated_effect`).
            if let Some(c) = effective[i]
                && self.draft.status.steps[c].plan_revision < plan.revision
                && matches!(
                    self.draft.status.steps[c].phase,
                    StepPhase::Pending | StepPhase::WaitingForApproval | StepPhase::Waiting
                )
                && (!ready
                    || plan.ancestors(i).into_iter().any(|j| {
                        effective[j].is_some_and(|e| {
                            self.draft.status.steps[e].plan_revision
                                > self.draft.status.steps[c].plan_revision
                        })
                    }))
            {
                let cp = &mut self.draft.status.steps[c];
                cp.phase = StepPhase::Superseded;
                cp.message = Some(format!(
                    "superseded by plan revision {}: a step it comes after runs again",
                    plan.revision
                ));
                effective[i] = None;
            }
            match effective[i] {
                Some(c) => {
                    let cp = &self.draft.status.steps[c];
                    let (phase, next, rev, attempt) = (
                        cp.phase,
                        cp.next_attempt_at.clone(),
                        cp.plan_revision,
                        cp.attempt + 1,
                    );
                    match phase {
                        StepPhase::Pending if self.due(next.as_ref()) => {
                            self.launch(plan, PodRole::Step, &name, rev, attempt);
                        }
                        StepPhase::WaitingForApproval => self.wait_for_approval(plan, i, c),
                        StepPhase::Verifying => self.continue_verifying(plan, c),
                        _ => {}
                    }
                }
                None if ready => {
                    let before = self.draft.status.steps.len();
                    self.start_step(plan, i, &effective);
                    if self.draft.status.plan.as_ref().map(|p| p.revision) != Some(plan.revision) {
                        return; // re-planned: the next decision starts from the new plan
                    }
                    if self.draft.status.steps.len() > before {
                        effective[i] = CheckpointIndex::new(&self.draft.status.steps).at(
                            &self.draft.status.steps,
                            StepRole::Step,
                            &name,
                            plan.revision,
                        );
                    }
                }
                None => {}
            }
            settled[i] = ready && done(self, &effective, i);
        }
    }

    /// Whether a checkpoint's attempt runs in a Pod this decision sees live,
    /// or is being started by this decision (through the gate, on fresh
    /// inputs).
    pub(super) fn started_running(&self, cp: &StepCheckpoint) -> bool {
        let Some(pod) = cp.pod.as_deref().filter(|_| cp.phase == StepPhase::Running) else {
            return false;
        };
        self.view.pods
            .get(pod)
            .is_some_and(|p| crate::observe::is_live(p))
            || self.draft.actions.iter().any(|a| {
                matches!(a, crate::Action::CreatePod(p) if p.metadata.name.as_deref() == Some(pod))
            })
    }

    /// Whether a Pod of step `name` from a revision before `revision` is
    /// still live (being stopped after a re-plan superseded its attempt).
    fn earlier_attempt_live(&self, name: &str, revision: i64) -> bool {
        self.view.pods.values().any(|p| {
            crate::observe::is_live(p)
                && crate::observe::coords(p).is_some_and(|c| {
                    c.role == PodRole::Step && c.step == name && c.plan_revision < revision
                })
        })
    }

    /// Step Pods (steps and compactors) the run has in flight.
    pub(super) fn in_flight(&self) -> usize {
        self.draft
            .status
            .steps
            .iter()
            .filter(|c| c.phase == StepPhase::Running && c.role != StepRole::Planner)
            .count()
    }

    pub(super) fn parallelism(&self) -> usize {
        self.view
            .run
            .spec
            .parallelism
            .unwrap_or(DEFAULT_PARALLELISM)
            .max(1) as usize
    }

    pub(super) fn planning(&self) -> Option<StepSpec> {
        let plan = self.draft.status.plan.as_ref()?;
        (plan.source == PlanSource::Spec && plan.revision == 1)
            .then(|| self.view.run.spec.planner.as_deref().cloned())
            .flatten()
    }

    pub(super) fn succeed_run(&mut self, plan: &Plan) {
        self.draft.status.phase = Some(RunPhase::Succeeded);
        self.complete();
        let skipped = self
            .draft
            .status
            .steps
            .iter()
            .filter(|c| c.phase == StepPhase::Skipped && c.plan_revision == plan.revision)
            .count();
        let skipped = match skipped {
            0 => String::new(),
            n => format!(" ({n} skipped)"),
        };
        self.event(
            EventType::Normal,
            Reason::RunSucceeded,
            format!(
                "all {} steps of plan revision {} are done{skipped}",
                plan.steps.len(),
                plan.revision
            ),
        );
        if let Some(ttl) = self.view.run.spec.ttl_seconds_after_finished {
            self.draft
                .deadlines
                .push(self.at(SignedDuration::from_secs(ttl.max(0).into())));
        }
    }

    /// Step `i` has no checkpoint at this revision yet and every step it
    /// depends on is done.
    fn start_step(&mut self, plan: &Plan<'_>, i: usize, effective: &[Option<usize>]) {
        let step = plan.steps[i];
        if let Some(expr) = &step.when {
            let results: Vec<(String, &'static str, Option<Value>)> = plan.deps[i]
                .iter()
                .filter_map(|&d| {
                    let c = &self.draft.status.steps[effective[d]?];
                    let phase = if c.phase == StepPhase::Skipped {
                        "Skipped"
                    } else {
                        "Succeeded"
                    };
                    Some((c.name.clone(), phase, c.result.clone()))
                })
                .collect();
            let inputs: Vec<when::Input> = results
                .iter()
                .map(|(n, p, r)| when::Input {
                    name: n,
                    phase: p,
                    result: r.as_ref(),
                })
                .collect();
            match when::evaluate(expr, &inputs, self.view.cel) {
                Ok(true) => {}
                Ok(false) => return self.skip_step(plan, i, format!("when {expr:?} is false")),
                Err(e) => return self.when_failed(plan, i, format!("when {expr:?}: {e}")),
            }
        }
        if self.replan_if_stale(plan, i) {
            return;
        }
        // An attempt of this step from an earlier revision is still being
        // stopped: what it did is not known yet, and nothing of the step
        // starts beside it (its effect decides whether a person is asked).
        if self.earlier_attempt_live(&step.name, plan.revision) {
            return;
        }
        if step.wait.is_some() {
            return self.start_wait(plan, i);
        }
        let gated = step.approval.as_ref().is_some_and(|g| g.required);
        if !gated && self.repeated_effect(plan, i).is_none() {
            return self.launch(plan, PodRole::Step, &step.name, plan.revision, 1);
        }
        if self.compaction_blocks(plan, i) {
            return;
        }
        self.ask_approval(plan, i, None, None);
    }

    /// The earlier execution of step `i` that acted (effect Applied or
    /// Unknown) at a plan revision before `plan.revision`: running it at this
    /// revision would act again under a new key, which only a person may
    /// allow (D1, D8).
    pub(super) fn repeated_effect(&self, plan: &Plan<'_>, i: usize) -> Option<RepeatedEffect> {
        let name = &plan.steps[i].name;
        self.draft
            .status
            .steps
            .iter()
            .filter(|c| {
                c.role == StepRole::Step && c.name == *name && c.plan_revision < plan.revision
            })
            .filter_map(|c| {
                // A journaled step's journal says what it did, too, and
                // more precisely: a call answered is Applied, not Unknown.
                let journal = self.journal_effect(&c.name, c.plan_revision);
                let effect = journal
                    .filter(|e| *e == EffectOutcome::Applied)
                    .or(c.effect.filter(|e| e.acted()))
                    .or(journal)?;
                Some((c, effect))
            })
            .max_by_key(|(c, _)| c.plan_revision)
            .map(|(c, effect)| RepeatedEffect {
                idempotency_key: c.idempotency_key.clone(),
                plan_revision: c.plan_revision,
                effect,
            })
    }

    /// A new checkpoint at this revision that says the step did not run.
    fn closed_checkpoint(
        &self,
        plan: &Plan<'_>,
        i: usize,
        phase: StepPhase,
        message: String,
    ) -> StepCheckpoint {
        let name = plan.steps[i].name.clone();
        StepCheckpoint {
            idempotency_key: self.key(PodRole::Step, &name, plan.revision),
            name,
            role: StepRole::Step,
            plan_revision: plan.revision,
            attempt: 0,
            phase,
            checkpoint: CheckpointState::Committed,
            effect: Some(EffectOutcome::NotApplied),
            finished_at: Some(Time(self.view.now)),
            message: Some(message),
            ..StepCheckpoint::default()
        }
    }

    /// `when` was false: the step is skipped and the steps after it go on.
    fn skip_step(&mut self, plan: &Plan<'_>, i: usize, why: String) {
        let cp = self.closed_checkpoint(plan, i, StepPhase::Skipped, format!("skipped: {why}"));
        self.event(
            EventType::Normal,
            Reason::StepSkipped,
            format!("step {} skipped: {why}", cp.name),
        );
        self.draft.status.steps.push(cp);
    }

    /// `when` could not be evaluated: never a silent skip (D13).
    fn when_failed(&mut self, plan: &Plan<'_>, i: usize, why: String) {
        let cp = self.closed_checkpoint(plan, i, StepPhase::Failed, why.clone());
        let name = cp.name.clone();
        self.draft.status.steps.push(cp);
        self.fail_run(Reason::WhenFailed, format!("step {name}: {why}"));
    }

    /// Re-plans made so far for stale input (a planner's plan is not one).
    fn replans(&self) -> i64 {
        self.draft.status.plan.as_ref().map_or(0, |p| {
            let base = if p.source == PlanSource::Planner {
                2
            } else {
                1
            };
            (p.revision - base).max(0)
        })
    }

    /// D8: before step `i` starts, every input it consumes (the steps it
    /// comes after) must be within its freshness budget. Otherwise the run
    /// re-plans: the stale reads and the steps after them that have not acted
    /// run again at a new revision with new keys; a step that acted keeps its
    /// checkpoint, and one that would have to act again asks a person first
    /// (`repeated_effect`). Re-plans are bounded by `budget.replans`.
    pub(super) fn replan_if_stale(&mut self, plan: &Plan<'_>, i: usize) -> bool {
        let index = CheckpointIndex::new(&self.draft.status.steps);
        let effective: Vec<Option<usize>> = (0..plan.steps.len())
            .map(|j| index.effective(&self.draft.status.steps, plan, j))
            .collect();
        drop(index);
        let stale: Vec<(usize, Timestamp)> = plan
            .ancestors(i)
            .into_iter()
            .filter_map(|j| {
                let c = &self.draft.status.steps[effective[j]?];
                let until = c.fresh_until.as_ref()?;
                (c.phase == StepPhase::Succeeded && until.0 <= self.view.now)
                    .then_some((j, until.0))
            })
            .collect();
        // No timer for freshness: it only matters when a step is about to start.
        let Some(&(first, since)) = stale.first() else {
            return false;
        };
        let stale_name = plan.steps[first].name.clone();
        let replans = self.replans();
        let limit = self
            .view
            .run
            .spec
            .budget
            .as_ref()
            .and_then(|b| b.replans)
            .unwrap_or(DEFAULT_REPLANS)
            .max(0);
        if replans >= i64::from(limit) {
            self.fail_run(
                Reason::InputStale,
                format!(
                    "the result of step {stale_name} went stale at {since} and the run has re-planned {replans} times, the limit of budget.replans ({limit}): a freshFor shorter than what must happen before the steps that use it can never be met"
                ),
            );
            return true;
        }
        let stale_set: HashSet<usize> = stale.iter().map(|(j, _)| *j).collect();
        // A step whose Pod is seen running has started on inputs that were
        // fresh then: it runs on to its end at its revision. One recorded as
        // launched but never seen has not started, and must not on these.
        let running = |m: &Self, j: usize| {
            effective[j].is_some_and(|c| m.started_running(&m.draft.status.steps[c]))
        };
        let acted = |m: &Self, j: usize| {
            effective[j].is_some_and(|c| {
                let c = &m.draft.status.steps[c];
                c.phase == StepPhase::Succeeded && c.effect.is_some_and(EffectOutcome::acted)
            })
        };
        let mut rerun: BTreeSet<usize> = stale_set.iter().copied().collect();
        let mut kept: Vec<String> = Vec::new();
        for j in plan.descendants(&stale_set) {
            if acted(self, j) {
                kept.push(plan.steps[j].name.clone());
            } else if !running(self, j) {
                rerun.insert(j);
            }
        }
        // Steps this revision was still to run keep that duty.
        for (j, e) in effective.iter().enumerate() {
            if plan.runs_at_revision(j)
                && !running(self, j)
                && !e.is_some_and(|c| self.draft.status.steps[c].phase.is_done())
            {
                rerun.insert(j);
            }
        }
        let revision = plan.revision + 1;
        let kept_after = self.draft.status.steps.len() + rerun.len();
        if kept_after > MAX_CHECKPOINTS {
            self.fail_run(
                Reason::StatusBudgetExceeded,
                format!(
                    "the result of step {stale_name} went stale, but running the {} steps it affects again would keep {kept_after} checkpoints in status, more than the {MAX_CHECKPOINTS} a run may hold",
                    rerun.len()
                ),
            );
            return true;
        }
        let names: Vec<String> = plan
            .order
            .iter()
            .filter(|j| rerun.contains(j))
            .map(|&j| plan.steps[j].name.clone())
            .collect();
        let mut reason_text = format!(
            "the result of step {stale_name} went stale at {since}; at plan revision {revision} {} run again",
            names.join(", ")
        );
        if !kept.is_empty() {
            kept.sort();
            reason_text.push_str(&format!(
                "; {} acted and keep their checkpoints",
                kept.join(", ")
            ));
        }
        let superseded: Vec<usize> = (0..self.draft.status.steps.len())
            .filter(|&k| {
                let cp = &self.draft.status.steps[k];
                let rerunning = cp.role != StepRole::Step || names.contains(&cp.name);
                rerunning
                    && !cp.phase.is_terminal()
                    && !self.started_running(cp)
                    && cp.plan_revision < revision
            })
            .collect();
        for k in superseded {
            // An attempt recorded as launched whose Pod this decision does
            // not see may have been created, and started, all the same: it
            // may have acted, and the step runs again only if a person says so.
            let unseen_acting = self.draft.status.steps[k].phase == StepPhase::Running
                && self.draft.status.steps[k].role == StepRole::Step
                && plan
                    .step(&self.draft.status.steps[k].name)
                    .is_none_or(|s| s.effect != agentrun_api::Effect::None);
            let cp = &mut self.draft.status.steps[k];
            if unseen_acting {
                cp.effect = Some(EffectOutcome::Unknown);
                self.draft.actions.push(crate::Action::DeletePod {
                    name: cp.pod.clone().unwrap_or_default(),
                    reason: format!("superseded by plan revision {revision}"),
                });
            }
            cp.phase = StepPhase::Superseded;
            cp.message = Some(format!("superseded by plan revision {revision}"));
        }
        if let Some(p) = self.draft.status.plan.as_mut() {
            p.revision = revision;
            p.reason = reason_text.clone();
            p.rerun = names;
            p.rerun_from = None;
        }
        self.draft.recorded = true;
        self.draft.tally.replans += 1;
        self.event(EventType::Normal, Reason::Replanned, reason_text);
        true
    }

    /// D11: when the context of step `i` would exceed `maxBytes` and a
    /// compactor is configured, it runs first. Returns whether it blocks.
    pub(super) fn compaction_blocks(&mut self, plan: &Plan<'_>, i: usize) -> bool {
        if self
            .view
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
        let index = CheckpointIndex::new(&self.draft.status.steps);
        match index.at(
            &self.draft.status.steps,
            StepRole::Compactor,
            &name,
            plan.revision,
        ) {
            Some(c) => {
                let cp = self.draft.status.steps[c].clone();
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
                let results = self.prior_results(plan, i, self.view.now);
                let summary = self.draft.status.summary.clone();
                let identity = Identity {
                    run: self.view.name,
                    run_uid: self.view.uid,
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
            .view
            .run
            .spec
            .context
            .as_ref()
            .and_then(|c| c.max_bytes)
            .unwrap_or(DEFAULT_CONTEXT_BYTES);
        max.clamp(1024, MAX_CONTEXT_BYTES) as usize
    }

    /// Fresh results of the steps step `i` comes after, not yet folded into
    /// the summary, in the plan's order.
    pub(super) fn prior_results(
        &self,
        plan: &Plan,
        i: usize,
        at: Timestamp,
    ) -> Vec<(String, Value)> {
        let compacted_before = self
            .draft
            .status
            .steps
            .iter()
            .rposition(|c| c.role == StepRole::Compactor && c.phase == StepPhase::Succeeded);
        let index = CheckpointIndex::new(&self.draft.status.steps);
        let ancestors = if i < plan.steps.len() {
            plan.ancestors(i)
        } else {
            Vec::new()
        };
        ancestors
            .into_iter()
            .filter_map(|j| {
                let c = index.effective(&self.draft.status.steps, plan, j)?;
                if compacted_before.is_some_and(|k| c < k) {
                    return None;
                }
                let cp = &self.draft.status.steps[c];
                let fresh = cp.fresh_until.as_ref().is_none_or(|t| t.0 > at);
                (cp.phase == StepPhase::Succeeded && fresh)
                    .then(|| cp.result.clone().map(|r| (cp.name.clone(), r)))
                    .flatten()
            })
            .collect()
    }
}
