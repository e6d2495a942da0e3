//! What a step's journal tells the operator (D19): how many calls it
//! holds, their bytes and tokens, and the call that may have acted — a
//! NonIdempotent call recorded as started and never answered, and not yet
//! settled.
//!
//! ```text
//!   StepJournal <prefix>0 ─┐
//!   StepJournal <prefix>1 ─┼─▶ read() ─▶ Journal { calls, bytes, tokens, open }
//!   StepJournal <prefix>k ─┘     (chunks 0..k in order; a gap ends the journal)
//! ```
//!
//! Only chunks named as the operator names them and carrying the run's UID
//! count: anything else in the namespace is not this step's journal.

use std::collections::BTreeMap;

use agentrun_api::{
    CallKind, CallState, CallTokens, Effect, EffectOutcome, JournalEntry, Settlement, StepJournal,
    TokenUsage, entry_bytes,
};

/// One step's journal at one plan revision, as the cache shows it.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Journal {
    /// Entries recorded.
    pub calls: i64,
    pub model_calls: i64,
    pub tool_calls: i64,
    /// Bytes counted against `journal.maxBytes`.
    pub bytes: i64,
    pub chunks: i32,
    /// Tokens of every model call, each once.
    pub tokens: TokenUsage,
    /// The last entry, when it is a NonIdempotent call that started and
    /// was never answered nor settled.
    pub open: Option<OpenCall>,
    /// Settlements recorded in the chunks' status, by seq and the attempt
    /// whose intent each settles.
    pub settled: BTreeMap<(i64, i32), EffectOutcome>,
    /// A tool call with an effect was answered (`Done`) or its intent was
    /// settled `Applied`: the step acted, whatever its later calls did.
    pub applied: bool,
}

/// A call that may have acted.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OpenCall {
    pub seq: i64,
    pub call_id: String,
    pub key: String,
    pub name: Option<String>,
    pub request_digest: String,
    /// The chunk that holds it: where its settlement is written.
    pub chunk: String,
    /// The attempt that recorded the intent.
    pub attempt: i32,
}

/// The journal named `<prefix><n>` among `chunks`, for the run `run_uid`.
pub fn read(chunks: &[&StepJournal], run_uid: &str, prefix: &str) -> Journal {
    let mut by_index: BTreeMap<i32, &StepJournal> = BTreeMap::new();
    for c in chunks {
        let Some(name) = c.metadata.name.as_deref() else {
            continue;
        };
        let Some(n) = name
            .strip_prefix(prefix)
            .and_then(|n| n.parse::<i32>().ok())
        else {
            continue;
        };
        if c.spec.run_uid == run_uid && c.spec.chunk == n {
            by_index.insert(n, c);
        }
    }
    let mut j = Journal::default();
    let mut last: Option<(&JournalEntry, &str)> = None;
    for (expected, (n, c)) in by_index.iter().enumerate() {
        if *n != expected as i32 {
            break; // a gap: what follows is not reached by a replay either
        }
        j.chunks += 1;
        for s in c.status.iter().flat_map(|s| s.settlements.iter()) {
            j.settled.insert((s.seq, s.attempt), s.outcome);
        }
        for e in &c.spec.entries {
            j.calls += 1;
            j.bytes = j.bytes.saturating_add(entry_bytes(e));
            match e.kind {
                CallKind::Model => j.model_calls += 1,
                CallKind::Tool => j.tool_calls += 1,
            }
            if let Some(t) = e.tokens {
                j.tokens.input = j.tokens.input.saturating_add(t.input.max(0));
                j.tokens.output = j.tokens.output.saturating_add(t.output.max(0));
            }
            last = Some((e, c.metadata.name.as_deref().unwrap_or_default()));
        }
    }
    j.applied = by_index
        .values()
        .take(j.chunks as usize)
        .flat_map(|c| c.spec.entries.iter())
        .any(|e| {
            e.kind == CallKind::Tool
                && e.effect != Some(Effect::None)
                && match e.state {
                    CallState::Done => true,
                    CallState::Intent => {
                        j.settled.get(&(e.seq, e.attempt)) == Some(&EffectOutcome::Applied)
                    }
                    CallState::NotApplied => false,
                }
        });
    j.open = last.and_then(|(e, chunk)| {
        (e.state == CallState::Intent && !j.settled.contains_key(&(e.seq, e.attempt))).then(|| {
            OpenCall {
                seq: e.seq,
                call_id: e.call_id.clone(),
                key: e.key.clone().unwrap_or_default(),
                name: e.name.clone(),
                request_digest: e.request_digest.clone(),
                chunk: chunk.to_owned(),
                attempt: e.attempt,
            }
        })
    });
    j
}

