//! One attempt, whatever it is for: a step, the planner, a compactor or a
//! compensation. Where its record lives in status (`Slot`), how it starts
//! (`launch`, through the gate), the Pod it runs as (built from status alone,
//! so creating it again after a crash creates the same Pod), how its Pod's
//! outcome is read exactly once (D3) with its tokens (D9), and the one retry
//! rule: a failure spends the retry budget, a disruption does not (D6).
//!
//! What differs by role is dispatched from here: a step's result, effect and
//! Reconcile question to `running`, a compensation's outcome to `saga`.

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use serde_json::Value;

use crate::EventType;
use crate::context::{self, Identity, PriorResult};
use crate::names::{self, PodRole};
use crate::observe::{self, Observation};
use crate::plan::{self, CheckpointIndex, Plan};
use crate::pods::{self, PodRequest};
use crate::reasons::Reason;
use crate::result;
use agentrun_api::{
    CompensationCheckpoint, EffectOutcome, MAX_CONTEXT_BYTES, StepCheckpoint, StepContainer,
    StepPhase, StepRole, TokenUsage,
};

use super::slot::{Acted, Slot, Start};
use super::{Machine, timeout_text};

impl Acted {
    /// `Maybe` unless `not` says otherwise.
    pub fn unless(not: bool) -> Acted {
        if not { Acted::No } else { Acted::Maybe }
    }
}

/// What identifies an attempt and its Pod, copied out of its record.
#[derive(Clone, Debug)]
pub(super) struct Record {
    pub role: PodRole,
    pub name: String,
    pub plan_revision: i64,
    pub attempt: i32,
    pub idempotency_key: String,
    pub pod: Option<String>,
    pub pod_uid: Option<String>,
    pub started_at: Option<Time>,
}

impl Record {
    /// How Events and messages name the attempt's step.
    pub fn what(&self) -> String {
        let name = &self.name;
        match self.role {
            PodRole::Step => format!("step {name}"),
            PodRole::Planner => format!("planner {name}"),
            PodRole::Compactor => format!("compactor before step {name}"),
            PodRole::Compensate => format!("compensation of step {name}"),
            PodRole::Verify => format!("verify probe of step {name}"),
        }
    }
}

/// The facts every attempt record holds, borrowed from a step's checkpoint
/// or a compensation's.
pub(super) struct Facts<'c> {
    pub attempt: &'c mut i32,
    pub pod: &'c mut Option<String>,
    pub pod_uid: &'c mut Option<String>,
    pub phase: &'c mut StepPhase,
    pub started_at: &'c mut Option<Time>,
    pub finished_at: &'c mut Option<Time>,
    pub next_attempt_at: &'c mut Option<Time>,
    pub failures: &'c mut i32,
    pub disruptions: &'c mut i32,
    pub tokens: &'c mut Option<TokenUsage>,
    pub message: &'c mut Option<String>,
}

trait AttemptRecord {
    fn facts(&mut self) -> Facts<'_>;
    fn record(&self) -> Record;
}

/// Both kinds of checkpoint hold the same attempt fields under the same names.
macro_rules! attempt_record {
    ($ty:ty, $role:expr) => {
        impl AttemptRecord for $ty {
            fn facts(&mut self) -> Facts<'_> {
                Facts {
                    attempt: &mut self.attempt,
                    pod: &mut self.pod,
                    pod_uid: &mut self.pod_uid,
                    phase: &mut self.phase,
                    started_at: &mut self.started_at,
                    finished_at: &mut self.finished_at,
                    next_attempt_at: &mut self.next_attempt_at,
                    failures: &mut self.failures,
                    disruptions: &mut self.disruptions,
                    tokens: &mut self.tokens,
                    message: &mut self.message,
                }
            }

            fn record(&self) -> Record {
                #[allow(clippy::redundant_closure_call)]
                Record {
                    role: ($role)(self),
                    name: self.name.clone(),
                    plan_revision: self.plan_revision,
                    attempt: self.attempt,
                    idempotency_key: self.idempotency_key.clone(),
                    pod: self.pod.clone(),
                    pod_uid: self.pod_uid.clone(),
                    started_at: self.started_at.clone(),
                }
            }
        }
    };
}

