//! The API proofs (D13): the AgentRun and Approval CRDs, generated from the
//! Rust types, install on the real apiserver and refuse every malformed object
//! at admission with a message that names the field and says what is wrong;
//! the printer columns and the samples work with the real kubectl.

use std::path::PathBuf;

use agentrun_e2e::{TestEnv, kubectl, kubectl_ok, repo_root};
use agentrun_operator::api::{AgentRun, Approval, ApprovalPhase, Decision};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{ApiResource, DynamicObject, Patch, PatchParams, PostParams};
use kube::{Api, CustomResourceExt};
use serde_json::{Value, json};

#[path = "api_admission/step_names.rs"]
mod step_names;

const RUN_UID: &str = "0b7c6a1e-0000-4000-8000-000000000001";

fn run(spec: Value) -> Value {
    json!({ "apiVersion": "agentrun.dev/v1alpha1", "kind": "AgentRun", "metadata": {}, "spec": spec })
}

fn step(name: &str) -> Value {
    json!({ "name": name, "container": { "image": "ghcr.io/example/agent:1" } })
}

/// A one-step run whose step is `step("fetch")` with `extra` merged in.
fn run_with_step(extra: Value) -> Value {
    let mut s = step("fetch");
    merge(&mut s, extra);
    run(json!({ "steps": [s] }))
}

fn approval(kind: &str, extra: Value) -> Value {
    let mut spec = json!({
        "runName": "refund-4711", "runUid": RUN_UID, "step": "issue-refund",
        "planRevision": 1, "kind": kind, "question": "Refund 23.90 EUR?",
    });
    merge(&mut spec, extra);
    json!({ "apiVersion": "agentrun.dev/v1alpha1", "kind": "Approval", "metadata": {}, "spec": spec })
}

/// JSON merge patch semantics (RFC 7386): objects merge, `null` removes.
fn merge(target: &mut Value, patch: Value) {
    match (target, patch) {
        (Value::Object(t), Value::Object(p)) => {
            for (k, v) in p {
                if v.is_null() {
                    t.remove(&k);
                } else {
                    merge(t.entry(k).or_insert(Value::Null), v);
                }
            }
        }
        (t, p) => *t = p,
    }
}

/// One admission rule: `object` is refused on create, or — with `update` — is
/// accepted and then the merge patch `update` is refused. Either refusal must
/// be a 422 whose message contains every string of `expect`.
struct Case {
    name: &'static str,
    object: Value,
    /// Written to the status subresource after the create, before `update`.
    status: Option<Value>,
    update: Option<Value>,
    expect: &'static [&'static str],
}

fn refused(name: &'static str, object: Value, expect: &'static [&'static str]) -> Case {
    Case {
        name,
        object,
        status: None,
        update: None,
        expect,
    }
}

fn refused_update(
    name: &'static str,
    object: Value,
    update: Value,
    expect: &'static [&'static str],
) -> Case {
    Case {
        name,
        object,
        status: None,
        update: Some(update),
        expect,
    }
}

/// Like [`refused_update`], with the approval's status set to `status` first.
fn refused_update_after(
    name: &'static str,
    object: Value,
    status: Value,
    update: Value,
    expect: &'static [&'static str],
) -> Case {
    Case {
        status: Some(status),
        ..refused_update(name, object, update, expect)
    }
}

