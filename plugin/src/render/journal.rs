//! A step's journal (D19, docs/journal.md) as people read it: the model and
//! tool calls of each (step, plan revision), gathered from its
//! `StepJournal` chunks, with where each call stands. `describe` prints a
//! block per step, `logs` the calls of each attempt, the console's timeline
//! draws them; all three read them from here.
//!
//! ```text
//!   StepJournal <pod prefix>-journal-0  (chunk 0, sealed)  entries seq 0..31 ─┐
//!   StepJournal <pod prefix>-journal-1  (chunk 1)          entries seq 32..  ─┴▶ StepCalls (step, rev)
//!                                         status.settlements (seq → Applied | NotApplied, by)
//! ```

use std::collections::BTreeMap;
use std::fmt::Write;

use agentrun_api::{
    AgentRun, CallKind, CallState, Effect, EffectOutcome, JOURNAL_DEFAULT_MAX_BYTES, JournalEntry,
    Settlement, StepJournal, entry_bytes,
};

use super::text::{Style, truncate};

/// The journal of one step at one plan revision.
#[derive(Debug)]
pub struct StepCalls<'a> {
    pub step: &'a str,
    pub plan_revision: i64,
    /// In the order the step made them (by seq).
    pub calls: Vec<Call<'a>>,
    pub chunks: usize,
    pub sealed: usize,
    /// The highest attempt any chunk carries: the attempt that took the
    /// journal over last.
    pub attempt: i32,
}

/// One recorded call and the operator's settlement of it, if any.
#[derive(Debug, Clone, Copy)]
pub struct Call<'a> {
    pub entry: &'a JournalEntry,
    pub settlement: Option<&'a Settlement>,
}

/// Where a call stands, for people.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Standing<'a> {
    Done,
    /// The tool said it did not act.
    NotApplied,
    /// An intent with no answer and nobody has settled it: it may have acted.
    Unknown,
    /// An intent settled by the verify probe or a person.
    Settled {
        outcome: EffectOutcome,
        by: &'a str,
    },
}

impl<'a> Call<'a> {
    pub fn standing(&self) -> Standing<'a> {
        match (self.entry.state, self.settlement) {
            (CallState::Done, _) => Standing::Done,
            (CallState::NotApplied, _) => Standing::NotApplied,
            (CallState::Intent, Some(s)) => Standing::Settled {
                outcome: s.outcome,
                by: s.by.as_str(),
            },
            (CallState::Intent, None) => Standing::Unknown,
        }
    }

    /// `Done`, `NotApplied`, `Unknown`, or the settled outcome (`Applied`).
    pub fn state_word(&self) -> &'static str {
        match self.standing() {
            Standing::Done => "Done",
            Standing::NotApplied => "NotApplied",
            Standing::Unknown => "Unknown",
            Standing::Settled { outcome, .. } => outcome_word(outcome),
        }
    }

    /// A model call's tokens (input, cached included, and output).
    pub fn tokens(&self) -> Option<i64> {
        self.entry.tokens.map(|t| t.input + t.output)
    }

    pub fn kind_word(&self) -> &'static str {
        match self.entry.kind {
            CallKind::Model => "model",
            CallKind::Tool => "tool",
        }
    }

    pub fn effect_word(&self) -> &'static str {
        match self.entry.effect {
            Some(Effect::None) => "None",
            Some(Effect::Idempotent) => "Idempotent",
            Some(Effect::NonIdempotent) => "NonIdempotent",
            None => "-",
        }
    }

    pub fn non_idempotent(&self) -> bool {
        self.entry.effect == Some(Effect::NonIdempotent)
    }
}

fn outcome_word(o: EffectOutcome) -> &'static str {
    match o {
        EffectOutcome::Applied => "Applied",
        EffectOutcome::NotApplied => "NotApplied",
        EffectOutcome::Unknown => "Unknown",
    }
}

impl StepCalls<'_> {
    /// Tokens of every model call, each counted once whichever attempt made it.
    pub fn tokens(&self) -> i64 {
        self.calls.iter().filter_map(Call::tokens).sum()
    }

    /// The bytes counted against the step's `journal.maxBytes`.
    pub fn bytes(&self) -> i64 {
        self.calls.iter().map(|c| entry_bytes(c.entry)).sum()
    }

    /// Calls recorded by an attempt before `attempt`: what it replayed.
    pub fn replayed_by(&self, attempt: i32) -> Vec<&Call<'_>> {
        self.calls
            .iter()
            .filter(|c| c.entry.attempt < attempt)
            .collect()
    }

    /// Calls `attempt` recorded itself.
    pub fn recorded_by(&self, attempt: i32) -> Vec<&Call<'_>> {
        self.calls
            .iter()
            .filter(|c| c.entry.attempt == attempt)
            .collect()
    }
}

