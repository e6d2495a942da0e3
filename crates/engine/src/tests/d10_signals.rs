//! D10 for events from outside: a wait step with a signal opens a `Signal`
//! and runs no Pod; a sender's `id` and `data` end it once, and `data` is
//! the step's result. A repeat changes nothing; the deadline is the API
//! server's order (an expiry is written to the Signal before `onTimeout`
//! applies, and a signal stored after the deadline is not taken); a run
//! that stops waiting supersedes its Signal so a late one is refused.

use super::*;
use agentrun_api::{
    Senders, ServiceAccountRef, SignalPhase, SignalStatus, SignalTimeout, SignalWait, StepSpec,
    WaitSpec,
};

fn wait_signal(name: &str, timeout: Option<&str>, on_timeout: SignalTimeout) -> StepSpec {
    StepSpec {
        name: name.into(),
        wait: Some(Box::new(WaitSpec {
            for_: None,
            until: None,
            signal: Some(SignalWait {
                description: Some("payment settled".into()),
                timeout: timeout.map(Duration::from),
                on_timeout,
                ..SignalWait::default()
            }),
        })),
        effect: Effect::None,
        ..StepSpec::default()
    }
}

/// a → settle (a signal, 1h, onTimeout as given) → b.
fn settle(on_timeout: SignalTimeout) -> World {
    let mut w = World::new(AgentRun::test().with_steps([
        step("a"),
        wait_signal("settle", Some("1h"), on_timeout),
        step("b"),
    ]));
    w.settle();
    w.succeed("run-a-2b8d3c-r1-a1", "");
    w.settle();
    w
}

fn signal_of(w: &World) -> String {
    cp(w, "settle", 1)
        .signal
        .expect("the checkpoint names its Signal")
}

fn signal_phase(w: &World) -> Option<SignalPhase> {
    w.signals[&signal_of(w)].status.as_ref().map(|s| s.phase)
}

#[test]
fn a_signal_ends_the_wait_with_its_data_as_the_result() {
    let mut w = settle(SignalTimeout::Fail);
    let name = signal_of(&w);
    assert_eq!(name, crate::signal_name("run", "run-uid", "settle", 1));
    let c = cp(&w, "settle", 1);
    assert_eq!(c.phase, StepPhase::Waiting);
    assert_eq!(
        c.wake_at.map(|t| t.0),
        Some(t(3600)),
        "the deadline is fixed"
    );
    assert_eq!(w.created, ["run-a-2b8d3c-r1-a1"], "no Pod for a signal");
    assert_eq!(w.status().phase, Some(RunPhase::Waiting));
    let cond = condition(&w, ConditionType::Succeeded);
    assert_eq!(cond.reason, Reason::Waiting);
    assert!(
        cond.message.ends_with(&format!(
            "step settle waits for Signal {name} until {}",
            t(3600)
        )),
        "{}",
        cond.message
    );
    let s = &w.signals[&name];
    assert_eq!(
        (
            s.spec.step.as_str(),
            s.spec.plan_revision,
            s.spec.run_uid.as_str()
        ),
        ("settle", 1, "run-uid")
    );
    assert_eq!(s.spec.expires_at.as_ref().map(|t| t.0), Some(t(3600)));
    assert_eq!(s.spec.description.as_deref(), Some("payment settled"));
    let st = s.status.as_ref().expect("the Signal says it waits");
    assert_eq!(st.phase, SignalPhase::Waiting);
    assert_eq!(
        st.message.as_deref(),
        Some(
            format!(
                "step settle waits for this signal until {}; onTimeout Fail",
                t(3600)
            )
            .as_str()
        )
    );
    let owner = &s.metadata.owner_references.as_ref().unwrap()[0];
    assert_eq!(
        (owner.uid.as_str(), owner.controller),
        ("run-uid", Some(true))
    );
    assert_eq!(
        w.decide().requeue_after,
        secs(3600),
        "requeued for the deadline"
    );

    w.advance(60);
    assert!(w.send_signal(&name, "pay-1", json!({"amount": 12}), "ci-bot"));
    let d = w.step();
    assert!(
        events(&d).contains(&Reason::SignalReceived),
        "{:?}",
        events(&d)
    );
    let c = cp(&w, "settle", 1);
    assert_eq!(
        (
            c.phase,
            c.checkpoint,
            c.effect,
            c.result.clone(),
            c.decided_by.as_deref()
        ),
        (
            StepPhase::Succeeded,
            CheckpointState::Committed,
            Some(EffectOutcome::NotApplied),
            Some(json!({"amount": 12})),
            Some("ci-bot")
        )
    );
    assert_eq!(
        creates(&d),
        ["run-b-59c772-r1-a1"],
        "b starts in the write that records the signal (D4)"
    );
    w.settle();
    assert_eq!(signal_phase(&w), Some(SignalPhase::Received));

    // The same signal again (a sender retrying): accepted, and nothing
    // changes. Another id is refused by the API server.
    assert!(w.send_signal(&name, "pay-1", json!({"amount": 12}), "ci-bot"));
    assert!(!w.send_signal(&name, "pay-2", json!({"amount": 99}), "ci-bot"));
    w.settle();
    assert_eq!(cp(&w, "settle", 1).result, Some(json!({"amount": 12})));
    w.succeed("run-b-59c772-r1-a1", "");
    assert_eq!(w.status().phase, Some(RunPhase::Succeeded));
    assert_eq!(w.created, ["run-a-2b8d3c-r1-a1", "run-b-59c772-r1-a1"]);
    assert_eq!(
        w.status().step_executions,
        2,
        "a signal is not an execution"
    );
}

