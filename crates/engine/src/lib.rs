//! The durable run engine: for one `AgentRun`, what happens next.
//!
//! The engine owns the durability contract (design.md §2, D1–D13). It is a
//! pure function with no client, no clock and no randomness: given the run as
//! last committed (spec + status), the step Pods and Approvals the cluster
//! shows for it, and `now`, [`decide`] returns the complete desired status and
//! the actions to apply after that status is written.
//!
//! ```text
//!            ┌──────────── Observed ────────────┐
//!            │ AgentRun (spec + committed status)│
//!            │ step Pods (cache, may lag)       │──decide──▶ Decision { status, actions, requeue_after, tally }
//!            │ Approvals, Signals, refusals, now│
//!            └──────────────────────────────────┘
//!   AgentRun ──owns──▶ Pod <run>-<step>-<tag>-r<rev>-a<n>   finalizer agentrun.dev/result (D5)
//!            ──owns──▶ Approval <run>-<step>-<tag>-r<rev>-approve | -reconcile-a<n>   (D10)
//!            ──owns──▶ Signal <run>-<step>-<tag>-r<rev>-signal                        (D10)
//! ```
//!
//! Commit discipline (D4/D5): the controller writes `status` first and applies
//! `actions` only once that write is acknowledged. A decision may record an
//! intent and emit its effect together ("attempt N launched as Pod X" +
//! `CreatePod(X)`); a step's outcome and the launch of the step after it share
//! one write, so the next Pod never exists before the checkpoint it depends
//! on is saved. Finalizers are released only for Pods whose outcome the status
//! being written holds. The stages of one decision are in [`machine`].
//!
//! This crate depends on no client, runtime or store (no kube, kube-runtime,
//! tokio): the engine's purity is a fact the compiler checks.
#![forbid(unsafe_code)]

pub mod answer;
mod approval;
pub mod cel;
mod conditions;
mod context;
pub mod fork;
pub mod journal;
mod machine;
mod names;
mod observe;
mod plan;
mod planner;
mod pods;
pub mod reasons;
mod result;
mod schema;
mod signal;
pub mod trace_ids;
mod when;

#[cfg(test)]
mod proptests;
#[cfg(any(test, feature = "testing"))]
pub mod testing;
#[cfg(test)]
mod tests;

use jiff::{SignedDuration, Timestamp};
use k8s_openapi::api::core::v1::Pod;

use agentrun_api::{
    AgentRun, AgentRunStatus, Approval, ApprovalStatus, Settlement, Signal, SignalStatus,
    StepJournal,
};

pub use approval::not_this_runs as not_this_runs_approval;
pub use names::{
    MAX_CHILD_NAME, PodRole, approve_name, approve_request, idempotency_key, journal_prefix,
    pod_name, reconcile_name, signal_name,
};
pub use observe::{Recorded, held_by, is_live, must_read, not_the_runs, referenced_pods};
pub use reasons::{ConditionType, Reason};
pub use result::MAX_MESSAGE_BYTES;
pub use signal::not_this_runs as not_this_runs_signal;

/// Everything one decision sees.
pub struct Observed<'a> {
    /// Spec and status as last read from the API server: the committed state.
    pub run: &'a AgentRun,
    /// Pods labelled `agentrun.dev/run=<run>`, from a cache that may lag.
    pub pods: &'a [Pod],
    /// Approvals owned by the run.
    pub approvals: &'a [Approval],
    /// Signals owned by the run.
    pub signals: &'a [Signal],
    /// The journal chunks of the run's steps (D19), from a cache that may lag.
    pub journals: &'a [StepJournal],
    /// Creations the API server refused while this reconcile applied the
    /// previous decision: facts no cache shows (D16).
    pub refused: &'a [Refusal],
    /// For a fork (`spec.forkOf`) not yet started: the source run, as the
    /// cache shows it (its UID is checked).
    pub source: Option<&'a AgentRun>,
    /// For a run not yet started: where it waits when the operator's cap on
    /// active runs is reached (`None`: it may start).
    pub queued: Option<Queued>,
    /// What the run history says (D18).
    pub history: History,
    pub now: Timestamp,
    /// What evaluating the author's CEL may spend, and the interrupt the
    /// controller raises at its deadline (D22).
    pub cel: cel::Limits,
}

/// What the run history says of the run (D18), as the controller read it.
#[derive(Clone, Debug, Default, PartialEq)]
pub enum History {
    /// No history is kept: no record is written or looked for, and the TTL
    /// deletes a finished run without one.
    #[default]
    Off,
    /// Kept, and nothing earlier to know: the run has started, or its lookup
    /// ([`needs_lookup`]) found no earlier run of its name and spec.
    On,
    /// A run of this namespace, name and spec already ran within the window.
    AlreadyRan(agentrun_api::AlreadyRan),
    /// The lookup failed (the API server's or the database's message).
    Unavailable(String),
}

impl History {
    pub fn is_on(&self) -> bool {
        !matches!(self, History::Off)
    }
}

/// Whether the controller must look the run up in the history before its
/// next decision: it has not started, and no lookup let it start yet (a run
/// that passed one has its spec digest noted).
pub fn needs_lookup(run: &AgentRun) -> bool {
    let Some(s) = run.status.as_ref() else {
        return true;
    };
    !s.phase.is_some_and(agentrun_api::RunPhase::is_terminal)
        && s.spec_digests.is_empty()
        && s.started_at.is_none()
        && s.plan.is_none()
}

