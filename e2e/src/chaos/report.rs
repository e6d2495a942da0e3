//! The report of a chaos run: what was injected, how often, and the verdict;
//! one summary line and the breakdown behind it.

use std::time::Duration;

use agentrun_operator::labels;

use super::operators::OperatorCounts;
use super::proxy::FaultCounts;
use super::verdict::Verdict;

/// What a chaos run did and the verdict on it.
#[derive(Clone, Debug)]
pub struct Report {
    pub namespace: String,
    pub proxy: FaultCounts,
    pub operators: OperatorCounts,
    pub apiserver_restarts: u64,
    /// Restarts that did not bring kube-apiserver back (each fails the run).
    pub apiserver_restart_failures: Vec<String>,
    pub evictions: u64,
    pub deletions: u64,
    /// Evictions of the Pods of the steps marked to be evicted again and again.
    pub repeated_evictions: u64,
    /// Journaled loops' Pods killed mid-loop.
    pub journal_kills: u64,
    /// Gated steps whose args the driver edited during their retry backoff,
    /// and those it meant to edit but found past their backoff.
    pub edits: u64,
    pub edits_missed: Vec<String>,
    /// `AGENTRUN_CLOCK_SKEW` of the second operator, if any.
    pub clock_skew: Option<String>,
    pub approvals_answered: u64,
    /// Signals the scripted sender sent, sent again (same id and data), and
    /// repeats the API server refused while the Signal still waited or had
    /// been received: a signal must be received once, its repeats admitted.
    pub signals_sent: u64,
    pub signals_repeated: u64,
    pub signal_repeats_refused: u64,
    pub status_versions: u64,
    /// Step Pods still holding `agentrun.dev/result` 30 s after the last run
    /// finished, or why they could not be counted.
    pub finalizers_held: Result<usize, String>,
    /// Errors of the driver's watch of runs: all, and the expected ones
    /// (410 Gone, or inside a kube-apiserver restart).
    pub watch_errors: u64,
    pub watch_errors_expected: u64,
    pub fault_phase: Duration,
    pub wall_time: Duration,
    pub verdict: Verdict,
    pub faults_min: u64,
    pub paused_leaders_min: u64,
    pub apiserver_restarts_min: u64,
    pub failpoint_crashes_min: u64,
    /// Operator kills while a verify probe ran (also counted in `operators.kills`).
    pub probe_kills: u64,
    pub probe_kills_min: u64,
    /// Runs whose stored status holds `status.archivedSteps` at the end, and
    /// how many checkpoints those archives hold (as the API server stores them).
    pub archived_runs: u64,
    pub archived_checkpoints: u64,
    pub archived_runs_min: u64,
    /// Journaled calls the run must see made, and settled after a loop was
    /// killed during one: without them the per-call referee judged nothing.
    pub journal_calls_min: u64,
    pub settled_calls_min: u64,
}

impl Report {
    /// Every injected fault: proxy faults, operator kills, paused leaders,
    /// failpoint aborts, kube-apiserver restarts, evicted and deleted Pods,
    /// repeated evictions of one step, steps edited during their backoff.
    pub fn faults(&self) -> u64 {
        self.proxy.total()
            + self.operators.kills
            + self.operators.paused_leaders
            + self.operators.failpoint_crashes
            + self.apiserver_restarts
            + self.evictions
            + self.deletions
            + self.repeated_evictions
            + self.journal_kills
            + self.edits
    }

    /// The one summary line.
    pub fn summary(&self) -> String {
        format!(
            "faults={} runs={} executions={} duplicates={} lost={} stuck={} reconcile_approvals={} paused_leaders={} replans={} repeat_approvals={} calls_executed={} calls_settled={}",
            self.faults(),
            self.verdict.runs,
            self.verdict.executions,
            self.verdict.duplicates,
            self.verdict.lost,
            self.verdict.stuck,
            self.verdict.reconcile_approvals,
            self.operators.paused_leaders,
            self.verdict.replans,
            self.verdict.repeat_approvals,
            self.verdict.calls_executed,
            self.verdict.calls_settled,
        )
    }

