//! What the plugin prints, as pure functions of the objects (and of `now`),
//! so the output is tested on real status objects without a cluster.

use std::fmt::Write;

use agentrun_api::{
    AgentRun, AgentRunStatus, Approval, ApprovalKind, EffectOutcome, RunPhase, Signal,
    StepCheckpoint, StepJournal, StepPhase, StepRole,
};
use agentrun_engine::human_duration;
use jiff::Timestamp;
use k8s_openapi::api::events::v1::Event;

mod approval;
mod history;
pub mod journal;
mod plan;
mod signal;
mod text;
use approval::approval_lines;
pub use approval::{is_pending, pending, question};
pub use history::{history_line, history_table, record_detail};
pub use plan::{graph_lines, lineage_line};
pub use signal::{SignalStep, deadline, signal_step, waiting_signal, waits_for_signal};
use text::mark;
pub use text::{Style, age, short, table, truncate};

fn name(run: &AgentRun) -> &str {
    run.metadata.name.as_deref().unwrap_or("")
}

/// The approval a run waits on, with who may decide it, e.g.
/// `refund-…-approve (group payments-leads)`.
pub fn waiting_for(run: &AgentRun, approvals: &[Approval]) -> Option<String> {
    let status = run.status.as_ref()?;
    let cp = status
        .steps
        .iter()
        .find(|c| c.phase == StepPhase::WaitingForApproval)?;
    let apv = cp.approval.clone()?;
    let who = approvals
        .iter()
        .find(|a| a.metadata.name.as_deref() == Some(&apv))
        .and_then(|a| a.spec.approvers.as_ref())
        .map(|a| format!(" ({})", a.describe()))
        .unwrap_or_default();
    Some(format!("{apv}{who}"))
}

/// For the list: `approval (user alice)`, `approval (anyone)`, or
/// `signal (payment settled)`; the Approval's or Signal's name is in
/// `describe` and `pending`.
pub fn waiting_who(run: &AgentRun, approvals: &[Approval]) -> Option<String> {
    let status = run.status.as_ref()?;
    let Some(cp) = status
        .steps
        .iter()
        .find(|c| c.phase == StepPhase::WaitingForApproval)
    else {
        return waiting_signal(run).map(|(_, s)| truncate(&s.what(), 40));
    };
    let apv = cp.approval.as_deref()?;
    let a = approvals
        .iter()
        .find(|a| a.metadata.name.as_deref() == Some(apv));
    let what = match a.map(|a| a.spec.kind) {
        Some(ApprovalKind::Reconcile) => "reconcile",
        _ => "approval",
    };
    let who = a
        .and_then(|a| a.spec.approvers.as_ref())
        .map(|ap| truncate(&ap.describe(), 30))
        .unwrap_or_else(|| "anyone".into());
    Some(format!("{what} ({who})"))
}

/// `kubectl agentrun list`.
pub fn list(
    runs: &[AgentRun],
    approvals: &[Approval],
    all_namespaces: bool,
    now: Timestamp,
    style: Style,
) -> String {
    let mut rows = vec![];
    let mut head: Vec<String> = vec![];
    if all_namespaces {
        head.push("NAMESPACE".into());
    }
    head.extend(
        [
            "NAME",
            "PHASE",
            "STEP",
            "PROGRESS",
            "TOKENS",
            "WAITING-FOR",
            "DURATION",
            "AGE",
        ]
        .map(String::from),
    );
    rows.push(head);
    for run in runs {
        let status = run.status.clone().unwrap_or_default();
        let mut row: Vec<String> = vec![];
        if all_namespaces {
            row.push(run.metadata.namespace.clone().unwrap_or_default());
        }
        let phase = status.phase.map(|p| format!("{p:?}")).unwrap_or_default();
        let tokens = match run.spec.budget.as_ref().and_then(|b| b.tokens) {
            Some(b) => format!("{}/{b}", status.tokens_used),
            None => status.tokens_used.to_string(),
        };
        let created = run
            .metadata
            .creation_timestamp
            .as_ref()
            .map(|t| age(t.0, now))
            .unwrap_or_default();
        let took = run_duration(&status, now);
        row.extend([
            name(run).to_owned(),
            style.phase(&phase),
            status.current_step.unwrap_or_else(|| "-".into()),
            status.progress.unwrap_or_else(|| "-".into()),
            tokens,
            waiting_who(run, approvals).unwrap_or_else(|| "-".into()),
            took,
            created,
        ]);
        rows.push(row);
    }
    table(&rows)
}

