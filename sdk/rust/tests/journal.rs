//! The step journal against a fake API server (tests/fake): replay, intents,
//! settlements, chunks, bounds and takeover, as docs/journal.md describes them.

mod fake;

use std::cell::Cell;

use agentrun_step::journal::{
    Api, CallTokens, Error, Identity, Journal, Result, ToolEffect, ToolError, call_key,
};
use fake::FakeApi;
use serde_json::{Value, json};

const KEY: &str = "9f3c6e1d0a7b4c28e5d1f6a0b3c9e7d2";
const PREFIX: &str = "refund-refund-3fa2c1-r1-journal-";

fn open_max(api: &FakeApi, attempt: i32, max_bytes: i64) -> Result<Journal> {
    let id = Identity {
        prefix: PREFIX.into(),
        run: "refund".into(),
        run_uid: "uid-run".into(),
        step: "refund".into(),
        plan_revision: 1,
        attempt,
    };
    Journal::connect(Api::new(api.url(), "shop"), id, KEY, max_bytes)
}

fn open(api: &FakeApi, attempt: i32) -> Journal {
    open_max(api, attempt, 1 << 20).unwrap()
}

fn chunk(api: &FakeApi, k: usize) -> Value {
    api.object(&format!("{PREFIX}{k}")).expect("chunk exists")
}

fn entry(api: &FakeApi, k: usize, i: usize) -> Value {
    chunk(api, k)["spec"]["entries"][i].clone()
}

/// A model call, a read and a refund; `calls` counts what really ran.
fn refund_loop(j: &mut Journal, calls: &Cell<u32>) -> Result<Vec<Value>> {
    let plan = j.model(
        &json!({"messages": [{"role": "user", "content": "refund 4711"}]}),
        |_| {
            calls.set(calls.get() + 1);
            Ok::<_, String>((
                json!({"tool_calls": ["call_a", "call_b"]}),
                CallTokens {
                    input: 100,
                    output: 20,
                    cached: 0,
                },
            ))
        },
    )?;
    let order = j.tool(
        "call_a",
        "lookup",
        &json!({"orderId": 4711}),
        ToolEffect::None,
        |_| {
            calls.set(calls.get() + 1);
            Ok(json!({"amount": "23.90 EUR"}))
        },
    )?;
    let refund = j.tool(
        "call_b",
        "refund",
        &json!({"orderId": 4711}),
        ToolEffect::NonIdempotent,
        |key| {
            calls.set(calls.get() + 1);
            Ok(json!({"refundId": format!("rf-{}", &key[..4])}))
        },
    )?;
    Ok(vec![plan, order, refund])
}

#[test]
fn a_new_attempt_replays_recorded_calls_without_calling_again() {
    let api = FakeApi::start();
    let calls = Cell::new(0);
    let first = refund_loop(&mut open(&api, 1), &calls).unwrap();
    assert_eq!(calls.get(), 3);

    let mut again = open(&api, 2);
    let replayed = refund_loop(&mut again, &calls).unwrap();
    assert_eq!(replayed, first);
    assert_eq!(calls.get(), 3, "nothing was called again");
    assert_eq!(
        again.spent(),
        CallTokens::default(),
        "a replayed model call costs nothing"
    );
    assert_eq!(
        chunk(&api, 0)["spec"]["attempt"],
        2,
        "attempt 2 took the journal over"
    );
    let key = call_key(KEY, "call_b");
    assert_eq!(first[2], json!({"refundId": format!("rf-{}", &key[..4])}));
}

#[test]
fn a_changed_request_stops_with_a_mismatch_naming_the_position() {
    let api = FakeApi::start();
    refund_loop(&mut open(&api, 1), &Cell::new(0)).unwrap();
    let mut j = open(&api, 2);
    j.model(
        &json!({"messages": [{"role": "user", "content": "refund 4711"}]}),
        |_| -> Result<_, String> { panic!("recorded") },
    )
    .unwrap();
    let err = j
        .tool(
            "call_a",
            "lookup",
            &json!({"orderId": 4712}),
            ToolEffect::None,
            |_| panic!("not called"),
        )
        .unwrap_err();
    assert!(
        matches!(err, Error::JournalMismatch { seq: 1, .. }),
        "{err}"
    );
    let text = err.to_string();
    assert!(
        text.starts_with("journal mismatch at call 1: recorded Tool call \"call_a\""),
        "{text}"
    );
}

