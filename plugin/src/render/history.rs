//! How run records read (D18): `kubectl agentrun history` lists them, and
//! `history RUN` shows each one like `describe` shows a live run — identity,
//! outcome, per step the effect and idempotency key, approvals with their
//! decider — read-only, from the record alone (the run is gone).

use std::fmt::Write;

use agentrun_api::{AgentRun, RunRecordSpec, StepRole};
use agentrun_history::record_name;
use jiff::Timestamp;

use super::text::{Style, age, table, truncate};

/// One line per record, newest first; the namespace column with `-A`.
pub fn history_table(records: &[RunRecordSpec], all_namespaces: bool, now: Timestamp) -> String {
    let mut rows = Vec::with_capacity(records.len() + 1);
    let mut head = vec![];
    if all_namespaces {
        head.push("NAMESPACE".to_owned());
    }
    head.extend(
        [
            "RUN",
            "OUTCOME",
            "REQUESTED-BY",
            "STEP-PODS",
            "TOKENS",
            "DURATION",
            "FINISHED",
            "RECORD",
        ]
        .map(String::from),
    );
    rows.push(head);
    for r in records {
        let mut row = vec![];
        if all_namespaces {
            row.push(r.run.namespace.clone());
        }
        let mut outcome = format!("{:?}", r.outcome.phase);
        if let Some(reason) = r.outcome.reason.as_deref().filter(|x| *x != "RunSucceeded") {
            outcome.push_str(&format!(" ({reason})"));
        }
        row.extend([
            r.run.name.clone(),
            outcome,
            r.run.requested_by.clone().unwrap_or_else(|| "-".into()),
            r.outcome.step_executions.to_string(),
            r.outcome.tokens_used.to_string(),
            r.outcome.duration.clone().unwrap_or_else(|| "-".into()),
            format!("{} ago", age(r.outcome.completed_at.0, now)),
            record_name(&r.run.name, &r.run.uid),
        ]);
        rows.push(row);
    }
    table(&rows)
}

/// One record in full.
pub fn record_detail(r: &RunRecordSpec, now: Timestamp, style: Style) -> String {
    let mut s = record_head(r, now, style);
    s.push_str(&record_steps(r));
    s.push_str(&record_approvals(r));
    s.push_str(&record_signals(r));
    s
}

/// The record, its run, when it ran and how it ended.
fn record_head(r: &RunRecordSpec, now: Timestamp, style: Style) -> String {
    let mut s = String::new();
    let phase = format!("{:?}", r.outcome.phase);
    let _ = writeln!(
        s,
        "Record {} of run {} in {}: {}",
        record_name(&r.run.name, &r.run.uid),
        r.run.name,
        r.run.namespace,
        style.phase(&phase)
    );
    let _ = writeln!(s, "Run UID: {}", r.run.uid);
    if let Some(u) = &r.run.requested_by {
        let _ = writeln!(s, "Requested by: {u}");
    }
    if let Some(t) = &r.run.rerun {
        let _ = writeln!(s, "Rerun: {t} (agentrun.dev/rerun)");
    }
    if let Some(f) = &r.run.forked_from {
        let _ = writeln!(s, "Forked from: run {f}");
    }
    let started = r
        .outcome
        .started_at
        .as_ref()
        .map(|t| t.0.to_string())
        .unwrap_or_else(|| "-".into());
    let _ = writeln!(
        s,
        "Started: {started}   Finished: {} ({} ago)   Duration: {}",
        r.outcome.completed_at.0,
        age(r.outcome.completed_at.0, now),
        r.outcome.duration.as_deref().unwrap_or("-")
    );
    if let Some(m) = &r.outcome.message {
        let reason = r.outcome.reason.as_deref().unwrap_or("");
        let _ = writeln!(s, "Outcome: {reason}: {m}");
    }
    let _ = writeln!(
        s,
        "Tokens: {}   Step Pods: {}   Plan revision: {}",
        r.outcome.tokens_used, r.outcome.step_executions, r.outcome.plan_revision
    );
    let _ = writeln!(s, "Spec digests: {}", r.run.spec_digests.join(", "));
    s
}

