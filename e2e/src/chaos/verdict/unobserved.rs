//! *Unobserved*, per run: created, but never seen in a terminal phase by the
//! driver's watch, so the evidence about it (every status version) is
//! incomplete.

use super::facts::Facts;

/// One finding per unobserved run.
pub(super) fn check(f: &Facts<'_>) -> Vec<String> {
    f.e.created
        .iter()
        .filter(|name| !f.e.observer.seen_terminal(name))
        .map(|name| {
            format!(
                "unobserved: run {name} was never seen in a terminal phase by the driver's watch"
            )
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::super::Observer;
    use super::super::fixtures::*;
    use crate::ledger::Outcome;
    use agentrun_operator::api::RunPhase;
    use jiff::Timestamp;

    #[test]
    fn a_run_never_seen_finishing_fails_the_verdict() {
        let r = run("r", 5, vec![committed("a", "k", "r")], RunPhase::Succeeded);
        let ledger = exec("1", "k", 10, Outcome::Succeeded, 11).to_vec();
        let o = Observer::default();
        let v = judge(&o, std::slice::from_ref(&r), ledger.clone());
        assert_eq!(v.unobserved, 1, "{v:?}");
        assert!(!v.passed());
        // Seen running only: still unobserved.
        let mut o = Observer::default();
        o.observe(
            &run("r", 4, vec![], RunPhase::Running),
            Timestamp::from_second(5).unwrap(),
        );
        assert_eq!(
            judge(&o, std::slice::from_ref(&r), ledger.clone()).unobserved,
            1
        );
        o.observe(&r, Timestamp::from_second(20).unwrap());
        assert!(judge(&o, &[r], ledger).passed());
    }
}
