//! What a run's author writes and the operator evaluates is bounded (D22),
//! on the real control plane with the operator and the simulated kubelet:
//! a `when` the CEL implementation cannot evaluate, or that nests more
//! loops than admission allows, is refused by the API server; one that
//! spends its cost budget ends its own run with that reason while another
//! run goes on; a signal's data over its cap fails its step before any
//! schema is applied to it.
//!
//! Needs the plane (`e2e/cluster up`); fails, never skips, without it.

use std::time::Duration;

use agentrun_e2e::support::scenario::{Scenario, phase, sim_step, status};
use agentrun_e2e::wait_for;
use agentrun_operator::api::{AgentRun, RunPhase, Signal, StepPhase};
use kube::Api;
use kube::api::{Patch, PatchParams, PostParams};
use serde_json::{Value, json};

const RUN_TIMEOUT: Duration = Duration::from_secs(90);

fn run_of(ns: &str, name: &str, spec: Value) -> AgentRun {
    serde_json::from_value(json!({
        "apiVersion": "agentrun.dev/v1alpha1",
        "kind": "AgentRun",
        "metadata": {"name": name, "namespace": ns},
        "spec": spec,
    }))
    .expect("a run")
}

/// detect (700 numbers) → check, gated by `when`.
fn gated(when: &str) -> Value {
    let items: Vec<u32> = (0..700).collect();
    let mut check = sim_step("check", "None", json!({"runMs": 50}));
    check["dependsOn"] = json!(["detect"]);
    check["when"] = json!(when);
    json!({"steps": [
        sim_step("detect", "None", json!({"runMs": 50, "result": {"items": items}})),
        check,
    ]})
}

/// The API server refuses, with the CRD's own message, what the operator's
/// CEL cannot evaluate (a message literal, which panics inside the CEL
/// implementation) and more than three comprehensions in one `when`; three
/// are admitted.
#[tokio::test]
async fn a_when_that_builds_a_message_or_nests_four_loops_is_refused_at_admission() {
    let s = Scenario::start_without_operator("when-admission").await;
    let ns = s.namespace().to_owned();
    let runs: Api<AgentRun> = s.runs();
    let dry = PostParams {
        dry_run: true,
        ..Default::default()
    };
    let cases = [
        (
            "message",
            "steps.detect.result.items == Foo{}",
            Some("when: builds a message (Name{…})"),
        ),
        (
            "message-with-a-brace-in-a-string",
            "steps.detect.result.note == 'x{' && google.protobuf.Int64Value{value: 1} == 1",
            Some("when: builds a message (Name{…})"),
        ),
        (
            "four-loops",
            "steps.detect.result.items.all(a, [1].all(b, [1].exists(c, [1].map(d, d).size() > 0)))",
            Some("when: at most 3 comprehensions"),
        ),
        (
            "a-brace-in-a-string-and-a-map",
            "steps.detect.result.note != 'Foo{}' && {'k': 1}.size() == 1 && steps.detect.result.items.all(a, [1].exists(b, [1].map(c, c).size() > 0))",
            None,
        ),
    ];
    for (name, when, refused) in cases {
        let got = runs.create(&dry, &run_of(&ns, name, gated(when))).await;
        match (refused, got) {
            (Some(want), Err(e)) => {
                let e = e.to_string();
                assert!(e.contains(want), "{name}: {e}");
            }
            (Some(want), Ok(_)) => panic!("{name}: admitted, expected {want:?}"),
            (None, Err(e)) => panic!("{name}: refused: {e}"),
            (None, Ok(_)) => {}
        }
    }
    s.finish().await;
}

