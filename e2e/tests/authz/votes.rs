//! The plugin's quorum vote path (`kubectl agentrun approve` on an Approval
//! with a quorum above 1): the whole vote list with one vote more, under the
//! resourceVersion read. Approvers vote through the plugin and the step runs
//! once; the same request sent as the run's creator (separation of duties)
//! or as a non-approver — which the plugin itself would not send — is
//! refused by the API server.

use std::time::Duration;

use agentrun_e2e::kubeconfig;
use agentrun_e2e::support::policies::{
    Policies, assert_admitted, assert_refused, kubectl_as, manifest, run_doc, wait_enforced,
};
use agentrun_e2e::support::processes::plugin_binary;
use agentrun_e2e::support::scenario::{Scenario, phase, sim_step};
use agentrun_e2e::{kubectl_ok, wait_for};
use agentrun_operator::api::{Approval, RunPhase};
use serde_json::json;

const RUN_TIMEOUT: Duration = Duration::from_secs(90);

/// `kubectl agentrun <args>` in `ns` as `user`: (exit code, stdout, stderr).
async fn plugin(ns: &str, user: &str, args: &[&str]) -> (i32, String, String) {
    let out = tokio::process::Command::new(plugin_binary())
        .arg("--kubeconfig")
        .arg(kubeconfig())
        .args(["-n", ns, "--as", user])
        .args(args)
        .env("NO_COLOR", "1")
        .output()
        .await
        .expect("running kubectl-agentrun");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[tokio::test]
async fn the_plugins_quorum_vote_reaches_the_server_as_the_voter() {
    let s = Scenario::start("authz-plugin-votes").await;
    let ns = s.namespace().to_owned();
    let p = Policies::install(&ns, &[]).await;
    let approver = format!("--clusterrole={}-approver", p.release);
    for args in [
        vec![
            "create",
            "role",
            "authors",
            "--verb=create,get",
            "--resource=agentruns.agentrun.dev",
        ],
        vec![
            "create",
            "rolebinding",
            "authors",
            "--role=authors",
            "--user=dave",
        ],
        vec![
            "create",
            "rolebinding",
            "approvers",
            &approver,
            "--user=dave",
            "--user=alice",
            "--user=bob",
            "--user=mallory",
        ],
    ] {
        let mut all = vec!["-n", ns.as_str()];
        all.extend(args);
        kubectl_ok(all).await;
    }
    wait_enforced(&ns, true).await;

    let mut pay = sim_step("pay", "NonIdempotent", json!({}));
    pay["approval"] = json!({"approvers": {"users": ["dave", "alice", "bob"]}, "quorum": 2,
                             "separateFromRequester": true});
    let file = manifest(
        &format!("payout-{ns}"),
        &run_doc("payout", vec![pay], json!({})),
    );
    assert_admitted(
        &kubectl_as("dave", &[], &ns, &["create", "-f", &file]).await,
        "dave's run",
    );
    let apv = s.approval_of("payout", Some("pay"), RUN_TIMEOUT).await;

    let (code, out, err) = plugin(&ns, "alice", &["approve", "payout", "--yes"]).await;
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains(&format!(
            "approval {apv}: Approved vote by alice recorded (1/2 approvals)"
        )),
        "{out}"
    );

    // What the plugin sends, sent by those it would not send it for, under
    // the resourceVersion once the operator has counted alice's vote.
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
    .expect("the approval");
    let plugin_vote = |user: &str| {
        let mut votes = serde_json::to_value(&a.spec.votes).unwrap();
        votes
            .as_array_mut()
            .unwrap()
            .push(json!({"user": user, "decision": "Approved"}));
        json!({"metadata": {"resourceVersion": a.metadata.resource_version}, "spec": {"votes": votes}}).to_string()
    };
    let (code, _, err) = plugin(&ns, "dave", &["approve", "payout", "--yes"]).await;
    assert_eq!(code, 1, "the plugin refuses the creator first: {err}");
    assert_refused(
        &kubectl_as(
            "dave",
            &[],
            &ns,
            &[
                "patch",
                "apv",
                &apv,
                "--type",
                "merge",
                "-p",
                &plugin_vote("dave"),
            ],
        )
        .await,
        "dave created run payout and may not approve it (separateFromRequester)",
    );
    assert_refused(
        &kubectl_as(
            "mallory",
            &[],
            &ns,
            &[
                "patch",
                "apv",
                &apv,
                "--type",
                "merge",
                "-p",
                &plugin_vote("mallory"),
            ],
        )
        .await,
        "mallory is not an approver; approvers: users dave, alice, bob",
    );
    assert!(
        s.list_pods().await.is_empty(),
        "one vote and two refusals start nothing"
    );

    let (code, out, err) = plugin(&ns, "bob", &["approve", "payout", "--yes"]).await;
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains("Approved vote by bob recorded (2/2 approvals)"),
        "{out}"
    );
    let done = s.wait_finished("payout", RUN_TIMEOUT).await;
    assert_eq!(phase(&done), Some(RunPhase::Succeeded));
    assert_eq!(s.ledger().executions().count(), 1, "released once");
    drop(p);
    s.finish().await;
}
