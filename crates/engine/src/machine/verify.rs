//! Settling an unknown outcome by asking the system that was changed: when
//! an attempt of a step with `verify` may have acted, its probe runs (role
//! `verify`, the step's own idempotency key) before any person is asked.
//!
//! ```text
//!   attempt ends, may have acted ──▶ step Verifying ──▶ probe Pod (key K)
//!        Applied    ─▶ step Succeeded with the probe's result (provenance Verified)
//!        NotApplied ─▶ step retries within retry.limit, same key, approved digest (D14)
//!        Unknown, a probe that fails or times out ─▶ Reconcile Approval saying what it saw
//! ```
//!
//! One probe per step and plan revision: a second unknown outcome asks a person.

use jiff::Timestamp;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

use crate::EventType;
use crate::approval;
use crate::names::PodRole;
use crate::plan::{self, CheckpointIndex, Plan};
use crate::reasons::Reason;
use crate::result;
use agentrun_api::{CheckpointState, EffectOutcome, Provenance, StepPhase, StepRole, TokenUsage};

use super::Machine;
use super::slot::{Acted, Slot};

impl<'a> Machine<'_, 'a> {
    /// Whether step checkpoint `c` may still be settled by its probe: the
    /// step has one and has not used it at this revision.
    /// A journaled step's probe is asked once per call that may have acted.
    pub(super) fn can_verify(&self, plan: &Plan<'_>, c: usize) -> bool {
        let cp = &self.draft.status.steps[c];
        cp.role == StepRole::Step
            && self
                .step_spec(plan, &cp.name)
                .is_some_and(|s| s.verify.is_some())
            && match self.probe_of(c) {
                None => true,
                Some(v) => {
                    self.unknown_call(c).is_some() && self.draft.status.steps[v].phase.is_terminal()
                }
            }
    }

    /// The checkpoint of step checkpoint `c`'s verify probe.
    fn probe_of(&self, c: usize) -> Option<usize> {
        let cp = &self.draft.status.steps[c];
        CheckpointIndex::new(&self.draft.status.steps).at(
            &self.draft.status.steps,
            StepRole::Verify,
            &cp.name,
            cp.plan_revision,
        )
    }

    /// Step checkpoint `c` may have acted: its probe is asked first. The
    /// probe starts in the next decision, once this one is written and the
    /// attempt's Pod is gone (nothing with the key runs beside it, D2).
    pub(super) fn start_verifying(&mut self, plan: &Plan<'_>, c: usize, what_happened: String) {
        let digest = plan
            .step(&self.draft.status.steps[c].name)
            .map(|s| approval::step_digest(s, self.view.run.spec.pod_template.as_deref()));
        let cp = &mut self.draft.status.steps[c];
        let message = format!(
            "{what_happened}; it may have acted: its verify probe asks with key {}",
            cp.idempotency_key
        );
        cp.effect = Some(EffectOutcome::Unknown);
        cp.phase = StepPhase::Verifying;
        let journaled = cp.journal.as_ref().is_some_and(|j| j.unknown.is_some());
        // A retry it allows runs what it would have run now (D14).
        cp.step_digest = digest;
        cp.next_attempt_at = None;
        cp.message = Some(message.clone());
        let text = format!("step {}: {message}", cp.name);
        self.draft.recorded = true;
        self.event(EventType::Normal, Reason::StepVerifying, text);
        // A journaled step's probe answered about an earlier call: it is
        // asked again, about this one, as its next attempt.
        if journaled && let Some(v) = self.probe_of(c) {
            let p = &mut self.draft.status.steps[v];
            if p.phase.is_terminal() {
                p.phase = StepPhase::Pending;
                p.next_attempt_at = None;
                p.result = None;
                p.effect = None;
            }
        }
    }

    /// The advance of a step that is verifying: start or retry its probe.
    pub(super) fn continue_verifying(&mut self, plan: &Plan<'_>, c: usize) {
        let (name, rev) = (
            self.draft.status.steps[c].name.clone(),
            self.draft.status.steps[c].plan_revision,
        );
        let probe = CheckpointIndex::new(&self.draft.status.steps).at(
            &self.draft.status.steps,
            StepRole::Verify,
            &name,
            rev,
        );
        match probe.map(|v| self.draft.status.steps[v].clone()) {
            None => self.launch(plan, PodRole::Verify, &name, rev, 1),
            Some(v) if v.phase == StepPhase::Pending && self.due(v.next_attempt_at.as_ref()) => {
                self.launch(plan, PodRole::Verify, &name, rev, v.attempt + 1)
            }
            _ => {}
        }
    }

    /// The probe in checkpoint `v` exited 0: what it says decides.
    pub(super) fn probe_answered(
        &mut self,
        plan: &Plan<'_>,
        v: usize,
        message: Option<&str>,
        finished_at: Option<Timestamp>,
    ) {
        let attempt = self.draft.status.steps[v].attempt;
        let report = match result::parse(message) {
            Ok(r) => r,
            Err(e) => {
                let why = format!("verify attempt {attempt} returned an unusable answer: {e}");
                let tokens = result::tokens_best_effort(message);
                return self.attempt_failed(plan, Slot::Step(v), why, tokens, Acted::No);
            }
        };
        self.add_tokens(Slot::Step(v), report.tokens);
        self.draft.tally.succeeded += 1;
        let now = Time(self.view.now);
        let (name, rev) = {
            let p = &mut self.draft.status.steps[v];
            p.phase = StepPhase::Succeeded;
            p.checkpoint = CheckpointState::Committed;
            p.finished_at = Some(now.clone());
            p.pod_uid = None;
            p.effect = report.effect;
            (p.name.clone(), p.plan_revision)
        };
        let Some(c) = CheckpointIndex::new(&self.draft.status.steps).at(
            &self.draft.status.steps,
            StepRole::Step,
            &name,
            rev,
        ) else {
            return;
        };
        if self.draft.status.steps[c].phase != StepPhase::Verifying {
            return; // the run moved on (a cancel, a failure): nothing to settle
        }
        if self.settling(c) {
            return self.probe_answered_call(plan, c, report.effect, &report.result);
        }
        match report.effect {
            Some(EffectOutcome::Applied) => {
                // The probe's result stands for the attempt's: the step's
                // resultSchema judges it as it would the attempt's own (D7).
                // The attempt acted, so it fails as one that acted.
                if let Some(why) = self.probe_result_refused(plan, c, &report.result) {
                    return self.attempt_failed(
                        plan,
                        Slot::Step(c),
                        why,
                        TokenUsage::default(),
                        Acted::Yes,
                    );
                }
                let (inline, truncated) = self.cap_result(report.result);
                let finished = finished_at
                    .map(|t| super::whole_seconds(t).min(self.view.now))
                    .unwrap_or(self.view.now);
                let fresh_for = self
                    .step_spec(plan, &name)
                    .and_then(|s| plan::duration(s.fresh_for.as_ref()));
                self.attempt_ended(plan, c);
                let cp = &mut self.draft.status.steps[c];
                cp.phase = StepPhase::Succeeded;
                cp.checkpoint = CheckpointState::Committed;
                cp.effect = Some(EffectOutcome::Applied);
                cp.provenance = Some(Provenance::Verified);
                cp.result = inline;
                cp.result_truncated = truncated;
                cp.finished_at = Some(Time(finished));
                cp.fresh_until =
                    fresh_for.map(|d| Time(finished.checked_add(d).unwrap_or(Timestamp::MAX)));
                cp.message = Some(format!(
                    "its verify probe found attempt {} applied",
                    cp.attempt
                ));
                let text = format!(
                    "step {name}: its verify probe found attempt {} applied; recorded as succeeded",
                    cp.attempt
                );
                self.event(EventType::Normal, Reason::StepVerified, text);
            }
            Some(EffectOutcome::NotApplied) => {
                let (limit, backoff) = self.step_retry(plan, &name);
                let cp = &self.draft.status.steps[c];
                let (failures, attempt) = (cp.failures, cp.attempt);
                self.draft.recorded = true;
                if failures > limit {
                    let cp = &mut self.draft.status.steps[c];
                    cp.phase = StepPhase::Failed;
                    cp.checkpoint = CheckpointState::Committed;
                    cp.effect = Some(EffectOutcome::NotApplied);
                    cp.finished_at = Some(now);
                    let why = format!(
                        "its verify probe found attempt {attempt} not applied; no retries left (limit {limit})"
                    );
                    cp.message = Some(why.clone());
                    return self.step_exhausted(c, why);
                }
                let at = (failures > 0)
                    .then(|| Time(self.backoff_until(plan::backoff(backoff.as_ref(), failures))));
                let cp = &mut self.draft.status.steps[c];
                cp.phase = StepPhase::Pending;
                cp.effect = None;
                cp.next_attempt_at = at.clone();
                let when = at.map(|t| format!(" at {}", t.0)).unwrap_or_default();
                let text = format!(
                    "its verify probe found attempt {attempt} not applied; attempt {} runs with the same key{when}",
                    attempt + 1
                );
                cp.message = Some(text.clone());
                self.event(
                    EventType::Normal,
                    Reason::StepVerified,
                    format!("step {name}: {text}"),
                );
            }
            other => {
                let said = match other {
                    Some(EffectOutcome::Unknown) => "Unknown".to_owned(),
                    _ => "no effect".to_owned(),
                };
                let saw = serde_json::to_string(&report.result).unwrap_or_default();
                let saw: String = saw.chars().take(200).collect();
                let what = format!(
                    "{}; its verify probe could not tell (it answered {said}: {saw})",
                    self.draft.status.steps[c]
                        .message
                        .clone()
                        .unwrap_or_default()
                        .split("; it may have acted")
                        .next()
                        .unwrap_or_default()
                );
                self.ask_person(plan, c, what);
            }
        }
    }

    /// The probe answered about a journaled call (D19): Applied settles it
    /// with the probe's result as the call's, NotApplied settles it to be
    /// called again; anything else asks a person about the call.
    fn probe_answered_call(
        &mut self,
        plan: &Plan<'_>,
        c: usize,
        effect: Option<EffectOutcome>,
        result: &serde_json::Value,
    ) {
        match effect {
            Some(EffectOutcome::Applied) => {
                let response = serde_json::to_string(result).unwrap_or_default();
                self.settle_call(c, EffectOutcome::Applied, Some(response), "verify");
            }
            Some(EffectOutcome::NotApplied) => {
                self.settle_call(c, EffectOutcome::NotApplied, None, "verify");
            }
            other => {
                let said = match other {
                    Some(EffectOutcome::Unknown) => "Unknown",
                    _ => "no effect",
                };
                let what = format!(
                    "{}; its verify probe could not tell (it answered {said})",
                    self.draft.status.steps[c]
                        .message
                        .clone()
                        .unwrap_or_default()
                        .split("; it may have acted")
                        .next()
                        .unwrap_or_default()
                );
                self.ask_person(plan, c, what);
            }
        }
    }

    /// Why the result a verify probe found applied for plan step checkpoint
    /// `c` may not be committed: it does not match the step's `resultSchema`
    /// (a Warning Event says so at once).
    fn probe_result_refused(
        &mut self,
        plan: &Plan<'_>,
        c: usize,
        result: &serde_json::Value,
    ) -> Option<String> {
        let cp = &self.draft.status.steps[c];
        let schema = self.step_spec(plan, &cp.name)?.result_schema?;
        let e = crate::schema::mismatches(&schema, result).err()?;
        let why = format!(
            "its verify probe found attempt {} applied, with a result that does not match its resultSchema: {e}",
            cp.attempt
        );
        let name = cp.name.clone();
        self.event(
            EventType::Warning,
            Reason::ResultInvalid,
            format!("step {name}: {why}"),
        );
        Some(why)
    }

    /// The probe in checkpoint `v` failed for good: a person is asked,
    /// told what the probe ran into.
    pub(super) fn probe_gave_up(&mut self, plan: &Plan<'_>, v: usize, why: String) {
        let (name, rev) = (
            self.draft.status.steps[v].name.clone(),
            self.draft.status.steps[v].plan_revision,
        );
        let Some(c) = CheckpointIndex::new(&self.draft.status.steps).at(
            &self.draft.status.steps,
            StepRole::Step,
            &name,
            rev,
        ) else {
            return;
        };
        if self.draft.status.steps[c].phase != StepPhase::Verifying || self.failing() {
            return;
        }
        let attempt = self.draft.status.steps[c].attempt;
        self.ask_person(
            plan,
            c,
            format!("attempt {attempt} may have acted, and its verify probe failed: {why}"),
        );
    }

    /// The retry rule of a plan step, by name.
    fn step_retry(&self, plan: &Plan<'_>, name: &str) -> (i32, Option<agentrun_api::Backoff>) {
        let retry = self.step_spec(plan, name).and_then(|s| s.retry);
        (
            retry.as_ref().map_or(0, |r| r.limit.max(0)),
            retry.and_then(|r| r.backoff),
        )
    }
}
