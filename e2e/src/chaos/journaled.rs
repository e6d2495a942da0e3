//! Journaled steps in the chaos workload (D19): every fourth run (index 1, 5,
//! 9, …) ends with an agent loop whose calls are journaled, a
//! NonIdempotent step with a verify probe — model calls and NonIdempotent
//! tool calls in turn, one tool call slow to act and slow to record — and
//! the driver's hunter kills the loop's Pods mid-loop, so calls are lost
//! between their intent and their answer and settled by the probe.
//!
//! ```text
//!   j-agent: Model ─ Tool ─ Model ─ Tool(slow) [─ Model ─ Tool]   (simkubelet's SIM_STEP.journal)
//!   hunter (every 100 ms): the Pods of attempts 1 and 2 killed a drawn
//!          0.1–1.5 s after they run (during the fault phase); evicted or deleted
//!   referee: verdict/journal_calls.rs, per (run, step, call id)
//! ```

use std::collections::BTreeMap;
use std::time::Duration;

use agentrun_operator::labels;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{DeleteParams, EvictParams, ListParams};
use kube::{Api, ResourceExt};
use serde_json::{Value, json};
use tracing::info;

use super::plan::{CallPlan, RunPlan, StepPlan, expected_result};
use super::rng::Rng;
use super::{Shared, lock};

/// The journaled step's name.
pub const STEP: &str = "j-agent";

/// How long the step's verify probe runs.
const PROBE_MS: u64 = 800;

/// Whether the `index`th run gets a journaled step.
pub fn journals(index: usize) -> bool {
    index % 4 == 1
}

/// The calls of the `index`th run's loop: 4–6, model and tool in turn, by
/// the run's index (no draw: every seed's workload stays as it was).
pub fn calls(index: usize) -> Vec<CallPlan> {
    let n = 4 + index % 3;
    let tools = n / 2;
    let slow_tool = (index / 4) % tools;
    (0..n)
        .map(|seq| {
            let tool = seq % 2 == 1;
            CallPlan {
                id: if tool {
                    format!("call_{seq}")
                } else {
                    format!("model-{seq}")
                },
                kind: if tool { "Tool" } else { "Model" },
                slow: tool && seq / 2 == slow_tool,
            }
        })
        .collect()
}

/// The journaled step of the `index`th run, after `last` (a graph's last step).
pub fn step(index: usize, last: Option<&str>) -> StepPlan {
    StepPlan {
        name: STEP.to_owned(),
        effect: "NonIdempotent",
        retry_limit: 2,
        run_ms: 0,
        depends_on: last.map(|l| vec![l.to_owned()]).unwrap_or_default(),
        journal: Some(calls(index)),
        ..StepPlan::quick(STEP.to_owned(), "NonIdempotent", 0)
    }
}

/// The AgentRun step of a journaled plan step: `journal: {}`, its loop in
/// `SIM_STEP.journal`, a verify probe that answers per call from the ledger.
pub fn spec_step(run: &str, s: &StepPlan, calls: &[CallPlan]) -> Value {
    let calls: Vec<Value> = calls
        .iter()
        .map(|c| {
            let mut call = json!({"kind": c.kind, "id": c.id});
            if c.slow {
                call["actMs"] = json!(1200);
                call["recordMs"] = json!(600);
            }
            call
        })
        .collect();
    let sim = json!({
        "result": expected_result(run, &s.name),
        "tokens": {"input": 10, "output": 5},
        "journal": {"calls": calls},
    });
    let probe = json!({"runMs": PROBE_MS, "probe": {"result": {"verified": s.name}}});
    let mut step = json!({
        "name": s.name,
        "effect": s.effect,
        "journal": {},
        "retry": {"limit": s.retry_limit, "backoff": {"initial": "200ms", "max": "1s"}},
        "container": {"image": "registry.example/chaos-agent:1", "env": env(&sim)},
        "verify": {"image": "registry.example/chaos-verify:1", "env": env(&probe)},
    });
    if !s.depends_on.is_empty() {
        step["dependsOn"] = json!(s.depends_on);
    }
    step
}

fn env(sim: &Value) -> Value {
    json!([{"name": "SIM_STEP", "value": sim.to_string()}])
}

/// The calls each journaled step declares, by (run, step): what the referee
/// expects a succeeded step's journal to hold.
pub fn declared(plans: &[RunPlan]) -> BTreeMap<(String, String), Vec<String>> {
    plans
        .iter()
        .flat_map(|p| {
            p.steps.iter().filter_map(|s| {
                let calls = s.journal.as_ref()?;
                Some((
                    (p.name.clone(), s.name.clone()),
                    calls.iter().map(|c| c.id.clone()).collect(),
                ))
            })
        })
        .collect()
}

