//! A run from start to finish, and what it says about itself: four steps
//! each executed once under the key in status, the Pods released, the
//! Events that tell the story, the `kubectl get` columns, `/metrics` and
//! `/readyz`; with step Events turned off, only what calls for attention.

use std::collections::BTreeMap;
use std::time::Duration;

use agentrun_e2e::kubectl_ok;
use agentrun_e2e::support::scenario::{Scenario, field_managers, phase, sim_step, status};
use agentrun_operator::api::{CheckpointState, EffectOutcome, RunPhase, StepPhase};
use agentrun_operator::labels;
use kube::ResourceExt;
use kube::api::ListParams;
use serde_json::json;

use super::{
    RUN_TIMEOUT, assert_finalizers_released, assert_one_success_per_key, event_counts, four_steps,
    step,
};

#[tokio::test]
async fn four_step_run_succeeds_with_one_execution_per_key() {
    let s = Scenario::start("four-step-run").await;
    s.create_run("refund", four_steps()).await;
    let run = s.wait_finished("refund", RUN_TIMEOUT).await;

    assert_eq!(phase(&run), Some(RunPhase::Succeeded), "{:?}", run.status);
    let st = status(&run);
    let names: Vec<&str> = st.steps.iter().map(|c| c.name.as_str()).collect();
    assert_eq!(
        names,
        [
            "lookup-order",
            "draft-refund",
            "issue-refund",
            "notify-customer"
        ]
    );
    for c in &st.steps {
        assert_eq!(c.phase, StepPhase::Succeeded, "{}", c.name);
        assert_eq!(c.checkpoint, CheckpointState::Committed, "{}", c.name);
        assert_eq!(c.attempt, 1, "{}", c.name);
        assert_eq!(c.failures + c.disruptions, 0, "{}", c.name);
        assert!(
            c.finished_at.is_some() && c.started_at.is_some(),
            "{}",
            c.name
        );
    }
    assert_eq!(
        step(&run, "lookup-order").result,
        Some(json!({"orderId": 4711}))
    );
    assert_eq!(
        step(&run, "issue-refund").effect,
        Some(EffectOutcome::Applied)
    );
    assert_eq!(st.tokens_used, 100 + 20 + 300 + 80 + 10 + 5);
    assert_eq!(st.progress.as_deref(), Some("4/4"));
    assert!(st.completed_at.is_some());

    // The ledger: four keys, each executed once, and they are the keys in status.
    let ledger = s.ledger();
    let executions = ledger.executions_by_key();
    let keys: BTreeMap<String, usize> = st
        .steps
        .iter()
        .map(|c| (c.idempotency_key.clone(), 1))
        .collect();
    assert_eq!(executions, keys, "one execution per key");
    assert_one_success_per_key(&s, &run);
    assert_finalizers_released(&s).await;

    // Events tell the story of the run (published in the background).
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let count = event_counts(&s, "refund").await;
        let n = |reason: &str| count.get(reason).copied().unwrap_or(0);
        let (started, succeeded, finished) =
            (n("StepStarted"), n("StepSucceeded"), n("RunSucceeded"));
        if started == 4 && succeeded == 4 && finished == 1 {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "events: StepStarted {started}, StepSucceeded {succeeded}, RunSucceeded {finished}"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    let events: kube::Api<k8s_openapi::api::events::v1::Event> = s.env().api();
    let ours = events
        .list(&ListParams::default())
        .await
        .expect("listing events")
        .items
        .into_iter()
        .filter(|e| e.reporting_controller.as_deref() == Some("agentrun-operator"))
        .collect::<Vec<_>>();
    assert!(
        ours.len() >= 9,
        "the run's Events, as the operator reports them: {ours:?}"
    );
    for e in ours {
        let managers = field_managers(&e.metadata);
        assert!(
            managers.iter().all(|m| m == labels::FIELD_MANAGER),
            "event {} ({:?}) was written by {managers:?}",
            e.name_any(),
            e.reason
        );
    }

    // What a person sees.
    let table = kubectl_ok(["get", "ar", "refund", "-n", s.namespace()]).await;
    let header: Vec<&str> = table
        .lines()
        .next()
        .unwrap_or_default()
        .split_whitespace()
        .collect();
    assert_eq!(
        header,
        [
            "NAME", "PHASE", "REASON", "STEP", "PROGRESS", "TOKENS", "DURATION", "AGE"
        ],
        "{table}"
    );
    let row: Vec<&str> = table
        .lines()
        .nth(1)
        .unwrap_or_default()
        .split_whitespace()
        .collect();
    assert_eq!(&row[..2], ["refund", "Succeeded"], "{table}");
    assert!(row.contains(&"4/4") && row.contains(&"515"), "{table}");
    // How long it took, as the operator recorded it when it finished.
    assert_eq!(
        Some(row[6]),
        st.duration.as_deref(),
        "the Duration column: {table}"
    );
    s.finish().await;
}

/// `/metrics` moves while a run progresses.
#[tokio::test]
async fn metrics_count_steps_and_checkpoints() {
    let s = Scenario::start("metrics").await;
    s.create_run("measured", four_steps()).await;
    s.wait_finished("measured", RUN_TIMEOUT).await;
    let body = agentrun_e2e::get_ok(s.operator_config.metrics_port, "/metrics").await;
    let value = |name: &str| -> f64 {
        body.lines()
            .find(|l| l.starts_with(name) && !l.starts_with('#'))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("metric {name} missing:\n{body}"))
    };
    assert_eq!(value("agentrun_steps_started_total"), 4.0);
    assert_eq!(value("agentrun_steps_succeeded_total"), 4.0);
    assert!(value("agentrun_checkpoint_write_duration_seconds_count") >= 4.0);
    assert!(
        body.contains("agentrun_runs{phase=\"Succeeded\"} 1"),
        "{body}"
    );
    assert_eq!(value("agentrun_leader"), 1.0);
    let health = agentrun_e2e::get_ok(s.operator_config.health_port, "/readyz").await;
    assert_eq!(health.trim(), "ok");
    s.finish().await;
}

