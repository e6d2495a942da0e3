//! The launch gate: the one place that answers "may this Pod start now?",
//! and the one place a `CreatePod` is emitted. Every start goes through it:
//! a new attempt (`launch`) and the Pod of a recorded attempt that was never
//! seen (`create_unseen`), which starts the attempt just as much.
//!
//! Keeps D2 (never beside a live attempt with the same key), D8 (never on
//! stale input: re-plan instead), D9 (the step-execution budget), D11 (the
//! compactor first), D14 (a step changed after its approval is asked again),
//! D16 (a creation the API server refused shows on the run), and `suspend`.

use crate::Refusal;
use crate::approval;
use crate::names::PodRole;
use crate::plan::Plan;
use crate::reasons::Reason;
use crate::{Action, EventType, RefusalCause};
use agentrun_api::TokenUsage;

use super::Machine;
use super::slot::{Acted, Slot, Start};

/// Why a Pod may not start now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Hold {
    /// This decision recorded an outcome that changes what comes next; the
    /// next decision starts from it once it is committed.
    Recorded,
    /// The run is failing: only compensations start.
    Failing,
    /// `spec.suspend`.
    Suspended,
    /// An input of the step went stale: the run was re-planned (D8), or it
    /// failed because it cannot be.
    Stale,
    /// The step changed after it was approved; it is asked again (D14).
    ApprovalChanged,
    /// The compactor runs first (D11).
    Compacting,
    /// `budget.stepExecutions` is spent; the run fails (D9).
    BudgetSpent,
    /// An earlier attempt with the same key is still stopping (D2).
    LivePod,
    /// `spec.parallelism` step Pods are in flight.
    Parallelism,
    /// A journaled call that may have acted is not settled yet, or its
    /// settlement not yet written to the journal (D19).
    Settling,
}

