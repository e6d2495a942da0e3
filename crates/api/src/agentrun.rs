//! The `AgentRun` resource: a plan of steps, each run as one Pod (or a wait),
//! with every step's checkpoint kept in the status subresource (its types
//! are in `run_status`).

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{
    EnvFromSource, EnvVar, LocalObjectReference, ResourceRequirements, Toleration,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::{CustomResource, KubeSchema};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::{AgentRunStatus, Approvers, Duration, JournalSpec, Senders};

/// Longest step name. Pod names (`<run>-<step>-r<rev>-a<attempt>`, `-c` for
/// compensation) and label values must stay within Kubernetes' limits.
pub const MAX_STEP_NAME: usize = 48;
/// Longest AgentRun name: the run name is a label value on every step Pod.
pub const MAX_RUN_NAME: usize = 63;
/// Most steps one plan may have.
pub const MAX_STEPS: usize = 500;
/// The refusal of a plan whose step names repeat (`spec.steps`). A CEL
/// messageExpression cannot name the repeated name: any comprehension in one
/// is estimated far beyond the budget.
pub const STEP_NAMES_UNIQUE: &str = "step names must be unique: a step is known by its name (dependsOn, when, its Pods and its idempotency key refer to it)";
/// Default and ceiling of `context.maxBytes`: the context travels in a Pod annotation.
pub const DEFAULT_CONTEXT_BYTES: i32 = 32 * 1024;
pub const MAX_CONTEXT_BYTES: i32 = 128 * 1024;
/// Default of `spec.parallelism`: step Pods one run may have in flight.
pub const DEFAULT_PARALLELISM: i32 = 10;
/// Most names one step may depend on.
pub const MAX_DEPENDS_ON: usize = 32;
/// The largest `resultSchema` a step may declare, as compact JSON.
pub const MAX_RESULT_SCHEMA_BYTES: usize = 8 * 1024;
/// The most data a Signal may carry into a run (as compact JSON): a signal
/// over it fails its step before any schema is applied to it (D22).
pub const MAX_SIGNAL_DATA_BYTES: usize = 64 * 1024;
/// Default of `budget.replans`: re-plans for stale input before the run stops.
pub const DEFAULT_REPLANS: i32 = 10;

/// A durable AI-agent run: an ordered plan of steps, each executed as one Pod,
/// whose results are checkpointed in status before the next step starts.
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[kube(
    group = "agentrun.dev",
    version = "v1alpha1",
    kind = "AgentRun",
    plural = "agentruns",
    singular = "agentrun",
    shortname = "ar",
    category = "agentrun-all",
    namespaced,
    status = "AgentRunStatus",
    derive = "PartialEq",
    derive = "Default",
    doc = "A durable AI-agent run: a plan of steps, each run as one Pod, whose results are checkpointed in status before the next step starts, so a run survives operator crashes, evictions and long waits for a person without repeating a committed step.",
    printcolumn(name = "Phase", type_ = "string", json_path = ".status.phase", description = "Pending, Queued, Planning, Running, WaitingForApproval, Waiting, Compensating, Succeeded, Failed or Cancelled"),
    printcolumn(name = "Reason", type_ = "string", json_path = ".status.conditions[?(@.type==\"Succeeded\")].reason", description = "Why the run is in its phase: the reason of its Succeeded condition"),
    printcolumn(name = "Step", type_ = "string", json_path = ".status.currentStep", description = "The step running or waiting now"),
    printcolumn(name = "Progress", type_ = "string", json_path = ".status.progress", description = "Steps succeeded out of the plan's steps"),
    printcolumn(name = "Tokens", type_ = "integer", json_path = ".status.tokensUsed", description = "Tokens reported by every attempt, failed ones included"),
    printcolumn(name = "Duration", type_ = "string", json_path = ".status.duration", description = "From the run's start to its end, once it has finished"),
    printcolumn(name = "Age", type_ = "date", json_path = ".metadata.creationTimestamp", description = "Time since the run was created"),
    validation = Rule::new("size(self.metadata.name) <= 63").message("metadata.name: an AgentRun name must be at most 63 characters, because it is a label value on every step Pod"),
)]
#[x_kube(
    validation = Rule::new("(has(self.steps) && size(self.steps) > 0) || has(self.planner)").message("spec.steps: at least one step is required unless spec.planner is set").reason(Reason::FieldValueRequired),
    validation = Rule::new("!has(self.planner) || !has(self.planner.wait)").message("spec.planner.wait: a planner runs a container; it cannot wait").field_path(".planner").reason(Reason::FieldValueForbidden),
    // On the spec, not the field: a rule on an optional field does not run
    // when an update adds or removes it.
    validation = Rule::new("has(self.forkOf) == has(oldSelf.forkOf) && (!has(self.forkOf) || self.forkOf == oldSelf.forkOf)").message("spec.forkOf is immutable: a fork starts from one source, and a run is a fork from its creation or never").field_path(".forkOf").reason(Reason::FieldValueForbidden),
    validation = Rule::new("has(self.template) == has(oldSelf.template) && (!has(self.template) || self.template == oldSelf.template)").message("spec.template is immutable: it records what the run was created from").field_path(".template").reason(Reason::FieldValueForbidden)
)]
#[serde(rename_all = "camelCase")]
pub struct AgentRunSpec {
    /// The steps of the plan, one Pod each. Step names are unique. Without
    /// `dependsOn` anywhere they run in order, each after the one before it;
    /// once any step names `dependsOn`, they form a graph: a step starts when
    /// the steps it depends on have committed, and a step without `dependsOn`
    /// starts at once. When a planner is set, these are its catalog: the only
    /// steps it may propose, with its own arguments and order (D17).
    // An atomic list: the plan has one owner under server-side apply, and the
    // field manager tracks it as one field rather than per step, which every
    // status write pays for (docs/api.md, "List semantics"). Uniqueness, which
    // a list-map keyed by name checked, is the rule below: `distinct()` is
    // native (Kubernetes 1.34+), estimated at about 2·n² (≈ 0.5M of the 10M a
    // rule may cost at 500 steps) and within the 1M a rule may spend at run
    // time, where an `all(… exists_one …)` is not.
    #[serde(default)]
    #[schemars(length(max = 500))]
    #[x_kube(
        merge_strategy = ListMerge::Atomic,
        validation = Rule::new("size(self.map(s, s.name).distinct()) == size(self)").message(STEP_NAMES_UNIQUE).reason(Reason::FieldValueInvalid)
    )]
    pub steps: Vec<StepSpec>,

    // Every run is cached (and copied while reconciled): the parts most runs
    // leave out (planner, context, podTemplate, forkOf) are boxed, so an
    // absent one costs a pointer, not its room. The JSON and schema are the same.
    /// A step that runs first and whose result (`plan` in its termination
    /// message) becomes the plan, as plan revision 2.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub planner: Option<Box<StepSpec>>,

    /// Limits across the whole run, counting every attempt.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub budget: Option<Budget>,

    /// Most step Pods (steps and compactors) the run has in flight at once
    /// when its steps form a graph (`dependsOn`); default 10.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 100))]
    pub parallelism: Option<i32>,

    /// How much prior context each step receives, and how it is compacted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub context: Option<Box<ContextSpec>>,

    /// Defaults applied to every step Pod.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod_template: Option<Box<PodDefaults>>,

    /// When true, no new step Pod is started; a running step finishes and is checkpointed.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub suspend: bool,

    /// When true, the run stops: running steps are stopped, the compensations of
    /// applied steps run in reverse order, and the run ends Cancelled.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub cancel: bool,

    /// This run is a fork of another: it starts from `fromStep`, carrying
    /// over the source run's checkpoints of the steps not after it (still
    /// fresh ones only) instead of running them again. Written by
    /// `kubectl agentrun retry`; immutable.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fork_of: Option<Box<ForkSource>>,

    /// The template this run was created from, its generation then, and the
    /// parameters it was given (D21). Written by whoever created the run
    /// (`kubectl agentrun submit`, a schedule); immutable.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub template: Option<Box<super::TemplateRef>>,

    /// Wall-clock limit for the whole run, counted from its start.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub active_deadline_seconds: Option<i64>,

    /// Delete the run (and, through owner references, its Pods and Approvals)
    /// this many seconds after it finished.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0))]
    pub ttl_seconds_after_finished: Option<i32>,
}

