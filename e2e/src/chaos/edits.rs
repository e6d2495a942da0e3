//! Steps edited during their retry backoff: a gated step the workload marks
//! (`StepPlan::edit_in_backoff`) fails its first attempt; while it waits out
//! its backoff, the driver changes its container args. The approval released
//! the step as it was (D14): the operator must ask again before attempt 2,
//! and the approver answers the new question like any other.
//!
//! ```text
//!   every 300 ms  GET each marked run ─ checkpoint of the step: failures ≥ 1, Pending
//!                 ─▶ PATCH spec.steps (the step's args + "--edited")   once per step
//! ```

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use agentrun_operator::api::{AgentRun, StepPhase};
use kube::Api;
use kube::api::{Patch, PatchParams};
use serde_json::json;
use tracing::{info, warn};

use super::workload::RunPlan;

/// The argument the driver adds.
pub const EDITED_ARG: &str = "--edited";

/// The edits still to make, and those made.
pub(super) struct Editor {
    /// run → steps to edit.
    due: BTreeMap<String, Vec<String>>,
    next: Instant,
    pub edits: u64,
    /// Steps found past their backoff (rejected, failed for good, retried
    /// already, the run ended) before the driver could edit them, and where
    /// each stood.
    pub missed: Vec<String>,
}

impl Editor {
    pub fn new(plans: &[RunPlan]) -> Editor {
        let mut due: BTreeMap<String, Vec<String>> = BTreeMap::new();
        for p in plans {
            for s in p.steps.iter().filter(|s| s.edit_in_backoff) {
                due.entry(p.name.clone()).or_default().push(s.name.clone());
            }
        }
        Editor {
            due,
            next: Instant::now(),
            edits: 0,
            missed: Vec::new(),
        }
    }

    /// Edits the steps of created runs that wait out their backoff now.
    pub async fn tick(&mut self, runs: &Api<AgentRun>, created: &[String]) {
        if self.due.is_empty() || Instant::now() < self.next {
            return;
        }
        self.next = Instant::now() + Duration::from_millis(300);
        let names: Vec<String> = self
            .due
            .keys()
            .filter(|r| created.contains(r))
            .cloned()
            .collect();
        for name in names {
            let Ok(run) = runs.get(&name).await else {
                continue;
            };
            let steps = self.due.remove(&name).unwrap_or_default();
            let mut left = Vec::new();
            for step in steps {
                match backoff_state(&run, &step) {
                    State::NotYet => left.push(step),
                    State::Past => self
                        .missed
                        .push(format!("{name}/{step}: {}", where_it_stands(&run, &step))),
                    State::InBackoff => match edit(runs, &run, &step).await {
                        Ok(()) => {
                            self.edits += 1;
                            info!(run = %name, %step, "edited a step during its retry backoff");
                        }
                        Err(e) => {
                            warn!(run = %name, %step, error = %e, "editing a step failed; will retry");
                            left.push(step);
                        }
                    },
                }
            }
            if !left.is_empty() {
                self.due.insert(name, left);
            }
        }
    }
}

#[derive(Debug, PartialEq, Eq)]
enum State {
    NotYet,
    InBackoff,
    Past,
}

/// Where the step stands: not failed yet, waiting out the backoff after a
/// failure, or past the point where an edit means anything.
fn backoff_state(run: &AgentRun, step: &str) -> State {
    let Some(status) = run.status.as_ref() else {
        return State::NotYet;
    };
    if status.phase.is_some_and(|p| p.is_terminal()) {
        return State::Past;
    }
    let Some(c) = status
        .steps
        .iter()
        .filter(|c| c.role.is_step() && c.name == step)
        .max_by_key(|c| c.plan_revision)
    else {
        return State::NotYet;
    };
    match c.phase {
        StepPhase::Pending if c.failures >= 1 => State::InBackoff,
        _ if c.phase.is_terminal() => State::Past,
        _ if c.failures >= 1 => State::Past,
        _ => State::NotYet,
    }
}

/// The run's phase and the step's latest checkpoint, in a few words.
fn where_it_stands(run: &AgentRun, step: &str) -> String {
    let status = run.status.as_ref();
    let c = status.and_then(|s| {
        s.steps
            .iter()
            .filter(|c| c.role.is_step() && c.name == step)
            .max_by_key(|c| c.plan_revision)
    });
    format!(
        "run {:?}, step {:?} after {} failure(s): {}",
        status.and_then(|s| s.phase),
        c.map(|c| c.phase),
        c.map_or(0, |c| c.failures),
        c.and_then(|c| c.message.as_deref()).unwrap_or("")
    )
}

/// Adds [`EDITED_ARG`] to the step's container args (the whole steps list,
/// as a merge patch replaces a list).
async fn edit(runs: &Api<AgentRun>, run: &AgentRun, step: &str) -> Result<(), kube::Error> {
    let mut steps = run.spec.steps.clone();
    for s in steps.iter_mut().filter(|s| s.name == step) {
        if let Some(c) = s.container.as_mut() {
            c.args.push(EDITED_ARG.into());
        }
    }
    let name = run.metadata.name.as_deref().unwrap_or_default();
    runs.patch(
        name,
        &PatchParams::default(),
        &Patch::Merge(json!({"spec": {"steps": steps}})),
    )
    .await
    .map(|_| ())
}

#[cfg(test)]
mod tests {
    use super::*;
    use agentrun_operator::api::{AgentRunStatus, RunPhase, StepCheckpoint};

    fn run_with(phase: RunPhase, step: StepPhase, failures: i32) -> AgentRun {
        let mut r: AgentRun = serde_json::from_value(json!({
            "apiVersion": "agentrun.dev/v1alpha1", "kind": "AgentRun",
            "metadata": {"name": "r"},
            "spec": {"steps": [{"name": "a", "container": {"image": "x"}}]},
        }))
        .unwrap();
        r.status = Some(AgentRunStatus {
            phase: Some(phase),
            steps: vec![StepCheckpoint {
                name: "a".into(),
                plan_revision: 1,
                phase: step,
                failures,
                ..Default::default()
            }],
            ..Default::default()
        });
        r
    }

    #[test]
    fn a_step_is_edited_only_while_it_waits_out_its_backoff() {
        use RunPhase::*;
        for (run, step, failures, state) in [
            (
                WaitingForApproval,
                StepPhase::WaitingForApproval,
                0,
                State::NotYet,
            ),
            (Running, StepPhase::Running, 0, State::NotYet),
            (Running, StepPhase::Pending, 1, State::InBackoff),
            (
                WaitingForApproval,
                StepPhase::WaitingForApproval,
                1,
                State::Past,
            ),
            (Running, StepPhase::Succeeded, 1, State::Past),
            (Failed, StepPhase::Pending, 1, State::Past),
        ] {
            assert_eq!(
                backoff_state(&run_with(run, step, failures), "a"),
                state,
                "{run:?} {step:?} {failures}"
            );
        }
        assert_eq!(
            backoff_state(&run_with(Running, StepPhase::Pending, 1), "b"),
            State::NotYet
        );
    }
}
