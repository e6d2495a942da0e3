//! `SIM_STEP.journal`: the calls a simulated journaled step's loop makes
//! (what `journal.rs` runs), read with the rest of `SIM_STEP` (`sim_step.rs`).

use agentrun_operator::api::{CallKind, CallState, CallTokens, Effect, JournalEntry, call_key};
use serde::Deserialize;
use serde_json::json;

/// `SIM_STEP.journal`: the loop's calls.
#[derive(Clone, Debug, Default, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub(crate) struct JournalSim {
    pub(crate) calls: Vec<CallSim>,
}

/// One call of the loop.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub(crate) struct CallSim {
    pub(crate) kind: CallKind,
    /// A tool call's effect (default `NonIdempotent`); a model call has none.
    pub(crate) effect: Option<Effect>,
    /// The call id (default `model-<seq>` / `call_<seq>`).
    pub(crate) id: Option<String>,
    /// Before the call is asked.
    #[serde(default = "default_think_ms")]
    pub(crate) think_ms: u64,
    /// From the intent to the call (NonIdempotent tools).
    #[serde(default = "default_step_ms")]
    pub(crate) act_ms: u64,
    /// From the call to its answer being recorded.
    #[serde(default = "default_step_ms")]
    pub(crate) record_ms: u64,
}

fn default_think_ms() -> u64 {
    50
}

fn default_step_ms() -> u64 {
    100
}

impl CallSim {
    pub(crate) fn id(&self, seq: i64) -> String {
        self.id.clone().unwrap_or_else(|| match self.kind {
            CallKind::Model => format!("model-{seq}"),
            CallKind::Tool => format!("call_{seq}"),
        })
    }

    pub(crate) fn effect(&self) -> Option<Effect> {
        (self.kind == CallKind::Tool).then(|| self.effect.unwrap_or(Effect::NonIdempotent))
    }

    /// The entry this call records at `seq`, as `attempt`, in `state`.
    pub(crate) fn entry(
        &self,
        seq: i64,
        step_key: &str,
        attempt: i32,
        state: CallState,
    ) -> JournalEntry {
        let id = self.id(seq);
        let tool = self.kind == CallKind::Tool;
        JournalEntry {
            seq,
            kind: self.kind,
            // What the loop asks is the same in every attempt.
            request_digest: call_key(step_key, &format!("request:{id}")),
            effect: self.effect(),
            key: tool.then(|| call_key(step_key, &id)),
            name: tool.then(|| "sim_tool".to_owned()),
            state,
            attempt,
            response: (state == CallState::Done).then(|| json!({"call": id}).to_string()),
            error: None,
            tokens: (self.kind == CallKind::Model).then_some(CallTokens {
                input: 20,
                output: 5,
                cached: 0,
            }),
            started_at: None,
            finished_at: None,
            call_id: id,
        }
    }
}
