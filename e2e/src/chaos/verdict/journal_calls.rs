//! *Journaled calls* (D19): a journaled step's effects are its calls, so
//! the referee counts per (run, step, call id), from the ledger's
//! `callExecuted` lines (what was really made) and the journals as the API
//! server holds them at the end (what was recorded and settled).
//!
//! ```text
//!   ledger callExecuted ──┐
//!   StepJournal entries ──┼─▶ per (run, step, call id) ─▶ duplicates, lost calls
//!   chunks' settlements ──┘
//!   declared calls of each journaled step (the workload) + committed checkpoints
//! ```
//!
//! - **duplicate**: a call made again. A NonIdempotent tool call may be made
//!   again only after its earlier making was settled `NotApplied` for the
//!   attempt that made it (which a truthful probe never says of a call that
//!   was made: any repeat is a duplicate); any other call (a model asked)
//!   only when the attempt that made it never recorded its answer — a
//!   recorded answer is replayed, never asked again.
//! - **lost**: a `Done` entry no making of the call by its attempt stands
//!   behind (a made-up answer), an `Applied` settlement of a call its
//!   attempt never made, or a step committed `Succeeded` whose journal lacks
//!   a call the workload declared, answered (`Done`, or settled `Applied`).

use std::collections::BTreeMap;

use agentrun_operator::api::{
    CallState, CheckpointState, Effect, EffectOutcome, JournalEntry, StepPhase,
};
use jiff::Timestamp;
use kube::ResourceExt;

use super::facts::Facts;

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
    attempt: i32,
    at: Timestamp,
    pod: &'a str,
}

