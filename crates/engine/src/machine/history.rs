//! The run history in a decision (D18): a run created again after its TTL
//! (what a GitOps re-sync does) runs nothing; a finished run is deleted by
//! its TTL only once its record is stored; the spec digests a record is
//! matched by are noted as the operator sees each version of the spec.

use jiff::SignedDuration;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

use crate::conditions::{FALSE, TRUE, UNKNOWN};
use crate::reasons::{ConditionType, Reason};
use crate::{EventType, History};
use agentrun_api::{AlreadyRan, RunPhase};
use agentrun_api::{MAX_SPEC_DIGESTS, spec_digest};

use super::Machine;

/// How often a run whose history cannot be read, or whose record could not
/// be stored, is looked at again.
pub(super) const HISTORY_RETRY: SignedDuration = SignedDuration::from_secs(15);

impl<'a> Machine<'_, 'a> {
    /// For a run not started: `true` lets it start. One that already ran
    /// ends `AlreadyRan`; one whose history cannot be read waits, visibly.
    pub(super) fn recognise(&mut self) -> bool {
        match self.view.history {
            History::Off | History::On => true,
            History::AlreadyRan(prior) => {
                let prior = prior.clone();
                self.already_ran(prior);
                false
            }
            History::Unavailable(why) => {
                let message = format!(
                    "the run history cannot be read ({why}); the run starts once the operator knows it has not run before"
                );
                self.draft.status.phase = Some(RunPhase::Pending);
                // D16: a Warning Event when the wait begins, not every look.
                let told =
                    crate::conditions::get(&self.view.committed.conditions, ConditionType::Stalled)
                        .is_some_and(|c| c.reason == Reason::HistoryUnavailable);
                if !told {
                    self.event(
                        EventType::Warning,
                        Reason::HistoryUnavailable,
                        message.clone(),
                    );
                }
                self.set_condition(
                    ConditionType::Stalled,
                    TRUE,
                    Reason::HistoryUnavailable,
                    message.clone(),
                );
                self.set_condition(
                    ConditionType::Succeeded,
                    UNKNOWN,
                    Reason::HistoryUnavailable,
                    message.clone(),
                );
                self.set_condition(
                    ConditionType::Ready,
                    FALSE,
                    Reason::HistoryUnavailable,
                    message,
                );
                self.set_condition(
                    ConditionType::Reconciling,
                    FALSE,
                    Reason::HistoryUnavailable,
                    String::new(),
                );
                self.draft.deadlines.push(self.at(HISTORY_RETRY));
                false
            }
        }
    }

    fn already_ran(&mut self, prior: AlreadyRan) {
        let message = format!(
            "run {} (UID {}) of this name and spec already ran: {} at {}; its record is RunRecord {}. Nothing of this run ran; to run the manifest again on purpose, set annotation agentrun.dev/rerun to a new value",
            self.view.name, prior.run_uid, prior.outcome, prior.completed_at.0, prior.record
        );
        let succeeded = if prior.outcome == "Succeeded" {
            TRUE
        } else {
            FALSE
        };
        self.draft.status.phase = Some(RunPhase::AlreadyRan);
        self.draft.status.completed_at = Some(Time(self.view.now));
        self.draft.status.current_step = None;
        self.draft.status.queue_position = None;
        self.set_condition(
            ConditionType::Succeeded,
            succeeded,
            Reason::AlreadyRan,
            message.clone(),
        );
        // Done as intended: what the manifest asks for has happened (kstatus
        // and Flux read Ready; Argo CD's health check reads the phase).
        self.set_condition(
            ConditionType::Ready,
            TRUE,
            Reason::AlreadyRan,
            message.clone(),
        );
        self.set_condition(
            ConditionType::Progressing,
            FALSE,
            Reason::AlreadyRan,
            String::new(),
        );
        self.set_condition(
            ConditionType::Reconciling,
            FALSE,
            Reason::AlreadyRan,
            String::new(),
        );
        if crate::conditions::is_true(&self.draft.status.conditions, ConditionType::Stalled) {
            self.set_condition(
                ConditionType::Stalled,
                FALSE,
                Reason::Unblocked,
                String::new(),
            );
        }
        self.draft.status.already_ran = Some(Box::new(prior));
        self.event(EventType::Normal, Reason::AlreadyRan, message);
    }

    /// Notes the digest of the spec as it is now, once per generation: the
    /// run's record keeps every version it ran, so a re-creation from any of
    /// them is recognised. The first and the latest are kept past the cap.
    pub(super) fn note_spec(&mut self) {
        let seen = self.view.committed.observed_generation == self.view.run.metadata.generation
            && !self.draft.status.spec_digests.is_empty();
        if seen {
            return;
        }
        let digest = spec_digest(&self.view.run.spec);
        let digests = &mut self.draft.status.spec_digests;
        if digests.contains(&digest) {
            return;
        }
        if digests.len() >= MAX_SPEC_DIGESTS {
            digests.remove(1);
        }
        digests.push(digest);
    }

    /// Whether the TTL may delete this finished run (`due`: its time has
    /// come): with history kept, only once its record is stored (the
    /// controller stores it, then writes `status.record`); until then it is
    /// looked at again, and once the TTL is due the wait shows on the run
    /// (D16: `Stalled`, reason `RecordFailed`, beside the controller's
    /// `RecordFailed` Warning Events with the store's message).
    pub(super) fn recorded_for_ttl(&mut self, due: bool) -> bool {
        let phase = self.draft.status.phase.unwrap_or(RunPhase::Pending);
        if phase == RunPhase::AlreadyRan {
            // Nothing ran, nothing to keep: it stays until its manifest goes,
            // so a re-sync finds it and does not create it again.
            return false;
        }
        if !self.view.history.is_on() || self.draft.status.record.is_some() {
            return true;
        }
        if due {
            self.set_condition(
                ConditionType::Stalled,
                TRUE,
                Reason::RecordFailed,
                "ttlSecondsAfterFinished has passed, but the run's record is not stored yet: the run is deleted once it is (see its RecordFailed Events)".into(),
            );
        }
        self.draft.deadlines.push(self.at(HISTORY_RETRY));
        false
    }
}
