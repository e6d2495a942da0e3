//! Fixed StepJournal chunks for the journal views' tests (render.rs and
//! console.rs): the shapes the step SDKs write (docs/journal.md), built
//! here so each case says what it holds.

#![allow(dead_code)]

use agentrun_api::{AgentRun, StepJournal};
use serde_json::{Value, json};

/// 2026-12-02T01:00:00Z plus `secs`.
pub fn t(secs: i64) -> String {
    let t0: jiff::Timestamp = "2026-12-02T01:00:00Z".parse().unwrap();
    (t0 + jiff::SignedDuration::from_secs(secs)).to_string()
}

/// A model call recorded by `attempt`, from `at` to `at + 1` s.
pub fn model(seq: i64, attempt: i32, tokens: (i64, i64), response: &str, at: i64) -> Value {
    json!({
        "seq": seq, "callId": format!("model-{seq}"), "kind": "Model",
        "requestDigest": format!("d{seq}"), "name": "claude", "state": "Done",
        "attempt": attempt, "response": response,
        "tokens": {"input": tokens.0, "output": tokens.1},
        "startedAt": t(at), "finishedAt": t(at + 1),
    })
}

/// A tool call; `state` Intent has no response and no finish time.
#[allow(clippy::too_many_arguments)]
pub fn tool(
    seq: i64,
    attempt: i32,
    id: &str,
    name: &str,
    effect: &str,
    key: &str,
    state: &str,
    response: Option<&str>,
    at: i64,
) -> Value {
    let mut e = json!({
        "seq": seq, "callId": id, "kind": "Tool", "requestDigest": format!("d{seq}"),
        "effect": effect, "key": key, "name": name, "state": state, "attempt": attempt,
        "startedAt": t(at),
    });
    if let Some(r) = response {
        e["response"] = json!(r);
        e["finishedAt"] = json!(t(at + 2));
    }
    e
}

/// Chunk `chunk` of step `step`'s journal at `rev`, of run `crawl` (UID u1).
pub fn chunk(
    step: &str,
    rev: i64,
    chunk: i32,
    attempt: i32,
    sealed: bool,
    entries: Vec<Value>,
    settlements: Vec<Value>,
) -> StepJournal {
    let first = entries.first().map_or(0, |e| e["seq"].as_i64().unwrap());
    serde_json::from_value(json!({
        "apiVersion": "agentrun.dev/v1alpha1", "kind": "StepJournal",
        "metadata": {"name": format!("crawl-{step}-0960e3-r{rev}-journal-{chunk}"), "namespace": "shop",
                     "labels": {"agentrun.dev/run": "crawl"}},
        "spec": {"runName": "crawl", "runUid": "u1", "step": step, "planRevision": rev,
                 "chunk": chunk, "firstSeq": first, "attempt": attempt, "sealed": sealed,
                 "entries": entries},
        "status": {"settlements": settlements},
    }))
    .unwrap()
}

pub fn settled(seq: i64, outcome: &str, by: &str, response: Option<&str>) -> Value {
    // Every intent the fixtures settle was written by attempt 1.
    let mut s = json!({"seq": seq, "attempt": 1, "outcome": outcome, "by": by, "at": t(120)});
    if let Some(r) = response {
        s["response"] = json!(r);
    }
    s
}

/// Run `crawl` (UID u1) whose step `agent` journals (maxBytes 4096), with
/// these checkpoints.
pub fn run(checkpoints: Vec<Value>) -> AgentRun {
    serde_json::from_value(json!({
        "apiVersion": "agentrun.dev/v1alpha1", "kind": "AgentRun",
        "metadata": {"name": "crawl", "namespace": "shop", "uid": "u1", "creationTimestamp": t(0)},
        "spec": {"steps": [{
            "name": "agent", "effect": "NonIdempotent", "journal": {"maxBytes": 4096},
            "container": {"image": "registry.example/agent:1"},
        }]},
        "status": {"phase": "Running", "steps": checkpoints},
    }))
    .unwrap()
}

/// The checkpoint of step `agent` at `rev`, on `attempt`, from `from` s.
pub fn checkpoint(rev: i64, attempt: i32, phase: &str, from: i64) -> Value {
    json!({
        "name": "agent", "planRevision": rev, "attempt": attempt,
        "idempotencyKey": format!("key-r{rev}"), "pod": format!("crawl-agent-0960e3-r{rev}-a{attempt}"),
        "phase": phase, "startedAt": t(from),
    })
}

/// The key of call `call_refund` (docs/journal.md's second vector's key).
pub const REFUND_KEY: &str = "3e3fe9b4ae2107749f6eac4ef0653153";

/// Attempt 1 asked the model, looked the order up and charged (settled
/// Applied by alice after attempt 1 was lost during it); attempt 2
/// replayed those, asked the model again and was lost during a refund.
/// Chunk 0 (attempt 1) is sealed.
pub fn replayed_and_unknown() -> Vec<StepJournal> {
    vec![
        chunk(
            "agent",
            1,
            0,
            1,
            true,
            vec![
                model(0, 1, (100, 20), r#"{"text":"look up"}"#, 10),
                tool(
                    1,
                    1,
                    "toolu_01A09q90qw90lq917835lq9",
                    "lookup_order",
                    "Idempotent",
                    "k1",
                    "Done",
                    Some(r#"{"order":7}"#),
                    12,
                ),
                tool(
                    2,
                    1,
                    "call_pay",
                    "charge",
                    "NonIdempotent",
                    "k2",
                    "Intent",
                    None,
                    15,
                ),
            ],
            vec![settled(2, "Applied", "alice", Some(r#"{"paid":1}"#))],
        ),
        chunk(
            "agent",
            1,
            1,
            2,
            false,
            vec![
                model(3, 2, (150, 30), r#"{"text":"refund"}"#, 30),
                tool(
                    4,
                    2,
                    "call_refund",
                    "refund",
                    "NonIdempotent",
                    REFUND_KEY,
                    "Intent",
                    None,
                    33,
                ),
            ],
            vec![],
        ),
    ]
}
