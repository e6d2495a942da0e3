//! The first round after a restart on the real control plane, with the
//! operator and the simulated kubelet: runs whose step finished while the
//! operator was down get their next Pod first; the finalizer releases and
//! routine Events of that round are held until every run found has been
//! reconciled once, and then sent, none lost (`src/controller/resume.rs`).
//!
//! Fails (never skips) without the plane.

use std::collections::BTreeMap;
use std::time::Duration;

use agentrun_e2e::ledger::LedgerEvent;
use agentrun_e2e::support::scenario::{Scenario, phase, sim_step, status};
use agentrun_operator::api::{RunPhase, StepPhase};
use serde_json::json;

const RUNS: usize = 12;
const TIMEOUT: Duration = Duration::from_secs(120);

#[tokio::test]
async fn after_a_restart_every_run_gets_its_next_pod_and_the_held_releases_follow() {
    let mut s = Scenario::start("resume-round").await;
    for i in 0..RUNS {
        s.create_run(
            &format!("r{i:02}"),
            json!({"steps": [
                sim_step("first", "Idempotent", json!({"runMs": 3000})),
                // Long enough not to finish within the first round after the
                // restart (under load that round took 180 ms; a 50 ms second
                // step then finished inside it and its release was held too).
                sim_step("second", "Idempotent", json!({"runMs": 2000})),
            ]}),
        )
        .await;
    }
    // Every first step running; the operator dies; the steps finish meanwhile.
    for i in 0..RUNS {
        s.wait_step_running(&format!("r{i:02}"), "first", TIMEOUT)
            .await;
    }
    s.kill_operator().await;
    tokio::time::sleep(Duration::from_secs(5)).await;
    s.start_operator(None);

    for i in 0..RUNS {
        let run = s.wait_finished(&format!("r{i:02}"), TIMEOUT).await;
        assert_eq!(phase(&run), Some(RunPhase::Succeeded), "{:#?}", run.status);
        assert!(
            status(&run)
                .steps
                .iter()
                .all(|c| c.phase == StepPhase::Succeeded)
        );
    }
    // Each step ran once.
    let mut starts: BTreeMap<(String, String), usize> = BTreeMap::new();
    for e in s.ledger().entries {
        if e.event == LedgerEvent::Started {
            *starts
                .entry((e.run.unwrap_or_default(), e.step.unwrap_or_default()))
                .or_default() += 1;
        }
    }
    assert_eq!(starts.len(), 2 * RUNS, "{starts:?}");
    assert!(starts.values().all(|&n| n == 1), "{starts:?}");
    // The releases held in the first round were sent: no step Pod keeps the finalizer.
    s.wait_finalizers_released(TIMEOUT).await;
    let log =
        without_colours(&std::fs::read_to_string(s.operator_log()).expect("the operator's log"));
    // The log holds both operators' lines: the restarted one's come last.
    let line = log
        .lines()
        .rfind(|l| l.contains("first round over"))
        .expect("the operator says when the first round is over");
    assert!(
        line.contains("every run it found reconciled once"),
        "{line}"
    );
    assert!(
        line.contains(&format!("releases={RUNS} events={}", 2 * RUNS)),
        "each first step's release and its two routine Events were held: {line}"
    );
    s.finish().await;
}

/// `text` without its ANSI colour sequences (ESC [ … m).
fn without_colours(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            for c in chars.by_ref() {
                if c == 'm' {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}