/// Where a run waits for a place under the caps on active runs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Queued {
    /// From 1: the next run of its namespace to start.
    pub position: u32,
    /// Which cap holds it, e.g. `2 of 2 runs active in namespace team-a (maxActiveRunsPerNamespace)`.
    pub why: String,
}

/// A Pod or Approval the API server would not create.
#[derive(Clone, Debug, PartialEq)]
pub struct Refusal {
    /// The name of the object that could not be created.
    pub name: String,
    pub cause: RefusalCause,
    /// The API server's own message.
    pub message: String,
}

/// Why a creation was refused, as far as it decides what happens next.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RefusalCause {
    /// The object itself is unacceptable (400, 403 from an admission plugin
    /// such as Pod Security or a missing PriorityClass, 422): sending it again
    /// cannot help, so it counts as a failed attempt.
    Rejected,
    /// The API server could not take it now (429, 5xx, an exhausted quota,
    /// the operator's own RBAC): tried again with backoff, visibly.
    Transient,
    /// An object that is not this run's holds the name.
    NameTaken,
}

/// What to do next.
#[derive(Clone, Debug, PartialEq)]
pub struct Decision {
    /// The complete desired status; written iff it differs from the input.
    pub status: AgentRunStatus,
    /// Applied only after the status write (if any) succeeded: Pod creations
    /// first, then the rest in order; Events are published in the background.
    /// No action in one decision depends on another's having been applied.
    pub actions: Vec<Action>,
    /// The time until the next deadline (backoff, approval expiry, timeout,
    /// active deadline, TTL). `Some(ZERO)` when the status changed and the run
    /// continues from it: decide again right after the write; and when the
    /// decision creates the Pod of a recorded NonIdempotent attempt whose UID
    /// is not recorded: decide again right after the create, which records it.
    pub requeue_after: Option<SignedDuration>,
    /// What this decision did, counted where it was decided; the metrics
    /// read it once the status write that holds it is acknowledged.
    pub tally: Tally,
}

/// What one decision did to the run's attempts, for the metrics.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Tally {
    /// Attempts launched: steps, planner, compactor and compensations.
    pub started: u64,
    /// Attempts that succeeded, compensations included.
    pub succeeded: u64,
    /// Attempts that failed, counting against their retries.
    pub failed: u64,
    /// Attempts lost to a disruption (D6), or whose outcome is unknown.
    pub disrupted: u64,
    /// Re-plans for stale input (D8).
    pub replans: u64,
    /// Tokens newly recorded (D9).
    pub tokens: u64,
    /// Journaled calls found started and never answered (D19).
    pub calls_unknown: u64,
    /// Journaled calls settled, by the verify probe or a person.
    pub calls_settled: u64,
    /// Steps failed because their journal passed its cap.
    pub journals_over_cap: u64,
}

/// One effect on the cluster.
#[derive(Clone, Debug, PartialEq)]
pub enum Action {
    /// Create if absent: AlreadyExists with our owner UID is success.
    CreatePod(Box<Pod>),
    /// Stop an attempt (timeout, cancel, a superseded attempt still running).
    DeletePod {
        name: String,
        reason: String,
    },
    /// Remove `agentrun.dev/result`: only for Pods whose outcome is already in
    /// the input status (and, once the run is terminal, every Pod of the run).
    ReleaseFinalizer {
        pod: String,
    },
    CreateApproval(Box<Approval>),
    /// Written under the Approval's resourceVersion as observed: a decision
    /// that landed meanwhile makes it fail, and the next decision sees it.
    SetApprovalStatus {
        name: String,
        resource_version: Option<String>,
        status: ApprovalStatus,
    },
    CreateSignal(Box<Signal>),
    /// Written under the Signal's resourceVersion as observed: a signal
    /// sent meanwhile makes it fail, and the next decision sees it.
    SetSignalStatus {
        name: String,
        resource_version: Option<String>,
        status: SignalStatus,
    },
    /// Record how a journaled call that may have acted was settled (D19),
    /// in the status of the chunk that holds it; a settlement already there
    /// is success.
    SettleCall {
        chunk: String,
        settlement: Settlement,
    },
    /// TTL after finishing (D12).
    DeleteRun,
    Event {
        type_: EventType,
        reason: Reason,
        message: String,
    },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EventType {
    Normal,
    Warning,
}

/// Decides what happens next for one run. Pure and total: never panics on
/// any input, and an unchanged world yields the input status unchanged.
/// How often a queued run looks at the caps again when no other run's end
/// wakes it.
pub const QUEUE_RECHECK: SignedDuration = SignedDuration::from_secs(30);

pub use machine::human_duration;

/// The engine's one entry point: what happens next to one run, given what
/// was observed of it (its spec and committed status, its Pods, Approvals and
/// Signals, the refusals of this reconcile, the history) and the time.
///
/// Pure: no client, no clock, no randomness; the same facts give the same
/// decision. It returns the status to write and the actions to take once
/// that write is acknowledged (D4), and the deadlines at which the run must
/// be looked at again. Every promise of docs/contract.md that the engine
/// keeps is kept here, in the fixed order of stages `machine` lays out, and
/// tested in `engine/tests/` first.
pub fn decide(observed: &Observed) -> Decision {
    machine::decide(observed)
}
