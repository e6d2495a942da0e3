//! Condition types and reasons, and Event reasons: the words the engine uses
//! in status and Events, as types, so that a misspelt reason does not
//! compile and dashboards and tests agree with the engine.

/// One vocabulary: an enum whose variants are the words themselves, with
/// `as_str`, `FromStr` (to read back what status holds), `Display`, and
/// comparison with and serialization as those strings.
macro_rules! vocabulary {
    ($(#[$meta:meta])* pub enum $t:ident { $($(#[$vmeta:meta])* $v:ident,)* }) => {
        $(#[$meta])*
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        pub enum $t {
            $($(#[$vmeta])* $v,)*
        }

        impl $t {
            /// The word as it appears in status and Events.
            pub const fn as_str(self) -> &'static str {
                match self {
                    $($t::$v => stringify!($v),)*
                }
            }
        }

        impl std::str::FromStr for $t {
            type Err = ();

            /// Reads back a word the engine wrote into status.
            fn from_str(s: &str) -> Result<$t, ()> {
                match s {
                    $(stringify!($v) => Ok($t::$v),)*
                    _ => Err(()),
                }
            }
        }

        impl std::fmt::Display for $t {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(self.as_str())
            }
        }

        impl AsRef<str> for $t {
            fn as_ref(&self) -> &str {
                self.as_str()
            }
        }

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
    };
}

vocabulary! {
    /// Condition types on `AgentRun.status.conditions`.
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
}

vocabulary! {
    /// Reasons, shared by conditions and Events.
    pub enum Reason {
        Running,
        Planning,
        Pending,
        Compensating,
        Suspended,
        Finished,
        NoApprovalPending,
        WaitingForApproval,
        /// Every step under way is a wait step, until the first wakes.
        Waiting,
        /// The run waits for a place under the caps on active runs.
        Queued,
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
        /// A step's `when` could not be evaluated (the CEL error says why).
        WhenFailed,
        /// A fork's source run is gone (or is another run now).
        ForkSourceGone,
        /// A fork would make a step that acted act again, unasked for.
        ForkRefused,
        /// A fork started, carrying over the source run's checkpoints.
        Forked,

        StepStarted,
        /// A wait step started: it wakes at the time its message names.
        StepWaiting,
        /// A wait step's time came: it succeeded.
        StepWoke,
        /// A wait step's signal was sent: it succeeded with its data.
        SignalReceived,
        /// A wait step's signal did not come in time: its `onTimeout` applies.
        SignalExpired,
        StepSucceeded,
        StepRetrying,
        StepTimedOut,
        StepDisrupted,
        StepStopped,
        StepOutcomeUnknown,
        /// A step's `when` was false: it did not run.
        StepSkipped,
        /// An attempt may have acted: the step's verify probe asks what happened.
        StepVerifying,
        /// The verify probe answered: applied (recorded as succeeded) or not (retried).
        StepVerified,
        /// A journaled call that may have acted was settled (D19): by the
        /// step's verify probe or a person; the next attempt replays past it.
        CallSettled,
        /// A step's journal grew past its `journal.maxBytes` (D19): the step fails.
        JournalOverCap,
        /// A step was disrupted again and again (D16); it resumes after its backoff.
        RepeatedlyDisrupted,
        /// A deleted step Pod still runs past its grace period (D16).
        PodNotStopping,
        /// A step's result was too large to keep inline in status (D11).
        ResultNotKept,
        /// A step's result did not match its `resultSchema`: not committed.
        ResultInvalid,
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
        /// A Pod, Approval or Signal the run needs was refused by the API server.
        FailedCreate,
        /// A Pod, Approval or Signal name the run needs is held by an object not its own.
        NameTaken,
        /// The run does not deserialize; nothing is done for it until it changes.
        Unreadable,
        /// A stall cleared: what was refused now exists.
        Unblocked,
        /// A run of this name and spec already ran within the retention
        /// window: nothing of this one runs (D18).
        AlreadyRan,
        /// The run history cannot be read: a run not started waits, since it
        /// may be one that already ran (D18).
        HistoryUnavailable,
        /// A finished run's record could not be stored; its TTL waits (D18).
        RecordFailed,
    }
}
