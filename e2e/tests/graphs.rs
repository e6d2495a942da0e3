//! Plans that branch and join, on the real control plane with the operator
//! and the simulated kubelet: fan-out and fan-in, conditional routing,
//! parallel approvals, and a failure in one branch while another runs. The
//! ledger says what really ran, and when.

use std::time::Duration;

use agentrun_e2e::ledger::{LedgerEntry, LedgerEvent, Outcome};
use agentrun_e2e::support::scenario::{Scenario, phase, sim_step, status};
use agentrun_operator::api::{AgentRun, ApprovalKind, EffectOutcome, RunPhase, StepPhase};
use agentrun_operator::labels;
use kube::ResourceExt;
use serde_json::{Value, json};

const RUN_TIMEOUT: Duration = Duration::from_secs(90);

/// A step spec with `extra`'s fields added.
fn with(mut step: Value, extra: Value) -> Value {
    if let (Some(s), Value::Object(e)) = (step.as_object_mut(), extra) {
        s.extend(e);
    }
    step
}

fn after(step: Value, deps: &[&str]) -> Value {
    with(step, json!({"dependsOn": deps}))
}

/// The ledger lines of step `step` of run `run` with this event.
fn lines(s: &Scenario, run: &str, step: &str, event: LedgerEvent) -> Vec<LedgerEntry> {
    s.ledger()
        .entries
        .into_iter()
        .filter(|e| {
            e.event == event
                && e.run.as_deref() == Some(run)
                && e.step.as_deref() == Some(step)
                && e.role.as_deref().is_none_or(|r| r == "step")
        })
        .collect()
}

fn one(s: &Scenario, run: &str, step: &str, event: LedgerEvent) -> LedgerEntry {
    let mut l = lines(s, run, step, event);
    assert_eq!(l.len(), 1, "step {step}: exactly one {event:?} line: {l:?}");
    l.remove(0)
}

fn phase_of(run: &AgentRun, step: &str) -> StepPhase {
    status(run)
        .steps
        .iter()
        .find(|c| c.name == step && c.role.is_step())
        .unwrap_or_else(|| panic!("no checkpoint of {step}"))
        .phase
}

