//! Who may decide, and who decided (D15), as the API server enforces it: the
//! chart's admission policies (templates/admission-policies.yaml) and roles
//! (templates/roles.yaml), rendered by helm, scoped to the test's namespace
//! and applied to the plane; the operator and the simulated kubelet run as in
//! the scenarios. Every person acts through kubectl with impersonation
//! (`--as`, `--as-group`), so RBAC and the policies see exactly them.
//!
//! ```text
//!   dave (authors) ──create AgentRun──▶ MAP stamps agentrun.dev/requested-by=dave
//!   operator ──creates──▶ Approval {approvers, quorum, requestedBy: dave}
//!   alice (payments-leads) ──patch decision──▶ MAP stamps decidedBy=alice ─▶ VAP checks ─▶ step runs
//!   mallory, dave, the operator, a forged decidedBy ──▶ VAP refuses, saying why
//! ```
//!
//! Needs the plane and `e2e/cluster tools`; fails, never skips, without them.

use std::time::Duration;

use agentrun_e2e::support::policies::{
    Policies, assert_refused, kubectl_as, manifest, run_doc, wait_enforced,
};
use agentrun_e2e::support::scenario::{Scenario, phase, sim_step, status};
use agentrun_e2e::{kubectl, kubectl_ok, wait_for};
use agentrun_operator::api::{AgentRun, Approval, ApprovalPhase, RunPhase, StepPhase};
use agentrun_operator::labels;
use kube::api::ListParams;
use serde_json::{Value, json};

const RUN_TIMEOUT: Duration = Duration::from_secs(90);

/// RBAC in the namespace: authors create runs; approvers (two groups, three
/// users, and the operator's ServiceAccount, to show that the policy and not
/// RBAC keeps it from deciding) get the approver role; erin may also create
/// Pods.
async fn grant(ns: &str, p: &Policies) {
    let approver = format!("--clusterrole={}-approver", p.release);
    let sa = format!(
        "--serviceaccount={}",
        p.operator(ns).trim_start_matches("system:serviceaccount:")
    );
    for args in [
        vec![
            "create",
            "role",
            "authors",
            "--verb=create,get,list,watch,patch,update",
            "--resource=agentruns.agentrun.dev",
        ],
        vec![
            "create",
            "rolebinding",
            "authors",
            "--role=authors",
            "--user=dave",
            "--user=erin",
            "--user=frank",
        ],
        vec![
            "create",
            "rolebinding",
            "approvers",
            &approver,
            "--group=payments-leads",
            "--group=devs",
            "--user=alice",
            "--user=bob",
            "--user=carol",
            &sa,
        ],
        vec![
            "create",
            "role",
            "pod-creators",
            "--verb=create",
            "--resource=pods",
        ],
        vec![
            "create",
            "rolebinding",
            "pod-creators",
            "--role=pod-creators",
            "--user=erin",
        ],
    ] {
        let mut all = vec!["-n", ns];
        all.extend(args);
        kubectl_ok(all).await;
    }
}

fn decision(d: &str) -> String {
    json!({"spec": {"decision": d}}).to_string()
}

fn vote(user: &str, d: &str) -> String {
    json!([{"op": "add", "path": "/spec/votes/-", "value": {"user": user, "decision": d}}])
        .to_string()
}