fn cases() -> Vec<Case> {
    let many_steps: Vec<Value> = (0..501).map(|i| step(&format!("s{i}"))).collect();
    let long_run_name = "r".repeat(64);
    let mut long_named_run = run(json!({ "steps": [step("fetch")] }));
    long_named_run["metadata"]["name"] = json!(long_run_name);
    let decided = |kind: &str, decision: &str| approval(kind, json!({ "decision": decision }));

    vec![
        // --- step names: DNS labels, unique, at most 48 characters ---
        refused(
            "step name with uppercase",
            run(json!({ "steps": [step("Fetch")] })),
            &["spec.steps[0].name", "Fetch"],
        ),
        refused(
            "step name with underscore",
            run(json!({ "steps": [step("fetch_order")] })),
            &["spec.steps[0].name", "fetch_order"],
        ),
        refused(
            "step name with leading dash",
            run(json!({ "steps": [step("-fetch")] })),
            &["spec.steps[0].name", "-fetch"],
        ),
        refused(
            "a step with a container and a wait",
            run_with_step(json!({ "wait": { "for": "1m" } })),
            &["a step has a container or a wait, exactly one of them"],
        ),
        refused(
            "a step with neither a container nor a wait",
            run(json!({ "steps": [{ "name": "nothing" }] })),
            &["a step has a container or a wait, exactly one of them"],
        ),
        refused(
            "a wait step that retries",
            run(
                json!({ "steps": [{ "name": "w", "wait": { "for": "1m" }, "retry": { "limit": 1 } }] }),
            ),
            &[
                "a wait step runs no container: retry, timeout, approval, compensate, verify and freshFor do not apply to it, and resultSchema only to a wait for a signal",
            ],
        ),
        refused(
            "a wait with both for and until",
            run(
                json!({ "steps": [{ "name": "w", "wait": { "for": "1m", "until": "2030-01-01T00:00:00Z" } }] }),
            ),
            &["wait: set exactly one of for, until and signal"],
        ),
        refused(
            "a wait for a signal and a time",
            run(
                json!({ "steps": [{ "name": "w", "wait": { "for": "1m", "signal": { "timeout": "1h" } } }] }),
            ),
            &["wait: set exactly one of for, until and signal"],
        ),
        refused(
            "a signal that times out at once",
            run(json!({ "steps": [{ "name": "w", "wait": { "signal": { "timeout": "0s" } } }] })),
            &["wait.signal.timeout must be longer than 0s"],
        ),
        refused(
            "a signal with an unknown onTimeout",
            run(
                json!({ "steps": [{ "name": "w", "wait": { "signal": { "onTimeout": "Approve" } } }] }),
            ),
            &["Unsupported value: \"Approve\"", "\"Fail\"", "\"Skip\""],
        ),
        refused(
            "a wait of 0s",
            run(json!({ "steps": [{ "name": "w", "wait": { "for": "0s" } }] })),
            &["wait.for must be longer than 0s"],
        ),
        refused(
            "a wait until a time that is not one",
            run(json!({ "steps": [{ "name": "w", "wait": { "until": "tomorrow" } }] })),
            &["spec.steps[0].wait.until", "tomorrow"],
        ),
        refused(
            "a planner that waits",
            run(json!({ "planner": { "name": "plan", "wait": { "for": "1m" } } })),
            &["spec.planner.wait: a planner runs a container; it cannot wait"],
        ),
        refused(
            "a result schema that is not an object",
            run_with_step(json!({ "resultSchema": "string" })),
            &["spec.steps[0].resultSchema", "must be of type object"],
        ),
        refused(
            "duplicate step names",
            run(json!({ "steps": [step("fetch"), step("fetch")] })),
            &["spec.steps: Invalid value", "step names must be unique"],
        ),
        refused(
            "step name of 49 characters",
            run(json!({ "steps": [step(&"a".repeat(49))] })),
            &["spec.steps[0].name", "48"],
        ),
        refused(
            "planner name with uppercase",
            run(json!({ "planner": step("Plan") })),
            &["spec.planner.name", "Plan"],
        ),
        // --- at least one step unless a planner, at most 500 ---
        refused(
            "empty steps and no planner",
            run(json!({ "steps": [] })),
            &[
                "spec.steps",
                "at least one step is required unless spec.planner is set",
            ],
        ),
        refused(
            "steps omitted and no planner",
            run(json!({})),
            &[
                "spec.steps",
                "at least one step is required unless spec.planner is set",
            ],
        ),
        refused(
            "501 steps",
            run(json!({ "steps": many_steps })),
            &["spec.steps", "500"],
        ),
        // --- retry and budgets ---
        refused(
            "retry limit -1",
            run_with_step(json!({ "retry": { "limit": -1 } })),
            &["spec.steps[0].retry.limit", "greater than or equal to 0"],
        ),
        refused(
            "retry limit 101",
            run_with_step(json!({ "retry": { "limit": 101 } })),
            &["spec.steps[0].retry.limit", "less than or equal to 100"],
        ),
        refused(
            "token budget 0",
            run(json!({ "steps": [step("fetch")], "budget": { "tokens": 0 } })),
            &["spec.budget.tokens", "greater than or equal to 1"],
        ),
        refused(
            "step execution budget 0",
            run(json!({ "steps": [step("fetch")], "budget": { "stepExecutions": 0 } })),
            &["spec.budget.stepExecutions", "greater than or equal to 1"],
        ),
        // --- durations ---
        refused(
            "freshFor without a unit",
            run_with_step(json!({ "freshFor": "10" })),
            &["spec.steps[0].freshFor", "10"],
        ),
        refused(
            "timeout in words",
            run_with_step(json!({ "timeout": "5 minutes" })),
            &["spec.steps[0].timeout", "5 minutes"],
        ),
        refused(
            "backoff initial in days",
            run_with_step(json!({ "retry": { "backoff": { "initial": "1d", "max": "5m" } } })),
            &["spec.steps[0].retry.backoff.initial", "1d"],
        ),
        refused(
            "negative approval timeout",
            run_with_step(json!({ "approval": { "timeout": "-5s" } })),
            &["spec.steps[0].approval.timeout", "-5s"],
        ),
        refused(
            "zero freshFor",
            run_with_step(json!({ "freshFor": "0s" })),
            &["spec.steps[0].freshFor", "freshFor must be longer than 0s"],
        ),
        refused(
            "zero timeout",
            run_with_step(json!({ "timeout": "0s" })),
            &["spec.steps[0].timeout", "timeout must be longer than 0s"],
        ),
        refused(
            "backoff initial longer than max",
            run_with_step(json!({ "retry": { "backoff": { "initial": "10m", "max": "1m" } } })),
            &[
                "spec.steps[0].retry.backoff",
                "backoff.initial must not be longer than backoff.max",
            ],
        ),
        // --- notifications ---
        refused(
            "escalation not before the approval's timeout",
            run_with_step(json!({ "approval": {
                "timeout": "1h", "escalate": { "after": "90m", "notify": ["leads"] } } })),
            &[
                "spec.steps[0].approval.escalate.after",
                "approval.escalate.after must be shorter than approval.timeout",
            ],
        ),
        refused(
            "escalation to no channel",
            run_with_step(json!({ "approval": { "escalate": { "after": "1h", "notify": [] } } })),
            &["spec.steps[0].approval.escalate.notify", "at least 1"],
        ),
        refused(
            "zero escalation delay",
            run_with_step(
                json!({ "approval": { "escalate": { "after": "0s", "notify": ["leads"] } } }),
            ),
            &[
                "spec.steps[0].approval.escalate.after",
                "must be longer than 0s",
            ],
        ),
        refused(
            "channel name that is not a DNS label",
            run_with_step(json!({ "approval": { "notify": ["Payments Team"] } })),
            &["spec.steps[0].approval.notify[0]", "Payments Team"],
        ),
        refused_update(
            "notify channels changed on an approval",
            approval("Approve", json!({ "notify": ["team"] })),
            json!({ "spec": { "notify": ["attacker"] } }),
            &["spec.notify", "immutable"],
        ),
        refused_update(
            "a fork's source changed",
            run(json!({ "steps": [step("fetch")],
                "forkOf": { "runName": "order", "runUid": "u-1", "fromStep": "fetch" } })),
            json!({ "spec": { "forkOf": { "runName": "other", "runUid": "u-2", "fromStep": "fetch" } } }),
            &["spec.forkOf", "immutable"],
        ),
        refused_update(
            "a run made a fork after its creation",
            run(json!({ "steps": [step("fetch")] })),
            json!({ "spec": { "forkOf": { "runName": "order", "runUid": "u-1", "fromStep": "fetch" } } }),
            &["spec.forkOf", "immutable"],
        ),
        refused_update(
            "escalation removed from an approval",
            approval(
                "Approve",
                json!({ "escalate": { "after": "1h", "notify": ["leads"] } }),
            ),
            json!({ "spec": { "escalate": null } }),
            &["spec.escalate", "immutable"],
        ),
        // --- enums ---
        refused(
            "approval onTimeout not in enum",
            run_with_step(json!({ "approval": { "onTimeout": "Ignore" } })),
            &[
                "spec.steps[0].approval.onTimeout",
                "Unsupported value",
                "Reject",
                "Approve",
            ],
        ),
        refused(
            "effect not in enum",
            run_with_step(json!({ "effect": "Sometimes" })),
            &["spec.steps[0].effect", "Unsupported value", "NonIdempotent"],
        ),
        // --- ranges ---
        refused(
            "context maxBytes below 1024",
            run(json!({ "steps": [step("fetch")], "context": { "maxBytes": 100 } })),
            &["spec.context.maxBytes", "1024"],
        ),
        refused(
            "context maxBytes above 131072",
            run(json!({ "steps": [step("fetch")], "context": { "maxBytes": 131073 } })),
            &["spec.context.maxBytes", "131072"],
        ),
        refused(
            "activeDeadlineSeconds 0",
            run(json!({ "steps": [step("fetch")], "activeDeadlineSeconds": 0 })),
            &["spec.activeDeadlineSeconds", "greater than or equal to 1"],
        ),
        refused(
            "ttlSecondsAfterFinished -1",
            run(json!({ "steps": [step("fetch")], "ttlSecondsAfterFinished": -1 })),
            &["spec.ttlSecondsAfterFinished", "greater than or equal to 0"],
        ),
        refused(
            "run name longer than 63",
            long_named_run,
            &["metadata.name", "at most 63 characters"],
        ),
        // --- containers ---
        refused(
            "missing container image",
            run(json!({ "steps": [{ "name": "fetch", "container": { "command": ["true"] } }] })),
            &["spec.steps[0].container.image", "Required value"],
        ),
        refused(
            "empty container image",
            run(json!({ "steps": [{ "name": "fetch", "container": { "image": "" } }] })),
            &["spec.steps[0].container.image", "at least 1"],
        ),
        // --- Approval ---
        refused(
            "decision not in enum",
            decided("Approve", "Maybe"),
            &["spec.decision", "Unsupported value", "Approved"],
        ),
        refused(
            "Approve approval with a Reconcile decision",
            decided("Approve", "Retry"),
            &[
                "spec.decision",
                "an Approve approval takes Approved or Rejected",
            ],
        ),
        refused(
            "Reconcile approval with an Approve decision",
            decided("Reconcile", "Approved"),
            &[
                "spec.decision",
                "a Reconcile approval takes Retry, MarkSucceeded or MarkFailed",
            ],
        ),
        refused(
            "planRevision 0",
            approval("Approve", json!({ "planRevision": 0 })),
            &["spec.planRevision", "greater than or equal to 1"],
        ),
        refused(
            "missing runUid",
            approval("Approve", json!({ "runUid": null })),
            &["spec.runUid", "Required value"],
        ),
        refused_update(
            "decision changed once made",
            decided("Approve", "Approved"),
            json!({ "spec": { "decision": "Rejected" } }),
            &[
                "spec.decision",
                "a decision is final once made and cannot be changed",
            ],
        ),
        refused_update(
            "decision removed once made",
            decided("Approve", "Approved"),
            json!({ "spec": { "decision": null } }),
            &["spec.decision", "cannot be changed or removed"],
        ),
        refused_update(
            "comment changed after the decision",
            approval(
                "Approve",
                json!({ "decision": "Approved", "comment": "ok" }),
            ),
            json!({ "spec": { "comment": "on second thought" } }),
            &[
                "spec.comment",
                "the comment of a made decision cannot be changed",
            ],
        ),
        refused_update(
            "runName changed",
            approval("Approve", json!({})),
            json!({ "spec": { "runName": "another-run" } }),
            &["spec.runName", "immutable"],
        ),
        refused_update(
            "runUid changed",
            approval("Approve", json!({})),
            json!({ "spec": { "runUid": "0b7c6a1e-0000-4000-8000-000000000002" } }),
            &["spec.runUid", "immutable"],
        ),
        refused_update(
            "step changed",
            approval("Approve", json!({})),
            json!({ "spec": { "step": "another-step" } }),
            &["spec.step", "immutable"],
        ),
        refused_update(
            "planRevision changed",
            approval("Approve", json!({})),
            json!({ "spec": { "planRevision": 2 } }),
            &["spec.planRevision", "immutable"],
        ),
        refused_update(
            "kind changed",
            approval("Approve", json!({})),
            json!({ "spec": { "kind": "Reconcile" } }),
            &["spec.kind", "immutable"],
        ),
        refused_update(
            "question changed",
            approval("Approve", json!({})),
            json!({ "spec": { "question": "Refund 2390 EUR?" } }),
            &["spec.question", "immutable"],
        ),
        refused_update(
            "onTimeout changed while pending",
            approval("Approve", json!({ "onTimeout": "Reject" })),
            json!({ "spec": { "onTimeout": "Approve" } }),
            &["spec.onTimeout", "immutable"],
        ),
        refused_update(
            "context rewritten",
            approval(
                "Approve",
                json!({ "context": { "reason": "gate on issue-refund" } }),
            ),
            json!({ "spec": { "context": { "reason": "nothing to see" } } }),
            &["spec.context", "immutable"],
        ),
        refused(
            "blank approver group",
            run_with_step(json!({ "approval": { "approvers": { "groups": ["  "] } } })),
            &["approval.approvers.groups: a group name cannot be blank"],
        ),
        refused(
            "approval timeout of 0s",
            run_with_step(json!({ "approval": { "timeout": "0s" } })),
            &["approval.timeout must be longer than 0s"],
        ),
        refused(
            "podTemplate label in the agentrun.dev/ prefix",
            run(
                json!({ "steps": [step("fetch")], "podTemplate": { "labels": { "agentrun.dev/run": "other" } } }),
            ),
            &["podTemplate.labels: agentrun.dev/ labels are set by the operator"],
        ),
        refused(
            "decidedBy without a decision",
            approval("Approve", json!({ "decidedBy": "alice" })),
            &["spec.decidedBy is recorded with spec.decision, not alone"],
        ),
        refused(
            "votes on a Reconcile approval",
            approval(
                "Reconcile",
                json!({ "votes": [{ "user": "alice", "decision": "Approved" }] }),
            ),
            &["spec.votes: only an Approve approval takes votes"],
        ),
        refused(
            "a vote that is neither Approved nor Rejected",
            approval(
                "Approve",
                json!({ "votes": [{ "user": "alice", "decision": "Retry" }] }),
            ),
            &["spec.votes[].decision: a vote is Approved or Rejected"],
        ),
        refused_update_after(
            "a vote on an expired approval",
            approval("Approve", json!({ "quorum": 2 })),
            json!({ "status": { "phase": "Expired" } }),
            json!({ "spec": { "votes": [{ "user": "alice", "decision": "Approved" }] } }),
            &[
                "spec.votes: approval case-",
                " is Expired and takes no more votes",
            ],
        ),
        refused_update(
            "expiresAt moved",
            approval("Approve", json!({ "expiresAt": "2030-01-01T00:00:00Z" })),
            json!({ "spec": { "expiresAt": "2031-01-01T00:00:00Z" } }),
            &["spec.expiresAt", "immutable"],
        ),
    ]
}

