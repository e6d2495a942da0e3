//! The bounded short chaos run (the long one is `make chaos`): forty runs
//! under injected API faults (410 Gone on watches among them), two operators
//! with leader election SIGKILLed, paused past their lease and aborted right
//! after status writes, a kube-apiserver restart, bulk evictions and Pod
//! deletes, journaled agent loops killed mid-loop (judged per call), on the
//! standard e2e plane in a namespace of its own. Fails on any
//! duplicate or unapproved execution or journaled call, lost, stuck or unobserved run, watch
//! failure, unexpected Reconcile approval, result finalizer left behind, a
//! repeated signal refused, too few faults, or no re-plan and no repeat
//! approval to judge.

use agentrun_e2e::chaos::{self, ChaosConfig};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn short_chaos_run_has_no_duplicates_lost_or_stuck_runs() {
    let seed = std::env::var("AGENTRUN_CHAOS_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(7);
    let report = chaos::run(ChaosConfig::short(seed)).await;
    eprintln!("{}", report.details());
    println!("{}", report.summary());
    let v = &report.verdict;
    assert!(report.faults() >= report.faults_min, "{}", report.summary());
    assert!(report.operators.paused_leaders >= 2, "{}", report.summary());
    assert!(report.operators.takeovers >= 1, "{}", report.summary());
    assert!(report.apiserver_restarts >= 1, "{}", report.summary());
    assert!(
        report.operators.failpoint_crashes >= 1,
        "{}",
        report.summary()
    );
    assert!(report.proxy.watch_gone > 0, "{}", report.summary());
    // The repeated-effect rule judges something: runs re-planned, and a
    // step that had acted was asked about before it acted again.
    assert!(report.verdict.replans >= 1, "{}", report.summary());
    assert!(report.verdict.repeat_approvals >= 1, "{}", report.summary());
    // The per-call referee judges something: journaled calls made. Calls
    // settled after a loop was killed during one are counted and required
    // by the long run (`make chaos`); in two minutes under load a kill lands
    // inside an open call on most seeds but not all (one run of four here
    // settled none), and the settling itself is proved deterministically by
    // tests/journal_loop.rs, tests/journal.rs and tests/node_journal.rs.
    assert!(v.calls_executed >= 1, "{}", report.details());
    assert_eq!(v.call_duplicates, 0, "{}", report.details());
    assert_eq!(v.calls_lost, 0, "{}", report.details());
    assert_eq!(v.duplicates, 0, "{}", report.summary());
    assert_eq!(v.unapproved, 0, "{}", report.summary());
    assert_eq!(v.lost, 0, "{}", report.summary());
    assert_eq!(v.stuck, 0, "{}", report.summary());
    assert_eq!(v.unobserved, 0, "{}", report.summary());
    assert_eq!(v.watch_failures, 0, "{}", report.summary());
    assert_eq!(v.reconcile_unexpected, 0, "{}", report.summary());
    assert_eq!(v.early_wakes, 0, "{}", report.summary());
    assert_eq!(report.finalizers_held, Ok(0), "{}", report.summary());
    // Waits for a signal, each sent twice by the driver: taken once, and
    // every repeat admitted. (Two runs wait for one; a run that fails
    // before its wait never opens it.)
    assert!(report.signals_sent >= 1, "{}", report.details());
    assert_eq!(report.signal_repeats_refused, 0, "{}", report.details());
    assert!(
        report.apiserver_restart_failures.is_empty(),
        "{}",
        report.summary()
    );
    assert!(report.passed(), "{}", report.summary());
}
