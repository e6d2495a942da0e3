//! A journaled step's calls as people see them: StepJournal chunks created
//! with the test's admin client (the operator's and the step SDKs' part is
//! theirs), read by `describe` and `logs` as the users they run as. The
//! chart's viewer and approver roles read journals; a signaler (a machine
//! that sends events) does not, and the API server says so.

use std::time::Duration;

use agentrun_e2e::kubectl_ok;
use agentrun_e2e::support::policies::{Policies, assert_admitted, assert_refused, kubectl_as};
use agentrun_e2e::support::scenario::{Scenario, sim_step, status};
use agentrun_operator::api::{StepJournal, StepPhase};
use kube::Api;
use kube::api::{Patch, PatchParams, PostParams};
use serde_json::{Value, json};

use super::plugin;

const RUN_TIMEOUT: Duration = Duration::from_secs(90);

/// What describe prints for the chunks below, literally (the same calls
/// as plugin/tests/render/journal.rs's first case).
const JOURNAL_BLOCK: &str = "      Journal: 5 calls (2 model, 3 tool) in 2 chunks, 1 sealed
      190 B of 4 KiB, 300 tokens; attempt 2 replayed 3 calls of attempt 1
      SEQ  KIND   ID          NAME       EFFECT         STATE    TOKENS  BY
      0    model  model-0     claude     -              Done     120     a1
      1    tool   toolu_01A…  lookup_o…  Idempotent     Done     -       a1
      2    tool   call_pay    charge     NonIdempotent  Applied  -       a1
        ↳ settled Applied by alice at 2026-12-02T01:02:00Z
      3    model  model-3     claude     -              Done     180     a2
      4    tool   call_refu…  refund     NonIdempotent  Unknown  -       a2
      ! call 4 refund is Unknown: it may have acted, and nobody has settled it
        id call_refund  key 3e3fe9b4ae2107749f6eac4ef0653153
";

fn model(seq: i64, attempt: i32, tokens: (i64, i64), response: &str) -> Value {
    json!({"seq": seq, "callId": format!("model-{seq}"), "kind": "Model",
           "requestDigest": format!("d{seq}"), "name": "claude", "state": "Done",
           "attempt": attempt, "response": response,
           "tokens": {"input": tokens.0, "output": tokens.1}})
}

fn tool(seq: i64, attempt: i32, id: &str, name: &str, effect: &str, key: &str) -> Value {
    json!({"seq": seq, "callId": id, "kind": "Tool", "requestDigest": format!("d{seq}"),
           "effect": effect, "key": key, "name": name, "state": "Intent", "attempt": attempt})
}

fn done(mut call: Value, response: &str) -> Value {
    call["state"] = json!("Done");
    call["response"] = json!(response);
    call
}

/// Chunk `chunk` of the journal whose step Pods are named `<prefix>-a<n>`,
/// owned by the run, as the step SDK writes it.
fn chunk(
    prefix: &str,
    run_uid: &str,
    chunk: i32,
    attempt: i32,
    sealed: bool,
    entries: Vec<Value>,
) -> StepJournal {
    let first = entries[0]["seq"].clone();
    serde_json::from_value(json!({
        "apiVersion": "agentrun.dev/v1alpha1", "kind": "StepJournal",
        "metadata": {
            "name": format!("{prefix}-journal-{chunk}"),
            "labels": {"agentrun.dev/run": "agent"},
            "ownerReferences": [{"apiVersion": "agentrun.dev/v1alpha1", "kind": "AgentRun",
                                 "name": "agent", "uid": run_uid}],
        },
        "spec": {"runName": "agent", "runUid": run_uid, "step": "agent", "planRevision": 1,
                 "chunk": chunk, "firstSeq": first, "attempt": attempt, "sealed": sealed,
                 "entries": entries},
    }))
    .unwrap()
}