fn dynamic_api(env: &TestEnv, kind: &str) -> Api<DynamicObject> {
    let resource = match kind {
        "AgentRun" => ApiResource::erase::<AgentRun>(&()),
        "Approval" => ApiResource::erase::<Approval>(&()),
        other => panic!("no API for kind {other}"),
    };
    Api::namespaced_with(env.client(), env.namespace(), &resource)
}

/// What is wrong with the refusal `result`, if anything.
fn check_refusal<T>(result: kube::Result<T>, expect: &[&str]) -> Result<String, String> {
    match result {
        Ok(_) => Err("accepted".to_owned()),
        Err(kube::Error::Api(status)) => {
            let missing: Vec<&&str> = expect
                .iter()
                .filter(|s| !status.message.contains(**s))
                .collect();
            if status.code != 422 {
                Err(format!(
                    "code {} (want 422): {}",
                    status.code, status.message
                ))
            } else if !missing.is_empty() {
                Err(format!("message lacks {missing:?}: {}", status.message))
            } else {
                Ok(status.message.clone())
            }
        }
        Err(e) => Err(format!("not an API refusal: {e}")),
    }
}

#[tokio::test]
async fn every_admission_rule_refuses_its_invalid_object_with_a_clear_message() {
    let env = TestEnv::new("admission_rules").await;
    let cases = cases();
    let mut mismatches = Vec::new();
    let mut refusals = Vec::new();
    for (i, case) in cases.into_iter().enumerate() {
        let mut object = case.object;
        if object["metadata"].get("name").is_none() {
            object["metadata"]["name"] = json!(format!("case-{i:02}"));
        }
        let kind = object["kind"].as_str().expect("kind").to_owned();
        let name = object["metadata"]["name"]
            .as_str()
            .expect("name")
            .to_owned();
        let api = dynamic_api(&env, &kind);
        let obj: DynamicObject = serde_json::from_value(object).expect("a DynamicObject");
        let created = api.create(&PostParams::default(), &obj).await;
        let outcome = match case.update {
            None => check_refusal(created, case.expect),
            Some(update) => match created {
                Err(e) => Err(format!("the object to update was refused: {e}")),
                Ok(_) if case.status.is_some() => {
                    let status = case.status.expect("checked");
                    match api
                        .patch_status(&name, &PatchParams::default(), &Patch::Merge(status))
                        .await
                    {
                        Err(e) => Err(format!("writing the status failed: {e}")),
                        Ok(_) => check_refusal(
                            api.patch(&name, &PatchParams::default(), &Patch::Merge(update))
                                .await,
                            case.expect,
                        ),
                    }
                }
                Ok(_) => check_refusal(
                    api.patch(&name, &PatchParams::default(), &Patch::Merge(update))
                        .await,
                    case.expect,
                ),
            },
        };
        match outcome {
            Ok(message) => {
                eprintln!("ok   {:<48} {message}", case.name);
                refusals.push(message);
            }
            Err(why) => {
                eprintln!("FAIL {:<48} {why}", case.name);
                mismatches.push(format!("{}: {why}", case.name));
            }
        }
    }
    assert!(
        mismatches.is_empty(),
        "{} admission case(s) did not behave:\n  {}",
        mismatches.len(),
        mismatches.join("\n  ")
    );
    // Every CEL rule of both CRDs was seen refusing something, here or in
    // the test named for it.
    let unseen: Vec<String> = rule_texts()
        .into_iter()
        .filter(|text| !refusals.iter().any(|m| m.contains(text.as_str())))
        .filter(|text| !PROVEN_ELSEWHERE.iter().any(|(t, _)| t == text))
        .collect();
    assert!(
        unseen.is_empty(),
        "{} rule(s) refused nothing in this table and name no other test:\n  {}",
        unseen.len(),
        unseen.join("\n  ")
    );
    env.cleanup().await;
}

