//! *Repeated effect* (D1, D8): the unit the contract protects is a step's
//! effect, (run, step name), across every plan revision and key. Executions
//! are grouped per step; an execution is a duplicate when the step's effect
//! had already happened under **another** key and no person let it happen
//! again before it started:
//!
//! - a `NonIdempotent` step: every earlier execution that may have acted (it
//!   started and did not say `NotApplied`) needs a person's leave — a
//!   Reconcile question answered `Retry`, or an `Approve` question with
//!   `spec.context.repeats` answered `Approved` — decided before this one
//!   started. (Re-runs under the execution's own key alone are `blind_rerun`'s.)
//! - an `Idempotent` step: every other key that already acted (succeeded, or
//!   the ledger records that it acted before it was killed) needs an
//!   approved repeat: the new key defeats the downstream system's dedup.
//! - a step whose effect cannot be looked up: as `NonIdempotent`, the default.
//! - `None` (reads) may run again under any key: a re-plan re-runs expired reads.

use std::collections::BTreeSet;

use agentrun_operator::api::Effect;

use super::Breach;
use super::facts::{Facts, LeaveKind};

pub(super) fn check(f: &Facts<'_>) -> Vec<Breach> {
    let mut out = Vec::new();
    for (&(run, step), xs) in &f.by_step {
        // A step whose effect cannot be looked up (its run is gone, or a
        // planner's step a later plan dropped) is judged as the documented
        // default, NonIdempotent: the referee is never less strict than the
        // contract.
        let effect = f.effect(run, step).unwrap_or(Effect::NonIdempotent);
        // A journaled step's effects are its calls (`journal_calls`).
        if effect == Effect::None || f.journaled(run, step) {
            continue;
        }
        let leaves = f.leaves(run, step);
        for (p, &i) in xs.iter().enumerate() {
            let x = &f.executions[i];
            let earlier = xs[..p].iter().map(|&j| &f.executions[j]);
            let allowed = |kinds: &[LeaveKind]| {
                leaves
                    .iter()
                    .filter(|l| kinds.contains(&l.kind) && l.before(x.started_at))
                    .count()
            };
            let (acted, allowed, keys) = if effect == Effect::NonIdempotent {
                let acted: Vec<_> = earlier.filter(|y| y.may_have_acted()).collect();
                if acted.iter().all(|y| y.key == x.key) {
                    continue;
                }
                let keys: BTreeSet<&str> = acted.iter().map(|y| y.key).collect();
                (
                    acted.len(),
                    allowed(&[LeaveKind::Retry, LeaveKind::Repeat]),
                    keys,
                )
            } else {
                // Acted: it succeeded, or the ledger records that it acted
                // before it was killed or failed.
                let keys: BTreeSet<&str> = earlier
                    .filter(|y| {
                        y.key != x.key
                            && (y.succeeded() || y.acted == Some(true))
                            && !y.said_not_applied
                            && y.finished_at.is_some_and(|t| t <= x.started_at)
                    })
                    .map(|y| y.key)
                    .collect();
                (keys.len(), allowed(&[LeaveKind::Repeat]), keys)
            };
            if acted > allowed {
                out.push(Breach {
                    exec: i,
                    why: format!(
                        "step {step} ({effect:?}) had already acted, or may have, {acted} time(s) under key(s) {} and a person allowed {allowed} repeat(s) before it",
                        keys.into_iter().collect::<Vec<_>>().join(", "),
                    ),
                });
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::super::fixtures::*;
    use super::super::{Observer, Verdict};
    use crate::ledger::{LedgerEntry, Outcome};
    use agentrun_operator::api::{AgentRun, Approval, Effect, RunPhase, StepPhase};

    /// Run `r` whose step `a` (`effect`) ended under key `k1` (committed
    /// Succeeded if `first` succeeded) and succeeded under `k2` (plan
    /// revisions 1 and 2).
    fn replanned(effect: Effect, first: Outcome) -> AgentRun {
        let mut before = committed("a", "k1", "r");
        if first != Outcome::Succeeded {
            before.phase = StepPhase::Superseded;
            before.result = None;
        }
        let mut second = committed("a", "k2", "r");
        second.plan_revision = 2;
        with_effect(
            run("r", 5, vec![before, second], RunPhase::Succeeded),
            effect,
        )
    }

    /// Executions of step `a` under `k1` at 10:00:10, then `k2` at 10:00:20.
    fn two_keys(first: Outcome) -> Vec<LedgerEntry> {
        let mut ledger = exec_at(
            "1",
            "k1",
            "2026-01-01T10:00:10Z",
            first,
            "2026-01-01T10:00:11Z",
        )
        .to_vec();
        ledger.extend(exec_at(
            "2",
            "k2",
            "2026-01-01T10:00:20Z",
            Outcome::Succeeded,
            "2026-01-01T10:00:21Z",
        ));
        ledger
    }

    fn judged(effect: Effect, approvals: &[Approval], ledger: Vec<LedgerEntry>) -> Verdict {
        let mut o = Observer::default();
        saw_finish(&mut o);
        let first = ledger[1].outcome.expect("a finished line");
        judge_disrupted(&o, &[replanned(effect, first)], approvals, ledger, &[])
    }

    #[test]
    fn a_non_idempotent_step_run_again_under_a_new_key_is_a_duplicate() {
        // The re-plan loop: charge acted at revision 1, then ran at 2 and 3.
        let mut ledger = two_keys(Outcome::Succeeded);
        ledger.extend(exec_at(
            "3",
            "k3",
            "2026-01-01T10:00:30Z",
            Outcome::Succeeded,
            "2026-01-01T10:00:31Z",
        ));
        let v = judged(Effect::NonIdempotent, &[], ledger);
        assert_eq!((v.duplicates, v.repeated_effects), (2, 2), "{v:?}");
        assert_eq!((v.after_commit, v.blind_reruns), (0, 0), "{v:?}");
        assert!(
            v.findings[0].contains("pod pod-2")
                && v.findings[0].contains("1 time(s) under key(s) k1")
                && v.findings[1].contains("pod pod-3")
                && v.findings[1].contains("2 time(s) under key(s) k1, k2"),
            "{:?}",
            v.findings
        );
        assert!(!v.passed());
    }

    #[test]
    fn an_execution_that_may_have_acted_counts_like_one_that_did() {
        // Killed mid-run at revision 1, then run under a new key unasked.
        let v = judged(Effect::NonIdempotent, &[], two_keys(Outcome::Killed));
        assert_eq!(v.repeated_effects, 1, "{v:?}");
        // A failure that said NotApplied did not act: a new key may run it.
        let mut ledger = two_keys(Outcome::Failed);
        ledger[1] = ledger[1]
            .clone()
            .reporting(Some(agentrun_operator::api::EffectOutcome::NotApplied));
        assert_eq!(
            judged(Effect::NonIdempotent, &[], ledger).repeated_effects,
            0
        );
    }

    #[test]
    fn a_repeat_a_person_approved_before_it_started_is_not_a_duplicate() {
        let ledger = two_keys(Outcome::Succeeded);
        let v = judged(
            Effect::NonIdempotent,
            &[repeat_approved("2026-01-01T10:00:15Z")],
            ledger.clone(),
        );
        assert!(v.passed(), "{v:?}");
        // Approved only after it ran.
        let v = judged(
            Effect::NonIdempotent,
            &[repeat_approved("2026-01-01T10:00:25Z")],
            ledger.clone(),
        );
        assert_eq!(v.repeated_effects, 1, "{v:?}");
        // Rejected: no leave (and the run is behind a gate that said no).
        let mut rejected = repeat_approved("2026-01-01T10:00:15Z");
        rejected.spec.decision = Some(agentrun_operator::api::Decision::Rejected);
        rejected.status.as_mut().unwrap().phase = agentrun_operator::api::ApprovalPhase::Rejected;
        let v = judged(Effect::NonIdempotent, &[rejected], ledger);
        assert_eq!((v.repeated_effects, v.unapproved), (1, 1), "{v:?}");
    }

    #[test]
    fn a_retry_decision_lets_a_non_idempotent_step_run_again() {
        // Killed at revision 1; a person said it did not act (Retry) before
        // the run went on under a new key.
        let retry = about(retry_at("2026-01-01T10:00:15Z"), "r-a-reconcile", "k1");
        let v = judged(Effect::NonIdempotent, &[retry], two_keys(Outcome::Killed));
        assert!(v.passed(), "{v:?}");
    }

    #[test]
    fn one_leave_does_not_cover_two_effects() {
        // Killed, Retry, the retry succeeded under k1; then k2 ran unasked:
        // the Retry was spent on k1's second attempt.
        let retry = about(retry_at("2026-01-01T10:00:12Z"), "r-a-reconcile", "k1");
        let mut ledger = exec_at(
            "1",
            "k1",
            "2026-01-01T10:00:10Z",
            Outcome::Killed,
            "2026-01-01T10:00:11Z",
        )
        .to_vec();
        ledger.extend(exec_at(
            "2",
            "k1",
            "2026-01-01T10:00:13Z",
            Outcome::Succeeded,
            "2026-01-01T10:00:14Z",
        ));
        ledger.extend(exec_at(
            "3",
            "k2",
            "2026-01-01T10:00:20Z",
            Outcome::Succeeded,
            "2026-01-01T10:00:21Z",
        ));
        let v = judged(Effect::NonIdempotent, &[retry], ledger);
        assert_eq!((v.duplicates, v.repeated_effects), (1, 1), "{v:?}");
        assert!(v.findings[0].contains("pod pod-3"), "{:?}", v.findings);
    }

    #[test]
    fn an_idempotent_step_under_a_new_key_after_a_success_is_a_duplicate() {
        let v = judged(Effect::Idempotent, &[], two_keys(Outcome::Succeeded));
        assert_eq!((v.duplicates, v.repeated_effects), (1, 1), "{v:?}");
        let v = judged(
            Effect::Idempotent,
            &[repeat_approved("2026-01-01T10:00:15Z")],
            two_keys(Outcome::Succeeded),
        );
        assert!(v.passed(), "{v:?}");
        // A key that never succeeded is no effect to repeat.
        let v = judged(Effect::Idempotent, &[], two_keys(Outcome::Killed));
        assert!(v.passed(), "{v:?}");
    }

    /// An Idempotent step killed after it acted under `k1`, then run under
    /// `k2`: the effect happened twice under two keys, though `k1` never
    /// succeeded.
    #[test]
    fn an_idempotent_step_that_acted_then_ran_under_a_new_key_is_a_duplicate() {
        let mut ledger = acting(
            exec_at(
                "1",
                "k1",
                "2026-01-01T10:00:10Z",
                Outcome::Killed,
                "2026-01-01T10:00:11Z",
            ),
            true,
        )
        .to_vec();
        ledger.extend(exec_at(
            "2",
            "k2",
            "2026-01-01T10:00:20Z",
            Outcome::Succeeded,
            "2026-01-01T10:00:21Z",
        ));
        let v = judged(Effect::Idempotent, &[], ledger.clone());
        assert_eq!((v.duplicates, v.repeated_effects), (1, 1), "{v:?}");
        // Killed before it acted: nothing to repeat.
        ledger[1] = ledger[1].clone().acting(false);
        let v = judged(Effect::Idempotent, &[], ledger);
        assert!(v.passed(), "{v:?}");
    }

    /// A step the final runs do not declare (a planner's step a later plan
    /// dropped) is judged as NonIdempotent, the default, not skipped.
    #[test]
    fn a_step_whose_effect_cannot_be_looked_up_is_judged_as_non_idempotent() {
        let mut o = Observer::default();
        saw_finish(&mut o);
        let mut r = replanned(Effect::Idempotent, Outcome::Killed);
        r.spec.steps[0].name = "renamed".into();
        let v = judge_disrupted(&o, &[r], &[], two_keys(Outcome::Killed), &[]);
        assert_eq!(v.repeated_effects, 1, "{v:?}");
    }

    /// A Retry whose decision time cannot be recovered is no leave: the
    /// operator treats such a decision as late.
    #[test]
    fn a_decision_without_a_time_lets_nothing_run_again() {
        let mut retry = about(
            approval("Reconcile", Some("Retry"), "Approved", "Reject"),
            "r-a-r1-reconcile",
            "k1",
        );
        retry.metadata.managed_fields = None;
        let v = judged(Effect::NonIdempotent, &[retry], two_keys(Outcome::Killed));
        assert_eq!(v.repeated_effects, 1, "{v:?}");
    }

    #[test]
    fn a_read_runs_again_after_it_expired() {
        let v = judged(Effect::None, &[], two_keys(Outcome::Succeeded));
        assert!(v.passed(), "{v:?}");
    }
}
