//! The table of malformed objects: each AgentRun or Approval the API server
//! must refuse, on create or on an update, and the words its refusal must
//! carry. Run by `every_admission_rule_refuses_its_invalid_object_with_a_clear_message`.

use serde_json::{Value, json};

const RUN_UID: &str = "0b7c6a1e-0000-4000-8000-000000000001";

pub(super) fn run(spec: Value) -> Value {
    json!({ "apiVersion": "agentrun.dev/v1alpha1", "kind": "AgentRun", "metadata": {}, "spec": spec })
}

pub(super) fn step(name: &str) -> Value {
    json!({ "name": name, "container": { "image": "ghcr.io/example/agent:1" } })
}

/// A one-step run whose step is `step("fetch")` with `extra` merged in.
pub(super) fn run_with_step(extra: Value) -> Value {
    let mut s = step("fetch");
    merge(&mut s, extra);
    run(json!({ "steps": [s] }))
}

pub(super) fn approval(kind: &str, extra: Value) -> Value {
    let mut spec = json!({
        "runName": "refund-4711", "runUid": RUN_UID, "step": "issue-refund",
        "planRevision": 1, "kind": kind, "question": "Refund 23.90 EUR?",
    });
    merge(&mut spec, extra);
    json!({ "apiVersion": "agentrun.dev/v1alpha1", "kind": "Approval", "metadata": {}, "spec": spec })
}

/// JSON merge patch semantics (RFC 7386): objects merge, `null` removes.
pub(super) fn merge(target: &mut Value, patch: Value) {
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
pub(super) struct Case {
    pub(super) name: &'static str,
    pub(super) object: Value,
    /// Written to the status subresource after the create, before `update`.
    pub(super) status: Option<Value>,
    pub(super) update: Option<Value>,
    pub(super) expect: &'static [&'static str],
}

pub(super) fn refused(name: &'static str, object: Value, expect: &'static [&'static str]) -> Case {
    Case {
        name,
        object,
        status: None,
        update: None,
        expect,
    }
}

pub(super) fn refused_update(
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
pub(super) fn refused_update_after(
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

pub(super) fn cases() -> Vec<Case> {
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
            "a signal's senders naming nobody",
            run(json!({ "steps": [{ "name": "w", "wait": { "signal": { "senders": {} } } }] })),
            &[
                "wait.signal.senders: name at least one user, group or serviceAccount (leave senders out to let RBAC alone decide)",
            ],
        ),
        refused(
            "a blank sender",
            run(
                json!({ "steps": [{ "name": "w", "wait": { "signal": { "senders": { "users": [" "] } } } }] }),
            ),
            &["wait.signal.senders.users: a user name cannot be blank"],
        ),
        refused(
            "a blank senders' group",
            run(
                json!({ "steps": [{ "name": "w", "wait": { "signal": { "senders": { "groups": [""] } } } }] }),
            ),
            &["wait.signal.senders.groups: a group name cannot be blank"],
        ),
        refused(
            "a when that builds a message",
            run(json!({ "steps": [step("a"), {
                "name": "b", "dependsOn": ["a"], "when": "steps.a.result == Foo{}",
                "container": { "image": "ghcr.io/example/agent:1" },
            }] })),
            &["when: builds a message (Name{…}), which CEL over JSON results does not support"],
        ),
        refused(
            "a when with four comprehensions",
            run(json!({ "steps": [step("a"), {
                "name": "b", "dependsOn": ["a"],
                "when": "steps.a.result.x.all(p, [1].all(q, [1].exists(r, [1].map(t, t).size() > 0)))",
                "container": { "image": "ghcr.io/example/agent:1" },
            }] })),
            &[
                "when: at most 3 comprehensions (all, exists, exists_one, map, filter) in one expression",
            ],
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
