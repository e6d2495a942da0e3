//! Condition types and reasons, and Event reasons: the words the engine uses
//! in status and Events, as types, so that a misspelt reason does not
//! compile and dashboards and tests agree with the engine.

/// Condition types on `AgentRun.status.conditions`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ConditionType {
    /// True: the run succeeded; False: it failed or was cancelled; Unknown: in progress.
    Succeeded,
    /// True while the run is making progress by itself.
    Progressing,
    /// True while the run waits on an Approval.
    AwaitingApproval,
    /// True once a token or step-execution budget was exhausted.
    BudgetExceeded,
    /// True while the run re-runs steps because an input went stale (D8).
    Stale,
    /// True once the run is bound to fail (or be cancelled) and is compensating
    /// first; its reason becomes the final `Succeeded=False` reason.
    FailureTarget,
    /// True while the run cannot make progress by itself: the API server
    /// refuses a Pod or Approval it needs, or a foreign object holds its name
    /// (D16). The message is the API server's own.
    Stalled,
    /// True once the run succeeded; the reason and message are `Succeeded`'s
    /// (kstatus, `kubectl wait --for=condition=Ready`).
    Ready,
    /// True while the run is under way and not stalled (kstatus reads it as
    /// "in progress").
    Reconciling,
}

impl ConditionType {
    /// The word as it appears in status and Events.
    pub const fn as_str(self) -> &'static str {
        match self {
            ConditionType::Succeeded => "Succeeded",
            ConditionType::Progressing => "Progressing",
            ConditionType::AwaitingApproval => "AwaitingApproval",
            ConditionType::BudgetExceeded => "BudgetExceeded",
            ConditionType::Stale => "Stale",
            ConditionType::FailureTarget => "FailureTarget",
            ConditionType::Stalled => "Stalled",
            ConditionType::Ready => "Ready",
            ConditionType::Reconciling => "Reconciling",
        }
    }
}

impl std::fmt::Display for ConditionType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Reasons, shared by conditions and Events.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Reason {
    Running,
    Planning,
    Pending,
    Compensating,
    Suspended,
    Finished,
    NoApprovalPending,
    WaitingForApproval,
    InputStale,
    InputsFresh,

    RunSucceeded,
    RunFailed,
    RunCancelled,
    InvalidSpec,
    InvalidPlan,
    StepFailed,
    Cancelled,
    DeadlineExceeded,
    TokenBudgetExceeded,
    StepExecutionBudgetExceeded,
    /// A re-plan would keep more checkpoints than a run's status may hold (D11).
    StatusBudgetExceeded,
    ApprovalRejected,
    ApprovalExpired,

    StepStarted,
    StepSucceeded,
    StepRetrying,
    StepTimedOut,
    StepDisrupted,
    StepStopped,
    StepOutcomeUnknown,
    /// A step's result was too large to keep inline in status (D11).
    ResultNotKept,
    ApprovalRequested,
    ApprovalGranted,
    ReconcileDecided,
    PlanAdopted,
    Replanned,
    ContextCompacted,
    CompensationStarted,
    CompensationSucceeded,
    CompensationFailed,
    TtlExpired,
    /// A Pod or Approval the run needs was refused by the API server.
    FailedCreate,
    /// A Pod or Approval name the run needs is held by an object not its own.
    NameTaken,
    /// The run does not deserialize; nothing is done for it until it changes.
    Unreadable,
    /// A stall cleared: what was refused now exists.
    Unblocked,
}

impl Reason {
    /// The word as it appears in status and Events.
    pub const fn as_str(self) -> &'static str {
        match self {
            Reason::Running => "Running",
            Reason::Planning => "Planning",
            Reason::Pending => "Pending",
            Reason::Compensating => "Compensating",
            Reason::Suspended => "Suspended",
            Reason::Finished => "Finished",
            Reason::NoApprovalPending => "NoApprovalPending",
            Reason::WaitingForApproval => "WaitingForApproval",
            Reason::InputStale => "InputStale",
            Reason::InputsFresh => "InputsFresh",
            Reason::RunSucceeded => "RunSucceeded",
            Reason::RunFailed => "RunFailed",
            Reason::RunCancelled => "RunCancelled",
            Reason::InvalidSpec => "InvalidSpec",
            Reason::InvalidPlan => "InvalidPlan",
            Reason::StepFailed => "StepFailed",
            Reason::Cancelled => "Cancelled",
            Reason::DeadlineExceeded => "DeadlineExceeded",
            Reason::TokenBudgetExceeded => "TokenBudgetExceeded",
            Reason::StepExecutionBudgetExceeded => "StepExecutionBudgetExceeded",
            Reason::StatusBudgetExceeded => "StatusBudgetExceeded",
            Reason::ApprovalRejected => "ApprovalRejected",
            Reason::ApprovalExpired => "ApprovalExpired",
            Reason::StepStarted => "StepStarted",
            Reason::StepSucceeded => "StepSucceeded",
            Reason::StepRetrying => "StepRetrying",
            Reason::StepTimedOut => "StepTimedOut",
            Reason::StepDisrupted => "StepDisrupted",
            Reason::StepStopped => "StepStopped",
            Reason::StepOutcomeUnknown => "StepOutcomeUnknown",
            Reason::ResultNotKept => "ResultNotKept",
            Reason::ApprovalRequested => "ApprovalRequested",
            Reason::ApprovalGranted => "ApprovalGranted",
            Reason::ReconcileDecided => "ReconcileDecided",
            Reason::PlanAdopted => "PlanAdopted",
            Reason::Replanned => "Replanned",
            Reason::ContextCompacted => "ContextCompacted",
            Reason::CompensationStarted => "CompensationStarted",
            Reason::CompensationSucceeded => "CompensationSucceeded",
            Reason::CompensationFailed => "CompensationFailed",
            Reason::TtlExpired => "TtlExpired",
            Reason::FailedCreate => "FailedCreate",
            Reason::NameTaken => "NameTaken",
            Reason::Unreadable => "Unreadable",
            Reason::Unblocked => "Unblocked",
        }
    }
}

