//! The chaos verdict: what the steps really did (the simkubelet ledger), what
//! the runs committed (every status version the driver saw, and the final
//! statuses), judged against the durability contract.
//!
//! ```text
//!   watch AgentRuns ──▶ Observer (observer.rs)
//!   ledger + final statuses + Approvals + Observer ──▶ Evidence ──▶ Facts (facts.rs)
//!        ──▶ every rule below, in this order ──▶ Verdict
//! ```
//!
//! The rules, one module each (also in e2e/README.md, "Chaos suite"):
//!
//! | rule | module | counts |
//! |---|---|---|
//! | an execution after its key's outcome was committed (D3, D4) | `after_commit` | duplicate |
//! | an execution of a key started after the key succeeded, or a second success (D3, D5) | `after_success` | duplicate |
//! | two live executions of one key (D2) | `overlapping` | duplicate |
//! | a NonIdempotent key run again after an attempt that may have acted, without a person's `Retry` (D6) | `blind_rerun` | duplicate |
//! | a step whose effect happened run again under another key — across plan revisions — without a person's leave (D1, D8) | `repeated_effect` | duplicate |
//! | an execution behind a gate that said no | `unapproved` | unapproved |
//! | a vanished run, a changed checkpoint, a made-up or dropped result (D3, D5) | `lost` | lost runs |
//! | a run not finished when the settle deadline passed | `stuck` | stuck runs |
//! | a run the driver's watch never saw finish | `unobserved` | unobserved runs |
//! | a Reconcile question no injected fault explains (D6) | `reconcile_unexpected` | unexpected |
//! | a step after a wait step started before the wait's `wakeAt` (D10) | `early_wake` | early |
//! | a verify probe started while an execution of its key was live (D2) | `early_probe` | early probes |
//! | a journaled call made again under its key, unless settled `NotApplied` (a tool) or never answered (a model); a tool call an earlier revision made, made under a new key without a person's leave (D19) | `journal_calls` | duplicate |
//! | a journaled call's answer or `Applied` settlement no making stands behind, or a succeeded step's declared call missing from its journal (D19) | `journal_calls` | lost runs |
//! | a step execution whose Pod lacks the run or step label | (here) | unlabelled |
//!
//! The first five judge executions: one execution counts once as a duplicate
//! however many of them name it, and each rule's own count is kept. A
//! journaled step (`journal: {}`) is re-run after a lost attempt by design
//! — its new attempt replays what its journal recorded — so `blind_rerun`
//! and `repeated_effect` leave it to `journal_calls`, which counts its
//! effects, the calls, one by one. The unit
//! the contract protects is the step's effect, (run, step name), across plan
//! revisions and keys: the per-key rules catch a key run twice, and
//! `repeated_effect` catches a step run again under a new key. A verify
//! probe's `NotApplied` answer, given once the execution it asks about has
//! ended and not contradicted by the ledger's record of what that execution
//! did, settles it like a person's `Retry` (`facts::settled_by_probes`); an
//! `Applied` answer counts for a committed step only when true
//! (`Facts::verified`).
//!
//! Any duplicate, unapproved, lost, stuck or unobserved run, watch failure
//! (observer.rs), unexpected Reconcile approval, early wake, early probe or
//! unlabelled execution fails the verdict.

mod after_commit;
mod after_success;
mod blind_rerun;
mod early_probe;
mod early_wake;
mod facts;
mod journal_calls;
mod lost;
mod observer;
mod overlapping;
mod reconcile_unexpected;
mod repeated_effect;
mod stuck;
mod unapproved;
mod unobserved;

#[cfg(test)]
mod fixtures;

use std::collections::{BTreeMap, BTreeSet};

use agentrun_operator::api::{AgentRun, Approval, StepJournal};

use crate::ledger::Ledger;
use facts::Facts;
pub use observer::{Commit, Observer, decision_time, status_write_time};

/// Everything the verdict is computed from.
pub struct Evidence<'a> {
    /// Names of the runs the driver created.
    pub created: &'a [String],
    /// The runs as listed after the settle phase.
    pub final_runs: &'a [AgentRun],
    pub approvals: &'a [Approval],
    pub ledger: &'a Ledger,
    pub observer: &'a Observer,
    /// Idempotency keys of Pods the driver evicted or deleted.
    pub disrupted_keys: &'a BTreeSet<String>,
    /// Every StepJournal chunk, as listed after the settle phase.
    pub journals: &'a [StepJournal],
    /// The call ids each journaled step declares, by (run, step).
    pub declared_calls: &'a BTreeMap<(String, String), Vec<String>>,
}

