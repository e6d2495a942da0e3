//! The `AgentRun` status subresource: the plan in force, one checkpoint per
//! (step, plan revision) and per compensation, tokens, conditions. Once a
//! checkpoint is committed, its outcome never changes (D3).

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::{StepSpec, any_json};

// Its lists are atomic (one field to the field manager, replaced whole by an
// apply): the operator alone writes them, by JSON patch at indices, and a
// checkpoint has no key of its own (one per step and plan revision). The
// conditions stay a map keyed by `type`, the Kubernetes convention, which lets
// a second writer apply one condition without taking the others.
/// The durable record of a run. Everything the operator knows lives here.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct AgentRunStatus {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase: Option<RunPhase>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// The plan being executed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub plan: Option<PlanStatus>,
    /// One checkpoint per (step, plan revision) that has started, in start
    /// order: every one of them here, in memory. Stored as `steps` and, for a
    /// long run, `archivedSteps` with the oldest finished ones compressed
    /// (`super::archive`).
    #[serde(flatten, with = "super::archive")]
    #[schemars(with = "super::archive::StoredSteps")]
    pub steps: Vec<StepCheckpoint>,
    /// Checkpoints of compensations run for applied steps.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "atomic"))]
    pub compensations: Vec<CompensationCheckpoint>,
    /// Tokens reported by every attempt so far, failed ones included.
    #[serde(default)]
    pub tokens_used: i64,
    /// Step Pods created so far, retries and re-plans included.
    #[serde(default)]
    pub step_executions: i32,
    /// The compacted context that replaces older raw results.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub summary: Option<String>,
    /// The step currently running or waiting (for `kubectl get`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub current_step: Option<String>,
    /// Steps of the current plan that have succeeded, as `done/total`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub progress: Option<String>,
    /// When the run started (was admitted, where runs queue);
    /// `activeDeadlineSeconds` counts from here. A run that has it counts
    /// against the operator's caps on active runs until it finishes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub started_at: Option<Time>,
    /// While `Queued`: the run's place in its namespace's queue, from 1 (the
    /// next to start).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub queue_position: Option<i32>,
    /// For a fork: where it came from, and who asked for it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub forked_from: Option<Box<ForkedFrom>>,
    /// When the run reached a terminal phase; `ttlSecondsAfterFinished`
    /// counts from here.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub completed_at: Option<Time>,
    /// From `startedAt` to `completedAt`, as `kubectl get` shows a Job's
    /// (`3m12s`); set when the run finishes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub duration: Option<String>,
    /// The sha256 (128 bits, hex) of each version of the spec the operator
    /// saw, `suspend` and `cancel` left out: the first is the spec the run
    /// was created with, an edit adds one (at most 16). The run's record
    /// keeps them, so a run created again from any of them is recognised (D18).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 16), extend("x-kubernetes-list-type" = "atomic"))]
    pub spec_digests: Vec<String>,
    /// The RunRecord written for this run once it finished (D18): set only
    /// after the record was stored, and the TTL deletes the run only then.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub record: Option<String>,
    /// Phase `AlreadyRan`: the earlier run of this name and spec whose record
    /// was found; nothing of this one ran.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub already_ran: Option<Box<AlreadyRan>>,
    /// Standard conditions: Succeeded, Progressing, AwaitingApproval, BudgetExceeded, Stale.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(schema_with = "super::conditions_schema")]
    pub conditions: Vec<Condition>,
}

/// The earlier run a run created again was recognised as (D18).
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct AlreadyRan {
    /// The RunRecord of the earlier run.
    pub record: String,
    /// The earlier run's UID.
    pub run_uid: String,
    /// How it ended: `Succeeded`, `Failed` or `Cancelled`.
    pub outcome: String,
    /// When the earlier run finished.
    pub completed_at: Time,
}

