//! The step journal (docs/journal.md): every model call and tool call of an
//! agent loop recorded in `StepJournal` chunks before the loop goes on, so the
//! next attempt of the same (run, step, plan revision) replays what was
//! recorded instead of asking the model again or calling a tool again.
//!
//! ```text
//!  Journal::open(&step) ── reads chunks 0..k + settlements, takes the journal over
//!      │
//!      ├─ model(req, |req| ask the model)        recorded? → replay   else ask, record Done
//!      └─ tool(id, name, args, effect, |key| …)  recorded? → replay   else (intent,) call, record
//! ```
//!
//! ```no_run
//! use agentrun_step::Step;
//! use agentrun_step::journal::{CallTokens, Journal, ToolEffect, ToolError};
//! use serde_json::json;
//!
//! let step = Step::load()?;
//! let mut journal = Journal::open(&step)?;
//! let answer = journal.model(&json!({"messages": ["refund order 4711"]}), |_req| {
//!     // ... ask the model ...
//!     Ok::<_, String>((json!({"tool_call": {"id": "call_1", "name": "refund"}}), CallTokens::default()))
//! })?;
//! let refund = journal.tool("call_1", "refund", &json!({"orderId": 4711}),
//!     ToolEffect::NonIdempotent, |key| {
//!         // ... call the payments API with Idempotency-Key: key ...
//!         Ok::<_, ToolError>(json!({"refundId": "rf-9"}))
//!     })?;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! A request's digest is sha256 of its canonical JSON ([`canonical_json`]: keys
//! sorted, compact); a tool call's is that of `{"arguments": args, "name": name}`.
//! A model call's tokens are counted from the journal, once, whichever attempt
//! made it: do not add them to the tokens [`crate::Step::succeed`] reports.

mod api;
mod digest;
mod error;
mod replay;
mod store;
mod wire;

use std::collections::HashMap;
use std::path::PathBuf;

use serde_json::Value;

pub use api::Api;
pub use digest::{call_key, canonical_json, model_digest, tool_digest};
pub use error::{BoxError, CallSig, Error, Result};
pub use store::Identity;
pub use wire::{
    CHUNK_MAX_BYTES, CHUNK_MAX_ENTRIES, CallKind, CallState, CallTokens, ENTRY_MAX_BYTES,
    ERROR_MAX_BYTES, Entry, ToolEffect,
};

use replay::Decision;
use store::Store;

pub const ENV_JOURNAL: &str = "AGENTRUN_JOURNAL";
pub const ENV_JOURNAL_MAX_BYTES: &str = "AGENTRUN_JOURNAL_MAX_BYTES";
pub const ENV_RUN_UID: &str = "AGENTRUN_RUN_UID";
pub const ENV_NAMESPACE: &str = "AGENTRUN_NAMESPACE";
pub const ENV_JOURNAL_TOKEN_FILE: &str = "AGENTRUN_JOURNAL_TOKEN_FILE";
pub const ENV_JOURNAL_CA_FILE: &str = "AGENTRUN_JOURNAL_CA_FILE";
pub const ENV_SERVICE_HOST: &str = "KUBERNETES_SERVICE_HOST";
pub const ENV_SERVICE_PORT: &str = "KUBERNETES_SERVICE_PORT";
/// `steps[].journal.maxBytes` when the variable is not set.
pub const DEFAULT_MAX_BYTES: i64 = 1 << 20;

/// Why a tool call returned no result.
#[derive(Debug)]
pub enum ToolError {
    /// The tool did not act (it refused before acting, or the system it calls
    /// said so): recorded as `NotApplied`, and the loop may go on.
    NotApplied(String),
    /// It failed and may have acted: nothing is recorded past its intent, and
    /// the step should stop (the operator then judges the call by its journal).
    Failed(BoxError),
}

impl<E: std::error::Error + Send + Sync + 'static> From<E> for ToolError {
    fn from(e: E) -> Self {
        ToolError::Failed(Box::new(e))
    }
}

/// A step's journal, opened by one attempt.
pub struct Journal {
    store: Store,
    step_key: String,
    max_bytes: i64,
    next: i64,
    spent: CallTokens,
}

impl Journal {
    /// Opens the journal the operator set up for this step's Pod, from the
    /// process environment (docs/journal.md, "What the Pod gets").
    pub fn open(step: &crate::Step) -> Result<Journal> {
        Journal::open_with(step, &std::env::vars().collect())
    }

