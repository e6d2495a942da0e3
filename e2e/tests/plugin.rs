//! `kubectl agentrun` against a real operator and simulated kubelet on the
//! plane, with the chart's admission policies in force: each command does
//! what it says, as the impersonated user it runs as, and says why when it
//! does not.

#[path = "plugin/journal.rs"]
mod journal;

use std::time::Duration;

use agentrun_e2e::kubeconfig;
use agentrun_e2e::support::policies::{
    Policies, assert_admitted, assert_refused, kubectl_as, manifest, run_doc, wait_enforced,
};
use agentrun_e2e::support::processes::plugin_binary;
use agentrun_e2e::support::scenario::{Scenario, field_managers, phase, sim_step, status};
use agentrun_operator::api::{Approval, EffectOutcome, RunPhase, Signal, StepPhase};
use agentrun_operator::labels;
use kube::Api;
use kube::api::DeleteParams;
use serde_json::json;

const RUN_TIMEOUT: Duration = Duration::from_secs(90);

struct Out {
    code: i32,
    stdout: String,
    stderr: String,
}

/// Runs the plugin in `ns`, as `user` (none: the admin) with `groups`.
async fn plugin(ns: &str, user: Option<&str>, groups: &[&str], args: &[&str]) -> Out {
    let mut cmd = tokio::process::Command::new(plugin_binary());
    cmd.arg("--kubeconfig").arg(kubeconfig()).args(["-n", ns]);
    if let Some(u) = user {
        cmd.args(["--as", u]);
    }
    for g in groups {
        cmd.args(["--as-group", g]);
    }
    let out = cmd
        .args(args)
        .env("NO_COLOR", "1")
        .output()
        .await
        .expect("running kubectl-agentrun");
    Out {
        code: out.status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

fn gated(step: &str) -> serde_json::Value {
    let mut s = sim_step(step, "NonIdempotent", json!({}));
    s["approval"] =
        json!({"question": format!("May {step} run?"), "approvers": {"users": ["alice"]}});
    s
}

/// With AGENTRUN_CAPTURE_FIXTURES=<dir>, writes the run, its Approvals and
/// its Signals as the API server returns them: the plugin's rendering tests
/// (plugin/tests/render.rs) use such captures as fixtures.
async fn capture(s: &Scenario, run: &str, file: &str) {
    let Some(dir) = std::env::var_os("AGENTRUN_CAPTURE_FIXTURES") else {
        return;
    };
    let r = s.runs().get(run).await.unwrap();
    let uid = r.metadata.uid.clone().unwrap();
    let approvals: Vec<Approval> = s
        .approvals()
        .list(&Default::default())
        .await
        .unwrap()
        .items
        .into_iter()
        .filter(|a| a.spec.run_uid == uid)
        .collect();
    let signals: Vec<Signal> = signals(s)
        .list(&Default::default())
        .await
        .unwrap()
        .items
        .into_iter()
        .filter(|g| g.spec.run_uid == uid)
        .collect();
    let doc = json!({"run": r, "approvals": approvals, "signals": signals});
    let path = std::path::Path::new(&dir).join(format!("{file}.json"));
    std::fs::write(path, serde_json::to_string_pretty(&doc).unwrap()).unwrap();
}

fn signals(s: &Scenario) -> Api<Signal> {
    s.env().api()
}

/// approve releases the step and records the person; reject fails the run
/// and compensates; pending shows what each user may decide; the errors
/// name the object and the next step; list and describe show the runs.
#[tokio::test]
async fn approve_releases_reject_compensates_and_pending_knows_who_may_decide() {
    let s = Scenario::start("plugin-approve").await;
    let ns = s.namespace().to_owned();
    let _policies = Policies::with_approvers(&ns, &["alice", "mallory"]).await;

    s.create_run("refund", json!({"steps": [gated("refund")]}))
        .await;
    let apv = s.approval_of("refund", None, RUN_TIMEOUT).await;

    capture(&s, "refund", "refund-waiting").await;
    let pending = plugin(&ns, Some("alice"), &[], &["pending"]).await;
    assert_eq!(pending.code, 0, "{}", pending.stderr);
    let row = pending
        .stdout
        .lines()
        .find(|l| l.starts_with(&apv))
        .unwrap_or_else(|| panic!("{}", pending.stdout));
    assert!(row.ends_with("may decide"), "{row}");
    let pending = plugin(&ns, Some("mallory"), &[], &["pending"]).await;
    assert!(
        pending
            .stdout
            .lines()
            .any(|l| l.starts_with(&apv) && l.ends_with("not an approver")),
        "{}",
        pending.stdout
    );

    let listed = plugin(&ns, None, &[], &["list"]).await;
    assert_eq!(listed.code, 0, "{}", listed.stderr);
    let row = listed
        .stdout
        .lines()
        .find(|l| l.starts_with("refund "))
        .unwrap_or_else(|| panic!("{}", listed.stdout));
    assert!(
        row.contains("WaitingForApproval") && row.contains("(user alice)"),
        "{row}"
    );
    assert!(
        listed.stdout.lines().all(|l| l.chars().count() <= 120),
        "{}",
        listed.stdout
    );

    let refused = plugin(&ns, Some("mallory"), &[], &["approve", "refund", "--yes"]).await;
    assert_eq!(refused.code, 1);
    assert!(
        refused.stderr.contains(&format!(
            "approval {apv}: mallory is not an approver; approvers: user alice"
        )),
        "{}",
        refused.stderr
    );
    // The plugin refused before asking; the API server refuses the same
    // decision sent as mallory, word for word, and nothing is recorded.
    let decision = json!({"spec": {"decision": "Approved", "decidedBy": "mallory",
                                   "decidedByGroups": ["system:authenticated"]}})
    .to_string();
    let sent = kubectl_as(
        "mallory",
        &[],
        &ns,
        &["patch", "apv", &apv, "--type", "merge", "-p", &decision],
    )
    .await;
    assert_refused(
        &sent,
        &format!("approval {apv}: mallory is not an approver; approvers: user alice"),
    );
    assert_eq!(s.approvals().get(&apv).await.unwrap().spec.decision, None);
    let no_tty = plugin(&ns, Some("alice"), &[], &["approve", "refund"]).await;
    assert_eq!(
        no_tty.code, 2,
        "no confirmation, no terminal: a usage error"
    );
    assert!(no_tty.stderr.contains("--yes"), "{}", no_tty.stderr);

    let approved = plugin(
        &ns,
        Some("alice"),
        &[],
        &["approve", "refund", "--yes", "--comment", "checked"],
    )
    .await;
    assert_eq!(approved.code, 0, "{}", approved.stderr);
    assert!(
        approved.stdout.contains("May refund run?"),
        "shows the question: {}",
        approved.stdout
    );
    assert!(
        approved
            .stdout
            .contains(&format!("approval {apv}: Approved by alice")),
        "{}",
        approved.stdout
    );
    let done = s.wait_finished("refund", RUN_TIMEOUT).await;
    assert_eq!(phase(&done), Some(RunPhase::Succeeded));
    let a = s.approvals().get(&apv).await.unwrap();
    assert_eq!(a.spec.decided_by.as_deref(), Some("alice"));
    assert_eq!(a.spec.comment.as_deref(), Some("checked"));
    assert!(
        field_managers(&a.metadata).contains("kubectl-agentrun"),
        "the decision names its writer: {:?}",
        field_managers(&a.metadata)
    );
    let again = plugin(&ns, Some("alice"), &[], &["approve", "refund", "--yes"]).await;
    assert_eq!(again.code, 1);
    assert!(
        again.stderr.contains("has no pending approval")
            && again.stderr.contains("already decided (Approved) by alice"),
        "{}",
        again.stderr
    );

    capture(&s, "refund", "refund-approved").await;
    let described = plugin(&ns, None, &[], &["describe", "refund"]).await;
    assert_eq!(described.code, 0, "{}", described.stderr);
    for want in [
        "Run refund in",
        "Succeeded",
        "refund  r1 attempt 1",
        "effect Applied",
        "decision Approved by alice",
        "ApprovalGranted",
    ] {
        assert!(
            described.stdout.contains(want),
            "describe lacks {want:?}:\n{}",
            described.stdout
        );
    }

    let mut reserve = sim_step("reserve", "NonIdempotent", json!({}));
    reserve["compensate"] = json!({"image": "registry.example/agent-step:1"});
    s.create_run("charge", json!({"steps": [reserve, gated("charge")]}))
        .await;
    s.approval_of("charge", None, RUN_TIMEOUT).await;
    let rejected = plugin(
        &ns,
        Some("alice"),
        &[],
        &["reject", "charge", "--yes", "--comment", "fraud"],
    )
    .await;
    assert_eq!(rejected.code, 0, "{}", rejected.stderr);
    let done = s.wait_finished("charge", RUN_TIMEOUT).await;
    assert_eq!(phase(&done), Some(RunPhase::Failed));
    let st = status(&done);
    assert_eq!(
        st.compensations
            .iter()
            .map(|c| (c.name.as_str(), c.phase))
            .collect::<Vec<_>>(),
        [("reserve", StepPhase::Succeeded)]
    );
    capture(&s, "charge", "charge-rejected").await;
    let missing = plugin(&ns, None, &[], &["describe", "nope"]).await;
    assert_eq!(missing.code, 1);
    assert!(
        missing
            .stderr
            .contains("AgentRun nope not found in namespace"),
        "{}",
        missing.stderr
    );
    s.finish().await;
}

/// reconcile --retry answers what an interrupted NonIdempotent step did,
/// shows the key and the Pod first, and the step runs again with the same
/// key; suspend, resume and cancel steer a run.
#[tokio::test]
async fn reconcile_retry_reruns_with_the_same_key_and_cancel_compensates() {
    let s = Scenario::start("plugin-reconcile").await;
    let ns = s.namespace().to_owned();
    let pay = json!({"name": "pay", "effect": "NonIdempotent",
        "container": {"image": "registry.example/pay:1", "env": [{"name": "SIM_STEP",
            "value": json!({"attempts": [{"runMs": 30000}, {"runMs": 50, "result": {"paid": true}}]}).to_string()}]}});
    s.create_run("pay", json!({"steps": [pay]})).await;
    let running = s
        .wait_run("pay", "running", RUN_TIMEOUT, |r| {
            status(r)
                .steps
                .iter()
                .any(|c| c.phase == StepPhase::Running && c.pod_uid.is_some())
        })
        .await;
    let first = status(&running).steps[0].clone();
    s.pods()
        .delete(first.pod.as_deref().unwrap(), &DeleteParams::default())
        .await
        .expect("deleting the step Pod");
    s.wait_run("pay", "asking what the step did", RUN_TIMEOUT, |r| {
        status(r)
            .steps
            .iter()
            .any(|c| c.effect == Some(EffectOutcome::Unknown) && c.approval.is_some())
    })
    .await;
    let usage = plugin(&ns, None, &[], &["reconcile", "pay", "--yes"]).await;
    assert_eq!(usage.code, 2, "{}", usage.stderr);
    // The Approval appears right after the run names it.
    let mut out = plugin(&ns, None, &[], &["reconcile", "pay", "--retry", "--yes"]).await;
    for _ in 0..50 {
        if out.code == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
        out = plugin(&ns, None, &[], &["reconcile", "pay", "--retry", "--yes"]).await;
    }
    assert_eq!(out.code, 0, "{}", out.stderr);
    assert!(
        out.stdout
            .contains(&format!("idempotency key: {}", first.idempotency_key)),
        "{}",
        out.stdout
    );
    assert!(
        out.stdout
            .contains(&format!("interrupted Pod: {}", first.pod.clone().unwrap())),
        "{}",
        out.stdout
    );
    let done = s.wait_finished("pay", RUN_TIMEOUT).await;
    assert_eq!(phase(&done), Some(RunPhase::Succeeded));
    let after = status(&done).steps[0].clone();
    assert_eq!(
        (after.attempt, &after.idempotency_key),
        (2, &first.idempotency_key)
    );
    assert_eq!(
        s.ledger().executions_by_key().get(&first.idempotency_key),
        Some(&2)
    );

    // Steering: suspend starts nothing, resume goes on, cancel compensates.
    let mut undo = sim_step("book", "NonIdempotent", json!({}));
    undo["compensate"] = json!({"image": "registry.example/agent-step:1"});
    s.create_run("trip", json!({"suspend": true, "steps": [undo, sim_step("wait", "None", json!({"runMs": 60000}))]})).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(s.list_pods().await.iter().all(|p| {
        !p.metadata
            .name
            .as_deref()
            .unwrap_or("")
            .starts_with("trip-")
    }));
    let out = plugin(&ns, None, &[], &["resume", "trip"]).await;
    assert_eq!(
        (out.code, out.stdout.trim()),
        (0, "agentrun trip resumed"),
        "{}",
        out.stderr
    );
    s.wait_run("trip", "on its second step", RUN_TIMEOUT, |r| {
        status(r).current_step.as_deref() == Some("wait")
    })
    .await;
    let out = plugin(&ns, None, &[], &["cancel", "trip", "--yes"]).await;
    assert_eq!(out.code, 0, "{}", out.stderr);
    let done = s.wait_finished("trip", RUN_TIMEOUT).await;
    assert_eq!(phase(&done), Some(RunPhase::Cancelled));
    assert_eq!(status(&done).compensations.len(), 1);
    s.finish().await;
}

/// `kubectl agentrun watch` follows a run to its end: one line per change
/// when its output is not a terminal, through a wait step and a step, then
/// it exits 0 by itself.
#[tokio::test]
async fn watch_follows_a_run_to_its_end_and_exits() {
    let s = Scenario::start("plugin-watch").await;
    s.create_run(
        "follow",
        json!({"steps": [
            {"name": "pause", "wait": {"for": "2s"}},
            sim_step("work", "None", json!({"runMs": 1500})),
        ]}),
    )
    .await;
    let out = tokio::time::timeout(
        RUN_TIMEOUT,
        plugin(s.namespace(), None, &[], &["watch", "follow"]),
    )
    .await
    .expect("watch ends when the run does");
    assert_eq!(out.code, 0, "{}{}", out.stdout, out.stderr);
    let lines: Vec<&str> = out.stdout.lines().collect();
    assert!(
        lines
            .iter()
            .any(|l| l.starts_with("follow Waiting step pause progress 0/2")),
        "{lines:?}"
    );
    assert!(
        lines
            .iter()
            .any(|l| l.starts_with("follow Running step work")),
        "{lines:?}"
    );
    assert_eq!(
        lines.last().copied(),
        Some("follow Succeeded step work progress 2/2"),
        "{lines:?}"
    );
    let unique: std::collections::BTreeSet<&&str> = lines.iter().collect();
    assert_eq!(unique.len(), lines.len(), "one line per change: {lines:?}");
    assert_eq!(
        phase(&s.runs().get("follow").await.unwrap()),
        Some(RunPhase::Succeeded)
    );
    s.finish().await;
}

/// `kubectl agentrun signal` sends a wait step's event as the user who runs
/// it, under the chart's validating policy alone (no mutating policy stamps
/// the sender, so the plugin names it and the API server checks it): the
/// step succeeds with the data as its result and the next step's Pod runs;
/// the same id again changes nothing; another id is the API server's
/// refusal; data that is not a JSON object never reaches it.
#[tokio::test]
async fn signal_sends_as_the_user_once_and_a_repeat_changes_nothing() {
    let s = Scenario::start("plugin-signal").await;
    let ns = s.namespace().to_owned();
    let p = Policies::install(&ns, &["--set", "admissionPolicies.mutating=false"]).await;
    p.grant_authors(&ns, &["dave"]).await;
    p.grant_role(&ns, "signaler", &["ci-bot"]).await;
    wait_enforced(&ns, false).await;

    let mut run = run_doc(
        "pay",
        vec![
            json!({"name": "settle", "wait": {"signal": {
                "description": "payment settled", "timeout": "10m",
            }}}),
            sim_step("b", "Idempotent", json!({"runMs": 50})),
        ],
        json!({}),
    );
    run["metadata"]["annotations"] = json!({labels::REQUESTED_BY: "dave"});
    let created = kubectl_as(
        "dave",
        &[],
        &ns,
        &["create", "-f", &manifest(&format!("pay-{ns}"), &run)],
    )
    .await;
    assert_admitted(&created, "dave's run");
    let waiting = s
        .wait_run("pay", "waiting for its signal", RUN_TIMEOUT, |r| {
            status(r)
                .steps
                .iter()
                .any(|c| c.name == "settle" && c.signal.is_some())
        })
        .await;
    let name = status(&waiting)
        .steps
        .into_iter()
        .find(|c| c.name == "settle")
        .and_then(|c| c.signal)
        .unwrap();
    agentrun_e2e::wait_for(
        &signals(&s),
        &name,
        |g: Option<&Signal>| g.is_some(),
        Duration::from_secs(20),
    )
    .await
    .unwrap_or_else(|| panic!("Signal {name} was not opened"));
    capture(&s, "pay", "signal-waiting").await;

    let described = plugin(&ns, None, &[], &["describe", "pay"]).await;
    assert_eq!(described.code, 0, "{}", described.stderr);
    for want in [
        "Waiting for: signal on step settle, until ".to_owned(),
        format!("      waits for signal (payment settled): Signal {name}\n"),
        "      expires at ".to_owned(),
        "      send with: kubectl agentrun signal pay settle --data '{…}'\n".to_owned(),
    ] {
        assert!(
            described.stdout.contains(&want),
            "{want:?} in\n{}",
            described.stdout
        );
    }
    let listed = plugin(&ns, None, &[], &["list"]).await;
    let row = listed
        .stdout
        .lines()
        .find(|l| l.starts_with("pay "))
        .unwrap_or("");
    assert!(
        row.contains("signal (payment settled)"),
        "{}",
        listed.stdout
    );

    // Data that is not an object is refused before any request: as a user
    // who may not even read the run, the refusal is still about the data.
    let bad = plugin(
        &ns,
        Some("nobody"),
        &[],
        &["signal", "pay", "settle", "--data", "[1]", "--id", "pay-1"],
    )
    .await;
    assert_eq!(bad.code, 1, "{}{}", bad.stdout, bad.stderr);
    assert_eq!(
        bad.stderr,
        "error: run pay, step settle: --data must be a JSON object, like '{\"amount\": 12}'; \
         got an array\n"
    );
    assert_eq!(signals(&s).get(&name).await.unwrap().spec.id, None);

    let sent = plugin(
        &ns,
        Some("ci-bot"),
        &[],
        &[
            "signal",
            "pay",
            "settle",
            "--data",
            r#"{"amount":12}"#,
            "--id",
            "pay-1",
        ],
    )
    .await;
    assert_eq!(sent.code, 0, "{}", sent.stderr);
    assert_eq!(sent.stdout, format!("signal {name} sent (id pay-1)\n"));
    let done = s.wait_finished("pay", RUN_TIMEOUT).await;
    assert_eq!(
        phase(&done),
        Some(RunPhase::Succeeded),
        "{:#?}",
        done.status
    );
    let settle = status(&done)
        .steps
        .into_iter()
        .find(|c| c.name == "settle")
        .unwrap();
    assert_eq!(settle.phase, StepPhase::Succeeded);
    assert_eq!(settle.result, Some(json!({"amount": 12})));
    assert_eq!(settle.decided_by.as_deref(), Some("ci-bot"));
    assert_eq!(s.ledger().starts("pay", "b", "step"), 1, "b's Pod ran once");
    let received = signals(&s).get(&name).await.unwrap();
    assert_eq!(received.spec.sent_by.as_deref(), Some("ci-bot"));
    assert!(field_managers(&received.metadata).contains("kubectl-agentrun"));

    let again = plugin(
        &ns,
        Some("ci-bot"),
        &[],
        &[
            "signal",
            "pay",
            "settle",
            "--data",
            r#"{"amount": 12}"#,
            "--id",
            "pay-1",
        ],
    )
    .await;
    assert_eq!(again.code, 0, "{}", again.stderr);
    assert_eq!(
        again.stdout,
        format!("signal {name} was already received with id pay-1; nothing changed\n")
    );
    let other = plugin(
        &ns,
        Some("ci-bot"),
        &[],
        &[
            "signal",
            "pay",
            "settle",
            "--data",
            r#"{"amount":99}"#,
            "--id",
            "pay-2",
        ],
    )
    .await;
    assert_eq!(other.code, 1, "{}{}", other.stdout, other.stderr);
    for want in [
        format!("error: sending signal {name} (run pay, step settle): "),
        "this signal was already received with id pay-1".to_owned(),
    ] {
        assert!(other.stderr.contains(&want), "{want:?} in {}", other.stderr);
    }
    assert_eq!(
        signals(&s)
            .get(&name)
            .await
            .unwrap()
            .metadata
            .resource_version,
        received.metadata.resource_version,
        "neither the repeat nor the refusal changed the Signal"
    );
    let not_a_signal = plugin(
        &ns,
        Some("ci-bot"),
        &[],
        &["signal", "pay", "b", "--data", "{}"],
    )
    .await;
    assert_eq!(not_a_signal.code, 1);
    assert_eq!(
        not_a_signal.stderr,
        "error: run pay, step b: the step does not wait for a signal (it is Succeeded)\n"
    );

    capture(&s, "pay", "signal-received").await;
    let described = plugin(&ns, None, &[], &["describe", "pay"]).await;
    assert!(
        described
            .stdout
            .contains("      signal pay-1 from ci-bot\n"),
        "{}",
        described.stdout
    );
    drop(p);
    s.finish().await;
}