/// An approver in the gate's group decides and is recorded as the decider;
/// everyone else is refused with a message that says why: someone outside
/// the group, the run's own creator (separation of duties), a client that
/// names someone else as the decider, and the operator's ServiceAccount. The
/// creator annotation that separation rests on cannot be edited or removed.
#[tokio::test]
async fn only_an_approver_decides_and_is_recorded_as_the_decider() {
    let s = Scenario::start("approvers-decide").await;
    let ns = s.namespace().to_owned();
    let p = Policies::install(&ns, &[]).await;
    grant(&ns, &p).await;
    wait_enforced(&ns, true).await;

    let mut refund = sim_step("refund", "NonIdempotent", json!({}));
    refund["approval"] = json!({
        "question": "Refund order 4711?",
        "approvers": {"groups": ["payments-leads"]},
        "separateFromRequester": true,
    });
    let run = run_doc("refund", vec![refund], json!({}));
    let file = manifest(&format!("run-{ns}"), &run);
    let created = kubectl_as("dave", &["payments-leads"], &ns, &["create", "-f", &file]).await;
    assert!(created.success(), "{created:?}");
    let apv = s.approval_of("refund", Some("refund"), RUN_TIMEOUT).await;
    let a = s.approvals().get(&apv).await.unwrap();
    assert_eq!(a.spec.requested_by.as_deref(), Some("dave"));

    let approve = decision("Approved");
    let patch = ["patch", "apv", &apv, "--type", "merge", "-p", &approve];
    let out = kubectl_as("mallory", &["devs"], &ns, &patch).await;
    assert_refused(
        &out,
        &format!("approval {apv}: mallory is not an approver; approvers: group payments-leads"),
    );
    let out = kubectl_as("dave", &["payments-leads"], &ns, &patch).await;
    assert_refused(
        &out,
        "dave created run refund and may not approve it (separateFromRequester)",
    );
    let forged = json!({"spec": {"decision": "Approved", "decidedBy": "carol"}}).to_string();
    let out = kubectl_as(
        "alice",
        &["payments-leads"],
        &ns,
        &["patch", "apv", &apv, "--type", "merge", "-p", &forged],
    )
    .await;
    assert_refused(
        &out,
        "spec.decidedBy must be the user who decides (alice), not carol",
    );
    let operator = p.operator(&ns);
    let out = kubectl_as(&operator, &[], &ns, &patch).await;
    assert_refused(&out, "may expire or supersede an approval, never decide it");
    for edit in [
        vec![
            "annotate",
            "ar",
            "refund",
            "agentrun.dev/requested-by=alice",
            "--overwrite",
        ],
        vec!["annotate", "ar", "refund", "agentrun.dev/requested-by-"],
    ] {
        let out = kubectl_as("dave", &[], &ns, &edit).await;
        assert_refused(
            &out,
            "records who created the run and cannot be changed or removed",
        );
    }
    assert_eq!(
        phase(&s.runs().get("refund").await.unwrap()),
        Some(RunPhase::WaitingForApproval),
        "nothing refused moved the run"
    );

    let out = kubectl_as("alice", &["payments-leads"], &ns, &patch).await;
    assert!(out.success(), "{out:?}");
    let a = s.approvals().get(&apv).await.unwrap();
    assert_eq!(a.spec.decided_by.as_deref(), Some("alice"));
    assert!(
        a.spec
            .decided_by_groups
            .contains(&"payments-leads".to_owned())
    );
    let done = s.wait_finished("refund", RUN_TIMEOUT).await;
    assert_eq!(phase(&done), Some(RunPhase::Succeeded));
    let a = wait_for(
        &s.approvals(),
        &apv,
        |a: Option<&Approval>| {
            a.and_then(|a| a.status.as_ref())
                .is_some_and(|st| st.phase == ApprovalPhase::Approved)
        },
        Duration::from_secs(30),
    )
    .await
    .expect("approval");
    assert_eq!(
        a.status.and_then(|st| st.decided_by).as_deref(),
        Some("alice"),
        "status names the person, not kubectl"
    );
    let events: kube::Api<k8s_openapi::api::events::v1::Event> = s.env().api();
    let mut granted = Vec::new();
    for _ in 0..50 {
        granted = events
            .list(&ListParams::default())
            .await
            .expect("events")
            .items
            .into_iter()
            .filter(|e| e.reason.as_deref() == Some("ApprovalGranted"))
            .filter_map(|e| e.note)
            .collect();
        if !granted.is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(granted, [format!("Approval {apv} approved by alice")]);
    assert_eq!(s.ledger().executions().count(), 1);
    drop(p);
    s.finish().await;
}

/// Quorum 2 of 3: one vote leaves the run waiting and says 1/2, the same
/// user cannot vote twice, nobody votes as someone else, and the second
/// approver's vote releases the step exactly once. In a second run one
/// rejection fails the run, which compensates the step that already acted.
#[tokio::test]
async fn a_quorum_of_two_releases_once_and_one_rejection_compensates() {
    let s = Scenario::start("approvers-quorum").await;
    let ns = s.namespace().to_owned();
    let p = Policies::install(&ns, &[]).await;
    grant(&ns, &p).await;
    wait_enforced(&ns, true).await;

    let gate = json!({
        "question": "Pay out?",
        "approvers": {"users": ["alice", "bob", "carol"]},
        "quorum": 2,
    });
    let mut pay = sim_step("pay", "NonIdempotent", json!({}));
    pay["approval"] = gate.clone();
    s.create_run("payout", json!({"steps": [pay]})).await;
    let apv = s.approval_of("payout", Some("pay"), RUN_TIMEOUT).await;

    let cast = |user: &'static str, as_user: &'static str, d: &'static str| {
        let ns = ns.clone();
        let apv = apv.clone();
        async move {
            let v = vote(as_user, d);
            kubectl_as(
                user,
                &[],
                &ns,
                &["patch", "apv", &apv, "--type", "json", "-p", &v],
            )
            .await
        }
    };
    let out = cast("alice", "alice", "Approved").await;
    assert!(out.success(), "{out:?}");
    let a = wait_for(
        &s.approvals(),
        &apv,
        |a: Option<&Approval>| {
            a.and_then(|a| a.status.as_ref())
                .is_some_and(|st| st.votes.as_deref() == Some("1/2"))
        },
        Duration::from_secs(30),
    )
    .await
    .expect("approval");
    assert_eq!(a.status.unwrap().phase, ApprovalPhase::Pending);
    let printed = kubectl_ok(["-n", &ns, "get", "apv", &apv]).await;
    assert!(
        printed.contains("1/2"),
        "the Votes column shows 1/2:\n{printed}"
    );
    assert_eq!(
        phase(&s.runs().get("payout").await.unwrap()),
        Some(RunPhase::WaitingForApproval)
    );
    assert!(s.list_pods().await.is_empty(), "one vote starts nothing");
    assert_refused(
        &cast("alice", "alice", "Approved").await,
        "each user votes once",
    );
    assert_refused(
        &cast("bob", "carol", "Approved").await,
        "a vote is cast as oneself: spec.votes[].user must be bob",
    );
    let approve = decision("Approved");
    assert_refused(
        &kubectl_as(
            "bob",
            &[],
            &ns,
            &["patch", "apv", &apv, "--type", "merge", "-p", &approve],
        )
        .await,
        "needs 2 approvals: add your vote to spec.votes",
    );
    let out = cast("bob", "bob", "Approved").await;
    assert!(out.success(), "{out:?}");
    let done = s.wait_finished("payout", RUN_TIMEOUT).await;
    assert_eq!(phase(&done), Some(RunPhase::Succeeded));
    let pay = status(&done)
        .steps
        .into_iter()
        .find(|c| c.name == "pay")
        .unwrap();
    assert_eq!((pay.phase, pay.attempt), (StepPhase::Succeeded, 1));
    assert_eq!(pay.decided_by.as_deref(), Some("alice, bob"));
    let executions = s.ledger().executions_by_key();
    assert_eq!(
        executions.get(&pay.idempotency_key),
        Some(&1),
        "released exactly once: {executions:?}"
    );

    // One rejection rejects: the run fails and undoes the step that acted.
    let mut reserve = sim_step("reserve", "NonIdempotent", json!({}));
    reserve["compensate"] = json!({"image": "registry.example/agent-step:1"});
    let mut charge = sim_step("charge", "NonIdempotent", json!({}));
    charge["approval"] = gate;
    s.create_run("charge", json!({"steps": [reserve, charge]}))
        .await;
    let apv = s.approval_of("charge", Some("charge"), RUN_TIMEOUT).await;
    let v = vote("carol", "Rejected");
    let out = kubectl_as(
        "carol",
        &[],
        &ns,
        &["patch", "apv", &apv, "--type", "json", "-p", &v],
    )
    .await;
    assert!(out.success(), "{out:?}");
    let done = s.wait_finished("charge", RUN_TIMEOUT).await;
    assert_eq!(phase(&done), Some(RunPhase::Failed));
    let st = status(&done);
    assert_eq!(st.compensations.len(), 1, "{:?}", st.compensations);
    assert_eq!(
        (st.compensations[0].name.as_str(), st.compensations[0].phase),
        ("reserve", StepPhase::Succeeded)
    );
    let a = s.approvals().get(&apv).await.unwrap().status.unwrap();
    assert_eq!(
        (a.phase, a.decided_by.as_deref()),
        (ApprovalPhase::Rejected, Some("carol"))
    );
    drop(p);
    s.finish().await;
}

