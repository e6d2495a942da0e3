//! *Early wake* (D10 for time): no step that comes after a wait step starts
//! before the wait's `wakeAt` — whatever operator died, paused or ran a
//! skewed clock meanwhile — and none after a wait for a signal starts before
//! the signal was recorded (its `finishedAt`; its `wakeAt` is a deadline).
//! The steps after a wait are the next one in a sequence, or those that name
//! it in `dependsOn`. An execution of such a step that started after the
//! wait started and before its end is a finding.

use agentrun_operator::api::StepSpec;
use kube::ResourceExt;

use super::facts::Facts;

/// The names of the steps that start after step `i` of `steps`.
fn after(steps: &[StepSpec], i: usize) -> Vec<&str> {
    let graph = steps.iter().any(|s| s.depends_on.is_some());
    let name = steps[i].name.as_str();
    if !graph {
        return steps
            .get(i + 1)
            .map(|s| s.name.as_str())
            .into_iter()
            .collect();
    }
    steps
        .iter()
        .filter(|s| s.depends_on.iter().flatten().any(|d| d == name))
        .map(|s| s.name.as_str())
        .collect()
}

pub(super) fn check(f: &Facts<'_>) -> Vec<String> {
    let mut out = Vec::new();
    for run in f.e.final_runs {
        let name = run.name_any();
        let Some(status) = run.status.as_ref() else {
            continue;
        };
        let planned = status
            .plan
            .as_ref()
            .filter(|p| !p.steps.is_empty())
            .map_or(run.spec.steps.as_slice(), |p| p.steps.as_slice());
        for c in status.steps.iter().filter(|c| c.role.is_step()) {
            // A timer ends at its wake; a signal when it was recorded.
            let end = if c.signal.is_some() {
                c.finished_at.as_ref()
            } else {
                c.wake_at.as_ref()
            };
            let (Some(from), Some(wake)) = (c.started_at.as_ref(), end) else {
                continue;
            };
            let Some(i) = planned.iter().position(|s| s.name == c.name) else {
                continue;
            };
            for next in after(planned, i) {
                let Some(steps) = f.by_step.get(&(name.as_str(), next)) else {
                    continue;
                };
                for x in steps.iter().map(|&k| &f.executions[k]) {
                    if x.started_at >= from.0 && x.started_at < wake.0 {
                        out.push(format!(
                            "early: run {name} step {next} started at {} (pod {}), before the wait {} {} at {}",
                            x.started_at,
                            x.pod,
                            c.name,
                            if c.signal.is_some() { "received its signal" } else { "woke" },
                            wake.0
                        ));
                    }
                }
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use agentrun_operator::api::{AgentRun, StepCheckpoint, StepPhase};
    use jiff::Timestamp;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
    use serde_json::json;

    use super::super::fixtures::*;
    use super::super::{Evidence, Observer};
    use super::*;
    use crate::ledger::{Ledger, Outcome};

    fn at(s: i64) -> Time {
        Time(Timestamp::from_second(s).unwrap())
    }

    /// Run `r`: wait `w` (10 s → 20 s), then step `a`.
    fn waited() -> AgentRun {
        let mut r: AgentRun = serde_json::from_value(json!({
            "apiVersion": "agentrun.dev/v1alpha1", "kind": "AgentRun",
            "metadata": {"name": "r"},
            "spec": {"steps": [
                {"name": "w", "wait": {"for": "10s"}},
                {"name": "a", "effect": "None", "container": {"image": "x"}},
            ]},
        }))
        .unwrap();
        r.status = Some(agentrun_operator::api::AgentRunStatus {
            steps: vec![StepCheckpoint {
                name: "w".into(),
                plan_revision: 1,
                phase: StepPhase::Succeeded,
                started_at: Some(at(10)),
                wake_at: Some(at(20)),
                finished_at: Some(at(20)),
                ..StepCheckpoint::default()
            }],
            ..Default::default()
        });
        r
    }

    fn findings(start: i64) -> Vec<String> {
        findings_in(waited(), start)
    }

    fn findings_in(run: AgentRun, start: i64) -> Vec<String> {
        let runs = [run];
        let ledger = Ledger {
            entries: exec("1", "k", start, Outcome::Succeeded, start + 1).to_vec(),
        };
        let observer = Observer::default();
        let e = Evidence {
            created: &["r".to_owned()],
            final_runs: &runs,
            approvals: &[],
            ledger: &ledger,
            observer: &observer,
            disrupted_keys: &BTreeSet::new(),
            journals: &[],
            declared_calls: &Default::default(),
        };
        check(&Facts::new(&e))
    }

    #[test]
    fn a_step_after_a_wait_that_starts_before_the_wake_is_a_finding() {
        let f = findings(15);
        assert_eq!(f.len(), 1, "{f:?}");
        assert!(f[0].starts_with("early: run r step a started at"), "{f:?}");
        assert!(findings(20).is_empty(), "at the wake is on time");
        assert!(
            findings(5).is_empty(),
            "before the wait began: another revision"
        );
    }

    /// A wait for a signal ends when the signal was recorded, long before
    /// its deadline (`wakeAt`): a step after it is on time from then on, and
    /// early before it.
    #[test]
    fn a_step_after_a_signal_is_judged_by_when_the_signal_was_recorded() {
        let mut r = waited();
        let cp = &mut r.status.as_mut().unwrap().steps[0];
        cp.signal = Some("r-w-1a2b3c-r1-signal".into());
        cp.wake_at = Some(at(3600));
        cp.finished_at = Some(at(14));
        assert!(
            findings_in(r.clone(), 15).is_empty(),
            "after the signal, before the deadline"
        );
        let f = findings_in(r, 12);
        assert_eq!(f.len(), 1, "{f:?}");
        assert!(
            f[0].contains("before the wait w received its signal at"),
            "{f:?}"
        );
    }
}
