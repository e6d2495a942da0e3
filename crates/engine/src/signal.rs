//! Signals as durable waits (D10): the `Signal` a wait step opens, and what
//! a sender (or the clock) makes of it.
//!
//! ```text
//!   AgentRun ──owns──▶ Signal <run>-<step>-<tag>-r<rev>-signal   (a wait: {signal: …} step)
//!   sender   ──patch spec.id + spec.data──▶ Signal ──watch──▶ step Succeeded, result = data
//! ```
//!
//! A Signal is a durable answer (`answer`): its order against its deadline
//! is the API server's, as for an approval's decision: a signal counts if the API server stored it before
//! the deadline (the time of the managedFields entry that owns `spec.id`);
//! an expiry takes effect once written to the Signal's status, after which
//! the API server refuses a signal.
//!
//! A run applies only a Signal it opened (its controller is the run, and it
//! is the one its checkpoint names: step, plan revision, deadline) and only
//! a sender's `spec.id`: a status that says `Received` where no sender wrote
//! an id is not a signal (D15: the server's record, or nothing).

use jiff::Timestamp;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{OwnerReference, Time};
use serde_json::Value;

use agentrun_api::{
    Senders, Signal, SignalPhase, SignalSpec, SignalStatus, SignalTimeout, StepCheckpoint,
    StepPhase,
};

use super::answer::{self, Standing, answered_at, answered_by, deadline, owned_meta, standing};
use super::observe::not_the_runs;

/// What the run makes of a Signal right now.
#[derive(Clone, Debug, PartialEq)]
pub enum Answer {
    Pending {
        expires_at: Option<Timestamp>,
    },
    /// Sent in time.
    Sent {
        id: String,
        data: Option<Value>,
        by: Option<String>,
    },
    /// The deadline passed, but the Signal does not say so yet: the expiry
    /// takes effect once written to its status under its resourceVersion.
    Expiring {
        /// A signal the API server stored after the deadline: its id and when.
        late: Option<(String, Timestamp)>,
    },
    /// Expired (written); `onTimeout` applies.
    Expired {
        on_timeout: SignalTimeout,
    },
    /// The run no longer waits on it.
    Superseded,
    /// It cannot end the wait, and says so without a sender's word: a
    /// `Received` with no `spec.id`, which the operator never writes.
    Void {
        why: &'static str,
    },
}

pub fn answer(s: &Signal, now: Timestamp) -> Answer {
    match s.status.as_ref().map(|st| st.phase) {
        Some(SignalPhase::Expired) => {
            return Answer::Expired {
                on_timeout: s.spec.on_timeout,
            };
        }
        Some(SignalPhase::Superseded) => return Answer::Superseded,
        // Received (written): it stays what the step took. Only a sender's
        // id is a signal; a status alone is not.
        Some(SignalPhase::Received) => {
            return match s.spec.id.clone() {
                Some(id) => Answer::Sent {
                    id,
                    data: s.spec.data.clone(),
                    by: sent_by(s),
                },
                None => Answer::Void {
                    why: "says Received but carries no spec.id, so no sender sent it",
                },
            };
        }
        _ => {}
    }
    let sent = s.spec.id.clone().map(|id| (id, answered_at(s)));
    match standing(deadline(s), sent, now) {
        Standing::Answered(id) => Answer::Sent {
            id,
            data: s.spec.data.clone(),
            by: sent_by(s),
        },
        Standing::Expiring { late } => Answer::Expiring { late },
        Standing::Pending { expires_at } => Answer::Pending { expires_at },
    }
}

/// Who sent it: the user the API server recorded (`spec.sentBy`), or on a
/// cluster without the admission policies the field manager that wrote
/// `spec.id`.
pub fn sent_by(s: &Signal) -> Option<String> {
    answered_by(s, s.spec.sent_by.as_ref())
}

