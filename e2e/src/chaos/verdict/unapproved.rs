//! *Unapproved* (D14): an execution behind an `Approve` question that said
//! no — `Rejected`, or `Expired` with `onTimeout: Reject`. The executions
//! behind it are those of the key it asked about (without a key: of its run
//! and step). When it asked again about a key an earlier question already
//! released (the step changed during its retry backoff), the attempts that
//! ran under the earlier decision are not behind it: only those that started
//! a whole second after it was created (its `creationTimestamp` has whole
//! seconds) are.

use agentrun_operator::api::{ApprovalKind, ApprovalPhase, Decision, OnTimeout};
use jiff::SignedDuration;
use kube::ResourceExt;

use super::facts::{Facts, approval_key, created};

/// One finding per execution behind a gate that said no.
pub(super) fn check(f: &Facts<'_>) -> Vec<String> {
    let mut out = Vec::new();
    let asks =
        f.e.approvals
            .iter()
            .filter(|a| a.spec.kind == ApprovalKind::Approve);
    for a in asks.clone() {
        let phase = a.status.as_ref().map(|s| s.phase);
        let rejected = phase == Some(ApprovalPhase::Rejected)
            || (a.spec.decision == Some(Decision::Rejected)
                && phase != Some(ApprovalPhase::Superseded));
        let expired =
            phase == Some(ApprovalPhase::Expired) && a.spec.on_timeout == OnTimeout::Reject;
        if !(rejected || expired) {
            continue;
        }
        let key = approval_key(a);
        // Asked again about a key an earlier question was about.
        let again = key.is_some()
            && asks.clone().any(|b| {
                b.metadata.name != a.metadata.name
                    && approval_key(b) == key
                    && created(b) <= created(a)
            });
        let from = created(a)
            .filter(|_| again)
            .map(|c| c + SignedDuration::from_secs(1));
        let behind = f.executions.iter().filter(|x| {
            let ours = match key {
                Some(key) => x.key == key,
                None => x.run == a.spec.run_name && x.step == a.spec.step,
            };
            ours && x.is_step() && from.is_none_or(|from| x.started_at >= from)
        });
        for x in behind {
            out.push(format!(
                "unapproved: run {} step {} pod {} started {} although approval {} was {}",
                x.run,
                x.step,
                x.pod,
                x.started_at,
                a.name_any(),
                if rejected {
                    "Rejected"
                } else {
                    "Expired (onTimeout: Reject)"
                }
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
    use agentrun_operator::api::{Effect, RunPhase};

    #[test]
    fn a_step_behind_a_rejected_or_expired_gate_has_no_execution() {
        let mut o = Observer::default();
        saw_finish(&mut o);
        let r = run("r", 5, vec![], RunPhase::Failed);
        let ledger = exec("1", "k", 10, Outcome::Succeeded, 11).to_vec();
        let finals = [r];
        let rejected = approval("Approve", Some("Rejected"), "Rejected", "Reject");
        let v = judge_with(&o, &finals, &[rejected], ledger.clone());
        assert_eq!(v.unapproved, 1, "{v:?}");
        assert!(!v.passed());
        assert!(
            v.findings.iter().any(|f| f
                == "unapproved: run r step a pod pod-1 started 1970-01-01T00:00:10Z although approval r-a-approve was Rejected"),
            "{:?}",
            v.findings
        );
        let expired = approval("Approve", None, "Expired", "Reject");
        assert_eq!(
            judge_with(&o, &finals, &[expired], ledger.clone()).unapproved,
            1
        );
        // Expiry that means consent, or an approval, releases the step.
        let consent = approval("Approve", None, "Expired", "Approve");
        assert_eq!(
            judge_with(&o, &finals, &[consent], ledger.clone()).unapproved,
            0
        );
        let approved = approval("Approve", Some("Approved"), "Approved", "Reject");
        assert_eq!(judge_with(&o, &finals, &[approved], ledger).unapproved, 0);
    }

    #[test]
    fn asked_again_after_an_edit_and_rejected_nothing_more_runs() {
        // Approved; attempt 1 failed (saying it did not act); the step was
        // edited during the backoff and asked about again at 10:00:20.
        let mut o = Observer::default();
        saw_finish(&mut o);
        let finals = [with_effect(
            run("r", 5, vec![], RunPhase::Failed),
            Effect::Idempotent,
        )];
        let first = created_at(
            about(
                approval("Approve", Some("Approved"), "Approved", "Reject"),
                "r-a-1",
                "k",
            ),
            "2026-01-01T10:00:00Z",
        );
        let again = created_at(
            about(
                approval("Approve", Some("Rejected"), "Rejected", "Reject"),
                "r-a-1-2",
                "k",
            ),
            "2026-01-01T10:00:20Z",
        );
        let mut ledger = not_applied(exec_at(
            "1",
            "k",
            "2026-01-01T10:00:10Z",
            Outcome::Failed,
            "2026-01-01T10:00:11Z",
        ))
        .to_vec();
        // Attempt 1 ran under the first decision: not behind the second.
        let v = judge_with(&o, &finals, &[first.clone(), again.clone()], ledger.clone());
        assert!(v.passed(), "{v:?}");
        // Attempt 2 ran although the edited step was rejected.
        ledger.extend(exec_at(
            "2",
            "k",
            "2026-01-01T10:00:25Z",
            Outcome::Succeeded,
            "2026-01-01T10:00:26Z",
        ));
        let v = judge_with(&o, &finals, &[first, again], ledger);
        assert_eq!(v.unapproved, 1, "{v:?}");
        assert!(
            v.findings
                .iter()
                .any(|f| f.contains("pod pod-2") && f.contains("approval r-a-1-2 was Rejected")),
            "{:?}",
            v.findings
        );
    }
}