fn effect(e: Option<EffectOutcome>) -> &'static str {
    match e {
        Some(EffectOutcome::Applied) => "Applied",
        Some(EffectOutcome::NotApplied) => "NotApplied",
        Some(EffectOutcome::Unknown) => "Unknown",
        None => "-",
    }
}

fn step_line(
    cp: &StepCheckpoint,
    sig: Option<&SignalStep>,
    now: Timestamp,
    full: bool,
    style: Style,
) -> String {
    let mut s = String::new();
    let role = match cp.role {
        StepRole::Step => String::new(),
        StepRole::Planner => " (planner)".into(),
        StepRole::Compactor => " (compactor)".into(),
        StepRole::Verify => " (verify probe)".into(),
    };
    let _ = writeln!(
        s,
        "  {} {}{role}  r{} attempt {}  {}  effect {}",
        mark(cp.phase),
        cp.name,
        cp.plan_revision,
        cp.attempt,
        style.phase(&format!("{:?}", cp.phase)),
        effect(cp.effect),
    );
    let mut facts = vec![format!("key {}", cp.idempotency_key)];
    if let Some(t) = cp.tokens {
        facts.push(format!("tokens {}", t.total()));
    }
    if let (true, Some(a), Some(b)) = (cp.attempt > 0, &cp.started_at, &cp.finished_at) {
        facts.push(format!("took {}", short(b.0.duration_since(a.0))));
    }
    let _ = writeln!(s, "      {}", style.dim(&facts.join("  ")));
    if let Some(pod) = &cp.pod {
        let _ = writeln!(s, "      {}", style.dim(&format!("pod {pod}")));
    }
    // What a signal step's message would say, said more plainly: what it
    // waits for and how to send it, or what came.
    let mut said = false;
    match (cp.phase, sig) {
        (StepPhase::Waiting, Some(g)) => {
            let _ = writeln!(s, "      waits for {}: Signal {}", g.what(), g.name);
            match g.expires {
                Some(t) => {
                    let _ = writeln!(s, "      expires at {}", deadline(t, now));
                }
                None => {
                    let _ = writeln!(s, "      no deadline: it waits until the signal comes");
                }
            }
            let _ = writeln!(s, "      send with: {}", g.command(None));
            said = true;
        }
        (StepPhase::Succeeded, Some(g)) => said = g.id.is_some(),
        _ => {}
    }
    if let (StepPhase::Waiting, None, Some(wake)) = (cp.phase, sig, &cp.wake_at) {
        let left = if wake.0 > now {
            format!("in {}", short(wake.0.duration_since(now)))
        } else {
            "now".into()
        };
        let _ = writeln!(s, "      wakes at {} ({left})", wake.0);
    }
    if let Some(until) = &cp.fresh_until {
        let stale = if until.0 <= now { " (stale)" } else { "" };
        let _ = writeln!(s, "      fresh until {}{stale}", until.0);
    }
    if let Some(r) = &cp.result {
        let text = r.to_string();
        let text = if full { text } else { truncate(&text, 66) };
        let _ = writeln!(s, "      result {text}");
    } else if cp.result_truncated {
        let _ = writeln!(s, "      result not kept in status");
    }
    match (sig, &cp.decided_by) {
        (Some(g), _) if cp.phase == StepPhase::Succeeded => {
            let _ = writeln!(s, "      {}", g.received());
        }
        (_, Some(by)) => {
            let _ = writeln!(s, "      released by {by}");
        }
        _ => {}
    }
    if let Some(m) = cp.message.as_ref().filter(|_| !said) {
        // What went wrong is often past the first line (a result's
        // mismatches, a Reconcile question): three lines before it is cut.
        let lines = if full {
            vec![m.clone()]
        } else {
            wrap(m, 72, 3)
        };
        for line in lines {
            let _ = writeln!(s, "      {line}");
        }
    }
    s
}

/// `text` in lines of at most `width` characters, broken between words (a
/// word longer than a line is cut), at most `max` of them: the last ends
/// with `…` when there was more.
pub fn wrap(text: &str, width: usize, max: usize) -> Vec<String> {
    let mut lines: Vec<String> = Vec::new();
    let mut line = String::new();
    for word in text.split_whitespace() {
        let fits = line.is_empty() || line.chars().count() + 1 + word.chars().count() <= width;
        if !fits {
            lines.push(std::mem::take(&mut line));
        }
        if !line.is_empty() {
            line.push(' ');
        }
        line.push_str(word);
    }
    if !line.is_empty() {
        lines.push(line);
    }
    let more = lines.len() > max;
    lines.truncate(max);
    for l in &mut lines {
        *l = truncate(l, width);
    }
    if more && let Some(last) = lines.last_mut() {
        let mut t = truncate(last, width - 1);
        if !t.ends_with('…') {
            t.push('…');
        }
        *last = t;
    }
    lines
}