/// The steps' and the compensations' tables, where there are any.
fn record_steps(r: &RunRecordSpec) -> String {
    let mut s = String::new();
    if !r.steps.is_empty() {
        s.push_str("\nSteps:\n");
        let mut rows = vec![
            [
                "STEP",
                "REV",
                "ATTEMPT",
                "PHASE",
                "EFFECT",
                "IDEMPOTENCY-KEY",
                "HOW",
                "TOKENS",
            ]
            .map(String::from)
            .to_vec(),
        ];
        for c in &r.steps {
            let name = match c.role {
                StepRole::Step => c.name.clone(),
                role => format!("{} ({role:?})", c.name),
            };
            let how = c
                .provenance
                .map(|p| format!("{p:?}"))
                .or_else(|| c.decided_by.as_ref().map(|d| format!("by {d}")))
                .unwrap_or_else(|| "-".into());
            rows.push(vec![
                format!("  {name}"),
                c.plan_revision.to_string(),
                c.attempt.to_string(),
                format!("{:?}", c.phase),
                c.effect.map_or_else(|| "-".into(), |e| format!("{e:?}")),
                c.idempotency_key.clone(),
                how,
                c.tokens.to_string(),
            ]);
        }
        s.push_str(&table(&rows));
    }
    if !r.compensations.is_empty() {
        s.push_str("\nCompensations:\n");
        let mut rows = vec![
            ["STEP", "ATTEMPT", "PHASE", "IDEMPOTENCY-KEY"]
                .map(String::from)
                .to_vec(),
        ];
        for c in &r.compensations {
            rows.push(vec![
                format!("  {}", c.name),
                c.attempt.to_string(),
                format!("{:?}", c.phase),
                c.idempotency_key.clone(),
            ]);
        }
        s.push_str(&table(&rows));
    }
    s
}

/// Each approval with who decided it, when, their comment and the votes.
fn record_approvals(r: &RunRecordSpec) -> String {
    let mut s = String::new();
    if !r.approvals.is_empty() {
        s.push_str("\nApprovals:\n");
        for a in &r.approvals {
            let by = a
                .decided_by
                .as_deref()
                .map(|u| format!(" by {u}"))
                .unwrap_or_default();
            let at = a
                .decided_at
                .as_ref()
                .map(|t| format!(" at {}", t.0))
                .unwrap_or_default();
            let _ = writeln!(
                s,
                "  {} ({}, step {}): {}{by}{at}",
                a.name, a.kind, a.step, a.phase
            );
            if let Some(c) = &a.comment {
                let _ = writeln!(s, "    comment: {}", truncate(c, 200));
            }
            if !a.votes.is_empty() {
                let _ = writeln!(s, "    votes: {}", a.votes.join(", "));
            }
        }
    }
    s
}

/// Each signal with its id and sender.
fn record_signals(r: &RunRecordSpec) -> String {
    let mut s = String::new();
    if !r.signals.is_empty() {
        s.push_str("\nSignals:\n");
        for g in &r.signals {
            let id =
                g.id.as_deref()
                    .map(|i| format!(" id {i}"))
                    .unwrap_or_default();
            let by = g
                .sent_by
                .as_deref()
                .map(|u| format!(" from {u}"))
                .unwrap_or_default();
            let _ = writeln!(s, "  {} (step {}): {}{id}{by}", g.name, g.step, g.phase);
        }
    }
    s
}

/// `describe`'s line for the history: the record a finished run left, or
/// the earlier run a run created again was recognised as.
pub fn history_line(run: &AgentRun) -> String {
    let Some(status) = run.status.as_ref() else {
        return String::new();
    };
    let name = run.metadata.name.as_deref().unwrap_or_default();
    if let Some(prior) = &status.already_ran {
        return format!(
            "Already ran: run {name} (UID {}) ended {} at {}; nothing of this run ran. Record: RunRecord {} (kubectl agentrun history {name}). To run it again on purpose, create it with annotation agentrun.dev/rerun set to a new value\n",
            prior.run_uid, prior.outcome, prior.completed_at.0, prior.record
        );
    }
    match &status.record {
        Some(record) => format!(
            "Record: RunRecord {record}, kept after the run is deleted (kubectl agentrun history {name})\n"
        ),
        None => String::new(),
    }
}
