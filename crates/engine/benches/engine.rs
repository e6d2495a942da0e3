//! One `decide` on a 500-step run half-way through: 250 steps checkpointed,
//! step 251 running. This is the engine's cost per reconcile of a large run.
//! And the most a step's `when` may cost (D22): a runaway expression stopped
//! at its budget, which says what one cost unit is in time.

use std::hint::black_box;

use agentrun_api::{AgentRun, AgentRunSpec, Effect, StepContainer, StepPhase, StepSpec};
use agentrun_engine::{Action, Observed, decide};
use criterion::{Criterion, criterion_group, criterion_main};
use jiff::Timestamp;
use k8s_openapi::api::core::v1::{
    ContainerState, ContainerStateTerminated, ContainerStatus, Pod, PodStatus,
};

const STEPS: usize = 500;
const DONE: usize = 250;

fn run() -> AgentRun {
    let steps = (0..STEPS)
        .map(|i| StepSpec {
            name: format!("step-{i:03}"),
            container: Some(StepContainer {
                image: "tool:1".into(),
                ..Default::default()
            }),
            effect: Effect::Idempotent,
            fresh_for: Some("24h".into()),
            timeout: Some("10m".into()),
            ..Default::default()
        })
        .collect();
    let mut run = AgentRun::new(
        "bench",
        AgentRunSpec {
            steps,
            ..Default::default()
        },
    );
    run.metadata.namespace = Some("default".into());
    run.metadata.uid = Some("bench-uid".into());
    run.metadata.generation = Some(1);
    run
}

fn phase(pod: &mut Pod, phase: &str, message: Option<String>) {
    pod.status = Some(PodStatus {
        phase: Some(phase.into()),
        container_statuses: Some(vec![ContainerStatus {
            name: "step".into(),
            state: Some(ContainerState {
                terminated: message.map(|m| ContainerStateTerminated {
                    exit_code: 0,
                    message: Some(m),
                    ..Default::default()
                }),
                ..Default::default()
            }),
            ..Default::default()
        }]),
        ..Default::default()
    });
}

/// Drives the engine (status write, then actions) until step DONE runs.
fn mid_way() -> (AgentRun, Vec<Pod>, Timestamp) {
    let mut run = run();
    let mut pods: Vec<Pod> = Vec::new();
    let mut now = Timestamp::from_second(1_750_000_000).unwrap();
    let mut uid = 0;
    for _ in 0..10 * STEPS {
        let d = decide(&Observed {
            run: &run,
            pods: &pods,
            approvals: &[],
            signals: &[],
            journals: &[],
            refused: &[],
            source: None,
            queued: None,
            history: agentrun_engine::History::On,
            now,
            cel: Default::default(),
        });
        run.status = Some(d.status);
        for a in d.actions {
            match a {
                Action::CreatePod(p) => {
                    let mut p = *p;
                    uid += 1;
                    p.metadata.uid = Some(format!("pod-{uid}"));
                    if run.status.as_ref().unwrap().steps.len() > DONE {
                        phase(&mut p, "Running", None);
                    } else {
                        let msg = format!(
                            r#"{{"result": {{"rows": {uid}}}, "tokens": {{"input": 100, "output": 20}}}}"#
                        );
                        phase(&mut p, "Succeeded", Some(msg));
                    }
                    pods.push(p);
                }
                Action::ReleaseFinalizer { pod } => {
                    pods.retain(|p| p.metadata.name.as_deref() != Some(&pod))
                }
                _ => {}
            }
        }
        now = now.checked_add(jiff::SignedDuration::from_secs(1)).unwrap();
        let s = run.status.as_ref().unwrap();
        // Step DONE is running once its Pod exists (only a NonIdempotent
        // step's checkpoint records the Pod's UID).
        if s.steps.len() > DONE
            && s.steps[DONE].phase == StepPhase::Running
            && pods.iter().any(|p| p.metadata.name == s.steps[DONE].pod)
        {
            return (run, pods, now);
        }
    }
    panic!("the run did not reach step {DONE}");
}

fn bench(c: &mut Criterion) {
    let (run, pods, now) = mid_way();
    let observed = Observed {
        run: &run,
        pods: &pods,
        approvals: &[],
        signals: &[],
        journals: &[],
        refused: &[],
        source: None,
        queued: None,
        history: agentrun_engine::History::On,
        now,
        cel: Default::default(),
    };
    let d = decide(&observed);
    assert_eq!(
        Some(&d.status),
        run.status.as_ref(),
        "a steady state: nothing to write"
    );
    c.bench_function("decide_500_steps_mid_way", |b| {
        b.iter(|| decide(black_box(&observed)))
    });
}

/// Ten nested loops over ten numbers, stopped by the budget.
fn cel_at_its_budget(c: &mut Criterion) {
    use agentrun_engine::cel;
    let ten = "[0,1,2,3,4,5,6,7,8,9]";
    let mut expr = String::from("a >= 0");
    for v in ["j", "i", "h", "g", "f", "e", "d", "c", "b", "a"] {
        expr = format!("{ten}.all({v}, {expr})");
    }
    let compiled = cel::compile(&expr).expect("compiles");
    let limits = cel::Limits::default();
    assert_eq!(
        cel::evaluate(&compiled, |_| Ok(()), &limits).unwrap_err(),
        cel::Failure::Cost {
            limit: cel::COST_LIMIT
        }
    );
    c.bench_function("when_stopped_at_its_cost_budget", |b| {
        b.iter(|| cel::evaluate(black_box(&compiled), |_| Ok(()), &limits))
    });
}

criterion_group!(benches, bench, cel_at_its_budget);
criterion_main!(benches);
