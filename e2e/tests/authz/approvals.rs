//! What the operator wrote on an Approval stays as written, and only the
//! operator opens one (D15): each rule as a real request of a user the
//! chart's approver role lets patch Approvals, on the real API server.
//!
//! ```text
//!   operator SA ──create──▶ Approval {approvers, quorum, separateFromRequester, requestedBy: dave}
//!   dave (creator, approver) ──remove separateFromRequester + decide──▶ refused
//!   alice, bob (approvers)   ──change or remove what the operator wrote──▶ refused
//!   mallory (may create approvals) ──create──▶ refused: only the operator opens one
//! ```

use agentrun_e2e::kubectl_ok;
use agentrun_e2e::support::policies::{
    Policies, assert_admitted, assert_refused, kubectl_as, manifest, wait_enforced,
};
use agentrun_e2e::support::scenario::Scenario;
use serde_json::{Value, json};

const RUN_UID: &str = "0b7c6a1e-0000-4000-8000-000000000031";

/// The policies for the scenario's namespace; dave, alice and bob and the
/// ServiceAccounts bot and other hold the approver role; mallory and the
/// operator's ServiceAccount may create Approvals (RBAC), so only the policy
/// tells them apart.
async fn setup(s: &Scenario) -> Policies {
    let ns = s.namespace();
    let p = Policies::install(ns, &[]).await;
    let approver = format!("--clusterrole={}-approver", p.release);
    let operator = format!(
        "--serviceaccount={}",
        p.operator(ns).trim_start_matches("system:serviceaccount:")
    );
    let (bot, other) = (
        format!("--serviceaccount={ns}:bot"),
        format!("--serviceaccount={ns}:other"),
    );
    for args in [
        vec![
            "create",
            "rolebinding",
            "approvers",
            &approver,
            "--user=dave",
            "--user=alice",
            "--user=bob",
            &bot,
            &other,
        ],
        vec![
            "create",
            "role",
            "opener",
            "--verb=create,get",
            "--resource=approvals.agentrun.dev",
        ],
        vec![
            "create",
            "rolebinding",
            "opener",
            "--role=opener",
            "--user=mallory",
            &operator,
        ],
    ] {
        let mut all = vec!["-n", ns];
        all.extend(args);
        kubectl_ok(all).await;
    }
    wait_enforced(ns, true).await;
    p
}

fn approval(name: &str, extra: Value) -> Value {
    let mut spec = json!({
        "runName": "refund", "runUid": RUN_UID, "step": "pay", "planRevision": 1,
        "kind": "Approve", "question": "Pay out 23.90 EUR?", "stepDigest": "ab12",
        "approvers": {"users": ["dave", "alice", "bob"]},
        "separateFromRequester": true, "requestedBy": "dave",
    });
    for (k, v) in extra.as_object().into_iter().flatten() {
        if v.is_null() {
            spec.as_object_mut().unwrap().remove(k);
        } else {
            spec[k] = v.clone();
        }
    }
    json!({"apiVersion": "agentrun.dev/v1alpha1", "kind": "Approval",
           "metadata": {"name": name}, "spec": spec})
}

/// Opens Approval `name` as the operator's ServiceAccount.
async fn open(s: &Scenario, p: &Policies, name: &str, extra: Value) {
    let ns = s.namespace();
    let file = manifest(&format!("apv-{name}-{ns}"), &approval(name, extra));
    let out = kubectl_as(&p.operator(ns), &[], ns, &["create", "-f", &file]).await;
    assert_admitted(&out, &format!("the operator opening {name}"));
}

/// `user` sends the JSON patch `ops` to Approval `name`.
async fn patch(
    s: &Scenario,
    user: &str,
    groups: &[&str],
    name: &str,
    ops: Value,
) -> agentrun_e2e::KubectlOutput {
    let body = ops.to_string();
    kubectl_as(
        user,
        groups,
        s.namespace(),
        &["patch", "apv", name, "--type", "json", "-p", &body],
    )
    .await
}

/// Approve, naming oneself as the decider (what the plugin sends).
fn decide(user: &str) -> Value {
    json!([{"op": "add", "path": "/spec/decision", "value": "Approved"},
           {"op": "add", "path": "/spec/decidedBy", "value": user}])
}