/// The status a Signal should show, if it differs from what it shows.
/// `step`: the phase of the checkpoint that waits on it, if any; `rejected`:
/// that step failed on the signal's data. One the run does not wait on is
/// superseded, saying `why`.
pub fn desired_status(
    s: &Signal,
    now: Timestamp,
    step: Option<StepPhase>,
    rejected: bool,
    why: &str,
) -> Option<SignalStatus> {
    let current = s.status.clone().unwrap_or_default();
    if current.phase != SignalPhase::Waiting {
        return None; // final once written
    }
    let waiting = step == Some(StepPhase::Waiting);
    let on_timeout = s.spec.on_timeout;
    let (phase, message) = match (answer(s, now), waiting) {
        (Answer::Expired { .. } | Answer::Superseded | Answer::Void { .. }, _) => return None,
        // Opened and not written yet: say what it waits for, so `kubectl
        // get signals` shows it.
        (Answer::Pending { expires_at }, true) if s.status.is_none() => (
            SignalPhase::Waiting,
            match expires_at {
                Some(at) => format!(
                    "step {} waits for this signal until {at}; onTimeout {on_timeout:?}",
                    s.spec.step
                ),
                None => format!("step {} waits for this signal", s.spec.step),
            },
        ),
        // Sent while the step waits: the step takes it in this decision,
        // and the next one says so here.
        (Answer::Pending { .. } | Answer::Sent { .. }, true) => return None,
        (Answer::Expiring { late: None }, true) => (
            SignalPhase::Expired,
            format!("expired without a signal; onTimeout {on_timeout:?} applies"),
        ),
        (
            Answer::Expiring {
                late: Some((id, at)),
            },
            true,
        ) => (
            SignalPhase::Expired,
            format!(
                "expired: signal {id} was sent at {at}, after the deadline, and is not applied; onTimeout {on_timeout:?} applies"
            ),
        ),
        (Answer::Sent { id, .. }, false) if step == Some(StepPhase::Succeeded) => (
            SignalPhase::Received,
            format!(
                "signal {id} received; step {} succeeded with its data",
                s.spec.step
            ),
        ),
        // Taken, and the step failed on it (its data did not match the
        // step's resultSchema): received all the same, never applied.
        (Answer::Sent { id, .. }, false) if step == Some(StepPhase::Failed) && rejected => (
            SignalPhase::Received,
            format!(
                "signal {id} received; its data did not match step {}'s resultSchema, so the step failed",
                s.spec.step
            ),
        ),
        (Answer::Sent { id, .. }, false) => (
            SignalPhase::Superseded,
            format!("superseded: {why}; signal {id} was not applied"),
        ),
        (_, false) => (SignalPhase::Superseded, format!("superseded: {why}")),
    };
    Some(SignalStatus {
        phase,
        recorded_at: Some(Time(now)),
        message: Some(message),
    })
}

pub struct Request<'a> {
    pub name: String,
    pub namespace: Option<String>,
    pub owner: OwnerReference,
    pub run_name: &'a str,
    pub run_uid: &'a str,
    pub step: &'a str,
    pub plan_revision: i64,
    pub description: Option<String>,
    pub expires_at: Option<Timestamp>,
    pub on_timeout: SignalTimeout,
    pub senders: Option<Senders>,
    pub separate_from_requester: bool,
    pub requested_by: Option<String>,
}

pub fn build(r: Request) -> Signal {
    Signal {
        metadata: owned_meta(r.name, r.namespace, r.owner, r.run_name, r.step),
        spec: SignalSpec {
            run_name: r.run_name.to_owned(),
            run_uid: r.run_uid.to_owned(),
            step: r.step.to_owned(),
            plan_revision: r.plan_revision,
            description: r.description,
            expires_at: r.expires_at.map(Time),
            on_timeout: r.on_timeout,
            senders: r.senders,
            separate_from_requester: r.separate_from_requester,
            requested_by: r.requested_by,
            id: None,
            data: None,
            sent_by: None,
        },
        status: None,
    }
}

/// Why `existing`, found under the name of the Signal `wanted` that the run
/// waits on, is not that Signal; `None` when it is. As for an Approval: its
/// controller is this run and it waits for what the run waits for now, from
/// whom the run waits for it (a signal sent to it meanwhile is the run's to
/// take). The controller adopts an existing Signal only on these terms.
pub fn not_this_runs(existing: &Signal, wanted: &Signal, run_uid: &str) -> Option<String> {
    let (e, w) = (&existing.spec, &wanted.spec);
    answer::not_this_runs(
        existing,
        wanted,
        run_uid,
        [
            ("description", e.description != w.description),
            ("onTimeout", e.on_timeout != w.on_timeout),
            ("senders", e.senders != w.senders),
        ],
    )
}

/// Why `s`, found under the name of the Signal checkpoint `cp` waits on, is
/// not one this run opened for it; `None` when it is. Only what the
/// checkpoint fixed is compared (an edit of the step's description or
/// senders after the wait began does not disown the Signal it opened).
pub fn not_opened_for(s: &Signal, run_uid: &str, cp: &StepCheckpoint) -> Option<String> {
    let spec = &s.spec;
    not_the_runs(
        s.metadata.owner_references.as_deref().unwrap_or_default(),
        run_uid,
        [
            ("runUid", spec.run_uid != run_uid),
            ("step", spec.step != cp.name),
            ("planRevision", spec.plan_revision != cp.plan_revision),
            (
                "expiresAt",
                spec.expires_at.as_ref().map(|t| t.0) != cp.wake_at.as_ref().map(|t| t.0),
            ),
        ],
    )
}