/// No confused deputy: naming a ServiceAccount for the run's step Pods needs
/// the right to create Pods in the namespace (or to impersonate that
/// ServiceAccount). A user who may only create AgentRuns is refused, with a
/// message naming the permission; a user who may create Pods is admitted; the
/// namespace's `default` ServiceAccount stays allowed to both.
#[tokio::test]
async fn naming_a_service_account_needs_the_right_to_use_it() {
    let s = Scenario::start_without_operator("approvers-deputy").await;
    let ns = s.namespace().to_owned();
    let p = Policies::install(&ns, &[]).await;
    grant(&ns, &p).await;
    wait_enforced(&ns, true).await;
    let run = |name: &str, sa: &str| {
        manifest(
            &format!("{name}-{ns}"),
            &run_doc(
                name,
                vec![sim_step("a", "Idempotent", json!({}))],
                json!({"podTemplate": {"serviceAccountName": sa}}),
            ),
        )
    };
    let out = kubectl_as(
        "frank",
        &[],
        &ns,
        &["create", "-f", &run("bot-frank", "payments-bot")],
    )
    .await;
    assert_refused(
        &out,
        &format!(
            "spec.podTemplate.serviceAccountName: frank may not run steps as ServiceAccount payments-bot in run bot-frank: that needs permission to create pods in namespace {ns}, or to impersonate serviceaccounts/payments-bot"
        ),
    );
    let out = kubectl_as(
        "erin",
        &[],
        &ns,
        &["create", "-f", &run("bot-erin", "payments-bot")],
    )
    .await;
    assert!(out.success(), "erin may create Pods: {out:?}");
    let out = kubectl_as(
        "frank",
        &[],
        &ns,
        &["create", "-f", &run("plain-frank", "default")],
    )
    .await;
    assert!(
        out.success(),
        "the default ServiceAccount stays allowed: {out:?}"
    );
    let r: AgentRun = s.runs().get("bot-erin").await.unwrap();
    assert_eq!(
        r.metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(labels::REQUESTED_BY))
            .map(String::as_str),
        Some("erin"),
        "the mutating policy stamped the creator"
    );
    drop(p);
    s.finish().await;
}

