//! Names the operator puts on the objects it creates. One place, so the
//! engine, the controller, the chart's RBAC and the test tools agree.

/// Label on every step Pod: the AgentRun's name.
pub const RUN: &str = "agentrun.dev/run";
/// Label on every step Pod: the step's name.
pub const STEP: &str = "agentrun.dev/step";
/// Label on every step Pod: the plan revision.
pub const PLAN_REVISION: &str = "agentrun.dev/plan-revision";
/// Label on every step Pod: the attempt number (from 1).
pub const ATTEMPT: &str = "agentrun.dev/attempt";
/// Label on every step Pod: `step`, `compensate`, `planner` or `compactor`.
pub const ROLE: &str = "agentrun.dev/role";
/// Label and annotation on every step Pod: the step's idempotency key (D1).
pub const IDEMPOTENCY_KEY: &str = "agentrun.dev/idempotency-key";
/// Annotation on every step Pod of a plan step: the sha256 of what it runs
/// (container, effect, compensation, Pod defaults), the same digest an
/// Approval binds (`spec.stepDigest`, D14).
pub const STEP_DIGEST: &str = "agentrun.dev/step-digest";
/// Annotation holding the step's materialised context JSON, mounted by the
/// downward API at `/agentrun/context.json`.
pub const CONTEXT: &str = "agentrun.dev/context";
/// Finalizer on every step Pod, released only after its result is committed (D5).
pub const RESULT_FINALIZER: &str = "agentrun.dev/result";
/// Label set, with the finalizer's release, on a step Pod that has ended:
/// the operator needs nothing more of it. Its Pod watch selects
/// [`STEP_POD_SELECTOR`], so its cache holds the Pods still in play rather
/// than every Pod a run ever had; the Pod itself stays, with its logs, until
/// its run is deleted. A Pod released while it still runs (deleted, say,
/// with its containers not yet stopped) is not labelled: it stays in view
/// for as long as it is live (D2).
pub const RELEASED: &str = "agentrun.dev/released";
/// The operator's Pod watch: step Pods not yet released once ended.
pub const STEP_POD_SELECTOR: &str = "agentrun.dev/run,!agentrun.dev/released";
/// Annotation on an AgentRun: the user who created it, stamped by the
/// chart's mutating admission policy at creation and guarded against change
/// by its validating policy. An approval gate with `separateFromRequester`
/// refuses this user's approval.
pub const REQUESTED_BY: &str = "agentrun.dev/requested-by";
/// Annotation on an AgentRun: running the same manifest again on purpose.
/// A run created with the namespace, name and spec of a run recorded within
/// the retention window runs nothing (phase `AlreadyRan`, D18) unless this
/// annotation names a value that run did not have. Set at creation only: the
/// chart's validating policy refuses adding or changing it later.
pub const RERUN: &str = "agentrun.dev/rerun";
/// Label on a run created from an AgentRunTemplate: the template's name
/// (`kubectl get ar -l agentrun.dev/template=refund`).
pub const TEMPLATE: &str = "agentrun.dev/template";
/// Annotation on a RunRecord: when its run finished (RFC 3339, to the
/// second, as the record says), what the retention counts from; the pruning
/// reads metadata only.
pub const COMPLETED_AT: &str = "agentrun.dev/completed-at";
/// The field manager of every write the operator makes.
pub const FIELD_MANAGER: &str = "agentrun-operator";
/// Annotation on a step Pod: the identity of the leader that created it. With
/// the chart's step Pod policy the API server refuses the create unless that
/// identity holds the leader Lease, so an operator paused past its lease and
/// deposed cannot start a Pod for an attempt its successor has closed.
pub const LEADER: &str = "agentrun.dev/leader";
/// What the API server says when that policy refuses a step Pod.
pub const NOT_THE_LEADER: &str = "which does not hold the leader Lease";

/// Environment variables a step container receives.
pub mod env {
    pub const IDEMPOTENCY_KEY: &str = "AGENTRUN_IDEMPOTENCY_KEY";
    pub const RUN: &str = "AGENTRUN_RUN";
    pub const STEP: &str = "AGENTRUN_STEP";
    pub const ATTEMPT: &str = "AGENTRUN_ATTEMPT";
    pub const PLAN_REVISION: &str = "AGENTRUN_PLAN_REVISION";
    pub const CONTEXT_FILE: &str = "AGENTRUN_CONTEXT_FILE";
    /// A journaled step's chunk name prefix (docs/journal.md).
    pub const JOURNAL: &str = "AGENTRUN_JOURNAL";
    pub const JOURNAL_MAX_BYTES: &str = "AGENTRUN_JOURNAL_MAX_BYTES";
    pub const JOURNAL_TOKEN_FILE: &str = "AGENTRUN_JOURNAL_TOKEN_FILE";
    pub const JOURNAL_CA_FILE: &str = "AGENTRUN_JOURNAL_CA_FILE";
    pub const RUN_UID: &str = "AGENTRUN_RUN_UID";
    pub const NAMESPACE: &str = "AGENTRUN_NAMESPACE";
    /// A verify probe asked about one journaled call: its seq, id and key.
    pub const CALL_SEQ: &str = "AGENTRUN_CALL_SEQ";
    pub const CALL_ID: &str = "AGENTRUN_CALL_ID";
    pub const CALL_KEY: &str = "AGENTRUN_CALL_KEY";
}

/// Where the context file is mounted in a step container.
pub const CONTEXT_PATH: &str = "/agentrun/context.json";
