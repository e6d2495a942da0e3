//! The chaos workload: seeded random runs of 3–8 steps with mixed effects
//! (20–300 ms each, one in seven 1–3 s), approval gates, steps that fail a
//! few times before they succeed (saying `NotApplied` or not), compensations
//! on some NonIdempotent steps — and the faults that live in the runs
//! themselves:
//!
//! ```text
//!   graph        fan-out and fan-in: s0 ─┬─ s1 ─┬─ s3 ─ …   (dependsOn, parallelism 2–4)
//!                                        └─ s2 ─┘
//!   stale read   read (freshFor 2s) ─ slow step that acts (3.5 s) ─ next: the read expired
//!                mid-run, the run re-plans; a read that acted (Idempotent) asks to repeat
//!   timeout      a NonIdempotent step whose first attempt outlives its timeout, retry
//!                limit 1: the operator must ask Reconcile, never retry blind
//!   edit         a gated step that fails once; the driver edits its args during the
//!                backoff (`edits.rs`): the operator must ask again
//!   evictions    a step whose Pods stay Pending 1 s; the driver evicts three in a row
//!                (`disruptions.rs`): backoff and `Stalled`, then it runs
//!   wait         a wait step (`wait: {for: 1500ms}`, no Pod): operator kills, paused
//!                leaders and a skewed clock must neither lose it nor wake it early;
//!                in every other run with a wait, a wait for a signal instead, which
//!                the driver sends twice (`signaler.rs`): taken once, with its data
//!   verify       every third run's NonIdempotent steps carry a verify probe and act
//!                halfway through an attempt: an attempt killed, timed out or failed
//!                is probed (simkubelet answers from what really happened: Applied
//!                with the step's result, or NotApplied); some probes fail once first,
//!                some cannot tell (Unknown: a person is asked); the driver kills the
//!                operator while some probes run (`probes.rs`)
//!   long         every tenth run (index 7, 17, …), when it is not a graph, goes on with
//!                LONG_STEPS quick steps of every effect: past 50 checkpoints the oldest
//!                are stored in status.archivedSteps, batch by batch, while the faults
//!                go on (a checkpoint moved into the archive is never run again)
//!   journal      every fourth run (index 1, 5, …) ends with a journaled agent loop
//!                (`journaled.rs`): its calls are killed mid-loop and judged per call
//! ```
//!
//! Every step's result is `{"run": <run>, "step": <step>}` on every attempt, so
//! a committed result that differs from it is a corrupted checkpoint.

use serde_json::{Value, json};

use super::journaled;
pub use super::plan::{Probe, RunPlan, StepPlan, expected_result};
use super::rng::Rng;

/// How long a probe runs: long enough for an operator kill to land on some.
/// A probe has as long as one attempt of its step, so a step with a
/// `timeout` has a short one; the rest run long enough for the fault loop,
/// which under load comes round once a second or slower, to see them run
/// (at 800 ms the short run once saw none of its eight probes).
const PROBE_MS: u64 = 800;
const PROBE_MS_UNTIMED: u64 = 3000;

const VERBS: [&str; 8] = [
    "lookup", "plan", "fetch", "charge", "write", "notify", "index", "review",
];