/// Rules whose refusal another test receives from the API server, as a
/// user who may send it: (the rule's text, the test).
const PROVEN_ELSEWHERE: &[(&str, &str)] = &[
    (
        "approval.approvers.users: a user name cannot be blank",
        "approvers.rs: malformed_approver_policies_are_refused_with_clear_messages",
    ),
    (
        "approval.approvers: name at least one user, group or serviceAccount (leave approvers out to let RBAC alone decide)",
        "approvers.rs: malformed_approver_policies_are_refused_with_clear_messages",
    ),
    (
        "approval.quorum: more distinct approvers are needed than the users and serviceAccounts listed, and no group is listed",
        "approvers.rs: malformed_approver_policies_are_refused_with_clear_messages",
    ),
    (
        " and can no longer be decided",
        "scenarios/approvals.rs: an_approval_releases_only_the_step_it_was_asked_about",
    ),
    (
        "spec.votes: each user votes once",
        "approvers.rs: a_quorum_of_two_releases_once_and_one_rejection_compensates",
    ),
    (
        "spec.approvers is immutable: who may decide was set when the approval was requested",
        "authz.rs: what_the_operator_wrote_on_an_approval_cannot_be_changed_or_removed",
    ),
    (
        "spec.decidedBy: who decided is final once recorded",
        "authz.rs: what_the_operator_wrote_on_an_approval_cannot_be_changed_or_removed",
    ),
    (
        "spec.quorum is immutable",
        "authz.rs: what_the_operator_wrote_on_an_approval_cannot_be_changed_or_removed",
    ),
    (
        "spec.requestedBy is immutable",
        "authz.rs: what_the_operator_wrote_on_an_approval_cannot_be_changed_or_removed",
    ),
    (
        "spec.separateFromRequester is immutable: separation of duties was set when the approval was requested and cannot be changed or removed",
        "authz.rs: what_the_operator_wrote_on_an_approval_cannot_be_changed_or_removed",
    ),
    (
        "spec.stepDigest is immutable: the approval is bound to the step as it was when asked",
        "authz.rs: what_the_operator_wrote_on_an_approval_cannot_be_changed_or_removed",
    ),
    (
        "spec.votes: votes are append-only; a vote cannot be changed or removed",
        "authz.rs: what_the_operator_wrote_on_an_approval_cannot_be_changed_or_removed",
    ),
];

