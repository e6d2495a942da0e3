//! Wait steps that end on a signal from outside, on the real control plane
//! with the operator and the simulated kubelet: who may send one is RBAC's
//! and the chart's policies' to decide, checked by the API server with
//! impersonation (`--as`); the data becomes the step's result; a signal is
//! received once, also when it is sent twice while the operator is down;
//! one that does not come in time expires and a late one is refused.
//!
//! ```text
//!   dave ──create AgentRun [wait signal settle, ship]──▶ operator opens Signal <run>-settle-…-signal
//!   ci-bot (signaler) ──patch spec.id + spec.data──▶ MAP stamps sentBy ─▶ VAP checks ─▶ settle Succeeded, ship runs
//!   dave, mallory, the operator, a forged sentBy, a planted Signal ──▶ refused, saying why
//!   wait.signal.senders + separateFromRequester ──copied onto the Signal──▶ VAP: only a listed
//!       sender, never the run's creator; mallory (a signaler, not listed), dave (listed, creator) ──▶ refused
//! ```
//!
//! Needs the plane and `e2e/cluster tools`; fails, never skips, without them.

use std::time::Duration;

use agentrun_e2e::support::policies::{
    Policies, assert_admitted, assert_refused, kubectl_as, manifest, run_doc, wait_enforced,
};
use agentrun_e2e::support::scenario::{Scenario, phase, sim_step, status};
use agentrun_e2e::{kubectl_ok, wait_for};
use agentrun_operator::api::{AgentRun, RunPhase, Signal, SignalPhase, StepCheckpoint, StepPhase};
use kube::Api;
use kube::api::{ListParams, Patch, PatchParams};
use serde_json::{Value, json};

const RUN_TIMEOUT: Duration = Duration::from_secs(90);

fn checkpoint(run: &AgentRun, step: &str) -> StepCheckpoint {
    status(run)
        .steps
        .into_iter()
        .find(|c| c.name == step && c.role.is_step())
        .unwrap_or_else(|| panic!("no checkpoint of {step}: {:#?}", run.status))
}

fn signals(s: &Scenario) -> Api<Signal> {
    s.env().api()
}

/// The Signal run `run` waits on at step `step`, once the run waits.
async fn signal_of(s: &Scenario, run: &str, step: &str) -> Signal {
    let waiting = s
        .wait_run(run, "waiting for its signal", RUN_TIMEOUT, |r| {
            r.status.as_ref().is_some_and(|st| {
                st.steps
                    .iter()
                    .any(|c| c.name == step && c.signal.is_some())
            })
        })
        .await;
    let name = checkpoint(&waiting, step)
        .signal
        .expect("the Signal's name");
    wait_for(
        &signals(s),
        &name,
        |sig: Option<&Signal>| sig.is_some(),
        Duration::from_secs(20),
    )
    .await
    .unwrap_or_else(|| panic!("Signal {name} was not opened"))
}

async fn signal_phase(s: &Scenario, name: &str, want: SignalPhase) -> Signal {
    wait_for(
        &signals(s),
        name,
        |sig: Option<&Signal>| {
            sig.and_then(|sig| sig.status.as_ref())
                .is_some_and(|st| st.phase == want)
        },
        Duration::from_secs(30),
    )
    .await
    .unwrap_or_else(|| panic!("Signal {name} did not become {want:?}"))
}

fn send(id: &str, data: Value) -> String {
    json!({"spec": {"id": id, "data": data}}).to_string()
}

/// settle (a signal, with a timeout) → ship.
fn settle_then_ship(timeout: &str, on_timeout: &str) -> Vec<Value> {
    vec![
        json!({"name": "settle", "wait": {"signal": {
            "description": "payment settled", "timeout": timeout, "onTimeout": on_timeout,
        }}}),
        sim_step("ship", "Idempotent", json!({"runMs": 50})),
    ]
}