/// Tokens as the journal holds them, in the run's unit.
pub fn tokens(t: CallTokens) -> TokenUsage {
    TokenUsage {
        input: t.input,
        output: t.output,
    }
}

/// The settlement the operator writes for an open call.
pub fn settlement(
    seq: i64,
    attempt: i32,
    outcome: EffectOutcome,
    response: Option<String>,
    by: &str,
    at: jiff::Timestamp,
) -> Settlement {
    Settlement {
        seq,
        attempt,
        outcome,
        response,
        by: by.to_owned(),
        at: k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(at),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use agentrun_api::{Effect, StepJournalSpec, StepJournalStatus};
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

    fn entry(seq: i64, kind: CallKind, state: CallState) -> JournalEntry {
        JournalEntry {
            seq,
            call_id: format!("call_{seq}"),
            kind,
            request_digest: "d".repeat(64),
            effect: (kind == CallKind::Tool).then_some(Effect::NonIdempotent),
            key: (kind == CallKind::Tool).then(|| "k".repeat(32)),
            name: None,
            state,
            attempt: 1,
            response: (state == CallState::Done).then(|| "{}".to_owned()),
            error: None,
            tokens: (kind == CallKind::Model).then_some(CallTokens {
                input: 100,
                output: 10,
                cached: 0,
            }),
            started_at: None,
            finished_at: None,
        }
    }

    fn chunk(name: &str, uid: &str, n: i32, entries: Vec<JournalEntry>) -> StepJournal {
        let first_seq = entries.first().map_or(0, |e| e.seq);
        StepJournal {
            metadata: ObjectMeta {
                name: Some(name.to_owned()),
                ..ObjectMeta::default()
            },
            spec: StepJournalSpec {
                run_name: "r".into(),
                run_uid: uid.into(),
                step: "s".into(),
                plan_revision: 1,
                chunk: n,
                first_seq,
                attempt: 1,
                sealed: false,
                entries,
            },
            status: None,
        }
    }

    #[test]
    fn a_journal_is_read_in_chunk_order_and_only_as_named_for_this_run() {
        use CallKind::*;
        use CallState::*;
        let c0 = chunk(
            "p-journal-0",
            "u",
            0,
            vec![entry(0, Model, Done), entry(1, Tool, Done)],
        );
        let c1 = chunk("p-journal-1", "u", 1, vec![entry(2, Tool, Intent)]);
        let other_run = chunk("p-journal-2", "v", 2, vec![entry(3, Model, Done)]);
        let other_step = chunk("q-journal-0", "u", 0, vec![entry(0, Model, Done)]);
        let after_gap = chunk("p-journal-3", "u", 3, vec![entry(9, Model, Done)]);
        let all = [&c1, &other_run, &c0, &other_step, &after_gap];
        let j = read(&all, "u", "p-journal-");
        assert_eq!(
            (j.chunks, j.calls, j.model_calls, j.tool_calls),
            (2, 3, 1, 2)
        );
        assert_eq!(
            j.tokens,
            TokenUsage {
                input: 100,
                output: 10
            }
        );
        let open = j.open.expect("the intent at seq 2 is open");
        assert_eq!((open.seq, open.chunk.as_str()), (2, "p-journal-1"));
    }

    #[test]
    fn a_settled_or_answered_call_is_not_open() {
        use CallKind::*;
        use CallState::*;
        let mut c = chunk("p-journal-0", "u", 0, vec![entry(0, Tool, Intent)]);
        assert!(read(&[&c], "u", "p-journal-").open.is_some());
        c.status = Some(StepJournalStatus {
            settlements: vec![settlement(
                0,
                1,
                EffectOutcome::NotApplied,
                None,
                "verify",
                jiff::Timestamp::UNIX_EPOCH,
            )],
        });
        assert_eq!(read(&[&c], "u", "p-journal-").open, None);
        // The next attempt called it again (after NotApplied) and was lost
        // during the call too: its intent is a new question.
        c.spec.entries[0].attempt = 2;
        assert_eq!(
            read(&[&c], "u", "p-journal-").open.map(|o| o.attempt),
            Some(2)
        );
        // An intent followed by another call was answered (a replay returns
        // what came after it): only the last entry can be open.
        let c = chunk(
            "p-journal-0",
            "u",
            0,
            vec![entry(0, Tool, Intent), entry(1, Model, Done)],
        );
        assert_eq!(read(&[&c], "u", "p-journal-").open, None);
    }
}
