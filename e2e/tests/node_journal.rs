//! A durable agent loop on the real node (`e2e/cluster node up`), D19: the example refund
//! agent's `refund-loop` — a tool-calling loop written with the official `openai` package
//! against the scripted mock model (examples/mock-model), its calls journaled by the step
//! SDK — is killed during its NonIdempotent refund, after the refund was made and before
//! the agent heard. The retry replays what was recorded (the model is not asked again), the
//! refund is settled by the step's verify probe asking the payments service by the call's
//! own key, the calls after it run once, and the tokens of every model call count once.
//! Fails, never skips, without the node.
//!
//! ```text
//!   attempt 1: model ─▶ lookup_order ─▶ model ─▶ check_policy ─▶ model ─▶ issue_refund (intent; refund made, answer held)
//!              Pod deleted here
//!   verify-call (AGENTRUN_CALL_KEY) ─▶ GET /refunds?idempotencyKey ─▶ Applied ─▶ settled in the journal
//!   attempt 2: replays 3 model answers and 2 tool results, the refund's settled result,
//!              then model ─▶ get_refund, notify_customer ─▶ model ─▶ get_refund ─▶ model (answer)
//! ```

use std::time::Duration;

use agentrun_e2e::support::journal::JOURNAL_WRITER_ENV;
use agentrun_e2e::support::node::{MockModel, Payments, node_scenario, pod_template};
use agentrun_e2e::support::policies::{Policies, wait_enforced};
use agentrun_e2e::support::scenario::{phase, status, step_checkpoint};
use agentrun_operator::api::{
    CallKind, CallState, EffectOutcome, JournalEntry, RunPhase, StepJournal, StepPhase, StepRole,
};
use kube::api::{Api, DeleteParams, ListParams};
use serde_json::{Value, json};

const RUN_TIMEOUT: Duration = Duration::from_secs(300);

fn refund_loop(payments: &Payments, model: &MockModel) -> Value {
    let mut agent = payments.agent(&["refund-loop"]);
    agent["env"]
        .as_array_mut()
        .expect("the agent's env")
        .push(json!({"name": "OPENAI_BASE_URL", "value": model.url()}));
    json!({
        "podTemplate": pod_template(),
        "steps": [{
            "name": "refund", "effect": "NonIdempotent", "timeout": "240s",
            "journal": {},
            "retry": {"limit": 1, "backoff": {"initial": "1s", "max": "1s"}},
            "container": agent,
            "verify": payments.agent(&["verify-call"]),
        }],
    })
}

/// Every journaled call of the run, in order.
async fn calls(
    journals: &Api<StepJournal>,
) -> Vec<(JournalEntry, Vec<agentrun_operator::api::Settlement>)> {
    let mut chunks = journals
        .list(&ListParams::default().labels("agentrun.dev/run=refund"))
        .await
        .expect("listing the journal")
        .items;
    chunks.sort_by_key(|c| c.spec.chunk);
    chunks
        .into_iter()
        .flat_map(|c| {
            let settled = c.status.map(|s| s.settlements).unwrap_or_default();
            c.spec
                .entries
                .into_iter()
                .map(move |e| (e, settled.clone()))
        })
        .collect()
}

