use super::super::fixtures::*;
use super::super::{Observer, Verdict};
use crate::ledger::{CallExecution, LedgerEntry, Outcome};
use crate::support::journal::{chunk, entry};
use agentrun_operator::api::{
    AgentRun, Approval, CallKind, CallState, EffectOutcome, JournalSpec, RunPhase, Settlement,
    StepJournal, StepJournalStatus, StepPhase,
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
    made_under("k", uid, attempt, seq, id, at)
}

/// [`made`], by an attempt under step key `key`.
fn made_under(key: &str, uid: &str, attempt: u32, seq: i64, id: &str, at: i64) -> LedgerEntry {
    let mut s = started(uid, key, "2026-01-01T10:00:00Z");
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

/// Run `r` whose journaled step `a` was re-planned: revision 1 (key k1)
/// made call_0 and call_1 and was superseded, revision 2 (key k2) ran
/// the loop from an empty journal and committed. `settled`: how
/// revision 1's call_1 was settled, if it was.
fn replanned(settled: Option<EffectOutcome>) -> (AgentRun, Vec<StepJournal>, Vec<LedgerEntry>) {
    let mut first = committed("a", "k1", "r");
    first.phase = StepPhase::Superseded;
    first.result = None;
    let mut second = committed("a", "k2", "r");
    second.plan_revision = 2;
    let mut r = run("r", 5, vec![first, second], RunPhase::Succeeded);
    r.spec.steps[0].journal = Some(Box::new(JournalSpec::default()));
    let mut old = chunk(
        "r-a-t-r1-journal-",
        0,
        &r,
        "a",
        1,
        vec![
            entry(0, CallKind::Model, CallState::Done, "k1", 1),
            entry(1, CallKind::Tool, CallState::Intent, "k1", 1),
        ],
    );
    old.status = settled.map(|outcome| StepJournalStatus {
        settlements: vec![Settlement {
            seq: 1,
            attempt: 1,
            outcome,
            response: None,
            by: "verify".into(),
            at: Time(ts("2026-01-01T10:00:15Z")),
        }],
    });
    let kinds = [
        CallKind::Model,
        CallKind::Tool,
        CallKind::Model,
        CallKind::Tool,
    ];
    let mut new = chunk(
        "r-a-t-r2-journal-",
        0,
        &r,
        "a",
        1,
        (0..4)
            .map(|seq| entry(seq, kinds[seq as usize], CallState::Done, "k2", 1))
            .collect(),
    );
    new.spec.plan_revision = 2;
    let mut ledger = exec_at(
        "1",
        "k1",
        "2026-01-01T10:00:00Z",
        Outcome::Killed,
        "2026-01-01T10:00:10Z",
    )
    .to_vec();
    ledger.extend(exec_at(
        "2",
        "k2",
        "2026-01-01T10:00:40Z",
        Outcome::Succeeded,
        "2026-01-01T10:00:50Z",
    ));
    ledger.extend([
        made_under("k1", "1", 1, 0, "call_0", 1),
        made_under("k1", "1", 1, 1, "call_1", 2),
    ]);
    ledger.extend((0..4).map(|seq| made_under("k2", "2", 1, seq, CALLS[seq as usize], 41 + seq)));
    (r, vec![old, new], ledger)
}

fn judge_replanned(settled: Option<EffectOutcome>, approvals: &[Approval]) -> Verdict {
    let (r, journals, ledger) = replanned(settled);
    let mut o = Observer::default();
    saw_finish(&mut o);
    judge_journaled(
        &o,
        &[r],
        approvals,
        ledger,
        &["k1", "k2"],
        &journals,
        &[("r", "a", CALLS)],
    )
}

#[test]
fn a_re_planned_loop_asks_its_model_again_but_repeats_a_tool_only_with_leave() {
    // Revision 2's journal starts empty: call_0 (a model) asked again
    // under k2 is no duplicate; call_1, a refund revision 1 may have
    // made, made again with nobody's leave is.
    let v = judge_replanned(None, &[]);
    assert_eq!(v.call_duplicates, 1, "{:?}", v.findings);
    assert!(
        v.findings.iter().any(|f| f.starts_with(
            "duplicate: run r step a call call_1 (NonIdempotent) made again by pod pod-2 (attempt 1)"
        ) && f.contains("under a new key, after it was made under 1 key(s) (k1) and a person allowed 0 repeat(s)")),
        "{:?}",
        v.findings
    );
    assert_eq!(v.calls_lost, 0, "{:?}", v.findings);
    // A person approved the repeat before revision 2 made it.
    let approved = repeat_approved("2026-01-01T10:00:30Z");
    let v = judge_replanned(None, std::slice::from_ref(&approved));
    assert_eq!(v.call_duplicates, 0, "{:?}", v.findings);
    // ... but not after it.
    let late = decided_at(approved, "2026-01-01T10:00:45Z");
    assert_eq!(judge_replanned(None, &[late]).call_duplicates, 1);
    // Settled NotApplied at revision 1: it never acted, no leave needed.
    let v = judge_replanned(Some(EffectOutcome::NotApplied), &[]);
    assert_eq!(v.call_duplicates, 0, "{:?}", v.findings);
    // Settled Applied: it did act.
    let v = judge_replanned(Some(EffectOutcome::Applied), &[]);
    assert_eq!(v.call_duplicates, 1, "{:?}", v.findings);
}

#[test]
fn a_journal_is_judged_under_its_own_revisions_key() {
    let judged = |journals: &[StepJournal], ledger: Vec<LedgerEntry>, r: AgentRun| {
        let mut o = Observer::default();
        saw_finish(&mut o);
        judge_journaled(
            &o,
            &[r],
            &[],
            ledger,
            &["k1", "k2"],
            journals,
            &[("r", "a", CALLS)],
        )
    };
    // Revision 2 committed with only call_0 answered: revision 1's
    // call_1, settled Applied, is no answer in revision 2's journal.
    let (r, mut journals, mut ledger) = replanned(Some(EffectOutcome::Applied));
    journals[1].spec.entries.truncate(1);
    ledger.retain(|l| {
        !l.call
            .as_ref()
            .is_some_and(|c| l.key() == "k2" && c.seq > 0)
    });
    let v = judged(&journals, ledger, r);
    assert!(
        v.findings.iter().any(|f| f
            == "lost: run r step a committed Succeeded but its journal holds no answer to call call_1"),
        "{:?}",
        v.findings
    );
    // Revision 2's attempt 1 recorded call_0 Done without making it:
    // revision 1's attempt 1 making it does not stand behind that.
    let (r, journals, mut ledger) = replanned(None);
    ledger.retain(|l| {
        !l.call
            .as_ref()
            .is_some_and(|c| l.key() == "k2" && c.seq == 0)
    });
    let v = judged(&journals, ledger, r);
    assert!(
        v.findings.iter().any(|f| f
            == "lost: run r step a call call_0 (seq 0) recorded Done by attempt 1, which the ledger never saw make it"),
        "{:?}",
        v.findings
    );
}