type CallId<'a> = (&'a str, &'a str, &'a str);

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
            attempt: line.attempt.unwrap_or(0) as i32,
            at: call.at,
            pod: &line.pod,
        });
    }
    for xs in made.values_mut() {
        xs.sort_by_key(|m| m.at);
    }
    // Per call: its entries (every revision), and per (seq, attempt) the settlement.
    let mut entries: BTreeMap<CallId<'_>, Vec<&JournalEntry>> = BTreeMap::new();
    let mut settled: BTreeMap<(&str, &str, i64, i32), EffectOutcome> = BTreeMap::new();
    for j in e.journals {
        let (run, step) = (j.spec.run_name.as_str(), j.spec.step.as_str());
        for x in &j.spec.entries {
            entries
                .entry((run, step, x.call_id.as_str()))
                .or_default()
                .push(x);
        }
        for s in j.status.iter().flat_map(|s| s.settlements.iter()) {
            if s.outcome != EffectOutcome::Unknown {
                out.settled += 1;
                out.settled_applied += usize::from(s.outcome == EffectOutcome::Applied);
                settled.insert((run, step, s.seq, s.attempt), s.outcome);
            }
        }
    }

    for (&(run, step, call), xs) in &made {
        let recorded = entries
            .get(&(run, step, call))
            .map(Vec::as_slice)
            .unwrap_or(&[]);
        let non_idempotent = recorded
            .iter()
            .any(|x| x.effect == Some(Effect::NonIdempotent));
        let seq = recorded.first().map(|x| x.seq);
        for (p, m) in xs.iter().enumerate().skip(1) {
            let before = &xs[p - 1];
            let allowed = if non_idempotent {
                seq.and_then(|s| settled.get(&(run, step, s, before.attempt)))
                    == Some(&EffectOutcome::NotApplied)
            } else {
                !recorded
                    .iter()
                    .any(|x| x.state == CallState::Done && x.attempt == before.attempt)
            };
            if !allowed {
                out.duplicates.push(format!(
                    "duplicate: run {run} step {step} call {call} made again by pod {} (attempt {}) at {}, after attempt {} made it at {}{}",
                    m.pod,
                    m.attempt,
                    m.at,
                    before.attempt,
                    before.at,
                    if non_idempotent {
                        " and it was not settled NotApplied"
                    } else {
                        " and recorded its answer"
                    }
                ));
            }
        }
    }

    let made_by = |run: &str, step: &str, call: &str, attempt: i32| {
        made.get(&(run, step, call))
            .is_some_and(|xs| xs.iter().any(|m| m.attempt == attempt))
    };
    for (&(run, step, call), xs) in &entries {
        for x in xs.iter().filter(|x| x.state == CallState::Done) {
            if !made_by(run, step, call, x.attempt) {
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
    for (&(run, step, seq, attempt), outcome) in &settled {
        if *outcome != EffectOutcome::Applied {
            continue;
        }
        let call = entries
            .iter()
            .filter(|((r, s, _), _)| *r == run && *s == step)
            .flat_map(|(_, xs)| xs.iter())
            .find(|x| x.seq == seq)
            .map(|x| x.call_id.as_str());
        if !call.is_some_and(|c| made_by(run, step, c, attempt)) {
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
        let run = r.name_any();
        for c in r.status.iter().flat_map(|s| s.steps.iter()) {
            // The step's own checkpoint, not its probe's.
            if !c.role.is_step()
                || c.phase != StepPhase::Succeeded
                || c.checkpoint != CheckpointState::Committed
            {
                continue;
            }
            let Some(declared) = e.declared_calls.get(&(run.clone(), c.name.clone())) else {
                continue;
            };
            for call in declared {
                let answered = entries
                    .get(&(run.as_str(), c.name.as_str(), call.as_str()))
                    .is_some_and(|xs| {
                        xs.iter().any(|x| {
                            x.state == CallState::Done
                                || (x.state == CallState::Intent
                                    && settled.get(&(
                                        run.as_str(),
                                        c.name.as_str(),
                                        x.seq,
                                        x.attempt,
                                    )) == Some(&EffectOutcome::Applied))
                        })
                    });
                if !answered {
                    out.lost.push((
                        run.clone(),
                        format!(
                            "lost: run {run} step {} committed Succeeded but its journal holds no answer to call {call}",
                            c.name
                        ),
                    ));
                }
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::super::fixtures::*;
    use super::super::{Observer, Verdict};
    use crate::ledger::{CallExecution, LedgerEntry, Outcome};
    use crate::support::journal::{chunk, entry};
    use agentrun_operator::api::{
        AgentRun, CallKind, CallState, EffectOutcome, JournalSpec, RunPhase, Settlement,
        StepJournal, StepJournalStatus,
    };
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

    const CALLS: &[&str] = &["call_0", "call_1", "call_2", "call_3"];

    /// Run `r` whose journaled step `a` (NonIdempotent) committed Succeeded under `k`.
    fn journaled_run() -> AgentRun {
        let mut r = run("r", 5, vec![committed("a", "k", "r")], RunPhase::Succeeded);
        r.spec.steps[0].journal = Some(Box::new(JournalSpec::default()));
        r
    }

    /// Attempt `attempt` of step `a` made call `id` (at `seq`) at second `at`.
    fn made(uid: &str, attempt: u32, seq: i64, id: &str, at: i64) -> LedgerEntry {
        let mut s = started(uid, "k", "2026-01-01T10:00:00Z");
        s.attempt = Some(attempt);
        s.executed(CallExecution {
            seq,
            id: id.into(),
            kind: if seq % 2 == 0 { "Model" } else { "Tool" }.into(),
            key: None,
            at: jiff::Timestamp::from_second(1_767_261_600 + at).unwrap(),
        })
    }

    /// The journal of a loop (Model, Tool, Model, Tool) whose attempt 1 was
    /// killed after it made call_1 and before it recorded the answer; call_1
    /// settled `outcome` for attempt 1; attempt 2 recorded the rest.
    fn journal(outcome: EffectOutcome) -> StepJournal {
        let kind = |seq: i64| {
            if seq % 2 == 0 {
                CallKind::Model
            } else {
                CallKind::Tool
            }
        };
        let mut entries = vec![
            entry(0, CallKind::Model, CallState::Done, "k", 1),
            entry(1, CallKind::Tool, CallState::Intent, "k", 1),
        ];
        if outcome == EffectOutcome::NotApplied {
            entries[1] = entry(1, CallKind::Tool, CallState::Done, "k", 2);
        }
        entries.extend((2..4).map(|seq| entry(seq, kind(seq), CallState::Done, "k", 2)));
        let mut j = chunk("r-a-t-r1-journal-", 0, &journaled_run(), "a", 2, entries);
        j.status = Some(StepJournalStatus {
            settlements: vec![Settlement {
                seq: 1,
                attempt: 1,
                outcome,
                response: None,
                by: "verify".into(),
                at: Time(ts("2026-01-01T10:00:30Z")),
            }],
        });
        j
    }

    /// Attempt 1 killed mid-call_1 (it made call_0 and call_1), attempt 2 succeeded.
    fn ledger(calls: Vec<LedgerEntry>) -> Vec<LedgerEntry> {
        let mut l = exec_at(
            "1",
            "k",
            "2026-01-01T10:00:00Z",
            Outcome::Killed,
            "2026-01-01T10:00:20Z",
        )
        .to_vec();
        let mut second = exec_at(
            "2",
            "k",
            "2026-01-01T10:00:40Z",
            Outcome::Succeeded,
            "2026-01-01T10:00:50Z",
        );
        for x in &mut second {
            x.attempt = Some(2);
        }
        l.extend(second);
        l.extend(calls);
        l
    }

    fn judge_calls(ledger: Vec<LedgerEntry>, journals: &[StepJournal]) -> Verdict {
        let mut o = Observer::default();
        saw_finish(&mut o);
        judge_journaled(
            &o,
            &[journaled_run()],
            &[],
            ledger,
            &["k"],
            journals,
            &[("r", "a", CALLS)],
        )
    }

    /// Attempt 1 made call_0 and call_1; attempt 2 replayed them and made the rest.
    fn clean_calls() -> Vec<LedgerEntry> {
        vec![
            made("1", 1, 0, "call_0", 1),
            made("1", 1, 1, "call_1", 2),
            made("2", 2, 2, "call_2", 41),
            made("2", 2, 3, "call_3", 42),
        ]
    }

    #[test]
    fn a_killed_loop_settled_by_its_probe_and_replayed_passes() {
        let v = judge_calls(ledger(clean_calls()), &[journal(EffectOutcome::Applied)]);
        assert!(v.passed(), "{:?}", v.findings);
        assert_eq!(
            (v.calls_executed, v.calls_settled, v.calls_settled_applied),
            (4, 1, 1)
        );
        // The step re-ran under its key without a person's Retry: by
        // design for a journaled step, so no blind re-run.
        assert_eq!((v.blind_reruns, v.duplicates, v.lost), (0, 0, 0));
    }

    #[test]
    fn a_tool_call_made_again_after_it_was_settled_applied_is_a_duplicate() {
        let mut calls = clean_calls();
        calls.push(made("2", 2, 1, "call_1", 40));
        let v = judge_calls(ledger(calls), &[journal(EffectOutcome::Applied)]);
        assert_eq!(
            (v.duplicates, v.call_duplicates),
            (1, 1),
            "{:?}",
            v.findings
        );
        assert!(
            v.findings.iter().any(|f| f.starts_with(
                "duplicate: run r step a call call_1 made again by pod pod-2 (attempt 2)"
            ) && f.ends_with("and it was not settled NotApplied")),
            "{:?}",
            v.findings
        );
        assert!(!v.passed());
    }

    #[test]
    fn a_tool_call_settled_not_applied_may_be_made_again() {
        // Attempt 1 wrote the intent and was killed before it made the
        // call: settled NotApplied, attempt 2 made it and recorded it.
        let calls = vec![
            made("1", 1, 0, "call_0", 1),
            made("2", 2, 1, "call_1", 40),
            made("2", 2, 2, "call_2", 41),
            made("2", 2, 3, "call_3", 42),
        ];
        let v = judge_calls(ledger(calls.clone()), &[journal(EffectOutcome::NotApplied)]);
        assert!(v.passed(), "{:?}", v.findings);
        // Made by attempt 1 too (a probe that lied, or a person's wrong
        // Retry): the repeat followed a NotApplied settlement, so it is
        // the settlement's fault, not the operator's.
        let mut twice = calls;
        twice.push(made("1", 1, 1, "call_1", 2));
        let v = judge_calls(ledger(twice), &[journal(EffectOutcome::NotApplied)]);
        assert_eq!(v.call_duplicates, 0, "{:?}", v.findings);
    }

    #[test]
    fn a_model_asked_again_after_its_answer_was_recorded_is_a_duplicate() {
        let mut calls = clean_calls();
        calls.push(made("2", 2, 0, "call_0", 40));
        let v = judge_calls(ledger(calls), &[journal(EffectOutcome::Applied)]);
        assert_eq!(v.call_duplicates, 1, "{:?}", v.findings);
        assert!(
            v.findings
                .iter()
                .any(|f| f.contains("call call_0 made again")
                    && f.ends_with("and recorded its answer")),
            "{:?}",
            v.findings
        );
    }

    #[test]
    fn a_recorded_answer_the_ledger_never_saw_made_is_lost() {
        let mut calls = clean_calls();
        calls.retain(|c| c.call.as_ref().unwrap().id != "call_3");
        let v = judge_calls(ledger(calls), &[journal(EffectOutcome::Applied)]);
        assert_eq!((v.lost, v.calls_lost), (1, 1), "{:?}", v.findings);
        assert!(
            v.findings.iter().any(|f| f
                == "lost: run r step a call call_3 (seq 3) recorded Done by attempt 2, which the ledger never saw make it"),
            "{:?}",
            v.findings
        );
    }

    #[test]
    fn an_applied_settlement_of_a_call_never_made_is_lost() {
        let mut calls = clean_calls();
        calls.retain(|c| c.call.as_ref().unwrap().id != "call_1");
        let v = judge_calls(ledger(calls), &[journal(EffectOutcome::Applied)]);
        assert_eq!(v.calls_lost, 1, "{:?}", v.findings);
        assert!(
            v.findings.iter().any(|f| f
                == "lost: run r step a call call_1 (seq 1) settled Applied for attempt 1, which never made it"),
            "{:?}",
            v.findings
        );
    }

    #[test]
    fn a_succeeded_step_whose_journal_lacks_a_declared_call_is_lost() {
        let mut j = journal(EffectOutcome::Applied);
        j.spec.entries.pop();
        let mut calls = clean_calls();
        calls.pop();
        let v = judge_calls(ledger(calls), &[j]);
        assert_eq!(v.calls_lost, 1, "{:?}", v.findings);
        assert!(
            v.findings.iter().any(|f| f
                == "lost: run r step a committed Succeeded but its journal holds no answer to call call_3"),
            "{:?}",
            v.findings
        );
        // Only the step's own success asks for every call: its probe's
        // committed answer does not (a step superseded mid-loop).
        let mut probe_only = journaled_run();
        let cps = &mut probe_only.status.as_mut().unwrap().steps;
        cps[0].role = agentrun_operator::api::StepRole::Verify;
        let mut j = journal(EffectOutcome::Applied);
        j.spec.entries.truncate(2);
        let mut o = Observer::default();
        saw_finish(&mut o);
        let v = judge_journaled(
            &o,
            &[probe_only],
            &[],
            ledger(clean_calls()[..2].to_vec()),
            &["k"],
            &[j],
            &[("r", "a", CALLS)],
        );
        assert_eq!(v.calls_lost, 0, "{:?}", v.findings);
        // An intent with no Applied settlement is no answer either.
        let mut j = journal(EffectOutcome::Applied);
        j.status = None;
        let v = judge_calls(ledger(clean_calls()), &[j]);
        assert!(
            v.findings
                .iter()
                .any(|f| f.ends_with("holds no answer to call call_1")),
            "{:?}",
            v.findings
        );
    }
}
