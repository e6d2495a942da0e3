//! The bounded short chaos run (the long one is `make chaos`): forty runs
//! under injected API faults, operator SIGKILLs, bulk evictions and Pod
//! deletes, on the standard e2e plane in a namespace of its own. Fails on any
//! duplicate execution, lost run or checkpoint, stuck run, or too few faults.

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
    assert!(report.faults() >= report.faults_min, "{}", report.summary());
    assert_eq!(report.verdict.duplicates, 0, "{}", report.summary());
    assert_eq!(report.verdict.lost, 0, "{}", report.summary());
    assert_eq!(report.verdict.stuck, 0, "{}", report.summary());
    assert!(report.passed(), "{}", report.summary());
}