/// A step whose first attempt fails and whose second runs on; its journal
/// says attempt 1 asked the model, looked the order up and charged (settled
/// Applied by alice), attempt 2 replayed those, asked again and was in the
/// middle of a refund. describe shows exactly that to a viewer, with the
/// refund prominent as Unknown with its key; logs show each attempt's own
/// calls; an approver may read the chunks too, a signaler may not.
#[tokio::test]
async fn describe_shows_a_journaled_steps_calls_to_a_viewer_and_a_signaler_may_not_read_them() {
    let s = Scenario::start("plugin-journal").await;
    let ns = s.namespace().to_owned();
    let policies = Policies::install(&ns, &[]).await;
    policies.grant_role(&ns, "viewer", &["vera"]).await;
    policies.grant_role(&ns, "approver", &["alice"]).await;
    policies.grant_role(&ns, "signaler", &["ci-bot"]).await;
    // describe lists the run's Events too, which the viewer role does not grant.
    kubectl_ok([
        "-n",
        &ns,
        "create",
        "role",
        "events-reader",
        "--verb=get,list",
        "--resource=events.events.k8s.io",
    ])
    .await;
    kubectl_ok([
        "-n",
        &ns,
        "create",
        "rolebinding",
        "events-readers",
        "--role=events-reader",
        "--user=vera",
    ])
    .await;

    let mut step = sim_step(
        "agent",
        "Idempotent",
        json!({"attempts": [{"exitCode": 1}, {"hang": true}]}),
    );
    step["retry"] = json!({"limit": 2, "backoff": {"initial": "1s", "max": "1s"}});
    step["journal"] = json!({"maxBytes": 4096});
    // A journaled step's Pod gets a token bound to it, which names its
    // ServiceAccount.
    s.create_run(
        "agent",
        json!({"steps": [step], "podTemplate": {"serviceAccountName": "default"}}),
    )
    .await;
    let r = s
        .wait_run(
            "agent",
            "attempt 2 of step agent running",
            RUN_TIMEOUT,
            |r| {
                status(r)
                    .steps
                    .iter()
                    .any(|c| c.name == "agent" && c.attempt == 2 && c.phase == StepPhase::Running)
            },
        )
        .await;
    let uid = r.metadata.uid.clone().unwrap();
    let pod = status(&r).steps[0].pod.clone().expect("the attempt's Pod");
    let prefix = pod.strip_suffix("-a2").expect("attempt 2's Pod name");

    let journals: Api<StepJournal> = s.env().api();
    let pp = PostParams::default();
    let first = chunk(
        prefix,
        &uid,
        0,
        1,
        true,
        vec![
            model(0, 1, (100, 20), r#"{"text":"look up"}"#),
            done(
                tool(
                    1,
                    1,
                    "toolu_01A09q90qw90lq917835lq9",
                    "lookup_order",
                    "Idempotent",
                    "k1",
                ),
                r#"{"order":7}"#,
            ),
            tool(2, 1, "call_pay", "charge", "NonIdempotent", "k2"),
        ],
    );
    journals.create(&pp, &first).await.expect("chunk 0");
    journals
        .patch_status(
            &format!("{prefix}-journal-0"),
            &PatchParams::default(),
            &Patch::Merge(json!({"status": {"settlements": [{
                "seq": 2, "attempt": 1, "outcome": "Applied", "response": r#"{"paid":1}"#,
                "by": "alice", "at": "2026-12-02T01:02:00Z",
            }]}})),
        )
        .await
        .expect("settling call 2");
    let second = chunk(
        prefix,
        &uid,
        1,
        2,
        false,
        vec![
            model(3, 2, (150, 30), r#"{"text":"refund"}"#),
            tool(
                4,
                2,
                "call_refund",
                "refund",
                "NonIdempotent",
                "3e3fe9b4ae2107749f6eac4ef0653153",
            ),
        ],
    );
    journals.create(&pp, &second).await.expect("chunk 1");

    let out = plugin(&ns, Some("vera"), &[], &["describe", "agent"]).await;
    assert_eq!(out.code, 0, "{}", out.stderr);
    let want = "  ▶ agent  r1 attempt 2  Running  effect ";
    assert!(out.stdout.contains(want), "{}", out.stdout);
    // The block follows the step's own lines (its Pod, then what it says).
    let block = out.stdout.find(JOURNAL_BLOCK);
    let pod_line = out.stdout.find(&format!("      pod {pod}\n"));
    assert!(
        matches!((pod_line, block), (Some(p), Some(b)) if p < b),
        "{}\n{}",
        out.stdout,
        out.stderr
    );
    assert!(out.stderr.is_empty(), "{}", out.stderr);
    assert_admitted(
        &kubectl_as("vera", &[], &ns, &["get", "stepjournals"]).await,
        "a viewer reading the journals",
    );
    // Who answers a Reconcile question about call 4 reads what the step did.
    assert_admitted(
        &kubectl_as("alice", &[], &ns, &["get", "stepjournals"]).await,
        "an approver reading the journals",
    );

    // Each attempt's own calls after its (simulated Pods': absent) log.
    let logs = plugin(&ns, None, &[], &["logs", "agent", "agent"]).await;
    assert_eq!(logs.code, 0, "{}", logs.stderr);
    for want in [
        "--- journal of step agent r1, attempt 1: recorded 3 calls ---\n",
        "--- journal of step agent r1, attempt 2: replayed 3 calls, recorded 2 calls ---\n",
        "    ! call 4 refund is Unknown: it may have acted, and nobody has settled it\n",
    ] {
        assert!(logs.stdout.contains(want), "{want}\n{}", logs.stdout);
    }

    // A machine that sends signals reads runs, not what their steps said.
    assert_refused(
        &kubectl_as("ci-bot", &[], &ns, &["get", "stepjournals"]).await,
        "forbidden",
    );
    s.finish().await;
}
