//! *Stuck*, per run: created by the driver and not in a terminal phase when
//! the settle deadline passed. The approver answers every Approval, so a run
//! still waiting for one is stuck too. Also tallies the final phases.

use std::collections::BTreeMap;

use agentrun_operator::api::{AgentRun, RunPhase};
use kube::ResourceExt;

use super::facts::Facts;

/// One finding per stuck run.
pub(super) fn check(f: &Facts<'_>) -> Vec<String> {
    f.e.final_runs
        .iter()
        .filter(|r| f.e.created.contains(&r.name_any()))
        .filter_map(|r| {
            let status = r.status.as_ref();
            let phase = status.and_then(|s| s.phase);
            if phase.is_some_and(RunPhase::is_terminal) {
                return None;
            }
            let current = status.and_then(|s| s.current_step.clone());
            Some(format!(
                "stuck: run {} is {phase:?} at step {current:?}",
                r.name_any()
            ))
        })
        .collect()
}

/// The final runs by phase.
pub(super) fn phases(runs: &[AgentRun]) -> BTreeMap<String, usize> {
    let mut phases = BTreeMap::new();
    for r in runs {
        let phase = r.status.as_ref().and_then(|s| s.phase);
        *phases
            .entry(
                phase
                    .map(|p| format!("{p:?}"))
                    .unwrap_or_else(|| "None".into()),
            )
            .or_default() += 1;
    }
    phases
}

#[cfg(test)]
mod tests {
    use super::super::Observer;
    use super::super::fixtures::*;
    use agentrun_operator::api::RunPhase;
    use std::collections::BTreeMap;

    #[test]
    fn a_run_left_waiting_is_stuck_and_a_finished_one_is_not() {
        let mut o = Observer::default();
        saw_finish(&mut o);
        let waiting = run("r", 5, vec![], RunPhase::WaitingForApproval);
        let v = judge(&o, &[waiting], vec![]);
        assert_eq!(v.stuck, 1, "{v:?}");
        assert!(
            v.findings
                .iter()
                .any(|f| f == "stuck: run r is Some(WaitingForApproval) at step None"),
            "{:?}",
            v.findings
        );
        assert!(!v.passed());
        let failed = run("r", 5, vec![], RunPhase::Failed);
        let v = judge(&o, &[failed], vec![]);
        assert_eq!(v.stuck, 0, "{v:?}");
        assert_eq!(v.phases, BTreeMap::from([("Failed".to_owned(), 1)]));
        assert!(v.passed(), "{v:?}");
    }
}