#[test]
fn the_intent_is_recorded_before_a_non_idempotent_call_and_only_then() {
    let api = FakeApi::start();
    let mut j = open(&api, 1);
    j.tool("call_r", "read", &json!({}), ToolEffect::Idempotent, |_| {
        assert_eq!(
            chunk(&api, 0)["spec"]["entries"],
            json!([]),
            "no intent for an idempotent call"
        );
        Ok(json!(1))
    })
    .unwrap();
    j.tool(
        "call_b",
        "refund",
        &json!({"orderId": 4711}),
        ToolEffect::NonIdempotent,
        |key| {
            let e = entry(&api, 0, 1);
            assert_eq!(
                (e["state"].as_str(), e["seq"].as_i64()),
                (Some("Intent"), Some(1))
            );
            assert_eq!(e["key"], json!(key));
            assert_eq!(e["effect"], "NonIdempotent");
            Ok(json!({"refundId": "rf-9"}))
        },
    )
    .unwrap();
    let e = entry(&api, 0, 1);
    assert_eq!(
        (e["state"].as_str(), e["response"].as_str()),
        (Some("Done"), Some(r#"{"refundId":"rf-9"}"#))
    );
}

/// Attempt 1 is lost during the refund: its intent stays open.
fn lost_during_refund(api: &FakeApi) {
    let mut j = open(api, 1);
    let err = j
        .tool(
            "call_b",
            "refund",
            &json!({"orderId": 4711}),
            ToolEffect::NonIdempotent,
            |_| Err(ToolError::Failed("connection reset".into())),
        )
        .unwrap_err();
    assert!(matches!(err, Error::Call { seq: 0, .. }), "{err}");
    assert_eq!(entry(api, 0, 0)["state"], "Intent");
}

fn refund(j: &mut Journal, calls: &Cell<u32>) -> Result<Value> {
    j.tool(
        "call_b",
        "refund",
        &json!({"orderId": 4711}),
        ToolEffect::NonIdempotent,
        |key| {
            calls.set(calls.get() + 1);
            assert_eq!(
                key,
                call_key(KEY, "call_b"),
                "called again with the same key"
            );
            Ok(json!({"refundId": "rf-10"}))
        },
    )
}

#[test]
fn an_unanswered_intent_stops_the_next_attempt_without_calling() {
    let api = FakeApi::start();
    lost_during_refund(&api);
    let calls = Cell::new(0);
    let err = refund(&mut open(&api, 2), &calls).unwrap_err();
    match &err {
        Error::JournalUnknown {
            seq,
            call_id,
            name,
            key,
            attempt,
        } => {
            assert_eq!(
                (*seq, call_id.as_str(), name.as_str(), *attempt),
                (0, "call_b", "refund", 1)
            );
            assert_eq!(key, &call_key(KEY, "call_b"));
        }
        other => panic!("want JournalUnknown, got {other}"),
    }
    assert_eq!(calls.get(), 0);
}

#[test]
fn a_settled_intent_replays_applied_or_calls_again_when_not_applied() {
    let calls = Cell::new(0);
    let applied = FakeApi::start();
    lost_during_refund(&applied);
    applied.settle(
        &format!("{PREFIX}0"),
        0,
        "Applied",
        Some(r#"{"refundId":"rf-9"}"#),
    );
    assert_eq!(
        refund(&mut open(&applied, 2), &calls).unwrap(),
        json!({"refundId": "rf-9"})
    );
    assert_eq!(calls.get(), 0, "an applied call is not called again");

    let by_person = FakeApi::start();
    lost_during_refund(&by_person);
    by_person.settle(&format!("{PREFIX}0"), 0, "Applied", None);
    assert_eq!(
        refund(&mut open(&by_person, 2), &calls).unwrap(),
        json!({"settled": "Applied", "by": "alice@example.com"})
    );
    assert_eq!(calls.get(), 0);

    let not_applied = FakeApi::start();
    lost_during_refund(&not_applied);
    not_applied.settle(&format!("{PREFIX}0"), 0, "NotApplied", None);
    assert_eq!(
        refund(&mut open(&not_applied, 2), &calls).unwrap(),
        json!({"refundId": "rf-10"})
    );
    assert_eq!(calls.get(), 1, "a call that did not act is called again");
    let e = entry(&not_applied, 0, 0);
    assert_eq!(
        (e["state"].as_str(), e["attempt"].as_i64()),
        (Some("Done"), Some(2))
    );
    assert_eq!(
        chunk(&not_applied, 0)["spec"]["entries"]
            .as_array()
            .unwrap()
            .len(),
        1,
        "recorded at its position"
    );
}

#[test]
fn not_applied_replays_before_the_end_and_is_called_again_at_the_end() {
    let api = FakeApi::start();
    let declined = |j: &mut Journal, calls: &Cell<u32>| {
        j.tool(
            "call_c",
            "charge",
            &json!({"cents": 2390}),
            ToolEffect::NonIdempotent,
            |_| {
                calls.set(calls.get() + 1);
                Err(ToolError::NotApplied("card declined".into()))
            },
        )
    };
    let calls = Cell::new(0);
    let mut j = open(&api, 1);
    assert!(matches!(
        declined(&mut j, &calls),
        Err(Error::NotApplied { seq: 0, .. })
    ));
    assert_eq!(entry(&api, 0, 0)["error"], "card declined");
    // At the end of the journal: called again.
    let mut j = open(&api, 2);
    assert!(matches!(
        declined(&mut j, &calls),
        Err(Error::NotApplied { seq: 0, .. })
    ));
    assert_eq!(calls.get(), 2);
    j.model(&json!({"after": "declined"}), |_| {
        Ok::<_, String>((json!("try another card"), CallTokens::default()))
    })
    .unwrap();
    // Before the end: returned as it was, not called.
    let mut j = open(&api, 3);
    let err = declined(&mut j, &calls).unwrap_err();
    assert_eq!(
        err.to_string(),
        "tool call 0 (\"call_c\") did not act: card declined"
    );
    assert_eq!(calls.get(), 2);
}

/// Model calls for turns `turns`, each answer `pad` bytes long.
fn model_calls(j: &mut Journal, turns: std::ops::Range<usize>, pad: usize) {
    for i in turns {
        j.model(&json!({"turn": i}), |_| {
            Ok::<_, String>((json!({"say": "x".repeat(pad)}), CallTokens::default()))
        })
        .unwrap();
    }
}

#[test]
fn the_write_that_fills_a_chunk_seals_it_and_the_next_call_opens_another() {
    let api = FakeApi::start();
    model_calls(&mut open(&api, 1), 0..33, 10);
    let c0 = chunk(&api, 0);
    assert_eq!(
        (
            c0["spec"]["sealed"].as_bool(),
            c0["spec"]["entries"].as_array().unwrap().len()
        ),
        (Some(true), 32)
    );
    let c1 = chunk(&api, 1);
    assert_eq!(
        (
            c1["spec"]["firstSeq"].as_i64(),
            c1["spec"]["chunk"].as_i64()
        ),
        (Some(32), Some(1))
    );
    assert_eq!(c1["spec"]["entries"][0]["seq"], 32);
    assert_eq!(c1["metadata"]["labels"]["agentrun.dev/run"], "refund");
    assert_eq!(
        c1["metadata"]["ownerReferences"],
        json!([{"apiVersion": "agentrun.dev/v1alpha1", "kind": "AgentRun", "name": "refund", "uid": "uid-run"}])
    );
    // A new attempt replays all 33 and records the 34th in chunk 1.
    let mut j = open(&api, 2);
    model_calls(&mut j, 0..33, 10);
    assert_eq!(j.spent(), CallTokens::default());
    model_calls(&mut j, 33..34, 10);
    assert_eq!(
        chunk(&api, 1)["spec"]["entries"].as_array().unwrap().len(),
        2
    );
    assert_eq!(
        chunk(&api, 0)["spec"]["attempt"],
        1,
        "a sealed chunk is never written again"
    );
}

#[test]
fn a_loop_writes_bytes_linear_in_its_calls() {
    let bytes = |n: usize| {
        let api = FakeApi::start();
        model_calls(&mut open(&api, 1), 0..n, 200);
        api.bytes_received()
    };
    let (b100, b200) = (bytes(100), bytes(200));
    // O(calls): doubling the calls doubles the bytes (rewriting the whole
    // journal on each call would quadruple them).
    let ratio = b200 as f64 / b100 as f64;
    assert!(
        ratio < 2.2,
        "100 calls sent {b100} bytes, 200 sent {b200}: ratio {ratio:.2}"
    );
    assert!(b200 < 200 * 20 * 400, "200 calls sent {b200} bytes");
}

#[test]
fn an_oversized_answer_and_a_full_journal_are_refused_with_the_numbers() {
    let api = FakeApi::start();
    let mut j = open(&api, 1);
    let err = j
        .tool("call_big", "export", &json!({}), ToolEffect::None, |_| {
            Ok(json!("x".repeat(200_000)))
        })
        .unwrap_err();
    assert!(
        matches!(
            err,
            Error::EntryTooLarge {
                seq: 0,
                size: 200_002,
                max: 131_072
            }
        ),
        "{err}"
    );
    assert_eq!(
        chunk(&api, 0)["spec"]["entries"],
        json!([]),
        "nothing recorded"
    );

    let api = FakeApi::start();
    let mut j = open_max(&api, 1, 4096).unwrap();
    model_calls(&mut j, 0..3, 1000);
    let err = j
        .model(&json!({"turn": 3}), |_| {
            Ok::<_, String>((json!({"say": "x".repeat(1000)}), CallTokens::default()))
        })
        .unwrap_err();
    match err {
        Error::JournalFull {
            seq: 3,
            would,
            max: 4096,
        } => assert!(would > 4096, "{would}"),
        other => panic!("want JournalFull, got {other}"),
    }
    assert_eq!(
        chunk(&api, 0)["spec"]["entries"].as_array().unwrap().len(),
        3
    );
}

/// The refund after attempt 2 has taken the journal over from attempt 1.
fn fenced_refund(api: &FakeApi) {
    let mut old = open(api, 1);
    model_calls(&mut old, 0..1, 10);
    let mut new = open(api, 2);
    let err = old
        .tool(
            "call_b",
            "refund",
            &json!({"orderId": 4711}),
            ToolEffect::NonIdempotent,
            |_| panic!("an older attempt starts no call once fenced"),
        )
        .unwrap_err();
    assert!(
        matches!(err, Error::JournalTakenOver { attempt: 1, by: 2 }),
        "{err}"
    );
    assert_eq!(
        chunk(api, 0)["spec"]["entries"].as_array().unwrap().len(),
        1,
        "no intent of attempt 1"
    );
    // The newer attempt goes on; the older one opening again is refused at once.
    model_calls(&mut new, 0..3, 10);
    assert!(matches!(
        open_max(api, 1, 1 << 20),
        Err(Error::JournalTakenOver { attempt: 1, by: 2 })
    ));
}

#[test]
fn a_newer_attempt_fences_an_older_one_still_running() {
    // The API server checks the resourceVersion before the CRD's rules and the
    // admission policy: the older attempt's write is a 409, then it reads the chunk.
    let api = FakeApi::start();
    fenced_refund(&api);
    assert!(
        api.seen()
            .iter()
            .any(|s| s.method == "PUT" && s.status == 409)
    );
}

#[test]
fn a_refusal_by_the_journals_policy_is_read_as_a_takeover() {
    // The chart's policy refuses an update from an attempt older than the chunk's (403).
    let api = FakeApi::start();
    api.policy_answers_first();
    fenced_refund(&api);
    assert!(
        api.seen()
            .iter()
            .any(|s| s.method == "PUT" && s.status == 403),
        "{:?}",
        api.seen()
            .iter()
            .map(|s| (s.method.clone(), s.status))
            .collect::<Vec<_>>()
    );
}

#[test]
fn an_older_attempt_is_fenced_when_a_newer_one_opened_the_next_chunk() {
    let api = FakeApi::start();
    let mut old = open(&api, 1);
    model_calls(&mut old, 0..32, 10);
    let _new = open(&api, 2);
    assert_eq!(
        chunk(&api, 1)["spec"]["attempt"],
        2,
        "the sealed chunk is left, the next one opened"
    );
    let err = old
        .tool(
            "call_b",
            "refund",
            &json!({}),
            ToolEffect::NonIdempotent,
            |_| panic!("fenced"),
        )
        .unwrap_err();
    assert!(
        matches!(err, Error::JournalTakenOver { attempt: 1, by: 2 }),
        "{err}"
    );
    assert!(
        api.seen()
            .iter()
            .any(|s| s.method == "POST" && s.status == 409)
    );
}

#[test]
fn a_status_write_between_read_and_write_does_not_stop_the_loop() {
    let api = FakeApi::start();
    let mut j = open(&api, 1);
    model_calls(&mut j, 0..1, 10);
    api.settle(&format!("{PREFIX}0"), 0, "Unknown", None);
    model_calls(&mut j, 1..2, 10);
    assert_eq!(
        chunk(&api, 0)["spec"]["entries"].as_array().unwrap().len(),
        2
    );
}

#[test]
fn chunks_are_read_as_the_crd_defines_them() {
    let api = FakeApi::start();
    refund_loop(&mut open(&api, 1), &Cell::new(0)).unwrap();
    let c: agentrun_api::StepJournal = serde_json::from_value(chunk(&api, 0)).unwrap();
    assert_eq!(
        (
            c.spec.run_uid.as_str(),
            c.spec.plan_revision,
            c.spec.attempt
        ),
        ("uid-run", 1, 1)
    );
    let refund = &c.spec.entries[2];
    assert_eq!(
        refund.key.as_deref(),
        Some(agentrun_api::call_key(KEY, "call_b").as_str())
    );
    assert_eq!(refund.effect, Some(agentrun_api::Effect::NonIdempotent));
    assert_eq!(
        c.spec.entries[0].tokens,
        Some(agentrun_api::CallTokens {
            input: 100,
            output: 20,
            cached: 0
        })
    );
    let back = serde_json::to_value(&c.spec).unwrap();
    assert_eq!(
        back,
        chunk(&api, 0)["spec"],
        "nothing the SDK writes is lost by the CRD's types"
    );
}

#[test]
fn a_journal_of_another_run_with_the_same_name_is_refused() {
    let api = FakeApi::start();
    model_calls(&mut open(&api, 1), 0..1, 10);
    let id = Identity {
        prefix: PREFIX.into(),
        run: "refund".into(),
        run_uid: "uid-new-run".into(),
        step: "refund".into(),
        plan_revision: 1,
        attempt: 1,
    };
    let err = Journal::connect(Api::new(api.url(), "shop"), id, KEY, 1 << 20)
        .err()
        .unwrap();
    assert!(
        err.to_string()
            .contains("belongs to run uid uid-run, not uid-new-run"),
        "{err}"
    );
}

#[test]
fn a_call_called_again_after_not_applied_and_lost_again_is_not_called_a_third_time() {
    let api = FakeApi::start();
    lost_during_refund(&api);
    api.settle(&format!("{PREFIX}0"), 0, "NotApplied", None);
    // Attempt 2 calls it again and is lost during the call too.
    let err = open(&api, 2)
        .tool(
            "call_b",
            "refund",
            &json!({"orderId": 4711}),
            ToolEffect::NonIdempotent,
            |_| Err(ToolError::Failed("connection reset".into())),
        )
        .unwrap_err();
    assert!(matches!(err, Error::Call { seq: 0, .. }), "{err}");
    let e = entry(&api, 0, 0);
    assert_eq!(
        (e["state"].as_str(), e["attempt"].as_i64()),
        (Some("Intent"), Some(2))
    );
    // Attempt 1's settlement does not answer attempt 2's intent.
    let calls = Cell::new(0);
    let err = refund(&mut open(&api, 3), &calls).unwrap_err();
    assert!(matches!(err, Error::JournalUnknown { .. }), "{err}");
    assert_eq!(calls.get(), 0, "never called a third time unasked");
}
