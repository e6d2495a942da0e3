//! Approvals as durable waits (D10): the Approval objects the engine asks
//! for, and what a person's decision (or the clock) makes of them. An
//! Approval is a durable answer (`answer`); what is its own is the decision
//! by votes and quorum, and the step digest it binds (D14).
//!
//! ```text
//!   AgentRun ──owns──▶ Approval <run>-<step>-r<rev>-approve            (before a gated step)
//!            ──owns──▶ Approval <run>-<step>-r<rev>-reconcile-a<n>     (after a lost NonIdempotent attempt)
//! ```

use jiff::Timestamp;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

use sha2::{Digest, Sha256};

use super::answer::{
    self, Standing, answered_at, answered_by, deadline, field_owners, owned_meta, standing,
};

use agentrun_api::labels;
use agentrun_api::{
    Approval, ApprovalContext, ApprovalKind, ApprovalPhase, ApprovalSpec, ApprovalStatus,
    Approvers, Decision, OnTimeout, PodDefaults, StepPhase, StepSpec,
};

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
    let decided = decided(a);
    let by_time = decided.as_ref().map(|d| ((), d.at));
    match standing(deadline(a), by_time, now) {
        Standing::Answered(()) => {
            let d = decided.expect("answered");
            Answer::Decided {
                decision: d.decision,
                by: d.by,
                comment: d.comment,
            }
        }
        Standing::Expiring { late } => Answer::Expiring {
            late: late.map(|((), at)| (decided.expect("late").decision, at)),
        },
        Standing::Pending { expires_at } => Answer::Pending { expires_at },
    }
}

/// What the people asked decided, once they have.
struct Decided {
    decision: Decision,
    by: Option<String>,
    comment: Option<String>,
    /// When the API server stored it.
    at: Option<Timestamp>,
}

/// Whether the approval is answered by votes: it needs more than one
/// approver, or someone voted.
fn by_votes(a: &Approval) -> bool {
    a.spec.kind == ApprovalKind::Approve && (a.spec.quorum > 1 || !a.spec.votes.is_empty())
}

/// The distinct users who voted `Approved`, in the order they voted.
fn approving(a: &Approval) -> Vec<&str> {
    let mut users: Vec<&str> = Vec::new();
    for v in a
        .spec
        .votes
        .iter()
        .filter(|v| v.decision == Decision::Approved)
    {
        if !users.contains(&v.user.as_str()) {
            users.push(&v.user);
        }
    }
    users
}

/// `1/2`: approving votes against the quorum, for an approval answered by votes.
pub fn tally(a: &Approval) -> Option<String> {
    by_votes(a).then(|| format!("{}/{}", approving(a).len(), a.spec.quorum.max(1)))
}

fn decided(a: &Approval) -> Option<Decided> {
    if by_votes(a) {
        // Votes are append-only, so their order is the API server's: the
        // first rejection, or the vote that completes the quorum, decides,
        // whichever comes first. A vote after that (it reached the API server
        // before the operator wrote the outcome) changes nothing. A
        // `spec.decision` is not how a quorum is answered (the validating
        // policy refuses it), so it is not read here.
        let at = votes_at(a);
        let quorum = a.spec.quorum.max(1) as usize;
        let mut approvers: Vec<&str> = Vec::new();
        for (k, v) in a.spec.votes.iter().enumerate() {
            match v.decision {
                Decision::Rejected => {
                    return Some(Decided {
                        decision: Decision::Rejected,
                        by: Some(v.user.clone()),
                        comment: v.comment.clone(),
                        at,
                    });
                }
                Decision::Approved if !approvers.contains(&v.user.as_str()) => {
                    approvers.push(&v.user);
                    if approvers.len() >= quorum {
                        let deciding = &a.spec.votes[..=k];
                        let comments: Vec<String> = deciding
                            .iter()
                            .filter_map(|v| Some(format!("{}: {}", v.user, v.comment.as_deref()?)))
                            .collect();
                        return Some(Decided {
                            decision: Decision::Approved,
                            by: Some(approvers.join(", ")),
                            comment: (!comments.is_empty()).then(|| comments.join("; ")),
                            at,
                        });
                    }
                }
                _ => {}
            }
        }
        return None;
    }
    Some(Decided {
        decision: a.spec.decision?,
        by: answered_by(a, a.spec.decided_by.as_ref()),
        comment: a.spec.comment.clone(),
        at: answered_at(a),
    })
}

