//! Who the current user is (as the API server authenticates them, from a
//! SelfSubjectReview) and whether an Approval's approver policy lets them
//! decide it: the same rules the chart's admission policies enforce, checked
//! first so a refusal can say why before anything is sent.

use agentrun_api::{Approval, ApprovalPhase};

/// A user and their groups.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Identity {
    pub user: String,
    pub groups: Vec<String>,
}

/// Why the user may not decide an approval.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// Not in `spec.approvers`.
    NotApprover { approvers: String },
    /// The run's creator, under `separateFromRequester`.
    Requester { run: String },
    /// Decided already.
    Decided { by: String, at: String },
    /// No longer waiting (expired, superseded).
    Closed { phase: ApprovalPhase },
    /// Voted already.
    Voted,
}

impl Refusal {
    /// For the `YOU` column of `pending`.
    pub fn short(&self) -> String {
        match self {
            Refusal::NotApprover { .. } => "not an approver".into(),
            Refusal::Requester { .. } => "your own run".into(),
            Refusal::Decided { .. } | Refusal::Closed { .. } => "closed".into(),
            Refusal::Voted => "voted".into(),
        }
    }

    /// The whole sentence, naming the approval and what to do next.
    pub fn explain(&self, me: &Identity, approval: &str) -> String {
        match self {
            Refusal::NotApprover { approvers } => format!(
                "approval {approval}: {} is not an approver; approvers: {approvers}",
                me.user
            ),
            Refusal::Requester { run } => format!(
                "approval {approval}: {} created run {run} and may not approve it (separateFromRequester); ask another approver",
                me.user
            ),
            Refusal::Decided { by, at } => {
                format!("approval {approval} is already decided{by}{at}")
            }
            Refusal::Closed { phase } => {
                format!("approval {approval} is {phase:?} and can no longer be decided")
            }
            Refusal::Voted => format!(
                "approval {approval}: {} has already voted; it waits for other approvers",
                me.user
            ),
        }
    }
}

impl Identity {
    /// Whether this user may decide (or vote on) `a`, approving if `approve`.
    pub fn may_decide_as(&self, a: &Approval, approve: bool) -> Result<(), Refusal> {
        let status = a.status.clone().unwrap_or_default();
        if let Some(d) = a.spec.decision {
            let by = a
                .spec
                .decided_by
                .clone()
                .or(status.decided_by.clone())
                .map(|b| format!(" by {b}"))
                .unwrap_or_default();
            let at = status
                .decided_at
                .map(|t| format!(" at {}", t.0))
                .unwrap_or_default();
            return Err(Refusal::Decided {
                by: format!(" ({d:?}){by}"),
                at,
            });
        }
        if status.phase != ApprovalPhase::Pending {
            return Err(Refusal::Closed {
                phase: status.phase,
            });
        }
        if let Some(ap) = &a.spec.approvers {
            let sa = |ns: &str, n: &str| format!("system:serviceaccount:{ns}:{n}");
            let allowed = ap.users.contains(&self.user)
                || ap.groups.iter().any(|g| self.groups.contains(g))
                || ap
                    .service_accounts
                    .iter()
                    .any(|s| sa(&s.namespace, &s.name) == self.user);
            if !allowed {
                return Err(Refusal::NotApprover {
                    approvers: ap.describe(),
                });
            }
        }
        if approve
            && a.spec.separate_from_requester
            && a.spec.requested_by.as_deref() == Some(self.user.as_str())
        {
            return Err(Refusal::Requester {
                run: a.spec.run_name.clone(),
            });
        }
        if a.spec.votes.iter().any(|v| v.user == self.user) {
            return Err(Refusal::Voted);
        }
        Ok(())
    }

    /// Whether this user may approve `a`.
    pub fn may_decide(&self, a: &Approval) -> Result<(), Refusal> {
        self.may_decide_as(a, true)
    }
}