/// How long the run has taken: to its end once it finished (what the
/// operator recorded), to now while it runs; `-` before it started (queued).
pub fn run_duration(status: &AgentRunStatus, now: Timestamp) -> String {
    if let Some(d) = &status.duration {
        return d.clone();
    }
    match (&status.started_at, &status.completed_at) {
        (Some(s), Some(c)) => human_duration(c.0.duration_since(s.0)),
        (Some(s), None) => human_duration(now.duration_since(s.0)),
        _ => "-".into(),
    }
}

/// The objects around a run that `describe` shows, each where it could be
/// read (none: what the run's status says).
#[derive(Clone, Copy, Debug, Default)]
pub struct Related<'a> {
    pub approvals: &'a [Approval],
    pub signals: &'a [Signal],
    /// Its steps' journal chunks (`StepJournal`).
    pub journals: &'a [StepJournal],
    pub events: &'a [Event],
}

/// `kubectl agentrun describe RUN`: a readable tree of the run.
pub fn describe(
    run: &AgentRun,
    related: &Related<'_>,
    now: Timestamp,
    full: bool,
    style: Style,
) -> String {
    let Related {
        approvals,
        signals,
        journals,
        events,
    } = *related;
    let status = run.status.clone().unwrap_or_default();
    let mut s = head_lines(run, &status, style);
    s.push_str(&waiting_lines(run, &status, approvals, signals, now));
    s.push_str(&graph_lines(run, &status));
    s.push_str(&step_lines(
        run, &status, signals, journals, now, full, style,
    ));
    s.push_str(&approval_section(run, approvals));
    s.push_str(&event_lines(events, now));
    s
}

/// The run, its plan, where it came from, its tokens and step Pods.
fn head_lines(run: &AgentRun, status: &AgentRunStatus, style: Style) -> String {
    let mut s = String::new();
    let phase = status.phase.map(|p| format!("{p:?}")).unwrap_or("-".into());
    let _ = writeln!(
        s,
        "Run {} in {}: {}",
        name(run),
        run.metadata.namespace.as_deref().unwrap_or("default"),
        style.phase(&phase)
    );
    if let Some(p) = &status.plan {
        let _ = writeln!(
            s,
            "Plan: revision {} from {:?} ({})",
            p.revision, p.source, p.reason
        );
    }
    s.push_str(&lineage_line(run, status));
    s.push_str(&history_line(run));
    let budget = run.spec.budget.clone().unwrap_or_default();
    let of = |n: Option<i64>| n.map(|b| format!(" of {b}")).unwrap_or_default();
    let _ = writeln!(
        s,
        "Tokens: {}{}   Step Pods: {}{}",
        status.tokens_used,
        of(budget.tokens),
        status.step_executions,
        of(budget.step_executions.map(i64::from)),
    );
    s
}