/// parse → physicist ∥ chemist → aggregate: both experts run at once, and
/// the aggregator starts only once both committed, with both results.
#[tokio::test]
async fn fan_out_runs_branches_together_and_the_join_waits_for_both() {
    let s = Scenario::start("graph-fan-out").await;
    s.create_run(
        "question",
        json!({"steps": [
            sim_step("parse", "None", json!({"runMs": 50, "result": {"question": "why is the sky blue"}})),
            after(sim_step("physicist", "None", json!({"runMs": 3000, "result": {"answer": "Rayleigh scattering"}})), &["parse"]),
            after(sim_step("chemist", "None", json!({"runMs": 3000, "result": {"answer": "N2 and O2"}})), &["parse"]),
            after(sim_step("aggregate", "None", json!({"runMs": 50, "result": {"summary": "both"}})), &["physicist", "chemist"]),
        ]}),
    )
    .await;
    let run = s.wait_finished("question", RUN_TIMEOUT).await;
    assert_eq!(phase(&run), Some(RunPhase::Succeeded), "{:#?}", run.status);
    assert_eq!(status(&run).progress.as_deref(), Some("4/4"));
    let p = one(&s, "question", "physicist", LedgerEvent::Started);
    let c = one(&s, "question", "chemist", LedgerEvent::Started);
    let p_end = one(&s, "question", "physicist", LedgerEvent::Finished);
    let c_end = one(&s, "question", "chemist", LedgerEvent::Finished);
    let agg = one(&s, "question", "aggregate", LedgerEvent::Started);
    assert!(
        p.started_at < c_end.finished_at.unwrap() && c.started_at < p_end.finished_at.unwrap(),
        "the experts ran at the same time: {p:?} {c:?}"
    );
    assert!(
        agg.started_at >= p_end.finished_at.unwrap()
            && agg.started_at >= c_end.finished_at.unwrap(),
        "the aggregator started after both"
    );
    let pod = s
        .pods()
        .get(
            status(&run)
                .steps
                .iter()
                .find(|c| c.name == "aggregate")
                .unwrap()
                .pod
                .as_deref()
                .unwrap(),
        )
        .await
        .unwrap();
    let ctx: Value = serde_json::from_str(&pod.annotations()[labels::CONTEXT]).unwrap();
    let names: Vec<&str> = ctx["results"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["step"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["parse", "physicist", "chemist"]);
    s.finish().await;
}

/// detect → spam-handler (when spam) ∥ assistant (when not): the spam
/// handler runs, the assistant is skipped and never runs, the run succeeds.
#[tokio::test]
async fn a_result_routes_the_run_and_the_other_branch_is_skipped() {
    let s = Scenario::start("graph-routing").await;
    s.create_run(
        "mail",
        json!({"steps": [
            sim_step("detect", "None", json!({"runMs": 50, "result": {"isSpam": true, "score": 0.97}})),
            with(after(sim_step("spam-handler", "Idempotent", json!({"runMs": 50, "result": {"binned": true}})), &["detect"]),
                 json!({"when": "steps.detect.result.isSpam"})),
            with(after(sim_step("assistant", "Idempotent", json!({"runMs": 50, "result": {"reply": "…"}})), &["detect"]),
                 json!({"when": "!steps.detect.result.isSpam"})),
        ]}),
    )
    .await;
    let run = s.wait_finished("mail", RUN_TIMEOUT).await;
    assert_eq!(phase(&run), Some(RunPhase::Succeeded), "{:#?}", run.status);
    assert_eq!(phase_of(&run, "assistant"), StepPhase::Skipped);
    assert!(lines(&s, "mail", "assistant", LedgerEvent::Started).is_empty());
    one(&s, "mail", "spam-handler", LedgerEvent::Started);
    let skipped = status(&run)
        .steps
        .into_iter()
        .find(|c| c.name == "assistant")
        .unwrap();
    assert_eq!(
        skipped.message.as_deref(),
        Some("skipped: when \"!steps.detect.result.isSpam\" is false")
    );
    s.finish().await;
}

/// manager → prepare → budget ∥ compliance (each gated) → reimburse: both
/// approvals are asked at once and decided independently; reimburse runs
/// once both approved.
#[tokio::test]
async fn parallel_approvals_are_asked_together_and_decided_independently() {
    let s = Scenario::start("graph-approvals").await;
    let gated = |name: &str| {
        with(
            sim_step(
                name,
                "Idempotent",
                json!({"runMs": 50, "result": {"ok": name}}),
            ),
            json!({"approval": {"required": true, "question": format!("{name}?")}}),
        )
    };
    s.create_run(
        "expense",
        json!({"steps": [
            gated("manager"),
            after(sim_step("prepare", "None", json!({"runMs": 50, "result": {"amount": 120}})), &["manager"]),
            after(gated("budget"), &["prepare"]),
            after(gated("compliance"), &["prepare"]),
            after(sim_step("reimburse", "NonIdempotent", json!({"runMs": 50, "result": {"paid": 120}})), &["budget", "compliance"]),
        ]}),
    )
    .await;
    let manager = s
        .approval_of("expense", Some("manager"), Duration::from_secs(30))
        .await;
    s.decide(&manager, "Approved", "ok").await;
    let budget = s
        .approval_of("expense", Some("budget"), Duration::from_secs(30))
        .await;
    let compliance = s
        .approval_of("expense", Some("compliance"), Duration::from_secs(30))
        .await;
    for name in [&budget, &compliance] {
        let a = s.approvals().get(name).await.unwrap();
        assert_eq!(a.spec.kind, ApprovalKind::Approve);
        assert!(a.spec.step_digest.is_some(), "bound to its own step (D14)");
    }
    s.decide(&compliance, "Approved", "policy ok").await;
    let run = s
        .wait_run("expense", "compliance done", Duration::from_secs(30), |r| {
            status(r)
                .steps
                .iter()
                .any(|c| c.name == "compliance" && c.phase == StepPhase::Succeeded)
        })
        .await;
    assert_eq!(phase_of(&run, "budget"), StepPhase::WaitingForApproval);
    assert!(lines(&s, "expense", "reimburse", LedgerEvent::Started).is_empty());
    s.decide(&budget, "Approved", "within budget").await;
    let run = s.wait_finished("expense", RUN_TIMEOUT).await;
    assert_eq!(phase(&run), Some(RunPhase::Succeeded), "{:#?}", run.status);
    one(&s, "expense", "reimburse", LedgerEvent::Started);
    s.finish().await;
}

/// a → left ∥ right; right fails for good while left still runs: left is
/// not stopped, its effect is recorded, and then left and a are compensated,
/// latest first; the join never runs.
#[tokio::test]
async fn a_failed_branch_lets_the_other_finish_then_both_applied_steps_are_compensated() {
    let s = Scenario::start("graph-failure").await;
    let undo = |name: &str| {
        json!({"compensate": {
            "image": "registry.example/agent-step:1",
            "env": [{"name": "SIM_STEP", "value": json!({"runMs": 50, "result": {"undone": name}}).to_string()}]
        }})
    };
    s.create_run(
        "saga",
        json!({"steps": [
            with(sim_step("a", "Idempotent", json!({"runMs": 50, "result": {"a": 1}})), undo("a")),
            with(after(sim_step("left", "Idempotent", json!({"runMs": 4000, "result": {"left": 1}})), &["a"]), undo("left")),
            after(sim_step("right", "Idempotent", json!({"runMs": 500, "exitCode": 1,
                "rawMessage": "{\"result\": {\"error\": \"refused\"}, \"effect\": \"NotApplied\"}"})), &["a"]),
            after(sim_step("join", "Idempotent", json!({"runMs": 50})), &["left", "right"]),
        ]}),
    )
    .await;
    let run = s.wait_finished("saga", RUN_TIMEOUT).await;
    assert_eq!(phase(&run), Some(RunPhase::Failed), "{:#?}", run.status);
    let left = status(&run)
        .steps
        .into_iter()
        .find(|c| c.name == "left")
        .unwrap();
    assert_eq!(
        (left.phase, left.effect),
        (StepPhase::Succeeded, Some(EffectOutcome::Applied)),
        "left ran to its end"
    );
    let l = one(&s, "saga", "left", LedgerEvent::Finished);
    assert_eq!(l.outcome, Some(Outcome::Succeeded));
    assert!(lines(&s, "saga", "join", LedgerEvent::Started).is_empty());
    let compensated: Vec<String> = status(&run)
        .compensations
        .iter()
        .map(|c| c.name.clone())
        .collect();
    assert_eq!(
        compensated,
        ["left", "a"],
        "latest first; right did not act"
    );
    s.finish().await;
}