#[test]
fn the_next_step_reads_the_signal_data_in_its_when() {
    let mut b = step("b");
    b.when = Some("steps.settle.result.amount > 10".into());
    let mut w = World::new(
        AgentRun::test().with_steps([wait_signal("settle", None, SignalTimeout::Fail), b]),
    );
    w.settle();
    assert_eq!(cp(&w, "settle", 1).wake_at, None, "no timeout: no deadline");
    assert_eq!(
        w.decide().requeue_after,
        None,
        "nothing to wake for but the watch"
    );
    let name = signal_of(&w);
    assert!(w.send_signal(&name, "pay-1", json!({"amount": 12}), "ci-bot"));
    w.settle();
    assert_eq!(w.created, ["run-b-59c772-r1-a1"]);
}

#[test]
fn no_signal_in_time_fails_the_run_once_the_expiry_is_written() {
    let mut w = settle(SignalTimeout::Fail);
    w.advance(3600);
    let d = w.step();
    // First the expiry, on the Signal: the step still waits, so a signal
    // that lands before it makes the write fail and is taken.
    assert_eq!(cp(&w, "settle", 1).phase, StepPhase::Waiting);
    assert!(d.actions.iter().any(|a| matches!(a, Action::SetSignalStatus { status, .. } if status.phase == SignalPhase::Expired)));
    assert_eq!(signal_phase(&w), Some(SignalPhase::Expired));
    let d = w.step();
    assert!(
        events(&d).contains(&Reason::SignalExpired),
        "{:?}",
        events(&d)
    );
    let c = cp(&w, "settle", 1);
    assert_eq!(c.phase, StepPhase::Failed);
    assert!(
        c.message
            .as_deref()
            .unwrap()
            .contains("no signal on Signal"),
        "{:?}",
        c.message
    );
    w.settle();
    assert_eq!(w.status().phase, Some(RunPhase::Failed));
    assert_eq!(
        condition(&w, ConditionType::Succeeded).reason,
        Reason::SignalExpired
    );
    let name = signal_of(&w);
    assert!(
        !w.send_signal(&name, "pay-1", json!({}), "ci-bot"),
        "the API server refuses a signal once the expiry is written"
    );
    assert_eq!(w.created, ["run-a-2b8d3c-r1-a1"]);
}

#[test]
fn no_signal_in_time_skips_the_step_with_on_timeout_skip() {
    let mut w = settle(SignalTimeout::Skip);
    w.advance(3600);
    w.settle();
    let c = cp(&w, "settle", 1);
    assert_eq!(c.phase, StepPhase::Skipped);
    assert!(c.result.is_none());
    assert_eq!(w.created, ["run-a-2b8d3c-r1-a1", "run-b-59c772-r1-a1"]);
}