// Every cached run keeps its plan, so the parts most steps leave out (retry,
// approval, compensation, verify, resultSchema, wait, a container's
// resources) are boxed: an absent one costs a pointer, not its room (a
// `StepSpec` is 336 bytes inline). The JSON and the schema are the same
// either way.
/// One step of a plan: a container run once per attempt, or a wait.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
#[x_kube(
    validation = Rule::new("has(self.container) != has(self.wait)").message("a step has a container or a wait, exactly one of them").reason(Reason::FieldValueRequired),
    validation = Rule::new("!has(self.wait) || !(has(self.retry) || has(self.timeout) || has(self.approval) || has(self.compensate) || has(self.verify) || has(self.freshFor) || (has(self.resultSchema) && !has(self.wait.signal)))").message("a wait step runs no container: retry, timeout, approval, compensate, verify and freshFor do not apply to it, and resultSchema only to a wait for a signal").reason(Reason::FieldValueForbidden)
)]
pub struct StepSpec {
    /// Unique within the plan; a DNS label of at most 48 characters.
    #[schemars(
        length(min = 1, max = 48),
        regex(pattern = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
    )]
    pub name: String,

    /// The steps this one starts after: each must have committed its
    /// checkpoint (succeeded, or been skipped) first, and the step's context
    /// holds their results. A plan in which no step sets `dependsOn` is a
    /// sequence (each step after the one before it); once one step sets it,
    /// a step without it starts at once.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(
        length(max = 32),
        inner(length(min = 1, max = 48)),
        extend("x-kubernetes-list-type" = "set")
    )]
    pub depends_on: Option<Box<[String]>>,

    /// A CEL expression over the results of the steps this one depends on
    /// (`steps.<name>.result`, or `steps['a-name'].result` for names with a
    /// dash): when it is false the step is `Skipped` and the steps after it
    /// go on without its result. An expression that fails to evaluate fails
    /// the step with the CEL error. Its cost is bounded (D22): at most three
    /// comprehensions, and an evaluation that spends its budget fails the
    /// step (docs/api.md, "Conditional steps").
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 1024))]
    #[x_kube(
        validation = Rule::new(r#"self.matches("^(?:[^'\"{]|'(?:\\\\.|[^'\\\\])*'|\"(?:\\\\.|[^\"\\\\])*\"|(?:^|[^A-Za-z0-9_.\\s])\\s*\\{)*$")"#).message("when: builds a message (Name{…}), which CEL over JSON results does not support: read the results as maps and lists"),
        validation = Rule::new(r#"size(self.findAll('[.](all|exists|exists_one|map|filter)\\s*[(]')) <= 3"#).message("when: at most 3 comprehensions (all, exists, exists_one, map, filter) in one expression: each multiplies the cost of what it contains, and an expression past its cost budget fails the step")
    )]
    pub when: Option<Box<str>>,

    /// The container that performs the step (every step but a wait).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub container: Option<StepContainer>,

    /// A step that waits, with no Pod: for a duration from when it starts,
    /// or until a time. The time it wakes is recorded in status when it
    /// starts, so a restart or an edit never moves it; it counts against no
    /// budget, and cancelling the run ends it at once.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub wait: Option<Box<WaitSpec>>,

    /// What the step does to the outside world. `None`: nothing; `Idempotent`:
    /// safe to repeat with the same idempotency key; `NonIdempotent` (default):
    /// may not be repeated blindly, so a disruption after it started asks a person.
    #[serde(default)]
    pub effect: Effect,

    /// How long the step's result stays true. A later step never starts on a
    /// result older than this: the run re-plans from the stale step.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = Rule::new(concat!("!self.matches(r'", crate::duration_pattern!(), "') || duration(self) > duration('0s')")).message("freshFor must be longer than 0s"))]
    pub fresh_for: Option<Duration>,

    /// A JSON Schema (draft 2020-12 unless `$schema` names another) the
    /// step's result must match. A result that does not is not committed:
    /// the attempt fails with the first mismatches in its message and follows
    /// the retry policy, and the effect it reported is recorded all the same.
    /// At most 8 KiB as JSON; references resolve only within the schema.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "super::json_schema_object")]
    pub result_schema: Option<Box<serde_json::Value>>,

    /// Longest time one attempt may run before it is stopped and counted as failed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = Rule::new(concat!("!self.matches(r'", crate::duration_pattern!(), "') || duration(self) > duration('0s')")).message("timeout must be longer than 0s"))]
    pub timeout: Option<Duration>,

    /// Retries after a failed attempt (exit code or timeout). Disruptions do not count.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retry: Option<Box<RetryPolicy>>,

    /// A human decision required before the step starts.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub approval: Option<Box<ApprovalGate>>,

    /// The container that undoes this step's effect, run (in reverse step order)
    /// when the run is cancelled or fails after this step applied its effect.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub compensate: Option<Box<StepContainer>>,

    /// A container that asks the system this step changes whether an attempt
    /// acted, when the operator cannot know (the attempt ended without saying
    /// it did not act). It runs with the step's `AGENTRUN_IDEMPOTENCY_KEY` and
    /// answers `{"effect": "Applied" | "NotApplied" | "Unknown", "result": …}`:
    /// Applied records the step as done with that result; NotApplied lets the
    /// step retry within its retry policy; anything else, or a probe that
    /// fails, asks a person (a Reconcile Approval that shows what it saw).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub verify: Option<Box<StepContainer>>,

    /// The step's agent loop journals its model and tool calls (D19): the
    /// step Pod gets a token that may write its own step's `StepJournal`,
    /// and a new attempt replays what an earlier one recorded. A lost
    /// attempt of a NonIdempotent step is then judged by its journal: with
    /// every NonIdempotent call answered it runs again (with the same key,
    /// replaying), and only a call that started and never answered is
    /// asked about, of its verify probe or a person. The step's tokens are
    /// its journal's, each model call counted once.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub journal: Option<Box<JournalSpec>>,
}

