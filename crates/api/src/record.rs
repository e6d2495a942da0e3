//! The `RunRecord` resource: what a finished run leaves behind (D18).
//!
//! The operator writes one when a run reaches a terminal phase, before the
//! status says so and long before its `ttlSecondsAfterFinished` deletes it:
//! who asked, what came of it, per step the effect, the idempotency key and
//! how the outcome was established, who approved what and when, the tokens.
//! It is not owned by the run, so it outlives it; the operator removes it
//! after the retention window (or past the count a namespace keeps), and the
//! namespace takes it along when it goes.
//!
//! A run created again with the same namespace, name and spec within the
//! window — what a GitOps controller does after the TTL deleted the run —
//! finds its record and runs nothing (phase `AlreadyRan`).

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::{CustomResource, KubeSchema};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::{EffectOutcome, Provenance, RunPhase, StepPhase, StepRole};

/// The record of one finished AgentRun.
#[allow(clippy::duplicated_attributes)]
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[kube(
    group = "agentrun.dev",
    version = "v1alpha1",
    kind = "RunRecord",
    plural = "runrecords",
    singular = "runrecord",
    shortname = "arrec",
    category = "agentrun-all",
    namespaced,
    derive = "PartialEq",
    doc = "The record of a finished AgentRun, written by the operator before the run is deleted and kept for the retention window: outcome, per step the effect and idempotency key, approvals with decider, tokens. A run created again with the same name and spec within the window runs nothing.",
    printcolumn(
        name = "Run",
        type_ = "string",
        json_path = ".spec.run.name",
        description = "The AgentRun this records"
    ),
    printcolumn(
        name = "Outcome",
        type_ = "string",
        json_path = ".spec.outcome.phase",
        description = "Succeeded, Failed or Cancelled"
    ),
    printcolumn(
        name = "Requested-By",
        type_ = "string",
        json_path = ".spec.run.requestedBy",
        description = "Who created the run, as the API server recorded it"
    ),
    printcolumn(
        name = "Steps",
        type_ = "integer",
        json_path = ".spec.outcome.stepExecutions",
        description = "Step Pods the run started"
    ),
    printcolumn(
        name = "Tokens",
        type_ = "integer",
        json_path = ".spec.outcome.tokensUsed",
        description = "Tokens the run reported"
    ),
    printcolumn(
        name = "Finished",
        type_ = "date",
        json_path = ".spec.outcome.completedAt",
        description = "When the run finished"
    )
)]
#[x_kube(
    validation = Rule::new("self == oldSelf").message("a RunRecord is history: it does not change once written").reason(Reason::FieldValueForbidden)
)]
#[serde(rename_all = "camelCase")]
pub struct RunRecordSpec {
    /// Which run this is.
    pub run: RecordedRun,
    /// What came of it.
    pub outcome: RecordedOutcome,
    /// Per checkpoint (steps, planner, compactor, verify probes), in the
    /// order the run recorded them.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 600))]
    pub steps: Vec<RecordedStep>,
    /// The compensations that ran.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 600))]
    pub compensations: Vec<RecordedStep>,
    /// Every decision a person made on the run's Approvals.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 600))]
    pub approvals: Vec<RecordedApproval>,
    /// Every signal the run received.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 600))]
    pub signals: Vec<RecordedSignal>,
}

/// The run's identity: what a run created again is matched against.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct RecordedRun {
    pub namespace: String,
    pub name: String,
    pub uid: String,
    /// The digests of the run's spec, one per version of it the operator
    /// saw (the first is the spec it was created with; an edit adds one).
    /// `suspend` and `cancel` are controls, not what runs: they are left out.
    #[schemars(length(min = 1, max = 16))]
    pub spec_digests: Vec<String>,
    /// The run's `agentrun.dev/rerun` annotation: a run that sets another
    /// value is a deliberate new run of the same manifest.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rerun: Option<String>,
    /// Who created the run (`agentrun.dev/requested-by`, stamped by the
    /// chart's admission policy).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub requested_by: Option<String>,
    /// The run this one was forked from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub forked_from: Option<String>,
    /// When the run was created.
    pub created_at: Time,
}

/// The run's outcome.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct RecordedOutcome {
    pub phase: RunPhase,
    /// The reason of the run's `Ready` condition (e.g. `StepFailed`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 1024))]
    pub message: Option<String>,
    /// When the run started (was admitted).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub started_at: Option<Time>,
    /// When the run finished.
    pub completed_at: Time,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub duration: Option<String>,
    #[serde(default)]
    pub tokens_used: i64,
    #[serde(default)]
    pub step_executions: i32,
    /// The last plan revision.
    #[serde(default)]
    pub plan_revision: i64,
}

/// One checkpoint, cut to its facts.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct RecordedStep {
    pub name: String,
    #[serde(default, skip_serializing_if = "is_step")]
    pub role: StepRole,
    pub plan_revision: i64,
    pub attempt: i32,
    pub phase: StepPhase,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub effect: Option<EffectOutcome>,
    pub idempotency_key: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub provenance: Option<Provenance>,
    #[serde(default, skip_serializing_if = "is_zero")]
    pub tokens: i64,
    /// When its Pod was created.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub started_at: Option<Time>,
    /// When its outcome was recorded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub finished_at: Option<Time>,
    /// Who decided the step's outcome (a signal's sender, a person's
    /// MarkSucceeded).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub decided_by: Option<String>,
    /// A journaled step (D19): its model and tool calls recorded, and how
    /// many of them were settled after they may have acted (its tokens are
    /// the journal's, in `tokens`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub journal: Option<RecordedJournal>,
}

/// What a journaled step's calls came to.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct RecordedJournal {
    pub calls: i64,
    #[serde(default, skip_serializing_if = "is_zero")]
    pub settled: i64,
}

fn is_step(role: &StepRole) -> bool {
    *role == StepRole::Step
}

fn is_zero(n: &i64) -> bool {
    *n == 0
}

/// A decision on one of the run's Approvals.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct RecordedApproval {
    /// The Approval's name.
    pub name: String,
    pub step: String,
    pub plan_revision: i64,
    /// `Approve` or `Reconcile`.
    pub kind: String,
    /// `Approved`, `Rejected`, `Expired`, `Resolved`, `Superseded` or `Pending`.
    pub phase: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub decision: Option<String>,
    /// Who decided, as the API server recorded it (D15).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub decided_by: Option<String>,
    /// When the decision took effect, by the API server's clock.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub decided_at: Option<Time>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 1024))]
    pub comment: Option<String>,
    /// For a quorum: each vote as `user=Decision`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub votes: Vec<String>,
    /// The digest of the step it released (D14).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub step_digest: Option<String>,
}

/// A signal the run received.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct RecordedSignal {
    pub name: String,
    pub step: String,
    /// `Received`, `Expired` or `Superseded`.
    pub phase: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sent_by: Option<String>,
    /// When the API server stored the signal.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub recorded_at: Option<Time>,
}