/// `--step-events=false` leaves out the two Events every step emits, and
/// keeps the ones that call for attention.
#[tokio::test]
async fn without_step_events_only_what_calls_for_attention_is_published() {
    let mut s = Scenario::start_without_operator("quiet-events").await;
    s.operator_config
        .extra_env
        .push(("AGENTRUN_STEP_EVENTS".into(), "false".into()));
    s.start_operator(None);
    s.create_run("quiet", json!({"steps": [
        {"name": "flaky", "effect": "Idempotent", "retry": {"limit": 1, "backoff": {"initial": "1s"}},
         "container": {"image": "registry.example/flaky:1", "env": [{"name": "SIM_STEP",
            "value": json!({"attempts": [{"runMs": 50, "exitCode": 2}, {"runMs": 50}]}).to_string()}]}},
        sim_step("report", "None", json!({"runMs": 50})),
    ]}))
    .await;
    let run = s.wait_finished("quiet", RUN_TIMEOUT).await;
    assert_eq!(phase(&run), Some(RunPhase::Succeeded), "{:?}", run.status);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    let counts = loop {
        let counts = event_counts(&s, "quiet").await;
        if counts.contains_key("RunSucceeded") && counts.contains_key("StepRetrying") {
            // Events are published in the order they were decided; give any
            // straggler from earlier decisions a moment before counting.
            tokio::time::sleep(Duration::from_secs(1)).await;
            break event_counts(&s, "quiet").await;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "no RunSucceeded and StepRetrying Events yet: {counts:?}"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    };
    assert_eq!(counts.get("StepRetrying"), Some(&1), "{counts:?}");
    assert_eq!(counts.get("RunSucceeded"), Some(&1), "{counts:?}");
    assert!(
        !counts.contains_key("StepStarted") && !counts.contains_key("StepSucceeded"),
        "{counts:?}"
    );
    // Status still records every start and success.
    for c in &status(&run).steps {
        assert!(
            c.started_at.is_some() && c.finished_at.is_some(),
            "{}",
            c.name
        );
    }
    s.finish().await;
}