/// What a wait step waits for: exactly one of `for`, `until` and `signal`.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
#[x_kube(
    validation = Rule::new("(has(self.for) ? 1 : 0) + (has(self.until) ? 1 : 0) + (has(self.signal) ? 1 : 0) == 1").message("wait: set exactly one of for, until and signal").reason(Reason::FieldValueRequired)
)]
pub struct WaitSpec {
    /// How long, counted from when the step starts (its `startedAt`), e.g.
    /// `10m`, `72h`.
    #[serde(rename = "for", default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = Rule::new(concat!("!self.matches(r'", crate::duration_pattern!(), "') || duration(self) > duration('0s')")).message("wait.for must be longer than 0s"))]
    pub for_: Option<Duration>,
    /// Until when (RFC 3339, e.g. `2026-12-24T09:00:00Z`). A time already
    /// past ends the wait as soon as it starts.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub until: Option<Time>,
    /// Until an event from outside arrives: the operator opens a `Signal`
    /// named after the run and step, a sender sets its `id` and `data`, and
    /// the step succeeds with `data` as its result.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub signal: Option<SignalWait>,
}

/// A wait for an event from outside (a `Signal`).
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct SignalWait {
    /// What the run waits for, shown to whoever sends it, e.g. `payment
    /// settled`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 256))]
    pub description: Option<String>,
    /// How long to wait, counted from when the step starts; unset waits
    /// indefinitely.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = Rule::new(concat!("!self.matches(r'", crate::duration_pattern!(), "') || duration(self) > duration('0s')")).message("wait.signal.timeout must be longer than 0s"))]
    pub timeout: Option<Duration>,
    /// What the step does when nothing is sent in time: `Fail` (the run
    /// fails and compensates) or `Skip` (the steps after it go on).
    #[serde(default)]
    pub on_timeout: crate::SignalTimeout,
    /// Who may send the signal. Unset: anyone whom RBAC lets patch the
    /// Signal. The admission policies the chart installs refuse a signal
    /// from anyone else (D15).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub senders: Option<Senders>,
    /// The person (or ServiceAccount) who created the run may not send its
    /// signal.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub separate_from_requester: bool,
}