/// Malformed approver policies are refused at admission (the CRD's own
/// rules, no policy needed), each with a message that says what is wrong.
#[tokio::test]
async fn malformed_approver_policies_are_refused_with_clear_messages() {
    let s = Scenario::start_without_operator("approvers-bad-input").await;
    let ns = s.namespace().to_owned();
    let cases = [
        (
            "empty-group",
            json!({"approvers": {"groups": [""]}}),
            "should be at least 1 chars long",
        ),
        (
            "blank-user",
            json!({"approvers": {"users": ["  "]}}),
            "approval.approvers.users: a user name cannot be blank",
        ),
        (
            "no-one",
            json!({"approvers": {}}),
            "approval.approvers: name at least one user, group or serviceAccount",
        ),
        (
            "quorum-zero",
            json!({"quorum": 0}),
            "should be greater than or equal to 1",
        ),
        (
            "quorum-too-big",
            json!({"approvers": {"users": ["alice", "bob"]}, "quorum": 3}),
            "approval.quorum: more distinct approvers are needed than the users and serviceAccounts listed",
        ),
    ];
    for (name, gate, want) in cases {
        let mut step = sim_step("a", "Idempotent", json!({}));
        step["approval"] = gate;
        let file = manifest(
            &format!("{name}-{ns}"),
            &run_doc(name, vec![step], json!({})),
        );
        let out = kubectl(["-n", &ns, "create", "-f", &file]).await;
        assert_refused(&out, want);
    }
    // Groups make any quorum possible: their size is not known here.
    let mut step = sim_step("a", "Idempotent", json!({}));
    step["approval"] = json!({"approvers": {"groups": ["payments-leads"]}, "quorum": 3});
    let file = manifest(
        &format!("group-quorum-{ns}"),
        &run_doc("group-quorum", vec![step], json!({})),
    );
    let out = kubectl(["-n", &ns, "create", "-f", &file]).await;
    assert!(out.success(), "{out:?}");
    s.finish().await;
}

