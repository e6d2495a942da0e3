//! The plans of generated runs (`workload.rs` draws them, `journaled.rs` adds
//! a journaled loop to some): what each step does and what it reports, kept
//! apart from both so neither imports the other.

use serde_json::{Value, json};

/// One step of a generated run.
#[derive(Clone, Debug, PartialEq)]
pub struct StepPlan {
    pub name: String,
    /// `None`, `Idempotent` or `NonIdempotent`.
    pub effect: &'static str,
    /// Attempts that exit 1 before one succeeds.
    pub fail_times: u32,
    /// Those failed attempts say `effect: NotApplied` (they did not act).
    pub fails_not_applied: bool,
    /// `retry.limit`; below `fail_times` the step (and the run) fails.
    pub retry_limit: u32,
    /// `retry.backoff.initial` and `.max`, in ms.
    pub backoff_ms: (u64, u64),
    /// An `Approve` gate before the step.
    pub approval: bool,
    pub run_ms: u64,
    /// A compensation container (NonIdempotent steps only).
    pub compensate: bool,
    /// `dependsOn` (graph runs only).
    pub depends_on: Vec<String>,
    /// `freshFor`, in ms.
    pub fresh_for_ms: Option<u64>,
    /// `timeout` and how long the first attempt runs (longer): the timeout stops it.
    pub timeout_ms: Option<(u64, u64)>,
    /// The driver edits the step's args once, during its retry backoff.
    pub edit_in_backoff: bool,
    /// The driver evicts this many of the step's Pods, one after another.
    pub evictions: u32,
    /// How long the step's Pods stay Pending.
    pub pending_ms: u64,
    /// A wait step of this long (no container).
    pub wait_ms: Option<u64>,
    /// The wait is for a signal instead (sent by the driver), not a timer.
    pub signal: bool,
    /// A verify probe, and how it behaves; the step's attempts then act
    /// halfway through their run, not as they start.
    pub verify: Option<Probe>,
    /// A journaled agent loop and its calls (`journaled.rs`).
    pub journal: Option<Vec<CallPlan>>,
}

/// How a step's verify probe behaves.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Probe {
    /// Answers what happened.
    Truthful,
    /// Its first attempt fails; then it answers what happened.
    FailsOnce,
    /// Answers `Unknown`: a person is asked.
    Unknown,
}

/// One generated run.
#[derive(Clone, Debug, PartialEq)]
pub struct RunPlan {
    pub name: String,
    pub steps: Vec<StepPlan>,
    /// `spec.parallelism` (graph runs).
    pub parallelism: Option<u32>,
}

impl RunPlan {
    /// Whether the steps form a graph (some step names `dependsOn`).
    pub fn is_graph(&self) -> bool {
        self.steps.iter().any(|s| !s.depends_on.is_empty())
    }
}

impl StepPlan {
    /// A step that succeeds on its first attempt after `run_ms`: no gate, no
    /// fault of its own.
    pub(super) fn quick(name: String, effect: &'static str, run_ms: u64) -> StepPlan {
        StepPlan {
            name,
            effect,
            fail_times: 0,
            fails_not_applied: false,
            retry_limit: 0,
            backoff_ms: (200, 1000),
            approval: false,
            run_ms,
            compensate: false,
            depends_on: vec![],
            fresh_for_ms: None,
            timeout_ms: None,
            edit_in_backoff: false,
            evictions: 0,
            pending_ms: 0,
            wait_ms: None,
            signal: false,
            verify: None,
            journal: None,
        }
    }
}

/// The result every attempt of a step reports.
pub fn expected_result(run: &str, step: &str) -> Value {
    json!({"run": run, "step": step})
}

/// One call of a journaled loop.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CallPlan {
    pub id: String,
    /// `Model` or `Tool` (a NonIdempotent tool).
    pub kind: &'static str,
    /// Slow to act after its intent and to record its answer: a wide
    /// window for a kill to leave the call open.
    pub slow: bool,
}
