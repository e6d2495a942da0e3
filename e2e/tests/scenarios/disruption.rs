//! A step's Pod lost to eviction or deletion (D6): an idempotent step runs
//! again under the same key without spending its retry budget; a
//! non-idempotent one that may have acted asks a person (a `Reconcile`
//! Approval), and each answer does what it says.

use agentrun_e2e::support::scenario::{Scenario, phase, sim_step, status};
use agentrun_operator::api::{EffectOutcome, RunPhase, StepPhase};
use agentrun_operator::labels;
use kube::api::{DeleteParams, EvictParams, ListParams};
use serde_json::json;

use super::{RUN_TIMEOUT, asked, assert_one_success_per_key, step, step_opt};

#[tokio::test]
async fn evicted_step_resumes_with_same_key() {
    let s = Scenario::start("evicted-step").await;
    let spec = json!({"steps": [
        {"name": "crawl", "effect": "Idempotent",
         "retry": {"limit": 0},
         "container": {"image": "registry.example/crawler:1", "env": [{"name": "SIM_STEP",
            "value": json!({"attempts": [{"runMs": 30000}, {"runMs": 50, "result": {"pages": 12}}]}).to_string()}]}},
    ]});
    s.create_run("crawl", spec).await;
    let (running, pod) = s.wait_step_running("crawl", "crawl", RUN_TIMEOUT).await;
    let first = step(&running, "crawl").clone();
    s.pods()
        .evict(&pod, &EvictParams::default())
        .await
        .expect("eviction accepted");

    let run = s.wait_finished("crawl", RUN_TIMEOUT).await;
    assert_eq!(phase(&run), Some(RunPhase::Succeeded), "{:?}", run.status);
    let c = step(&run, "crawl");
    assert_eq!(
        c.idempotency_key, first.idempotency_key,
        "same key after eviction"
    );
    assert_eq!(c.disruptions, 1);
    assert_eq!(c.failures, 0, "the retry budget is untouched");
    assert_eq!(c.attempt, 2);
    assert_ne!(
        c.pod.as_deref(),
        Some(pod.as_str()),
        "a new pod for the new attempt"
    );
    let executions = s.ledger().executions_by_key();
    assert_eq!(
        executions.get(&c.idempotency_key),
        Some(&2),
        "ran twice under one key"
    );
    assert_one_success_per_key(&s, &run);
    s.finish().await;
}

#[tokio::test]
async fn deleted_non_idempotent_step_asks_a_person_and_each_decision_does_what_it_says() {
    let s = Scenario::start("reconcile-decisions").await;
    let spec = || {
        json!({"steps": [
            {"name": "pay", "effect": "NonIdempotent",
             "container": {"image": "registry.example/pay:1", "env": [{"name": "SIM_STEP",
                "value": json!({"attempts": [{"runMs": 30000}, {"runMs": 50, "result": {"paid": true}}]}).to_string()}]}},
            sim_step("receipt", "None", json!({"runMs": 50})),
        ]})
    };
    for (run_name, decision) in [
        ("retry", "Retry"),
        ("marksucceeded", "MarkSucceeded"),
        ("markfailed", "MarkFailed"),
    ] {
        s.create_run(run_name, spec()).await;
        let running = s
            .wait_run(run_name, "running", RUN_TIMEOUT, |r| {
                status(r)
                    .steps
                    .iter()
                    .any(|c| c.phase == StepPhase::Running && c.pod_uid.is_some())
            })
            .await;
        let pod = step(&running, "pay").pod.clone().unwrap();
        s.pods()
            .delete(&pod, &DeleteParams::default())
            .await
            .expect("deleting the pod");

        let waiting = s
            .wait_run(
                run_name,
                "waiting for a Reconcile decision",
                RUN_TIMEOUT,
                |r| {
                    step_opt(r, "pay").is_some_and(|c| {
                        c.effect == Some(EffectOutcome::Unknown) && c.approval.is_some()
                    })
                },
            )
            .await;
        assert_eq!(phase(&waiting), Some(RunPhase::WaitingForApproval));
        let approval_name = step(&waiting, "pay").approval.clone().unwrap();
        let approval = asked(&s, &approval_name).await;
        assert_eq!(format!("{:?}", approval.spec.kind), "Reconcile");
        let live_pods = s
            .pods()
            .list(&ListParams::default().labels(&format!("{}={run_name}", labels::RUN)))
            .await
            .unwrap()
            .into_iter()
            .filter(|p| p.metadata.deletion_timestamp.is_none())
            .count();
        assert_eq!(live_pods, 0, "nothing runs while a person decides");

        s.decide(&approval_name, decision, "checked the payment provider")
            .await;
        let run = s.wait_finished(run_name, RUN_TIMEOUT).await;
        let pay = step(&run, "pay");
        let executions = s.ledger().executions_by_key();
        match decision {
            "Retry" => {
                assert_eq!(phase(&run), Some(RunPhase::Succeeded));
                assert_eq!(
                    executions.get(&pay.idempotency_key),
                    Some(&2),
                    "rerun with the same key"
                );
            }
            "MarkSucceeded" => {
                assert_eq!(phase(&run), Some(RunPhase::Succeeded));
                assert_eq!(pay.phase, StepPhase::Succeeded);
                assert_eq!(
                    executions.get(&pay.idempotency_key),
                    Some(&1),
                    "not run again"
                );
            }
            _ => {
                assert_eq!(phase(&run), Some(RunPhase::Failed));
                assert_eq!(pay.phase, StepPhase::Failed);
                assert_eq!(
                    executions.get(&pay.idempotency_key),
                    Some(&1),
                    "not run again"
                );
                assert!(
                    step_opt(&run, "receipt").is_none_or(|c| c.pod.is_none()),
                    "no later step ran"
                );
            }
        }
    }
    s.finish().await;
}