impl<'a> Machine<'_, 'a> {
    /// Whether the Pod of `start` may be created now, or why not. A hold
    /// may itself decide what comes instead: a re-plan, the compactor, a new
    /// approval request, the run's failure.
    pub(super) fn gate(&mut self, plan: &Plan<'_>, start: Start<'_>) -> Result<(), Hold> {
        let (role, name, rev, new) = match start {
            Start::New {
                role, name, rev, ..
            } => (role, name.to_owned(), rev, true),
            Start::Again(slot) => {
                let r = self.record(slot);
                (r.role, r.name, r.plan_revision, false)
            }
        };
        if new && self.draft.recorded {
            return Err(Hold::Recorded);
        }
        if role != PodRole::Compensate && self.failing() {
            // `fail_run` stopped whatever may exist of the run's attempts.
            return Err(Hold::Failing);
        }
        if self.view.run.spec.suspend {
            return Err(Hold::Suspended);
        }
        let at = (role == PodRole::Step).then(|| plan.index(&name)).flatten();
        if let Some(i) = at {
            if self.replan_if_stale(plan, i) {
                return Err(Hold::Stale);
            }
            // D14: every attempt — the first, a retry, a re-run after a
            // disruption, a Reconcile retry — runs exactly what was approved.
            let slot = match start {
                Start::Again(slot) => Some(slot),
                Start::New { .. } => self.slot(role, &name, rev),
            };
            if new
                && let Some(Slot::Step(c)) = slot
                && self.settling(c)
            {
                return Err(Hold::Settling);
            }
            if let Some(Slot::Step(c)) = slot {
                let digest = approval::step_digest(
                    plan.steps[i],
                    self.view.run.spec.pod_template.as_deref(),
                );
                if self.draft.status.steps[c]
                    .step_digest
                    .as_ref()
                    .is_some_and(|d| *d != digest)
                {
                    self.draft.recorded = true;
                    self.ask_again(
                        plan,
                        i,
                        c,
                        format!("step {name} changed after it was approved and before its Pod was created"),
                    );
                    return Err(Hold::ApprovalChanged);
                }
            }
            if new && rev == plan.revision && self.compaction_blocks(plan, i) {
                return Err(Hold::Compacting);
            }
        }
        if new
            && matches!(role, PodRole::Step | PodRole::Compactor)
            && self.in_flight() >= self.parallelism()
        {
            return Err(Hold::Parallelism);
        }
        let Start::New { key, .. } = start else {
            return Ok(());
        };
        if role != PodRole::Compensate
            && let Some(budget) = self
                .view
                .run
                .spec
                .budget
                .as_ref()
                .and_then(|b| b.step_executions)
            && self.draft.status.step_executions >= budget
        {
            self.budget_exceeded(
                Reason::StepExecutionBudgetExceeded,
                format!(
                    "{} step Pods created, the budget of {budget} is spent",
                    self.draft.status.step_executions
                ),
            );
            return Err(Hold::BudgetSpent);
        }
        if self.live_pod_with_key(key) {
            let past_grace = self
                .view
                .pods
                .values()
                .filter(|p| {
                    crate::observe::is_live(p)
                        && p.metadata
                            .labels
                            .as_ref()
                            .and_then(|l| l.get(agentrun_api::labels::IDEMPOTENCY_KEY))
                            .map(String::as_str)
                            == Some(key)
                })
                .find_map(|p| {
                    let gone_by = p.metadata.deletion_timestamp.as_ref()?.0;
                    (gone_by <= self.view.now)
                        .then(|| (p.metadata.name.clone().unwrap_or_default(), gone_by))
                });
            if let Some((pod, gone_by)) = past_grace {
                self.draft.stalled = Some((
                    Reason::PodNotStopping,
                    format!(
                        "{} {name}: Pod {pod} was to stop by {gone_by} and still runs (a lost or stuck node?); the next attempt waits until it has",
                        role.label()
                    ),
                ));
            }
            return Err(Hold::LivePod);
        }
        Ok(())
    }

    /// Creates the Pods of recorded attempts that were never seen, once the
    /// run limits are checked: a cancel, deadline or budget that closes an
    /// attempt must not start it.
    pub(super) fn create_unseen(&mut self, plan: &Plan<'_>) {
        for slot in std::mem::take(&mut self.draft.unseen) {
            if self.gate(plan, Start::Again(slot)).is_err() {
                continue;
            }
            let refusal = self.emit_pod(plan, slot);
            if refusal.is_none() {
                let r = self.record(slot);
                if r.pod_uid.is_none() {
                    // Its UID is recorded once seen, so that a cache that
                    // still shows an earlier Pod of the same name is never
                    // read as this one (`observe::referenced_pods`).
                    match slot {
                        Slot::Step(i) => self.draft.status.steps[i].pod_recreated = true,
                        Slot::Compensation(k) => {
                            self.draft.status.compensations[k].pod_recreated = true
                        }
                    }
                    self.draft.uid_wanted = true;
                }
            }
            if let Some(r) = refusal
                && r.cause == RefusalCause::Rejected
            {
                // The same Pod would be refused again: a failed attempt.
                let why = format!(
                    "attempt {}: the API server refused its Pod {}: {}",
                    self.record(slot).attempt,
                    r.name,
                    r.message
                );
                self.attempt_failed(plan, slot, why, TokenUsage::default(), Acted::No);
            }
        }
    }

    /// Emits the creation of the Pod of the attempt in `slot` — the only
    /// place a `CreatePod` comes from — unless the API server refused it in
    /// this reconcile: then the refusal is returned and the run shows it
    /// (D16).
    pub(super) fn emit_pod(&mut self, plan: &Plan<'_>, slot: Slot) -> Option<&'a Refusal> {
        let pod = self.attempt_pod(plan, slot)?;
        let name = pod.metadata.name.as_deref().unwrap_or("");
        match self.view.refused.iter().find(|r| r.name == name) {
            None => {
                self.draft.actions.push(Action::CreatePod(Box::new(pod)));
                None
            }
            Some(r) => {
                let what = self.record(slot).what();
                self.stall(&what, "Pod", r);
                Some(r)
            }
        }
    }

    /// Records that a creation the run needs was refused: a `Stalled`
    /// condition and a Warning Event, both with the API server's message.
    pub(super) fn stall(&mut self, what: &str, kind: &str, r: &Refusal) {
        let (why, text) = match r.cause {
            RefusalCause::NameTaken => (
                Reason::NameTaken,
                format!(
                    "{what}: {kind} {} exists but does not belong to this run; delete or rename it: {}",
                    r.name, r.message
                ),
            ),
            RefusalCause::Rejected | RefusalCause::Transient => (
                Reason::FailedCreate,
                format!(
                    "{what}: the API server refused {kind} {}: {}",
                    r.name, r.message
                ),
            ),
        };
        self.event(EventType::Warning, Reason::FailedCreate, text.clone());
        self.draft.stalled = Some((why, text));
    }
}
