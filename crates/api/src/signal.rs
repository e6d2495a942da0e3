//! The `Signal` resource: an event from outside the cluster that a run waits
//! on durably (a payment settled, a document uploaded, a CI job finished).
//!
//! The operator creates it (owned by the run) when a `wait: {signal: …}` step
//! starts, with the step's `senders` and `separateFromRequester`; a sender
//! with RBAC `patch signals` whom those admit (the chart's admission
//! policies check it) sets `spec.id` and `spec.data` (with `kubectl agentrun
//! signal`, a CI job or any client of the API server); the step succeeds
//! with `data` as its result and the run goes on. A signal is received once:
//! `id` and `data` are final once set, so a repeat with the same id and data
//! changes nothing and a different one is refused.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::{CustomResource, KubeSchema};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::Senders;

/// An event from outside that an AgentRun waits on.
#[allow(clippy::duplicated_attributes)]
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[kube(
    group = "agentrun.dev",
    version = "v1alpha1",
    kind = "Signal",
    plural = "signals",
    singular = "signal",
    shortname = "sig",
    category = "agentrun-all",
    namespaced,
    status = "SignalStatus",
    derive = "PartialEq",
    doc = "An event from outside the cluster that an AgentRun waits on: the operator opens it when a wait step with a signal starts; a sender sets spec.id and spec.data once, and the step succeeds with data as its result. Who may send is decided by RBAC on this object and its spec.senders; the API server records who sent it.",
    printcolumn(name = "Run", type_ = "string", json_path = ".spec.runName", description = "The AgentRun waiting on the signal"),
    printcolumn(name = "Step", type_ = "string", json_path = ".spec.step", description = "The wait step the signal ends"),
    printcolumn(name = "Phase", type_ = "string", json_path = ".status.phase", description = "Waiting, Received, Expired or Superseded"),
    printcolumn(name = "ID", type_ = "string", json_path = ".spec.id", description = "The sender's id of the event"),
    printcolumn(name = "Sent-By", type_ = "string", json_path = ".spec.sentBy", description = "Who sent it, as the API server recorded it"),
    printcolumn(name = "Expires", type_ = "string", json_path = ".spec.expiresAt", description = "When onTimeout applies if nothing is sent"),
    printcolumn(name = "Age", type_ = "date", json_path = ".metadata.creationTimestamp", description = "Time since the run began to wait"),
    validation = Rule::new("!has(self.spec.id) || has(oldSelf.spec.id) || !has(oldSelf.status) || !has(oldSelf.status.phase) || oldSelf.status.phase == 'Waiting'").message(kube::core::Message::Expression("'spec.id: signal ' + self.metadata.name + ' is ' + oldSelf.status.phase + (has(oldSelf.status.message) ? ' (' + oldSelf.status.message + ')' : '') + ' and takes no signal'".into())).field_path(".spec.id").reason(Reason::FieldValueForbidden),
)]
#[x_kube(
    validation = Rule::new("!has(oldSelf.id) || (has(self.id) && self.id == oldSelf.id)").message(kube::core::Message::Expression("'spec.id: this signal was already received with id ' + oldSelf.id + '; a signal is received once (a repeat with the same id and data changes nothing)'".into())).field_path(".id").reason(Reason::FieldValueForbidden),
    validation = Rule::new("!has(oldSelf.id) || (has(self.data) == has(oldSelf.data) && (!has(self.data) || self.data == oldSelf.data))").message(kube::core::Message::Expression("'spec.data: signal ' + oldSelf.id + ' was already received with other data; a repeat with the same id must carry the same data'".into())).field_path(".data").reason(Reason::FieldValueForbidden),
    validation = Rule::new("!has(self.data) || has(self.id)").message("spec.data is sent with spec.id, the sender's id of the event").field_path(".id").reason(Reason::FieldValueRequired),
    validation = Rule::new("has(self.expiresAt) == has(oldSelf.expiresAt) && (!has(self.expiresAt) || self.expiresAt == oldSelf.expiresAt)").message("spec.expiresAt is immutable: the deadline was set when the run began to wait").field_path(".expiresAt").reason(Reason::FieldValueForbidden),
    validation = Rule::new("has(self.description) == has(oldSelf.description) && (!has(self.description) || self.description == oldSelf.description)").message("spec.description is immutable").field_path(".description").reason(Reason::FieldValueForbidden),
    validation = Rule::new("has(self.requestedBy) == has(oldSelf.requestedBy) && (!has(self.requestedBy) || self.requestedBy == oldSelf.requestedBy)").message("spec.requestedBy is immutable").field_path(".requestedBy").reason(Reason::FieldValueForbidden),
    // On the parent, not the fields: a rule on an optional field does not
    // run when a patch removes it, and removing either would let anyone send.
    validation = Rule::new("has(self.senders) == has(oldSelf.senders) && (!has(self.senders) || self.senders == oldSelf.senders)").message("spec.senders is immutable: who may send was set when the run began to wait").field_path(".senders").reason(Reason::FieldValueForbidden),
    validation = Rule::new("has(self.separateFromRequester) == has(oldSelf.separateFromRequester) && (!has(self.separateFromRequester) || self.separateFromRequester == oldSelf.separateFromRequester)").message("spec.separateFromRequester is immutable: separation of duties was set when the run began to wait and cannot be changed or removed").field_path(".separateFromRequester").reason(Reason::FieldValueForbidden),
    validation = Rule::new("!has(oldSelf.sentBy) || (has(self.sentBy) && self.sentBy == oldSelf.sentBy)").message("spec.sentBy: who sent the signal is final once recorded").field_path(".sentBy").reason(Reason::FieldValueForbidden),
    validation = Rule::new("!has(self.sentBy) || has(self.id)").message("spec.sentBy is recorded with spec.id, not alone").field_path(".sentBy").reason(Reason::FieldValueForbidden)
)]
#[serde(rename_all = "camelCase")]
pub struct SignalSpec {
    /// The AgentRun waiting on this signal. Immutable.
    #[schemars(
        length(min = 1, max = 63),
        regex(pattern = r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")
    )]
    #[x_kube(validation = Rule::new("self == oldSelf").message("spec.runName is immutable"))]
    pub run_name: String,
    /// The UID of that AgentRun, so a signal never reaches a newer run of the same name. Immutable.
    #[schemars(length(min = 1, max = 64))]
    #[x_kube(validation = Rule::new("self == oldSelf").message("spec.runUid is immutable"))]
    pub run_uid: String,
    /// The wait step the signal ends. Immutable.
    #[schemars(
        length(min = 1, max = 48),
        regex(pattern = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
    )]
    #[x_kube(validation = Rule::new("self == oldSelf").message("spec.step is immutable"))]
    pub step: String,
    /// The plan revision of that step. Immutable.
    #[schemars(range(min = 1))]
    #[x_kube(validation = Rule::new("self == oldSelf").message("spec.planRevision is immutable"))]
    pub plan_revision: i64,
    /// What the run waits for, from the step's `wait.signal.description`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 256))]
    pub description: Option<String>,
    /// When the wait ends without a signal; then `onTimeout` applies. Unset:
    /// never.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expires_at: Option<Time>,
    /// What the step does when nothing is sent in time. Immutable.
    #[serde(default)]
    #[x_kube(validation = Rule::new("self == oldSelf").message("spec.onTimeout is immutable"))]
    pub on_timeout: SignalTimeout,
    /// Who may send, copied from the step's `wait.signal.senders`. Unset:
    /// anyone whom RBAC lets patch this Signal. Immutable.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub senders: Option<Senders>,
    /// Whether the run's creator (`requestedBy`) is refused as a sender. Immutable.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub separate_from_requester: bool,
    /// Who created the run, as the API server recorded it. Immutable.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 253))]
    pub requested_by: Option<String>,
    /// Set by the sender: its own id of the event (a payment id, a CI run
    /// id). Final once set: a repeat with the same id and data changes
    /// nothing; another id is refused.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(
        length(min = 1, max = 253),
        regex(pattern = r"^[A-Za-z0-9]([-A-Za-z0-9_.:/]*[A-Za-z0-9])?$")
    )]
    pub id: Option<String>,
    /// Set by the sender with `id`: a JSON object that becomes the step's
    /// result for the steps after it. Final once set.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "super::json_schema_object")]
    pub data: Option<serde_json::Value>,
    /// The user who set `id`, from the API server's record of the request
    /// (stamped by the chart's mutating policy, or filled by the client and
    /// checked by its validating policy). Final once set.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 253))]
    pub sent_by: Option<String>,
}

/// What a wait step does when its signal does not come in time.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum SignalTimeout {
    /// The step fails: the run fails and compensates.
    #[default]
    Fail,
    /// The step is skipped, as a step whose `when` is false: the steps after
    /// it go on and see `steps['<step>'].phase == 'Skipped'`.
    Skip,
}

/// What became of the wait.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct SignalStatus {
    #[serde(default)]
    pub phase: SignalPhase,
    /// When the operator recorded the signal, the expiry or the supersession.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub recorded_at: Option<Time>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
}

/// The lifecycle of a Signal.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum SignalPhase {
    /// The run waits for it.
    #[default]
    Waiting,
    /// It was sent in time and its step succeeded with its data.
    Received,
    /// Its deadline passed first; the API server refuses a signal now.
    Expired,
    /// The run no longer waits on it (it failed, was cancelled or re-planned).
    Superseded,
}
