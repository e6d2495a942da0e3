//! D19: a journaled step is judged by its journal. A lost attempt whose
//! calls were all answered runs again with the same key and asks nobody; a
//! call that started and was never answered is asked about (of the probe,
//! else a person), settled in the journal before the next attempt; the
//! journal's tokens count once; a journal past its cap fails the step.

use super::*;
use agentrun_api::{CallKind, CallState, JournalSpec, StepContainer};

/// `python3 -c "import hashlib; print(hashlib.sha256(b'run-uid\\x00refund').hexdigest()[:6])"`
const REFUND: &str = "run-refund-d5e7dc";

fn refund(journaled: bool, verify: bool) -> World {
    let mut s = step("refund")
        .with_effect(Effect::NonIdempotent)
        .with_retry(2, "5s", "5s");
    if journaled {
        s.journal = Some(Box::new(JournalSpec {
            max_bytes: Some(8192),
        }));
    }
    if verify {
        s.verify = Some(Box::new(StepContainer {
            image: "tool:1".into(),
            args: vec!["verify-call".into()],
            ..StepContainer::default()
        }));
    }
    World::new(AgentRun::test().with_steps([s, step("notify")]))
}

fn a(n: i32) -> String {
    format!("{REFUND}-r1-a{n}")
}

/// Attempt 1 runs, records `entries`, and is evicted.
fn evicted_after(mut w: World, entries: Vec<agentrun_api::JournalEntry>) -> World {
    w.settle();
    w.update_pod(&a(1), |p| p.running());
    w.settle();
    w.journal("refund", 1, entries);
    w.update_pod(&a(1), |p| p.evicted(true));
    w.settle();
    w
}

fn answered() -> Vec<agentrun_api::JournalEntry> {
    vec![
        journal_entry(0, CallKind::Model, CallState::Done),
        journal_entry(1, CallKind::Tool, CallState::Done),
        journal_entry(2, CallKind::Model, CallState::Done),
    ]
}

fn open_intent() -> Vec<agentrun_api::JournalEntry> {
    let mut e = answered();
    e.push(journal_entry(3, CallKind::Tool, CallState::Intent));
    e
}

fn env(w: &World, pod: &str) -> std::collections::BTreeMap<String, String> {
    w.pod(pod).spec.unwrap().containers[0]
        .env
        .clone()
        .unwrap_or_default()
        .into_iter()
        .map(|e| (e.name, e.value.unwrap_or_default()))
        .collect()
}

#[test]
fn a_lost_attempt_whose_calls_were_all_answered_runs_again_with_the_same_key() {
    // Without a journal the same loss asks a person (D6): the table's
    // second row is today's rule, the first is what the journal changes.
    for (journaled, runs_again) in [(true, true), (false, false)] {
        let w = evicted_after(refund(journaled, false), answered());
        let c = cp(&w, "refund", 1);
        assert_eq!(
            (
                w.pods.contains_key(&a(2)),
                c.phase == StepPhase::WaitingForApproval
            ),
            (runs_again, !runs_again),
            "journaled={journaled}: {:?}",
            c.message
        );
        if runs_again {
            assert!(w.approvals.is_empty(), "nobody is asked");
            assert_eq!(
                w.pod(&a(2)).metadata.labels.unwrap()[labels::IDEMPOTENCY_KEY],
                c.idempotency_key,
                "the same key: the attempt replays its journal"
            );
            assert_eq!(c.failures, 0, "a disruption costs no retry");
        }
    }
}