/// RBAC in the namespace: dave authors runs; ci-bot and the operator's
/// ServiceAccount hold the release's signaler role (the operator's, to show
/// that the policy and not RBAC keeps it from sending); mallory may create
/// Signals, to show that only the operator opens one.
async fn grant(ns: &str, p: &Policies) {
    p.grant_authors(ns, &["dave"]).await;
    let sa = format!(
        "--serviceaccount={}",
        p.operator(ns).trim_start_matches("system:serviceaccount:")
    );
    p.grant_role(ns, "signaler", &["ci-bot", &sa]).await;
    kubectl_ok([
        "-n",
        ns,
        "create",
        "role",
        "planters",
        "--verb=create,patch",
        "--resource=signals.agentrun.dev",
    ])
    .await;
    kubectl_ok([
        "-n",
        ns,
        "create",
        "rolebinding",
        "planters",
        "--role=planters",
        "--user=mallory",
    ])
    .await;
}

/// A signaler's signal ends the wait with its data as the step's result,
/// recorded as theirs; everyone else is refused with a message that says
/// why: the run's author (no RBAC), a client naming someone else as the
/// sender, the operator's ServiceAccount, and someone who plants a Signal
/// of their own. A repeat with the same id is admitted and changes
/// nothing; another id is refused.
#[tokio::test]
async fn only_a_signaler_sends_and_is_recorded_as_the_sender() {
    let s = Scenario::start("signals-send").await;
    let ns = s.namespace().to_owned();
    let p = Policies::install(&ns, &[]).await;
    grant(&ns, &p).await;
    wait_enforced(&ns, true).await;

    let run = run_doc("order", settle_then_ship("10m", "Fail"), json!({}));
    let created = kubectl_as(
        "dave",
        &[],
        &ns,
        &["create", "-f", &manifest(&format!("run-{ns}"), &run)],
    )
    .await;
    assert_admitted(&created, "dave's run");
    let sig = signal_of(&s, "order", "settle").await;
    let name = sig.metadata.name.clone().unwrap();
    assert_eq!(sig.spec.requested_by.as_deref(), Some("dave"));
    assert_eq!(sig.spec.description.as_deref(), Some("payment settled"));
    assert!(sig.spec.expires_at.is_some());

    let paid = send("pay-4711", json!({"amount": 12, "currency": "EUR"}));
    let patch = ["patch", "signal", &name, "--type", "merge", "-p", &paid];
    let out = kubectl_as("dave", &[], &ns, &patch).await;
    assert_refused(&out, "User \"dave\" cannot get resource \"signals\"");
    let forged = json!({"spec": {"id": "pay-4711", "data": {}, "sentBy": "alice"}}).to_string();
    let out = kubectl_as(
        "ci-bot",
        &[],
        &ns,
        &["patch", "signal", &name, "--type", "merge", "-p", &forged],
    )
    .await;
    assert_refused(
        &out,
        "spec.sentBy must be the user who sends (ci-bot), not alice",
    );
    let out = kubectl_as(&p.operator(&ns), &[], &ns, &patch).await;
    assert_refused(&out, "may expire or supersede a signal, never send it");
    let mut planted = serde_json::to_value(&sig).unwrap();
    planted["metadata"] =
        json!({"name": "order-settle-planted", "ownerReferences": sig.metadata.owner_references});
    planted["spec"]["id"] = json!("pay-4711");
    planted["spec"]["data"] = json!({"amount": 1_000_000});
    planted.as_object_mut().unwrap().remove("status");
    let out = kubectl_as(
        "mallory",
        &[],
        &ns,
        &[
            "create",
            "-f",
            &manifest(&format!("planted-{ns}"), &planted),
        ],
    )
    .await;
    assert_refused(&out, "only the operator");
    assert_eq!(
        phase(&s.runs().get("order").await.unwrap()),
        Some(RunPhase::Waiting),
        "nothing refused moved the run"
    );

    let out = kubectl_as("ci-bot", &[], &ns, &patch).await;
    assert_admitted(&out, "ci-bot's signal");
    let sent = signals(&s).get(&name).await.unwrap();
    assert_eq!(
        sent.spec.sent_by.as_deref(),
        Some("ci-bot"),
        "stamped by the API server"
    );
    let again = kubectl_as("ci-bot", &[], &ns, &patch).await;
    assert_admitted(&again, "the same signal again");
    assert!(again.stdout.contains("(no change)"), "{again:?}");
    let other = send("pay-4712", json!({"amount": 99}));
    let out = kubectl_as(
        "ci-bot",
        &[],
        &ns,
        &["patch", "signal", &name, "--type", "merge", "-p", &other],
    )
    .await;
    assert_refused(&out, "this signal was already received with id pay-4711");

    let done = s.wait_finished("order", RUN_TIMEOUT).await;
    assert_eq!(
        phase(&done),
        Some(RunPhase::Succeeded),
        "{:#?}",
        done.status
    );
    let c = checkpoint(&done, "settle");
    assert_eq!(c.phase, StepPhase::Succeeded);
    assert_eq!(c.result, Some(json!({"amount": 12, "currency": "EUR"})));
    assert_eq!(c.decided_by.as_deref(), Some("ci-bot"));
    assert_eq!(s.ledger().starts("order", "ship", "step"), 1);
    let received = signal_phase(&s, &name, SignalPhase::Received).await;
    assert!(
        received
            .status
            .unwrap()
            .message
            .unwrap()
            .contains("signal pay-4711 received"),
    );
    s.finish().await;
}

