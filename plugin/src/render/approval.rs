//! Approvals as the plugin prints them: the lines of one in `describe`, and
//! the `pending` table of those a person may decide.

use std::fmt::Write;

use agentrun_api::{Approval, ApprovalKind, ApprovalPhase};
use jiff::Timestamp;

use super::text::{short, table, truncate};
use crate::identity::Identity;

pub(super) fn approval_lines(a: &Approval) -> String {
    let mut s = String::new();
    let st = a.status.clone().unwrap_or_default();
    let _ = writeln!(
        s,
        "  {}  {:?}  {:?}{}",
        a.metadata.name.as_deref().unwrap_or(""),
        a.spec.kind,
        st.phase,
        st.votes
            .as_ref()
            .map(|v| format!("  votes {v}"))
            .unwrap_or_default()
    );
    let mut who = vec![];
    if let Some(r) = &a.spec.requested_by {
        who.push(format!("requested by {r}"));
    }
    who.push(match &a.spec.approvers {
        Some(ap) => format!("approvers {}", ap.describe()),
        None => "approvers: anyone RBAC allows".into(),
    });
    if a.spec.quorum > 1 {
        who.push(format!("quorum {}", a.spec.quorum));
    }
    let _ = writeln!(s, "      {}", who.join("; "));
    for v in &a.spec.votes {
        let _ = writeln!(
            s,
            "      vote {:?} by {}{}",
            v.decision,
            v.user,
            v.comment
                .as_deref()
                .map(|c| format!(": {c}"))
                .unwrap_or_default()
        );
    }
    if let Some(line) = notified(&st) {
        let _ = writeln!(s, "      {line}");
    }
    if let Some(d) = a.spec.decision {
        let by = st
            .decided_by
            .clone()
            .or(a.spec.decided_by.clone())
            .map(|b| format!(" by {b}"))
            .unwrap_or_default();
        let at = st
            .decided_at
            .map(|t| format!(" at {}", t.0))
            .unwrap_or_default();
        let _ = writeln!(s, "      decision {d:?}{by}{at}");
    } else if st.phase != ApprovalPhase::Pending {
        let by = st
            .decided_by
            .map(|b| format!(" by {b}"))
            .unwrap_or_default();
        let _ = writeln!(s, "      {:?}{by}", st.phase);
    }
    s
}

/// What the approval's notifications came to: `notified: 2 delivered`, or
/// the `Notified` condition's message when something is held back.
fn notified(st: &agentrun_api::ApprovalStatus) -> Option<String> {
    let c = st.conditions.iter().find(|c| c.type_ == "Notified")?;
    let delivered = st
        .notifications
        .iter()
        .filter(|d| d.state == agentrun_api::DeliveryState::Delivered)
        .count();
    Some(if c.status == "True" {
        format!("notified: {delivered} delivered")
    } else {
        // Within describe's 80 columns (6 of indent); the whole message is
        // on the Approval's condition.
        let head = format!("not notified ({}): ", c.reason);
        let room = 74usize.saturating_sub(head.chars().count()).max(10);
        format!("{head}{}", truncate(&c.message, room))
    })
}

/// `kubectl agentrun pending`: approvals waiting for a decision, and
/// whether the current user may decide each.
pub fn pending(
    approvals: &[Approval],
    me: &Identity,
    now: Timestamp,
    all_namespaces: bool,
) -> String {
    let mut rows = vec![];
    let mut head: Vec<String> = vec![];
    if all_namespaces {
        head.push("NAMESPACE".into());
    }
    head.extend(["APPROVAL", "RUN", "STEP", "KIND", "VOTES", "EXPIRES", "YOU"].map(String::from));
    rows.push(head);
    for a in approvals.iter().filter(|a| is_pending(a)) {
        let mut row: Vec<String> = vec![];
        if all_namespaces {
            row.push(a.metadata.namespace.clone().unwrap_or_default());
        }
        let you = match me.may_decide(a) {
            Ok(()) => "may decide".to_owned(),
            Err(why) => why.short(),
        };
        row.extend([
            a.metadata.name.clone().unwrap_or_default(),
            a.spec.run_name.clone(),
            a.spec.step.clone(),
            match a.spec.kind {
                ApprovalKind::Approve => "Approve".into(),
                ApprovalKind::Reconcile => "Reconcile".into(),
            },
            a.status
                .as_ref()
                .and_then(|s| s.votes.clone())
                .unwrap_or_else(|| "-".into()),
            a.spec
                .expires_at
                .as_ref()
                .map(|t| format!("in {}", short(t.0.duration_since(now))))
                .unwrap_or_else(|| "never".into()),
            you,
        ]);
        rows.push(row);
    }
    table(&rows)
}

/// Waiting for a decision: `Pending` and undecided.
pub fn is_pending(a: &Approval) -> bool {
    a.status
        .as_ref()
        .is_none_or(|s| s.phase == ApprovalPhase::Pending)
        && a.spec.decision.is_none()
}

/// What a person sees before confirming a decision.
pub fn question(a: &Approval) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "Approval {} ({:?}) for run {}, step {}:",
        a.metadata.name.as_deref().unwrap_or(""),
        a.spec.kind,
        a.spec.run_name,
        a.spec.step
    );
    let _ = writeln!(s, "  {}", a.spec.question);
    if let Some(c) = &a.spec.context {
        if !c.reason.is_empty() {
            let _ = writeln!(s, "  why: {}", c.reason);
        }
        if let Some(k) = &c.idempotency_key {
            let _ = writeln!(s, "  idempotency key: {k}");
        }
        if let Some(p) = &c.pod {
            let _ = writeln!(s, "  interrupted Pod: {p}");
        }
        for done in &c.completed_steps {
            let _ = writeln!(s, "  done: {}", truncate(done, 72));
        }
    }
    s
}