/// The journals of `run` (its chunks, by UID), one per (step, plan
/// revision), ordered by step and revision.
pub fn journals_of<'a>(run: &AgentRun, chunks: &'a [StepJournal]) -> Vec<StepCalls<'a>> {
    let uid = run.metadata.uid.as_deref().unwrap_or_default();
    let mut by_step: BTreeMap<(&str, i64), Vec<&StepJournal>> = BTreeMap::new();
    for j in chunks.iter().filter(|j| j.spec.run_uid == uid) {
        by_step
            .entry((j.spec.step.as_str(), j.spec.plan_revision))
            .or_default()
            .push(j);
    }
    by_step
        .into_iter()
        .map(|((step, plan_revision), mut js)| {
            js.sort_by_key(|j| j.spec.chunk);
            let settlements: Vec<&Settlement> = js
                .iter()
                .flat_map(|j| j.status.iter().flat_map(|s| s.settlements.iter()))
                .collect();
            let mut calls: Vec<Call> = js
                .iter()
                .flat_map(|j| j.spec.entries.iter())
                .map(|entry| Call {
                    entry,
                    // A settlement answers the intent of the attempt it names.
                    settlement: settlements
                        .iter()
                        .copied()
                        .find(|s| s.seq == entry.seq && s.attempt == entry.attempt),
                })
                .collect();
            calls.sort_by_key(|c| c.entry.seq);
            StepCalls {
                step,
                plan_revision,
                calls,
                chunks: js.len(),
                sealed: js.iter().filter(|j| j.spec.sealed).count(),
                attempt: js.iter().map(|j| j.spec.attempt).max().unwrap_or(1),
            }
        })
        .collect()
}

/// The step's `journal.maxBytes`: from the plan the planner wrote, else
/// from `spec.steps`; the default when neither says.
pub fn max_bytes(run: &AgentRun, step: &str) -> i64 {
    let planned = run
        .status
        .as_ref()
        .and_then(|s| s.plan.as_ref())
        .and_then(|p| p.steps.iter().find(|s| s.name == step));
    planned
        .or_else(|| run.spec.steps.iter().find(|s| s.name == step))
        .and_then(|s| s.journal.as_ref())
        .map_or(JOURNAL_DEFAULT_MAX_BYTES, |j| j.max_bytes())
}

/// Whether any step of `run` journals its calls.
pub fn journaled(run: &AgentRun) -> bool {
    let planned = run
        .status
        .iter()
        .flat_map(|s| s.plan.iter().flat_map(|p| p.steps.iter()));
    planned
        .chain(run.spec.steps.iter())
        .any(|s| s.journal.is_some())
}

/// `1 MiB`, `2.1 KiB`, `930 B`.
pub fn bytes(n: i64) -> String {
    let unit = |v: f64, u: &str| {
        let s = format!("{v:.1}");
        format!("{} {u}", s.strip_suffix(".0").unwrap_or(&s))
    };
    match n {
        ..1024 => format!("{n} B"),
        1024..1_048_576 => unit(n as f64 / 1024.0, "KiB"),
        _ => unit(n as f64 / 1_048_576.0, "MiB"),
    }
}

fn plural(n: usize, one: &str) -> String {
    if n == 1 {
        format!("{n} {one}")
    } else {
        format!("{n} {one}s")
    }
}