/// The lineage of a fork, as the operator read it from the source run.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct ForkedFrom {
    pub run_name: String,
    pub run_uid: String,
    pub from_step: String,
    /// Who created the fork (the API server's record, annotation
    /// `agentrun.dev/requested-by`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub requested_by: Option<String>,
    /// The steps whose checkpoints were carried over (provenance Inherited).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "atomic"))]
    pub inherited: Vec<String>,
}

/// Where a run stands.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RunPhase {
    Pending,
    /// Waits for a place under the operator's cap on active runs (per
    /// namespace or in all): nothing of it has started.
    Queued,
    Planning,
    Running,
    WaitingForApproval,
    /// Every step under way is a wait step: nothing runs until the first wakes.
    Waiting,
    Compensating,
    Succeeded,
    Failed,
    Cancelled,
    /// A run of this namespace, name and spec already ran within the
    /// retention window (its RunRecord is named in `status.alreadyRan`):
    /// nothing of this one runs (D18). What a GitOps re-sync after the TTL
    /// creates; the `agentrun.dev/rerun` annotation runs it again on purpose.
    AlreadyRan,
}

impl RunPhase {
    /// Terminal phases are sticky: nothing moves a run out of them.
    pub fn is_terminal(self) -> bool {
        matches!(
            self,
            RunPhase::Succeeded | RunPhase::Failed | RunPhase::Cancelled | RunPhase::AlreadyRan
        )
    }

    /// A run that ran and finished: it leaves a record (D18).
    pub fn is_finished(self) -> bool {
        matches!(
            self,
            RunPhase::Succeeded | RunPhase::Failed | RunPhase::Cancelled
        )
    }
}

/// The plan in force.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct PlanStatus {
    /// Starts at 1; every re-plan adds one. Part of every idempotency key.
    pub revision: i64,
    /// Why this revision exists (e.g. "initial plan from spec", "step lookup stale").
    #[serde(default)]
    pub reason: String,
    /// Where the steps come from.
    #[serde(default)]
    pub source: PlanSource,
    /// The names of the steps of this plan, in order.
    #[serde(default)]
    #[schemars(extend("x-kubernetes-list-type" = "atomic"))]
    pub step_names: Vec<String>,
    /// The full step definitions when the planner wrote the plan (empty when the
    /// plan is `spec.steps`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 500), extend("x-kubernetes-list-type" = "atomic"))]
    pub steps: Vec<StepSpec>,
    /// Set by a re-plan for freshness (D8): the steps that run again at this
    /// revision, with new keys: the stale reads, and the steps after them
    /// that have not acted. Every other step keeps its checkpoint from an
    /// earlier revision; a step that acted (effect Applied or Unknown) is
    /// never run again unless a person approves it. Empty (and no
    /// `rerunFrom`): every step of the plan runs at this revision.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 500), extend("x-kubernetes-list-type" = "atomic"))]
    pub rerun: Vec<String>,
    /// Written by earlier versions instead of `rerun`: the first step that
    /// runs again at this revision; it and every later step run again.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rerun_from: Option<String>,
}

/// The origin of a plan's steps.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum PlanSource {
    #[default]
    Spec,
    Planner,
}

