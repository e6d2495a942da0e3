//! The invariants at the run's boundary with the world outside it: signals
//! (taken at most once, only if the API server stored them before the
//! deadline, only from a sender the step names), results checked against
//! their step's `resultSchema`, and the caps on active runs (nothing starts
//! before the controller admits the run).
//!
//! Each is judged from what the simulated API server holds and what the
//! senders did (`Sim::sends`), and a result against [`fits_schema`], which
//! knows the schema without a JSON Schema validator.

use super::*;
use agentrun_api::SignalPhase;

impl Sim {
    /// Across one committed status write.
    pub(super) fn check_boundary(&mut self, before: &AgentRunStatus, after: &AgentRunStatus) {
        self.check_queue(before, after);
        self.check_results(after);
        self.check_signals_taken(before, after);
    }

    /// A queued run is started only by a decision the controller admitted
    /// (or one that cancels it), once; a started run is never queued again.
    fn check_queue(&mut self, before: &AgentRunStatus, after: &AgentRunStatus) {
        if after.phase == Some(RunPhase::Queued) {
            self.was_queued = true;
            assert!(
                after.started_at.is_none(),
                "a run that started is queued again: startedAt {:?}",
                after.started_at
            );
        }
        if before.started_at.is_some() {
            assert_eq!(
                after.started_at, before.started_at,
                "startedAt is written once"
            );
        } else if after.started_at.is_some() {
            assert!(
                self.w.queued.is_none() || self.w.run.spec.cancel,
                "the run started while the controller held it at {:?}",
                self.w.queued
            );
        }
    }

    /// D7 at the boundary: a step is never committed as succeeded with a
    /// result its `resultSchema` refuses (a person's MarkSucceeded, on the
    /// Reconcile Approval the API server holds, records no result and is
    /// the person's word).
    fn check_results(&mut self, after: &AgentRunStatus) {
        for c in &after.steps {
            let refused = c
                .message
                .as_deref()
                .is_some_and(|m| m.contains("does not match") && m.contains("resultSchema"));
            self.schema_refused |= refused;
            let schema = self
                .w
                .run
                .spec
                .steps
                .iter()
                .any(|s| s.name == c.name && s.result_schema.is_some());
            if c.role != StepRole::Step || c.phase != StepPhase::Succeeded || !schema {
                continue;
            }
            let marked = self.w.approvals.values().any(|a| {
                a.spec.kind == ApprovalKind::Reconcile
                    && a.spec.step == c.name
                    && a.spec.plan_revision == c.plan_revision
                    && a.spec.decision == Some(Answer::MarkSucceeded)
            });
            if marked && c.result.is_none() {
                continue;
            }
            assert!(
                c.result.as_ref().is_some_and(fits_schema),
                "D7: step {} (revision {}) committed as succeeded with result {:?}, which its resultSchema refuses ({:?}, {:?})",
                c.name,
                c.plan_revision,
                c.result,
                c.provenance,
                c.message
            );
        }
    }