    /// [`Journal::open`] with the given environment.
    pub fn open_with(step: &crate::Step, env: &HashMap<String, String>) -> Result<Journal> {
        let get = |name: &str| -> Result<String> {
            env.get(name)
                .filter(|v| !v.is_empty())
                .cloned()
                .ok_or_else(|| Error::Env {
                    name: name.to_owned(),
                    problem: "is not set: is `journal: {}` set on this step?".into(),
                })
        };
        let api = Api::in_cluster(
            &get(ENV_SERVICE_HOST)?,
            &get(ENV_SERVICE_PORT)?,
            PathBuf::from(get(ENV_JOURNAL_CA_FILE)?),
            PathBuf::from(get(ENV_JOURNAL_TOKEN_FILE)?),
            &get(ENV_NAMESPACE)?,
        )?;
        let max_bytes = match env.get(ENV_JOURNAL_MAX_BYTES).filter(|v| !v.is_empty()) {
            None => DEFAULT_MAX_BYTES,
            Some(v) => v.parse().map_err(|_| Error::Env {
                name: ENV_JOURNAL_MAX_BYTES.into(),
                problem: format!("must be an integer, got {v:?}"),
            })?,
        };
        let id = Identity {
            prefix: get(ENV_JOURNAL)?,
            run: step.run.clone(),
            run_uid: get(ENV_RUN_UID)?,
            step: step.step.clone(),
            plan_revision: step.plan_revision,
            attempt: i32::try_from(step.attempt).map_err(|_| Error::Env {
                name: crate::ENV_ATTEMPT.into(),
                problem: format!("is out of range: {}", step.attempt),
            })?,
        };
        Journal::connect(api, id, &step.idempotency_key, max_bytes)
    }

    /// Reads every chunk of the journal at `api` and takes it over for
    /// `id.attempt`. `step_key` is the step's `AGENTRUN_IDEMPOTENCY_KEY`.
    pub fn connect(api: Api, id: Identity, step_key: &str, max_bytes: i64) -> Result<Journal> {
        let mut store = Store::load(api, id)?;
        store.take_over()?;
        Ok(Journal {
            store,
            step_key: step_key.to_owned(),
            max_bytes,
            next: 0,
            spent: CallTokens::default(),
        })
    }

    /// The position the next call takes.
    pub fn position(&self) -> i64 {
        self.next
    }

    /// How many calls the journal holds.
    pub fn recorded(&self) -> i64 {
        self.store.len()
    }

    /// The tokens of every model call the journal holds, each once,
    /// whichever attempt made it: what [`crate::Step::succeed_journaled`]
    /// reports as `journalTokens`, so the run counts the whole journal even
    /// when the attempt ends before the operator has seen its last entries.
    pub fn tokens_total(&self) -> CallTokens {
        let mut t = CallTokens::default();
        for seq in 0..self.store.len() {
            if let Some(got) = self.store.entry(seq).and_then(|e| e.tokens) {
                t.input += got.input;
                t.output += got.output;
                t.cached += got.cached;
            }
        }
        t
    }

    /// The tokens this attempt spent on journaled model calls (replayed
    /// calls cost nothing).
    pub fn spent(&self) -> CallTokens {
        self.spent
    }

    /// Asks the model, or returns its recorded answer. The call's id is
    /// `model-<position>`.
    pub fn model<F, E>(&mut self, request: &Value, ask: F) -> Result<Value>
    where
        F: FnOnce(&Value) -> std::result::Result<(Value, CallTokens), E>,
        E: Into<BoxError>,
    {
        let id = format!("model-{}", self.next);
        self.model_with_id(&id, request, ask)
    }

    /// [`Journal::model`] with the step's own call id.
    pub fn model_with_id<F, E>(&mut self, call_id: &str, request: &Value, ask: F) -> Result<Value>
    where
        F: FnOnce(&Value) -> std::result::Result<(Value, CallTokens), E>,
        E: Into<BoxError>,
    {
        let seq = self.next;
        let sig = CallSig {
            call_id: call_id.to_owned(),
            kind: CallKind::Model,
            request_digest: model_digest(request),
        };
        if let Some(v) = self.replayed(seq, &sig)? {
            return v;
        }
        let (answer, tokens) = ask(request).map_err(|e| Error::Call {
            seq,
            call_id: call_id.to_owned(),
            source: e.into(),
        })?;
        let mut entry = self.entry(seq, &sig, CallState::Done);
        entry.response = Some(self.answer_text(seq, &answer)?);
        entry.tokens = Some(tokens);
        self.record(entry)?;
        self.spent.input += tokens.input;
        self.spent.output += tokens.output;
        self.spent.cached += tokens.cached;
        self.next += 1;
        Ok(answer)
    }