/// The durable record of one step at one plan revision. Once `outcome` is
/// set it is never changed (D3).
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct StepCheckpoint {
    pub name: String,
    /// What the Pod does: a plan step (default), the planner or the compactor.
    /// A compactor checkpoint is named after the step it runs before.
    #[serde(default, skip_serializing_if = "StepRole::is_step")]
    pub role: StepRole,
    pub plan_revision: i64,
    /// The current or last attempt, from 1.
    pub attempt: i32,
    /// Stable across attempts of this (run, step, plan revision); passed to the step.
    pub idempotency_key: String,
    /// The Pod of the current or last attempt.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod: Option<String>,
    /// The UID of a NonIdempotent step's running Pod once it has been seen; a
    /// Pod seen once and then gone (or replaced) was lost, not merely not yet
    /// cached, and may have acted. Not recorded for other steps, whose Pod is
    /// simply created again under the same name and key. Cleared when the
    /// attempt ends.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod_uid: Option<String>,
    /// This attempt's Pod was created again after it was never seen (the
    /// operator died between recording the launch and creating it, or the
    /// Pod was removed unseen): its UID is then recorded once seen, like a
    /// NonIdempotent step's, so an older copy of the Pod a cache still
    /// holds is never read as this one.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub pod_recreated: bool,
    /// What the step is doing or how it ended.
    pub phase: StepPhase,
    /// Whether the outcome has been written to this status: `Committed` once
    /// the step finished and its result is durable.
    #[serde(default)]
    pub checkpoint: CheckpointState,
    /// What happened outside the cluster: Applied, NotApplied or Unknown.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub effect: Option<EffectOutcome>,
    /// The step's result (capped; see `resultTruncated`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "any_json")]
    pub result: Option<serde_json::Value>,
    /// True when the result was too large to keep inline or was compacted into the summary.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub result_truncated: bool,
    /// Tokens of all attempts of this step.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokens: Option<TokenUsage>,
    /// When the current or last attempt was launched (to the whole second);
    /// the step's `timeout` counts from here.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub started_at: Option<Time>,
    /// When the attempt that decided the outcome ended: for a step that
    /// succeeded, when its container finished (as the kubelet reported it),
    /// so its `freshFor` counts from there, not from when the operator
    /// noticed; otherwise when the outcome was recorded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub finished_at: Option<Time>,
    /// After this instant the result is stale and later steps will not use it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fresh_until: Option<Time>,
    /// Attempts that failed (exit code, timeout, bad result); counts against `retry.limit`.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub failures: i32,
    /// Attempts lost to eviction, preemption or deletion; never count against `retry.limit`.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub disruptions: i32,
    /// Earliest time of the next attempt (backoff timer).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub next_attempt_at: Option<Time>,
    /// When a wait step ends: its `wait.until`, or `wait.for` after its
    /// `startedAt`. Fixed when the wait starts.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub wake_at: Option<Time>,
    /// The Approval this step waits on, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub approval: Option<String>,
    /// The Signal this wait step waits on, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub signal: Option<String>,
    /// For a step behind an approval gate: the digest of the step as the
    /// approval asked about it. Only a step with this digest is released by
    /// the approval (D14).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub step_digest: Option<String>,
    /// Who released the step: the approver(s) of its approval gate, or
    /// whoever answered its Reconcile question, or who sent its signal, as
    /// the API server recorded them (D15).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub decided_by: Option<String>,
    /// A person-readable account of the last thing that happened.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    /// The operator ended this attempt while its Pod was still running (a
    /// timeout, cancel, deadline or budget): the Pod is being stopped and
    /// keeps its result finalizer until it has, so what it reports then (its
    /// tokens, and the result of a step that finished after all) is still
    /// recorded here. Cleared once recorded, or once the Pod is gone.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub stopping: bool,
    /// How the outcome was established, when not by the step's own attempt:
    /// `Verified` (its verify probe answered Applied), `Marked` (a person
    /// answered MarkSucceeded).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub provenance: Option<Provenance>,
    /// The status grew past its size budget and this finished checkpoint was
    /// cut to its facts: outcome, persistence, effect, key, attempt, result
    /// and freshness stay; its Pod name, start time, tokens (counted in the
    /// run's `tokensUsed`) and message were dropped (D11).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub compacted: bool,
    /// A journaled step's calls at this plan revision (D19).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub journal: Option<Box<super::JournalSummary>>,
}

fn is_zero(n: &i32) -> bool {
    *n == 0
}

/// How a checkpoint's outcome was established.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Provenance {
    /// The step's verify probe found the effect applied.
    Verified,
    /// A person answered a Reconcile question MarkSucceeded.
    Marked,
    /// Carried over from the run this one was forked from (`spec.forkOf`).
    Inherited,
}