    /// D10: a step that waits for a signal succeeds with the signal the API
    /// server took, at most once, only if it was stored before the deadline
    /// and from a sender the step names; it is skipped for its deadline only
    /// once the Signal says it expired; it fails on the signal's data only
    /// if that data does not fit the step's schema.
    fn check_signals_taken(&mut self, before: &AgentRunStatus, after: &AgentRunStatus) {
        for c in &after.steps {
            let Some(name) = c.signal.as_deref() else {
                continue;
            };
            let was = before
                .steps
                .iter()
                .find(|o| {
                    o.role == c.role && o.name == c.name && o.plan_revision == c.plan_revision
                })
                .map(|o| o.phase);
            if was == Some(c.phase) {
                continue;
            }
            let sent = self.sends.get(name);
            let deadline = self.deadline_of(name);
            let spec = self.w.run.spec.steps.iter().find(|s| s.name == c.name);
            match c.phase {
                StepPhase::Succeeded => {
                    let sent = sent.unwrap_or_else(|| {
                        panic!("D10: step {} took Signal {name}, on which the API server took no signal", c.name)
                    });
                    assert!(
                        deadline.is_none_or(|d| sent.at <= d),
                        "D10: step {} took signal {} on Signal {name}, stored at {} after its deadline {deadline:?}",
                        c.name,
                        sent.id,
                        sent.at
                    );
                    assert_eq!(
                        (c.result.as_ref(), c.decided_by.as_deref()),
                        (Some(&sent.data), Some(sent.by.as_str())),
                        "D10: step {} took Signal {name} with other data or another sender than the API server holds",
                        c.name
                    );
                    let senders = spec
                        .and_then(|s| s.wait.as_ref())
                        .and_then(|w| w.signal.as_ref())
                        .and_then(|s| s.senders.as_ref());
                    assert!(
                        senders.is_none_or(|s| s.users.contains(&sent.by)),
                        "D15: step {} took a signal from {}, whom its senders do not name",
                        c.name,
                        sent.by
                    );
                    assert!(
                        self.consumed.insert(name.to_owned()),
                        "D10: Signal {name} taken a second time (step {}, revision {})",
                        c.name,
                        c.plan_revision
                    );
                }
                StepPhase::Skipped => {
                    let phase = self
                        .w
                        .signals
                        .get(name)
                        .and_then(|s| s.status.as_ref())
                        .map(|s| s.phase);
                    assert_eq!(
                        phase,
                        Some(SignalPhase::Expired),
                        "D10: step {} skipped for its deadline before Signal {name} said it expired",
                        c.name
                    );
                }
                StepPhase::Failed if c.decided_by.is_some() => {
                    let fits = spec.is_none_or(|s| s.result_schema.is_none())
                        || sent.is_some_and(|s| fits_schema(&s.data));
                    assert!(
                        !fits,
                        "D7: step {} failed on the data of Signal {name} ({:?}), which fits its schema: {:?}",
                        c.name,
                        sent.map(|s| &s.data),
                        c.message
                    );
                }
                _ => {}
            }
        }
    }

    /// The deadline of Signal `name`, as the API server holds it.
    fn deadline_of(&self, name: &str) -> Option<Timestamp> {
        self.w
            .signals
            .get(name)
            .and_then(|s| s.spec.expires_at.as_ref())
            .map(|t| t.0)
    }

    /// The checks on an action that creates something for the run or writes
    /// a Signal's status, against what the API server holds.
    pub(super) fn check_boundary_action(&self, held: &AgentRunStatus, a: &Action) {
        let creates = match a {
            Action::CreatePod(p) => p.metadata.name.clone(),
            Action::CreateApproval(x) => x.metadata.name.clone(),
            Action::CreateSignal(x) => x.metadata.name.clone(),
            _ => None,
        };
        if let Some(what) = creates {
            assert!(
                held.started_at.is_some() && held.phase != Some(RunPhase::Queued),
                "{what} created for a run the API server holds unstarted ({:?})",
                held.phase
            );
        }
        if let Action::CreateSignal(s) = a {
            let name = s.metadata.name.as_deref().unwrap_or_default();
            assert!(
                held.steps.iter().any(|c| c.signal.as_deref() == Some(name)),
                "Signal {name} created before a checkpoint names it"
            );
        }
        let Action::SetSignalStatus {
            name,
            resource_version,
            status,
        } = a
        else {
            return;
        };
        let applies = self
            .w
            .signals
            .get(name)
            .is_some_and(|s| s.metadata.resource_version == *resource_version);
        if !applies {
            return; // the API server refuses it (409)
        }
        let sent = self.sends.get(name);
        match status.phase {
            SignalPhase::Expired => {
                let deadline = self.deadline_of(name);
                if let Some(sent) = sent {
                    assert!(
                        deadline.is_some_and(|d| sent.at > d),
                        "D10: Signal {name} written Expired, yet signal {} was stored at {}, before its deadline {deadline:?}",
                        sent.id,
                        sent.at
                    );
                }
            }
            SignalPhase::Received => assert!(
                sent.is_some(),
                "D10: Signal {name} written Received, yet no sender sent it"
            ),
            _ => {}
        }
    }
}
