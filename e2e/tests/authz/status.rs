//! The status of an Approval or a Signal is the operator's record of what
//! became of it (D22): a write to `approvals/status` or `signals/status` by
//! anyone else — here mallory, whom RBAC lets patch both — is refused by the
//! API server, and the waits it would have ended go on waiting. The
//! operator's own ServiceAccount is admitted.
//!
//! ```text
//!   mallory (patch approvals/status, signals/status) ──phase Approved / Received──▶ refused
//!   operator SA (the same RBAC)                       ──the same write, dry run──▶ admitted
//! ```

use agentrun_e2e::support::policies::{
    Policies, assert_admitted, assert_refused, kubectl_as, wait_enforced,
};
use agentrun_e2e::support::scenario::{Scenario, phase, sim_step};
use agentrun_e2e::{kubectl_ok, wait_for};
use agentrun_operator::api::{RunPhase, Signal};
use serde_json::json;

use super::RUN_TIMEOUT;

#[tokio::test]
async fn only_the_operator_writes_the_status_of_approvals_and_signals() {
    let s = Scenario::start("authz-status").await;
    let ns = s.namespace().to_owned();
    let p = Policies::install(&ns, &[]).await;
    let operator = p.operator(&ns);
    let operator_sa = format!(
        "--serviceaccount={}",
        operator.trim_start_matches("system:serviceaccount:")
    );
    for args in [
        vec![
            "create",
            "role",
            "status-writers",
            "--verb=get,patch,update",
            "--resource=approvals.agentrun.dev/status,signals.agentrun.dev/status",
        ],
        vec![
            "create",
            "rolebinding",
            "status-writers",
            "--role=status-writers",
            "--user=mallory",
            &operator_sa,
        ],
    ] {
        let mut all = vec!["-n", ns.as_str()];
        all.extend(args);
        kubectl_ok(all).await;
    }
    wait_enforced(&ns, true).await;

    let mut pay = sim_step("pay", "NonIdempotent", json!({}));
    pay["approval"] = json!({"question": "Pay out?"});
    s.create_run("gated", json!({"steps": [pay]})).await;
    s.create_run(
        "waiting",
        json!({"steps": [{"name": "settle", "wait": {"signal": {"timeout": "10m"}}}]}),
    )
    .await;
    let apv = s.approval_of("gated", Some("pay"), RUN_TIMEOUT).await;
    let waiting = s
        .wait_run("waiting", "waiting for its signal", RUN_TIMEOUT, |r| {
            r.status
                .as_ref()
                .is_some_and(|st| st.steps.iter().any(|c| c.signal.is_some()))
        })
        .await;
    let sig = waiting.status.unwrap().steps[0].signal.clone().unwrap();
    let signals: kube::Api<Signal> = s.env().api();
    wait_for(
        &signals,
        &sig,
        |x: Option<&Signal>| x.is_some(),
        RUN_TIMEOUT,
    )
    .await
    .unwrap_or_else(|| panic!("Signal {sig} was not opened"));

    for (kind, name, status, refusal) in [
        (
            "approval",
            apv.as_str(),
            json!({"status": {"phase": "Approved", "decidedBy": "mallory"}}),
            format!(
                "approval {apv}: only the operator ({operator}) writes the status of an approval; mallory may decide it through spec.decision or spec.votes"
            ),
        ),
        (
            "signal",
            sig.as_str(),
            json!({"status": {"phase": "Received"}}),
            format!(
                "signal {sig}: only the operator ({operator}) writes the status of a signal; mallory may send it through spec.id and spec.data"
            ),
        ),
    ] {
        let body = status.to_string();
        let write = [
            "patch",
            kind,
            name,
            "--subresource=status",
            "--type",
            "merge",
            "-p",
            &body,
        ];
        let out = kubectl_as("mallory", &[], &ns, &write).await;
        assert_refused(&out, &refusal);
        let mut dry = write.to_vec();
        dry.push("--dry-run=server");
        let out = kubectl_as(&operator, &[], &ns, &dry).await;
        assert_admitted(
            &out,
            &format!("the operator's write of the {kind}'s status"),
        );
    }
    assert_eq!(
        phase(&s.runs().get("gated").await.unwrap()),
        Some(RunPhase::WaitingForApproval),
        "nothing refused moved the run"
    );
    assert_eq!(
        phase(&s.runs().get("waiting").await.unwrap()),
        Some(RunPhase::Waiting),
        "nothing refused moved the run"
    );
    drop(p);
    s.finish().await;
}