    /// Calls a tool, or returns its recorded result. `call_id` is the model's
    /// `tool_call.id` / `tool_use_id`; `call` gets the call's own idempotency
    /// key ([`call_key`]). A NonIdempotent call's intent is recorded before
    /// `call` runs. A tool that did not act returns [`Error::NotApplied`].
    pub fn tool<F>(
        &mut self,
        call_id: &str,
        name: &str,
        args: &Value,
        effect: ToolEffect,
        call: F,
    ) -> Result<Value>
    where
        F: FnOnce(&str) -> std::result::Result<Value, ToolError>,
    {
        let seq = self.next;
        let sig = CallSig {
            call_id: call_id.to_owned(),
            kind: CallKind::Tool,
            request_digest: tool_digest(name, args),
        };
        if let Some(v) = self.replayed(seq, &sig)? {
            return v;
        }
        let key = call_key(&self.step_key, call_id);
        let mut entry = self.entry(seq, &sig, CallState::Intent);
        entry.effect = Some(effect);
        entry.key = Some(key.clone());
        entry.name = Some(name.to_owned());
        if effect == ToolEffect::NonIdempotent {
            self.record(entry.clone())?;
        }
        match call(&key) {
            Ok(result) => {
                entry.state = CallState::Done;
                entry.response = Some(self.answer_text(seq, &result)?);
                self.record(entry)?;
                self.next += 1;
                Ok(result)
            }
            Err(ToolError::NotApplied(reason)) => {
                entry.state = CallState::NotApplied;
                entry.error = Some(cut(&reason, ERROR_MAX_BYTES));
                self.record(entry)?;
                self.next += 1;
                Err(Error::NotApplied {
                    seq,
                    call_id: call_id.to_owned(),
                    reason,
                })
            }
            Err(ToolError::Failed(source)) => Err(Error::Call {
                seq,
                call_id: call_id.to_owned(),
                source,
            }),
        }
    }

    /// The recorded outcome at `seq`, when replay answers without calling.
    fn replayed(&mut self, seq: i64, sig: &CallSig) -> Result<Option<Result<Value>>> {
        let at_end = seq + 1 == self.store.len();
        let decision = replay::decide(
            seq,
            self.store.entry(seq),
            at_end,
            self.store.settlement(seq),
            sig,
        )?;
        let out = match decision {
            Decision::Call => return Ok(None),
            Decision::Replay(text) => serde_json::from_str(&text).map_err(|e| Error::Corrupt {
                chunk: format!("holding call {seq}"),
                problem: format!("the recorded answer of call {seq} is not JSON: {e}"),
            }),
            Decision::ReplaySettled { by } => Ok(store::settled_applied(&by)),
            Decision::ReplayNotApplied(reason) => Err(Error::NotApplied {
                seq,
                call_id: sig.call_id.clone(),
                reason,
            }),
        };
        self.next += 1;
        Ok(Some(out))
    }

    fn entry(&self, seq: i64, sig: &CallSig, state: CallState) -> Entry {
        Entry {
            seq,
            call_id: sig.call_id.clone(),
            kind: sig.kind,
            request_digest: sig.request_digest.clone(),
            effect: None,
            key: None,
            name: None,
            state,
            attempt: self.store.attempt(),
            response: None,
            error: None,
            tokens: None,
        }
    }

    /// An answer as recorded: JSON text of at most [`ENTRY_MAX_BYTES`].
    fn answer_text(&self, seq: i64, answer: &Value) -> Result<String> {
        let text = answer.to_string();
        if text.len() > ENTRY_MAX_BYTES {
            return Err(Error::EntryTooLarge {
                seq,
                size: text.len(),
                max: ENTRY_MAX_BYTES,
            });
        }
        Ok(text)
    }

    /// Records `entry` if the journal stays within its maxBytes.
    fn record(&mut self, entry: Entry) -> Result<()> {
        let replaced = self.store.entry(entry.seq).map_or(0, Entry::bytes);
        let would = self.store.bytes() - replaced + entry.bytes();
        if would > self.max_bytes {
            return Err(Error::JournalFull {
                seq: entry.seq,
                would,
                max: self.max_bytes,
            });
        }
        self.store.record(entry)
    }
}

/// `s` cut to at most `max` bytes on a character boundary (a reason, never an answer).
fn cut(s: &str, max: usize) -> String {
    let mut end = s.len().min(max);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    s[..end].to_owned()
}