/// Every CEL rule of the AgentRun and Approval CRDs, as the fixed text its
/// refusal carries: its message, or the longest literal of its
/// messageExpression.
fn rule_texts() -> std::collections::BTreeSet<String> {
    fn walk(v: &Value, out: &mut std::collections::BTreeSet<String>) {
        match v {
            Value::Object(m) => {
                for rule in m
                    .get("x-kubernetes-validations")
                    .and_then(Value::as_array)
                    .into_iter()
                    .flatten()
                {
                    let text = match (rule["message"].as_str(), rule["messageExpression"].as_str())
                    {
                        (Some(message), _) => message.to_owned(),
                        (None, Some(expr)) => expr
                            .split('\'')
                            .skip(1)
                            .step_by(2)
                            .max_by_key(|lit| lit.len())
                            .unwrap_or(expr)
                            .to_owned(),
                        (None, None) => panic!("a rule without a message: {rule}"),
                    };
                    out.insert(text);
                }
                m.values().for_each(|v| walk(v, out));
            }
            Value::Array(items) => items.iter().for_each(|v| walk(v, out)),
            _ => {}
        }
    }
    let mut out = std::collections::BTreeSet::new();
    for crd in [AgentRun::crd(), Approval::crd()] {
        walk(
            &serde_json::to_value(crd).expect("the CRD as JSON"),
            &mut out,
        );
    }
    out
}

