//! Approvals as durable waits (D10): the Approval objects the engine asks
//! for, and what a person's decision (or the clock) makes of them.
//!
//! ```text
//!   AgentRun ──owns──▶ Approval <run>-<step>-r<rev>-approve            (before a gated step)
//!            ──owns──▶ Approval <run>-<step>-r<rev>-reconcile-a<n>     (after a lost NonIdempotent attempt)
//! ```

use jiff::Timestamp;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};

use crate::api::{
    Approval, ApprovalContext, ApprovalKind, ApprovalPhase, ApprovalSpec, ApprovalStatus, Decision,
    OnTimeout,
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
    /// Expired without a decision; `onTimeout` applies.
    Expired {
        on_timeout: OnTimeout,
    },
}

pub fn answer(a: &Approval, now: Timestamp) -> Answer {
    let status_phase = a.status.as_ref().map(|s| s.phase);
    // What was recorded first wins: an expiry already written stays an expiry.
    if status_phase == Some(ApprovalPhase::Expired) {
        return Answer::Expired {
            on_timeout: a.spec.on_timeout,
        };
    }
    if let Some(decision) = a.spec.decision {
        return Answer::Decided {
            decision,
            by: decided_by(a),
            comment: a.spec.comment.clone(),
        };
    }
    match a.spec.expires_at.as_ref().map(|t| t.0) {
        Some(at) if at <= now && a.spec.kind == ApprovalKind::Approve => Answer::Expired {
            on_timeout: a.spec.on_timeout,
        },
        expires_at => Answer::Pending { expires_at },
    }
}

/// The status the Approval should show, if it differs from what it shows.
pub fn desired_status(a: &Approval, now: Timestamp) -> Option<ApprovalStatus> {
    let current = a.status.clone().unwrap_or_default();
    if current.phase != ApprovalPhase::Pending {
        return None; // final once written
    }
    let (phase, by, message) = match answer(a, now) {
        Answer::Pending { .. } => return None,
        Answer::Decided { decision, by, .. } => {
            let phase = match decision {
                Decision::Approved => ApprovalPhase::Approved,
                Decision::Rejected => ApprovalPhase::Rejected,
                Decision::Retry | Decision::MarkSucceeded | Decision::MarkFailed => {
                    ApprovalPhase::Resolved
                }
            };
            (phase, by, format!("decision {decision:?} applied"))
        }
        Answer::Expired { on_timeout } => (
            ApprovalPhase::Expired,
            Some(labels::FIELD_MANAGER.to_owned()),
            format!("expired without a decision; onTimeout {on_timeout:?} applied"),
        ),
    };
    Some(ApprovalStatus {
        phase,
        decided_at: Some(Time(now)),
        decided_by: by,
        message: Some(message),
    })
}

/// The field manager that wrote `spec.decision`, from managedFields.
fn decided_by(a: &Approval) -> Option<String> {
    a.metadata.managed_fields.iter().flatten().find_map(|m| {
        let fields = &m.fields_v1.as_ref()?.0;
        fields.get("f:spec")?.get("f:decision")?;
        m.manager.clone()
    })
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
            decision: None,
            comment: None,
        },
        status: None,
    }
}
