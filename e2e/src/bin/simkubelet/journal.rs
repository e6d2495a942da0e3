//! A journaled step's agent loop (D19, docs/journal.md), as the step SDKs run
//! it: `SIM_STEP.journal.calls` are the calls the loop makes, in order.
//!
//! ```text
//!   read chunks ─▶ take the journal over (spec.attempt = this attempt)
//!   per call p:  think ─▶ recorded Done / settled Applied ─▶ replayed, nothing made
//!                         recorded Intent, unsettled     ─▶ stop (JournalUnknown)
//!                         else: [Intent] ─(actMs)─▶ made: ledger callExecuted ─(recordMs)─▶ Done
//! ```
//!
//! The loop is a future the Pod's task drops the moment the Pod is being
//! deleted, as a killed container stops: between any two of those points,
//! between the intent and the call, between the call and its answer. A call
//! is "made" only by its `callExecuted` line (and the effects record a
//! verify probe reads), appended synchronously, so a dropped loop has made
//! exactly the calls the ledger shows.

use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use agentrun_e2e::ledger::CallExecution;
use agentrun_operator::api::{CallState, Effect, EffectOutcome, JournalEntry};
use jiff::Timestamp;
use tracing::info;

use crate::Context;
use crate::facts::PodFacts;
use crate::journal_calls::{CallSim, JournalSim};
use crate::journal_store::{JournalId, Store, StoreError};

/// Why the loop stopped before its last call, as the SDK says it.
#[derive(Debug, thiserror::Error)]
pub(crate) enum LoopError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("journal mismatch at call {seq}: recorded {recorded:?}, asked {asked:?}")]
    Mismatch {
        seq: i64,
        recorded: String,
        asked: String,
    },
    #[error("call {seq} ({call_id}) may have acted and is not settled (JournalUnknown)")]
    Unknown { seq: i64, call_id: String },
}

/// What a finished loop did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Ran {
    pub(crate) replayed: u32,
}

/// Runs the loop of `facts`' Pod; `made` counts the calls it made (read
/// after the loop is dropped, too).
pub(crate) async fn run(
    ctx: &Context,
    facts: &PodFacts,
    id: &JournalId,
    sim: &JournalSim,
    made: &AtomicU32,
) -> Result<Ran, LoopError> {
    let mut store = Store::load(ctx.client.clone(), &facts.namespace, id.clone()).await?;
    store.take_over().await?;
    let mut ran = Ran::default();
    for (seq, call) in (0i64..).zip(&sim.calls) {
        tokio::time::sleep(Duration::from_millis(call.think_ms)).await;
        let asked = call.entry(seq, &id.step_key, id.attempt, CallState::Done);
        if let Some(e) = store.entry(seq) {
            let same = (e.call_id.as_str(), e.kind, e.request_digest.as_str())
                == (
                    asked.call_id.as_str(),
                    asked.kind,
                    asked.request_digest.as_str(),
                );
            if !same {
                return Err(LoopError::Mismatch {
                    seq,
                    recorded: e.call_id.clone(),
                    asked: asked.call_id,
                });
            }
            let at_end = seq + 1 == store.len();
            let replay = match e.state {
                CallState::Done => true,
                CallState::NotApplied => !at_end,
                CallState::Intent => match store.settlement(seq, e.attempt) {
                    Some(EffectOutcome::Applied) => true,
                    Some(EffectOutcome::NotApplied) => false,
                    _ => {
                        return Err(LoopError::Unknown {
                            seq,
                            call_id: e.call_id.clone(),
                        });
                    }
                },
            };
            if replay {
                ran.replayed += 1;
                continue;
            }
        }
        if call.effect() == Some(Effect::NonIdempotent) {
            store
                .record(call.entry(seq, &id.step_key, id.attempt, CallState::Intent))
                .await?;
            tokio::time::sleep(Duration::from_millis(call.act_ms)).await;
        }
        execute(ctx, facts, call, seq, &asked);
        made.fetch_add(1, Ordering::SeqCst);
        tokio::time::sleep(Duration::from_millis(call.record_ms)).await;
        store.record(asked).await?;
    }
    Ok(ran)
}

/// The call is made: the ledger's line, and what a probe of its key reads.
fn execute(ctx: &Context, facts: &PodFacts, call: &CallSim, seq: i64, entry: &JournalEntry) {
    if let Some(key) = &entry.key {
        ctx.effects.record_call(key);
    }
    let line = facts
        .ledger_entry(Timestamp::now())
        .executed(CallExecution {
            seq,
            id: entry.call_id.clone(),
            kind: format!("{:?}", call.kind),
            key: entry.key.clone(),
            at: Timestamp::now(),
        });
    ctx.record(&line);
    info!(pod = %facts.name, seq, call = %entry.call_id, "journaled call made");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn calls_default_their_ids_and_tools_default_to_non_idempotent() {
        let sim: JournalSim = serde_json::from_str(
            r#"{"calls":[{"kind":"Model"},{"kind":"Tool","actMs":900},{"kind":"Tool","effect":"Idempotent","id":"t"}]}"#,
        )
        .unwrap();
        let ids: Vec<String> = (0..).zip(&sim.calls).map(|(s, c)| c.id(s)).collect();
        assert_eq!(ids, ["model-0", "call_1", "t"]);
        let effects: Vec<_> = sim.calls.iter().map(CallSim::effect).collect();
        assert_eq!(
            effects,
            [None, Some(Effect::NonIdempotent), Some(Effect::Idempotent)]
        );
        assert_eq!(
            (
                sim.calls[1].act_ms,
                sim.calls[1].record_ms,
                sim.calls[0].think_ms
            ),
            (900, 100, 50)
        );
        assert!(
            serde_json::from_str::<JournalSim>(r#"{"calls":[{"kind":"Tool","actMS":1}]}"#).is_err()
        );
    }

    #[test]
    fn a_tool_calls_key_is_the_documented_call_key_of_the_step_key() {
        let c: CallSim = serde_json::from_str(r#"{"kind":"Tool","id":"call_1"}"#).unwrap();
        let e = c.entry(1, "stepkey", 2, CallState::Intent);
        // docs/journal.md's first vector (openssl).
        assert_eq!(e.key.as_deref(), Some("0ed9ffc913f10948baf0d9ce47391e7f"));
        assert_eq!(
            (e.attempt, e.state, e.response),
            (2, CallState::Intent, None)
        );
        let done = c.entry(1, "stepkey", 3, CallState::Done);
        assert_eq!(
            done.request_digest, e.request_digest,
            "the same question every attempt"
        );
        assert_eq!(done.response.as_deref(), Some(r#"{"call":"call_1"}"#));
    }
}