#[tokio::test]
async fn valid_objects_are_accepted_and_a_decision_can_be_made_once() {
    let env = TestEnv::new("admission_accepts_valid").await;
    let runs = dynamic_api(&env, "AgentRun");
    let approvals = dynamic_api(&env, "Approval");
    let create = |mut object: Value, name: &str| {
        object["metadata"]["name"] = json!(name);
        serde_json::from_value::<DynamicObject>(object).expect("a DynamicObject")
    };

    runs.create(
        &PostParams::default(),
        &create(run(json!({ "steps": [step("fetch")] })), "minimal"),
    )
    .await
    .expect("a minimal AgentRun is accepted");
    runs.create(
        &PostParams::default(),
        &create(run(json!({ "planner": step("plan") })), "planned"),
    )
    .await
    .expect("a planner without steps is accepted");
    let full = run_with_step(json!({
        "effect": "Idempotent", "freshFor": "10m", "timeout": "1h30m",
        "retry": { "limit": 100, "backoff": { "initial": "250ms", "max": "5m" } },
        "approval": { "question": "ok?", "timeout": "72h", "onTimeout": "Approve",
                      "notify": ["payments-oncall", "audit"],
                      "escalate": { "after": "71h59m", "notify": ["payments-leads"] } },
    }));
    runs.create(&PostParams::default(), &create(full, "bounds"))
        .await
        .expect("an AgentRun at the edges of every bound is accepted");
    runs.create(
        &PostParams::default(),
        &create(
            run(json!({ "steps": [step(&"a".repeat(48))] })),
            &"r".repeat(63),
        ),
    )
    .await
    .expect("a 63-character run name and a 48-character step name are accepted");

    // Typed, so the generated types and the schema agree both ways.
    let typed: Api<Approval> = env.api();
    approvals
        .create(
            &PostParams::default(),
            &create(approval("Approve", json!({})), "gate"),
        )
        .await
        .expect("a minimal Approval is accepted");
    let pending = typed.get("gate").await.expect("read the Approval");
    assert_eq!(pending.spec.decision, None);
    let decided = typed
        .patch(
            "gate",
            &PatchParams::default(),
            &Patch::Merge(json!({ "spec": { "decision": "Approved", "comment": "fine" } })),
        )
        .await
        .expect("Pending -> Approved is accepted");
    assert_eq!(decided.spec.decision, Some(Decision::Approved));
    typed
        .patch(
            "gate",
            &PatchParams::default(),
            &Patch::Merge(json!({ "spec": { "decision": "Approved" }, "metadata": { "labels": { "seen": "yes" } } })),
        )
        .await
        .expect("restating the same decision is accepted");
    let status = typed
        .patch_status(
            "gate",
            &PatchParams::default(),
            &Patch::Merge(
                json!({ "status": { "phase": "Approved", "decidedBy": "kubectl-patch" } }),
            ),
        )
        .await
        .expect("the operator records the outcome in status");
    assert_eq!(status.status.unwrap().phase, ApprovalPhase::Approved);

    approvals
        .create(
            &PostParams::default(),
            &create(
                approval("Reconcile", json!({ "decision": "MarkSucceeded" })),
                "reconcile",
            ),
        )
        .await
        .expect("a Reconcile approval with a Reconcile decision is accepted");
    env.cleanup().await;
}

