//! A leader paused past its Lease and resumed after a takeover acts on a stale
//! cache: it creates no Pod for an attempt its successor closed, and leaves alone a
//! Reconcile approval its successor asked.

use std::collections::BTreeMap;
use std::time::Duration;

use agentrun_e2e::ledger::{LedgerEvent, Outcome};
use agentrun_e2e::support::scenario::{Scenario, phase, sim_step, status};
use agentrun_operator::api::{Approval, RunPhase, StepPhase};
use agentrun_operator::labels;
use kube::ResourceExt;
use kube::api::{DeleteParams, EvictParams};
use serde_json::json;

use super::{Pair, RUN, TIMEOUT};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_leader_resumed_after_a_takeover_creates_no_pod_for_a_closed_attempt() {
    let s = Scenario::start_without_operator("paused-leader").await;
    let mut pair = Pair::start(&s).await;

    // Six Idempotent steps; the first attempts of s2 and s4 run until they are
    // disrupted (however long the takeover takes), their second ones succeed.
    let steps: Vec<_> = (1..=6)
        .map(|i| {
            let sim = if i == 2 || i == 4 {
                json!({"attempts": [{"hang": true}, {"runMs": 500}]})
            } else {
                json!({"runMs": 500})
            };
            sim_step(&format!("s{i}"), "Idempotent", sim)
        })
        .collect();
    s.create_run(RUN, json!({"steps": steps})).await;

    // Round 1: pause A while s2 runs, evict s2's Pod once B leads.
    // Round 2: pause B while s4 runs, delete s4's Pod once A leads.
    let mut fence_hits = 0;
    for (leader, standby, step, evict) in [(0usize, 1usize, "s2", true), (1, 0, "s4", false)] {
        let (_, pod) = s.wait_step_running(RUN, step, TIMEOUT).await;
        let paused = pair.pause(leader, standby, &["/agentruns"]).await;

        // Attempt 1 is disrupted while its leader sleeps; the new leader closes it.
        if evict {
            s.pods()
                .evict(&pod, &EvictParams::default())
                .await
                .expect("eviction accepted");
        } else {
            s.pods()
                .delete(&pod, &DeleteParams::default())
                .await
                .expect("delete accepted");
        }
        s.wait_run(RUN, &format!("{step} attempt 2 succeeded"), TIMEOUT, |r| {
            status(r)
                .steps
                .iter()
                .any(|c| c.name == step && c.attempt == 2 && c.phase == StepPhase::Succeeded)
        })
        .await;

        // Wake the deposed leader with its stale cache; it must step down.
        let after = pair.resume(leader, paused).await;
        fence_hits += after.matches("the run moved on since the decision").count();
    }

    let run = s.wait_finished(RUN, TIMEOUT).await;
    assert_eq!(phase(&run), Some(RunPhase::Succeeded), "{:?}", run.status);
    // The last Pods' outcomes are in; let their finished lines land.
    tokio::time::sleep(Duration::from_millis(500)).await;
    // How often the resumed leaders' creations were stopped by the quorum
    // read (debug log): what this scenario exercises, not what it asserts.
    eprintln!("resumed leaders: {fence_hits} Pod creations fenced by a quorum read");

    // The ledger: per (step, attempt), how often it ran and how it ended.
    let ledger = s.ledger();
    let mut runs: BTreeMap<(String, u32), Vec<Option<Outcome>>> = BTreeMap::new();
    for e in ledger.executions() {
        let outcome = ledger
            .for_pod(&e.uid)
            .find(|f| f.event == LedgerEvent::Finished)
            .and_then(|f| f.outcome);
        runs.entry((e.step.clone().unwrap_or_default(), e.attempt.unwrap_or(0)))
            .or_default()
            .push(outcome);
    }
    let k = |s: &str, a: u32| (s.to_owned(), a);
    let expected: BTreeMap<(String, u32), Vec<Option<Outcome>>> = BTreeMap::from([
        (k("s1", 1), vec![Some(Outcome::Succeeded)]),
        (k("s2", 1), vec![Some(Outcome::Killed)]),
        (k("s2", 2), vec![Some(Outcome::Succeeded)]),
        (k("s3", 1), vec![Some(Outcome::Succeeded)]),
        (k("s4", 1), vec![Some(Outcome::Killed)]),
        (k("s4", 2), vec![Some(Outcome::Succeeded)]),
        (k("s5", 1), vec![Some(Outcome::Succeeded)]),
        (k("s6", 1), vec![Some(Outcome::Succeeded)]),
    ]);
    assert_eq!(
        runs, expected,
        "every attempt ran exactly once, only the disrupted ones were closed without success; ledger: {:#?}",
        ledger.entries
    );
    // One key per step, the same across its attempts (D1), each succeeded once.
    let successes = ledger.successes_by_key();
    assert_eq!(successes.len(), 6, "{successes:?}");
    assert!(successes.values().all(|n| *n == 1), "{successes:?}");
    // A disrupted attempt ended before its successor started (D2).
    for step in ["s2", "s4"] {
        let of = |a: u32| {
            ledger
                .entries
                .iter()
                .find(|e| {
                    e.step.as_deref() == Some(step)
                        && e.attempt == Some(a)
                        && e.event == LedgerEvent::Finished
                })
                .unwrap_or_else(|| panic!("{step} attempt {a} has a finished line"))
                .clone()
        };
        let (first, second) = (of(1), of(2));
        assert!(
            first.finished_at.expect("finishedAt") <= second.started_at,
            "{step}: attempt 2 started at {} while attempt 1 ran until {:?}",
            second.started_at,
            first.finished_at
        );
    }

    // The Pods the API server holds: exactly one per step, of the attempt the
    // final status records; none for a closed attempt (the disrupted attempt
    // 1 Pods were released and are gone, and nobody created them again).
    let final_status = status(&run);
    let mut pods: Vec<(String, String, String)> = s
        .list_pods()
        .await
        .iter()
        .map(|p| {
            let l = p.labels();
            (
                l.get(labels::STEP).cloned().unwrap_or_default(),
                l.get(labels::ATTEMPT).cloned().unwrap_or_default(),
                p.name_any(),
            )
        })
        .collect();
    pods.sort();
    // The last checkpoint of each step is its final attempt.
    let last: BTreeMap<&str, (String, String)> = final_status
        .steps
        .iter()
        .filter(|c| c.role.is_step())
        .map(|c| {
            (
                c.name.as_str(),
                (c.attempt.to_string(), c.pod.clone().unwrap_or_default()),
            )
        })
        .collect();
    let recorded: Vec<(String, String, String)> = last
        .into_iter()
        .map(|(step, (attempt, pod))| (step.to_owned(), attempt, pod))
        .collect();
    let attempts: Vec<(&str, &str)> = pods
        .iter()
        .map(|(s, a, _)| (s.as_str(), a.as_str()))
        .collect();
    assert_eq!(
        attempts,
        [
            ("s1", "1"),
            ("s2", "2"),
            ("s3", "1"),
            ("s4", "2"),
            ("s5", "1"),
            ("s6", "1")
        ],
        "Pods: {pods:?}"
    );
    assert_eq!(
        pods, recorded,
        "the Pods are the ones the final status records"
    );

    pair.stop().await;
    s.finish().await;
}