fn vote(user: &str, decision: &str) -> Value {
    json!([{"op": "add", "path": "/spec/votes/-", "value": {"user": user, "decision": decision}}])
}

/// Each field the operator wrote, changed or removed by an approver whom
/// RBAC lets patch the Approval, is refused by the API server — removal
/// included, which a rule on the optional field alone would not see.
#[tokio::test]
async fn what_the_operator_wrote_on_an_approval_cannot_be_changed_or_removed() {
    let s = Scenario::start_without_operator("authz-approval-fields").await;
    let p = setup(&s).await;
    let remove = |path: &str| json!({"op": "remove", "path": path});
    let replace = |path: &str, value: Value| json!({"op": "replace", "path": path, "value": value});
    let quorum2 = json!({"quorum": 2});
    // (approval, spec at creation, who, patch, refusal)
    let cases: Vec<(&str, Value, &str, Value, &str)> = vec![
        // The creator, an approver too, turns separation off and approves in one patch.
        (
            "sep-and-decide",
            json!({}),
            "dave",
            json!([remove("/spec/separateFromRequester"),
                {"op": "add", "path": "/spec/decision", "value": "Approved"}]),
            "spec.separateFromRequester is immutable",
        ),
        (
            "sep-removed",
            json!({}),
            "alice",
            json!([remove("/spec/separateFromRequester")]),
            "spec.separateFromRequester is immutable",
        ),
        (
            "sep-flipped",
            json!({}),
            "alice",
            json!([replace("/spec/separateFromRequester", json!(false))]),
            "spec.separateFromRequester is immutable",
        ),
        (
            "approvers-removed",
            json!({}),
            "alice",
            json!([remove("/spec/approvers")]),
            "spec.approvers is immutable",
        ),
        (
            "approvers-changed",
            json!({}),
            "alice",
            json!([replace("/spec/approvers/users", json!(["alice"]))]),
            "spec.approvers is immutable",
        ),
        (
            "quorum-lowered",
            quorum2.clone(),
            "alice",
            json!([replace("/spec/quorum", json!(1))]),
            "spec.quorum is immutable",
        ),
        // Removed, the API server defaults it to 1: a change all the same.
        (
            "quorum-removed",
            quorum2.clone(),
            "alice",
            json!([remove("/spec/quorum")]),
            "spec.quorum is immutable",
        ),
        (
            "requester-removed",
            json!({}),
            "alice",
            json!([remove("/spec/requestedBy")]),
            "spec.requestedBy is immutable",
        ),
        (
            "requester-changed",
            json!({}),
            "alice",
            json!([replace("/spec/requestedBy", json!("alice"))]),
            "spec.requestedBy is immutable",
        ),
        (
            "digest-removed",
            json!({}),
            "alice",
            json!([remove("/spec/stepDigest")]),
            "spec.stepDigest is immutable",
        ),
        (
            "run-moved",
            json!({}),
            "alice",
            json!([replace("/spec/runUid", json!("another"))]),
            "spec.runUid is immutable",
        ),
    ];
    for (name, extra, user, ops, want) in cases {
        open(&s, &p, name, extra).await;
        let out = patch(&s, user, &[], name, ops).await;
        assert_refused(&out, want);
    }

    // Votes are append-only: alice's vote stands, neither removed nor turned.
    open(&s, &p, "votes", quorum2.clone()).await;
    assert_admitted(
        &patch(&s, "alice", &[], "votes", vote("alice", "Approved")).await,
        "alice's vote",
    );
    assert_refused(
        &patch(&s, "bob", &[], "votes", json!([remove("/spec/votes/0")])).await,
        "votes are append-only",
    );
    assert_refused(
        &patch(
            &s,
            "alice",
            &[],
            "votes",
            json!([replace("/spec/votes/0/decision", json!("Rejected"))]),
        )
        .await,
        "votes are append-only",
    );

    // Who decided is final: not renamed, not removed, no groups added.
    open(&s, &p, "decided", json!({})).await;
    assert_admitted(
        &patch(&s, "alice", &[], "decided", decide("alice")).await,
        "alice's decision",
    );
    for ops in [
        json!([replace("/spec/decidedBy", json!("bob"))]),
        json!([remove("/spec/decidedBy")]),
        json!([{"op": "add", "path": "/spec/decidedByGroups/-", "value": "admins"}]),
    ] {
        assert_refused(
            &patch(&s, "alice", &[], "decided", ops).await,
            "who decided is final once recorded",
        );
    }
    drop(p);
    s.finish().await;
}

