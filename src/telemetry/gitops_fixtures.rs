//! The status objects the GitOps health checks in `docs/gitops/` are tested
//! against, made by the engine itself (its test world and serialization) and
//! checked in under `docs/gitops/testdata/`. This test fails when the engine
//! would now write something else; `AGENTRUN_UPDATE_FIXTURES=1 cargo test
//! --lib gitops` writes them anew. `e2e/tests/observability.rs` runs the Lua
//! checks on them.

use std::collections::BTreeMap;
use std::path::PathBuf;

use serde_json::{Value, json};

use crate::api::{AgentRun, Approval, Decision as Answer, OnTimeout};
use crate::engine::testing::{PodExt, World, ok_message, step};
use crate::engine::{Refusal, RefusalCause};

fn run_json(w: &World) -> Value {
    let mut v = serde_json::to_value(&w.run).unwrap();
    v["apiVersion"] = json!("agentrun.dev/v1alpha1");
    v["kind"] = json!("AgentRun");
    v
}

fn approval_json(a: &Approval) -> Value {
    let mut v = serde_json::to_value(a).unwrap();
    v["apiVersion"] = json!("agentrun.dev/v1alpha1");
    v["kind"] = json!("Approval");
    // The field the decider is read from; what a person sees is the rest.
    if let Some(m) = v["metadata"].as_object_mut() {
        m.remove("managedFields");
    }
    v
}

fn fixtures() -> BTreeMap<&'static str, Value> {
    let mut out = BTreeMap::new();
    let two = || AgentRun::test().with_steps([step("a"), step("b")]);

    let mut w = World::new(two());
    w.settle();
    out.insert("agentrun-running.json", run_json(&w));

    let mut suspended = w.run.clone();
    suspended.spec.suspend = true;
    let mut ws = World::new(suspended);
    ws.pods = w.pods.clone();
    ws.settle();
    out.insert("agentrun-suspended.json", run_json(&ws));

    let mut changed = w.run.clone();
    changed.metadata.generation = Some(2);
    let mut v = serde_json::to_value(&changed).unwrap();
    v["apiVersion"] = json!("agentrun.dev/v1alpha1");
    v["kind"] = json!("AgentRun");
    out.insert("agentrun-spec-changed.json", v);

    let a = w.status().steps[0].pod.clone().unwrap();
    w.succeed(&a, &ok_message(json!("ok"), 3));
    let b = w.status().steps[1].pod.clone().unwrap();
    w.succeed(&b, &ok_message(json!("ok"), 4));
    out.insert("agentrun-succeeded.json", run_json(&w));

    let mut w = World::new(two());
    w.settle();
    let a = w.status().steps[0].pod.clone().unwrap();
    w.update_pod(&a, |p| p.exited(1, "boom"));
    w.settle();
    out.insert("agentrun-failed.json", run_json(&w));

    let mut w = World::new(two());
    w.settle();
    let a = w.status().steps[0].pod.clone().unwrap();
    w.pods.clear();
    w.refused = vec![Refusal {
        name: a,
        cause: RefusalCause::Transient,
        message: "pods \"x\" is forbidden: exceeded quota: compute, requested: cpu=1, used: cpu=4, limited: cpu=4".into(),
    }];
    w.step();
    out.insert("agentrun-stalled.json", run_json(&w));

    // D18: created again by a re-sync after the TTL deleted the run that ran.
    let mut w = World::new(two());
    w.history = crate::engine::History::AlreadyRan(crate::api::AlreadyRan {
        record: "run-0ld0uid0".into(),
        run_uid: "0ld0uid0-1".into(),
        outcome: "Succeeded".into(),
        completed_at: k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
            crate::engine::testing::t(-600),
        ),
    });
    w.settle();
    out.insert("agentrun-already-ran.json", run_json(&w));

    let gated = || {
        AgentRun::test().with_steps([step("deploy").with_approval(Some("1h"), OnTimeout::Reject)])
    };
    let mut w = World::new(gated());
    w.settle();
    out.insert("agentrun-waiting-for-approval.json", run_json(&w));
    let name = w
        .approvals
        .keys()
        .next()
        .cloned()
        .expect("an approval was asked");
    out.insert("approval-pending.json", approval_json(&w.approvals[&name]));
    let mut approved = World::new(gated());
    approved.settle();
    approved.decide_approval(&name, Answer::Approved, "kubectl-patch");
    approved.settle();
    out.insert(
        "approval-approved.json",
        approval_json(&approved.approvals[&name]),
    );
    let mut rejected = World::new(gated());
    rejected.settle();
    rejected.decide_approval(&name, Answer::Rejected, "kubectl-patch");
    rejected.settle();
    out.insert(
        "approval-rejected.json",
        approval_json(&rejected.approvals[&name]),
    );
    let mut expired = World::new(gated());
    expired.settle();
    expired.advance(3601);
    expired.settle();
    out.insert(
        "approval-expired.json",
        approval_json(&expired.approvals[&name]),
    );
    out
}

#[test]
fn gitops_testdata_is_what_the_engine_writes() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("docs/gitops/testdata");
    // Rewriting never passes: stale files are written and the test still fails, so the
    // change is reviewed and committed; under CI it is refused outright.
    let update = std::env::var_os("AGENTRUN_UPDATE_FIXTURES").is_some();
    assert!(
        !(update && std::env::var_os("CI").is_some()),
        "AGENTRUN_UPDATE_FIXTURES is set under CI: fixtures are compared there, never rewritten"
    );
    let mut stale = Vec::new();
    for (file, value) in fixtures() {
        let text = serde_json::to_string_pretty(&value).unwrap() + "\n";
        let path = dir.join(file);
        if std::fs::read_to_string(&path).ok().as_deref() != Some(text.as_str()) {
            stale.push(file);
            if update {
                std::fs::create_dir_all(&dir).unwrap();
                std::fs::write(&path, &text).unwrap();
            }
        }
    }
    assert!(
        stale.is_empty(),
        "docs/gitops/testdata is stale ({stale:?}): {}",
        if update {
            "rewritten: review the diff, commit it, run again without AGENTRUN_UPDATE_FIXTURES"
        } else {
            "run AGENTRUN_UPDATE_FIXTURES=1 cargo test --lib gitops and commit the result"
        }
    );
}

#[test]
fn the_fixtures_show_each_state_they_are_named_for() {
    let f = fixtures();
    let phase = |k: &str| f[k]["status"]["phase"].as_str().unwrap_or("").to_owned();
    assert_eq!(phase("agentrun-running.json"), "Running");
    assert_eq!(phase("agentrun-succeeded.json"), "Succeeded");
    assert_eq!(phase("agentrun-failed.json"), "Failed");
    assert_eq!(phase("agentrun-already-ran.json"), "AlreadyRan");
    assert_eq!(
        phase("agentrun-waiting-for-approval.json"),
        "WaitingForApproval"
    );
    let stalled = f["agentrun-stalled.json"]["status"]["conditions"]
        .as_array()
        .unwrap()
        .iter()
        .any(|c| c["type"] == "Stalled" && c["status"] == "True");
    assert!(stalled, "{:#}", f["agentrun-stalled.json"]["status"]);
    assert_eq!(f["agentrun-suspended.json"]["spec"]["suspend"], true);
    for (k, want) in [
        ("approval-pending.json", "Pending"),
        ("approval-approved.json", "Approved"),
        ("approval-rejected.json", "Rejected"),
        ("approval-expired.json", "Expired"),
    ] {
        assert_eq!(
            f[k]["status"]["phase"].as_str().unwrap_or("Pending"),
            want,
            "{k}"
        );
    }
}
