//! What a call at a recorded position does, decided from what was recorded
//! alone (docs/journal.md, "Replay"): no I/O, a table of cases below.

use super::error::{CallSig, Error, Result};
use super::wire::{CallState, Entry, Outcome, Settlement};

#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Decision {
    /// Answered before: return this JSON text; nothing is called.
    Replay(String),
    /// Applied by a settlement without a response: return who said so.
    ReplaySettled { by: String },
    /// Recorded as not acted before the end of the journal: return that as it was.
    ReplayNotApplied(String),
    /// Make the call and record it at this position.
    Call,
}

/// `recorded` is the entry at the call's position, `at_end` whether it is the
/// journal's last, `settlement` the operator's answer for it.
pub(crate) fn decide(
    seq: i64,
    recorded: Option<&Entry>,
    at_end: bool,
    settlement: Option<&Settlement>,
    asked: &CallSig,
) -> Result<Decision> {
    let Some(e) = recorded else {
        return Ok(Decision::Call);
    };
    let was = CallSig {
        call_id: e.call_id.clone(),
        kind: e.kind,
        request_digest: e.request_digest.clone(),
    };
    if &was != asked {
        return Err(Error::JournalMismatch {
            seq,
            recorded: was,
            asked: asked.clone(),
        });
    }
    Ok(match e.state {
        CallState::Done => Decision::Replay(e.response.clone().unwrap_or_else(|| "null".into())),
        CallState::NotApplied if at_end => Decision::Call,
        CallState::NotApplied => Decision::ReplayNotApplied(e.error.clone().unwrap_or_default()),
        CallState::Intent => match settlement.map(|s| (s.outcome, s)) {
            Some((Outcome::Applied, s)) => match &s.response {
                Some(r) => Decision::Replay(r.clone()),
                None => Decision::ReplaySettled { by: s.by.clone() },
            },
            Some((Outcome::NotApplied, _)) => Decision::Call,
            Some((Outcome::Unknown, _)) | None => {
                return Err(Error::JournalUnknown {
                    seq,
                    call_id: e.call_id.clone(),
                    name: e.name.clone().unwrap_or_default(),
                    key: e.key.clone().unwrap_or_default(),
                    attempt: e.attempt,
                });
            }
        },
    })
}

#[cfg(test)]
mod tests {
    use super::super::wire::{CallKind, ToolEffect};
    use super::*;

    fn entry(state: CallState) -> Entry {
        Entry {
            seq: 3,
            call_id: "call_1".into(),
            kind: CallKind::Tool,
            request_digest: "d1".into(),
            effect: Some(ToolEffect::NonIdempotent),
            key: Some("k1".into()),
            name: Some("refund".into()),
            state,
            attempt: 1,
            response: (state == CallState::Done).then(|| r#"{"ok":1}"#.into()),
            error: (state == CallState::NotApplied).then(|| "declined".into()),
            tokens: None,
        }
    }

    fn settled(outcome: Outcome, response: Option<&str>) -> Settlement {
        Settlement {
            seq: 3,
            attempt: 1,
            outcome,
            response: response.map(Into::into),
            by: "alice".into(),
        }
    }

    fn asked(id: &str, digest: &str) -> CallSig {
        CallSig {
            call_id: id.into(),
            kind: CallKind::Tool,
            request_digest: digest.into(),
        }
    }

    /// Name, recorded entry, at the end, settlement, what replay does.
    type Case = (
        &'static str,
        Option<Entry>,
        bool,
        Option<Settlement>,
        Result<Decision, &'static str>,
    );

    #[test]
    fn each_recorded_state_replays_calls_or_stops_as_documented() {
        use Decision::*;
        let same = asked("call_1", "d1");
        let cases: Vec<Case> = vec![
            ("past the end: call", None, false, None, Ok(Call)),
            (
                "done: replay",
                Some(entry(CallState::Done)),
                false,
                None,
                Ok(Replay(r#"{"ok":1}"#.into())),
            ),
            (
                "not applied at the end: call again",
                Some(entry(CallState::NotApplied)),
                true,
                None,
                Ok(Call),
            ),
            (
                "not applied before the end: as it was",
                Some(entry(CallState::NotApplied)),
                false,
                None,
                Ok(ReplayNotApplied("declined".into())),
            ),
            (
                "intent settled applied: its response",
                Some(entry(CallState::Intent)),
                true,
                Some(settled(Outcome::Applied, Some(r#"{"refundId":"rf-9"}"#))),
                Ok(Replay(r#"{"refundId":"rf-9"}"#.into())),
            ),
            (
                "intent settled applied by a person",
                Some(entry(CallState::Intent)),
                true,
                Some(settled(Outcome::Applied, None)),
                Ok(ReplaySettled { by: "alice".into() }),
            ),
            (
                "intent settled not applied: call again",
                Some(entry(CallState::Intent)),
                true,
                Some(settled(Outcome::NotApplied, None)),
                Ok(Call),
            ),
            (
                "intent unsettled: stop",
                Some(entry(CallState::Intent)),
                true,
                None,
                Err("JournalUnknown"),
            ),
            (
                "intent settled unknown: stop",
                Some(entry(CallState::Intent)),
                true,
                Some(settled(Outcome::Unknown, None)),
                Err("JournalUnknown"),
            ),
        ];
        for (name, rec, at_end, s, want) in cases {
            let got = decide(3, rec.as_ref(), at_end, s.as_ref(), &same);
            match (got, want) {
                (Ok(g), Ok(w)) => assert_eq!(g, w, "{name}"),
                (
                    Err(Error::JournalUnknown {
                        seq: 3, ref key, ..
                    }),
                    Err("JournalUnknown"),
                ) => {
                    assert_eq!(key, "k1", "{name}")
                }
                (g, w) => panic!("{name}: got {g:?}, want {w:?}"),
            }
        }
    }

    #[test]
    fn a_different_call_at_a_recorded_position_is_a_mismatch_naming_it() {
        for (what, other) in [
            ("id", asked("call_2", "d1")),
            ("request", asked("call_1", "d2")),
        ] {
            let err = decide(3, Some(&entry(CallState::Done)), false, None, &other).unwrap_err();
            let text = err.to_string();
            assert!(
                matches!(err, Error::JournalMismatch { seq: 3, .. }),
                "{what}: {text}"
            );
            assert!(text.starts_with("journal mismatch at call 3: recorded Tool call \"call_1\" with request digest d1, asked"), "{what}: {text}");
        }
    }
}
