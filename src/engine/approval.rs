//! Approvals as durable waits (D10): the Approval objects the engine asks
//! for, and what a person's decision (or the clock) makes of them.
//!
//! ```text
//!   AgentRun ──owns──▶ Approval <run>-<step>-r<rev>-approve            (before a gated step)
//!            ──owns──▶ Approval <run>-<step>-r<rev>-reconcile-a<n>     (after a lost NonIdempotent attempt)
//! ```

use jiff::Timestamp;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};

use sha2::{Digest, Sha256};

use crate::api::{
    Approval, ApprovalContext, ApprovalKind, ApprovalPhase, ApprovalSpec, ApprovalStatus, Decision,
    OnTimeout, PodDefaults, StepPhase, StepSpec,
};
use crate::labels;

/// What the run makes of an Approval right now.
#[derive(Clone, Debug, PartialEq)]
pub enum Answer {
    Pending {
        expires_at: Option<Timestamp>,
    },
    Decided {
        decision: Decision,
        by: Option<String>,
        comment: Option<String>,
    },
    /// The deadline passed without a decision made in time, but the Approval
    /// does not say so yet. The expiry takes effect once written to the
    /// Approval's status under its resourceVersion: a decision that lands
    /// first makes that write fail, and the API server refuses a decision
    /// once the write succeeded. The order is the API server's (D10).
    Expiring {
        /// A decision the API server took after the deadline.
        late: Option<(Decision, Timestamp)>,
    },
    /// Expired (written); `onTimeout` applies.
    Expired {
        on_timeout: OnTimeout,
    },
    /// The run no longer waits on it.
    Superseded,
}

pub fn answer(a: &Approval, now: Timestamp) -> Answer {
    // What was recorded first wins: a written expiry stays an expiry.
    match a.status.as_ref().map(|s| s.phase) {
        Some(ApprovalPhase::Expired) => {
            return Answer::Expired {
                on_timeout: a.spec.on_timeout,
            };
        }
        Some(ApprovalPhase::Superseded) => return Answer::Superseded,
        _ => {}
    }
    let deadline = match a.spec.kind {
        ApprovalKind::Approve => a.spec.expires_at.as_ref().map(|t| t.0),
        ApprovalKind::Reconcile => None,
    };
    if let Some(decision) = a.spec.decision {
        // The API server's clock says when the decision was stored.
        return match (deadline, decided_at(a)) {
            (Some(deadline), Some(at)) if at > deadline => Answer::Expiring {
                late: Some((decision, at)),
            },
            _ => Answer::Decided {
                decision,
                by: decided_by(a),
                comment: a.spec.comment.clone(),
            },
        };
    }
    match deadline {
        Some(at) if at <= now => Answer::Expiring { late: None },
        expires_at => Answer::Pending { expires_at },
    }
}

/// The status an Approval should show, if it differs from what it shows.
/// `step`: the phase of the checkpoint that refers to it, if any — waiting
/// on it, or past it once its answer was acted on. One the run does not wait
/// on is superseded, saying `why`.
pub fn desired_status(
    a: &Approval,
    now: Timestamp,
    step: Option<StepPhase>,
    why: &str,
) -> Option<ApprovalStatus> {
    let current = a.status.clone().unwrap_or_default();
    if current.phase != ApprovalPhase::Pending {
        return None; // final once written
    }
    let waiting = step == Some(StepPhase::WaitingForApproval);
    let operator = Some(labels::FIELD_MANAGER.to_owned());
    let superseded = || {
        let unapplied = a
            .spec
            .decision
            .map(|d| format!("; decision {d:?} was not applied"))
            .unwrap_or_default();
        Some(ApprovalStatus {
            phase: ApprovalPhase::Superseded,
            decided_at: Some(Time(now)),
            decided_by: operator.clone(),
            message: Some(format!("superseded: {why}{unapplied}")),
        })
    };
    let (phase, by, message) = match answer(a, now) {
        Answer::Superseded | Answer::Expired { .. } => return None,
        Answer::Pending { .. } if waiting => return None,
        Answer::Pending { .. } => return superseded(),
        // Acted on: the checkpoint went past its wait.
        Answer::Decided { decision, by, .. } if step.is_some() && !waiting => {
            let phase = match decision {
                Decision::Approved => ApprovalPhase::Approved,
                Decision::Rejected => ApprovalPhase::Rejected,
                Decision::Retry | Decision::MarkSucceeded | Decision::MarkFailed => {
                    ApprovalPhase::Resolved
                }
            };
            (phase, by, format!("decision {decision:?} applied"))
        }
        Answer::Decided { .. } if waiting => return None, // acted on next
        Answer::Decided { .. } => return superseded(),
        Answer::Expiring { late } if waiting => {
            let on_timeout = a.spec.on_timeout;
            let message = match late {
                None => format!("expired without a decision; onTimeout {on_timeout:?} applies"),
                Some((d, at)) => format!(
                    "expired: decision {d:?} was made at {at}, after the deadline; onTimeout {on_timeout:?} applies"
                ),
            };
            (ApprovalPhase::Expired, operator, message)
        }
        Answer::Expiring { .. } => return superseded(),
    };
    Some(ApprovalStatus {
        phase,
        decided_at: Some(Time(now)),
        decided_by: by,
        message: Some(message),
    })
}