    /// The breakdown behind the summary line.
    pub fn details(&self) -> String {
        let v = &self.verdict;
        let o = &self.operators;
        let finalizers = match &self.finalizers_held {
            Ok(n) => n.to_string(),
            Err(e) => format!("unknown ({e})"),
        };
        let mut out = format!(
            "namespace={} wall={:.0}s fault_phase={:.0}s\nproxy: {}\nkills={} paused_leaders={} takeovers_during_pause={} failpoint_crashes={} (armed starts {}) self_exits={} apiserver_restarts={} evictions={} deletions={} repeated_evictions={} edits_in_backoff={} (missed {}) clock_skew={}\napprovals_answered={} signals_sent={} (again {}, refused {}) status_versions_seen={} watch_errors={} (expected {}) finalizers_held={}\nexecutions={} successful_executions={} phases={:?}\nprobes={} (applied {}, not_applied {}) probe_kills={} archived_runs={} (checkpoints {})\njournaled: loops_killed={} calls_executed={} calls_settled={} (applied {}) call_duplicates={} calls_lost={}\nduplicates: after_commit={} after_success={} overlapping={} blind_reruns={} repeated_effects={}; unapproved={} unobserved={} watch_failures={} reconcile_unexpected={} early_wakes={} early_probes={} unlabelled={}",
            self.namespace,
            self.wall_time.as_secs_f64(),
            self.fault_phase.as_secs_f64(),
            self.proxy,
            o.kills,
            o.paused_leaders,
            o.takeovers,
            o.failpoint_crashes,
            o.failpoints_armed,
            o.self_exits,
            self.apiserver_restarts,
            self.evictions,
            self.deletions,
            self.repeated_evictions,
            self.edits,
            self.edits_missed.len(),
            self.clock_skew.as_deref().unwrap_or("none"),
            self.approvals_answered,
            self.signals_sent,
            self.signals_repeated,
            self.signal_repeats_refused,
            self.status_versions,
            self.watch_errors,
            self.watch_errors_expected,
            finalizers,
            v.executions,
            v.successful_executions,
            v.phases,
            v.probes,
            v.probes_applied,
            v.probes_not_applied,
            self.probe_kills,
            self.archived_runs,
            self.archived_checkpoints,
            self.journal_kills,
            v.calls_executed,
            v.calls_settled,
            v.calls_settled_applied,
            v.call_duplicates,
            v.calls_lost,
            v.after_commit,
            v.after_success,
            v.overlapping,
            v.blind_reruns,
            v.repeated_effects,
            v.unapproved,
            v.unobserved,
            v.watch_failures,
            v.reconcile_unexpected,
            v.early_wakes,
            v.early_probes,
            v.unlabelled,
        );
        match &self.finalizers_held {
            Ok(0) => {}
            Ok(n) => out.push_str(&format!(
                "\nfinalizers: {n} step Pods still hold {} (D5)",
                labels::RESULT_FINALIZER
            )),
            Err(e) => out.push_str(&format!("\nfinalizers: could not be counted: {e}")),
        }
        for m in &self.edits_missed {
            out.push_str(&format!("\nnot edited (past its backoff): {m}"));
        }
        for f in &self.apiserver_restart_failures {
            out.push_str(&format!("\napiserver restart failed: {f}"));
        }
        if self.faults() < self.faults_min {
            out.push_str(&format!(
                "\ntoo few faults: {} < --faults-min {}",
                self.faults(),
                self.faults_min
            ));
        }
        if !self.enough_of_each_fault() {
            out.push_str(&format!(
                "\ntoo few of a kind: paused_leaders={} (min {}), apiserver_restarts={} (min {}), failpoint_crashes={} (min {}), probe_kills={} (min {}), archived_runs={} (min {}), calls_executed={} (min {}), calls_settled={} (min {})",
                o.paused_leaders,
                self.paused_leaders_min,
                self.apiserver_restarts,
                self.apiserver_restarts_min,
                o.failpoint_crashes,
                self.failpoint_crashes_min,
                self.probe_kills,
                self.probe_kills_min,
                self.archived_runs,
                self.archived_runs_min,
                v.calls_executed,
                self.journal_calls_min,
                v.calls_settled,
                self.settled_calls_min,
            ));
        }
        for f in &v.findings {
            out.push('\n');
            out.push_str(f);
        }
        out
    }

    /// The verdict passed, every result finalizer was released, every
    /// kube-apiserver restart came back, and enough faults were injected to
    /// mean something.
    pub fn passed(&self) -> bool {
        self.verdict.passed()
            && self.finalizers_held == Ok(0)
            && self.apiserver_restart_failures.is_empty()
            && self.signal_repeats_refused == 0
            && self.faults() >= self.faults_min
            && self.enough_of_each_fault()
            && self.judged_repeats()
    }

    /// The repeated-effect rule had something to judge: a run re-planned
    /// and a person was asked before a step acted again. Without either, a
    /// repeated effect could not have been caught, and the run proves nothing
    /// about it.
    pub fn judged_repeats(&self) -> bool {
        self.verdict.replans >= 1 && self.verdict.repeat_approvals >= 1
    }