/// The judgement.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Verdict {
    pub runs: usize,
    pub executions: usize,
    pub successful_executions: usize,
    /// Executions that should not have happened (each counted once), and by rule.
    pub duplicates: usize,
    pub after_commit: usize,
    pub after_success: usize,
    pub overlapping: usize,
    pub blind_reruns: usize,
    /// Executions of a step whose effect had already happened under another
    /// key, without a person's leave.
    pub repeated_effects: usize,
    /// Executions of steps behind a Rejected or expired gate.
    pub unapproved: usize,
    pub lost: usize,
    pub stuck: usize,
    pub unobserved: usize,
    pub watch_failures: usize,
    pub reconcile_approvals: usize,
    pub reconcile_unexpected: usize,
    /// Steps that started before the wait step they come after woke.
    pub early_wakes: usize,
    /// Verify probes that started beside a live execution of their key.
    pub early_probes: usize,
    /// Verify probes run, and those that answered `Applied` / `NotApplied`.
    pub probes: usize,
    pub probes_applied: usize,
    pub probes_not_applied: usize,
    /// Step executions whose Pod lacked the run or step label.
    pub unlabelled: usize,
    /// Journaled calls made (the ledger), settled after a lost attempt (of
    /// them `Applied`), made again without leave, and lost.
    pub calls_executed: usize,
    pub calls_settled: usize,
    pub calls_settled_applied: usize,
    pub call_duplicates: usize,
    pub calls_lost: usize,
    /// Runs that re-planned (final plan revision past 1), and Approvals that
    /// asked to let a step act again (`spec.context.repeats`): what the
    /// repeated-effect rule has to judge. A run with none of either proves
    /// nothing about it.
    pub replans: usize,
    pub repeat_approvals: usize,
    /// Outcomes of the runs, by phase.
    pub phases: BTreeMap<String, usize>,
    /// One line per finding.
    pub findings: Vec<String>,
}

impl Verdict {
    pub fn passed(&self) -> bool {
        self.duplicates == 0
            && self.unapproved == 0
            && self.lost == 0
            && self.stuck == 0
            && self.unobserved == 0
            && self.watch_failures == 0
            && self.reconcile_unexpected == 0
            && self.early_wakes == 0
            && self.early_probes == 0
            && self.unlabelled == 0
    }
}

/// One reason an execution should not have happened.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct Breach {
    /// Index into [`Facts::executions`].
    pub exec: usize,
    pub why: String,
}

/// Computes the verdict from the evidence: every rule, in the order of the
/// table above.
pub fn verdict(e: &Evidence<'_>) -> Verdict {
    let f = Facts::new(e);
    let mut v = Verdict {
        runs: e.created.len(),
        executions: f.executions.len(),
        successful_executions: f.executions.iter().filter(|x| x.succeeded()).count(),
        probes: f.probes.values().map(Vec::len).sum(),
        probes_applied: f
            .executions
            .iter()
            .filter(|x| x.is_probe() && x.succeeded() && x.said_applied)
            .count(),
        probes_not_applied: f
            .executions
            .iter()
            .filter(|x| x.is_probe() && x.succeeded() && x.said_not_applied)
            .count(),
        replans: e
            .final_runs
            .iter()
            .filter(|r| {
                r.status
                    .as_ref()
                    .and_then(|s| s.plan.as_ref())
                    .is_some_and(|p| p.revision > 1)
            })
            .count(),
        repeat_approvals: e
            .approvals
            .iter()
            .filter(|a| a.spec.context.as_ref().is_some_and(|c| c.repeats.is_some()))
            .count(),
        ..Verdict::default()
    };

    // Duplicates: the reasons of every execution named, in key and start order.
    let mut why: BTreeMap<usize, Vec<String>> = BTreeMap::new();
    let mut tally = |breaches: Vec<Breach>| {
        let n = breaches.len();
        for b in breaches {
            why.entry(b.exec).or_default().push(b.why);
        }
        n
    };
    v.after_commit = tally(after_commit::check(&f));
    v.after_success = tally(after_success::check(&f));
    v.overlapping = tally(overlapping::check(&f));
    v.blind_reruns = tally(blind_rerun::check(&f));
    v.repeated_effects = tally(repeated_effect::check(&f));
    v.duplicates = why.len();
    for (x, reasons) in why {
        v.findings.push(format!(
            "duplicate: {}: {}",
            f.executions[x].describe(),
            reasons.join("; ")
        ));
    }
    let calls = journal_calls::check(&f);
    v.calls_executed = calls.executed;
    v.calls_settled = calls.settled;
    v.calls_settled_applied = calls.settled_applied;
    v.call_duplicates = calls.duplicates.len();
    v.duplicates += calls.duplicates.len();
    v.findings.extend(calls.duplicates);
    v.calls_lost = calls.lost.len();

    for x in f.executions.iter().filter(|x| x.unlabelled()) {
        v.unlabelled += 1;
        v.findings.push(format!(
            "unlabelled: {}: its Pod lacks the run or step label, so no rule can judge it",
            x.describe()
        ));
    }

    let unapproved = unapproved::check(&f);
    v.unapproved = unapproved.len();
    v.findings.extend(unapproved);

    let mut lost = lost::check(&f);
    lost.extend(calls.lost);
    v.lost = lost
        .iter()
        .map(|(run, _)| run)
        .collect::<BTreeSet<_>>()
        .len();
    v.findings
        .extend(lost.into_iter().map(|(_, finding)| finding));

    let stuck = stuck::check(&f);
    v.stuck = stuck.len();
    v.findings.extend(stuck);
    v.phases = stuck::phases(e.final_runs);

    let early = early_wake::check(&f);
    v.early_wakes = early.len();
    v.findings.extend(early);

    let early = early_probe::check(&f);
    v.early_probes = early.len();
    v.findings.extend(early);

    let unobserved = unobserved::check(&f);
    v.unobserved = unobserved.len();
    v.findings.extend(unobserved);

    v.watch_failures = e.observer.watch_failures.len();
    v.findings.extend(
        e.observer
            .watch_failures
            .iter()
            .map(|w| format!("watch: {w}")),
    );

    let reconcile = reconcile_unexpected::check(&f);
    v.reconcile_approvals = reconcile.asked;
    v.reconcile_unexpected = reconcile.unexpected.len();
    v.findings.extend(reconcile.unexpected);
    v
}