attempt_record!(StepCheckpoint, |c: &StepCheckpoint| PodRole::from(c.role));
attempt_record!(CompensationCheckpoint, |_: &CompensationCheckpoint| {
    PodRole::Compensate
});

impl<'a> Machine<'_, 'a> {
    pub(super) fn facts(&mut self, slot: Slot) -> Facts<'_> {
        match slot {
            Slot::Step(i) => self.draft.status.steps[i].facts(),
            Slot::Compensation(k) => self.draft.status.compensations[k].facts(),
        }
    }

    pub(super) fn record(&self, slot: Slot) -> Record {
        match slot {
            Slot::Step(i) => self.draft.status.steps[i].record(),
            Slot::Compensation(k) => self.draft.status.compensations[k].record(),
        }
    }

    /// The record of `role`'s attempts at `name` in plan revision `rev`.
    pub(super) fn slot(&self, role: PodRole, name: &str, rev: i64) -> Option<Slot> {
        match role.step_role() {
            None => self
                .draft
                .status
                .compensations
                .iter()
                .position(|c| c.name == name && c.plan_revision == rev)
                .map(Slot::Compensation),
            Some(role) => CheckpointIndex::new(&self.draft.status.steps)
                .at(&self.draft.status.steps, role, name, rev)
                .map(Slot::Step),
        }
    }

    /// The record for a first attempt, added to status.
    fn open(&mut self, role: PodRole, name: &str, rev: i64, key: String) -> Slot {
        match role.step_role() {
            None => {
                self.draft
                    .status
                    .compensations
                    .push(CompensationCheckpoint {
                        name: name.to_owned(),
                        plan_revision: rev,
                        idempotency_key: key,
                        ..CompensationCheckpoint::default()
                    });
                Slot::Compensation(self.draft.status.compensations.len() - 1)
            }
            Some(role) => {
                self.draft.status.steps.push(StepCheckpoint {
                    name: name.to_owned(),
                    role,
                    plan_revision: rev,
                    idempotency_key: key,
                    ..StepCheckpoint::default()
                });
                Slot::Step(self.draft.status.steps.len() - 1)
            }
        }
    }

    /// Starts attempt `attempt` of `role` at `name` in plan revision `rev`
    /// if the launch gate lets it: records the intent in status and emits
    /// the Pod, which the controller creates once that status is written
    /// (D1, D2, D4).
    pub(super) fn launch(
        &mut self,
        plan: &Plan<'_>,
        role: PodRole,
        name: &str,
        rev: i64,
        attempt: i32,
    ) {
        let key = self.key(role, name, rev);
        let start = Start::New {
            role,
            name,
            rev,
            key: &key,
        };
        if self.gate(plan, start).is_err() {
            return;
        }
        let slot = match self.slot(role, name, rev) {
            Some(slot) => slot,
            None => self.open(role, name, rev, key),
        };
        let pod = names::pod_name(self.view.name, self.view.uid, role, name, rev, attempt);
        let now = Time(self.view.now);
        let f = self.facts(slot);
        *f.attempt = attempt;
        *f.pod = Some(pod.clone());
        *f.pod_uid = None;
        *f.phase = StepPhase::Running;
        *f.started_at = Some(now);
        *f.next_attempt_at = None;
        match slot {
            Slot::Step(i) => self.draft.status.steps[i].pod_recreated = false,
            Slot::Compensation(k) => self.draft.status.compensations[k].pod_recreated = false,
        }
        if role != PodRole::Compensate {
            self.draft.status.step_executions = self.draft.status.step_executions.saturating_add(1);
        }
        self.draft.tally.started += 1;
        // A new attempt has a new name: nothing was refused for it yet.
        self.emit_pod(plan, slot);
        let (reason, what) = match role {
            PodRole::Compensate => (
                Reason::CompensationStarted,
                format!("compensating step {name} (plan revision {rev})"),
            ),
            _ => (Reason::StepStarted, self.record(slot).what()),
        };
        self.event(
            EventType::Normal,
            reason,
            format!("{what}: attempt {attempt} as Pod {pod}"),
        );
    }

    /// The Pod of a record's current attempt, rebuilt deterministically from
    /// status: the context as of the attempt's start.
    pub(super) fn attempt_pod(&self, plan: &Plan<'_>, slot: Slot) -> Option<Pod> {
        let r = self.record(slot);
        let at = r.started_at.as_ref().map_or(self.view.now, |t| t.0);
        let i = plan
            .steps
            .iter()
            .position(|s| s.name == r.name)
            .unwrap_or(plan.steps.len());
        let summary = self.draft.status.summary.as_deref();
        let (container, results, summary, max): (StepContainer, Vec<(String, Value)>, _, usize) =
            match r.role {
                PodRole::Step => (
                    self.step_spec(plan, &r.name)?.container?,
                    self.prior_results(plan, i, at),
                    summary,
                    self.max_context_bytes(),
                ),
                PodRole::Planner => (
                    self.view.run.spec.planner.as_ref()?.container.clone()?,
                    Vec::new(),
                    summary,
                    self.max_context_bytes(),
                ),
                PodRole::Compactor => (
                    self.view.run.spec.context.as_ref()?.compactor.clone()?,
                    self.prior_results(plan, i, at),
                    summary,
                    MAX_CONTEXT_BYTES as usize,
                ),
                // A probe sees what the step saw; its key is the step's.
                PodRole::Verify => (
                    *self.step_spec(plan, &r.name)?.verify?,
                    self.prior_results(plan, i, at),
                    summary,
                    self.max_context_bytes(),
                ),
                // A compensation sees the result of the step it undoes.
                PodRole::Compensate => (
                    *self.step_spec(plan, &r.name)?.compensate?,
                    self.draft
                        .status
                        .steps
                        .iter()
                        .find(|c| {
                            c.role == StepRole::Step
                                && c.name == r.name
                                && c.plan_revision == r.plan_revision
                        })
                        .and_then(|c| c.result.clone())
                        .map(|v| (r.name.clone(), v))
                        .into_iter()
                        .collect(),
                    None,
                    self.max_context_bytes(),
                ),
            };
        let refs: Vec<PriorResult> = results
            .iter()
            .map(|(s, r)| PriorResult { step: s, result: r })
            .collect();
        let identity = Identity {
            run: self.view.name,
            run_uid: self.view.uid,
            step: &r.name,
            role: r.role.label(),
            attempt: r.attempt,
            idempotency_key: &r.idempotency_key,
            plan_revision: r.plan_revision,
        };
        let ctx = context::materialise(&identity, summary, &refs, max);
        Some(pods::build(PodRequest {
            name: names::pod_name(
                self.view.name,
                self.view.uid,
                r.role,
                &r.name,
                r.plan_revision,
                r.attempt,
            ),
            namespace: self.view.run.metadata.namespace.clone(),
            owner: self.owner(),
            run: self.view.name,
            step: &r.name,
            role: r.role,
            plan_revision: r.plan_revision,
            attempt: r.attempt,
            idempotency_key: &r.idempotency_key,
            container: &container,
            defaults: self.view.run.spec.pod_template.as_deref(),
            context_json: ctx.json,
            step_digest: (r.role == PodRole::Step)
                .then(|| self.step_spec(plan, &r.name))
                .flatten()
                .map(|s| {
                    crate::approval::step_digest(&s, self.view.run.spec.pod_template.as_deref())
                }),
            journal: (r.role == PodRole::Step)
                .then(|| self.journal_spec(plan, &r.name))
                .flatten()
                .map(|j| crate::pods::JournalPod {
                    prefix: names::journal_prefix(
                        self.view.name,
                        self.view.uid,
                        &r.name,
                        r.plan_revision,
                    ),
                    max_bytes: j.max_bytes(),
                }),
            call: (r.role == PodRole::Verify)
                .then(|| self.slot(PodRole::Step, &r.name, r.plan_revision))
                .flatten()
                .and_then(|slot| match slot {
                    Slot::Step(c) => self.unknown_call(c).cloned(),
                    Slot::Compensation(_) => None,
                }),
        }))
    }

    /// Reads the Pod of a running attempt and records its outcome, once.
    pub(super) fn observe_attempt(&mut self, plan: &Plan<'_>, slot: Slot) {
        let r = self.record(slot);
        let pod = self.view.pods.get(r.pod.as_deref().unwrap_or("")).copied();
        match observe::observe(pod, r.pod_uid.as_deref()) {
            // Intent is in status; the create may not have happened (a crash
            // between the write and the create) or the cache may lag.
            // Create-if-absent makes repeating it safe, but a create made now
            // starts the attempt now: the gate decides, once the run limits
            // are checked (`create_unseen`).
            Observation::NotSeen => self.draft.unseen.push(slot),
            Observation::Live { uid } => {
                self.keep_pod_uid(plan, slot, &r, uid);
                if let Slot::Step(i) = slot {
                    self.check_timeout(plan, i);
                }
            }
            Observation::Terminating { uid } => {
                self.keep_pod_uid(plan, slot, &r, uid);
                self.watch_stopping_pod(&r, pod);
            }
            Observation::Succeeded {
                message,
                finished_at,
            } => match slot {
                Slot::Step(i) => self.on_success(plan, i, message.as_deref(), finished_at),
                Slot::Compensation(k) => self.compensation_succeeded(plan, k, message.as_deref()),
            },
            Observation::Failed {
                exit_code,
                reason,
                message,
            } => {
                let tokens = result::tokens_best_effort(message.as_deref());
                if let Slot::Step(i) = slot {
                    let journal = result::journal_tokens_best_effort(message.as_deref());
                    self.count_journal_at_end(plan, i, journal);
                }
                // What the step said about it, where it said something.
                let said = result::failure_reason(message.as_deref())
                    .map(|t| format!(": {t}"))
                    .unwrap_or_default();
                // D6: only an attempt that says so in its result did not act.
                let not_applied =
                    result::reported_effect(message.as_deref()) == Some(EffectOutcome::NotApplied);
                let reported = if not_applied {
                    "; it reported NotApplied"
                } else {
                    ""
                };
                let why = format!(
                    "attempt {} exited with code {exit_code} ({reason}){said}{reported}",
                    r.attempt
                );
                self.attempt_failed(plan, slot, why, tokens, Acted::unless(not_applied));
            }
            Observation::Disrupted {
                reason,
                started,
                message,
            } => {
                let tokens = result::tokens_best_effort(message.as_deref());
                self.disrupted(plan, slot, &reason, started, tokens);
            }
            Observation::Vanished => {
                self.disrupted(plan, slot, "its Pod vanished", true, TokenUsage::default());
            }
        }
    }

    /// A Pod being deleted is awaited until it stops (D2: nothing else with
    /// its key starts before). Past its grace period it is on a lost or stuck
    /// node: the run says so (D16) and goes on waiting.
    fn watch_stopping_pod(&mut self, r: &Record, pod: Option<&Pod>) {
        let Some(gone_by) = pod.and_then(|p| p.metadata.deletion_timestamp.as_ref()) else {
            return;
        };
        if gone_by.0 > self.view.now {
            self.draft.deadlines.push(gone_by.0);
            return;
        }
        let name = r.pod.clone().unwrap_or_default();
        self.draft.stalled = Some((
            Reason::PodNotStopping,
            format!(
                "{}: Pod {name} was to stop by {} and still runs (a lost or stuck node?); attempt {} waits until it has",
                r.what(),
                gone_by.0,
                r.attempt + 1
            ),
        ));
    }

    /// Records the UID of a seen Pod where telling a vanished Pod from one
    /// never created changes the answer (see `may_have_acted_matters`).
    fn keep_pod_uid(&mut self, plan: &Plan<'_>, slot: Slot, r: &Record, uid: Option<String>) {
        let recreated = match slot {
            Slot::Step(i) => self.draft.status.steps[i].pod_recreated,
            Slot::Compensation(k) => self.draft.status.compensations[k].pod_recreated,
        };
        if r.pod_uid.is_none()
            && uid.is_some()
            && (recreated || self.may_have_acted_matters(plan, r))
        {
            *self.facts(slot).pod_uid = uid;
        }
    }

    pub(super) fn add_tokens(&mut self, slot: Slot, t: TokenUsage) {
        if t.total() == 0 {
            return;
        }
        let f = self.facts(slot);
        let mut sum = f.tokens.unwrap_or_default();
        sum.input = sum.input.saturating_add(t.input);
        sum.output = sum.output.saturating_add(t.output);
        *f.tokens = Some(sum);
        self.draft.status.tokens_used = self.draft.status.tokens_used.saturating_add(t.total());
        self.draft.tally.tokens += t.total().max(0) as u64;
    }

    /// The retry rule of a record: a compensation retries as its step does;
    /// a verify probe has `MAX_VERIFY_FAILURES` failures and its step's backoff.
    fn retry_rule(&self, plan: &Plan<'_>, r: &Record) -> (i32, Option<agentrun_api::Backoff>) {
        let spec = match r.role {
            PodRole::Step | PodRole::Compensate => self.step_spec(plan, &r.name),
            PodRole::Planner => self.view.run.spec.planner.as_deref().cloned(),
            PodRole::Compactor => None,
            PodRole::Verify => {
                let backoff = self
                    .step_spec(plan, &r.name)
                    .and_then(|s| s.retry)
                    .and_then(|r| r.backoff);
                return (super::MAX_VERIFY_FAILURES - 1, backoff);
            }
        };
        let retry = spec.and_then(|s| s.retry);
        (
            retry.as_ref().map_or(0, |r| r.limit.max(0)),
            retry.and_then(|r| r.backoff),
        )
    }

    /// A failed attempt (exit code, timeout, bad result, a Pod the API
    /// server refuses) spends the retry budget: retried after its backoff,
    /// never early (see `backoff_until`), or past `retry.limit` failed for
    /// good. `Acted::Maybe`: the attempt ended without saying it did not act
    /// (a timeout, a non-zero exit without `"effect": "NotApplied"`, an
    /// unreadable result), so a step's effect is `Unknown` (D7), a
    /// compensation covers it, and a NonIdempotent step is retried only once
    /// a person answered the Reconcile question (D6). `Acted::Yes`: the
    /// effect is `Applied`, and a NonIdempotent step is not retried at all.
    pub(super) fn attempt_failed(
        &mut self,
        plan: &Plan<'_>,
        slot: Slot,
        why: String,
        tokens: TokenUsage,
        acted: Acted,
    ) {
        self.draft.tally.failed += 1;
        self.add_tokens(slot, tokens);
        if let Slot::Step(i) = slot {
            match acted {
                Acted::No => {}
                Acted::Maybe => self.record_effect(plan, i, EffectOutcome::Unknown),
                Acted::Yes => self.record_effect(plan, i, EffectOutcome::Applied),
            }
        }
        let r = self.record(slot);
        let (limit, backoff) = self.retry_rule(plan, &r);
        let f = self.facts(slot);
        let failures = *f.failures + 1;
        *f.failures = failures;
        *f.pod_uid = None;
        self.draft.recorded = true;
        if let Slot::Step(i) = slot {
            self.attempt_ended(plan, i);
        }
        // A failing run retries nothing: what ran is recorded, then it winds down.
        if failures > limit || (self.failing() && r.role != PodRole::Compensate) {
            let message = if failures > limit {
                format!("{why}; no retries left (limit {limit})")
            } else {
                format!("{why}; not retried: the run is failing")
            };
            return self.failed_for_good(plan, slot, &why, message);
        }
        if let Slot::Step(i) = slot
            && self.non_idempotent(plan, i)
        {
            match acted {
                Acted::No => {}
                // A journaled step's journal says whether it may have.
                Acted::Maybe if self.unrecorded_call_may_have_acted(plan, i) => {
                    return self.ask_reconcile(plan, i, why);
                }
                Acted::Maybe => {}
                Acted::Yes => {
                    let message =
                        format!("{why}; not retried: its NonIdempotent effect was applied");
                    return self.failed_for_good(plan, slot, &why, message);
                }
            }
        }
        let delay = plan::backoff(backoff.as_ref(), failures);
        let at = Time(self.backoff_until(delay));
        let message = format!(
            "{why}; retry {failures} of {limit} after {}",
            timeout_text(delay)
        );
        let f = self.facts(slot);
        *f.phase = StepPhase::Pending;
        *f.next_attempt_at = Some(at);
        *f.message = Some(message.clone());
        if let Slot::Step(_) = slot {
            self.event(
                EventType::Warning,
                Reason::StepRetrying,
                format!("step {}: {message}", r.name),
            );
        }
    }

    /// The last attempt of a record failed: its record is final, and a
    /// step's run fails (see `step_exhausted`).
    fn failed_for_good(&mut self, plan: &Plan<'_>, slot: Slot, why: &str, message: String) {
        let r = self.record(slot);
        let now = Time(self.view.now);
        let f = self.facts(slot);
        *f.phase = StepPhase::Failed;
        *f.finished_at = Some(now);
        *f.next_attempt_at = None;
        *f.message = Some(message.clone());
        match slot {
            Slot::Step(i) if r.role == PodRole::Verify => self.probe_gave_up(plan, i, message),
            Slot::Step(i) => self.step_exhausted(i, message),
            Slot::Compensation(_) => self.event(
                EventType::Warning,
                Reason::CompensationFailed,
                format!("{}: {why}", r.what()),
            ),
        }
    }

    /// A disrupted attempt (evicted, preempted, its node lost, its Pod
    /// vanished) does not spend the retry budget (D6); what follows depends
    /// on the role: a step may have acted (see `step_disrupted`), a
    /// compensation is meant to be repeatable and runs again. Either backs
    /// off once disrupted again (the retry backoff, capped), so a Pod evicted
    /// over and over is not re-created in a hot loop.
    pub(super) fn disrupted(
        &mut self,
        plan: &Plan<'_>,
        slot: Slot,
        why: &str,
        started: bool,
        tokens: TokenUsage,
    ) {
        self.draft.tally.disrupted += 1;
        self.add_tokens(slot, tokens);
        let f = self.facts(slot);
        *f.disruptions += 1;
        *f.pod_uid = None;
        *f.next_attempt_at = None;
        self.draft.recorded = true;
        match slot {
            Slot::Step(i) => self.step_disrupted(plan, i, why, started),
            Slot::Compensation(k) => {
                let at = self.disruption_backoff(plan, slot);
                let c = &mut self.draft.status.compensations[k];
                c.phase = StepPhase::Pending;
                c.next_attempt_at = at.clone();
                c.message = Some(format!(
                    "attempt {} was disrupted; it runs again with the same key{}",
                    c.attempt,
                    at.map(|t| format!(" at {}", t.0)).unwrap_or_default()
                ));
            }
        }
    }

    /// When the attempt after a disruption may start: at once after the
    /// first, then after the retry backoff counted in disruptions.
    pub(super) fn disruption_backoff(&mut self, plan: &Plan<'_>, slot: Slot) -> Option<Time> {
        let r = self.record(slot);
        let (_, backoff) = self.retry_rule(plan, &r);
        let disruptions = *self.facts(slot).disruptions;
        (disruptions >= 2)
            .then(|| Time(self.backoff_until(plan::backoff(backoff.as_ref(), disruptions - 1))))
    }
}
