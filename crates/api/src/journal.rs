//! The `StepJournal` resource: every model call and tool call a step makes,
//! recorded in order before the step goes on (D19), so a new attempt of the
//! same (run, step, plan revision) replays what was recorded instead of
//! asking the model again or calling a tool again.
//!
//! ```text
//!   step Pod (attempt n, its own bound token) ──writes──▶ StepJournal chunk k
//!        <run>-<step>-<tag>-r<rev>-journal-<k>   entries seq firstSeq..
//!   operator ──writes──▶ status.settlements (a call that may have acted, settled
//!        by the step's verify probe or a person)
//!   AgentRun ──owns──▶ StepJournal (deleted with the run)
//! ```
//!
//! A journal is a list of chunks. The step appends to its last chunk (an
//! update guarded by resourceVersion, so one position is written once); a
//! chunk that is full is sealed and never changes again, and the next entry
//! opens chunk k+1. An append therefore writes at most one chunk's bytes: a
//! 200-call loop writes O(calls) bytes, not O(calls²).
//!
//! Who writes what is held by admission (the chart's `-journals` policy),
//! not by RBAC alone: a step Pod writes only the chunks of its own (run,
//! step, revision), named after its own Pod name as the API server puts it
//! in the token, with its own attempt number, never lowering the attempt a
//! chunk carries (a newer attempt fences an older one still running); the
//! status is the operator's.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::{CustomResource, KubeSchema};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use super::Effect;

/// Default of `steps[].journal.maxBytes`: 1 MiB of recorded calls per step
/// and plan revision.
pub const JOURNAL_DEFAULT_MAX_BYTES: i64 = 1 << 20;
/// Largest `steps[].journal.maxBytes`: 8 MiB, spread over chunks of at most
/// [`JOURNAL_CHUNK_MAX_BYTES`].
pub const JOURNAL_MAX_BYTES: i64 = 8 << 20;
/// Most bytes of recorded calls one chunk holds (its entries' requests,
/// responses and errors); a chunk stays far below etcd's request limit.
pub const JOURNAL_CHUNK_MAX_BYTES: i64 = 256 << 10;
/// Most entries one chunk holds.
pub const JOURNAL_CHUNK_MAX_ENTRIES: usize = 32;
/// Longest recorded response or result of one call, in bytes: a call whose
/// answer is longer is refused to the step (never cut).
pub const JOURNAL_ENTRY_MAX_BYTES: usize = 128 << 10;

/// A step's journaling: set `journal: {}` on a step whose agent loop uses
/// the step SDK's journal (`step.model`, `step.tool`).
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct JournalSpec {
    /// Most bytes of recorded calls (requests' digests and ids, responses,
    /// results) this step's journal may hold per plan revision. A call that
    /// would pass it is refused to the step with a clear error, and a journal
    /// found past it fails the step. Default 1 MiB, at most 8 MiB.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 4096, max = 8388608))]
    pub max_bytes: Option<i64>,
}

impl JournalSpec {
    pub fn max_bytes(&self) -> i64 {
        self.max_bytes.unwrap_or(JOURNAL_DEFAULT_MAX_BYTES)
    }
}