/// The `index`th run (names `c000`, `c001`, …).
pub fn generate(rng: &mut Rng, index: usize) -> RunPlan {
    let graph = rng.chance(0.25);
    let n = rng.range(if graph { 4 } else { 3 }, 8) as usize;
    let mut steps: Vec<StepPlan> = (0..n).map(|i| base_step(rng, i)).collect();
    let mut parallelism = None;
    if graph {
        // s0 fans out to s1 and s2, which fan in to s3; later steps hang
        // from one or two earlier ones.
        for i in 1..n {
            let deps: Vec<usize> = match i {
                1 | 2 => vec![0],
                3 => vec![1, 2],
                _ => {
                    let a = rng.below(i as u64) as usize;
                    let b = rng.below(i as u64) as usize;
                    if a == b {
                        vec![a]
                    } else {
                        vec![a.min(b), a.max(b)]
                    }
                }
            };
            steps[i].depends_on = deps.iter().map(|&d| steps[d].name.clone()).collect();
        }
        parallelism = Some(rng.range(2, 4) as u32);
    }
    let mut used = vec![false; n];
    if rng.chance(0.2) {
        // The read, a step after it that acts and takes longer than the
        // read stays true, and a step that consumes both (in a graph: s0,
        // s1, and s3 which comes after s1 and s2).
        let (read, slow) = if graph {
            (0, 1)
        } else {
            let i = rng.below(n as u64 - 2) as usize;
            (i, i + 1)
        };
        let reservation = rng.chance(0.25);
        let s = &mut steps[read];
        s.effect = if reservation { "Idempotent" } else { "None" };
        s.fresh_for_ms = Some(2000);
        plain(s, 50);
        let s = &mut steps[slow];
        s.effect = *rng.pick(&["Idempotent", "NonIdempotent"]);
        plain(s, 3500);
        used[read] = true;
        used[slow] = true;
    }
    if let Some(i) = pick_free(rng, &mut used, 0.2) {
        let s = &mut steps[i];
        s.effect = "NonIdempotent";
        plain(s, 100);
        s.timeout_ms = Some((2000, 6000));
        s.retry_limit = 1;
    }
    if let Some(i) = pick_free(rng, &mut used, 0.2) {
        let s = &mut steps[i];
        plain(s, 100);
        s.approval = true;
        s.fail_times = 1;
        s.fails_not_applied = true;
        s.retry_limit = 1;
        s.backoff_ms = (2500, 2500);
        s.edit_in_backoff = true;
    }
    if let Some(i) = pick_free(rng, &mut used, 0.15) {
        let s = &mut steps[i];
        plain(s, 100);
        s.evictions = 3;
        s.pending_ms = 1000;
    }
    if let Some(i) = pick_free(rng, &mut used, 0.2) {
        let s = &mut steps[i];
        plain(s, 0);
        s.effect = "None";
        s.compensate = false;
        s.wait_ms = Some(1500);
        // Half the waits wait for a signal: by the run's index, so the draws
        // (and every seed's workload, tuned to end within the short run's
        // settle time) stay as they were.
        s.signal = !index.is_multiple_of(2);
    }
    // Every third run's NonIdempotent steps carry a probe: by the run's and
    // the step's index, so the draws (and every seed's workload) stay as
    // they were.
    if index.is_multiple_of(3) {
        for (i, s) in steps.iter_mut().enumerate() {
            if s.effect == "NonIdempotent" && s.wait_ms.is_none() {
                s.verify = Some(match (index / 3 + i) % 5 {
                    0 => Probe::FailsOnce,
                    1 => Probe::Unknown,
                    _ => Probe::Truthful,
                });
            }
        }
    }
    // Every tenth run goes on long enough to archive checkpoints: by the
    // run's index and after every draw, so the workload of every seed is
    // otherwise as it was.
    if index % 10 == 7 && !graph {
        steps.extend((0..LONG_STEPS).map(long_step));
    }
    // Every fourth run ends with a journaled loop: by the run's index and
    // after every draw, like the long runs.
    if journaled::journals(index) {
        let last = graph.then(|| steps[steps.len() - 1].name.clone());
        steps.push(journaled::step(index, last.as_deref()));
    }
    RunPlan {
        name: format!("c{index:03}"),
        steps,
        parallelism,
    }
}

/// The quick steps a long run adds: at 75 checkpoints or more, its status
/// has archived two batches of checkpoints (`agentrun_operator::api::archive`) while the faults go on.
pub const LONG_STEPS: usize = 72;

/// The `j`th step a long run adds: quick, of each effect in turn, no fault
/// of its own (the driver's evictions, deletes and kills still find it).
fn long_step(j: usize) -> StepPlan {
    StepPlan::quick(
        format!("t{j:02}-{}", VERBS[j % VERBS.len()]),
        ["None", "Idempotent", "NonIdempotent"][j % 3],
        20,
    )
}

fn base_step(rng: &mut Rng, i: usize) -> StepPlan {
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
    // Drawn in the order they always were: every seed's workload stays as it was.
    let name = format!("s{i}-{}", rng.pick(&VERBS));
    let fails_not_applied = rng.chance(0.5);
    let approval = rng.chance(0.12);
    // Mostly quick steps; some slow enough to be caught mid-run.
    let run_ms = if rng.chance(0.15) {
        rng.range(1000, 3000)
    } else {
        rng.range(20, 300)
    };
    let compensate = effect == "NonIdempotent" && rng.chance(0.3);
    StepPlan {
        fail_times,
        fails_not_applied,
        retry_limit,
        approval,
        compensate,
        ..StepPlan::quick(name, effect, run_ms)
    }
}

/// A step that succeeds on its first attempt after `run_ms`, without a gate.
fn plain(s: &mut StepPlan, run_ms: u64) {
    s.fail_times = 0;
    s.retry_limit = 0;
    s.approval = false;
    s.run_ms = run_ms;
}

/// With probability `p`, a step no other fault of the run has taken.
fn pick_free(rng: &mut Rng, used: &mut [bool], p: f64) -> Option<usize> {
    if !rng.chance(p) {
        return None;
    }
    let free: Vec<usize> = (0..used.len()).filter(|&i| !used[i]).collect();
    if free.is_empty() {
        return None; // every step already carries a fault
    }
    let i = *rng.pick(&free);
    used[i] = true;
    Some(i)
}

fn sim_env(sim: &Value) -> Value {
    json!([{"name": "SIM_STEP", "value": sim.to_string()}])
}

