//! The chaos workload: seeded random runs of 3–8 steps with mixed effects
//! (20–300 ms each, one in seven 1–3 s),
//! approval gates, steps that fail a few times before they succeed, and
//! compensations on some NonIdempotent steps.
//!
//! Every step's result is `{"run": <run>, "step": <step>}` on every attempt, so
//! a committed result that differs from it is a corrupted checkpoint.

use serde_json::{Value, json};

use super::rng::Rng;

/// One step of a generated run.
#[derive(Clone, Debug, PartialEq)]
pub struct StepPlan {
    pub name: String,
    /// `None`, `Idempotent` or `NonIdempotent`.
    pub effect: &'static str,
    /// Attempts that exit 1 before one succeeds.
    pub fail_times: u32,
    /// `retry.limit`; below `fail_times` the step (and the run) fails.
    pub retry_limit: u32,
    /// An `Approve` gate before the step.
    pub approval: bool,
    pub run_ms: u64,
    /// A compensation container (NonIdempotent steps only).
    pub compensate: bool,
}

/// One generated run.
#[derive(Clone, Debug, PartialEq)]
pub struct RunPlan {
    pub name: String,
    pub steps: Vec<StepPlan>,
}

const VERBS: [&str; 8] = [
    "lookup", "plan", "fetch", "charge", "write", "notify", "index", "review",
];

/// The `index`th run (names `c000`, `c001`, …).
pub fn generate(rng: &mut Rng, index: usize) -> RunPlan {
    let n = rng.range(3, 8) as usize;
    let steps = (0..n)
        .map(|i| {
            let effect = *rng.pick(&["None", "Idempotent", "NonIdempotent"]);
            let fail_times = match rng.below(100) {
                0..75 => 0,
                75..90 => 1,
                _ => 2,
            } as u32;
            let retry_limit = if fail_times > 0 && rng.chance(0.1) {
                fail_times - 1
            } else {
                fail_times + rng.below(2) as u32
            };
            StepPlan {
                name: format!("s{i}-{}", rng.pick(&VERBS)),
                effect,
                fail_times,
                retry_limit,
                approval: rng.chance(0.12),
                // Mostly quick steps; some slow enough to be caught mid-run.
                run_ms: if rng.chance(0.15) {
                    rng.range(1000, 3000)
                } else {
                    rng.range(20, 300)
                },
                compensate: effect == "NonIdempotent" && rng.chance(0.3),
            }
        })
        .collect();
    RunPlan {
        name: format!("c{index:03}"),
        steps,
    }
}

/// The result every attempt of a step reports.
pub fn expected_result(run: &str, step: &str) -> Value {
    json!({"run": run, "step": step})
}

fn sim_env(sim: &Value) -> Value {
    json!([{"name": "SIM_STEP", "value": sim.to_string()}])
}

/// The AgentRun spec of a plan.
pub fn spec(plan: &RunPlan) -> Value {
    let steps: Vec<Value> = plan
        .steps
        .iter()
        .map(|s| {
            let ok = json!({
                "runMs": s.run_ms,
                "result": expected_result(&plan.name, &s.name),
                "tokens": {"input": 10, "output": 5},
            });
            let sim = if s.fail_times == 0 {
                ok
            } else {
                let mut attempts: Vec<Value> = (0..s.fail_times)
                    .map(|_| json!({"runMs": s.run_ms, "exitCode": 1, "tokens": {"input": 3, "output": 0}}))
                    .collect();
                attempts.push(ok);
                json!({"attempts": attempts})
            };
            let mut step = json!({
                "name": s.name,
                "effect": s.effect,
                "retry": {"limit": s.retry_limit, "backoff": {"initial": "200ms", "max": "1s"}},
                "container": {"image": "registry.example/chaos-step:1", "env": sim_env(&sim)},
            });
            if s.approval {
                step["approval"] = json!({"required": true, "question": format!("May {} run?", s.name)});
            }
            if s.compensate {
                step["compensate"] = json!({
                    "image": "registry.example/chaos-undo:1",
                    "env": sim_env(&json!({"runMs": 30, "result": {"undone": s.name}})),
                });
            }
            step
        })
        .collect();
    json!({"steps": steps})
}

#[cfg(test)]
mod tests {
    use super::*;
    use agentrun_operator::api::AgentRunSpec;

    #[test]
    fn generated_specs_deserialize_and_stay_in_bounds() {
        let mut rng = Rng::new(42);
        for i in 0..200 {
            let plan = generate(&mut rng, i);
            assert!((3..=8).contains(&plan.steps.len()));
            let spec: AgentRunSpec =
                serde_json::from_value(spec(&plan)).expect("spec deserializes");
            assert_eq!(spec.steps.len(), plan.steps.len());
            let mut names: Vec<_> = plan.steps.iter().map(|s| &s.name).collect();
            names.dedup();
            assert_eq!(names.len(), plan.steps.len(), "step names are unique");
        }
    }
}
