//! *Overlap* (D2): an execution that started while another execution of its
//! key was still live (started, not yet finished; a Pod that vanished is
//! allowed 50 ms, since simkubelet logs its end when it notices).

use super::Breach;
use super::facts::Facts;

pub(super) fn check(f: &Facts<'_>) -> Vec<Breach> {
    let mut out = Vec::new();
    for xs in f.by_key.values() {
        for (p, &i) in xs.iter().enumerate() {
            let x = &f.executions[i];
            let live = xs[..p]
                .iter()
                .map(|&j| &f.executions[j])
                .find(|y| y.live_until() > x.started_at);
            if let Some(live) = live {
                out.push(Breach {
                    exec: i,
                    why: format!(
                        "while pod {} of the same key was live (started {}, {})",
                        live.pod,
                        live.started_at,
                        live.finished_at
                            .map(|f| format!("finished {f}"))
                            .unwrap_or_else(|| "never finished".into())
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
    use agentrun_operator::api::RunPhase;

    #[test]
    fn two_live_executions_of_one_key_are_a_duplicate() {
        let mut o = Observer::default();
        saw_finish(&mut o);
        let r = run("r", 5, vec![committed("a", "k", "r")], RunPhase::Succeeded);
        // Pod 1 fails at 10:00:15, but pod 2 started at 10:00:12.
        let mut ledger = not_applied(exec_at(
            "1",
            "k",
            "2026-01-01T10:00:10Z",
            Outcome::Failed,
            "2026-01-01T10:00:15Z",
        ))
        .to_vec();
        ledger.extend(exec_at(
            "2",
            "k",
            "2026-01-01T10:00:12Z",
            Outcome::Succeeded,
            "2026-01-01T10:00:13Z",
        ));
        // Pod 3 started while nothing else was live, but never finished; pod 4 started under it.
        ledger.push(started("3", "k2", "2026-01-01T10:00:20Z"));
        ledger.extend(exec_at(
            "4",
            "k2",
            "2026-01-01T10:00:30Z",
            Outcome::Failed,
            "2026-01-01T10:00:31Z",
        ));
        let v = judge(&o, &[r], ledger);
        assert_eq!(v.overlapping, 2, "{v:?}");
        assert!(
            v.findings[0].contains("pod pod-2") && v.findings[0].contains("while pod pod-1"),
            "{:?}",
            v.findings
        );
        assert!(
            v.findings.iter().any(|f| f.contains("pod pod-4")
                && f.contains("while pod pod-3")
                && f.contains("never finished")),
            "{:?}",
            v.findings
        );
    }

    #[test]
    fn a_retry_after_the_previous_execution_ended_is_not_an_overlap() {
        let mut o = Observer::default();
        saw_finish(&mut o);
        let r = run("r", 5, vec![committed("a", "k", "r")], RunPhase::Succeeded);
        let mut ledger = not_applied(exec_at(
            "1",
            "k",
            "2026-01-01T10:00:10Z",
            Outcome::Failed,
            "2026-01-01T10:00:11.000Z",
        ))
        .to_vec();
        ledger.extend(exec_at(
            "2",
            "k",
            "2026-01-01T10:00:11.001Z",
            Outcome::Succeeded,
            "2026-01-01T10:00:12Z",
        ));
        let v = judge(&o, &[r], ledger);
        assert!(v.passed(), "{v:?}");
    }
}