/// The container of a step. The step Pod gets exactly one container built from it.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct StepContainer {
    /// Container image.
    #[schemars(length(min = 1))]
    pub image: String,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub command: Vec<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub args: Vec<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub env: Vec<EnvVar>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub env_from: Vec<EnvFromSource>,
    /// Overrides `podTemplate.resources` for this step.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resources: Option<Box<ResourceRequirements>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub working_dir: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("enum" = ["Always", "IfNotPresent", "Never"]))]
    pub image_pull_policy: Option<String>,
}

/// What a step does to the world outside the cluster.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Effect {
    /// Reads only; always safe to run again.
    None,
    /// Changes the world, but the same idempotency key makes a repeat harmless.
    Idempotent,
    /// Changes the world and a repeat may double the change.
    #[default]
    NonIdempotent,
}

/// Retries of a step after failed attempts.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct RetryPolicy {
    /// Attempts after the first that may fail before the step fails (0–100).
    #[serde(default)]
    #[schemars(range(min = 0, max = 100))]
    pub limit: i32,
    /// Delay between attempts: starts at `initial`, doubles, capped at `max`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub backoff: Option<Backoff>,
}

/// Exponential backoff between attempts.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
#[x_kube(
    validation = Rule::new(concat!("!self.initial.matches(r'", crate::duration_pattern!(), "') || !self.max.matches(r'", crate::duration_pattern!(), "') || duration(self.initial) <= duration(self.max)")).message("backoff.initial must not be longer than backoff.max").reason(Reason::FieldValueInvalid)
)]
pub struct Backoff {
    /// First delay (default 10s).
    #[serde(default = "Backoff::default_initial")]
    pub initial: Duration,
    /// Longest delay (default 5m).
    #[serde(default = "Backoff::default_max")]
    pub max: Duration,
}

