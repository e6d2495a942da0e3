//! *Journaled calls* (D19): a journaled step's effects are its calls, so
//! the referee counts per call, from the ledger's `callExecuted` lines (what
//! was really made) and the journals as the API server holds them at the
//! end (what was recorded and settled). A journal belongs to one (run, step,
//! plan revision), whose step key the ledger names, so a call is
//! (run, step, step key, call id); the same call id at another revision is
//! the same call asked under a new key.
//!
//! ```text
//!   ledger callExecuted ──┐
//!   StepJournal entries ──┼─▶ per (run, step, step key, call id) ─▶ duplicates, lost calls
//!   chunks' settlements ──┘                  └─ per (run, step, call id) across keys ─▶ duplicates
//!   declared calls of each journaled step (the workload) + committed checkpoints
//! ```
//!
//! - **duplicate** under one key: a call made again. A NonIdempotent tool
//!   call may be made again only after its earlier making was settled
//!   `NotApplied` for the attempt that made it (which a truthful probe never
//!   says of a call that was made: any repeat is a duplicate); any other
//!   call (a model asked) only when the attempt that made it never recorded
//!   its answer — a recorded answer is replayed, never asked again.
//! - **duplicate** under another key (a re-plan gave the step a new key and
//!   a new journal): a tool call with an effect that an earlier revision
//!   made, and no settlement says `NotApplied`, needs a person's leave given
//!   before it is made again, as a step's effect does (`repeated_effect`): a
//!   `Retry` or an approved repeat for a `NonIdempotent` call, an approved
//!   repeat for an `Idempotent` one (the new key defeats the tool's dedup).
//!   A model may be asked again under a new key: the new revision's journal
//!   starts empty by design (docs/journal.md).
//! - **lost**: a `Done` entry no making of the call by its attempt stands
//!   behind (a made-up answer), an `Applied` settlement of a call its
//!   attempt never made, or a step committed `Succeeded` whose journal lacks
//!   a call the workload declared, answered (`Done`, or settled `Applied`).

use std::collections::{BTreeMap, BTreeSet};

use agentrun_operator::api::{
    CallState, CheckpointState, Effect, EffectOutcome, JournalEntry, StepJournal, StepPhase,
    StepRole,
};
use agentrun_operator::engine::{PodRole, idempotency_key};
use jiff::Timestamp;
use kube::ResourceExt;

use super::facts::{Facts, LeaveKind};

/// What the per-call referee found.
#[derive(Debug, Default)]
pub(super) struct Calls {
    /// Calls really made (`callExecuted` lines).
    pub executed: usize,
    /// Calls settled by a probe or a person, and of them `Applied`.
    pub settled: usize,
    pub settled_applied: usize,
    pub duplicates: Vec<String>,
    /// (run, finding) per lost call.
    pub lost: Vec<(String, String)>,
}

/// One making of a call, from the ledger.
struct Made<'a> {
    /// The step key it was made under.
    key: &'a str,
    attempt: i32,
    at: Timestamp,
    pod: &'a str,
}

/// (run, step, call id): one call across every revision.
type CallId<'a> = (&'a str, &'a str, &'a str);
/// (run, step, step key, call id): one call of one journal.
type JournalCall<'a> = (&'a str, &'a str, &'a str, &'a str);

/// The step key of chunk `j`'s journal: its revision's checkpoint's key in
/// the run as it ended, else the key the operator derives for it.
fn step_key(f: &Facts<'_>, j: &StepJournal) -> String {
    f.e.final_runs
        .iter()
        .filter(|r| {
            r.name_any() == j.spec.run_name && r.uid().unwrap_or_default() == j.spec.run_uid
        })
        .flat_map(|r| r.status.iter().flat_map(|s| s.steps.iter()))
        .find(|c| {
            // A verify probe carries its step's key.
            (c.role.is_step() || c.role == StepRole::Verify)
                && c.name == j.spec.step
                && c.plan_revision == j.spec.plan_revision
        })
        .map(|c| c.idempotency_key.clone())
        .unwrap_or_else(|| {
            idempotency_key(
                &j.spec.run_uid,
                PodRole::Step,
                &j.spec.step,
                j.spec.plan_revision,
            )
        })
}

