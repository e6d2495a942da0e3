//! Wait steps (durable timers) on the real control plane with the operator
//! and the simulated kubelet: no Pod runs while a step waits, the time it
//! wakes survives the operator being killed, the wake is taken once the
//! operator is back, and cancelling the run ends the wait at once.

use std::time::Duration;

use agentrun_e2e::ledger::LedgerEvent;
use agentrun_e2e::support::scenario::{Scenario, phase, sim_step, status};
use agentrun_operator::api::{AgentRun, RunPhase, StepCheckpoint, StepPhase};
use serde_json::json;

const RUN_TIMEOUT: Duration = Duration::from_secs(90);

fn checkpoint(run: &AgentRun, step: &str) -> StepCheckpoint {
    status(run)
        .steps
        .into_iter()
        .find(|c| c.name == step && c.role.is_step())
        .unwrap_or_else(|| panic!("no checkpoint of {step}: {:#?}", run.status))
}

/// The Pods the kubelet started for run `run`, any role.
fn started(s: &Scenario, run: &str) -> Vec<String> {
    s.ledger()
        .entries
        .into_iter()
        .filter(|e| e.event == LedgerEvent::Started && e.run.as_deref() == Some(run))
        .filter_map(|e| e.step)
        .collect()
}

/// draft → cool-off (wait 6s) → send, with the operator killed while the
/// wait runs and started again after its time: the wake is as recorded,
/// send runs once, after it, and nothing ran in between.
#[tokio::test]
async fn a_wait_survives_the_operator_and_the_next_step_starts_after_it() {
    let mut s = Scenario::start("wait-restart").await;
    s.create_run(
        "notice",
        json!({"steps": [
            sim_step("draft", "None", json!({"runMs": 50, "result": {"text": "hello"}})),
            {"name": "cool-off", "wait": {"for": "6s"}},
            sim_step("send", "Idempotent", json!({"runMs": 50})),
        ]}),
    )
    .await;
    let waiting = s
        .wait_run("notice", "waiting", RUN_TIMEOUT, |r| {
            phase(r) == Some(RunPhase::Waiting)
        })
        .await;
    let c = checkpoint(&waiting, "cool-off");
    assert_eq!(c.phase, StepPhase::Waiting);
    assert_eq!(c.pod, None, "a wait has no Pod");
    let (from, wake) = (c.started_at.unwrap().0, c.wake_at.unwrap().0);
    assert_eq!(wake.duration_since(from).as_secs(), 6);
    let cond = status(&waiting)
        .conditions
        .into_iter()
        .find(|c| c.type_ == "Succeeded")
        .unwrap();
    assert_eq!(cond.reason, "Waiting");
    assert!(
        cond.message.contains("step cool-off waits until"),
        "{}",
        cond.message
    );

    s.kill_operator().await;
    tokio::time::sleep(Duration::from_secs(8)).await;
    assert_eq!(
        started(&s, "notice"),
        ["draft"],
        "nothing ran while it waited"
    );
    s.start_operator(None);
    let run = s.wait_finished("notice", RUN_TIMEOUT).await;
    assert_eq!(phase(&run), Some(RunPhase::Succeeded), "{:#?}", run.status);
    let c = checkpoint(&run, "cool-off");
    assert_eq!(c.wake_at.map(|t| t.0), Some(wake), "the wake did not move");
    assert_eq!(
        c.finished_at.map(|t| t.0),
        Some(wake),
        "the wait ended when it was due, not when the operator looked"
    );
    let send = checkpoint(&run, "send");
    assert!(
        send.started_at.unwrap().0 >= wake,
        "send started after the wake"
    );
    assert_eq!(started(&s, "notice"), ["draft", "send"]);
    assert_eq!(
        status(&run).step_executions,
        2,
        "a wait is not an execution"
    );
    s.finish().await;
}

/// A wait of a day, cancelled: it ends at once and the run is Cancelled.
#[tokio::test]
async fn cancelling_a_run_ends_its_wait_at_once() {
    let s = Scenario::start("wait-cancel").await;
    s.create_run(
        "hold",
        json!({"steps": [
            {"name": "hold", "wait": {"for": "24h"}},
            sim_step("after", "None", json!({"runMs": 50})),
        ]}),
    )
    .await;
    s.wait_run("hold", "waiting", RUN_TIMEOUT, |r| {
        phase(r) == Some(RunPhase::Waiting)
    })
    .await;
    s.runs()
        .patch(
            "hold",
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(json!({"spec": {"cancel": true}})),
        )
        .await
        .expect("cancelling the run");
    let run = s.wait_finished("hold", Duration::from_secs(20)).await;
    assert_eq!(phase(&run), Some(RunPhase::Cancelled));
    let c = checkpoint(&run, "hold");
    assert_eq!(c.phase, StepPhase::Failed);
    assert!(
        c.message
            .as_deref()
            .is_some_and(|m| m.starts_with("stopped waiting:")),
        "{:?}",
        c.message
    );
    assert!(started(&s, "hold").is_empty());
    s.finish().await;
}
