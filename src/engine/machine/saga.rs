//! Winding down: once no step Pod is live, compensate the steps whose effect
//! was applied or may have been (D7), latest first, each as an attempt with
//! its own key and retries; then the terminal phase.

use jiff::SignedDuration;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use serde_json::Value;

use crate::api::{
    CompensationCheckpoint, EffectOutcome, RunPhase, StepContainer, StepPhase, StepRole, TokenUsage,
};
use crate::engine::conditions::{self as cond};
use crate::engine::context::{self, Identity, PriorResult};
use crate::engine::names::{self, PodRole};
use crate::engine::observe::{self, Observation};
use crate::engine::plan::Plan;
use crate::engine::pods::{self, PodRequest};
use crate::engine::reasons::{ConditionType, Reason};
use crate::engine::result;
use crate::engine::{Action, EventType, RefusalCause};

use super::{AfterFailure, Machine};

impl<'a> Machine<'a> {
    pub(super) fn wind_down(&mut self, plan: &Plan<'_>) {
        // Nothing new starts while a step Pod of this run is still live. Past
        // the run's active deadline, a Pod still not stopped when its grace
        // period ended is on a lost node: its effect is already recorded as
        // Unknown, and waiting for it would hang the run past its deadline.
        let past_deadline = cond::get(&self.status.conditions, ConditionType::FailureTarget)
            .is_some_and(|c| c.reason == Reason::DeadlineExceeded);
        let mut step_pod_live = false;
        for p in self.pods.values() {
            if !observe::is_live(p)
                || observe::coords(p).is_none_or(|c| c.role == PodRole::Compensate)
            {
                continue;
            }
            match p.metadata.deletion_timestamp.as_ref() {
                Some(gone_by) if past_deadline && gone_by.0 <= self.now => {}
                Some(gone_by) if past_deadline => {
                    self.deadlines.push(gone_by.0);
                    step_pod_live = true;
                }
                _ => step_pod_live = true,
            }
        }
        if step_pod_live {
            return;
        }
        let targets = self.compensation_targets(plan);
        for (name, rev, container) in targets {
            let existing = self
                .status
                .compensations
                .iter()
                .position(|c| c.name == name && c.plan_revision == rev);
            let Some(k) = existing else {
                if !self.recorded && !self.run.spec.suspend {
                    self.launch_compensation(plan, &name, rev, &container, 1);
                }
                return;
            };
            let cp = self.status.compensations[k].clone();
            match cp.phase {
                StepPhase::Running => return,
                StepPhase::Pending => {
                    if !self.recorded
                        && !self.run.spec.suspend
                        && self.due(cp.next_attempt_at.as_ref())
                    {
                        self.launch_compensation(plan, &name, rev, &container, cp.attempt + 1);
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
        self.status
            .steps
            .iter()
            .rev()
            .filter(|c| c.role == StepRole::Step)
            .filter(|c| {
                matches!(
                    c.effect,
                    Some(EffectOutcome::Applied | EffectOutcome::Unknown)
                )
            })
            .filter_map(|c| {
                let container = self.step_spec(plan, &c.name)?.compensate?;
                Some((c.name.clone(), c.plan_revision, container))
            })
            .collect()
    }

    pub(super) fn launch_compensation(
        &mut self,
        plan: &Plan<'_>,
        name: &str,
        rev: i64,
        container: &StepContainer,
        attempt: i32,
    ) {
        let key = self.key(PodRole::Compensate, name, rev);
        if self.live_pod_with_key(&key) {
            return;
        }
        let pod_name =
            names::pod_name(self.name, self.uid, PodRole::Compensate, name, rev, attempt);
        let k = match self
            .status
            .compensations
            .iter()
            .position(|c| c.name == name && c.plan_revision == rev)
        {
            Some(k) => k,
            None => {
                self.status.compensations.push(CompensationCheckpoint {
                    name: name.to_owned(),
                    plan_revision: rev,
                    idempotency_key: key,
                    ..CompensationCheckpoint::default()
                });
                self.status.compensations.len() - 1
            }
        };
        let cp = &mut self.status.compensations[k];
        cp.attempt = attempt;
        cp.pod = Some(pod_name.clone());
        cp.pod_uid = None;
        cp.phase = StepPhase::Running;
        cp.started_at = Some(Time(self.now));
        self.tally.started += 1;
        cp.next_attempt_at = None;
        let cp = cp.clone();
        self.actions.push(Action::CreatePod(Box::new(
            self.compensation_pod(plan, &cp, container),
        )));
        self.event(
            EventType::Normal,
            Reason::CompensationStarted,
            format!("compensating step {name} (plan revision {rev}): attempt {attempt} as Pod {pod_name}"),
        );
    }

    pub(super) fn compensation_pod(
        &self,
        _plan: &Plan<'_>,
        cp: &CompensationCheckpoint,
        container: &StepContainer,
    ) -> Pod {
        let step_result = self
            .status
            .steps
            .iter()
            .find(|c| {
                c.role == StepRole::Step && c.name == cp.name && c.plan_revision == cp.plan_revision
            })
            .and_then(|c| c.result.clone());
        let results: Vec<(String, Value)> = step_result
            .map(|r| (cp.name.clone(), r))
            .into_iter()
            .collect();
        let refs: Vec<PriorResult> = results
            .iter()
            .map(|(s, r)| PriorResult { step: s, result: r })
            .collect();
        let identity = Identity {
            run: self.name,
            run_uid: self.uid,
            step: &cp.name,
            role: PodRole::Compensate.label(),
            attempt: cp.attempt,
            idempotency_key: &cp.idempotency_key,
            plan_revision: cp.plan_revision,
        };
        let ctx = context::materialise(&identity, None, &refs, self.max_context_bytes());
        pods::build(PodRequest {
            name: names::pod_name(
                self.name,
                self.uid,
                PodRole::Compensate,
                &cp.name,
                cp.plan_revision,
                cp.attempt,
            ),
            namespace: self.run.metadata.namespace.clone(),
            owner: self.owner(),
            run: self.name,
            step: &cp.name,
            role: PodRole::Compensate,
            plan_revision: cp.plan_revision,
            attempt: cp.attempt,
            idempotency_key: &cp.idempotency_key,
            container,
            defaults: self.run.spec.pod_template.as_ref(),
            context_json: ctx.json,
        })
    }

    pub(super) fn observe_compensation(&mut self, plan: &Plan<'_>, k: usize) {
        let cp = self.status.compensations[k].clone();
        let pod = self.pods.get(cp.pod.as_deref().unwrap_or("")).copied();
        let (limit, backoff) = {
            let spec = self.step_spec(plan, &cp.name);
            let retry = spec.and_then(|s| s.retry);
            (
                retry.as_ref().map_or(0, |r| r.limit.max(0)),
                retry.and_then(|r| r.backoff),
            )
        };
        let now = self.now;
        let failed = |why: String, m: &mut Self| {
            let failures = m.status.compensations[k].failures + 1;
            let next = m.after_failure(&why, failures, limit, backoff.as_ref());
            let c = &mut m.status.compensations[k];
            c.failures = failures;
            c.pod_uid = None;
            m.recorded = true;
            match next {
                AfterFailure::Exhausted(message) => {
                    c.phase = StepPhase::Failed;
                    c.finished_at = Some(Time(now));
                    c.message = Some(message);
                    let message = format!("compensation of step {}: {why}", c.name);
                    m.event(EventType::Warning, Reason::CompensationFailed, message);
                }
                AfterFailure::Retry { at, message } => {
                    c.phase = StepPhase::Pending;
                    c.next_attempt_at = Some(at);
                    c.message = Some(message);
                }
            }
        };
        let observation = observe::observe(pod, cp.pod_uid.as_deref());
        // A compensation's tokens are spent like any step's (D9).
        let tokens = match &observation {
            Observation::Succeeded { message }
            | Observation::Failed { message, .. }
            | Observation::Disrupted { message, .. } => {
                result::tokens_best_effort(message.as_deref())
            }
            _ => TokenUsage::default(),
        };
        if tokens.total() > 0 {
            let c = &mut self.status.compensations[k];
            let mut sum = c.tokens.unwrap_or_default();
            sum.input = sum.input.saturating_add(tokens.input);
            sum.output = sum.output.saturating_add(tokens.output);
            c.tokens = Some(sum);
            self.status.tokens_used = self.status.tokens_used.saturating_add(tokens.total());
            self.tally.tokens += tokens.total().max(0) as u64;
        }
        match observation {
            Observation::NotSeen => {
                if let Some(container) = self.step_spec(plan, &cp.name).and_then(|s| s.compensate) {
                    let pod = self.compensation_pod(plan, &cp, &container);
                    let what = format!("compensation of step {}", cp.name);
                    if let Some(r) = self.create_pod(&what, pod)
                        && r.cause == RefusalCause::Rejected
                    {
                        let why = format!(
                            "attempt {}: the API server refused its Pod {}: {}",
                            cp.attempt, r.name, r.message
                        );
                        failed(why, self);
                    }
                }
            }
            // Compensations are repeatable: one whose Pod vanished unseen is
            // simply created again, so its UID is not worth a write.
            Observation::Live { .. } | Observation::Terminating { .. } => {}
            Observation::Succeeded { message } => match result::parse(message.as_deref()) {
                Ok(_) => {
                    let c = &mut self.status.compensations[k];
                    c.phase = StepPhase::Succeeded;
                    c.finished_at = Some(Time(now));
                    c.pod_uid = None;
                    self.recorded = true;
                    let message = format!("compensation of step {} succeeded", cp.name);
                    self.event(EventType::Normal, Reason::CompensationSucceeded, message);
                }
                Err(e) => failed(
                    format!("attempt {} returned an unusable result: {e}", cp.attempt),
                    self,
                ),
            },
            Observation::Failed {
                exit_code, reason, ..
            } => failed(
                format!(
                    "attempt {} exited with code {exit_code} ({reason})",
                    cp.attempt
                ),
                self,
            ),
            Observation::Disrupted { .. } | Observation::Vanished => {
                // Compensations run with their own key and are meant to be repeatable.
                let c = &mut self.status.compensations[k];
                c.disruptions += 1;
                c.pod_uid = None;
                c.phase = StepPhase::Pending;
                c.message = Some(format!(
                    "attempt {} was disrupted; it runs again with the same key",
                    cp.attempt
                ));
                self.recorded = true;
            }
        }
    }

    pub(super) fn finish_failed(&mut self) {
        let target = cond::get(&self.status.conditions, ConditionType::FailureTarget).cloned();
        let why: Reason = target
            .as_ref()
            .and_then(|c| c.reason.parse().ok())
            .unwrap_or(Reason::RunFailed);
        let message = target.map(|c| c.message).unwrap_or_default();
        let cancelled = why == Reason::Cancelled;
        self.status.phase = Some(if cancelled {
            RunPhase::Cancelled
        } else {
            RunPhase::Failed
        });
        self.status.completed_at = Some(Time(self.now));
        let failed_compensations: Vec<String> = self
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
        if let Some(ttl) = self.run.spec.ttl_seconds_after_finished {
            self.deadlines
                .push(self.at(SignedDuration::from_secs(ttl.max(0).into())));
        }
    }
}