fn ms(ms: u64) -> String {
    format!("{ms}ms")
}

/// What simkubelet makes the step's container do, attempt by attempt.
fn sim(run: &str, s: &StepPlan) -> Value {
    // A step with a probe acts halfway through an attempt, so one stopped
    // early did not act and its probe says so.
    let acts = |mut attempt: Value| {
        if s.verify.is_some() {
            attempt["actAtMs"] = json!(attempt["runMs"].as_u64().unwrap_or(0) / 2);
        }
        attempt
    };
    let ok = acts(json!({
        "pendingMs": s.pending_ms,
        "runMs": s.run_ms,
        "result": expected_result(run, &s.name),
        "tokens": {"input": 10, "output": 5},
    }));
    let mut attempts: Vec<Value> = (0..s.fail_times)
        .map(|_| {
            let mut failed = json!({"pendingMs": s.pending_ms, "runMs": s.run_ms, "exitCode": 1, "tokens": {"input": 3, "output": 0}});
            if s.fails_not_applied {
                failed["effect"] = json!("NotApplied");
            }
            acts(failed)
        })
        .collect();
    if let Some((_, first_ms)) = s.timeout_ms {
        let mut outlives = ok.clone();
        outlives["runMs"] = json!(first_ms);
        attempts.push(acts(outlives));
    }
    if attempts.is_empty() {
        return ok;
    }
    attempts.push(ok);
    json!({"attempts": attempts})
}

/// What simkubelet makes the step's probe do: answer from what the step's
/// attempts really did (`probe`), after failing once, or say it cannot tell.
fn probe_sim(run: &str, s: &StepPlan, probe: Probe) -> Value {
    let run_ms = if s.timeout_ms.is_some() {
        PROBE_MS
    } else {
        PROBE_MS_UNTIMED
    };
    let answers = json!({"runMs": run_ms, "probe": {"result": expected_result(run, &s.name)}});
    match probe {
        Probe::Truthful => answers,
        Probe::FailsOnce => json!({"attempts": [{"runMs": run_ms / 2, "exitCode": 1}, answers]}),
        Probe::Unknown => json!({
            "runMs": run_ms,
            "rawMessage": json!({"effect": "Unknown", "result": {"saw": "no record either way"}}).to_string(),
        }),
    }
}