/// What a checkpointed Pod does for the run.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub enum StepRole {
    /// A step of the plan.
    #[default]
    Step,
    /// `spec.planner`: its result is the next plan revision.
    Planner,
    /// `spec.context.compactor`: its summary replaces older raw results.
    Compactor,
    /// `steps[].verify`: the probe that settles an unknown outcome of the
    /// step it is named after, with the step's key.
    Verify,
}

impl StepRole {
    pub fn is_step(&self) -> bool {
        *self == StepRole::Step
    }
}

/// The lifecycle of one step.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub enum StepPhase {
    /// Not started yet (waiting for backoff, budget or a decision).
    #[default]
    Pending,
    /// Waiting for a person's Approval before starting.
    WaitingForApproval,
    /// A Pod for the current attempt exists.
    Running,
    /// Finished successfully; result committed.
    Succeeded,
    /// Failed for good (retries exhausted, rejected, or marked failed).
    Failed,
    /// Result was superseded by a re-plan before it was used.
    Superseded,
    /// Not run: its `when` was false. The steps after it go on.
    Skipped,
    /// An attempt may have acted; the step's verify probe is asking the
    /// system it changes what happened.
    Verifying,
    /// A wait step, until its `wakeAt`: no Pod runs.
    Waiting,
}

impl StepPhase {
    pub fn is_terminal(self) -> bool {
        matches!(
            self,
            StepPhase::Succeeded | StepPhase::Failed | StepPhase::Superseded | StepPhase::Skipped
        )
    }

    /// Done as far as the steps after it are concerned.
    pub fn is_done(self) -> bool {
        matches!(self, StepPhase::Succeeded | StepPhase::Skipped)
    }
}

/// Whether a step's outcome is durable.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum CheckpointState {
    /// The step has no final outcome yet.
    #[default]
    Pending,
    /// The outcome is recorded in status and will not change.
    Committed,
}

/// What a step did to the outside world.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
pub enum EffectOutcome {
    Applied,
    NotApplied,
    /// The step may or may not have acted: an attempt ended (lost, stopped,
    /// timed out, failed, or with an unreadable result) without reporting
    /// `NotApplied`.
    Unknown,
}

impl EffectOutcome {
    /// Applied, or may have been: the step's effect is history (D1, D8).
    pub fn acted(self) -> bool {
        matches!(self, EffectOutcome::Applied | EffectOutcome::Unknown)
    }
}

/// Tokens reported by a step.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Default)]
#[serde(rename_all = "camelCase")]
pub struct TokenUsage {
    #[serde(default)]
    pub input: i64,
    #[serde(default)]
    pub output: i64,
}

impl TokenUsage {
    pub fn total(&self) -> i64 {
        self.input.saturating_add(self.output)
    }
}

/// The record of one compensation Pod.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct CompensationCheckpoint {
    /// The step being compensated.
    pub name: String,
    pub plan_revision: i64,
    pub attempt: i32,
    pub idempotency_key: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod: Option<String>,
    /// Recorded only for a Pod created again after it was never seen
    /// (`podRecreated`), so an older Pod of the same name is never read as
    /// this one. (`StepCheckpoint.podUid` explains the field.)
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod_uid: Option<String>,
    /// As `StepCheckpoint.podRecreated`.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub pod_recreated: bool,
    pub phase: StepPhase,
    /// When the current or last attempt of the compensation was launched.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub started_at: Option<Time>,
    /// When the compensation's outcome was recorded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub finished_at: Option<Time>,
    /// Attempts that failed; counts against the compensated step's `retry.limit`.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub failures: i32,
    /// Attempts lost to disruption; never counted as failures.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub disruptions: i32,
    /// Earliest time of the next attempt (backoff timer).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub next_attempt_at: Option<Time>,
    /// Tokens its attempts reported; they count against the run's budget too.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokens: Option<TokenUsage>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
}