/// One chunk of a step's journal.
#[allow(clippy::duplicated_attributes)]
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[kube(
    group = "agentrun.dev",
    version = "v1alpha1",
    kind = "StepJournal",
    plural = "stepjournals",
    singular = "stepjournal",
    shortname = "sj",
    category = "agentrun-all",
    namespaced,
    status = "StepJournalStatus",
    derive = "PartialEq",
    doc = "One chunk of the journal of a step's model and tool calls (D19), written by the step's own Pod before the step goes on and replayed by its next attempt. Admission lets a step Pod write only its own step's chunks; the status (settlements of calls that may have acted) is the operator's.",
    printcolumn(
        name = "Run",
        type_ = "string",
        json_path = ".spec.runName",
        description = "The AgentRun the step belongs to"
    ),
    printcolumn(
        name = "Step",
        type_ = "string",
        json_path = ".spec.step",
        description = "The step whose calls these are"
    ),
    printcolumn(
        name = "Rev",
        type_ = "integer",
        json_path = ".spec.planRevision",
        description = "The plan revision"
    ),
    printcolumn(
        name = "Chunk",
        type_ = "integer",
        json_path = ".spec.chunk",
        description = "The chunk's place in the journal, from 0"
    ),
    printcolumn(
        name = "Last-Seq",
        type_ = "integer",
        json_path = ".spec.entries[-1:].seq",
        description = "The seq of the chunk's last recorded call"
    ),
    printcolumn(
        name = "Sealed",
        type_ = "boolean",
        json_path = ".spec.sealed",
        description = "Full: never written again"
    ),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp",
        description = "Time since the chunk was opened"
    )
)]
#[x_kube(
    validation = Rule::new("!oldSelf.sealed || self == oldSelf").message("spec: a sealed journal chunk is final; the next call opens the next chunk").reason(Reason::FieldValueForbidden),
    validation = Rule::new("self.attempt >= oldSelf.attempt").message("spec.attempt: a newer attempt has taken this journal over; an older attempt may not write it").field_path(".attempt").reason(Reason::FieldValueForbidden),
    validation = Rule::new("self.entries.size() >= oldSelf.entries.size()").message("spec.entries: a recorded call is never removed").field_path(".entries").reason(Reason::FieldValueForbidden),
    validation = Rule::new("self.entries.size() == 0 || self.entries[0].seq == self.firstSeq").message("spec.entries: the first entry's seq is spec.firstSeq").field_path(".entries").reason(Reason::FieldValueInvalid)
)]
#[serde(rename_all = "camelCase")]
pub struct StepJournalSpec {
    /// The AgentRun whose step this is. Immutable.
    #[schemars(
        length(min = 1, max = 63),
        regex(pattern = r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")
    )]
    #[x_kube(validation = Rule::new("self == oldSelf").message("spec.runName is immutable"))]
    pub run_name: String,
    /// The UID of that AgentRun. Immutable.
    #[schemars(length(min = 1, max = 64))]
    #[x_kube(validation = Rule::new("self == oldSelf").message("spec.runUid is immutable"))]
    pub run_uid: String,
    /// The step. Immutable.
    #[schemars(
        length(min = 1, max = 48),
        regex(pattern = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
    )]
    #[x_kube(validation = Rule::new("self == oldSelf").message("spec.step is immutable"))]
    pub step: String,
    /// The plan revision: a new revision starts a new journal. Immutable.
    #[schemars(range(min = 1))]
    #[x_kube(validation = Rule::new("self == oldSelf").message("spec.planRevision is immutable"))]
    pub plan_revision: i64,
    /// This chunk's place in the journal, from 0. Immutable.
    #[schemars(range(min = 0, max = 4096))]
    #[x_kube(validation = Rule::new("self == oldSelf").message("spec.chunk is immutable"))]
    pub chunk: i32,
    /// The seq of the chunk's first entry. Immutable.
    #[schemars(range(min = 0))]
    #[x_kube(validation = Rule::new("self == oldSelf").message("spec.firstSeq is immutable"))]
    pub first_seq: i64,
    /// The attempt that last wrote this chunk; it never goes down, so an
    /// older attempt still running is refused once a newer one has written.
    #[schemars(range(min = 1))]
    pub attempt: i32,
    /// Full: the chunk never changes again.
    #[serde(default)]
    pub sealed: bool,
    /// The calls, in the order the step made them.
    #[serde(default)]
    #[schemars(length(max = 32))]
    pub entries: Vec<JournalEntry>,
}

/// One model or tool call.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
#[x_kube(
    validation = Rule::new("self.kind == 'Tool' || (!has(self.effect) && !has(self.key))").message("a model call has no effect and no key").reason(Reason::FieldValueForbidden),
    validation = Rule::new("self.kind == 'Model' || (has(self.effect) && has(self.key))").message("a tool call records its effect and its key").reason(Reason::FieldValueRequired),
    validation = Rule::new("self.state != 'Intent' || (self.kind == 'Tool' && self.effect == 'NonIdempotent')").message("only a NonIdempotent tool call records an intent before it starts").reason(Reason::FieldValueForbidden),
    validation = Rule::new("self.state != 'Done' || has(self.response)").message("a finished call records its response").field_path(".response").reason(Reason::FieldValueRequired)
)]
pub struct JournalEntry {
    /// Position in the step's journal, from 0.
    #[schemars(range(min = 0))]
    pub seq: i64,
    /// The call's id: the model's `tool_call.id` / `tool_use_id` for a tool
    /// call, the SDK's or the step's own for a model call.
    #[schemars(length(min = 1, max = 256))]
    pub call_id: String,
    pub kind: CallKind,
    /// The SDK's digest of what was asked (sha256 of its canonical JSON):
    /// a replay that asks something else at this position stops.
    #[schemars(length(min = 1, max = 128))]
    pub request_digest: String,
    /// A tool call's declared effect.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub effect: Option<Effect>,
    /// A tool call's own idempotency key: [`call_key`] of the step's key and
    /// the call id, the same in every attempt.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 64))]
    pub key: Option<String>,
    /// The model or tool's name (for people and for prices).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 256))]
    pub name: Option<String>,
    pub state: CallState,
    /// The attempt that recorded this entry (an entry settled to run again
    /// is rewritten by the attempt that ran it).
    #[schemars(range(min = 1))]
    pub attempt: i32,
    /// The response (model) or result (tool), as JSON text.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 131072))]
    pub response: Option<String>,
    /// Why the call did not act (`NotApplied`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 4096))]
    pub error: Option<String>,
    /// A model call's tokens.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokens: Option<CallTokens>,
    /// When the call started, by the step's clock.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub started_at: Option<Time>,
    /// When its answer was recorded, by the step's clock.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub finished_at: Option<Time>,
}

/// What kind of call an entry records.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CallKind {
    Model,
    Tool,
}

/// Where a call stands.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CallState {
    /// A NonIdempotent tool call about to start: recorded before it starts,
    /// so an attempt lost during it leaves a call that may have acted.
    Intent,
    /// Answered: the response is recorded and is replayed.
    Done,
    /// The call said it did not act; a replay calls it again.
    NotApplied,
}