/// Three runs whose `when` loops over a 700-item result three levels deep
/// (343 million iterations unbounded: minutes of a worker each) each fail
/// at the step with a bound as the reason (the cost budget, or the deadline
/// of the decision), and a run created after them succeeds in the meantime.
#[tokio::test]
async fn runs_whose_when_spends_its_budget_fail_and_a_neighbour_goes_on() {
    let s = Scenario::start("when-budget").await;
    let deep = "steps.detect.result.items.all(a, steps.detect.result.items.all(b, \
                steps.detect.result.items.all(c, a + b + c >= 0)))";
    for i in 0..3 {
        s.create_run(&format!("costly-{i}"), gated(deep)).await;
    }
    s.create_run(
        "neighbour",
        json!({"steps": [
            sim_step("one", "None", json!({"runMs": 50})),
            sim_step("two", "None", json!({"runMs": 50})),
        ]}),
    )
    .await;
    let neighbour = s.wait_finished("neighbour", RUN_TIMEOUT).await;
    assert_eq!(phase(&neighbour), Some(RunPhase::Succeeded));
    for i in 0..3 {
        let run = s.wait_finished(&format!("costly-{i}"), RUN_TIMEOUT).await;
        assert_eq!(phase(&run), Some(RunPhase::Failed), "{:#?}", run.status);
        let st = status(&run);
        let succeeded = st
            .conditions
            .iter()
            .find(|c| c.type_ == "Succeeded")
            .expect("a Succeeded condition");
        assert_eq!(succeeded.reason, "WhenFailed");
        // Whichever bound comes first: the budget, or (a debug build on a
        // loaded machine spends it more slowly) the decision's deadline.
        assert!(
            succeeded
                .message
                .contains("exceeds the cost budget of 1000000 an expression may spend")
                || succeeded
                    .message
                    .contains("was stopped at its evaluation deadline"),
            "{}",
            succeeded.message
        );
        let check = st
            .steps
            .iter()
            .find(|c| c.name == "check")
            .expect("check's checkpoint");
        assert_eq!(check.phase, StepPhase::Failed);
        assert!(check.pod.is_none(), "no Pod of check: {check:?}");
    }
    s.finish().await;
}

/// A signal whose data is over 64 KiB fails its step with the size, and
/// the step after it never starts; one just under the cap is taken.
#[tokio::test]
async fn a_signal_with_data_over_its_cap_fails_its_step() {
    let s = Scenario::start("signal-cap").await;
    let signals: Api<Signal> = s.env().api();
    let spec = json!({"steps": [
        {"name": "settle", "wait": {"signal": {"description": "payment settled"}}},
        sim_step("ship", "Idempotent", json!({"runMs": 50})),
    ]});
    for (run, bytes) in [("large", 65 * 1024), ("small", 60 * 1024)] {
        s.create_run(run, spec.clone()).await;
        let waiting = s
            .wait_run(run, "waiting for its signal", RUN_TIMEOUT, |r| {
                r.status.as_ref().is_some_and(|st| {
                    st.steps
                        .iter()
                        .any(|c| c.name == "settle" && c.signal.is_some())
                })
            })
            .await;
        let name = status(&waiting)
            .steps
            .iter()
            .find_map(|c| c.signal.clone())
            .expect("the Signal's name");
        wait_for(
            &signals,
            &name,
            |sig: Option<&Signal>| sig.is_some(),
            Duration::from_secs(20),
        )
        .await
        .expect("the Signal is opened");
        let data = json!({"note": "x".repeat(bytes)});
        signals
            .patch(
                &name,
                &PatchParams {
                    field_manager: Some("e2e-sender".into()),
                    ..Default::default()
                },
                &Patch::Merge(json!({"spec": {"id": "pay-1", "data": data}})),
            )
            .await
            .expect("sending the signal");
    }
    let large = s.wait_finished("large", RUN_TIMEOUT).await;
    assert_eq!(phase(&large), Some(RunPhase::Failed), "{:#?}", large.status);
    let settle = status(&large)
        .steps
        .into_iter()
        .find(|c| c.name == "settle")
        .unwrap();
    assert_eq!(settle.phase, StepPhase::Failed);
    let message = settle.message.unwrap_or_default();
    assert!(
        message.contains("bytes of data, over the 64 KiB a signal may carry"),
        "{message}"
    );
    assert!(
        !status(&large).steps.iter().any(|c| c.name == "ship"),
        "ship never started"
    );
    let small = s.wait_finished("small", RUN_TIMEOUT).await;
    assert_eq!(
        phase(&small),
        Some(RunPhase::Succeeded),
        "{:#?}",
        small.status
    );
    s.finish().await;
}
