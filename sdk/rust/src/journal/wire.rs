//! The `StepJournal` JSON as the API server stores it (crates/api/src/journal.rs),
//! mirrored here so a step binary does not link the operator's API crate and its
//! Kubernetes types. A test checks these against the CRD's own types.

use serde::{Deserialize, Serialize};
use serde_json::Value;

pub(crate) const GROUP_VERSION: &str = "agentrun.dev/v1alpha1";
pub(crate) const KIND: &str = "StepJournal";
pub(crate) const RUN_LABEL: &str = "agentrun.dev/run";

/// Most entries one chunk holds.
pub const CHUNK_MAX_ENTRIES: usize = 32;
/// Most recorded bytes (see [`Entry::bytes`]) one chunk holds.
pub const CHUNK_MAX_BYTES: i64 = 256 << 10;
/// Longest response or result of one call: a longer one is refused, never cut.
pub const ENTRY_MAX_BYTES: usize = 128 << 10;
/// Longest recorded reason of a call that did not act.
pub const ERROR_MAX_BYTES: usize = 4096;

/// One chunk: the spec is the step's, the status (settlements) the operator's.
/// `metadata` is kept as the server sent it, so an update carries its
/// resourceVersion, labels and owner back unchanged.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
pub(crate) struct Chunk {
    #[serde(rename = "apiVersion", default)]
    pub api_version: String,
    #[serde(default)]
    pub kind: String,
    pub metadata: serde_json::Map<String, Value>,
    pub spec: ChunkSpec,
    #[serde(default, skip_serializing)]
    pub status: Option<ChunkStatus>,
}

impl Chunk {
    /// The seq the next entry after this chunk's last one takes.
    pub fn end(&self) -> i64 {
        self.spec.first_seq + self.spec.entries.len() as i64
    }

    pub fn bytes(&self) -> i64 {
        self.spec.entries.iter().map(Entry::bytes).sum()
    }
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub(crate) struct ChunkSpec {
    pub run_name: String,
    pub run_uid: String,
    pub step: String,
    pub plan_revision: i64,
    pub chunk: i32,
    pub first_seq: i64,
    pub attempt: i32,
    #[serde(default)]
    pub sealed: bool,
    #[serde(default)]
    pub entries: Vec<Entry>,
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub(crate) struct ChunkStatus {
    #[serde(default)]
    pub settlements: Vec<Settlement>,
}

/// What the operator recorded of a call that may have acted.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub(crate) struct Settlement {
    pub seq: i64,
    /// The attempt whose intent it settles: an intent written again by a
    /// later attempt is a new question.
    #[serde(default)]
    pub attempt: i32,
    pub outcome: Outcome,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub response: Option<String>,
    #[serde(default)]
    pub by: String,
}

#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Outcome {
    Applied,
    NotApplied,
    Unknown,
}

/// One recorded call.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct Entry {
    pub seq: i64,
    pub call_id: String,
    pub kind: CallKind,
    pub request_digest: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub effect: Option<ToolEffect>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    pub state: CallState,
    pub attempt: i32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub response: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokens: Option<CallTokens>,
}

impl Entry {
    /// The bytes this entry counts against `maxBytes`: its ids, digest, key,
    /// name, response and error (as the operator counts them).
    pub fn bytes(&self) -> i64 {
        let len = |s: &Option<String>| s.as_ref().map_or(0, String::len);
        (self.call_id.len()
            + self.request_digest.len()
            + len(&self.key)
            + len(&self.name)
            + len(&self.response)
            + len(&self.error)) as i64
    }
}

/// What kind of call an entry records.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CallKind {
    Model,
    Tool,
}

/// Where a recorded call stands.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CallState {
    /// A NonIdempotent tool call about to start.
    Intent,
    /// Answered; a replay returns the answer.
    Done,
    /// The tool said it did not act.
    NotApplied,
}

/// A tool's declared effect, as on a step (`effect:`).
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ToolEffect {
    /// Reads only.
    None,
    /// Changes the world; the call's key makes a repeat harmless.
    Idempotent,
    /// Changes the world and a repeat may double the change: its intent is
    /// recorded before the call.
    NonIdempotent,
}

/// Tokens of one model call.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Default)]
#[serde(rename_all = "camelCase")]
pub struct CallTokens {
    #[serde(default)]
    pub input: i64,
    #[serde(default)]
    pub output: i64,
    /// Input tokens served from the provider's cache (part of `input`).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub cached: i64,
}

fn is_zero(n: &i64) -> bool {
    *n == 0
}