#[test]
fn a_signal_stored_after_the_deadline_is_not_taken() {
    let mut w = settle(SignalTimeout::Fail);
    // The operator is down past the deadline; the sender's write lands
    // before the expiry is written. The API server's time says it is late.
    w.advance(3700);
    let name = signal_of(&w);
    assert!(w.send_signal(&name, "pay-1", json!({"amount": 12}), "ci-bot"));
    w.settle();
    let s = &w.signals[&name];
    let st = s.status.as_ref().unwrap();
    assert_eq!(st.phase, SignalPhase::Expired);
    assert!(
        st.message
            .as_deref()
            .unwrap()
            .contains("signal pay-1 was sent at"),
        "{:?}",
        st.message
    );
    assert_eq!(cp(&w, "settle", 1).phase, StepPhase::Failed);
    assert_eq!(cp(&w, "settle", 1).result, None);
    assert_eq!(w.status().phase, Some(RunPhase::Failed));
}

#[test]
fn a_signal_sent_before_the_deadline_wins_over_an_expiry_decided_on_a_stale_copy() {
    let mut w = settle(SignalTimeout::Fail);
    let name = signal_of(&w);
    w.advance(3600);
    // The decision sees no signal at the deadline and asks to write the
    // expiry…
    let d = w.decide();
    assert!(
        d.actions
            .iter()
            .any(|a| matches!(a, Action::SetSignalStatus { .. }))
    );
    // …but the signal reaches the API server first, stamped at the
    // deadline: in time.
    assert!(w.send_signal(&name, "pay-1", json!({"amount": 1}), "ci-bot"));
    w.commit(&d);
    assert_eq!(
        signal_phase(&w),
        Some(SignalPhase::Waiting),
        "the expiry, decided on the old resourceVersion, is refused"
    );
    w.settle();
    assert_eq!(cp(&w, "settle", 1).phase, StepPhase::Succeeded);
    assert_eq!(signal_phase(&w), Some(SignalPhase::Received));
}

#[test]
fn a_signal_missing_from_the_cache_is_opened_again_and_keeps_its_deadline() {
    let mut w = settle(SignalTimeout::Fail);
    let name = signal_of(&w);
    w.signals.clear();
    w.advance(100);
    let d = w.step();
    let opened: Vec<_> = d
        .actions
        .iter()
        .filter_map(|a| match a {
            Action::CreateSignal(s) => Some(s.clone()),
            _ => None,
        })
        .collect();
    assert_eq!(opened.len(), 1);
    assert_eq!(opened[0].metadata.name.as_deref(), Some(name.as_str()));
    assert_eq!(
        opened[0].spec.expires_at.as_ref().map(|t| t.0),
        Some(t(3600)),
        "the deadline fixed when the wait started, not now + 1h"
    );
    assert_eq!(d.requeue_after, secs(3500));
}

#[test]
fn cancelling_the_run_supersedes_its_signal_and_a_late_one_is_refused() {
    let mut w = settle(SignalTimeout::Fail);
    w.run.spec.cancel = true;
    w.run.metadata.generation = Some(2);
    w.settle();
    assert_eq!(w.status().phase, Some(RunPhase::Cancelled));
    assert_eq!(cp(&w, "settle", 1).phase, StepPhase::Failed);
    assert_eq!(signal_phase(&w), Some(SignalPhase::Superseded));
    let name = signal_of(&w);
    assert!(!w.send_signal(&name, "pay-1", json!({}), "ci-bot"));
}

#[test]
fn a_refused_signal_stalls_the_run_visibly() {
    let mut w =
        World::new(AgentRun::test().with_steps([wait_signal("settle", None, SignalTimeout::Fail)]));
    let name = crate::signal_name("run", "run-uid", "settle", 1);
    w.step();
    w.signals.clear();
    w.refused = vec![Refusal {
        name: name.clone(),
        cause: RefusalCause::NameTaken,
        message: "it is owned by AgentRun other (uid x)".into(),
    }];
    let d = w.step();
    assert!(
        !d.actions
            .iter()
            .any(|a| matches!(a, Action::CreateSignal(_)))
    );
    let stalled = condition(&w, ConditionType::Stalled);
    assert_eq!(stalled.reason, Reason::NameTaken);
    assert!(
        stalled.message.contains(&format!("Signal {name} exists")),
        "{}",
        stalled.message
    );
}

