//! The `Approval` resource: a human decision a run waits on durably.
//!
//! The operator creates it (owned by the run) with the run's identity and the
//! context a person needs; a person sets `spec.decision` (with kubectl, a UI
//! or GitOps); the operator records the outcome in `status` and the run goes on.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::{CustomResource, KubeSchema};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::{Approvers, Delivery, Effect, Escalation, OnTimeout};

/// A decision a person owes an AgentRun.
// The printer columns repeat `type_ = "string"`, which clippy takes for a
// duplicated attribute.
#[allow(clippy::duplicated_attributes)]
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[kube(
    group = "agentrun.dev",
    version = "v1alpha1",
    kind = "Approval",
    plural = "approvals",
    singular = "approval",
    shortname = "apv",
    category = "agentrun-all",
    namespaced,
    status = "ApprovalStatus",
    derive = "PartialEq",
    doc = "A decision a person owes an AgentRun: may a gated step run (Approve), or what did an interrupted NonIdempotent step do (Reconcile). People set spec.decision or add spec.votes; the API server records who decided.",
    printcolumn(name = "Run", type_ = "string", json_path = ".spec.runName", description = "The AgentRun waiting on the decision"),
    printcolumn(name = "Step", type_ = "string", json_path = ".spec.step", description = "The step the decision is about"),
    printcolumn(name = "Kind", type_ = "string", json_path = ".spec.kind", description = "Approve (may the step run?) or Reconcile (what did an interrupted step do?)"),
    printcolumn(name = "Phase", type_ = "string", json_path = ".status.phase", description = "Pending, Approved, Rejected, Expired, Resolved or Superseded"),
    printcolumn(name = "Decision", type_ = "string", json_path = ".spec.decision", description = "The decision a person set"),
    printcolumn(name = "Expires", type_ = "string", json_path = ".spec.expiresAt", description = "When onTimeout applies if nobody decides"),
    printcolumn(name = "Votes", type_ = "string", json_path = ".status.votes", description = "Approving votes against the quorum"),
    printcolumn(name = "Decided-By", type_ = "string", json_path = ".status.decidedBy", description = "Who decided, as the API server recorded it"),
    printcolumn(name = "Age", type_ = "date", json_path = ".metadata.creationTimestamp", description = "Time since the approval was asked"),
    validation = Rule::new("!has(self.spec.decision) || has(oldSelf.spec.decision) || !has(oldSelf.status) || !has(oldSelf.status.phase) || oldSelf.status.phase == 'Pending'").message(kube::core::Message::Expression("'spec.decision: approval ' + self.metadata.name + ' is ' + oldSelf.status.phase + (has(oldSelf.status.message) ? ' (' + oldSelf.status.message + ')' : '') + ' and can no longer be decided'".into())),
    validation = Rule::new("size(self.spec.votes) == size(oldSelf.spec.votes) || !has(oldSelf.status) || !has(oldSelf.status.phase) || oldSelf.status.phase == 'Pending'").message(kube::core::Message::Expression("'spec.votes: approval ' + self.metadata.name + ' is ' + oldSelf.status.phase + ' and takes no more votes'".into())),
)]
#[x_kube(
    validation = Rule::new("!has(self.decision) || (self.kind == 'Approve' ? self.decision in ['Approved', 'Rejected'] : self.decision in ['Retry', 'MarkSucceeded', 'MarkFailed'])").message("spec.decision: an Approve approval takes Approved or Rejected; a Reconcile approval takes Retry, MarkSucceeded or MarkFailed").field_path(".decision").reason(Reason::FieldValueInvalid),
    validation = Rule::new("!has(oldSelf.decision) || (has(self.decision) && self.decision == oldSelf.decision)").message("spec.decision: a decision is final once made and cannot be changed or removed").field_path(".decision").reason(Reason::FieldValueForbidden),
    validation = Rule::new("!has(oldSelf.comment) || !has(oldSelf.decision) || (has(self.comment) && self.comment == oldSelf.comment)").message("spec.comment: the comment of a made decision cannot be changed").field_path(".comment").reason(Reason::FieldValueForbidden),
    validation = Rule::new("has(self.expiresAt) == has(oldSelf.expiresAt) && (!has(self.expiresAt) || self.expiresAt == oldSelf.expiresAt)").message("spec.expiresAt is immutable: the deadline was set when the approval was requested").field_path(".expiresAt").reason(Reason::FieldValueForbidden),
    validation = Rule::new("has(self.context) == has(oldSelf.context) && (!has(self.context) || self.context == oldSelf.context)").message("spec.context is immutable").field_path(".context").reason(Reason::FieldValueForbidden),
    validation = Rule::new("has(self.stepDigest) == has(oldSelf.stepDigest) && (!has(self.stepDigest) || self.stepDigest == oldSelf.stepDigest)").message("spec.stepDigest is immutable: the approval is bound to the step as it was when asked").field_path(".stepDigest").reason(Reason::FieldValueForbidden),
    validation = Rule::new("has(self.approvers) == has(oldSelf.approvers) && (!has(self.approvers) || self.approvers == oldSelf.approvers)").message("spec.approvers is immutable: who may decide was set when the approval was requested").field_path(".approvers").reason(Reason::FieldValueForbidden),
    validation = Rule::new("has(self.requestedBy) == has(oldSelf.requestedBy) && (!has(self.requestedBy) || self.requestedBy == oldSelf.requestedBy)").message("spec.requestedBy is immutable").field_path(".requestedBy").reason(Reason::FieldValueForbidden),
    // On the parent, not the field: a rule on an optional field does not run
    // when a patch removes it, and removing it would turn separation off.
    validation = Rule::new("has(self.separateFromRequester) == has(oldSelf.separateFromRequester) && (!has(self.separateFromRequester) || self.separateFromRequester == oldSelf.separateFromRequester)").message("spec.separateFromRequester is immutable: separation of duties was set when the approval was requested and cannot be changed or removed").field_path(".separateFromRequester").reason(Reason::FieldValueForbidden),
    validation = Rule::new("has(self.notify) == has(oldSelf.notify) && (!has(self.notify) || self.notify == oldSelf.notify)").message("spec.notify is immutable: the channels were set when the approval was requested").field_path(".notify").reason(Reason::FieldValueForbidden),
    validation = Rule::new("has(self.escalate) == has(oldSelf.escalate) && (!has(self.escalate) || self.escalate == oldSelf.escalate)").message("spec.escalate is immutable").field_path(".escalate").reason(Reason::FieldValueForbidden),
    validation = Rule::new("!has(oldSelf.decidedBy) || (has(self.decidedBy) && self.decidedBy == oldSelf.decidedBy && self.decidedByGroups == oldSelf.decidedByGroups)").message("spec.decidedBy: who decided is final once recorded").field_path(".decidedBy").reason(Reason::FieldValueForbidden),
    validation = Rule::new("oldSelf.votes.all(v, v in self.votes)").message("spec.votes: votes are append-only; a vote cannot be changed or removed").field_path(".votes").reason(Reason::FieldValueForbidden)
)]
#[x_kube(
    validation = Rule::new("!has(self.decidedBy) || has(self.decision)").message("spec.decidedBy is recorded with spec.decision, not alone").field_path(".decidedBy").reason(Reason::FieldValueForbidden),
    validation = Rule::new("self.votes.all(v, self.votes.exists_one(w, w.user == v.user))").message("spec.votes: each user votes once").field_path(".votes").reason(Reason::FieldValueForbidden),
    validation = Rule::new("size(self.votes) == 0 || self.kind == 'Approve'").message("spec.votes: only an Approve approval takes votes; a Reconcile approval takes spec.decision").field_path(".votes").reason(Reason::FieldValueForbidden)
)]
#[serde(rename_all = "camelCase")]
pub struct ApprovalSpec {
    /// The AgentRun waiting on this decision. Immutable.
    #[schemars(
        length(min = 1, max = 63),
        regex(pattern = r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")
    )]
    #[x_kube(validation = Rule::new("self == oldSelf").message("spec.runName is immutable"))]
    pub run_name: String,
    /// The UID of that AgentRun, so a decision never reaches a newer run of the same name. Immutable.
    #[schemars(length(min = 1, max = 64))]
    #[x_kube(validation = Rule::new("self == oldSelf").message("spec.runUid is immutable"))]
    pub run_uid: String,
    /// The step the decision is about. Immutable.
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
    /// `Approve`: may the step run? `Reconcile`: a NonIdempotent step was
    /// interrupted and may or may not have acted; what happened? Immutable.
    #[x_kube(validation = Rule::new("self == oldSelf").message("spec.kind is immutable"))]
    pub kind: ApprovalKind,
    /// The question put to the person deciding.
    #[schemars(length(max = 1024))]
    #[serde(default)]
    #[x_kube(validation = Rule::new("self == oldSelf").message("spec.question is immutable"))]
    pub question: String,
    /// What a person needs to decide.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub context: Option<ApprovalContext>,
    /// When the request expires; then `onTimeout` applies. Unset: never.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expires_at: Option<Time>,
    /// The sha256 of the step this approval is about, as it was when asked:
    /// its container (image, command, args, env), effect, compensation and
    /// the run's Pod defaults. An approval releases only a step with this
    /// digest (D14); a step changed after the request needs a new decision.
    /// Immutable.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 64))]
    pub step_digest: Option<String>,
    /// The decision taken at expiry (for `Approve` approvals). Immutable.
    #[serde(default)]
    #[x_kube(validation = Rule::new("self == oldSelf").message("spec.onTimeout is immutable"))]
    pub on_timeout: OnTimeout,
    /// Set by the person deciding. Approve: `Approved` or `Rejected`.
    /// Reconcile: `Retry`, `MarkSucceeded` or `MarkFailed`. Final once set.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub decision: Option<Decision>,
    /// Why the person decided as they did.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 4096))]
    pub comment: Option<String>,
    /// Who may decide, copied from the step's gate. Unset: anyone whom RBAC
    /// lets patch this Approval. Immutable.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub approvers: Option<Approvers>,
    /// How many distinct approvers must approve. Above 1 each casts a vote
    /// in `votes` and `decision` stays unset. Immutable.
    #[serde(default = "one")]
    #[schemars(range(min = 1, max = 16))]
    #[x_kube(validation = Rule::new("self == oldSelf").message("spec.quorum is immutable"))]
    pub quorum: i32,
    /// Whether the run's creator (`requestedBy`) is refused as an approver. Immutable.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub separate_from_requester: bool,
    /// Who created the run, as the API server recorded it at creation
    /// (annotation `agentrun.dev/requested-by`). Immutable.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 253))]
    pub requested_by: Option<String>,
    /// The user who set `decision`, from the API server's record of the
    /// request (stamped by the chart's mutating policy, or filled by the
    /// client and checked by its validating policy). Final once set.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 253))]
    pub decided_by: Option<String>,
    /// The groups of that user at the time.
    #[serde(default)]
    #[schemars(length(max = 64))]
    pub decided_by_groups: Vec<String>,
    /// Votes, one per user, append-only: with a quorum above 1 the step runs
    /// once `quorum` distinct approvers voted `Approved`; one `Rejected`
    /// rejects.
    #[serde(default)]
    #[schemars(length(max = 32))]
    pub votes: Vec<Vote>,
    /// The channels told about this approval (besides the operator's
    /// default channels), copied from the step's gate. Immutable.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 8), inner(length(min = 1, max = 63)))]
    pub notify: Vec<String>,
    /// A reminder to other channels while nobody decides, copied from the
    /// step's gate. Immutable.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub escalate: Option<Escalation>,
}