/// Nothing is sent in time: with onTimeout Fail the run fails, with Skip the
/// step is skipped and the run goes on; both Signals say Expired and the API
/// server refuses a signal sent after that.
#[tokio::test]
async fn a_signal_that_does_not_come_in_time_expires_and_a_late_one_is_refused() {
    let s = Scenario::start("signals-expire").await;
    s.create_run("strict", json!({"steps": settle_then_ship("3s", "Fail")}))
        .await;
    s.create_run("lenient", json!({"steps": settle_then_ship("3s", "Skip")}))
        .await;
    let strict = s.wait_finished("strict", RUN_TIMEOUT).await;
    let lenient = s.wait_finished("lenient", RUN_TIMEOUT).await;
    assert_eq!(
        phase(&strict),
        Some(RunPhase::Failed),
        "{:#?}",
        strict.status
    );
    assert_eq!(checkpoint(&strict, "settle").phase, StepPhase::Failed);
    let failed = status(&strict)
        .conditions
        .into_iter()
        .find(|c| c.type_ == "Succeeded")
        .unwrap();
    assert_eq!(failed.reason, "SignalExpired");
    assert_eq!(
        phase(&lenient),
        Some(RunPhase::Succeeded),
        "{:#?}",
        lenient.status
    );
    assert_eq!(checkpoint(&lenient, "settle").phase, StepPhase::Skipped);
    assert_eq!(s.ledger().starts("strict", "ship", "step"), 0);
    assert_eq!(s.ledger().starts("lenient", "ship", "step"), 1);
    for run in [&strict, &lenient] {
        let name = checkpoint(run, "settle").signal.unwrap();
        signal_phase(&s, &name, SignalPhase::Expired).await;
        let late = signals(&s)
            .patch(
                &name,
                &PatchParams::default(),
                &Patch::Merge(json!({"spec": {"id": "late", "data": {}}})),
            )
            .await
            .expect_err("a signal after the expiry is refused");
        assert!(
            late.to_string().contains("is Expired") && late.to_string().contains("takes no signal"),
            "{late}"
        );
    }
    s.finish().await;
}

/// The operator is down while the signal is sent — twice, as a retrying
/// sender does — and comes back: the step takes it once, ship runs once.
#[tokio::test]
async fn a_signal_sent_twice_while_the_operator_is_down_is_taken_once() {
    let mut s = Scenario::start("signals-restart").await;
    s.create_run("order", json!({"steps": settle_then_ship("10m", "Fail")}))
        .await;
    let sig = signal_of(&s, "order", "settle").await;
    let name = sig.metadata.name.unwrap();
    // Checked while the operator is up (nothing could run while it is
    // down): the wait holds ship back until the signal comes.
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(
        s.ledger().starts("order", "ship", "step"),
        0,
        "ship waits for the signal"
    );
    s.kill_operator().await;
    let body = json!({"spec": {"id": "pay-1", "data": {"amount": 5}}});
    for _ in 0..2 {
        signals(&s)
            .patch(&name, &PatchParams::default(), &Patch::Merge(&body))
            .await
            .expect("the same signal is admitted again");
    }
    s.start_operator(None);
    let done = s.wait_finished("order", RUN_TIMEOUT).await;
    assert_eq!(
        phase(&done),
        Some(RunPhase::Succeeded),
        "{:#?}",
        done.status
    );
    assert_eq!(
        checkpoint(&done, "settle").result,
        Some(json!({"amount": 5}))
    );
    assert_eq!(s.ledger().starts("order", "ship", "step"), 1);
    let listed = signals(&s).list(&ListParams::default()).await.unwrap();
    assert_eq!(listed.items.len(), 1, "one Signal for the one wait");
    s.finish().await;
}