/// D7 at the boundary: a signal whose data does not match the step's
/// resultSchema is never committed as its result. It cannot be sent again,
/// so the step fails (reason ResultInvalid, the mismatch by JSON pointer,
/// never the values) and the Signal says it was received and not applied.
#[test]
fn a_signal_whose_data_does_not_match_the_result_schema_fails_the_step() {
    let mut w = settle(SignalTimeout::Fail);
    w.run.spec.steps[1].result_schema = Some(Box::new(json!({
        "type": "object",
        "required": ["amount"],
        "properties": {"amount": {"type": "number", "minimum": 0}},
    })));
    let name = signal_of(&w);
    assert!(w.send_signal(
        &name,
        "pay-1",
        json!({"amount": -5, "card": "4111"}),
        "ci-bot"
    ));
    let d = w.step();
    assert!(
        events(&d).contains(&Reason::ResultInvalid),
        "{:?}",
        events(&d)
    );
    let c = cp(&w, "settle", 1);
    assert_eq!((c.phase, c.result.clone()), (StepPhase::Failed, None));
    let message = c.message.unwrap();
    assert!(
        message.contains("does not match the step's resultSchema: at /amount"),
        "{message}"
    );
    assert!(
        !message.contains("4111") && !message.contains("-5"),
        "{message}"
    );
    w.settle();
    assert_eq!(w.status().phase, Some(RunPhase::Failed));
    assert_eq!(
        condition(&w, ConditionType::Succeeded).reason,
        Reason::ResultInvalid
    );
    let st = w.signals[&name].status.clone().unwrap();
    assert_eq!(st.phase, SignalPhase::Received);
    assert!(
        st.message
            .unwrap()
            .contains("did not match step settle's resultSchema")
    );
    assert_eq!(w.created, ["run-a-2b8d3c-r1-a1"], "b never started");
}

#[test]
fn a_signal_whose_data_matches_the_result_schema_is_committed() {
    let mut w = settle(SignalTimeout::Fail);
    w.run.spec.steps[1].result_schema =
        Some(Box::new(json!({"type": "object", "required": ["amount"]})));
    let name = signal_of(&w);
    assert!(w.send_signal(&name, "pay-1", json!({"amount": 5}), "ci-bot"));
    w.settle();
    assert_eq!(cp(&w, "settle", 1).result, Some(json!({"amount": 5})));
    assert_eq!(w.created, ["run-a-2b8d3c-r1-a1", "run-b-59c772-r1-a1"]);
}

/// Who may send travels into the Signal, where the API server's policies
/// read it: the wait's senders (a ServiceAccount without a namespace is the
/// run's), its separation and the run's creator.
#[test]
fn a_signal_carries_the_waits_senders_separation_and_the_runs_creator() {
    let mut settle = wait_signal("settle", None, SignalTimeout::Fail);
    let wait = settle.wait.as_mut().unwrap().signal.as_mut().unwrap();
    wait.senders = Some(Senders {
        users: vec!["ci-bot".into()],
        groups: vec!["payments-bridges".into()],
        service_accounts: vec![
            ServiceAccountRef {
                namespace: String::new(),
                name: "bridge".into(),
            },
            ServiceAccountRef {
                namespace: "ci".into(),
                name: "runner".into(),
            },
        ],
    });
    wait.separate_from_requester = true;
    let mut run = AgentRun::test().with_steps([settle]);
    run.metadata.annotations = Some([(labels::REQUESTED_BY.to_owned(), "dave".to_owned())].into());
    let mut w = World::new(run);
    w.settle();
    let s = &w.signals[&signal_of(&w)].spec;
    let senders = s.senders.clone().expect("senders copied");
    assert_eq!(
        (senders.users, senders.groups),
        (
            vec!["ci-bot".to_owned()],
            vec!["payments-bridges".to_owned()]
        )
    );
    let accounts: Vec<(&str, &str)> = senders
        .service_accounts
        .iter()
        .map(|a| (a.namespace.as_str(), a.name.as_str()))
        .collect();
    assert_eq!(accounts, [("default", "bridge"), ("ci", "runner")]);
    assert_eq!(
        (s.separate_from_requester, s.requested_by.as_deref()),
        (true, Some("dave"))
    );
}