impl Backoff {
    fn default_initial() -> Duration {
        Duration::from("10s")
    }
    fn default_max() -> Duration {
        Duration::from("5m")
    }
}

impl Default for Backoff {
    fn default() -> Self {
        Backoff {
            initial: Self::default_initial(),
            max: Self::default_max(),
        }
    }
}

/// A human approval required before a step starts.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
#[x_kube(
    validation = Rule::new("!has(self.quorum) || !has(self.approvers) || size(self.approvers.groups) > 0 || self.quorum <= size(self.approvers.users) + size(self.approvers.serviceAccounts)").message("approval.quorum: more distinct approvers are needed than the users and serviceAccounts listed, and no group is listed").field_path(".quorum").reason(Reason::FieldValueInvalid),
    validation = Rule::new(concat!("!has(self.escalate) || !has(self.timeout) || !self.timeout.matches(r'", crate::duration_pattern!(), "') || !self.escalate.after.matches(r'", crate::duration_pattern!(), "') || duration(self.escalate.after) < duration(self.timeout)")).message("approval.escalate.after must be shorter than approval.timeout: the reminder goes out while the approval still waits").field_path(".escalate.after").reason(Reason::FieldValueInvalid)
)]
pub struct ApprovalGate {
    /// Whether the approval is required (default true when the block is present).
    #[serde(default = "default_true")]
    pub required: bool,
    /// The question put to the person deciding.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 1024))]
    pub question: Option<String>,
    /// How long to wait for a decision; unset waits indefinitely.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = Rule::new(concat!("!self.matches(r'", crate::duration_pattern!(), "') || duration(self) > duration('0s')")).message("approval.timeout must be longer than 0s"))]
    pub timeout: Option<Duration>,
    /// What an expired approval means.
    #[serde(default)]
    pub on_timeout: OnTimeout,
    /// Who may decide. Unset: anyone whom RBAC lets patch the Approval. The
    /// admission policies the chart installs refuse a decision from anyone
    /// else (D15).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub approvers: Option<Approvers>,
    /// How many distinct approvers must approve (default 1). With more than
    /// one, each casts a vote (`spec.votes` of the Approval); one rejection
    /// rejects.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 16))]
    pub quorum: Option<i32>,
    /// The person (or ServiceAccount) who created the run may not approve it.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub separate_from_requester: bool,
    /// Channels to tell when the approval is asked, decided or expires, by
    /// name, besides the operator's default channels. The channels (where
    /// they point, how messages are signed) are configured by the platform
    /// team in the operator's channel Secret; a name it does not know is
    /// reported on the Approval (`Notified=False`) and in an Event.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(
        length(max = 8),
        inner(
            length(min = 1, max = 63),
            regex(pattern = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
        )
    )]
    pub notify: Vec<String>,
    /// A reminder to other channels when nobody decided within `after`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub escalate: Option<crate::Escalation>,
}

