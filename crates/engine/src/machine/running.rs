//! Observing running attempts: a Pod's outcome becomes the checkpoint exactly
//! once (D3) with its three facts (D7) and its tokens (D9); a failure spends
//! the retry budget, a disruption does not (D6); timeouts count from the
//! Pod's creation.

use jiff::{SignedDuration, Timestamp};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use serde_json::Value;

use crate::conditions::TRUE;
use crate::names::PodRole;
use crate::observe::{self};
use crate::plan::{self, Plan};
use crate::reasons::{ConditionType, Reason};
use crate::result;
use crate::{Action, EventType};
use agentrun_api::{
    CheckpointState, Effect, EffectOutcome, PlanSource, PlanStatus, StepPhase, StepRole, StepSpec,
    TokenUsage,
};

use super::attempt::Record;
use super::slot::{Acted, Slot};
use super::{MAX_INLINE_RESULT, MAX_INLINE_RESULTS, Machine, timeout_text};

impl<'a> Machine<'_, 'a> {
    pub(super) fn observe_running(&mut self, plan: &Plan<'_>) {
        let steps = (0..self.draft.status.steps.len())
            .filter(|&i| self.draft.status.steps[i].phase == StepPhase::Running)
            .map(Slot::Step);
        let compensations = (0..self.draft.status.compensations.len())
            .filter(|&k| self.draft.status.compensations[k].phase == StepPhase::Running)
            .map(Slot::Compensation);
        let running: Vec<Slot> = steps.chain(compensations).collect();
        for slot in running {
            self.observe_attempt(plan, slot);
        }
    }

    /// Whether a Pod of this attempt that vanished unseen must be told apart
    /// from one never created, which costs a status write to record its UID.
    /// Only a NonIdempotent step's answer differs (a Reconcile approval
    /// instead of running again with the same key, D6). For every other step
    /// a vanished Pod is created again under the same name and key, which is
    /// what a disruption leads to anyway. The result finalizer keeps every
    /// deleted or evicted Pod visible until its outcome is committed, so only
    /// a Pod whose finalizer someone stripped can vanish at all.
    pub(super) fn may_have_acted_matters(&self, plan: &Plan<'_>, r: &Record) -> bool {
        r.role == PodRole::Step
            && self
                .step_spec(plan, &r.name)
                .is_none_or(|s| s.effect == Effect::NonIdempotent)
    }

    pub(super) fn check_timeout(&mut self, plan: &Plan<'_>, i: usize) {
        let cp = &self.draft.status.steps[i];
        let timeout = match cp.role {
            StepRole::Step => self
                .step_spec(plan, &cp.name)
                .and_then(|s| plan::duration(s.timeout.as_ref())),
            StepRole::Planner => self
                .view
                .run
                .spec
                .planner
                .as_ref()
                .and_then(|s| plan::duration(s.timeout.as_ref())),
            StepRole::Compactor => None,
            // A probe has as long as one attempt of its step.
            StepRole::Verify => self
                .step_spec(plan, &cp.name)
                .and_then(|s| plan::duration(s.timeout.as_ref())),
        };
        let (Some(timeout), Some(launched)) = (timeout, cp.started_at.as_ref()) else {
            return;
        };
        // Step time starts when the Pod exists: a Pod created late (the
        // operator died between recording the launch and creating it) is not
        // charged for the downtime. Both stamps hold whole seconds; the event
        // happened within the second after, so counting from the end of that
        // second stops an attempt at most a second late, never early.
        let created = cp
            .pod
            .as_deref()
            .and_then(|p| self.view.pods.get(p))
            .and_then(|p| p.metadata.creation_timestamp.as_ref())
            .map(|t| t.0);
        let from = created.map_or(launched.0, |c| c.max(launched.0));
        let deadline = from
            .checked_add(SignedDuration::from_secs(1))
            .and_then(|t| t.checked_add(timeout))
            .unwrap_or(Timestamp::MAX);
        if deadline > self.view.now {
            self.draft.deadlines.push(deadline);
            return;
        }
        let pod = cp.pod.clone().unwrap_or_default();
        // The Pod may have started since the cache last showed it: a
        // NonIdempotent step's timed-out attempt may have acted unless its
        // Pod is gone having never started (D6). Other steps are judged
        // by what the cache shows, for the effect they record.
        let started = self.non_idempotent(plan, i)
            || self
                .view
                .pods
                .get(pod.as_str())
                .is_none_or(|p| observe::started(p));
        let why = format!(
            "attempt {} timed out after {}",
            cp.attempt,
            timeout_text(timeout)
        );
        self.draft.actions.push(Action::DeletePod {
            name: pod.clone(),
            reason: why.clone(),
        });
        self.event(
            EventType::Warning,
            Reason::StepTimedOut,
            format!("step {}: {why}", cp.name),
        );
        self.attempt_failed(
            plan,
            Slot::Step(i),
            why,
            TokenUsage::default(),
            Acted::unless(!started),
        );
        // What the Pod reports while it stops is still recorded (D9).
        self.draft.status.steps[i].stopping = true;
    }

    pub(super) fn on_success(
        &mut self,
        plan: &Plan<'_>,
        i: usize,
        message: Option<&str>,
        finished_at: Option<Timestamp>,
    ) {
        if self.draft.status.steps[i].role == StepRole::Verify {
            return self.probe_answered(plan, i, message, finished_at);
        }
        let attempt = self.draft.status.steps[i].attempt;
        let report = match result::parse(message) {
            Ok(r) => r,
            Err(e) => {
                let why = format!("attempt {attempt} returned an unusable result: {e}");
                // Whatever tokens it reported were spent all the same (D9).
                let tokens = result::tokens_best_effort(message);
                return self.attempt_failed(plan, Slot::Step(i), why, tokens, Acted::Maybe);
            }
        };
        self.count_journal_at_end(plan, i, report.journal_tokens);
        let role = self.draft.status.steps[i].role;
        if let Some(why) = self.result_refused(plan, i, &report) {
            let acted = match (role, report.effect) {
                (StepRole::Step, None | Some(EffectOutcome::Applied)) => Acted::Yes,
                (StepRole::Step, Some(EffectOutcome::Unknown)) => Acted::Maybe,
                _ => Acted::No,
            };
            return self.attempt_failed(plan, Slot::Step(i), why, report.tokens, acted);
        }
        let planned = match role {
            StepRole::Planner => {
                match super::super::planner::parse_planner_plan(
                    report.plan.as_ref(),
                    &self.view.run.spec.steps,
                ) {
                    Ok(steps) => Some(steps),
                    Err(e) => {
                        // An invalid plan is a failed attempt: retried within
                        // `retry.limit`, then the run fails for that reason.
                        let name = self.draft.status.steps[i].name.clone();
                        let why = format!("attempt {attempt} returned an invalid plan: {e}");
                        self.attempt_failed(plan, Slot::Step(i), why, report.tokens, Acted::No);
                        if self.draft.status.steps[i].phase == StepPhase::Failed {
                            self.set_condition(
                                ConditionType::FailureTarget,
                                TRUE,
                                Reason::InvalidPlan,
                                format!("planner {name}: {e}"),
                            );
                        }
                        return;
                    }
                }
            }
            _ => None,
        };
        self.add_tokens(Slot::Step(i), report.tokens);
        let spec = match role {
            StepRole::Step => self.step_spec(plan, &self.draft.status.steps[i].name),
            StepRole::Planner => self.view.run.spec.planner.as_deref().cloned(),
            StepRole::Compactor | StepRole::Verify => None,
        };
        let (inline, truncated) = self.cap_result(report.result);
        self.draft.tally.succeeded += 1;
        if role == StepRole::Step {
            self.attempt_ended(plan, i);
        }
        // D8: a result is as old as the container's finish, not as the
        // moment the operator noticed (it may have been down meanwhile).
        let finished = finished_at
            .map(|t| super::whole_seconds(t).min(self.view.now))
            .unwrap_or(self.view.now);
        let cp = &mut self.draft.status.steps[i];
        cp.phase = StepPhase::Succeeded;
        cp.checkpoint = CheckpointState::Committed;
        cp.finished_at = Some(Time(finished));
        cp.pod_uid = None;
        cp.next_attempt_at = None;
        cp.result = inline;
        cp.result_truncated = truncated;
        // What the step waited for or went through no longer holds.
        cp.message = None;
        if role == StepRole::Step {
            let declared = spec.as_ref().map_or(Effect::NonIdempotent, |s| s.effect);
            cp.effect = Some(match (declared, report.effect, cp.effect) {
                (Effect::None, _, _) => EffectOutcome::NotApplied,
                // An earlier attempt may have acted; this one saying it did
                // not (under the same key) does not undo that.
                (_, Some(EffectOutcome::NotApplied), Some(EffectOutcome::Unknown)) => {
                    EffectOutcome::Unknown
                }
                (_, Some(said), _) => said,
                (_, None, _) => EffectOutcome::Applied,
            });
        }
        let fresh_for = spec
            .as_ref()
            .and_then(|s| plan::duration(s.fresh_for.as_ref()));
        cp.fresh_until = fresh_for.map(|d| Time(finished.checked_add(d).unwrap_or(Timestamp::MAX)));
        let name = cp.name.clone();
        let attempt = cp.attempt;
        if truncated && role == StepRole::Step {
            // D11 keeps status small; D16 says so where people look.
            let why = format!(
                "its result was not kept: a run keeps at most {} KiB of step results inline (and {} KiB per step); later steps, the compactor and its compensation do not receive it",
                MAX_INLINE_RESULTS / 1024,
                MAX_INLINE_RESULT / 1024
            );
            cp.message = Some(format!("succeeded on attempt {attempt}; {why}"));
            self.event(
                EventType::Warning,
                Reason::ResultNotKept,
                format!("step {name}: {why}"),
            );
        }
        match role {
            StepRole::Step => self.event(
                EventType::Normal,
                Reason::StepSucceeded,
                format!("step {name} succeeded on attempt {attempt}"),
            ),
            StepRole::Compactor => {
                // A compactor that returns no summary keeps the one there was.
                if report.summary.is_some() {
                    self.draft.status.summary = report.summary;
                }
                self.event(
                    EventType::Normal,
                    Reason::ContextCompacted,
                    format!("context compacted before step {name}"),
                );
            }
            StepRole::Planner => {
                // The new plan is resolved and started by the next decision.
                self.draft.recorded = true;
                self.adopt_plan(&name, planned.unwrap_or_default());
            }
            StepRole::Verify => {} // answered above
        }
    }

    /// Keeps the result inline only within the per-step and per-run caps (D11).
    pub(super) fn cap_result(&self, result: Value) -> (Option<Value>, bool) {
        if result.is_null() {
            return (None, false);
        }
        let size = serde_json::to_string(&result).map_or(usize::MAX, |s| s.len());
        let used: usize = self
            .draft
            .status
            .steps
            .iter()
            .filter_map(|c| c.result.as_ref())
            .map(|r| serde_json::to_string(r).map_or(0, |s| s.len()))
            .sum();
        if size > MAX_INLINE_RESULT || used + size > MAX_INLINE_RESULTS {
            (None, true)
        } else {
            (Some(result), false)
        }
    }

    pub(super) fn adopt_plan(&mut self, planner: &str, steps: Vec<StepSpec>) {
        let revision = self.draft.status.plan.as_ref().map_or(1, |p| p.revision) + 1;
        let names: Vec<String> = steps.iter().map(|s| s.name.clone()).collect();
        let message = format!(
            "plan revision {revision} from planner {planner}: {} steps",
            names.len()
        );
        self.draft.status.plan = Some(PlanStatus {
            revision,
            reason: format!("plan from planner {planner}"),
            source: PlanSource::Planner,
            step_names: names,
            steps,
            rerun: Vec::new(),
            rerun_from: None,
        });
        self.event(EventType::Normal, Reason::PlanAdopted, message);
    }

    /// Records what a failed attempt of plan step checkpoint `i` did, unless
    /// the step declares no effect (D7: a failure never hides an effect). An
    /// attempt that ended without saying it did not act (timed out, exited 0
    /// with an unusable result, non-zero without `NotApplied`) may have
    /// acted: `Unknown`, and a compensation covers it. One that reported its
    /// effect and then failed another way: `Applied`.
    pub(super) fn record_effect(&mut self, plan: &Plan<'_>, i: usize, outcome: EffectOutcome) {
        if self.draft.status.steps[i].role != StepRole::Step {
            return;
        }
        let effect = self
            .step_spec(plan, &self.draft.status.steps[i].name)
            .map_or(Effect::NonIdempotent, |s| s.effect);
        if effect != Effect::None {
            self.draft.status.steps[i].effect = Some(outcome);
        }
    }

    /// A step, planner or compactor failed with no retries left: its
    /// checkpoint is final, and the run fails unless it was the compactor.
    pub(super) fn step_exhausted(&mut self, i: usize, message: String) {
        let cp = &mut self.draft.status.steps[i];
        cp.checkpoint = CheckpointState::Committed;
        if cp.role == StepRole::Step && cp.effect.is_none() {
            cp.effect = Some(EffectOutcome::NotApplied);
        }
        let (role, name) = (cp.role, cp.name.clone());
        if role == StepRole::Compactor {
            // Without a summary the oldest results are simply left out.
            self.event(
                EventType::Warning,
                Reason::StepFailed,
                format!("compactor before {name}: {message}"),
            );
        } else if !self.failing() {
            self.fail_run(Reason::StepFailed, format!("step {name}: {message}"));
        }
    }

    /// Why a successful attempt's result may not be committed: it does not
    /// match the step's `resultSchema` (a Warning Event says so at once, the
    /// attempt's message keeps it).
    fn result_refused(
        &mut self,
        plan: &Plan<'_>,
        i: usize,
        report: &result::StepReport,
    ) -> Option<String> {
        let cp = &self.draft.status.steps[i];
        let spec = match cp.role {
            StepRole::Step => self.step_spec(plan, &cp.name),
            StepRole::Planner => self.view.run.spec.planner.as_deref().cloned(),
            StepRole::Compactor | StepRole::Verify => None,
        };
        let schema = spec?.result_schema?;
        let e = crate::schema::mismatches(&schema, &report.result).err()?;
        let why = format!(
            "attempt {} returned a result that does not match its resultSchema: {e}",
            cp.attempt
        );
        let what = self.record(Slot::Step(i)).what();
        self.event(
            EventType::Warning,
            Reason::ResultInvalid,
            format!("{what}: {why}"),
        );
        Some(why)
    }

    /// Whether plan step checkpoint `i` is a NonIdempotent step's.
    pub(super) fn non_idempotent(&self, plan: &Plan<'_>, i: usize) -> bool {
        self.draft.status.steps[i].role == StepRole::Step
            && self
                .step_spec(plan, &self.draft.status.steps[i].name)
                .is_none_or(|s| s.effect == Effect::NonIdempotent)
    }

    /// An attempt of plan step checkpoint `i` ended. A step without an
    /// approval gate was bound to a digest only for the attempt a Reconcile
    /// answer released (D14): the next one is not.
    pub(super) fn attempt_ended(&mut self, plan: &Plan<'_>, i: usize) {
        let gated = self
            .step_spec(plan, &self.draft.status.steps[i].name)
            .and_then(|s| s.approval)
            .is_some_and(|g| g.required);
        if !gated {
            self.draft.status.steps[i].step_digest = None;
        }
    }

    /// A disrupted step, after `disrupted` counted it: a NonIdempotent step
    /// that may have acted asks a person instead of running again (D6); any
    /// other runs again with the same key, after a backoff once disrupted
    /// again; a step disrupted over and over says so (D16).
    pub(super) fn step_disrupted(&mut self, plan: &Plan<'_>, i: usize, why: &str, started: bool) {
        let effect = match self.draft.status.steps[i].role {
            StepRole::Step => self
                .step_spec(plan, &self.draft.status.steps[i].name)
                .map_or(Effect::NonIdempotent, |s| s.effect),
            _ => Effect::None,
        };
        if self.draft.status.steps[i].role == StepRole::Step {
            self.attempt_ended(plan, i);
        }
        let attempt = self.draft.status.steps[i].attempt;
        if started && effect != Effect::None && self.draft.status.steps[i].role == StepRole::Step {
            // It may have acted before it was stopped.
            self.draft.status.steps[i].effect = Some(EffectOutcome::Unknown);
        }
        if self.failing() {
            let now = Time(self.view.now);
            let cp = &mut self.draft.status.steps[i];
            cp.phase = StepPhase::Failed;
            cp.checkpoint = CheckpointState::Committed;
            cp.finished_at = Some(now);
            if cp.role == StepRole::Step && cp.effect.is_none() {
                cp.effect = Some(EffectOutcome::NotApplied);
            }
            cp.message = Some(format!(
                "attempt {attempt} was disrupted ({why}); not run again: the run is failing"
            ));
            return;
        }
        if effect == Effect::NonIdempotent
            && started
            && self.unrecorded_call_may_have_acted(plan, i)
        {
            return self.ask_reconcile(
                plan,
                i,
                format!("attempt {attempt} was disrupted ({why}) after it started"),
            );
        }
        let at = self.disruption_backoff(plan, Slot::Step(i));
        let cp = &mut self.draft.status.steps[i];
        let disruptions = cp.disruptions;
        let when = match &at {
            Some(t) => format!(" at {}", t.0),
            None => String::new(),
        };
        let message = format!(
            "attempt {attempt} was disrupted ({why}); it runs again with the same key{when}"
        );
        cp.phase = StepPhase::Pending;
        cp.next_attempt_at = at;
        cp.message = Some(message.clone());
        let text = format!("step {}: {message}", cp.name);
        if disruptions >= super::STALL_AFTER_DISRUPTIONS {
            self.event(
                EventType::Warning,
                Reason::RepeatedlyDisrupted,
                format!("{text}; disrupted {disruptions} times"),
            );
        } else {
            self.event(EventType::Normal, Reason::StepDisrupted, text);
        }
    }
}