/// A wait names who may send its signal: the operator copies the senders
/// and the separation onto the Signal, and the API server refuses everyone
/// else, RBAC notwithstanding — a signaler who is not listed, and the run's
/// own creator under `separateFromRequester` even when listed. Neither can
/// take the guard off the Signal (removal is refused like a change). A
/// member of a listed group sends, and is recorded as the sender.
#[tokio::test]
async fn only_a_listed_sender_sends_and_never_the_runs_creator_under_separation() {
    let s = Scenario::start("signals-senders").await;
    let ns = s.namespace().to_owned();
    let p = Policies::install(&ns, &[]).await;
    p.grant_authors(&ns, &["dave"]).await;
    p.grant_role(
        &ns,
        "signaler",
        &["dave", "mallory", "--group=payments-bridges"],
    )
    .await;
    wait_enforced(&ns, true).await;

    let mut steps = settle_then_ship("10m", "Fail");
    steps[0]["wait"]["signal"]["senders"] =
        json!({"users": ["dave"], "groups": ["payments-bridges"]});
    steps[0]["wait"]["signal"]["separateFromRequester"] = json!(true);
    let run = run_doc("order", steps, json!({}));
    let created = kubectl_as(
        "dave",
        &[],
        &ns,
        &["create", "-f", &manifest(&format!("senders-{ns}"), &run)],
    )
    .await;
    assert_admitted(&created, "dave's run");
    let sig = signal_of(&s, "order", "settle").await;
    let name = sig.metadata.name.clone().unwrap();
    let senders = sig.spec.senders.clone().expect("the wait's senders");
    assert_eq!(
        (
            senders.users,
            senders.groups,
            sig.spec.separate_from_requester
        ),
        (
            vec!["dave".to_owned()],
            vec!["payments-bridges".to_owned()],
            true
        )
    );

    let paid = send("pay-4711", json!({"amount": 12}));
    let patch = ["patch", "signal", &name, "--type", "merge", "-p", &paid];
    let out = kubectl_as("mallory", &[], &ns, &patch).await;
    assert_refused(
        &out,
        &format!(
            "signal {name}: mallory is not a sender of this signal; senders: user dave; group payments-bridges"
        ),
    );
    let out = kubectl_as("dave", &[], &ns, &patch).await;
    assert_refused(
        &out,
        &format!(
            "signal {name}: dave created run order and may not send its signal (separateFromRequester)"
        ),
    );
    for (unguard, refusal) in [
        (
            json!([{"op": "remove", "path": "/spec/senders"}]),
            "spec.senders is immutable",
        ),
        (
            json!([{"op": "remove", "path": "/spec/separateFromRequester"}]),
            "spec.separateFromRequester is immutable",
        ),
    ] {
        let body = unguard.to_string();
        let out = kubectl_as(
            "dave",
            &[],
            &ns,
            &["patch", "signal", &name, "--type", "json", "-p", &body],
        )
        .await;
        assert_refused(&out, refusal);
    }
    assert_eq!(
        phase(&s.runs().get("order").await.unwrap()),
        Some(RunPhase::Waiting),
        "nothing refused moved the run"
    );

    let out = kubectl_as("bridge", &["payments-bridges"], &ns, &patch).await;
    assert_admitted(&out, "a listed group's member's signal");
    let done = s.wait_finished("order", RUN_TIMEOUT).await;
    assert_eq!(
        phase(&done),
        Some(RunPhase::Succeeded),
        "{:#?}",
        done.status
    );
    assert_eq!(
        checkpoint(&done, "settle").decided_by.as_deref(),
        Some("bridge")
    );
    assert_eq!(s.ledger().starts("order", "ship", "step"), 1);
    drop(p);
    s.finish().await;
}