#[tokio::test]
async fn an_agent_loop_killed_during_its_refund_resumes_from_its_journal_without_asking_or_acting_again()
 {
    let mut s = node_scenario("node-journal").await;
    let ns = s.namespace().to_owned();
    // The chart's policies (the journals policy among them) and an operator that
    // binds the step's ServiceAccount to this release's journal-writer role.
    let p = Policies::install(&ns, &[]).await;
    wait_enforced(&ns, true).await;
    s.kill_operator().await;
    s.operator_config.extra_env.push((
        JOURNAL_WRITER_ENV.into(),
        format!("{}-journal-writer", p.release),
    ));
    s.start_operator(None);

    let payments = Payments::start(&ns, 0.0).await;
    let model = MockModel::start(&ns).await;
    // The refund is made, and its answer held: the agent never hears it.
    payments.stall(&["/refunds"]).await;
    s.create_run("refund", refund_loop(&payments, &model)).await;
    let key = payments.wait_for_refund().await;

    let journals: Api<StepJournal> = Api::namespaced(s.env().client(), &ns);
    // The intent is recorded before the refund is asked for.
    let recorded = calls(&journals).await;
    let (intent, _) = recorded
        .last()
        .expect("attempt 1 recorded its calls")
        .clone();
    assert_eq!(
        (
            intent.kind,
            intent.state,
            intent.name.as_deref(),
            intent.key.as_deref()
        ),
        (
            CallKind::Tool,
            CallState::Intent,
            Some("issue_refund"),
            Some(key.as_str())
        ),
        "the refund's key is the call's own: {recorded:#?}"
    );
    let asked_before = model.requests().await.len();
    assert_eq!(asked_before, 3, "three model turns led to the refund");

    // The Pod is deleted during the call.
    let run = s.runs().get("refund").await.unwrap();
    let pod = step_checkpoint(&run, "refund")
        .pod
        .expect("attempt 1's Pod");
    s.pods()
        .delete(&pod, &DeleteParams::default().grace_period(1))
        .await
        .expect("deleting attempt 1's Pod");
    // Once the operator is asking the probe, the held answer may go (to nobody).
    s.wait_run(
        "refund",
        "its verify probe asked about the refund",
        RUN_TIMEOUT,
        |r| {
            status(r)
                .steps
                .iter()
                .any(|c| c.role == StepRole::Verify && c.pod.is_some())
        },
    )
    .await;
    payments.stall(&[]).await;

    let done = s.wait_finished("refund", RUN_TIMEOUT).await;
    assert_eq!(
        phase(&done),
        Some(RunPhase::Succeeded),
        "{:#?}",
        done.status
    );
    let c = step_checkpoint(&done, "refund");
    assert_eq!(
        (c.phase, c.attempt),
        (StepPhase::Succeeded, 2),
        "{:?}",
        c.message
    );

    // What really happened: one refund, one notification.
    let ledger = payments.ledger().await;
    assert_eq!(
        ledger["refunds"].as_array().map(Vec::len),
        Some(1),
        "{ledger:#}"
    );
    assert_eq!(
        ledger["notifications"].as_array().map(Vec::len),
        Some(1),
        "{ledger:#}"
    );
    // The model was asked each turn once: attempt 2 asked only what came after the refund.
    let asked = model.requests().await;
    let tool_results: Vec<usize> = asked
        .iter()
        .map(|r| {
            r["body"]["messages"]
                .as_array()
                .map_or(0, |m| m.iter().filter(|m| m["role"] == "tool").count())
        })
        .collect();
    assert_eq!(tool_results, vec![0, 1, 2, 3, 5, 6], "each turn asked once");

    // The journal: the refund settled by the probe, the calls before it recorded by
    // attempt 1 (replayed, never rewritten), the calls after it by attempt 2.
    let recorded = calls(&journals).await;
    let by_attempt: Vec<(String, i32)> = recorded
        .iter()
        .map(|(e, _)| match e.kind {
            CallKind::Model => ("model".to_owned(), e.attempt),
            CallKind::Tool => (e.name.clone().unwrap_or_default(), e.attempt),
        })
        .collect();
    assert_eq!(
        by_attempt
            .iter()
            .map(|(n, a)| format!("{n}@{a}"))
            .collect::<Vec<_>>(),
        [
            "model@1",
            "lookup_order@1",
            "model@1",
            "check_policy@1",
            "model@1",
            "issue_refund@1",
            "model@2",
            "get_refund@2",
            "notify_customer@2",
            "model@2",
            "get_refund@2",
            "model@2",
        ]
        .map(String::from)
        .to_vec(),
        "{recorded:#?}"
    );
    let (refund, settled) = &recorded[5];
    let s0 = settled
        .iter()
        .find(|x| x.seq == refund.seq)
        .expect("the refund is settled");
    assert_eq!(
        (s0.outcome, s0.by.as_str()),
        (EffectOutcome::Applied, "verify")
    );

    // Tokens: every model call once, as the model billed it.
    let billed: i64 = asked
        .iter()
        .map(|r| {
            r["reply"]["usage"]["prompt_tokens"].as_i64().unwrap_or(0)
                + r["reply"]["usage"]["completion_tokens"]
                    .as_i64()
                    .unwrap_or(0)
        })
        .sum();
    assert!(billed > 0);
    assert_eq!(status(&done).tokens_used, billed);
    assert!(
        s.approvals()
            .list(&Default::default())
            .await
            .unwrap()
            .items
            .is_empty(),
        "nobody was asked"
    );
    // The run's record keeps what its calls came to after the run is gone (D18).
    let uid = done.metadata.uid.clone().unwrap();
    let record = Api::<agentrun_operator::api::RunRecord>::namespaced(s.env().client(), &ns)
        .get(&format!("refund-{}", &uid[..8]))
        .await
        .expect("the run's record");
    let step = record
        .spec
        .steps
        .iter()
        .find(|c| c.name == "refund")
        .unwrap();
    assert_eq!(
        step.journal,
        Some(agentrun_operator::api::RecordedJournal {
            calls: 12,
            settled: 1
        })
    );
    assert_eq!(step.tokens, billed);
    s.finish().await;
}