/// The journals as the API server holds them at the end, per call.
struct Journals<'a> {
    entries: BTreeMap<JournalCall<'a>, Vec<&'a JournalEntry>>,
    /// Per (run, step, step key, seq, attempt): how the call was settled.
    settled: BTreeMap<(&'a str, &'a str, &'a str, i64, i32), EffectOutcome>,
}

impl<'a> Journals<'a> {
    fn recorded(
        &self,
        run: &'a str,
        step: &'a str,
        key: &'a str,
        call: &'a str,
    ) -> &[&'a JournalEntry] {
        self.entries
            .get(&(run, step, key, call))
            .map(Vec::as_slice)
            .unwrap_or(&[])
    }

    fn settlement(
        &self,
        run: &'a str,
        step: &'a str,
        key: &'a str,
        seq: i64,
        attempt: i32,
    ) -> Option<EffectOutcome> {
        self.settled.get(&(run, step, key, seq, attempt)).copied()
    }

    /// The call's making by `attempt` under `key` was settled `NotApplied`:
    /// it did not act.
    fn not_applied(
        &self,
        run: &'a str,
        step: &'a str,
        call: &'a str,
        key: &'a str,
        attempt: i32,
    ) -> bool {
        self.recorded(run, step, key, call)
            .first()
            .is_some_and(|x| {
                self.settlement(run, step, key, x.seq, attempt) == Some(EffectOutcome::NotApplied)
            })
    }
}