/// Votes that reached the API server after the quorum or a rejection had
/// decided, as `user (decision)`: recorded on the Approval, never applied.
pub fn votes_after_decision(a: &Approval) -> Vec<String> {
    if !by_votes(a) {
        return Vec::new();
    }
    let quorum = a.spec.quorum.max(1) as usize;
    let mut approvers: Vec<&str> = Vec::new();
    for (k, v) in a.spec.votes.iter().enumerate() {
        let decides = match v.decision {
            Decision::Rejected => true,
            Decision::Approved => {
                if !approvers.contains(&v.user.as_str()) {
                    approvers.push(&v.user);
                }
                approvers.len() >= quorum
            }
            _ => false,
        };
        if decides {
            return a.spec.votes[k + 1..]
                .iter()
                .map(|v| format!("{} ({:?})", v.user, v.decision))
                .collect();
        }
    }
    Vec::new()
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
            votes: tally(a),
            message: Some(format!("superseded: {why}{unapplied}")),
            ..ApprovalStatus::default()
        })
    };
    let (phase, by, message) = match answer(a, now) {
        Answer::Superseded | Answer::Expired { .. } => return None,
        // Waiting: the vote count is all that changes.
        Answer::Pending { .. } if waiting => {
            let votes = tally(a);
            // Only the decision path's own fields: the notifier's
            // (notifications, conditions) are written by the notifier
            // alone, and a copy here would claim them in the apply.
            return (votes != current.votes).then_some(ApprovalStatus {
                votes,
                phase: current.phase,
                decided_at: current.decided_at,
                decided_by: current.decided_by,
                message: current.message,
                ..ApprovalStatus::default()
            });
        }
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
            let late = votes_after_decision(a);
            let message = if late.is_empty() {
                format!("decision {decision:?} applied")
            } else {
                format!(
                    "decision {decision:?} applied; votes after it were not applied: {}",
                    late.join(", ")
                )
            };
            (phase, by, message)
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
        votes: tally(a),
        message: Some(message),
        ..ApprovalStatus::default()
    })
}

/// When the API server stored the last vote: the latest managedFields entry
/// that owns `spec.votes`. Later than the vote that reached the quorum if
/// more came after it, never earlier.
fn votes_at(a: &Approval) -> Option<Timestamp> {
    field_owners(&a.metadata, "f:votes")
        .filter_map(|m| m.time.as_ref().map(|t| t.0))
        .max()
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
    pub approvers: Option<Approvers>,
    pub quorum: i32,
    pub separate_from_requester: bool,
    pub requested_by: Option<String>,
    pub notify: Vec<String>,
    pub escalate: Option<agentrun_api::Escalation>,
}

pub fn build(r: Request) -> Approval {
    Approval {
        metadata: owned_meta(r.name, r.namespace, r.owner, r.run_name, r.step),
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
            approvers: r.approvers,
            quorum: r.quorum.max(1),
            separate_from_requester: r.separate_from_requester,
            requested_by: r.requested_by,
            decided_by: None,
            decided_by_groups: Vec::new(),
            votes: Vec::new(),
            notify: r.notify,
            escalate: r.escalate,
        },
        status: None,
    }
}

/// Why `existing`, found under the name of the Approval `wanted` that the run
/// asks for, is not that Approval; `None` when it is. Besides what every
/// durable answer is opened for, everything that decides what a decision
/// releases, and who may make it, must be what the run asks now: its
/// decision would release the step.
pub fn not_this_runs(existing: &Approval, wanted: &Approval, run_uid: &str) -> Option<String> {
    let (e, w) = (&existing.spec, &wanted.spec);
    answer::not_this_runs(
        existing,
        wanted,
        run_uid,
        [
            ("kind", e.kind != w.kind),
            ("stepDigest", e.step_digest != w.step_digest),
            ("question", e.question != w.question),
            ("approvers", e.approvers != w.approvers),
            ("quorum", e.quorum != w.quorum),
            ("onTimeout", e.on_timeout != w.on_timeout),
        ],
    )
}