/// The run takes only a Signal it opened: one under the name it waits on
/// whose controller is another object (planted on a cluster without the
/// chart's policies) is never applied, nor written to — not even the expiry
/// at its deadline; the run keeps waiting and says what is in the way (D16).
#[test]
fn a_signal_the_run_did_not_open_is_never_applied() {
    let mut w = settle(SignalTimeout::Fail);
    let name = signal_of(&w);
    let planted = w.signals.get_mut(&name).unwrap();
    planted.metadata.owner_references.as_mut().unwrap()[0].uid = "someone-else".into();
    w.advance(3600);
    w.settle();
    assert_eq!(
        signal_phase(&w),
        Some(SignalPhase::Waiting),
        "the operator writes no status on a Signal it did not open"
    );
    assert!(w.send_signal(&name, "pay-1", json!({"amount": 1_000_000}), "mallory"));
    let d = w.step();
    assert!(
        !events(&d).contains(&Reason::SignalReceived),
        "{:?}",
        events(&d)
    );
    let c = cp(&w, "settle", 1);
    assert_eq!((c.phase, c.result.clone()), (StepPhase::Waiting, None));
    let stalled = condition(&w, ConditionType::Stalled);
    assert_eq!(stalled.reason, Reason::NameTaken);
    assert!(
        stalled.message.contains(&format!(
            "step settle: Signal {name} exists but does not belong to this run"
        )) && stalled.message.contains("(uid someone-else)"),
        "{}",
        stalled.message
    );
    w.settle();
    assert_eq!(w.created, ["run-a-2b8d3c-r1-a1"], "b never started");

    // Owned by the run, but for another plan revision than the checkpoint's:
    // not the one it opened either.
    let mut w = settle(SignalTimeout::Fail);
    let name = signal_of(&w);
    w.signals.get_mut(&name).unwrap().spec.plan_revision = 2;
    assert!(w.send_signal(&name, "pay-1", json!({}), "mallory"));
    w.settle();
    assert_eq!(cp(&w, "settle", 1).phase, StepPhase::Waiting);
    assert!(
        condition(&w, ConditionType::Stalled)
            .message
            .contains("its spec differs from what the run asks in planRevision")
    );
}

/// A status alone is not a signal: a Signal that says Received with no
/// sender's `spec.id` (written by someone other than the operator, who
/// writes Received only after its step took an id) is not applied. The
/// API server takes no id on it any more, so the step fails and says why.
#[test]
fn a_signal_marked_received_without_an_id_is_not_applied() {
    let mut w = settle(SignalTimeout::Fail);
    let name = signal_of(&w);
    w.signals.get_mut(&name).unwrap().status = Some(SignalStatus {
        phase: SignalPhase::Received,
        recorded_at: None,
        message: Some("forged".into()),
    });
    let d = w.step();
    assert!(
        !events(&d).contains(&Reason::SignalReceived),
        "{:?}",
        events(&d)
    );
    let c = cp(&w, "settle", 1);
    assert_eq!((c.phase, c.result.clone()), (StepPhase::Failed, None));
    assert_eq!(
        c.message.as_deref(),
        Some(
            format!(
                "Signal {name} says Received but carries no spec.id, so no sender sent it; it is not applied and takes no signal now"
            )
            .as_str()
        )
    );
    w.settle();
    assert_eq!(w.status().phase, Some(RunPhase::Failed));
    assert_eq!(w.created, ["run-a-2b8d3c-r1-a1"], "b never started");
}

/// D22: a signal's data comes from outside and is bounded before anything
/// evaluates it: over 64 KiB the step fails with the size, whatever its
/// schema, and the steps after it never start.
#[test]
fn a_signal_with_data_over_its_cap_fails_the_step_before_any_schema_runs() {
    let mut w = settle(SignalTimeout::Fail);
    let name = signal_of(&w);
    let big = "x".repeat(agentrun_api::MAX_SIGNAL_DATA_BYTES);
    assert!(w.send_signal(&name, "pay-1", json!({"note": big}), "ci-bot"));
    let d = w.step();
    assert!(
        events(&d).contains(&Reason::ResultInvalid),
        "{:?}",
        events(&d)
    );
    let c = cp(&w, "settle", 1);
    assert_eq!((c.phase, c.result.clone()), (StepPhase::Failed, None));
    let message = c.message.unwrap();
    assert!(
        message.contains("carries 65547 bytes of data, over the 64 KiB a signal may carry"),
        "{message}"
    );
    w.settle();
    assert_eq!(w.status().phase, Some(RunPhase::Failed));
    assert_eq!(w.created, ["run-a-2b8d3c-r1-a1"], "b never started");
}