/// On a cluster without MutatingAdmissionPolicy the chart installs only the
/// validating half: nothing stamps the decider or the run's creator, so a
/// decision must name its decider and a run its creator, and the server
/// takes each only when it names the requester.
#[tokio::test]
async fn without_the_mutating_policy_the_client_names_the_decider_and_the_server_checks_it() {
    let s = Scenario::start("approvers-no-mutating").await;
    let ns = s.namespace().to_owned();
    let p = Policies::install(&ns, &["--set", "admissionPolicies.mutating=false"]).await;
    grant(&ns, &p).await;
    wait_enforced(&ns, false).await;
    let mut pay = sim_step("pay", "NonIdempotent", json!({}));
    pay["approval"] = json!({"approvers": {"users": ["alice"]}});
    let mut run = run_doc("pay", vec![pay], json!({}));
    let unsigned = manifest(&format!("pay-unsigned-{ns}"), &run);
    assert_refused(
        &kubectl_as("dave", &[], &ns, &["create", "-f", &unsigned]).await,
        "metadata.annotations[agentrun.dev/requested-by] must be set to the user who creates the run (dave)",
    );
    run["metadata"]["annotations"] = json!({labels::REQUESTED_BY: "dave"});
    let signed = manifest(&format!("pay-{ns}"), &run);
    let out = kubectl_as("dave", &[], &ns, &["create", "-f", &signed]).await;
    assert!(out.success(), "{out:?}");
    let apv = s.approval_of("pay", Some("pay"), RUN_TIMEOUT).await;
    let patch = |body: Value| {
        let (ns, apv) = (ns.clone(), apv.clone());
        async move {
            let body = body.to_string();
            kubectl_as(
                "alice",
                &[],
                &ns,
                &["patch", "apv", &apv, "--type", "merge", "-p", &body],
            )
            .await
        }
    };
    assert_refused(
        &patch(json!({"spec": {"decision": "Approved"}})).await,
        "spec.decidedBy must be the user who decides (alice)",
    );
    assert_refused(
        &patch(json!({"spec": {"decision": "Approved", "decidedBy": "bob"}})).await,
        "spec.decidedBy must be the user who decides (alice), not bob",
    );
    let out = patch(json!({"spec": {"decision": "Approved", "decidedBy": "alice"}})).await;
    assert!(out.success(), "{out:?}");
    let done = s.wait_finished("pay", RUN_TIMEOUT).await;
    assert_eq!(phase(&done), Some(RunPhase::Succeeded));
    drop(p);
    s.finish().await;
}
