//! Condition types and reasons, and Event reasons: the words the engine uses
//! in status and Events, in one place so dashboards and tests agree.

/// Condition types on `AgentRun.status.conditions`.
pub mod condition {
    /// True: the run succeeded; False: it failed or was cancelled; Unknown: in progress.
    pub const SUCCEEDED: &str = "Succeeded";
    /// True while the run is making progress by itself.
    pub const PROGRESSING: &str = "Progressing";
    /// True while the run waits on an Approval.
    pub const AWAITING_APPROVAL: &str = "AwaitingApproval";
    /// True once a token or step-execution budget was exhausted.
    pub const BUDGET_EXCEEDED: &str = "BudgetExceeded";
    /// True while the run re-runs steps because an input went stale (D8).
    pub const STALE: &str = "Stale";
    /// True once the run is bound to fail (or be cancelled) and is compensating
    /// first; its reason becomes the final `Succeeded=False` reason.
    pub const FAILURE_TARGET: &str = "FailureTarget";
    /// True while the run cannot make progress by itself: the API server
    /// refuses a Pod or Approval it needs, or a foreign object holds its name
    /// (D16). The message is the API server's own.
    pub const STALLED: &str = "Stalled";
}

/// Reasons, shared by conditions and Events.
pub mod reason {
    pub const RUNNING: &str = "Running";
    pub const PLANNING: &str = "Planning";
    pub const PENDING: &str = "Pending";
    pub const COMPENSATING: &str = "Compensating";
    pub const SUSPENDED: &str = "Suspended";
    pub const FINISHED: &str = "Finished";
    pub const NO_APPROVAL_PENDING: &str = "NoApprovalPending";
    pub const WAITING_FOR_APPROVAL: &str = "WaitingForApproval";
    pub const INPUT_STALE: &str = "InputStale";
    pub const INPUTS_FRESH: &str = "InputsFresh";

    pub const RUN_SUCCEEDED: &str = "RunSucceeded";
    pub const RUN_FAILED: &str = "RunFailed";
    pub const RUN_CANCELLED: &str = "RunCancelled";
    pub const INVALID_SPEC: &str = "InvalidSpec";
    pub const INVALID_PLAN: &str = "InvalidPlan";
    pub const STEP_FAILED: &str = "StepFailed";
    pub const CANCELLED: &str = "Cancelled";
    pub const DEADLINE_EXCEEDED: &str = "DeadlineExceeded";
    pub const TOKEN_BUDGET_EXCEEDED: &str = "TokenBudgetExceeded";
    pub const STEP_BUDGET_EXCEEDED: &str = "StepExecutionBudgetExceeded";
    /// A re-plan would keep more checkpoints than a run's status may hold (D11).
    pub const STATUS_BUDGET_EXCEEDED: &str = "StatusBudgetExceeded";
    pub const APPROVAL_REJECTED: &str = "ApprovalRejected";
    pub const APPROVAL_EXPIRED: &str = "ApprovalExpired";

    pub const STEP_STARTED: &str = "StepStarted";
    pub const STEP_SUCCEEDED: &str = "StepSucceeded";
    pub const STEP_RETRYING: &str = "StepRetrying";
    pub const STEP_TIMED_OUT: &str = "StepTimedOut";
    pub const STEP_DISRUPTED: &str = "StepDisrupted";
    pub const STEP_STOPPED: &str = "StepStopped";
    pub const STEP_OUTCOME_UNKNOWN: &str = "StepOutcomeUnknown";
    /// A step's result was too large to keep inline in status (D11).
    pub const RESULT_NOT_KEPT: &str = "ResultNotKept";
    pub const APPROVAL_REQUESTED: &str = "ApprovalRequested";
    pub const APPROVAL_GRANTED: &str = "ApprovalGranted";
    pub const RECONCILE_DECIDED: &str = "ReconcileDecided";
    pub const PLAN_ADOPTED: &str = "PlanAdopted";
    pub const REPLANNED: &str = "Replanned";
    pub const CONTEXT_COMPACTED: &str = "ContextCompacted";
    pub const COMPENSATION_STARTED: &str = "CompensationStarted";
    pub const COMPENSATION_SUCCEEDED: &str = "CompensationSucceeded";
    pub const COMPENSATION_FAILED: &str = "CompensationFailed";
    pub const TTL_EXPIRED: &str = "TtlExpired";
    /// A Pod or Approval the run needs was refused by the API server.
    pub const FAILED_CREATE: &str = "FailedCreate";
    /// A Pod or Approval name the run needs is held by an object not its own.
    pub const NAME_TAKEN: &str = "NameTaken";
    /// The run does not deserialize; nothing is done for it until it changes.
    pub const UNREADABLE: &str = "Unreadable";
    /// A stall cleared: what was refused now exists.
    pub const UNBLOCKED: &str = "Unblocked";
}