fn one() -> i32 {
    1
}

/// One approver's vote.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
#[x_kube(
    validation = Rule::new("self.decision in ['Approved', 'Rejected']").message("spec.votes[].decision: a vote is Approved or Rejected").field_path(".decision").reason(Reason::FieldValueInvalid)
)]
pub struct Vote {
    /// The voter: the user who adds the vote (the policies check it).
    #[schemars(length(min = 1, max = 253))]
    pub user: String,
    pub decision: Decision,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 4096))]
    pub comment: Option<String>,
}

/// What is being asked.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
pub enum ApprovalKind {
    /// May the step run?
    Approve,
    /// Did an interrupted NonIdempotent step act?
    Reconcile,
}

/// A person's answer.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Decision {
    /// (Approve) The step may run.
    Approved,
    /// (Approve) The step must not run: the run fails and compensates.
    Rejected,
    /// (Reconcile) The step did not act: run it again with the same key.
    Retry,
    /// (Reconcile) The step acted: record it as succeeded and go on.
    MarkSucceeded,
    /// (Reconcile) The step failed: fail the run and compensate.
    MarkFailed,
}

/// The facts a person needs to decide.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct ApprovalContext {
    /// Why the run is asking.
    #[serde(default)]
    pub reason: String,
    /// The step's declared effect.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub effect: Option<Effect>,
    /// The idempotency key the step ran (or will run) with.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub idempotency_key: Option<String>,
    /// The Pod of the interrupted attempt (Reconcile).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod: Option<String>,
    /// The steps that already succeeded, with a short form of their results.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub completed_steps: Vec<String>,
    /// Set when the step already acted at an earlier plan revision: approving
    /// runs it again under a new key, so its effect happens a second time.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub repeats: Option<RepeatedEffect>,
}