pub(super) fn check(f: &Facts<'_>) -> Calls {
    let e = f.e;
    let mut out = Calls::default();
    let mut made: BTreeMap<CallId<'_>, Vec<Made<'_>>> = BTreeMap::new();
    for (line, call) in e.ledger.calls() {
        out.executed += 1;
        let id = (
            line.run.as_deref().unwrap_or(""),
            line.step.as_deref().unwrap_or(""),
            call.id.as_str(),
        );
        made.entry(id).or_default().push(Made {
            key: line.key(),
            attempt: line.attempt.unwrap_or(0) as i32,
            at: call.at,
            pod: &line.pod,
        });
    }
    for xs in made.values_mut() {
        xs.sort_by_key(|m| m.at);
    }
    // Per call of a journal: its entries, and per (seq, attempt) the settlement.
    let keys: Vec<String> = e.journals.iter().map(|j| step_key(f, j)).collect();
    let mut entries: BTreeMap<JournalCall<'_>, Vec<&JournalEntry>> = BTreeMap::new();
    let mut settled: BTreeMap<(&str, &str, &str, i64, i32), EffectOutcome> = BTreeMap::new();
    let mut effects: BTreeMap<CallId<'_>, Effect> = BTreeMap::new();
    for (j, key) in e.journals.iter().zip(&keys) {
        let (run, step) = (j.spec.run_name.as_str(), j.spec.step.as_str());
        for x in &j.spec.entries {
            entries
                .entry((run, step, key.as_str(), x.call_id.as_str()))
                .or_default()
                .push(x);
            if let Some(effect) = x.effect {
                effects.insert((run, step, x.call_id.as_str()), effect);
            }
        }
        for s in j.status.iter().flat_map(|s| s.settlements.iter()) {
            if s.outcome != EffectOutcome::Unknown {
                out.settled += 1;
                out.settled_applied += usize::from(s.outcome == EffectOutcome::Applied);
                settled.insert((run, step, key.as_str(), s.seq, s.attempt), s.outcome);
            }
        }
    }
    let j = Journals { entries, settled };
    for (&(run, step, call), xs) in &made {
        let effect = effects.get(&(run, step, call)).copied();
        let leaves = f.leaves(run, step);
        for (p, m) in xs.iter().enumerate() {
            // Under its own key: against the last making under that key.
            if let Some(before) = xs[..p].iter().rev().find(|y| y.key == m.key) {
                let allowed = if effect == Some(Effect::NonIdempotent) {
                    j.not_applied(run, step, call, before.key, before.attempt)
                } else {
                    !j.recorded(run, step, m.key, call)
                        .iter()
                        .any(|x| x.state == CallState::Done && x.attempt == before.attempt)
                };
                if !allowed {
                    out.duplicates.push(format!(
                        "duplicate: run {run} step {step} call {call} made again by pod {} (attempt {}) at {}, after pod {} (attempt {}) made it at {}{}",
                        m.pod,
                        m.attempt,
                        m.at,
                        before.pod,
                        before.attempt,
                        before.at,
                        if effect == Some(Effect::NonIdempotent) {
                            " and it was not settled NotApplied"
                        } else {
                            " and recorded its answer"
                        }
                    ));
                }
            }
            // Under another key: a tool's effect again needs a person's leave.
            let kinds: &[LeaveKind] = match effect {
                Some(Effect::NonIdempotent) => &[LeaveKind::Retry, LeaveKind::Repeat],
                Some(Effect::Idempotent) => &[LeaveKind::Repeat],
                _ => continue,
            };
            let acted: BTreeSet<&str> = xs[..p]
                .iter()
                .filter(|y| y.key != m.key && !j.not_applied(run, step, call, y.key, y.attempt))
                .map(|y| y.key)
                .collect();
            let allowed = leaves
                .iter()
                .filter(|l| kinds.contains(&l.kind) && l.before(m.at))
                .count();
            if acted.len() > allowed {
                out.duplicates.push(format!(
                    "duplicate: run {run} step {step} call {call} ({effect:?}) made again by pod {} (attempt {}) at {} under a new key, after it was made under {} key(s) ({}) and a person allowed {allowed} repeat(s) before it",
                    m.pod,
                    m.attempt,
                    m.at,
                    acted.len(),
                    acted.into_iter().collect::<Vec<_>>().join(", "),
                    effect = effect.unwrap_or(Effect::None),
                ));
            }
        }
    }

    let made_by = |run: &str, step: &str, key: &str, call: &str, attempt: i32| {
        made.get(&(run, step, call))
            .is_some_and(|xs| xs.iter().any(|m| m.key == key && m.attempt == attempt))
    };
    for (&(run, step, key, call), xs) in &j.entries {
        for x in xs.iter().filter(|x| x.state == CallState::Done) {
            if !made_by(run, step, key, call, x.attempt) {
                out.lost.push((
                    run.to_owned(),
                    format!(
                        "lost: run {run} step {step} call {call} (seq {}) recorded Done by attempt {}, which the ledger never saw make it",
                        x.seq, x.attempt
                    ),
                ));
            }
        }
    }
    for (&(run, step, key, seq, attempt), outcome) in &j.settled {
        if *outcome != EffectOutcome::Applied {
            continue;
        }
        let call = j
            .entries
            .iter()
            .filter(|((r, s, k, _), _)| (*r, *s, *k) == (run, step, key))
            .flat_map(|(_, xs)| xs.iter())
            .find(|x| x.seq == seq)
            .map(|x| x.call_id.as_str());
        if !call.is_some_and(|c| made_by(run, step, key, c, attempt)) {
            out.lost.push((
                run.to_owned(),
                format!(
                    "lost: run {run} step {step} call {} (seq {seq}) settled Applied for attempt {attempt}, which never made it",
                    call.unwrap_or("?")
                ),
            ));
        }
    }

    for r in e.final_runs {
        let run = r.metadata.name.as_deref().unwrap_or("");
        for c in r.status.iter().flat_map(|s| s.steps.iter()) {
            // The step's own checkpoint, not its probe's.
            if !c.role.is_step()
                || c.phase != StepPhase::Succeeded
                || c.checkpoint != CheckpointState::Committed
            {
                continue;
            }
            let Some(declared) = e.declared_calls.get(&(run.to_owned(), c.name.clone())) else {
                continue;
            };
            let (name, key) = (c.name.as_str(), c.idempotency_key.as_str());
            for call in declared {
                let answered = j.recorded(run, name, key, call).iter().any(|x| {
                    x.state == CallState::Done
                        || (x.state == CallState::Intent
                            && j.settlement(run, name, key, x.seq, x.attempt)
                                == Some(EffectOutcome::Applied))
                });
                if !answered {
                    out.lost.push((
                        run.to_owned(),
                        format!(
                            "lost: run {run} step {name} committed Succeeded but its journal holds no answer to call {call}"
                        ),
                    ));
                }
            }
        }
    }
    out
}

#[cfg(test)]
mod tests;
