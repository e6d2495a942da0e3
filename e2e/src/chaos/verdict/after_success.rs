//! *After a success*: an execution of a key that starts once an earlier
//! execution of that key has finished `Succeeded`, or a second success of
//! it — a re-run after a dropped or unseen result, caught whether the re-run
//! then succeeds, fails or is killed, and even before any commit was seen
//! (D3, D5). The one exception: a success that outlived its step's
//! `timeout`, which the operator stopped and recorded as failed; running
//! its key again is the retry the timeout asks for.

use super::Breach;
use super::facts::Facts;

pub(super) fn check(f: &Facts<'_>) -> Vec<Breach> {
    let mut out = Vec::new();
    for key in f.by_key.keys() {
        let Some((first, first_pod, done)) = f
            .of_key(key)
            .filter(|(_, x)| x.succeeded() && !f.outlived_timeout(x))
            .min_by_key(|(_, x)| x.finished_at)
            .map(|(i, x)| (i, x.pod, x.finished_at))
        else {
            continue;
        };
        for (i, x) in f.of_key(key) {
            if i == first {
                continue;
            }
            if x.succeeded() {
                out.push(Breach {
                    exec: i,
                    why: format!("a second success (first: pod {first_pod})"),
                });
            } else if done.is_some_and(|d| x.started_at >= d) {
                out.push(Breach {
                    exec: i,
                    why: format!("started after its key had succeeded (pod {first_pod})"),
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

    #[test]
    fn a_second_success_is_a_duplicate_even_before_the_commit_was_seen() {
        let mut o = Observer::default();
        saw_finish(&mut o);
        let r = run("r", 5, vec![committed("a", "k", "r")], RunPhase::Succeeded);
        let mut ledger = exec("1", "k", 10, Outcome::Succeeded, 11).to_vec();
        ledger.extend(exec("2", "k", 12, Outcome::Succeeded, 13));
        let v = judge(&o, &[r], ledger);
        assert_eq!((v.duplicates, v.after_success), (1, 1), "{v:?}");
        assert!(
            v.findings[0].contains("pod pod-2") && v.findings[0].contains("first: pod pod-1"),
            "{:?}",
            v.findings
        );
    }

    #[test]
    fn failures_then_one_success_are_not_a_second_success() {
        let mut o = Observer::default();
        saw_finish(&mut o);
        let r = with_effect(
            run("r", 5, vec![committed("a", "k", "r")], RunPhase::Succeeded),
            Effect::Idempotent,
        );
        let mut ledger = exec("1", "k", 10, Outcome::Failed, 11).to_vec();
        ledger.extend(exec("2", "k", 12, Outcome::Failed, 13));
        ledger.extend(exec("3", "k", 14, Outcome::Succeeded, 15));
        let v = judge(&o, &[r], ledger);
        assert!(v.passed(), "{v:?}");
        assert_eq!(v.successful_executions, 1);
    }

    /// A success never committed (its result dropped), then the key run
    /// again and failed, or killed: no second success, still a re-run of
    /// what had already happened.
    #[test]
    fn a_run_after_an_uncommitted_success_is_a_duplicate_whatever_its_outcome() {
        for outcome in [Outcome::Failed, Outcome::Killed] {
            let mut o = Observer::default();
            saw_finish(&mut o);
            let r = with_effect(run("r", 5, vec![], RunPhase::Failed), Effect::Idempotent);
            let mut ledger = exec("1", "k", 10, Outcome::Succeeded, 11).to_vec();
            ledger.extend(exec("2", "k", 12, outcome, 13));
            let v = judge(&o, &[r], ledger);
            assert_eq!(
                (v.duplicates, v.after_success),
                (1, 1),
                "{outcome:?}: {v:?}"
            );
            assert!(
                v.findings[0].contains("pod pod-2")
                    && v.findings[0].contains("started after its key had succeeded (pod pod-1)"),
                "{:?}",
                v.findings
            );
        }
    }
}