#[tokio::test]
async fn generated_crds_are_structural_and_established() {
    let env = TestEnv::new("crds_structural").await;
    let crds: Api<CustomResourceDefinition> = Api::all(env.client());
    for name in [AgentRun::crd_name(), Approval::crd_name()] {
        let crd = crds.get(name).await.expect("the CRD is installed");
        let conditions = crd.status.and_then(|s| s.conditions).unwrap_or_default();
        let status_of = |t: &str| {
            conditions
                .iter()
                .find(|c| c.type_ == t)
                .map(|c| c.status.clone())
        };
        assert_eq!(
            status_of("Established").as_deref(),
            Some("True"),
            "{name}: {conditions:?}"
        );
        assert_eq!(
            status_of("NamesAccepted").as_deref(),
            Some("True"),
            "{name}: {conditions:?}"
        );
        assert_eq!(
            status_of("NonStructuralSchema"),
            None,
            "{name}: {conditions:?}"
        );
    }
    env.cleanup().await;
}

/// `kubectl get` output as rows of whitespace-separated cells.
fn table(output: &str) -> Vec<Vec<String>> {
    output
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| l.split_whitespace().map(str::to_owned).collect())
        .collect()
}

#[tokio::test]
async fn kubectl_get_ar_shows_phase_step_progress_and_tokens() {
    let env = TestEnv::new("kubectl_get_ar_columns").await;
    let runs: Api<AgentRun> = env.api();
    let object: AgentRun = serde_json::from_value({
        let mut r =
            run(json!({ "steps": [step("lookup-order"), step("draft-refund"), step("notify")] }));
        r["metadata"]["name"] = json!("refund-4711");
        r
    })
    .unwrap();
    runs.create(&PostParams::default(), &object)
        .await
        .expect("create AgentRun");
    runs.patch_status(
        "refund-4711",
        &PatchParams::default(),
        &Patch::Merge(json!({ "status": {
            "phase": "Running", "currentStep": "draft-refund", "progress": "1/3", "tokensUsed": 1234,
            "conditions": [{"type": "Succeeded", "status": "Unknown", "reason": "Running",
                "message": "1/3 steps done", "lastTransitionTime": "2026-12-01T00:00:00Z"}],
        }})),
    )
    .await
    .expect("write status");

    let out = kubectl_ok(["get", "ar", "-n", env.namespace()]).await;
    let rows = table(&out);
    assert_eq!(
        rows[0],
        [
            "NAME", "PHASE", "REASON", "STEP", "PROGRESS", "TOKENS", "DURATION", "AGE"
        ],
        "{out}"
    );
    assert_eq!(rows.len(), 2, "{out}");
    assert_eq!(
        rows[1][..6],
        [
            "refund-4711",
            "Running",
            "Running",
            "draft-refund",
            "1/3",
            "1234"
        ],
        "{out}"
    );
    assert_eq!(rows[1].len(), 7, "no Duration while it runs: {out}");
    // Once finished, how long it took (what the operator records).
    runs.patch_status(
        "refund-4711",
        &PatchParams::default(),
        &Patch::Merge(json!({ "status": {
            "phase": "Succeeded", "currentStep": "notify", "progress": "3/3", "duration": "3m12s",
        }})),
    )
    .await
    .expect("write status");
    let out = kubectl_ok(["get", "ar", "-n", env.namespace()]).await;
    let rows = table(&out);
    assert_eq!(rows[1][6], "3m12s", "{out}");
    for args in [&["get", "ar"][..], &["get", "ar", "-o", "wide"][..]] {
        let mut a = args.to_vec();
        a.extend(["-n", env.namespace()]);
        let out = kubectl_ok(a).await;
        for line in out.lines() {
            assert!(
                line.len() <= 100,
                "{args:?}: wider than 100 columns: {line:?}"
            );
        }
    }
    env.cleanup().await;
}