impl std::fmt::Display for Reason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl AsRef<str> for Reason {
    fn as_ref(&self) -> &str {
        self.as_str()
    }
}

impl std::str::FromStr for Reason {
    type Err = ();

    /// Reads back a reason the engine wrote into status.
    fn from_str(s: &str) -> Result<Reason, ()> {
        Ok(match s {
            "Running" => Reason::Running,
            "Planning" => Reason::Planning,
            "Pending" => Reason::Pending,
            "Compensating" => Reason::Compensating,
            "Suspended" => Reason::Suspended,
            "Finished" => Reason::Finished,
            "NoApprovalPending" => Reason::NoApprovalPending,
            "WaitingForApproval" => Reason::WaitingForApproval,
            "InputStale" => Reason::InputStale,
            "InputsFresh" => Reason::InputsFresh,
            "RunSucceeded" => Reason::RunSucceeded,
            "RunFailed" => Reason::RunFailed,
            "RunCancelled" => Reason::RunCancelled,
            "InvalidSpec" => Reason::InvalidSpec,
            "InvalidPlan" => Reason::InvalidPlan,
            "StepFailed" => Reason::StepFailed,
            "Cancelled" => Reason::Cancelled,
            "DeadlineExceeded" => Reason::DeadlineExceeded,
            "TokenBudgetExceeded" => Reason::TokenBudgetExceeded,
            "StepExecutionBudgetExceeded" => Reason::StepExecutionBudgetExceeded,
            "StatusBudgetExceeded" => Reason::StatusBudgetExceeded,
            "ApprovalRejected" => Reason::ApprovalRejected,
            "ApprovalExpired" => Reason::ApprovalExpired,
            "StepStarted" => Reason::StepStarted,
            "StepSucceeded" => Reason::StepSucceeded,
            "StepRetrying" => Reason::StepRetrying,
            "StepTimedOut" => Reason::StepTimedOut,
            "StepDisrupted" => Reason::StepDisrupted,
            "StepStopped" => Reason::StepStopped,
            "StepOutcomeUnknown" => Reason::StepOutcomeUnknown,
            "ResultNotKept" => Reason::ResultNotKept,
            "ApprovalRequested" => Reason::ApprovalRequested,
            "ApprovalGranted" => Reason::ApprovalGranted,
            "ReconcileDecided" => Reason::ReconcileDecided,
            "PlanAdopted" => Reason::PlanAdopted,
            "Replanned" => Reason::Replanned,
            "ContextCompacted" => Reason::ContextCompacted,
            "CompensationStarted" => Reason::CompensationStarted,
            "CompensationSucceeded" => Reason::CompensationSucceeded,
            "CompensationFailed" => Reason::CompensationFailed,
            "TtlExpired" => Reason::TtlExpired,
            "FailedCreate" => Reason::FailedCreate,
            "NameTaken" => Reason::NameTaken,
            "Unreadable" => Reason::Unreadable,
            "Unblocked" => Reason::Unblocked,
            _ => return Err(()),
        })
    }
}

/// What both vocabularies share: compared with and turned into the strings
/// status holds, and serialized as those strings.
macro_rules! words {
    ($($t:ty),*) => {$(
        impl PartialEq<$t> for String {
            fn eq(&self, other: &$t) -> bool {
                self == other.as_str()
            }
        }

        impl PartialEq<$t> for &str {
            fn eq(&self, other: &$t) -> bool {
                *self == other.as_str()
            }
        }

        impl From<$t> for String {
            fn from(v: $t) -> String {
                v.as_str().to_owned()
            }
        }

        impl serde::Serialize for $t {
            fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                s.serialize_str(self.as_str())
            }
        }
    )*};
}

words!(Reason, ConditionType);