#[cfg(test)]
mod tests {
    use super::fixtures::*;
    use super::*;
    use crate::ledger::Outcome;
    use agentrun_operator::api::RunPhase;
    use jiff::Timestamp;

    #[test]
    fn clean_run_passes() {
        let mut o = Observer::default();
        let r = run("r", 5, vec![committed("a", "k", "r")], RunPhase::Succeeded);
        o.observe(&r, Timestamp::from_second(20).unwrap());
        let v = judge(
            &o,
            &[r],
            exec("1", "k", 10, Outcome::Succeeded, 11).to_vec(),
        );
        assert!(v.passed(), "{v:?}");
        assert_eq!((v.executions, v.successful_executions), (1, 1));
        assert_eq!(v.phases, BTreeMap::from([("Succeeded".to_owned(), 1)]));
    }

    #[test]
    fn an_execution_named_by_several_rules_is_one_duplicate() {
        // Pod 2 starts after pod 1's success was committed, and succeeds too.
        let mut o = Observer::default();
        let r = run("r", 5, vec![committed("a", "k", "r")], RunPhase::Succeeded);
        o.observe(&r, Timestamp::from_second(12).unwrap());
        let mut ledger = exec("1", "k", 10, Outcome::Succeeded, 11).to_vec();
        ledger.extend(exec("2", "k", 13, Outcome::Succeeded, 14));
        let v = judge(&o, &[r], ledger);
        assert_eq!(
            (v.duplicates, v.after_commit, v.after_success),
            (1, 1, 1),
            "{v:?}"
        );
        assert_eq!(v.findings.len(), 1, "{:?}", v.findings);
        assert!(
            v.findings[0].starts_with("duplicate: run r key k pod pod-2 started")
                && v.findings[0].contains("after its outcome was committed")
                && v.findings[0].contains("; a second success"),
            "{:?}",
            v.findings
        );
        assert!(!v.passed());
    }

    /// An execution whose Pod lacked the run or step label is a finding:
    /// no rule can judge it, so the verdict fails rather than skip it.
    #[test]
    fn an_unlabelled_execution_fails_the_verdict() {
        let mut o = Observer::default();
        saw_finish(&mut o);
        let r = run("r", 5, vec![committed("a", "k", "r")], RunPhase::Succeeded);
        let mut ledger = exec("1", "k", 10, Outcome::Succeeded, 11).to_vec();
        let mut stray = exec("2", "k-stray", 12, Outcome::Succeeded, 13);
        for e in &mut stray {
            e.step = None;
        }
        ledger.extend(stray);
        let v = judge(&o, &[r], ledger);
        assert_eq!(v.unlabelled, 1, "{v:?}");
        assert!(!v.passed());
        assert!(
            v.findings
                .iter()
                .any(|f| f.starts_with("unlabelled: run r key k-stray")),
            "{:?}",
            v.findings
        );
    }
}