#[tokio::test]
async fn kubectl_get_apv_shows_run_step_kind_decision_and_expiry() {
    let env = TestEnv::new("kubectl_get_apv_columns").await;
    let approvals = dynamic_api(&env, "Approval");
    let mut object = approval(
        "Approve",
        json!({ "expiresAt": "2030-01-02T03:04:05Z", "decision": "Approved" }),
    );
    object["metadata"]["name"] = json!("refund-4711-issue-refund-r1-approve");
    approvals
        .create(
            &PostParams::default(),
            &serde_json::from_value(object).unwrap(),
        )
        .await
        .expect("create Approval");

    let out = kubectl_ok(["get", "apv", "-n", env.namespace()]).await;
    let rows = table(&out);
    assert_eq!(
        rows[0],
        [
            "NAME",
            "RUN",
            "STEP",
            "KIND",
            "PHASE",
            "DECISION",
            "EXPIRES",
            "VOTES",
            "DECIDED-BY",
            "AGE"
        ],
        "{out}"
    );
    assert_eq!(rows.len(), 2, "{out}");
    assert_eq!(
        rows[1][..6],
        [
            "refund-4711-issue-refund-r1-approve",
            "refund-4711",
            "issue-refund",
            "Approve",
            "Approved",
            "2030-01-02T03:04:05Z",
        ],
        "{out}"
    );
    env.cleanup().await;
}

#[tokio::test]
async fn every_sample_applies_with_server_side_dry_run() {
    let env = TestEnv::new("samples_dry_run").await;
    let dir = repo_root().join("config/samples");
    // The example Approval in docs/examples validates too.
    let examples = repo_root().join("docs/examples");
    let mut samples: Vec<PathBuf> = [&dir, &examples]
        .into_iter()
        .flat_map(|d| {
            std::fs::read_dir(d).unwrap_or_else(|e| panic!("reading {}: {e}", d.display()))
        })
        .map(|entry| entry.expect("directory entry").path())
        .filter(|p| matches!(p.extension().and_then(|e| e.to_str()), Some("yaml" | "yml")))
        // The kustomization lists the samples; it is not an object to apply.
        .filter(|p| p.file_stem().and_then(|s| s.to_str()) != Some("kustomization"))
        .collect();
    samples.sort();
    assert!(!samples.is_empty(), "no sample under {}", dir.display());

    let mut failures = Vec::new();
    for sample in &samples {
        let out = kubectl([
            "apply".as_ref(),
            "--dry-run=server".as_ref(),
            "-n".as_ref(),
            env.namespace().as_ref(),
            "-f".as_ref(),
            sample.as_os_str(),
        ])
        .await;
        if out.success() {
            eprintln!("ok   {}: {}", sample.display(), out.stdout.trim());
        } else {
            failures.push(format!(
                "{}: {}{}",
                sample.display(),
                out.stderr.trim(),
                out.stdout.trim()
            ));
        }
    }
    assert!(
        failures.is_empty(),
        "samples refused:\n  {}",
        failures.join("\n  ")
    );
    env.cleanup().await;
}

/// `kubectl explain` opens with what the resource is, not a generated stub.
#[tokio::test]
async fn kubectl_explain_describes_both_resources() {
    let env = TestEnv::new("kubectl_explain").await;
    let run = kubectl_ok(["explain", "agentrun"]).await;
    assert!(
        run.contains("A durable AI-agent run: a plan of steps"),
        "{run}"
    );
    let approval = kubectl_ok(["explain", "approval"]).await;
    assert!(
        approval.contains("A decision a person owes an AgentRun"),
        "{approval}"
    );
    for out in [&run, &approval] {
        assert!(!out.contains("Auto-generated"), "{out}");
    }
    env.cleanup().await;
}
