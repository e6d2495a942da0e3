//! *Blind re-run* (D6): an execution of a NonIdempotent step under a key one
//! of whose earlier executions may have acted without saying whether it did —
//! killed, failed without reporting `NotApplied`, or never seen to end — not
//! preceded by as many `Retry` decisions on the key's Reconcile questions
//! (by the API server's time of the decision) as there were such executions.
//! A failed attempt that said `NotApplied` may be retried without asking.

use agentrun_operator::api::Effect;

use super::Breach;
use super::facts::Facts;

pub(super) fn check(f: &Facts<'_>) -> Vec<Breach> {
    let mut out = Vec::new();
    for (key, xs) in &f.by_key {
        let Some(first) = xs.first().map(|&i| &f.executions[i]) else {
            continue;
        };
        // A journaled step's attempts replay; its calls are judged one by one.
        if !first.is_step()
            || f.journaled(first.run, first.step)
            || f.effect(first.run, first.step)
                .unwrap_or(Effect::NonIdempotent)
                != Effect::NonIdempotent
        {
            continue;
        }
        let retries = f.retries(key);
        for (p, &i) in xs.iter().enumerate() {
            let x = &f.executions[i];
            let unsettled = xs[..p]
                .iter()
                .filter(|&&j| f.executions[j].unsettled())
                .count();
            let retried = retries.iter().filter(|r| r.before(x.started_at)).count();
            if retried < unsettled {
                out.push(Breach {
                    exec: i,
                    why: format!(
                        "a NonIdempotent step re-run after {unsettled} execution(s) that may have acted (killed, or failed without saying NotApplied) with {retried} Retry decision(s) before it"
                    ),
                });
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::super::Observer;
    use super::super::fixtures::*;
    use crate::ledger::Outcome;
    use agentrun_operator::api::{Effect, RunPhase};

    fn killed_then_succeeded(first: Outcome) -> Vec<crate::ledger::LedgerEntry> {
        let mut ledger = exec_at(
            "1",
            "k",
            "2026-01-01T10:00:10Z",
            first,
            "2026-01-01T10:00:11Z",
        )
        .to_vec();
        ledger.extend(exec_at(
            "2",
            "k",
            "2026-01-01T10:00:20Z",
            Outcome::Succeeded,
            "2026-01-01T10:00:21Z",
        ));
        ledger
    }

    /// An observer that saw run `r` finish, and the run: step `a` committed
    /// Succeeded under key `k`.
    fn seen_succeeded() -> (Observer, [agentrun_operator::api::AgentRun; 1]) {
        let mut o = Observer::default();
        saw_finish(&mut o);
        let finals = [run(
            "r",
            5,
            vec![committed("a", "k", "r")],
            RunPhase::Succeeded,
        )];
        (o, finals)
    }

    #[test]
    fn a_non_idempotent_step_re_run_after_a_kill_needs_a_retry_decision_before_it() {
        let (o, finals) = seen_succeeded();
        let ledger = killed_then_succeeded(Outcome::Killed);
        // No Reconcile approval at all.
        let v = judge_with(&o, &finals, &[], ledger.clone());
        assert_eq!((v.duplicates, v.blind_reruns), (1, 1), "{v:?}");
        assert!(
            v.findings[0].contains("pod pod-2")
                && v.findings[0].contains("after 1 execution(s) that may have acted")
                && v.findings[0].contains("with 0 Retry"),
            "{:?}",
            v.findings
        );
        // Retry decided at 10:00:25, after the re-run started.
        let v = judge_with(
            &o,
            &finals,
            &[retry_at("2026-01-01T10:00:25Z")],
            ledger.clone(),
        );
        assert_eq!(v.blind_reruns, 1, "{v:?}");
        // Retry decided at 10:00:15: the re-run was asked for.
        let v = judge_with(&o, &finals, &[retry_at("2026-01-01T10:00:15Z")], ledger);
        assert!(v.passed(), "{v:?}");
    }

    #[test]
    fn a_failure_that_did_not_say_not_applied_needs_a_retry_decision_too() {
        let (o, finals) = seen_succeeded();
        let v = judge_with(&o, &finals, &[], killed_then_succeeded(Outcome::Failed));
        assert_eq!((v.duplicates, v.blind_reruns), (1, 1), "{v:?}");
        let v = judge_with(
            &o,
            &finals,
            &[retry_at("2026-01-01T10:00:15Z")],
            killed_then_succeeded(Outcome::Failed),
        );
        assert!(v.passed(), "{v:?}");
    }

    #[test]
    fn a_failure_that_said_not_applied_is_retried_without_asking() {
        let (o, finals) = seen_succeeded();
        let mut ledger = killed_then_succeeded(Outcome::Failed);
        ledger[1] = ledger[1]
            .clone()
            .reporting(Some(agentrun_operator::api::EffectOutcome::NotApplied));
        let v = judge_with(&o, &finals, &[], ledger);
        assert!(v.passed(), "{v:?}");
    }

    #[test]
    fn a_killed_attempt_then_a_success_is_not_a_duplicate_for_an_idempotent_step() {
        let mut o = Observer::default();
        saw_finish(&mut o);
        let r = with_effect(
            run("r", 5, vec![committed("a", "k", "r")], RunPhase::Succeeded),
            Effect::Idempotent,
        );
        assert!(judge(&o, &[r], killed_then_succeeded(Outcome::Killed)).passed());
    }

    #[test]
    fn a_probe_that_found_the_attempt_not_applied_lets_it_run_again_only_when_true() {
        let (o, finals) = seen_succeeded();
        let rerun = |first_acted: bool, probe_start: &str| {
            let mut ledger = killed_then_succeeded(Outcome::Killed);
            ledger[1] = ledger[1].clone().acting(first_acted);
            ledger.extend(probe(
                "v",
                "k",
                probe_start,
                "NotApplied",
                "2026-01-01T10:00:13Z",
            ));
            judge_with(&o, &finals, &[], ledger)
        };
        // Killed before it acted (10:00:11), probed after (10:00:12): no person needed.
        let v = rerun(false, "2026-01-01T10:00:12Z");
        assert!(v.passed(), "{v:?}");
        // The ledger says it acted: the probe's NotApplied is not believed.
        let v = rerun(true, "2026-01-01T10:00:12Z");
        assert_eq!((v.duplicates, v.blind_reruns), (1, 1), "{v:?}");
        // A probe beside the live attempt settles nothing (and is a finding of its own).
        let v = rerun(false, "2026-01-01T10:00:10.500Z");
        assert_eq!((v.blind_reruns, v.early_probes), (1, 1), "{v:?}");
    }
}