/// Kills journaled steps' Pods mid-loop, until aborted.
pub(super) async fn hunt(
    pods: Api<Pod>,
    shared: std::sync::Arc<Shared>,
    plans: Vec<RunPlan>,
    mut rng: Rng,
) {
    // (run, attempt) → how long after it runs its Pod is killed; drawn up front.
    let mut due: BTreeMap<(String, u32), Duration> = BTreeMap::new();
    for p in &plans {
        if !p.steps.iter().any(|s| s.journal.is_some()) {
            continue;
        }
        // Attempts 1 and 2, inside the first 1.5 s of a loop of 2.5 s or
        // more: mostly while its slow tool call is open.
        for a in 1..=2 {
            let at = rng.duration(Duration::from_millis(100), Duration::from_millis(1500));
            due.insert((p.name.clone(), a), at);
        }
    }
    let selector = format!("{}={STEP},{}=step", labels::STEP, labels::ROLE);
    let mut killed = 0u64;
    loop {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let Ok(list) = pods.list(&ListParams::default().labels(&selector)).await else {
            continue;
        };
        for pod in list.items {
            let Some(ran_for) = running_for(&pod) else {
                continue;
            };
            let of = |l: &str| pod.labels().get(l).cloned().unwrap_or_default();
            let attempt = of(labels::ATTEMPT).parse::<u32>().unwrap_or(0);
            let slot = (of(labels::RUN), attempt);
            if due.get(&slot).is_none_or(|at| ran_for < *at) {
                continue;
            }
            due.remove(&slot);
            let name = pod.name_any();
            let evict = killed.is_multiple_of(2);
            let result = if evict {
                pods.evict(&name, &EvictParams::default()).await.map(|_| ())
            } else {
                pods.delete(&name, &DeleteParams::default())
                    .await
                    .map(|_| ())
            };
            match result {
                Ok(()) => {
                    killed += 1;
                    *lock(&shared.journal_kills) += 1;
                    if let Some(key) = pod.annotations().get(labels::IDEMPOTENCY_KEY) {
                        lock(&shared.disrupted_keys).insert(key.clone());
                    }
                    info!(pod = %name, evict, ?ran_for, "killed a journaled loop mid-run");
                }
                Err(err) => info!(pod = %name, error = %err, "killing a journaled loop failed"),
            }
        }
    }
}

/// How long the Pod's step has been running (`None`: it is not running).
fn running_for(pod: &Pod) -> Option<Duration> {
    if pod.metadata.deletion_timestamp.is_some() {
        return None;
    }
    let started = pod
        .status
        .as_ref()?
        .container_statuses
        .as_ref()?
        .first()?
        .state
        .as_ref()?
        .running
        .as_ref()?
        .started_at
        .as_ref()?
        .0;
    Duration::try_from(jiff::Timestamp::now().duration_since(started)).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_loop_alternates_model_and_tool_calls_with_one_slow_tool() {
        let c = calls(1);
        let kinds: Vec<&str> = c.iter().map(|c| c.kind).collect();
        assert_eq!(kinds, ["Model", "Tool", "Model", "Tool", "Model"]);
        let ids: Vec<&str> = c.iter().map(|c| c.id.as_str()).collect();
        assert_eq!(ids, ["model-0", "call_1", "model-2", "call_3", "model-4"]);
        for index in [1, 5, 9, 13, 17, 21] {
            let slow = calls(index).iter().filter(|c| c.slow).count();
            assert_eq!(slow, 1, "run {index}");
        }
        assert_eq!(calls(5).len(), 6);
        assert_eq!(calls(9).len(), 4);
    }

    #[test]
    fn the_spec_step_journals_and_carries_its_loop_and_probe() {
        let s = step(1, Some("s3-write"));
        let v = spec_step("c001", &s, &calls(1));
        assert_eq!(v["journal"], json!({}));
        assert_eq!(v["effect"], "NonIdempotent");
        assert_eq!(v["dependsOn"], json!(["s3-write"]));
        let sim: Value =
            serde_json::from_str(v["container"]["env"][0]["value"].as_str().unwrap()).unwrap();
        assert_eq!(
            sim["journal"]["calls"][1],
            json!({"kind": "Tool", "id": "call_1", "actMs": 1200, "recordMs": 600})
        );
        assert_eq!(
            sim["journal"]["calls"][3],
            json!({"kind": "Tool", "id": "call_3"})
        );
        assert_eq!(sim["result"], expected_result("c001", STEP));
        assert!(
            v["verify"]["env"][0]["value"]
                .as_str()
                .unwrap()
                .contains("probe")
        );
    }
}
