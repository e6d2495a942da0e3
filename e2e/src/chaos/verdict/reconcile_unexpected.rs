//! *Unexpected Reconcile question* (D6): a person is asked what a step did
//! only about a NonIdempotent step one of whose attempts may have acted
//! without saying whether it did. Each question must be explained by a fault
//! the run met: a Pod of its key the driver evicted or deleted, or an
//! execution of its key in the ledger that was killed (a timeout, an
//! eviction, a vanished Pod), failed without reporting `NotApplied`, or never
//! ended, or ran past its step's timeout (the operator may stop it before
//! the kubelet reports that it ended). A question about any other step — an Idempotent one, or one whose
//! attempts all ended cleanly — is unexpected: the operator asked a person
//! for nothing, or for the wrong step.

use agentrun_operator::api::{ApprovalKind, Effect};
use kube::ResourceExt;

use super::facts::{Facts, approval_key};

/// Reconcile questions asked, and one finding per unexpected one.
pub(super) struct Reconcile {
    pub asked: usize,
    pub unexpected: Vec<String>,
}

pub(super) fn check(f: &Facts<'_>) -> Reconcile {
    let mut r = Reconcile {
        asked: 0,
        unexpected: Vec::new(),
    };
    for a in
        f.e.approvals
            .iter()
            .filter(|a| a.spec.kind == ApprovalKind::Reconcile)
    {
        r.asked += 1;
        let effect = a.spec.context.as_ref().and_then(|c| c.effect);
        let key = approval_key(a);
        let disrupted = key.is_some_and(|k| f.e.disrupted_keys.contains(k));
        let unsettled = key.is_some_and(|k| {
            f.of_key(k)
                .any(|(_, x)| x.unsettled() || f.outlived_timeout(x))
        });
        if effect == Some(Effect::NonIdempotent) && (disrupted || unsettled) {
            continue;
        }
        r.unexpected.push(format!(
            "unexpected Reconcile approval {} (run {}, step {}, effect {effect:?}, disrupted by the driver: {disrupted}, an execution that may have acted: {unsettled})",
            a.name_any(),
            a.spec.run_name,
            a.spec.step,
        ));
    }
    r
}

#[cfg(test)]
mod tests {
    use super::super::Observer;
    use super::super::fixtures::*;
    use crate::ledger::Outcome;
    use agentrun_operator::api::{Effect, RunPhase};
    use jiff::Timestamp;

    fn finished() -> (Observer, agentrun_operator::api::AgentRun) {
        let mut o = Observer::default();
        let r = run("r", 5, vec![committed("a", "k", "r")], RunPhase::Succeeded);
        o.observe(&r, Timestamp::from_second(40).unwrap());
        (o, r)
    }

    #[test]
    fn an_unexpected_reconcile_approval_fails_the_verdict() {
        let (o, r) = finished();
        let ledger = exec("1", "k", 10, Outcome::Succeeded, 11).to_vec();
        // About an Idempotent step, though the driver disrupted its key.
        let mut idempotent = approval("Reconcile", Some("MarkSucceeded"), "Resolved", "Reject");
        idempotent.spec.context.as_mut().unwrap().effect = Some(Effect::Idempotent);
        let v = judge_disrupted(
            &o,
            std::slice::from_ref(&r),
            &[idempotent],
            ledger.clone(),
            &["k"],
        );
        assert_eq!((v.reconcile_approvals, v.reconcile_unexpected), (1, 1));
        assert!(!v.passed(), "{v:?}");
        // About a NonIdempotent step nobody disrupted, whose one attempt succeeded.
        let clean = approval("Reconcile", Some("MarkSucceeded"), "Resolved", "Reject");
        let v = judge_disrupted(&o, std::slice::from_ref(&r), &[clean], ledger, &[]);
        assert_eq!((v.reconcile_approvals, v.reconcile_unexpected), (1, 1));
        assert!(
            v.findings[0].contains("disrupted by the driver: false")
                && v.findings[0].contains("may have acted: false"),
            "{:?}",
            v.findings
        );
    }

    #[test]
    fn the_faults_a_run_met_explain_its_reconcile_approvals() {
        let (o, r) = finished();
        let retry = retry_at("1970-01-01T00:00:15Z");
        let then_success = exec("2", "k", 20, Outcome::Succeeded, 21);
        for (first, disrupted) in [
            // Evicted or deleted by the driver, the Pod may never have run.
            (None, &["k"][..]),
            // Stopped by its timeout (or any kill) mid-run.
            (Some(exec("1", "k", 10, Outcome::Killed, 13)), &[][..]),
            // Failed without saying it did not act.
            (Some(exec("1", "k", 10, Outcome::Failed, 13)), &[][..]),
        ] {
            let mut ledger = first.map(|x| x.to_vec()).unwrap_or_default();
            ledger.extend(then_success.clone());
            let v = judge_disrupted(
                &o,
                std::slice::from_ref(&r),
                std::slice::from_ref(&retry),
                ledger,
                disrupted,
            );
            assert_eq!((v.reconcile_approvals, v.reconcile_unexpected), (1, 0));
            assert!(v.passed(), "{v:?}");
        }
        // A success that ran past its step's timeout: the operator may have
        // stopped it before the kubelet reported the end.
        let mut timed = r.clone();
        timed.spec.steps[0].timeout = Some("2s".into());
        let outlived = exec("1", "k", 10, Outcome::Succeeded, 16).to_vec();
        let v = judge_disrupted(
            &o,
            std::slice::from_ref(&timed),
            std::slice::from_ref(&retry),
            outlived.clone(),
            &[],
        );
        assert_eq!(v.reconcile_unexpected, 0, "{v:?}");
        // Within its timeout it explains nothing.
        let within = exec("1", "k", 10, Outcome::Succeeded, 11).to_vec();
        let v = judge_disrupted(
            &o,
            std::slice::from_ref(&timed),
            std::slice::from_ref(&retry),
            within,
            &[],
        );
        assert_eq!(v.reconcile_unexpected, 1, "{v:?}");
        // A failure that said NotApplied explains nothing.
        let mut ledger = not_applied(exec("1", "k", 10, Outcome::Failed, 13)).to_vec();
        ledger.extend(then_success);
        let v = judge_disrupted(&o, &[r], &[retry], ledger, &[]);
        assert_eq!(v.reconcile_unexpected, 1, "{v:?}");
    }
}