/// `attempt 1` or `attempts 1, 2`.
fn attempts_word(calls: &[&Call<'_>]) -> String {
    let mut ns: Vec<i32> = calls.iter().map(|c| c.entry.attempt).collect();
    ns.sort_unstable();
    ns.dedup();
    let list: Vec<String> = ns.iter().map(i32::to_string).collect();
    match ns.len() {
        1 => format!("attempt {}", list[0]),
        _ => format!("attempts {}", list.join(", ")),
    }
}

/// The `Journal` block under a step in `describe`: what was recorded, what
/// the current attempt replayed, a row per call, and every call that may
/// have acted with nobody's word on it, with its key. `current` is the
/// step's current attempt (its checkpoint's, or the journal's own).
pub fn journal_block(
    j: &StepCalls<'_>,
    current: i32,
    max_bytes: i64,
    full: bool,
    style: Style,
) -> String {
    let mut s = String::new();
    let models = j
        .calls
        .iter()
        .filter(|c| c.entry.kind == CallKind::Model)
        .count();
    let sealed = if j.sealed > 0 {
        format!(", {} sealed", j.sealed)
    } else {
        String::new()
    };
    let _ = writeln!(
        s,
        "      Journal: {} ({models} model, {} tool) in {}{sealed}",
        plural(j.calls.len(), "call"),
        j.calls.len() - models,
        plural(j.chunks, "chunk"),
    );
    let mut facts = format!(
        "{} of {}, {} tokens",
        bytes(j.bytes()),
        bytes(max_bytes),
        j.tokens()
    );
    let current = current.max(j.attempt);
    if current > 1 {
        let replayed = j.replayed_by(current);
        let _ = write!(
            facts,
            "; attempt {current} replayed {}",
            plural(replayed.len(), "call")
        );
        if !replayed.is_empty() {
            let _ = write!(facts, " of {}", attempts_word(&replayed));
        }
    }
    let _ = writeln!(s, "      {}", style.dim(&facts));
    if !j.calls.is_empty() {
        let calls: Vec<&Call<'_>> = j.calls.iter().collect();
        s.push_str(&call_rows(&calls, "      ", full, false));
    }
    s.push_str(&unknown_lines(&j.calls, "      ", style));
    s
}

/// The calls as aligned rows under a header at `indent` (two spaces
/// between columns); a settled call gets a line saying by whom. Ids and
/// names are cut unless `full`; with `responses`, each call's recorded
/// response and error follow it, whole.
pub fn call_rows(calls: &[&Call<'_>], indent: &str, full: bool, responses: bool) -> String {
    let cut = |s: &str, n: usize| if full { s.to_owned() } else { truncate(s, n) };
    let mut rows: Vec<[String; 8]> = vec![
        [
            "SEQ", "KIND", "ID", "NAME", "EFFECT", "STATE", "TOKENS", "BY",
        ]
        .map(String::from),
    ];
    for c in calls {
        rows.push([
            c.entry.seq.to_string(),
            c.kind_word().into(),
            cut(&c.entry.call_id, 10),
            cut(c.entry.name.as_deref().unwrap_or("-"), 9),
            c.effect_word().into(),
            c.state_word().into(),
            c.tokens().map_or_else(|| "-".into(), |t| t.to_string()),
            format!("a{}", c.entry.attempt),
        ]);
    }
    let widths: Vec<usize> = (0..8)
        .map(|i| rows.iter().map(|r| r[i].chars().count()).max().unwrap_or(0))
        .collect();
    let mut out = String::new();
    for (n, r) in rows.iter().enumerate() {
        let mut line = indent.to_owned();
        for (i, cell) in r.iter().enumerate() {
            line.push_str(cell);
            line.push_str(&" ".repeat(widths[i] - cell.chars().count() + 2));
        }
        out.push_str(line.trim_end());
        out.push('\n');
        let Some(c) = n.checked_sub(1).map(|i| calls[i]) else {
            continue;
        };
        if responses {
            if let Some(r) = &c.entry.response {
                let _ = writeln!(out, "{indent}    response {r}");
            }
            if let Some(e) = &c.entry.error {
                let _ = writeln!(out, "{indent}    error {e}");
            }
        }
        if let (Some(st), CallState::Intent) = (c.settlement, c.entry.state) {
            let _ = writeln!(
                out,
                "{indent}  ↳ settled {} by {} at {}",
                outcome_word(st.outcome),
                cut(&st.by, 24),
                st.at.0
            );
            if let (true, Some(r)) = (responses, &st.response) {
                let _ = writeln!(out, "{indent}    settled response {r}");
            }
        }
    }
    out
}

/// A prominent line for each call that may have acted and that nobody has
/// settled: its seq, tool, id and key, the facts a person answering the
/// Reconcile question needs.
pub fn unknown_lines(calls: &[Call<'_>], indent: &str, style: Style) -> String {
    let mut s = String::new();
    for c in calls.iter().filter(|c| c.standing() == Standing::Unknown) {
        let head = format!(
            "! call {} {} is Unknown: it may have acted, and nobody has settled it",
            c.entry.seq,
            c.entry.name.as_deref().unwrap_or("-"),
        );
        let _ = writeln!(s, "{indent}{}", style.warn(&head));
        let _ = writeln!(
            s,
            "{indent}  id {}  key {}",
            c.entry.call_id,
            c.entry.key.as_deref().unwrap_or("-")
        );
    }
    s
}

/// What attempt `attempt` of a step did with its journal, for `logs`: a
/// line saying how many calls it replayed (recorded by earlier attempts)
/// and recorded, its own calls, and those of them that may have acted with
/// nobody's word on them. Nothing when the step has no journal.
pub fn attempt_calls(j: &StepCalls<'_>, attempt: i32, responses: bool, style: Style) -> String {
    let mut s = String::new();
    let replayed = j.replayed_by(attempt);
    let recorded = j.recorded_by(attempt);
    let mut what = Vec::new();
    if attempt > 1 {
        what.push(format!("replayed {}", plural(replayed.len(), "call")));
    }
    what.push(format!("recorded {}", plural(recorded.len(), "call")));
    let _ = writeln!(
        s,
        "--- journal of step {} r{}, attempt {attempt}: {} ---",
        j.step,
        j.plan_revision,
        what.join(", ")
    );
    if !recorded.is_empty() {
        s.push_str(&call_rows(&recorded, "    ", responses, responses));
    }
    let own: Vec<Call<'_>> = recorded.into_iter().copied().collect();
    s.push_str(&unknown_lines(&own, "    ", style));
    s
}

#[cfg(test)]
mod tests {
    use super::bytes;

    #[test]
    fn sizes_read_in_the_largest_whole_unit_with_one_decimal() {
        for (n, want) in [
            (930, "930 B"),
            (1023, "1023 B"),
            (1024, "1 KiB"),
            (2150, "2.1 KiB"),
            (4096, "4 KiB"),
            (1_048_576, "1 MiB"),
            (8_388_608, "8 MiB"),
        ] {
            assert_eq!(bytes(n), want, "{n}");
        }
    }
}
