//! *Early probe* (D2): a verify probe asks the changed system whether an
//! attempt acted, so it must start only once no execution of its key is
//! live — else it may answer `NotApplied` for an attempt that acts a moment
//! later, and the retry it allows acts twice. A probe that started while an
//! execution of its key was live is a finding (its answer also settles
//! nothing: `facts::settled_by_probes`).

use super::facts::Facts;

pub(super) fn check(f: &Facts<'_>) -> Vec<String> {
    let mut out = Vec::new();
    for (key, probes) in &f.probes {
        for &p in probes {
            let p = &f.executions[p];
            let live = f
                .of_key(key)
                .map(|(_, x)| x)
                .find(|x| x.started_at <= p.started_at && x.live_until() > p.started_at);
            if let Some(x) = live {
                out.push(format!(
                    "early probe: run {} step {} probe pod {} started {} while pod {} of key {key} was live (started {})",
                    p.run, p.step, p.pod, p.started_at, x.pod, x.started_at
                ));
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
    use agentrun_operator::api::RunPhase;

    fn verdict_of(ledger: Vec<crate::ledger::LedgerEntry>) -> super::super::Verdict {
        let mut o = Observer::default();
        saw_finish(&mut o);
        let finals = [run("r", 5, vec![], RunPhase::Failed)];
        judge_with(&o, &finals, &[], ledger)
    }

    /// Key `k`'s attempt killed (before it acted) at `killed`, and its
    /// probe from `probed` to a second later (minutes past 10:00, seconds).
    fn killed_then_probed(killed: u32, probed: u32) -> Vec<crate::ledger::LedgerEntry> {
        let t = |s: u32| format!("2026-01-01T10:00:{s:02}Z");
        let mut ledger = acting(
            exec_at("1", "k", &t(10), Outcome::Killed, &t(killed)),
            false,
        )
        .to_vec();
        ledger.extend(probe("v", "k", &t(probed), "NotApplied", &t(probed + 1)));
        ledger
    }

    #[test]
    fn a_probe_beside_a_live_attempt_of_its_key_is_a_finding() {
        let v = verdict_of(killed_then_probed(20, 15));
        assert_eq!(v.early_probes, 1, "{v:?}");
        assert!(!v.passed());
        assert!(
            v.findings
                .iter()
                .any(|f| f.starts_with("early probe: run r step a probe pod pod-v")),
            "{:?}",
            v.findings
        );
    }

    #[test]
    fn a_probe_after_the_attempt_ended_is_not() {
        let mut ledger = killed_then_probed(12, 13);
        // Another key's live attempt does not matter.
        ledger.push(started("2", "other", "2026-01-01T10:00:12Z"));
        assert_eq!(verdict_of(ledger).early_probes, 0);
    }
}