fn default_true() -> bool {
    true
}

/// The decision taken when an approval expires.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum OnTimeout {
    /// Treat expiry as a rejection: the run fails and compensates.
    #[default]
    Reject,
    /// Treat expiry as consent: the step runs.
    Approve,
}

/// The run a fork starts from, and where.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct ForkSource {
    /// The source run, in this namespace.
    #[schemars(length(min = 1, max = 63))]
    pub run_name: String,
    /// Its UID: a run deleted and created again under the name is not it.
    #[schemars(length(min = 1, max = 64))]
    pub run_uid: String,
    /// The step this run starts from: it and every step after it run here.
    #[schemars(length(min = 1, max = 48))]
    pub from_step: String,
    /// Run `fromStep` again even though it acted in the source run. It then
    /// acts a second time, so it waits for an Approval that says so.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub rerun_acted: bool,
}

/// Limits on what the whole run may spend.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct Budget {
    /// Total tokens (input + output) reported by all attempts of all steps.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub tokens: Option<i64>,
    /// Total step Pods the run may create, retries and re-plans included.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub step_executions: Option<i32>,
    /// Re-plans for stale input (D8) before the run stops with reason
    /// `InputStale` (default 10): no freshness setting can make a run loop.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0, max = 100))]
    pub replans: Option<i32>,
}

/// The context materialised into each step's input.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct ContextSpec {
    /// Largest context a step receives, in bytes (default 32768, at most 131072).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1024, max = 131072))]
    pub max_bytes: Option<i32>,
    /// A container that turns prior results into a summary when the context
    /// would exceed `maxBytes`. Without one, the oldest results are dropped from
    /// the context (they stay in status).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub compactor: Option<StepContainer>,
}

/// Defaults for every step Pod of the run.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct PodDefaults {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub service_account_name: Option<String>,
    /// Mount the service account token (default false: steps get no API credentials).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub automount_service_account_token: Option<bool>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub node_selector: BTreeMap<String, String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tolerations: Vec<Toleration>,
    /// Resources for step containers that do not set their own.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resources: Option<ResourceRequirements>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub image_pull_secrets: Vec<LocalObjectReference>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub priority_class_name: Option<String>,
    /// Extra labels for step Pods (the `agentrun.dev/` labels cannot be overridden).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    #[x_kube(validation = Rule::new("self.all(k, !k.startsWith('agentrun.dev/'))").message("podTemplate.labels: agentrun.dev/ labels are set by the operator"))]
    pub labels: BTreeMap<String, String>,
    /// Extra annotations for step Pods.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub annotations: BTreeMap<String, String>,
}
