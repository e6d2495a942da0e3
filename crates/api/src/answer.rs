//! A durable answer (D10): something a run waits for that an outside party
//! answers once, before a deadline, in the API server's order — an
//! [`Approval`]'s decision, a [`Signal`]'s id and data. Each kind carries the
//! same header ([`Opened`]): the run, step and plan revision it was opened
//! for, its deadline and who created the run; the rules that read it are
//! written once, in the engine's `answer` module.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};

use crate::{Approval, ApprovalKind, Signal};

/// What every durable answer was opened for.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Opened<'a> {
    pub run_name: &'a str,
    pub run_uid: &'a str,
    pub step: &'a str,
    pub plan_revision: i64,
    /// When the wait ends without an answer (its `onTimeout` applies).
    pub expires_at: Option<&'a Time>,
    /// Who created the run, as the API server recorded it.
    pub requested_by: Option<&'a str>,
    /// Whether that user is refused as the one who answers.
    pub separate_from_requester: bool,
}

/// An object a run waits on for an outside party's answer.
pub trait DurableAnswer {
    /// The spec field (`f:decision`, `f:id`) whose managedFields entry says
    /// who wrote the answer and when the API server stored it.
    const ANSWER_FIELD: &'static str;
    fn meta(&self) -> &ObjectMeta;
    fn opened(&self) -> Opened<'_>;
    /// The deadline that orders answers: the one an answer must beat.
    fn deadline(&self) -> Option<&Time> {
        self.opened().expires_at
    }
}

/// The header of a spec that carries it under the shared field names.
macro_rules! opened {
    ($s:expr) => {
        Opened {
            run_name: &$s.run_name,
            run_uid: &$s.run_uid,
            step: &$s.step,
            plan_revision: $s.plan_revision,
            expires_at: $s.expires_at.as_ref(),
            requested_by: $s.requested_by.as_deref(),
            separate_from_requester: $s.separate_from_requester,
        }
    };
}

impl DurableAnswer for Approval {
    const ANSWER_FIELD: &'static str = "f:decision";
    fn meta(&self) -> &ObjectMeta {
        &self.metadata
    }
    fn opened(&self) -> Opened<'_> {
        opened!(self.spec)
    }
    /// A Reconcile question has no deadline: what happened is asked until
    /// someone knows.
    fn deadline(&self) -> Option<&Time> {
        match self.spec.kind {
            ApprovalKind::Approve => self.spec.expires_at.as_ref(),
            ApprovalKind::Reconcile => None,
        }
    }
}

impl DurableAnswer for Signal {
    const ANSWER_FIELD: &'static str = "f:id";
    fn meta(&self) -> &ObjectMeta {
        &self.metadata
    }
    fn opened(&self) -> Opened<'_> {
        opened!(self.spec)
    }
}