/// The earlier execution of a step that an approval would repeat.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct RepeatedEffect {
    /// The key the step acted under.
    pub idempotency_key: String,
    /// The plan revision it acted at.
    pub plan_revision: i64,
    /// `Applied`, or `Unknown` when it may have acted.
    pub effect: crate::EffectOutcome,
}

/// What became of the request.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct ApprovalStatus {
    #[serde(default)]
    pub phase: ApprovalPhase,
    /// When the decision (or the expiry or supersession) was recorded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub decided_at: Option<Time>,
    /// The person who decided (`spec.decidedBy`; with a quorum, the voters),
    /// or `agentrun-operator` for an expiry or a supersession. On a cluster
    /// without the chart's admission policies, the field manager that wrote
    /// `spec.decision`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub decided_by: Option<String>,
    /// Approving votes against the quorum, e.g. `1/2`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub votes: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    /// The notifications sent about this approval, one per (event,
    /// channel). Written by the operator's notifier (field manager
    /// `agentrun-operator-notifier`), never by the decision path.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(schema_with = "super::deliveries_schema")]
    pub notifications: Vec<Delivery>,
    /// `Notified`: whether every notification due was delivered, and if
    /// not, why (a channel that is not configured, an address refused,
    /// a receiver failing).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(schema_with = "super::conditions_schema")]
    pub conditions: Vec<k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition>,
}

/// The lifecycle of an Approval.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum ApprovalPhase {
    #[default]
    Pending,
    Approved,
    Rejected,
    Expired,
    /// A Reconcile approval whose decision was applied.
    Resolved,
    /// The run no longer waits on this approval: its step changed (a new
    /// approval was asked), the plan was revised, or the run ended. A
    /// decision made on it is not applied; the API server refuses new ones.
    Superseded,
}
