//! Finalizers and terminal runs: which step Pods the input status accounts
//! for and may be released (D5), the Pod of an attempt closed while it ran
//! whose report is still awaited (D9), and what a terminal run still does:
//! cleanup and TTL (D12).

use jiff::{SignedDuration, Timestamp};
use k8s_openapi::api::core::v1::Pod;

use crate::Action;
use crate::names::PodRole;
use crate::observe::{self, Observation};
use crate::result;
use agentrun_api::{StepPhase, StepRole};

use super::Machine;

impl<'a> Machine<'_, 'a> {
    /// Whether the input status accounts for this Pod's attempt: its slot has
    /// moved past it or is no longer running it.
    pub(super) fn accounted(&self, pod: &Pod) -> Option<bool> {
        let c = observe::coords(pod)?;
        let (attempt, phase) = match c.role {
            PodRole::Compensate => {
                let cp = self
                    .view
                    .committed
                    .compensations
                    .iter()
                    .find(|x| x.name == c.step && x.plan_revision == c.plan_revision)?;
                (cp.attempt, cp.phase)
            }
            role => {
                let step_role = role.step_role().unwrap_or(StepRole::Step);
                let cp = self.view.committed.steps.iter().find(|x| {
                    x.role == step_role && x.name == c.step && x.plan_revision == c.plan_revision
                })?;
                (cp.attempt, cp.phase)
            }
        };
        Some(c.attempt < attempt || (c.attempt == attempt && phase != StepPhase::Running))
    }

    pub(super) fn release_accounted_pods(&mut self) {
        let mut pods: Vec<&Pod> = self.view.pods.values().copied().collect();
        pods.sort_by(|a, b| a.metadata.name.cmp(&b.metadata.name));
        for pod in pods {
            if self.accounted(pod) != Some(true) || self.awaits_report(pod) {
                continue;
            }
            self.stop_and_release(pod, "the attempt is already accounted for");
        }
        // A stopping attempt's Pod that is gone (its finalizer was stripped)
        // has nothing left to report.
        for cp in self.draft.status.steps.iter_mut().filter(|c| c.stopping) {
            if cp
                .pod
                .as_deref()
                .is_none_or(|p| !self.view.pods.contains_key(p))
            {
                cp.stopping = false;
                cp.message = Some(format!(
                    "{}; its Pod was removed before it reported",
                    cp.message.as_deref().unwrap_or("stopped")
                ));
            }
        }
    }

    /// For the Pod of an attempt the operator ended while it still ran
    /// (`stopping`): true while the Pod is still stopping, so it keeps its
    /// finalizer; once it has stopped, what it reported is recorded — its
    /// tokens, and the result of a step that finished after all, which a
    /// compensation may need — and it may be released in the same decision,
    /// since actions follow the write (D5, D9). A Pod still running when its
    /// grace period has ended is on a lost node and is given up on.
    pub(super) fn awaits_report(&mut self, pod: &Pod) -> bool {
        let Some(c) = observe::coords(pod) else {
            return false;
        };
        let role = match c.role {
            PodRole::Step => StepRole::Step,
            PodRole::Planner => StepRole::Planner,
            PodRole::Compactor => StepRole::Compactor,
            PodRole::Verify => StepRole::Verify,
            PodRole::Compensate => return false,
        };
        let Some(i) = self.draft.status.steps.iter().position(|x| {
            x.stopping
                && x.role == role
                && x.name == c.step
                && x.plan_revision == c.plan_revision
                && x.attempt == c.attempt
        }) else {
            return false;
        };
        if observe::is_live(pod) {
            match pod.metadata.deletion_timestamp.as_ref() {
                Some(gone_by) if gone_by.0 <= self.view.now => {
                    // Still running past its grace period, it may act yet:
                    // its effect is not known (D6, D7), so a re-plan or a
                    // retry under another key asks a person first (D8).
                    let unknown = self.acts(i) && observe::started(pod);
                    let cp = &mut self.draft.status.steps[i];
                    if unknown && cp.effect != Some(agentrun_api::EffectOutcome::Applied) {
                        cp.effect = Some(agentrun_api::EffectOutcome::Unknown);
                    }
                    cp.stopping = false;
                    cp.message = Some(format!(
                        "{}; its Pod did not stop within its grace period (a lost node?), so what it reports is not awaited",
                        cp.message.as_deref().unwrap_or("stopped")
                    ));
                    return false;
                }
                Some(gone_by) => self.draft.deadlines.push(gone_by.0),
                None => {
                    self.draft.actions.push(Action::DeletePod {
                        name: pod.metadata.name.clone().unwrap_or_default(),
                        reason: "the attempt has ended".into(),
                    });
                }
            }
            return true;
        }
        let (message, exited_ok) = match observe::observe(Some(pod), None) {
            Observation::Succeeded { message, .. } => (message, true),
            Observation::Failed { message, .. } | Observation::Disrupted { message, .. } => {
                (message, false)
            }
            _ => (None, false),
        };
        let tokens = result::tokens_best_effort(message.as_deref());
        self.add_tokens(super::slot::Slot::Step(i), tokens);
        let report = exited_ok
            .then(|| result::parse(message.as_deref()).ok())
            .flatten();
        // D7: a result its step's resultSchema refuses is never kept, not
        // even from a Pod that finished after its attempt was closed (a
        // person's MarkSucceeded would commit it as the step's result).
        let refused = report
            .as_ref()
            .is_some_and(|r| self.schema_refuses(i, &r.result));
        let report = report.filter(|_| !refused);
        let (result, truncated) = match report {
            Some(r) => self.cap_result(r.result),
            None => (None, false),
        };
        // Judged not started when it was stopped, it may have started since:
        // what its Pod finally shows decides whether it may have acted (D7).
        let acts = self.acts(i);
        let cp = &mut self.draft.status.steps[i];
        if acts && observe::started(pod) && cp.effect != Some(agentrun_api::EffectOutcome::Applied)
        {
            cp.effect = Some(agentrun_api::EffectOutcome::Unknown);
        }
        cp.stopping = false;
        let told = cp.message.clone().unwrap_or_else(|| "stopped".into());
        if exited_ok && refused {
            cp.message = Some(format!(
                "{told}; its Pod then finished with exit code 0, and its result, which does not match its resultSchema, is not kept"
            ));
        } else if exited_ok && cp.result.is_none() {
            cp.result = result;
            cp.result_truncated |= truncated;
            cp.message = Some(format!(
                "{told}; its Pod then finished with exit code 0, and its result is kept"
            ));
        } else if tokens.total() > 0 {
            cp.message = Some(format!(
                "{told}; its Pod then stopped, reporting {} tokens",
                tokens.total()
            ));
        }
        false
    }

    /// The spec of the plan step checkpoint `i` records, if it is a step's:
    /// from the run's steps or the planner's plan.
    fn recorded_step_spec(&self, i: usize) -> Option<&agentrun_api::StepSpec> {
        let cp = &self.draft.status.steps[i];
        if cp.role != agentrun_api::StepRole::Step {
            return None;
        }
        self.view
            .run
            .spec
            .steps
            .iter()
            .chain(self.draft.status.plan.iter().flat_map(|p| p.steps.iter()))
            .find(|s| s.name == cp.name)
    }

    /// Whether checkpoint `i` is a step whose `resultSchema` refuses `result`.
    fn schema_refuses(&self, i: usize, result: &serde_json::Value) -> bool {
        self.recorded_step_spec(i)
            .and_then(|s| s.result_schema.as_deref())
            .is_some_and(|schema| crate::schema::mismatches(schema, result).is_err())
    }

    /// Whether checkpoint `i` is a step that acts (its effect is not `None`).
    fn acts(&self, i: usize) -> bool {
        self.draft.status.steps[i].role == agentrun_api::StepRole::Step
            && self
                .recorded_step_spec(i)
                .is_none_or(|s| s.effect != agentrun_api::Effect::None)
    }

    pub(super) fn stop_and_release(&mut self, pod: &Pod, why: &str) {
        let name = pod.metadata.name.clone().unwrap_or_default();
        if observe::is_live(pod) && pod.metadata.deletion_timestamp.is_none() {
            self.draft.actions.push(Action::DeletePod {
                name: name.clone(),
                reason: why.to_owned(),
            });
        }
        if observe::has_result_finalizer(pod) {
            self.draft
                .actions
                .push(Action::ReleaseFinalizer { pod: name });
        }
    }

    pub(super) fn release_all_pods(&mut self) {
        let mut pods: Vec<&Pod> = self.view.pods.values().copied().collect();
        pods.sort_by(|a, b| a.metadata.name.cmp(&b.metadata.name));
        for pod in pods {
            self.stop_and_release(pod, "the run has finished");
        }
    }

    /// Terminal phases are sticky: only cleanup and TTL remain; the TTL
    /// waits for the run's record (D18).
    pub(super) fn terminal(&mut self) {
        // Once terminal no outcome can change the run, so every Pod may go;
        // all attempts were accounted for before the run became terminal.
        self.release_all_pods();
        self.sync_approvals();
        self.sync_signals();
        if let (Some(ttl), Some(done)) = (
            self.view.run.spec.ttl_seconds_after_finished,
            self.draft.status.completed_at.clone(),
        ) {
            let at = done
                .0
                .checked_add(SignedDuration::from_secs(ttl.max(0).into()))
                .unwrap_or(Timestamp::MAX);
            let due = at <= self.view.now;
            if !self.recorded_for_ttl(due) {
                return;
            }
            if due {
                self.draft.actions.push(Action::DeleteRun);
            } else {
                self.draft.deadlines.push(at);
            }
        }
    }
}