    /// The faults that need a minimum of their own happened that often.
    pub fn enough_of_each_fault(&self) -> bool {
        self.operators.paused_leaders >= self.paused_leaders_min
            && self.apiserver_restarts >= self.apiserver_restarts_min
            && self.operators.failpoint_crashes >= self.failpoint_crashes_min
            && self.probe_kills >= self.probe_kills_min
            && self.archived_runs >= self.archived_runs_min
            && self.verdict.calls_executed as u64 >= self.journal_calls_min
            && self.verdict.calls_settled as u64 >= self.settled_calls_min
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report() -> Report {
        Report {
            namespace: "ns".into(),
            proxy: FaultCounts {
                error_500: 300,
                ..FaultCounts::default()
            },
            operators: OperatorCounts {
                paused_leaders: 2,
                failpoint_crashes: 1,
                ..OperatorCounts::default()
            },
            apiserver_restarts: 1,
            apiserver_restart_failures: vec![],
            evictions: 0,
            deletions: 0,
            repeated_evictions: 0,
            edits: 0,
            edits_missed: vec![],
            clock_skew: Some("+20s".into()),
            approvals_answered: 0,
            signals_sent: 0,
            signals_repeated: 0,
            signal_repeats_refused: 0,
            status_versions: 0,
            finalizers_held: Ok(0),
            watch_errors: 0,
            watch_errors_expected: 0,
            fault_phase: Duration::from_secs(60),
            wall_time: Duration::from_secs(90),
            verdict: Verdict {
                replans: 2,
                repeat_approvals: 1,
                calls_executed: 12,
                calls_settled: 2,
                ..Verdict::default()
            },
            faults_min: 300,
            paused_leaders_min: 2,
            apiserver_restarts_min: 1,
            failpoint_crashes_min: 1,
            probe_kills: 1,
            probe_kills_min: 1,
            archived_runs: 1,
            archived_checkpoints: 50,
            archived_runs_min: 1,
            journal_calls_min: 1,
            settled_calls_min: 1,
            journal_kills: 0,
        }
    }

    #[test]
    fn a_clean_report_passes_and_its_summary_counts_paused_leaders() {
        let r = report();
        assert!(r.passed(), "{}", r.details());
        assert_eq!(
            r.summary(),
            "faults=304 runs=0 executions=0 duplicates=0 lost=0 stuck=0 reconcile_approvals=0 paused_leaders=2 replans=2 repeat_approvals=1 calls_executed=12 calls_settled=2"
        );
    }

    /// Without a re-plan or a repeat approval the repeated-effect rule had
    /// nothing to judge: the run fails rather than pass on nothing.
    #[test]
    fn a_run_with_nothing_for_the_repeated_effect_rule_to_judge_fails() {
        for (replans, repeats) in [(0, 1), (2, 0)] {
            let mut r = report();
            r.verdict.replans = replans;
            r.verdict.repeat_approvals = repeats;
            assert!(
                !r.passed(),
                "{replans} re-plans, {repeats} repeat approvals"
            );
        }
    }

    #[test]
    fn a_held_or_uncounted_finalizer_fails_the_run() {
        let mut r = report();
        r.finalizers_held = Ok(1);
        assert!(!r.passed());
        assert!(r.details().contains("finalizers: 1 step Pods still hold"));
        r.finalizers_held = Err("listing step Pods: connection refused".into());
        assert!(!r.passed());
        assert!(r.details().contains("finalizers_held=unknown"));
    }

    #[test]
    fn an_unexpected_reconcile_approval_or_a_failed_restart_fails_the_run() {
        let mut r = report();
        r.verdict.reconcile_unexpected = 1;
        assert!(!r.passed());
        let mut r = report();
        r.apiserver_restart_failures
            .push("kube-apiserver did not come back".into());
        assert!(!r.passed());
    }

    #[test]
    fn edits_and_repeated_evictions_are_faults_and_the_details_name_them() {
        let mut r = report();
        r.repeated_evictions = 6;
        r.edits = 2;
        r.edits_missed = vec!["c001/s2-index: run Some(Failed)".into()];
        r.verdict.repeated_effects = 1;
        assert_eq!(r.faults(), 312);
        let d = r.details();
        assert!(
            d.contains("repeated_evictions=6 edits_in_backoff=2 (missed 1) clock_skew=+20s"),
            "{d}"
        );
        assert!(d.contains("blind_reruns=0 repeated_effects=1;"), "{d}");
        assert!(
            d.contains("\nnot edited (past its backoff): c001/s2-index: run Some(Failed)"),
            "{d}"
        );
    }

    #[test]
    fn too_few_of_a_kind_fails_the_run() {
        for f in [
            |r: &mut Report| r.operators.paused_leaders = 1,
            |r: &mut Report| r.apiserver_restarts = 0,
            |r: &mut Report| r.operators.failpoint_crashes = 0,
            |r: &mut Report| r.proxy.error_500 = 200,
            |r: &mut Report| r.verdict.calls_executed = 0,
            |r: &mut Report| r.verdict.calls_settled = 0,
        ] {
            let mut r = report();
            f(&mut r);
            assert!(!r.passed(), "{}", r.details());
        }
    }
}
