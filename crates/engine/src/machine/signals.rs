//! Wait steps with a signal: an event from outside the cluster that a run
//! waits on durably (D10). When the step starts, its deadline (if any) is
//! fixed in its checkpoint (`wakeAt`) and the operator opens the step's
//! `Signal`; a sender sets its `id` and `data` once, and the step succeeds
//! with `data` as its result. Nothing runs meanwhile, and nothing counts
//! against a budget.
//!
//! The order of a signal and the deadline is the API server's (see
//! `engine::signal`): an expiry is written to the Signal first, and only
//! then does `onTimeout` apply, so a signal is either taken or refused,
//! never lost in between.
//!
//! Who may send is the step's (`wait.signal.senders`,
//! `separateFromRequester`), copied onto the Signal where the API server's
//! admission policies read it; the run takes only a Signal it opened.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

use crate::names;
use crate::plan::{self, Plan};
use crate::reasons::Reason;
use crate::signal::{self, Answer};
use crate::{Action, EventType, Refusal, RefusalCause};
use agentrun_api::labels;
use agentrun_api::{
    CheckpointState, EffectOutcome, RunPhase, Senders, ServiceAccountRef, SignalTimeout, StepPhase,
};

use super::{Machine, whole_seconds};

impl<'a> Machine<'_, 'a> {
    /// Starts wait step `i`, which waits for a signal: its checkpoint, with
    /// its deadline, then the Signal (intent, then effect).
    pub(super) fn start_signal(&mut self, plan: &Plan<'_>, i: usize) {
        let step = plan.steps[i];
        let Some(wait) = step.wait.as_deref().and_then(|w| w.signal.as_ref()) else {
            return;
        };
        let now = whole_seconds(self.view.now);
        let expires = plan::duration(wait.timeout.as_ref())
            .map(|t| now.checked_add(t).unwrap_or(jiff::Timestamp::MAX));
        let signal = names::signal_name(self.view.name, self.view.uid, &step.name, plan.revision);
        let what = wait
            .description
            .as_deref()
            .map(|d| format!(" ({d})"))
            .unwrap_or_default();
        let until = expires.map(|t| format!(" until {t}")).unwrap_or_default();
        let message = format!("waits for Signal {signal}{what}{until}");
        self.open_wait(plan, i, now, expires, Some(signal), message);
        let c = self.draft.status.steps.len() - 1;
        self.open_signal(plan, i, c);
    }

    /// Asks for the Signal checkpoint `c` waits on (create if absent), or
    /// says why the API server would not create it (D16).
    fn open_signal(&mut self, plan: &Plan<'_>, i: usize, c: usize) {
        let cp = &self.draft.status.steps[c];
        let Some(name) = cp.signal.clone() else {
            return;
        };
        let step = plan.steps[i];
        let wait = step.wait.as_deref().and_then(|w| w.signal.clone());
        let ns = self
            .view
            .run
            .metadata
            .namespace
            .as_deref()
            .unwrap_or_default();
        let senders = wait
            .as_ref()
            .and_then(|w| w.senders.clone())
            .map(|s| Senders {
                service_accounts: ServiceAccountRef::in_namespace(s.service_accounts, ns),
                ..s
            });
        let s = signal::build(signal::Request {
            name: name.clone(),
            namespace: self.view.run.metadata.namespace.clone(),
            owner: self.owner(),
            run_name: self.view.name,
            run_uid: self.view.uid,
            step: &step.name,
            plan_revision: cp.plan_revision,
            description: wait.as_ref().and_then(|w| w.description.clone()),
            expires_at: cp.wake_at.as_ref().map(|t| t.0),
            on_timeout: wait.as_ref().map(|w| w.on_timeout).unwrap_or_default(),
            senders,
            separate_from_requester: wait.is_some_and(|w| w.separate_from_requester),
            requested_by: self
                .view
                .run
                .metadata
                .annotations
                .as_ref()
                .and_then(|a| a.get(labels::REQUESTED_BY))
                .cloned(),
        });
        match self.view.refused.iter().find(|r| r.name == name) {
            None => self.draft.actions.push(Action::CreateSignal(Box::new(s))),
            Some(r) => self.stall(&format!("step {}", step.name), "Signal", r),
        }
    }

    /// Checkpoint `c` waits for its signal: take it, apply `onTimeout`
    /// once the expiry is written, or wait on.
    pub(super) fn observe_signal(&mut self, plan: &Plan<'_>, c: usize) {
        let cp = self.draft.status.steps[c].clone();
        let Some(name) = cp.signal.clone() else {
            return;
        };
        let found =
            self.view.signals.iter().find(|s| {
                s.metadata.name.as_deref() == Some(&name) && s.spec.run_uid == self.view.uid
            });
        let Some(s) = found else {
            // Opened but not yet visible (or the create was lost): open it
            // again, and keep the deadline.
            if let Some(t) = &cp.wake_at {
                self.draft.deadlines.push(t.0);
            }
            if let Some(i) = plan.steps.iter().position(|s| s.name == cp.name) {
                self.open_signal(plan, i, c);
            }
            return;
        };
        let step = cp.name.clone();
        // A Signal under the name the run opened but not opened by it (a
        // planted one, on a cluster without the chart's policies) is never
        // taken: it stays in the way, visibly (D16).
        if let Some(why) = signal::not_opened_for(s, self.view.uid, &cp) {
            if let Some(t) = &cp.wake_at {
                self.draft.deadlines.push(t.0);
            }
            let refusal = Refusal {
                name,
                cause: RefusalCause::NameTaken,
                message: why,
            };
            return self.stall(&format!("step {step}"), "Signal", &refusal);
        }
        match signal::answer(s, self.view.now) {
            Answer::Pending { expires_at } => {
                if let Some(at) = expires_at {
                    self.draft.deadlines.push(at);
                }
            }
            // The expiry is written to the Signal first (`sync_signals`);
            // the watch brings the run back once it is.
            Answer::Expiring { .. } => {}
            Answer::Sent { id, data, by } => self.take_signal(plan, c, &name, id, data, by),
            Answer::Expired { on_timeout } => self.signal_expired(c, &name, on_timeout),
            Answer::Superseded => self.refuse_step(
                c,
                Reason::SignalExpired,
                format!("Signal {name} was superseded while the step waited on it"),
            ),
            Answer::Void { why } => self.refuse_step(
                c,
                Reason::SignalExpired,
                format!("Signal {name} {why}; it is not applied and takes no signal now"),
            ),
        }
    }

    /// Checkpoint `c` takes signal `id` sent on Signal `name`: its data is
    /// bounded (D22) and checked against the step's resultSchema (D7) before
    /// it is committed as the step's result.
    fn take_signal(
        &mut self,
        plan: &Plan<'_>,
        c: usize,
        name: &str,
        id: String,
        data: Option<serde_json::Value>,
        by: Option<String>,
    ) {
        let step = self.draft.status.steps[c].name.clone();
        let data = data.unwrap_or_default();
        // D22: data from outside is bounded before anything
        // evaluates it; the API server has no way to measure it.
        let bytes = serde_json::to_vec(&data).map_or(0, |v| v.len());
        if bytes > agentrun_api::MAX_SIGNAL_DATA_BYTES {
            let why = format!(
                "signal {id} on Signal {name} carries {bytes} bytes of data, over the {} KiB a signal may carry",
                agentrun_api::MAX_SIGNAL_DATA_BYTES / 1024
            );
            self.event(
                EventType::Warning,
                Reason::ResultInvalid,
                format!("step {step}: {why}"),
            );
            self.draft.status.steps[c].decided_by = by;
            return self.refuse_step(c, Reason::ResultInvalid, why);
        }
        // D7 at the boundary: data from outside that does not match
        // the step's resultSchema is never committed as its result.
        // The signal cannot be sent again, so the step fails.
        let schema = plan
            .steps
            .iter()
            .find(|s| s.name == step)
            .and_then(|s| s.result_schema.clone());
        if let Some(e) = schema.and_then(|sc| crate::schema::mismatches(&sc, &data).err()) {
            let from = by
                .as_deref()
                .map(|b| format!(" from {b}"))
                .unwrap_or_default();
            let why = format!(
                "signal {id}{from} on Signal {name} carries data that does not match the step's resultSchema: {e}"
            );
            self.event(
                EventType::Warning,
                Reason::ResultInvalid,
                format!("step {step}: {why}"),
            );
            self.draft.status.steps[c].decided_by = by;
            return self.refuse_step(c, Reason::ResultInvalid, why);
        }
        let (result, truncated) = self.cap_result(data);
        let from = by
            .as_deref()
            .map(|b| format!(" from {b}"))
            .unwrap_or_default();
        let text = format!("Signal {name}: {id}{from}");
        if truncated {
            self.event(
                EventType::Warning,
                Reason::ResultNotKept,
                format!(
                    "step {step}: the data of signal {id} is too large to keep in status; it stays on Signal {name}"
                ),
            );
        }
        let cp = &mut self.draft.status.steps[c];
        cp.phase = StepPhase::Succeeded;
        cp.checkpoint = CheckpointState::Committed;
        cp.effect = Some(EffectOutcome::NotApplied);
        cp.finished_at = Some(Time(self.view.now));
        cp.result = result;
        cp.result_truncated = truncated;
        cp.decided_by = by;
        cp.message = Some(text.clone());
        self.draft.tally.succeeded += 1;
        self.event(
            EventType::Normal,
            Reason::SignalReceived,
            format!("step {step}: {text}"),
        );
    }

    /// Checkpoint `c`'s Signal `name` expired (written): `onTimeout` applies.
    fn signal_expired(&mut self, c: usize, name: &str, on_timeout: SignalTimeout) {
        let cp = &self.draft.status.steps[c];
        let step = cp.name.clone();
        let deadline = cp
            .wake_at
            .as_ref()
            .map(|t| format!(" before {}", t.0))
            .unwrap_or_default();
        let text = format!("no signal on Signal {name}{deadline} (onTimeout {on_timeout:?})");
        match on_timeout {
            SignalTimeout::Fail => self.refuse_step(c, Reason::SignalExpired, text),
            SignalTimeout::Skip => {
                let cp = &mut self.draft.status.steps[c];
                cp.phase = StepPhase::Skipped;
                cp.checkpoint = CheckpointState::Committed;
                cp.effect = Some(EffectOutcome::NotApplied);
                cp.finished_at = Some(Time(self.view.now));
                cp.message = Some(format!("skipped: {text}"));
                self.event(
                    EventType::Normal,
                    Reason::SignalExpired,
                    format!("step {step} skipped: {text}"),
                );
            }
        }
    }

    /// The status each of the run's Signals should show (D10): expired
    /// while its step waits on it, received once its step took it,
    /// superseded when the run no longer waits on it (a failed, cancelled or
    /// finished run, a re-plan), so a late signal is refused by the API
    /// server instead of being sent into a void.
    pub(super) fn sync_signals(&mut self) {
        let terminal = self.draft.status.phase.is_some_and(RunPhase::is_terminal);
        // Only the run's own: the status of a Signal it did not open is not
        // the operator's to write.
        let own = |s: &&agentrun_api::Signal| {
            s.spec.run_uid == self.view.uid
                && crate::not_the_runs(
                    s.metadata.owner_references.as_deref().unwrap_or_default(),
                    self.view.uid,
                    [],
                )
                .is_none()
        };
        for s in self.view.signals.iter().filter(own) {
            let Some(name) = s.metadata.name.clone() else {
                continue;
            };
            let cp =
                self.draft.status.steps.iter().find(|c| {
                    c.signal.as_deref() == Some(&name) && c.phase != StepPhase::Superseded
                });
            let step = cp.map(|c| c.phase);
            // A step that failed on its signal's data records the sender
            // (`observe_signal`); one a failing run stopped does not.
            let rejected =
                cp.is_some_and(|c| c.phase == StepPhase::Failed && c.decided_by.is_some());
            let why = if terminal {
                "the run has finished"
            } else {
                "the run no longer waits on it"
            };
            if let Some(status) = signal::desired_status(s, self.view.now, step, rejected, why) {
                self.draft.actions.push(Action::SetSignalStatus {
                    name,
                    resource_version: s.metadata.resource_version.clone(),
                    status,
                });
            }
        }
    }
}
