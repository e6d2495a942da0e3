//! *After the commit* (D3, D4): an execution that started after its key's
//! outcome — a success, or a failure for good, which no execution may follow
//! either — was committed: by the API server's time of the status write in
//! which the checkpoint first appeared committed (the operator's `status`
//! entry in `managedFields`, whole seconds, so a start ≥ 1 s after it is
//! after the commit), or after the driver's watch first saw it committed.

use jiff::SignedDuration;

use super::Breach;
use super::facts::Facts;

pub(super) fn check(f: &Facts<'_>) -> Vec<Breach> {
    let mut out = Vec::new();
    for key in f.by_key.keys() {
        let Some(c) = f.e.observer.committed_at.get(*key) else {
            continue;
        };
        for (i, x) in f.of_key(key) {
            let after_written = c
                .written
                .is_some_and(|w| x.started_at >= w + SignedDuration::from_secs(1));
            let after_seen = x.started_at > c.seen;
            if after_written || after_seen {
                out.push(Breach {
                    exec: i,
                    why: format!(
                        "after its outcome was committed ({:?}, written {}, seen {})",
                        c.phase,
                        c.written
                            .map(|w| w.to_string())
                            .unwrap_or_else(|| "?".into()),
                        c.seen
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
    use agentrun_operator::api::{RunPhase, StepPhase};
    use jiff::Timestamp;

    #[test]
    fn an_execution_after_the_commit_is_a_duplicate() {
        let mut o = Observer::default();
        let r = run("r", 5, vec![committed("a", "k", "r")], RunPhase::Succeeded);
        o.observe(&r, Timestamp::from_second(20).unwrap());
        let mut ledger = exec("1", "k", 10, Outcome::Succeeded, 11).to_vec();
        ledger.extend(exec("2", "k", 30, Outcome::Killed, 31));
        let v = judge(&o, &[r], ledger);
        assert_eq!((v.duplicates, v.after_commit), (1, 1), "{v:?}");
    }

    #[test]
    fn a_committed_probe_is_not_its_steps_outcome() {
        // The probe (role Verify, the step's own key) answered NotApplied and
        // was committed at 20; the step's attempt 2 under the same key ran at 30.
        let mut o = Observer::default();
        let mut probe = committed("a", "k", "r");
        probe.role = agentrun_operator::api::StepRole::Verify;
        let mut step = committed("a", "k", "r");
        step.phase = StepPhase::Pending;
        step.checkpoint = agentrun_operator::api::CheckpointState::Pending;
        let r = run("r", 5, vec![step, probe.clone()], RunPhase::Running);
        o.observe(&r, Timestamp::from_second(20).unwrap());
        assert!(!o.committed_at.contains_key("k"), "{:?}", o.committed_at);
        let mut ledger = acting(exec("1", "k", 10, Outcome::Killed, 11), false).to_vec();
        ledger.extend(probe_at(12, 13));
        ledger.extend(exec("2", "k", 30, Outcome::Succeeded, 31));
        let finals = [run(
            "r",
            6,
            vec![committed("a", "k", "r"), probe],
            RunPhase::Succeeded,
        )];
        o.observe(&finals[0], Timestamp::from_second(40).unwrap());
        let v = judge(&o, &finals, ledger);
        assert!(v.passed(), "{v:?}");
    }

    /// A probe of key `k` from second `start` to `end` that found nothing applied.
    fn probe_at(start: i64, end: i64) -> [crate::ledger::LedgerEntry; 2] {
        let t = |s: i64| Timestamp::from_second(s).unwrap().to_string();
        probe("v", "k", &t(start), "NotApplied", &t(end))
    }

    #[test]
    fn an_execution_a_second_after_the_status_write_is_a_duplicate_though_the_driver_saw_it_later()
    {
        // The driver's watch saw the commit only at 10:00:40; the API server
        // wrote it during 10:00:20.
        let mut o = Observer::default();
        let r = written_at(
            run("r", 5, vec![committed("a", "k", "r")], RunPhase::Succeeded),
            "2026-01-01T10:00:20Z",
        );
        o.observe(&r, ts("2026-01-01T10:00:40Z"));
        assert_eq!(
            o.committed_at["k"].written,
            Some(ts("2026-01-01T10:00:20Z"))
        );
        let mut ledger = exec_at(
            "1",
            "k",
            "2026-01-01T10:00:10Z",
            Outcome::Succeeded,
            "2026-01-01T10:00:19.5Z",
        )
        .to_vec();
        // In the second of the write: it may have started before the commit.
        ledger.extend(exec_at(
            "2",
            "k",
            "2026-01-01T10:00:20.900Z",
            Outcome::Killed,
            "2026-01-01T10:00:20.950Z",
        ));
        // A full second after it: after the commit.
        ledger.extend(exec_at(
            "3",
            "k",
            "2026-01-01T10:00:21Z",
            Outcome::Killed,
            "2026-01-01T10:00:22Z",
        ));
        let v = judge(&o, &[r], ledger);
        // Only pod 3 is after the commit; both re-ran a key that had
        // succeeded (`after_success`).
        assert_eq!(
            (v.duplicates, v.after_commit, v.after_success),
            (2, 1, 2),
            "{v:?}"
        );
        assert!(
            !v.findings[0].contains("after its outcome was committed"),
            "{:?}",
            v.findings
        );
        assert!(
            v.findings[1].contains("pod pod-3")
                && v.findings[1].contains("written 2026-01-01T10:00:20Z"),
            "{:?}",
            v.findings
        );
    }

    #[test]
    fn an_execution_after_a_committed_failure_is_a_duplicate() {
        let mut o = Observer::default();
        let mut failed = committed("a", "k", "r");
        failed.phase = StepPhase::Failed;
        failed.result = None;
        let r = run("r", 5, vec![failed], RunPhase::Failed);
        o.observe(&r, Timestamp::from_second(20).unwrap());
        let mut ledger = exec("1", "k", 10, Outcome::Failed, 11).to_vec();
        ledger.extend(exec("2", "k", 30, Outcome::Failed, 31));
        assert_eq!(judge(&o, &[r], ledger).after_commit, 1);
    }

    #[test]
    fn retries_before_the_commit_are_not_after_it() {
        let mut o = Observer::default();
        let mut r = run("r", 5, vec![committed("a", "k", "r")], RunPhase::Succeeded);
        r.spec.steps[0].effect = agentrun_operator::api::Effect::Idempotent;
        o.observe(&r, Timestamp::from_second(20).unwrap());
        let mut ledger = exec("1", "k", 10, Outcome::Killed, 11).to_vec();
        ledger.extend(exec("2", "k", 12, Outcome::Succeeded, 13));
        let v = judge(&o, &[r], ledger);
        assert!(v.passed(), "{v:?}");
        assert_eq!(v.after_commit, 0);
    }
}