/// Tokens of one model call.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Default)]
#[serde(rename_all = "camelCase")]
pub struct CallTokens {
    #[serde(default)]
    #[schemars(range(min = 0))]
    pub input: i64,
    #[serde(default)]
    #[schemars(range(min = 0))]
    pub output: i64,
    /// Input tokens served from the provider's cache (part of `input`).
    #[serde(default, skip_serializing_if = "is_zero")]
    #[schemars(range(min = 0))]
    pub cached: i64,
}

fn is_zero(n: &i64) -> bool {
    *n == 0
}

/// The operator's part of a chunk.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct StepJournalStatus {
    /// Calls of this chunk that were recorded as started and never answered
    /// (the attempt was lost during them), settled by the step's verify
    /// probe or by a person's answer to a Reconcile question.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 32))]
    pub settlements: Vec<Settlement>,
}

/// What became of a call that may have acted.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct Settlement {
    pub seq: i64,
    /// The attempt whose intent this settles (the entry's `attempt`): an
    /// intent a later attempt records at the same seq, calling again after
    /// `NotApplied`, is a new question.
    #[schemars(range(min = 1))]
    pub attempt: i32,
    /// `Applied`: the call acted, and `response` is what a replay returns;
    /// `NotApplied`: it did not, and the next attempt calls it again with
    /// the same key.
    pub outcome: super::EffectOutcome,
    /// What a replay of an applied call returns, as JSON text.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 131072))]
    pub response: Option<String>,
    /// `verify` (the step's probe) or the person who answered, as the API
    /// server recorded them.
    #[schemars(length(max = 253))]
    pub by: String,
    /// When the operator recorded the settlement.
    pub at: Time,
}

/// What the run's status holds of a step's journal at the checkpoint's plan
/// revision.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct JournalSummary {
    /// Model and tool calls recorded.
    #[serde(default)]
    pub calls: i64,
    /// Bytes recorded, against the step's `journal.maxBytes`.
    #[serde(default)]
    pub bytes: i64,
    /// Tokens of the journal's model calls counted into the step's tokens so
    /// far (each call once, whichever attempt made it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokens: Option<super::TokenUsage>,
    /// Calls that were recorded as started, never answered, and settled.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub settled: i64,
    /// The call that may have acted, while it is being settled.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub unknown: Option<JournalCall>,
}

/// A journaled call, as a person or a verify probe is asked about it.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct JournalCall {
    pub seq: i64,
    pub call_id: String,
    /// The call's own key (its idempotency key for the tool).
    pub key: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// What was asked, as the SDK's digest of the tool's name and arguments.
    pub request_digest: String,
    /// The journal chunk that holds it.
    pub chunk: String,
    /// The attempt that recorded its intent.
    #[serde(default)]
    pub attempt: i32,
    /// Once decided: how it is settled, written to the chunk before the
    /// next attempt starts.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub outcome: Option<super::EffectOutcome>,
    /// With `outcome: Applied`: what a replay returns, as JSON text.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub response: Option<String>,
    /// Who settled it: `verify` or the person who answered.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub settled_by: Option<String>,
}

/// The idempotency key of one tool call: the first 128 bits of
/// sha256(step key ‖ 0x00 ‖ call id), in hex. The same for every attempt of
/// the step (the step's key is, D1) and different for every call; the step
/// SDKs derive it the same way (docs/step-contract.md gives vectors).
pub fn call_key(step_key: &str, call_id: &str) -> String {
    let mut h = Sha256::new();
    h.update(step_key.as_bytes());
    h.update([0]);
    h.update(call_id.as_bytes());
    h.finalize()
        .iter()
        .take(16)
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// The name of chunk `chunk` of the journal whose step Pods are named
/// `<prefix>-<marker><attempt>`: `<prefix>-journal-<chunk>`.
pub fn journal_chunk_name(pod_prefix: &str, chunk: i32) -> String {
    format!("{pod_prefix}-journal-{chunk}")
}

/// The recorded bytes an entry counts against `maxBytes`: its ids, digest,
/// response and error.
pub fn entry_bytes(e: &JournalEntry) -> i64 {
    let len = |s: &Option<String>| s.as_ref().map_or(0, String::len);
    (e.call_id.len()
        + e.request_digest.len()
        + len(&e.key)
        + len(&e.name)
        + len(&e.response)
        + len(&e.error)) as i64
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Known answers computed with `printf 'K\0C' | openssl dgst -sha256`,
    /// never with the function under test.
    #[test]
    fn call_keys_match_independent_vectors() {
        let cases = [
            ("stepkey", "call_1", "0ed9ffc913f10948baf0d9ce47391e7f"),
            (
                "0123456789abcdef0123456789abcdef",
                "call_abc123",
                "3e3fe9b4ae2107749f6eac4ef0653153",
            ),
            (
                "k",
                "toolu_01A09q90qw90lq917835lq9",
                "114672f7ee8e42b9648ee81d11f0c179",
            ),
        ];
        for (key, id, want) in cases {
            assert_eq!(call_key(key, id), want, "call_key({key:?}, {id:?})");
        }
    }
}
