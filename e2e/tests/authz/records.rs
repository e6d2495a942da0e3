//! D22, the history's half: RunRecords are the operator's alone. A record
//! makes a GitOps re-creation of its run run nothing (D18), so one planted
//! would stop a future run and one deleted would make a finished run
//! execute again on its next re-sync. With the chart's records policy,
//! mallory, whose role grants every verb on runrecords, is refused each
//! write with the reason; the operator's ServiceAccount, holding the same
//! role, is admitted; and the namespace's own deletion still takes the
//! records along (the namespace controller may delete them once the
//! namespace is being deleted).

use std::time::Duration;

use agentrun_e2e::kubectl_ok;
use agentrun_e2e::support::policies::{
    Policies, assert_admitted, assert_refused, kubectl_as, manifest,
};
use agentrun_e2e::support::scenario::Scenario;
use k8s_openapi::api::core::v1::Namespace;
use kube::Api;
use serde_json::{Value, json};

/// The namespace controller's user in a cluster whose controller manager
/// runs each controller as its own ServiceAccount.
const NAMESPACE_CONTROLLER: &str = "system:serviceaccount:kube-system:namespace-controller";
/// A finalizer of the test's, holding a record while its namespace goes.
const HOLD: &str = "e2e.agentrun.dev/hold";

/// Releases the test's finalizer from the record `name` of `namespace`
/// when dropped, also when the test panics: the namespace can go.
struct Unhold<'a>(&'a str, &'a str);