/// A resumed leader whose run and Pod caches are from before the takeover
/// sees a Reconcile approval its successor asked (its Approval watch is
/// current) on a run that, as far as it knows, does not wait on it. It must leave it
/// alone: the question is the run's, and only a person answers it (D6).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resumed_leader_with_a_stale_run_cache_leaves_a_live_reconcile_approval_alone() {
    let s = Scenario::start_without_operator("stale-reconcile").await;
    let mut pair = Pair::start(&s).await;
    // One NonIdempotent step: attempt 1 runs until disrupted, attempt 2 succeeds.
    let sim = json!({"attempts": [{"hang": true}, {"runMs": 300}]});
    s.create_run(
        RUN,
        json!({"steps": [sim_step("charge", "NonIdempotent", sim)]}),
    )
    .await;
    let (_, pod) = s.wait_step_running(RUN, "charge", TIMEOUT).await;
    // Its runs and Pods caches stay as they were (attempt 1 running); only
    // its Approval watch is current.
    let paused = pair.pause(0, 1, &["/agentruns", "/pods"]).await;
    s.pods()
        .evict(&pod, &EvictParams::default())
        .await
        .expect("eviction accepted");
    // operator-b asks a person whether the charge happened.
    let waiting = s
        .wait_run(RUN, "waiting for a Reconcile decision", TIMEOUT, |r| {
            status(r)
                .steps
                .iter()
                .any(|c| c.name == "charge" && c.phase == StepPhase::WaitingForApproval)
        })
        .await;
    let question = status(&waiting)
        .steps
        .iter()
        .find(|c| c.name == "charge")
        .and_then(|c| c.approval.clone())
        .expect("the checkpoint names its approval");
    agentrun_e2e::wait_for(
        &s.approvals(),
        &question,
        |a: Option<&Approval>| a.is_some(),
        TIMEOUT,
    )
    .await;
    pair.resume(0, paused).await;

    let approvals: Vec<Approval> = s
        .approvals()
        .list(&Default::default())
        .await
        .expect("listing approvals")
        .items;
    let seen: Vec<(String, String, String)> = approvals
        .iter()
        .map(|a| {
            (
                a.name_any(),
                format!("{:?}", a.spec.kind),
                a.status
                    .as_ref()
                    .map(|st| format!("{:?}: {}", st.phase, st.message.clone().unwrap_or_default()))
                    .unwrap_or_else(|| "no status".into()),
            )
        })
        .collect();
    assert_eq!(
        seen.len(),
        1,
        "one question, the Reconcile one, and nothing else was asked: {seen:#?}"
    );
    assert_eq!(seen[0].0, question, "{seen:#?}");
    assert_eq!(seen[0].1, "Reconcile", "{seen:#?}");
    assert!(
        !seen[0].2.starts_with("Superseded"),
        "the deposed leader superseded the live Reconcile approval: {seen:#?}"
    );

    // A person checks the payment system: not charged; run it again.
    s.decide(&question, "Retry", "checked: no charge with this key")
        .await;
    let run = s.wait_finished(RUN, TIMEOUT).await;
    assert_eq!(phase(&run), Some(RunPhase::Succeeded), "{:?}", run.status);
    tokio::time::sleep(Duration::from_millis(500)).await;
    let outcomes: Vec<(u32, Option<Outcome>)> = {
        let ledger = s.ledger();
        ledger
            .executions()
            .map(|e| {
                (
                    e.attempt.unwrap_or(0),
                    ledger
                        .for_pod(&e.uid)
                        .find(|f| f.event == LedgerEvent::Finished)
                        .and_then(|f| f.outcome),
                )
            })
            .collect()
    };
    assert_eq!(
        outcomes,
        [(1, Some(Outcome::Killed)), (2, Some(Outcome::Succeeded))],
        "charged at most once more, and only after the Retry"
    );
    pair.stop().await;
    s.finish().await;
}