#[test]
fn a_journaled_step_pod_is_told_where_its_journal_is_and_gets_a_bound_token() {
    let mut w = refund(true, false);
    w.settle();
    let env = env(&w, &a(1));
    let prefix = crate::journal_prefix("run", "run-uid", "refund", 1);
    assert_eq!(prefix, "run-refund-d5e7dc-r1-journal-");
    assert_eq!(env["AGENTRUN_JOURNAL"], prefix);
    assert_eq!(env["AGENTRUN_JOURNAL_MAX_BYTES"], "8192");
    assert_eq!(env["AGENTRUN_RUN_UID"], "run-uid");
    assert_eq!(
        env["AGENTRUN_JOURNAL_TOKEN_FILE"],
        "/var/run/agentrun/journal/token"
    );
    let spec = w.pod(&a(1)).spec.unwrap();
    let projected = spec
        .volumes
        .clone()
        .unwrap()
        .into_iter()
        .find_map(|v| v.projected)
        .expect("a projected journal volume");
    let token = projected.sources.unwrap()[0]
        .service_account_token
        .clone()
        .expect("a Pod-bound token");
    assert_eq!(token.path, "token");
    // The API server refuses a projected token without a named account.
    assert_eq!(spec.service_account_name.as_deref(), Some("default"));
    // A step without `journal` gets none of it.
    let mut plain = World::new(AgentRun::test().with_steps([step("x")]));
    plain.settle();
    let p = plain.pod("run-x-dc2dd4-r1-a1");
    assert!(
        !env_names(&p)
            .iter()
            .any(|n| n.starts_with("AGENTRUN_JOURNAL")),
        "{:?}",
        env_names(&p)
    );
}

fn env_names(p: &k8s_openapi::api::core::v1::Pod) -> Vec<String> {
    p.spec.as_ref().unwrap().containers[0]
        .env
        .iter()
        .flatten()
        .map(|e| e.name.clone())
        .collect()
}