impl Drop for Unhold<'_> {
    fn drop(&mut self) {
        let _ = std::process::Command::new(agentrun_e2e::support::kubectl::kubectl_binary())
            .arg("--kubeconfig")
            .arg(agentrun_e2e::kubeconfig())
            .args(["-n", self.0, "patch", "runrecord", self.1, "--type=merge"])
            .args(["-p", r#"{"metadata":{"finalizers":null}}"#])
            .output();
    }
}

/// A record of run `run` (UID `<tag>-0000-4000-8000-000000000000`), named
/// as the operator names it.
fn record_doc(run: &str, tag: &str) -> Value {
    json!({
        "apiVersion": "agentrun.dev/v1alpha1",
        "kind": "RunRecord",
        "metadata": {
            "name": format!("{run}-{tag}"),
            "labels": {"agentrun.dev/run": run},
        },
        "spec": {
            "run": {
                "namespace": "placeholder",
                "name": run,
                "uid": format!("{tag}-0000-4000-8000-000000000000"),
                "specDigests": ["9e192b8624214fba49c6410dad95627b"],
                "createdAt": "2026-11-01T00:00:00Z",
            },
            "outcome": {"phase": "Succeeded", "completedAt": "2026-11-01T00:01:00Z"},
        },
    })
}

/// Waits until the records policy refuses mallory's dry-run create.
async fn wait_records_guarded(ns: &str, file: &str) {
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let out = kubectl_as(
            "mallory",
            &[],
            ns,
            &["create", "--dry-run=server", "-f", file],
        )
        .await;
        if !out.success() && out.stderr.contains("only the operator") {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the records policy is not enforced after 30 s: {out:?}"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

#[tokio::test]
async fn only_the_operator_writes_or_deletes_run_records() {
    let s = Scenario::start_without_operator("authz-records").await;
    let ns = s.namespace().to_owned();
    let p = Policies::install(&ns, &[]).await;
    let operator = p.operator(&ns);
    // RBAC lets both write records: only the policy tells them apart.
    kubectl_ok([
        "-n",
        &ns,
        "create",
        "role",
        "record-writers",
        "--verb=*",
        "--resource=runrecords.agentrun.dev",
    ])
    .await;
    let sa = format!(
        "--serviceaccount={}",
        operator.trim_start_matches("system:serviceaccount:")
    );
    kubectl_ok([
        "-n",
        &ns,
        "create",
        "rolebinding",
        "record-writers",
        "--role=record-writers",
        "--user=mallory",
        &sa,
    ])
    .await;
    let mut doc = record_doc("refund-4711", "0a1b2c3d");
    doc["spec"]["run"]["namespace"] = json!(ns);
    let planted = manifest(&format!("record-{ns}"), &doc);
    wait_records_guarded(&ns, &planted).await;
    let refusal = |name: &str| {
        format!(
            "runrecord {name}: only the operator ({operator}) writes or deletes run records; mallory may read them"
        )
    };

    // Planting one: refused.
    let out = kubectl_as("mallory", &[], &ns, &["create", "-f", &planted]).await;
    assert_refused(&out, &refusal("refund-4711-0a1b2c3d"));
    // The operator writes it.
    let out = kubectl_as(&operator, &[], &ns, &["create", "-f", &planted]).await;
    assert_admitted(&out, "the operator's record");

    // Changing or deleting the operator's record: refused, and it stays.
    let changes: [&[&str]; 3] = [
        &[
            "label",
            "--overwrite",
            "runrecord",
            "refund-4711-0a1b2c3d",
            "agentrun.dev/run=other",
        ],
        &[
            "annotate",
            "runrecord",
            "refund-4711-0a1b2c3d",
            "agentrun.dev/completed-at=2020-01-01T00:00:00Z",
        ],
        &["delete", "runrecord", "refund-4711-0a1b2c3d"],
    ];
    for args in changes {
        let out = kubectl_as("mallory", &[], &ns, args).await;
        assert_refused(&out, &refusal("refund-4711-0a1b2c3d"));
    }
    let kept = kubectl_ok([
        "-n",
        &ns,
        "get",
        "runrecord",
        "refund-4711-0a1b2c3d",
        "-o",
        "jsonpath={.metadata.labels.agentrun\\.dev/run} {.metadata.annotations}",
    ])
    .await;
    assert_eq!(
        kept.trim(),
        "refund-4711",
        "the record is as the operator wrote it"
    );

    // The operator removes what its retention removes.
    let out = kubectl_as(
        &operator,
        &[],
        &ns,
        &["delete", "runrecord", "refund-4711-0a1b2c3d"],
    )
    .await;
    assert_admitted(&out, "the operator's pruning");

    // The namespace's deletion takes its records along. In a cluster whose
    // controller manager uses a ServiceAccount per controller, the namespace
    // controller deletes them as system:serviceaccount:kube-system:namespace-controller
    // (this plane's acts as an administrator, so the test acts as that
    // ServiceAccount itself): refused while the namespace lives, admitted once
    // it is being deleted. A finalizer holds the record there to show it.
    let mut held = doc.clone();
    held["metadata"]["finalizers"] = json!([HOLD]);
    let held = manifest(&format!("held-record-{ns}"), &held);
    let unhold = Unhold(&ns, "refund-4711-0a1b2c3d");
    let out = kubectl_as(&operator, &[], &ns, &["create", "-f", &held]).await;
    assert_admitted(&out, "the operator's record");
    let delete = [
        "delete",
        "--wait=false",
        "runrecord",
        "refund-4711-0a1b2c3d",
    ];
    let out = kubectl_as(NAMESPACE_CONTROLLER, &[], &ns, &delete).await;
    assert_refused(&out, "only the operator");
    let namespaces: Api<Namespace> = Api::all(s.env().client());
    namespaces.delete(&ns, &Default::default()).await.unwrap();
    // The policy reads the namespace from the API server's informer: a moment.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let out = kubectl_as(NAMESPACE_CONTROLLER, &[], &ns, &delete).await;
        if out.success() {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the namespace controller may not delete a record of a namespace being deleted: {out:?}"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    drop(unhold);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while namespaces.get_opt(&ns).await.unwrap().is_some() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "namespace {ns} with a RunRecord was not deleted within 60 s: {:?}",
            namespaces.get(&ns).await.map(|n| n.status)
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    drop(p);
    s.finish().await;
}