/// Who may approve, as the server checks it for the paths that had no test:
/// a ServiceAccount approver (and one that is not), a decider naming groups
/// they are not in, the creator's vote under separation with a quorum, and
/// separation on an Approval whose run's creator is not recorded, which
/// nobody may approve.
#[tokio::test]
async fn approvers_are_checked_on_every_path_to_a_decision() {
    let s = Scenario::start_without_operator("authz-approval-paths").await;
    let ns = s.namespace().to_owned();
    let p = setup(&s).await;

    let sa = |name: &str| format!("system:serviceaccount:{ns}:{name}");
    open(
        &s,
        &p,
        "by-bot",
        json!({"approvers": {"serviceAccounts": [{"namespace": ns, "name": "bot"}]}}),
    )
    .await;
    assert_refused(
        &patch(&s, &sa("other"), &[], "by-bot", decide(&sa("other"))).await,
        &format!(
            "{} is not an approver; approvers: serviceAccount {ns}/bot",
            sa("other")
        ),
    );
    assert_admitted(
        &patch(&s, &sa("bot"), &[], "by-bot", decide(&sa("bot"))).await,
        "bot's decision",
    );

    open(
        &s,
        &p,
        "by-group",
        json!({"approvers": {"groups": ["payments-leads"]}}),
    )
    .await;
    let forged = json!([{"op": "add", "path": "/spec/decision", "value": "Approved"},
                        {"op": "add", "path": "/spec/decidedBy", "value": "alice"},
                        {"op": "add", "path": "/spec/decidedByGroups", "value": ["payments-leads", "admins"]}]);
    assert_refused(
        &patch(&s, "alice", &["payments-leads"], "by-group", forged).await,
        "spec.decidedByGroups names groups alice is not in",
    );

    open(&s, &p, "quorum-sep", json!({"quorum": 2})).await;
    assert_refused(
        &patch(&s, "dave", &[], "quorum-sep", vote("dave", "Approved")).await,
        "dave created run refund and may not approve it (separateFromRequester)",
    );
    assert_admitted(
        &patch(&s, "alice", &[], "quorum-sep", vote("alice", "Approved")).await,
        "alice's vote",
    );

    open(&s, &p, "no-creator", json!({"requestedBy": null})).await;
    assert_refused(
        &patch(&s, "alice", &[], "no-creator", decide("alice")).await,
        "run refund has no recorded creator (agentrun.dev/requested-by), so separateFromRequester cannot be checked and nobody may approve it",
    );
    let reject = json!([{"op": "add", "path": "/spec/decision", "value": "Rejected"},
                        {"op": "add", "path": "/spec/decidedBy", "value": "alice"}]);
    assert_admitted(
        &patch(&s, "alice", &[], "no-creator", reject).await,
        "a rejection",
    );
    drop(p);
    s.finish().await;
}

/// Only the operator opens an Approval: mallory, whom RBAC lets create
/// Approvals, is refused by the policy with a message that says so; the
/// operator's ServiceAccount is admitted (every `open` above).
#[tokio::test]
async fn only_the_operator_opens_an_approval() {
    let s = Scenario::start_without_operator("authz-approval-create").await;
    let ns = s.namespace().to_owned();
    let p = setup(&s).await;
    let planted = approval(
        "planted",
        json!({"approvers": {"users": ["mallory"]}, "separateFromRequester": null}),
    );
    let file = manifest(&format!("planted-{ns}"), &planted);
    let out = kubectl_as("mallory", &[], &ns, &["create", "-f", &file]).await;
    assert_refused(
        &out,
        &format!(
            "approval planted: only the operator ({}) creates approvals; mallory may decide one the operator opened, not open one",
            p.operator(&ns)
        ),
    );
    open(&s, &p, "opened", json!({})).await;
    drop(p);
    s.finish().await;
}