/// A `Waiting for:` line for each thing the run waits for: an Approval, a
/// place to start, a signal, a wake-up time.
fn waiting_lines(
    run: &AgentRun,
    status: &AgentRunStatus,
    approvals: &[Approval],
    signals: &[Signal],
    now: Timestamp,
) -> String {
    let mut s = String::new();
    if let Some(w) = waiting_for(run, approvals) {
        let until = status
            .steps
            .iter()
            .find(|c| c.phase == StepPhase::WaitingForApproval)
            .and_then(|c| c.approval.as_deref())
            .and_then(|n| {
                approvals
                    .iter()
                    .find(|a| a.metadata.name.as_deref() == Some(n))
            })
            .and_then(|a| a.spec.expires_at.as_ref())
            .map(|t| format!(", until {} (in {})", t.0, short(t.0.duration_since(now))))
            .unwrap_or_default();
        let _ = writeln!(s, "Waiting for: Approval {w}{until}");
    }
    if status.phase == Some(RunPhase::Queued) {
        // The Succeeded condition says where and why.
        let why = status
            .conditions
            .iter()
            .find(|c| c.type_ == "Succeeded")
            .map(|c| c.message.clone())
            .unwrap_or_else(|| "queued".into());
        for line in wrap(&format!("Waiting for: a place to start, {why}"), 78, 3) {
            let _ = writeln!(s, "{line}");
        }
    }
    for (c, g) in status
        .steps
        .iter()
        .filter(|c| c.phase == StepPhase::Waiting)
        .filter_map(|c| Some((c, signal_step(run, c, signals)?)))
    {
        // What it is and how to send it are under the step.
        let until = g
            .expires
            .map(|t| format!(", until {}", deadline(t, now)))
            .unwrap_or_else(|| " (no deadline)".into());
        let line = format!("Waiting for: signal on step {}{until}", c.name);
        for line in wrap(&line, 78, 2) {
            let _ = writeln!(s, "{line}");
        }
    }
    if let Some(w) = status
        .steps
        .iter()
        .filter(|c| c.phase == StepPhase::Waiting && c.signal.is_none())
        .filter_map(|c| Some((c, c.wake_at.as_ref()?)))
        .min_by_key(|(_, t)| t.0)
    {
        let (c, t) = w;
        let _ = writeln!(
            s,
            "Waiting for: step {} to wake at {} (in {})",
            c.name,
            t.0,
            short(t.0.duration_since(now))
        );
    }
    s
}

/// `Steps:` (each with its journal, if it has one) and, if any ran,
/// `Compensations:`.
fn step_lines(
    run: &AgentRun,
    status: &AgentRunStatus,
    signals: &[Signal],
    journals: &[StepJournal],
    now: Timestamp,
    full: bool,
    style: Style,
) -> String {
    let mut s = String::new();
    let _ = writeln!(s, "Steps:");
    let mut journals = journal::journals_of(run, journals);
    for cp in &status.steps {
        let sig = signal_step(run, cp, signals);
        s.push_str(&step_line(cp, sig.as_ref(), now, full, style));
        if cp.role != StepRole::Step {
            continue;
        }
        if let Some(i) = journals
            .iter()
            .position(|j| j.step == cp.name && j.plan_revision == cp.plan_revision)
        {
            let j = journals.remove(i);
            let max = journal::max_bytes(run, j.step);
            s.push_str(&journal::journal_block(&j, cp.attempt, max, full, style));
        }
    }
    // Chunks of a (step, revision) the status has no checkpoint of.
    for j in &journals {
        let _ = writeln!(s, "  · {}  r{}  (no checkpoint)", j.step, j.plan_revision);
        let max = journal::max_bytes(run, j.step);
        s.push_str(&journal::journal_block(j, j.attempt, max, full, style));
    }
    if !status.compensations.is_empty() {
        let _ = writeln!(s, "Compensations:");
        for c in &status.compensations {
            let _ = writeln!(
                s,
                "  {} undo {}  r{} attempt {}  {}  key {}",
                mark(c.phase),
                c.name,
                c.plan_revision,
                c.attempt,
                style.phase(&format!("{:?}", c.phase)),
                c.idempotency_key
            );
        }
    }
    s
}

/// `Approvals:`, the run's own (by UID), if it has any.
fn approval_section(run: &AgentRun, approvals: &[Approval]) -> String {
    let mut s = String::new();
    let mine: Vec<&Approval> = approvals
        .iter()
        .filter(|a| Some(a.spec.run_uid.as_str()) == run.metadata.uid.as_deref())
        .collect();
    if !mine.is_empty() {
        let _ = writeln!(s, "Approvals:");
        for a in mine {
            s.push_str(&approval_lines(a));
        }
    }
    s
}

/// `Events:`, the last eight, if there are any.
fn event_lines(events: &[Event], now: Timestamp) -> String {
    let mut s = String::new();
    if !events.is_empty() {
        let _ = writeln!(s, "Events:");
        let mut rows = vec![];
        for e in events.iter().rev().take(8).rev() {
            let at = e
                .event_time
                .as_ref()
                .map(|t| t.0)
                .or_else(|| e.deprecated_last_timestamp.as_ref().map(|t| t.0))
                .map(|t| age(t, now))
                .unwrap_or_default();
            rows.push(vec![
                format!("  {at}"),
                e.type_.clone().unwrap_or_default(),
                e.reason.clone().unwrap_or_default(),
                truncate(e.note.as_deref().unwrap_or(""), 50),
            ]);
        }
        s.push_str(&table(&rows));
    }
    s
}