#[test]
fn a_call_left_open_is_asked_of_the_probe_with_its_key_and_settled_before_the_next_attempt() {
    let mut w = evicted_after(refund(true, true), open_intent());
    let c = cp(&w, "refund", 1);
    assert_eq!(c.phase, StepPhase::Verifying, "{:?}", c.message);
    assert!(
        c.message
            .as_deref()
            .unwrap()
            .contains("its call 3 (issue_refund call_3"),
        "{:?}",
        c.message
    );
    let probe = format!("{REFUND}-r1-v1");
    let env = env(&w, &probe);
    let key = agentrun_api::call_key("step-key", "call_3");
    assert_eq!(
        (
            env["AGENTRUN_CALL_SEQ"].as_str(),
            env["AGENTRUN_CALL_ID"].as_str(),
            env["AGENTRUN_CALL_KEY"].as_str()
        ),
        ("3", "call_3", key.as_str())
    );
    // The probe finds the refund made: the call is settled Applied with
    // what the probe found, and the step runs again to replay past it.
    w.update_pod(&probe, |p| {
        p.succeeded(r#"{"effect": "Applied", "result": {"refundId": "rf-9"}}"#)
    });
    let d = w.step();
    let settled: Vec<_> = d
        .actions
        .iter()
        .filter_map(|a| match a {
            Action::SettleCall { chunk, settlement } => Some((chunk.clone(), settlement.clone())),
            _ => None,
        })
        .collect();
    assert_eq!(settled.len(), 1, "{:?}", d.actions);
    assert_eq!(d.tally.calls_settled, 1, "the metrics count the settlement");
    assert_eq!(settled[0].0, "run-refund-d5e7dc-r1-journal-0");
    assert_eq!(
        (
            settled[0].1.seq,
            settled[0].1.outcome,
            settled[0].1.by.as_str()
        ),
        (3, EffectOutcome::Applied, "verify")
    );
    assert_eq!(
        settled[0].1.response.as_deref(),
        Some(r#"{"refundId":"rf-9"}"#)
    );
    assert!(
        !w.created.contains(&a(2)),
        "not before the settlement is seen"
    );
    // The settlement write was lost: no attempt until the journal shows it,
    // and the settlement is asked for again.
    for j in w.journals.values_mut() {
        j.status = None;
    }
    let d = w.step();
    assert!(creates(&d).is_empty(), "{:?}", creates(&d));
    assert!(
        d.actions
            .iter()
            .any(|a| matches!(a, Action::SettleCall { settlement, .. } if settlement.seq == 3))
    );
    w.settle();
    let c = cp(&w, "refund", 1);
    assert!(w.pods.contains_key(&a(2)), "{:?}", c.message);
    assert_eq!(c.effect, Some(EffectOutcome::Applied), "the call acted");
    assert!(c.journal.as_ref().unwrap().unknown.is_none());
    assert!(w.approvals.is_empty(), "nobody was woken");
}

#[test]
fn without_a_probe_a_person_is_asked_about_the_call_and_their_answer_settles_it() {
    for (answer, outcome) in [
        (Answer::MarkSucceeded, EffectOutcome::Applied),
        (Answer::Retry, EffectOutcome::NotApplied),
    ] {
        let mut w = evicted_after(refund(true, false), open_intent());
        let c = cp(&w, "refund", 1);
        assert_eq!(c.phase, StepPhase::WaitingForApproval);
        let name = c.approval.clone().unwrap();
        let reason = w.approvals[&name]
            .spec
            .context
            .as_ref()
            .unwrap()
            .reason
            .clone();
        assert!(
            reason.contains("its call 3 (issue_refund call_3, key "),
            "{reason}"
        );
        assert!(w.decide_approval(&name, answer, "alice"));
        w.settle();
        let j = w.journals.values().next().unwrap();
        let s = &j
            .status
            .as_ref()
            .expect("settled in the journal")
            .settlements[0];
        assert_eq!((s.seq, s.outcome), (3, outcome), "{answer:?}");
        assert_eq!(s.by, "alice");
        if outcome == EffectOutcome::Applied {
            assert_eq!(
                s.response.as_deref(),
                Some(r#"{"by":"alice","settled":"Applied"}"#)
            );
        }
        let c = cp(&w, "refund", 1);
        assert_eq!(c.phase, StepPhase::Running, "{answer:?}: {:?}", c.message);
        assert!(w.pods.contains_key(&a(2)), "the step replays past the call");
    }
}

#[test]
fn the_journal_tokens_count_once_whichever_attempt_made_the_calls() {
    let w = evicted_after(refund(true, false), answered());
    // Two model calls of 120 tokens, made by the lost attempt.
    assert_eq!(w.status().tokens_used, 240);
    let c = cp(&w, "refund", 1);
    assert_eq!(c.journal.as_ref().unwrap().calls, 3);
    // Attempt 2 replays them: nothing is counted again when it succeeds
    // reporting no tokens outside the journal.
    let mut w = w;
    w.update_pod(&a(2), |p| p.running());
    w.settle();
    w.succeed(
        &a(2),
        r#"{"result": {"refundId": "rf-1"}, "effect": "Applied"}"#,
    );
    assert_eq!(w.status().tokens_used, 240);
}

#[test]
fn a_journal_past_its_cap_fails_the_step_and_stops_its_attempt() {
    let mut w = refund(true, false);
    w.settle();
    w.update_pod(&a(1), |p| p.running());
    w.settle();
    let mut big = journal_entry(0, CallKind::Model, CallState::Done);
    big.response = Some("x".repeat(9000));
    w.journal("refund", 1, vec![big]);
    let d = w.step();
    assert!(
        d.actions
            .iter()
            .any(|a| matches!(a, Action::DeletePod { name, .. } if *name == self::a(1))),
        "{:?}",
        d.actions
    );
    let c = cp(&w, "refund", 1);
    assert_eq!(c.phase, StepPhase::Failed);
    assert!(
        c.message
            .as_deref()
            .unwrap()
            .contains("past its journal.maxBytes 8192"),
        "{:?}",
        c.message
    );
    assert!(
        events(&d).contains(&Reason::JournalOverCap),
        "{:?}",
        events(&d)
    );
}

#[test]
fn a_call_settled_not_applied_and_lost_again_when_called_again_is_asked_again() {
    let mut w = evicted_after(refund(true, false), open_intent());
    let name = cp(&w, "refund", 1).approval.clone().unwrap();
    assert!(w.decide_approval(&name, Answer::Retry, "alice"));
    w.settle();
    // Attempt 2 replays calls 0-2 and calls 3 again: its own intent.
    w.update_pod(&a(2), |p| p.running());
    w.settle();
    let mut e = open_intent();
    e[3].attempt = 2;
    w.journal("refund", 1, e);
    w.update_pod(&a(2), |p| p.evicted(true));
    w.settle();
    let c = cp(&w, "refund", 1);
    assert_eq!(c.phase, StepPhase::WaitingForApproval, "{:?}", c.message);
    assert!(
        !w.pods.contains_key(&a(3)),
        "never called a third time unasked"
    );
    assert_eq!(
        c.journal
            .as_ref()
            .unwrap()
            .unknown
            .as_ref()
            .unwrap()
            .attempt,
        2
    );
}

#[test]
fn the_journal_an_attempt_reports_at_its_end_counts_when_the_cache_has_not_caught_up() {
    // The cache shows two model calls; the attempt ended having seen four.
    let mut w = refund(true, false);
    w.settle();
    w.update_pod(&a(1), |p| p.running());
    w.settle();
    w.journal("refund", 1, answered());
    w.succeed(
        &a(1),
        r#"{"result": {"refundId": "rf-1"}, "effect": "Applied", "journalTokens": {"input": 400, "output": 80}}"#,
    );
    assert_eq!(cp(&w, "refund", 1).phase, StepPhase::Succeeded);
    assert_eq!(w.status().tokens_used, 480);
    // The cache catches up: nothing is counted twice.
    let mut more = answered();
    more.push(journal_entry(3, CallKind::Model, CallState::Done));
    more.push(journal_entry(4, CallKind::Model, CallState::Done));
    w.journal("refund", 1, more);
    w.settle();
    assert_eq!(w.status().tokens_used, 480);
}

/// quote (a read, true for 3 s) → refund (journaled, NonIdempotent, no
/// probe): attempt 1 records `entries`, the last an intent, and is evicted;
/// a person answers Retry once quote went stale, which settles that call
/// `NotApplied`, so the run re-plans before attempt 2 would start.
fn retried_after_stale(entries: Vec<agentrun_api::JournalEntry>) -> World {
    let mut s = step("refund")
        .with_effect(Effect::NonIdempotent)
        .with_retry(2, "5s", "5s");
    s.journal = Some(Box::new(JournalSpec::default()));
    let mut w = World::new(AgentRun::test().with_steps([
        step("quote").with_effect(Effect::None).with_fresh_for("3s"),
        s,
    ]));
    w.settle();
    w.succeed(
        "run-quote-85b807-r1-a1",
        &ok_message(serde_json::json!({"price": 42}), 0),
    );
    w.update_pod(&a(1), |p| p.running());
    w.settle();
    w.journal("refund", 1, entries);
    w.update_pod(&a(1), |p| p.evicted(true));
    w.settle();
    let name = cp(&w, "refund", 1)
        .approval
        .clone()
        .expect("asked about the call");
    w.advance(6);
    assert!(w.decide_approval(&name, Answer::Retry, "alice"));
    w.settle();
    w
}

#[test]
fn a_call_settled_not_applied_does_not_unsay_the_calls_before_it_that_acted() {
    // Call 1 (a refund) was answered; call 3 started and was never
    // answered, and a person says it did not act. The step still acted —
    // through call 1 — so the re-plan asks before the loop runs afresh
    // under a new key (and would refund again). Found by the chaos run:
    // the settlement cleared the step's effect, and revision 2 refunded
    // twice unasked.
    let w = retried_after_stale(open_intent());
    let plan = w.status().plan.unwrap();
    assert_eq!(plan.revision, 2, "quote went stale: {}", plan.reason);
    let old = cp(&w, "refund", 1);
    assert_eq!(
        (old.phase, old.effect),
        (StepPhase::Superseded, Some(EffectOutcome::Applied)),
        "{:?}",
        old.message
    );
    let mut w = w;
    w.succeed(
        "run-quote-85b807-r2-a1",
        &ok_message(serde_json::json!({"price": 42}), 0),
    );
    let new = cp(&w, "refund", 2);
    assert_eq!(
        new.phase,
        StepPhase::WaitingForApproval,
        "{:?}",
        new.message
    );
    assert!(
        !w.pods.contains_key(&format!("{REFUND}-r2-a1")),
        "the refund is not made again unasked"
    );
    let asked = &w.approvals[new.approval.as_ref().unwrap()];
    let repeats = asked
        .spec
        .context
        .as_ref()
        .unwrap()
        .repeats
        .clone()
        .unwrap();
    assert_eq!(
        (
            repeats.plan_revision,
            repeats.effect,
            repeats.idempotency_key
        ),
        (1, EffectOutcome::Applied, old.idempotency_key)
    );

    // Only the model had answered: nothing acted, and revision 2 runs the
    // loop afresh without asking.
    let mut w = retried_after_stale(vec![
        journal_entry(0, CallKind::Model, CallState::Done),
        journal_entry(1, CallKind::Tool, CallState::Intent),
    ]);
    assert_eq!(cp(&w, "refund", 1).effect, None);
    w.succeed(
        "run-quote-85b807-r2-a1",
        &ok_message(serde_json::json!({"price": 42}), 0),
    );
    assert!(
        w.pods.contains_key(&format!("{REFUND}-r2-a1")),
        "{:?}",
        cp(&w, "refund", 2).message
    );
}

#[test]
fn a_settlement_the_api_server_refuses_stalls_the_run_visibly_until_it_lands() {
    let mut w = evicted_after(refund(true, true), open_intent());
    let probe = format!("{REFUND}-r1-v1");
    w.update_pod(&probe, |p| p.succeeded(r#"{"effect": "NotApplied"}"#));
    let d = w.decide();
    w.run.status = Some(d.status);
    // The settlement write is refused (an admission policy, say).
    let chunk = "run-refund-d5e7dc-r1-journal-0";
    w.refused = vec![Refusal {
        name: chunk.into(),
        cause: RefusalCause::Transient,
        message: "ValidatingAdmissionPolicy 'agentrun-journals' denied request".into(),
    }];
    let d = w.step();
    assert!(
        !d.actions
            .iter()
            .any(|a| matches!(a, Action::SettleCall { .. })),
        "not sent again in the same reconcile: {:?}",
        d.actions
    );
    assert!(
        d.actions.iter().any(|a| matches!(a, Action::Event { type_: EventType::Warning, message, .. }
            if message.contains("settlement of call 3 (call_3) as NotApplied") && message.contains("denied request"))),
        "a Warning Event with the API's message: {:?}",
        d.actions
    );
    let (status, _) = condition_of(&w, ConditionType::Stalled);
    assert_eq!(status, "True");
    assert!(
        !w.created.contains(&a(2)),
        "no attempt before the settlement lands"
    );
    // The next reconcile sends it again: the stall stands until it lands
    // (cleared and set again, it would write the status twice a reconcile,
    // each write waking the next).
    w.refused.clear();
    let d = w.decide();
    assert!(
        d.actions
            .iter()
            .any(|a| matches!(a, Action::SettleCall { .. })),
        "{:?}",
        d.actions
    );
    let stalled = d
        .status
        .conditions
        .iter()
        .find(|c| c.type_ == ConditionType::Stalled.as_str())
        .map(|c| c.status.clone());
    assert_eq!(
        stalled.as_deref(),
        Some("True"),
        "still stalled while it is sent again"
    );
    // The cause goes away: the settlement lands, the stall clears, attempt 2 runs.
    w.refused.clear();
    w.advance(5);
    w.settle();
    assert!(
        w.pods.contains_key(&a(2)),
        "{:?}",
        cp(&w, "refund", 1).message
    );
    assert_eq!(condition_of(&w, ConditionType::Stalled).0, "False");
}