/// The managedFields entry that owns `spec.decision`.
fn decision_entry(
    a: &Approval,
) -> Option<&k8s_openapi::apimachinery::pkg::apis::meta::v1::ManagedFieldsEntry> {
    a.metadata.managed_fields.iter().flatten().find(|m| {
        m.fields_v1
            .as_ref()
            .and_then(|f| f.0.get("f:spec")?.get("f:decision"))
            .is_some()
    })
}

/// The field manager that wrote `spec.decision`, from managedFields.
fn decided_by(a: &Approval) -> Option<String> {
    decision_entry(a)?.manager.clone()
}

/// When the API server stored the decision: the time of the managedFields
/// entry that owns it. A later write by the same manager moves that time
/// later, never earlier, so a decision is never taken for earlier than it was.
fn decided_at(a: &Approval) -> Option<Timestamp> {
    decision_entry(a)?.time.as_ref().map(|t| t.0)
}

/// The sha256 of what a step runs (D14): its container, effect and
/// compensation, and the run's Pod defaults (the ServiceAccount, among
/// others). An approval carries the digest of the step it was asked about.
pub fn step_digest(step: &StepSpec, defaults: Option<&PodDefaults>) -> String {
    let bound = serde_json::json!({
        "container": step.container,
        "effect": step.effect,
        "compensate": step.compensate,
        "podTemplate": defaults,
    });
    let bytes = serde_json::to_vec(&bound).unwrap_or_default();
    let digest = Sha256::digest(&bytes);
    digest.iter().map(|b| format!("{b:02x}")).collect()
}

/// Everything needed to build an Approval object.
pub struct Request<'a> {
    pub name: String,
    pub namespace: Option<String>,
    pub owner: k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference,
    pub run_name: &'a str,
    pub run_uid: &'a str,
    pub step: &'a str,
    pub plan_revision: i64,
    pub kind: ApprovalKind,
    pub question: String,
    pub context: ApprovalContext,
    pub expires_at: Option<Timestamp>,
    pub on_timeout: OnTimeout,
    pub step_digest: Option<String>,
}

pub fn build(r: Request) -> Approval {
    Approval {
        metadata: ObjectMeta {
            name: Some(r.name),
            namespace: r.namespace,
            labels: Some(
                [
                    (labels::RUN.to_owned(), r.run_name.to_owned()),
                    (labels::STEP.to_owned(), r.step.to_owned()),
                ]
                .into(),
            ),
            owner_references: Some(vec![r.owner]),
            ..ObjectMeta::default()
        },
        spec: ApprovalSpec {
            run_name: r.run_name.to_owned(),
            run_uid: r.run_uid.to_owned(),
            step: r.step.to_owned(),
            plan_revision: r.plan_revision,
            kind: r.kind,
            question: r.question,
            context: Some(r.context),
            expires_at: r.expires_at.map(Time),
            on_timeout: r.on_timeout,
            step_digest: r.step_digest,
            decision: None,
            comment: None,
        },
        status: None,
    }
}
