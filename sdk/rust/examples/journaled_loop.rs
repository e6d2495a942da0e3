//! An agent loop whose model and tool calls are journaled (docs/journal.md):
//! run again after an eviction, it replays what was recorded and goes on
//! from the first call that was not.
//!
//! In a step Pod with `journal: {}` set on the step:
//!     journaled_loop
//! Against a local API server (e.g. `kubectl proxy` on 8001), for a try:
//!     AGENTRUN_JOURNAL_URL=http://127.0.0.1:8001 journaled_loop

use agentrun_step::journal::{
    Api, CallTokens, ENV_JOURNAL, ENV_NAMESPACE, ENV_RUN_UID, Error, Identity, Journal, ToolEffect,
    ToolError,
};
use agentrun_step::{Step, Tokens};
use serde_json::{Value, json};

/// Stands in for a model API: asks for a refund once, then finishes.
fn ask_model(request: &Value) -> Result<(Value, CallTokens), String> {
    let turns = request["messages"].as_array().map_or(0, Vec::len);
    let answer = if turns < 2 {
        json!({"tool_call": {"id": "call_refund_1", "name": "refund", "arguments": {"orderId": 4711}}})
    } else {
        json!({"content": "Refunded order 4711."})
    };
    Ok((
        answer,
        CallTokens {
            input: 800,
            output: 40,
            cached: 0,
        },
    ))
}

/// Stands in for a payments API that dedupes on the Idempotency-Key.
fn refund(args: &Value, key: &str) -> Result<Value, ToolError> {
    if args["orderId"].is_null() {
        return Err(ToolError::NotApplied("no order given".into()));
    }
    Ok(json!({"refundId": format!("rf-{}", &key[..8])}))
}

fn open(step: &Step) -> Result<Journal, Error> {
    match std::env::var("AGENTRUN_JOURNAL_URL") {
        Ok(url) => {
            let env = |n: &str| std::env::var(n).unwrap_or_default();
            let api = Api::new(&url, &env(ENV_NAMESPACE));
            let id = Identity {
                prefix: env(ENV_JOURNAL),
                run: step.run.clone(),
                run_uid: env(ENV_RUN_UID),
                step: step.step.clone(),
                plan_revision: step.plan_revision,
                attempt: step.attempt as i32,
            };
            Journal::connect(api, id, &step.idempotency_key, 1 << 20)
        }
        Err(_) => Journal::open(step),
    }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let step = Step::load()?;
    let mut journal = open(&step)?;
    let mut messages = vec![json!({"role": "user", "content": "Refund order 4711"})];
    let answer = loop {
        let reply = journal.model(&json!({"model": "m", "messages": messages}), ask_model)?;
        let Some(call) = reply.get("tool_call") else {
            break reply["content"].clone();
        };
        let (id, name, args) = (
            call["id"].as_str().unwrap_or_default(),
            "refund",
            &call["arguments"],
        );
        let result = match journal.tool(id, name, args, ToolEffect::NonIdempotent, |key| {
            refund(args, key)
        }) {
            Ok(v) => v,
            // The tool did not act: tell the model and go on.
            Err(Error::NotApplied { reason, .. }) => json!({"error": reason}),
            Err(e) => return Err(e.into()),
        };
        messages.push(reply.clone());
        messages.push(json!({"role": "tool", "tool_call_id": id, "content": result}));
    };
    // Journaled model calls are counted from the journal, once: report the
    // journal's whole and nothing outside it.
    step.succeed_journaled(
        &json!({"answer": answer}),
        Some(Tokens::default()),
        &journal,
    )?;
    Ok(())
}
