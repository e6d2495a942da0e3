//! *Lost* (D3, D5), per run: a run that vanished; a committed checkpoint
//! (step or compensation) that changed or disappeared in a later status, or
//! a terminal phase that changed (the Observer's violations); a committed
//! `Succeeded` step whose result is not the one the step reported, or none
//! of whose key's executions succeeded (unless a person marked it
//! succeeded, or its verify probe truly found it applied:
//! `Facts::verified`); a successful execution whose key is not committed
//! `Succeeded` at the end (a dropped result).

use std::collections::BTreeSet;

use agentrun_operator::api::{ApprovalKind, CheckpointState, Decision, Provenance, StepPhase};
use kube::ResourceExt;

use super::facts::{Facts, approval_key};
use crate::chaos::workload::expected_result;

/// (run, finding) per loss; a run may have several.
pub(super) fn check(f: &Facts<'_>) -> Vec<(String, String)> {
    let e = f.e;
    let mut out = Vec::new();
    let finals: BTreeSet<String> = e.final_runs.iter().map(|r| r.name_any()).collect();
    for name in e.created.iter().filter(|n| !finals.contains(*n)) {
        out.push((name.clone(), format!("lost: run {name} vanished")));
    }
    for (run, what) in &e.observer.violations {
        out.push((run.clone(), format!("lost: run {run}: {what}")));
    }

    let marked_succeeded: BTreeSet<&str> = e
        .approvals
        .iter()
        .filter(|a| {
            a.spec.kind == ApprovalKind::Reconcile
                && a.spec.decision == Some(Decision::MarkSucceeded)
        })
        .filter_map(approval_key)
        .collect();
    let successes = e.ledger.successes_by_key();
    let mut committed_success: BTreeSet<&str> = BTreeSet::new();
    for run in e.final_runs {
        let name = run.name_any();
        let Some(status) = run.status.as_ref() else {
            continue;
        };
        for c in &status.steps {
            if c.phase != StepPhase::Succeeded || c.checkpoint != CheckpointState::Committed {
                continue;
            }
            committed_success.insert(&c.idempotency_key);
            if marked_succeeded.contains(c.idempotency_key.as_str()) {
                continue; // a person said it acted
            }
            if !c.role.is_step() || c.pod.is_none() {
                continue;
            }
            let verified = c.provenance == Some(Provenance::Verified);
            if verified && !f.verified(&c.idempotency_key) {
                out.push((
                    name.clone(),
                    format!(
                        "lost: run {name} step {} committed Succeeded as verified, but no probe of key {} answered Applied after an execution that acted",
                        c.name, c.idempotency_key
                    ),
                ));
            } else if !verified && successes.get(&c.idempotency_key).copied().unwrap_or(0) == 0 {
                out.push((
                    name.clone(),
                    format!(
                        "lost: run {name} step {} committed Succeeded but no execution of key {} succeeded",
                        c.name, c.idempotency_key
                    ),
                ));
            }
            let reported = expected_result(&name, &c.name);
            if !c.result_truncated && c.result.as_ref() != Some(&reported) {
                out.push((
                    name.clone(),
                    format!(
                        "lost: run {name} step {} committed result {:?}, the step reported {reported}",
                        c.name, c.result
                    ),
                ));
            }
        }
        for c in &status.compensations {
            if c.phase == StepPhase::Succeeded {
                committed_success.insert(&c.idempotency_key);
            }
        }
    }
    for (key, xs) in &f.by_key {
        let Some(x) = xs.iter().map(|&i| &f.executions[i]).find(|x| x.succeeded()) else {
            continue;
        };
        if !committed_success.contains(key) {
            out.push((
                x.run.to_owned(),
                format!(
                    "lost: run {} key {key}: pod {} succeeded but the key is not committed Succeeded (dropped result)",
                    x.run, x.pod
                ),
            ));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::super::Observer;
    use super::super::fixtures::*;
    use crate::ledger::Outcome;
    use agentrun_operator::api::RunPhase;
    use jiff::Timestamp;
    use serde_json::json;

    #[test]
    fn a_changed_checkpoint_or_terminal_phase_loses_the_run() {
        let mut o = Observer::default();
        let t = Timestamp::from_second(20).unwrap();
        o.observe(
            &run("r", 5, vec![committed("a", "k", "r")], RunPhase::Succeeded),
            t,
        );
        let mut changed = committed("a", "k", "r");
        changed.attempt = 2;
        let r = run("r", 6, vec![changed], RunPhase::Running);
        o.observe(&r, t);
        assert_eq!(o.violations.len(), 2, "{:?}", o.violations);
        let v = judge(
            &o,
            &[r],
            exec("1", "k", 10, Outcome::Succeeded, 11).to_vec(),
        );
        assert_eq!((v.lost, v.stuck), (1, 1), "{v:?}");
    }

    #[test]
    fn a_dropped_success_and_a_vanished_run_are_lost() {
        let mut o = Observer::default();
        saw_finish(&mut o);
        let v = judge(&o, &[], exec("1", "k", 10, Outcome::Succeeded, 11).to_vec());
        assert_eq!(v.lost, 1);
        assert_eq!(v.findings.len(), 2, "{:?}", v.findings);
    }

    #[test]
    fn a_made_up_success_or_result_loses_the_run_unless_a_person_marked_it() {
        let mut o = Observer::default();
        saw_finish(&mut o);
        // Committed Succeeded, but its only execution was killed.
        let r = run("r", 5, vec![committed("a", "k", "r")], RunPhase::Succeeded);
        let killed = exec("1", "k", 10, Outcome::Killed, 11).to_vec();
        let v = judge(&o, std::slice::from_ref(&r), killed.clone());
        assert_eq!(v.lost, 1, "{v:?}");
        assert!(v.findings[0].contains("no execution of key k succeeded"));
        // A person looked and said it acted.
        let marked = approval("Reconcile", Some("MarkSucceeded"), "Resolved", "Reject");
        let v = judge_with(&o, std::slice::from_ref(&r), &[marked], killed);
        assert_eq!(v.lost, 0, "{v:?}");
        // Another result than the step reported.
        let mut wrong = committed("a", "k", "r");
        wrong.result = Some(json!({"run": "r", "step": "b"}));
        let r = run("r", 5, vec![wrong], RunPhase::Succeeded);
        let v = judge(
            &o,
            &[r],
            exec("1", "k", 10, Outcome::Succeeded, 11).to_vec(),
        );
        assert_eq!(v.lost, 1, "{v:?}");
        assert!(
            v.findings[0].contains("committed result"),
            "{:?}",
            v.findings
        );
    }

    #[test]
    fn a_verified_step_stands_only_on_a_true_applied_answer() {
        let mut o = Observer::default();
        saw_finish(&mut o);
        let mut cp = committed("a", "k", "r");
        cp.provenance = Some(agentrun_operator::api::Provenance::Verified);
        let r = run("r", 5, vec![cp], RunPhase::Succeeded);
        let ledger = |acted: bool| {
            let mut l = acting(exec("1", "k", 10, Outcome::Killed, 11), acted).to_vec();
            l.extend(probe(
                "v",
                "k",
                "1970-01-01T00:00:12Z",
                "Applied",
                "1970-01-01T00:00:13Z",
            ));
            l
        };
        // The attempt acted before it was killed; the probe found it.
        let v = judge(&o, std::slice::from_ref(&r), ledger(true));
        assert_eq!(v.lost, 0, "{v:?}");
        // Nothing acted: the probe's Applied is made up.
        let v = judge(&o, std::slice::from_ref(&r), ledger(false));
        assert_eq!(v.lost, 1, "{v:?}");
        assert!(
            v.findings[0].contains("committed Succeeded as verified"),
            "{:?}",
            v.findings
        );
    }
}