/// The AgentRun spec of a plan.
pub fn spec(plan: &RunPlan) -> Value {
    let steps: Vec<Value> = plan
        .steps
        .iter()
        .map(|s| {
            if let Some(calls) = &s.journal {
                return journaled::spec_step(&plan.name, s, calls);
            }
            if let Some(w) = s.wait_ms {
                let wait = if s.signal {
                    json!({"signal": {"description": "an event the chaos driver sends"}})
                } else {
                    json!({"for": ms(w)})
                };
                let mut step = json!({"name": s.name, "wait": wait});
                if !s.depends_on.is_empty() {
                    step["dependsOn"] = json!(s.depends_on);
                }
                return step;
            }
            let mut step = json!({
                "name": s.name,
                "effect": s.effect,
                "retry": {"limit": s.retry_limit, "backoff": {"initial": ms(s.backoff_ms.0), "max": ms(s.backoff_ms.1)}},
                "container": {"image": "registry.example/chaos-step:1", "env": sim_env(&sim(&plan.name, s))},
            });
            if !s.depends_on.is_empty() {
                step["dependsOn"] = json!(s.depends_on);
            }
            if let Some(f) = s.fresh_for_ms {
                step["freshFor"] = json!(ms(f));
            }
            if let Some((t, _)) = s.timeout_ms {
                step["timeout"] = json!(ms(t));
            }
            if s.approval {
                step["approval"] = json!({"required": true, "question": format!("May {} run?", s.name)});
            }
            if let Some(probe) = s.verify {
                step["verify"] = json!({
                    "image": "registry.example/chaos-verify:1",
                    "env": sim_env(&probe_sim(&plan.name, s, probe)),
                });
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
    let mut spec = json!({"steps": steps});
    if let Some(p) = plan.parallelism {
        spec["parallelism"] = json!(p);
    }
    spec
}

#[cfg(test)]
mod tests {
    use super::*;
    use agentrun_operator::api::AgentRunSpec;

    fn plans(n: usize) -> Vec<RunPlan> {
        let mut rng = Rng::new(42);
        (0..n).map(|i| generate(&mut rng, i)).collect()
    }

    #[test]
    fn generated_specs_deserialize_and_stay_in_bounds() {
        for plan in plans(200) {
            // A journaled loop adds one step to every fourth run.
            let n = plan.steps.len() - plan.steps.iter().filter(|s| s.journal.is_some()).count();
            assert!((3..=8).contains(&n) || (3 + LONG_STEPS..=8 + LONG_STEPS).contains(&n));
            let spec: AgentRunSpec =
                serde_json::from_value(spec(&plan)).expect("spec deserializes");
            assert_eq!(spec.steps.len(), plan.steps.len());
            let mut names: Vec<_> = plan.steps.iter().map(|s| &s.name).collect();
            names.sort();
            names.dedup();
            assert_eq!(names.len(), plan.steps.len(), "step names are unique");
            for (i, s) in plan.steps.iter().enumerate() {
                // A graph: every dependency is an earlier step (no cycle).
                for d in &s.depends_on {
                    let j = plan.steps.iter().position(|t| &t.name == d).unwrap();
                    assert!(j < i, "{} depends on a later {d}", s.name);
                }
            }
        }
    }

    #[test]
    fn every_seed_draws_a_workload_even_when_a_run_has_no_step_left_for_a_fault() {
        // The long run draws 200 runs; a three-step run can have every step
        // taken by a fault before the last one is drawn.
        for seed in 1..=5 {
            let mut rng = Rng::new(seed).fork(1);
            for i in 0..1000 {
                let plan = generate(&mut rng, i);
                assert!(plan.steps.iter().filter(|s| s.wait_ms.is_some()).count() <= 1);
            }
        }
    }

    #[test]
    fn the_short_run_meets_every_kind_of_run_fault() {
        // As the driver draws them: the first fork of the seed's generator.
        let mut rng = Rng::new(7).fork(1);
        let plans: Vec<RunPlan> = (0..40).map(|i| generate(&mut rng, i)).collect();
        let steps = || plans.iter().flat_map(|p| &p.steps);
        let graphs = plans.iter().filter(|p| p.is_graph()).count();
        let fan_in = steps().filter(|s| s.depends_on.len() >= 2).count();
        let stale = steps().filter(|s| s.fresh_for_ms.is_some()).count();
        let timeouts = steps().filter(|s| s.timeout_ms.is_some()).count();
        let edits = steps().filter(|s| s.edit_in_backoff).count();
        let evicted = steps().filter(|s| s.evictions > 0).count();
        let waits = steps().filter(|s| s.wait_ms.is_some() && !s.signal).count();
        let signals = steps().filter(|s| s.signal).count();
        let may_have_acted =
            |s: &&StepPlan| s.effect == "NonIdempotent" && s.fail_times > 0 && !s.fails_not_applied;
        let asks = steps()
            .filter(may_have_acted)
            .filter(|s| s.verify.is_none())
            .count();
        // Probed for sure: an attempt that fails without saying, or outlives its timeout.
        let probed = |p: Probe| {
            steps()
                .filter(|s| s.verify == Some(p))
                .filter(|s| may_have_acted(s) || s.timeout_ms.is_some())
                .count()
        };
        // The forty runs of the short chaos run (seed 7) meet each a few times.
        // Two of the waits are waits for a signal, each sent twice.
        assert!(signals >= 2, "signals: {signals}");
        // A long run archives checkpoints while the faults go on.
        let long = plans.iter().filter(|p| p.steps.len() >= 75).count();
        assert!(long >= 1, "long runs: {long}");
        assert!(
            probed(Probe::FailsOnce) + probed(Probe::Unknown) >= 1,
            "probes that fail once or cannot tell"
        );
        for (what, n) in [
            ("graphs", graphs),
            ("fan-ins", fan_in),
            ("stale reads", stale),
            ("timeouts", timeouts),
            ("edits", edits),
            ("repeated evictions", evicted),
            ("waits", waits),
            ("failures that may have acted", asks),
            ("probes that answer", probed(Probe::Truthful)),
        ] {
            assert!(n >= 3, "{what}: {n}");
        }
    }

    #[test]
    fn a_timed_out_step_outlives_its_timeout_once_then_succeeds() {
        let plan = plans(200)
            .into_iter()
            .find(|p| p.steps.iter().any(|s| s.timeout_ms.is_some()))
            .unwrap();
        let s = plan.steps.iter().find(|s| s.timeout_ms.is_some()).unwrap();
        let v = spec(&plan);
        let step = v["steps"]
            .as_array()
            .unwrap()
            .iter()
            .find(|x| x["name"] == s.name.as_str())
            .unwrap();
        assert_eq!(step["timeout"], "2000ms");
        assert_eq!(step["effect"], "NonIdempotent");
        assert_eq!(step["retry"]["limit"], 1);
        let sim: Value =
            serde_json::from_str(step["container"]["env"][0]["value"].as_str().unwrap()).unwrap();
        assert_eq!(sim["attempts"][0]["runMs"], 6000);
        assert_eq!(sim["attempts"][1]["runMs"], 100);
        assert_eq!(
            sim["attempts"][1]["result"],
            expected_result(&plan.name, &s.name)
        );
    }
}
